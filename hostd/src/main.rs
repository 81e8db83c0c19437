//! `hostd` command: parse the command line, validate the config, serve.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use vrdma_hostd::config::{Args, Config};
use vrdma_hostd::error_chain;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VRDMA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let config = match Config::try_from(Args::parse()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("hostd: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    };
    match vrdma_hostd::run(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
