//! `vrdmactl`: asks a running hostd, over its admin socket, for its
//! tenants' stats (a table, or JSON), for Prometheus metrics, or to reload
//! its policy. Exits 0 on success, 1 when hostd reports an error (a policy
//! that does not load: the old one stays in force), 2 when hostd cannot be
//! reached or answers nonsense.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vrdma_errors::error_chain;
use vrdma_hostd::admin::{self, AdminRequest, AdminResponse};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Control a running vrdma hostd through its admin socket"
)]
struct Args {
    /// hostd's admin socket (hostd's `admin_socket`, default `<socket>.admin`).
    #[arg(long, default_value = "/run/vrdma/hostd.sock.admin")]
    admin_socket: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every tenant's counters, usage and quotas.
    Stats {
        /// Print hostd's JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// The same in the Prometheus text exposition format.
    Metrics,
    /// The RoCEv2 transport's counters per peer host: packets, bytes,
    /// retransmissions, timeouts, NAKs by kind, RTT, drops by reason.
    Peers {
        /// Print hostd's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Re-read the policy file; prints what changed, or why the file was
    /// refused (the policy in force then stays).
    Reload,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let request = match args.command {
        Command::Stats { .. } => AdminRequest::Stats,
        Command::Metrics => AdminRequest::Metrics,
        Command::Peers { .. } => AdminRequest::Peers,
        Command::Reload => AdminRequest::Reload,
    };
    let response = match admin::call(&args.admin_socket, request) {
        Ok(response) => response,
        Err(e) => {
            eprintln!("vrdmactl: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    };
    match (response, args.command) {
        (AdminResponse::Stats(stats), Command::Stats { json: true }) => {
            match serde_json::to_string_pretty(&stats) {
                Ok(text) => println!("{text}"),
                Err(e) => {
                    eprintln!("vrdmactl: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        (AdminResponse::Stats(stats), Command::Stats { json: false }) => {
            print!("{}", admin::render_table(&stats));
        }
        (AdminResponse::Metrics { text }, Command::Metrics) => print!("{text}"),
        (AdminResponse::Peers(peers), Command::Peers { json: true }) => {
            match serde_json::to_string_pretty(&peers) {
                Ok(text) => println!("{text}"),
                Err(e) => {
                    eprintln!("vrdmactl: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        (AdminResponse::Peers(peers), Command::Peers { json: false }) => {
            print!("{}", admin::render_peers(&peers));
        }
        (AdminResponse::Reloaded { file, changes }, Command::Reload) => {
            if changes.is_empty() {
                println!("Reloaded {file}: no changes");
            } else {
                println!("Reloaded {file}:");
                for change in changes {
                    println!("  {change}");
                }
            }
        }
        (AdminResponse::Error { message }, _) => {
            eprintln!("vrdmactl: hostd: {message}");
            return ExitCode::FAILURE;
        }
        (other, _) => {
            eprintln!("vrdmactl: unexpected answer {other:?}");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}
