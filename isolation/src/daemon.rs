//! The frame around a vrdma daemon's sandbox, the same for vdev and
//! hostd: its log, its config file, and how its `main` ends.
//!
//! - [`main`] runs a daemon's start-up: the log (`VRDMA_LOG`, default
//!   `info`, on stderr), then the configuration — refused, the daemon
//!   prints `<daemon>: <error chain>` on stderr and exits with status 2,
//!   before any socket is touched — then the daemon's own start (opening,
//!   the sandbox, serving) — failed, the error chain is logged and the
//!   status is 1.
//! - [`read_config_file`] and [`parse_config`] turn the TOML config file
//!   into the daemon's file layout, naming the file in every error
//!   ([`ConfigFileError`]).
//! - [`testing`] (cargo feature `testing`): the pieces the daemons'
//!   configuration tests share.

use std::error::Error;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::de::DeserializeOwned;
use vrdma_errors::error_chain;

#[cfg(any(test, feature = "testing"))]
pub mod testing;

/// Why a daemon's config file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("Cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Invalid config file {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
}

/// Reads the TOML config file at `path` into `T`, the daemon's layout of
/// the file (which refuses unknown keys).
pub fn read_config_file<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_config(&text, path)
}

/// Parses `text`, the config file at `path` (for errors), into `T`.
pub fn parse_config<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T, ConfigFileError> {
    toml::from_str(text).map_err(|source| ConfigFileError::Parse {
        path: path.to_owned(),
        source: Box::new(source),
    })
}

/// A daemon's `main`, named `daemon` in its messages: the log first, then
/// `configure` (the command line and config file, validated), then
/// `start` with the configuration. A failed start is logged by
/// `log_failure` with its error chain (vdev names its tenant on every log
/// line, this one too).
pub fn main<C, E: Error>(
    daemon: &str,
    configure: impl FnOnce() -> Result<C, E>,
    start: impl FnOnce(&C) -> Result<(), Box<dyn Error>>,
    log_failure: impl FnOnce(&C, &str),
) -> ExitCode {
    init_log();
    let config = match configure() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{daemon}: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    };
    match start(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log_failure(&config, &error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// The argument that asks a vrdma program for its manual page.
pub const PRINT_MANPAGE: &str = "--print-manpage";

/// With [`PRINT_MANPAGE`] as its only argument, program `name` writes its
/// manual page (roff, from its clap definition `A`: every option as
/// `--help` gives it) to stdout and is done: what the Debian package
/// ships as `man 1 <name>`. `None` for any other command line.
pub fn manpage_requested<A: clap::CommandFactory>(name: &'static str) -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != PRINT_MANPAGE || args.next().is_some() {
        return None;
    }
    let page = clap_mangen::Man::new(A::command().name(name).bin_name(name));
    Some(match page.render(&mut std::io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cannot write the manual page: {e}");
            ExitCode::FAILURE
        }
    })
}

/// The log: the `VRDMA_LOG` filter (default `info`) on stderr, in colour
/// only on a terminal.
fn init_log() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VRDMA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

#[cfg(test)]
mod tests {
    use super::testing::ScratchDir;
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Layout {
        socket: String,
    }

    #[test]
    fn errors_name_the_file() {
        let dir = ScratchDir::new("isolation-config-file");
        let path = dir.write("daemon.toml", "socket = \"/s\"\n");
        let layout: Layout = read_config_file(&path).expect("valid");
        assert_eq!(layout.socket, "/s");

        let err = parse_config::<Layout>("sockett = 1", &path).expect_err("unknown key");
        let chain = error_chain(&err);
        assert!(matches!(err, ConfigFileError::Parse { .. }));
        assert!(
            chain.starts_with(&format!("Invalid config file {}: ", path.display()))
                && chain.contains("sockett"),
            "{chain}"
        );
        let missing = dir.path().join("missing.toml");
        let err = read_config_file::<Layout>(&missing).expect_err("no file");
        assert!(matches!(err, ConfigFileError::Read { .. }));
        assert!(
            error_chain(&err)
                .starts_with(&format!("Cannot read config file {}: ", missing.display())),
            "{err}"
        );
    }
}
