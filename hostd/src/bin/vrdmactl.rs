//! `vrdmactl`: asks a running hostd, over its admin socket, for its
//! tenants' stats (a table, or JSON), for Prometheus metrics, for a live
//! view of the host (`top`), or to reload its policy. Exits 0 on success, 1 when hostd reports an error (a policy
//! that does not load: the old one stays in force), 2 when hostd cannot be
//! reached or answers nonsense.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use vrdma_errors::error_chain;
use vrdma_hostd::admin::{self, AdminRequest, AdminResponse};
use vrdma_hostd::stats::Stats;
use vrdma_hostd::top;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Control a running vrdma hostd through its admin socket"
)]
struct Args {
    /// hostd's admin socket (hostd's `admin_socket`, default `<socket>.admin`).
    #[arg(long, default_value = "/run/vrdma/hostd.sock.admin")]
    admin_socket: PathBuf,
    /// Print JSON instead of text (every command; before or after it).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every tenant's counters, usage and quotas.
    Stats,
    /// The same in the Prometheus text exposition format (with --json:
    /// `{"text": ...}`).
    Metrics,
    /// The RoCEv2 transport's counters per peer host: packets, bytes,
    /// retransmissions, timeouts, NAKs by kind, RTT, drops by reason.
    Peers,
    /// Re-read the policy file; prints what changed, or why the file was
    /// refused (the policy in force then stays).
    Reload,
    /// One screen of what the host is doing, refreshed: per tenant its
    /// class, devices, QPs, MRs and its rates of work, bytes, errors,
    /// refusals, drops and throttling; per peer host the transport's
    /// rates (with --json: one JSON object per refresh, a line each).
    Top {
        /// Seconds between refreshes (0.1 to 3600).
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Refreshes to show, then exit (default: until interrupted).
        #[arg(long)]
        count: Option<u64>,
    },
}

/// Exit statuses: hostd could not be reached or answered nonsense.
const UNREACHABLE: u8 = 2;

fn main() -> ExitCode {
    if let Some(done) = vrdma_isolation::daemon::manpage_requested::<Args>("vrdmactl") {
        return done;
    }
    let args = Args::parse();
    let request = match args.command {
        Command::Top { interval, count } => {
            return top(&args.admin_socket, interval, count, args.json);
        }
        Command::Stats => AdminRequest::Stats,
        Command::Metrics => AdminRequest::Metrics,
        Command::Peers => AdminRequest::Peers,
        Command::Reload => AdminRequest::Reload,
    };
    let response = match call(&args.admin_socket, request) {
        Ok(response) => response,
        Err(code) => return code,
    };
    let json = args.json;
    let printed = match (response, args.command) {
        (AdminResponse::Stats(stats), Command::Stats) if json => print_json(&stats),
        (AdminResponse::Stats(stats), Command::Stats) => {
            print!("{}", admin::render_table(&stats));
            Ok(())
        }
        (AdminResponse::Metrics { text }, Command::Metrics) if json => {
            print_json(&serde_json::json!({ "text": text }))
        }
        (AdminResponse::Metrics { text }, Command::Metrics) => {
            print!("{text}");
            Ok(())
        }
        (AdminResponse::Peers(peers), Command::Peers) if json => print_json(&peers),
        (AdminResponse::Peers(peers), Command::Peers) => {
            print!("{}", admin::render_peers(&peers));
            Ok(())
        }
        (AdminResponse::Reloaded { file, changes }, Command::Reload) if json => {
            print_json(&serde_json::json!({ "file": file, "changes": changes }))
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
            Ok(())
        }
        (AdminResponse::Error { message }, _) => {
            if json {
                // The reason on stdout for a script, and for a person.
                let _ = print_json(&serde_json::json!({ "error": message }));
            }
            eprintln!("vrdmactl: hostd: {message}");
            return ExitCode::FAILURE;
        }
        (other, _) => {
            eprintln!("vrdmactl: unexpected answer {other:?}");
            return ExitCode::from(UNREACHABLE);
        }
    };
    match printed {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vrdmactl: {e}");
            ExitCode::from(UNREACHABLE)
        }
    }
}

fn print_json(value: &impl serde::Serialize) -> Result<(), serde_json::Error> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// hostd's answer to `request`, or the exit status when it cannot be
/// reached (the reason on stderr).
fn call(socket: &std::path::Path, request: AdminRequest) -> Result<AdminResponse, ExitCode> {
    admin::call(socket, request).map_err(|e| {
        eprintln!("vrdmactl: {}", error_chain(&e));
        ExitCode::from(UNREACHABLE)
    })
}

/// The stats now, or the exit status when hostd cannot give them.
fn sample(socket: &std::path::Path) -> Result<Stats, ExitCode> {
    match call(socket, AdminRequest::Stats)? {
        AdminResponse::Stats(stats) => Ok(stats),
        other => {
            eprintln!("vrdmactl: unexpected answer {other:?}");
            Err(ExitCode::from(UNREACHABLE))
        }
    }
}

/// `vrdmactl top`: a frame per interval from consecutive samples.
fn top(socket: &std::path::Path, interval: f64, count: Option<u64>, json: bool) -> ExitCode {
    if !(0.1..=3600.0).contains(&interval) {
        eprintln!("vrdmactl: --interval {interval}: must be between 0.1 and 3600 seconds");
        return ExitCode::from(UNREACHABLE);
    }
    let clear = !json && std::io::stdout().is_terminal();
    let mut before = match sample(socket) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let mut taken = Instant::now();
    let mut shown = 0u64;
    while count.is_none_or(|n| shown < n) {
        std::thread::sleep(Duration::from_secs_f64(interval));
        let after = match sample(socket) {
            Ok(s) => s,
            Err(code) => return code,
        };
        let now = Instant::now();
        let frame = top::frame(&before, &after, now - taken);
        if json {
            match serde_json::to_string(&frame) {
                Ok(line) => println!("{line}"),
                Err(e) => {
                    eprintln!("vrdmactl: {e}");
                    return ExitCode::from(UNREACHABLE);
                }
            }
        } else {
            if clear {
                // Home and clear: the screen is redrawn, not scrolled.
                print!("\x1b[H\x1b[2J");
            }
            print!("{}", top::render(&frame));
            if !clear {
                println!();
            }
        }
        let _ = std::io::stdout().flush();
        (before, taken, shown) = (after, now, shown + 1);
    }
    ExitCode::SUCCESS
}
