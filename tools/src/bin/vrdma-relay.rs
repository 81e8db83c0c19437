//! `vrdma-relay`: the hostile network between hosts. An L2 forwarder (a
//! learning switch) between two or more interfaces that drops, duplicates,
//! reorders, delays, truncates and corrupts RoCEv2 frames (IPv4 UDP to
//! port 4791) at configured rates, deterministically from `--seed`; ARP
//! and everything else pass untouched. See `vrdma_tools::relay`.
//!
//! It runs until SIGTERM or SIGINT, then prints its counters (one line for
//! people on stderr, one JSON line on stdout); with `--stats FILE` it also
//! keeps the JSON line in FILE, rewritten every second (the file appears
//! once the sockets are open: the relay forwards from then on).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser;
use vrdma_errors::error_chain;
use vrdma_tools::relay::{self, Faults};

/// Command line of `vrdma-relay`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Forwards Ethernet frames between interfaces as a learning switch, harming RoCEv2 \
             (UDP port 4791) frames at the given rates"
)]
struct Args {
    /// An interface to forward between (at least two; each put in
    /// promiscuous mode).
    #[arg(long = "iface", required = true)]
    ifaces: Vec<String>,
    /// Chance that a RoCE frame is dropped.
    #[arg(long, default_value_t = 0.0)]
    drop: f64,
    /// Chance that a RoCE frame is sent twice.
    #[arg(long, default_value_t = 0.0)]
    dup: f64,
    /// Chance that a RoCE frame is held back and sent after the next
    /// `--reorder-gap` frames.
    #[arg(long, default_value_t = 0.0)]
    reorder: f64,
    /// How many frames overtake a reordered one.
    #[arg(long, default_value_t = 1)]
    reorder_gap: u32,
    /// How long a reordered frame waits at most for frames to overtake it.
    #[arg(long, default_value_t = 10_000)]
    reorder_timeout_us: u64,
    /// How long a delayed frame is held.
    #[arg(long, default_value_t = 0)]
    delay_us: u64,
    /// Chance that a RoCE frame is delayed by `--delay-us`.
    #[arg(long, default_value_t = 0.0)]
    delay_rate: f64,
    /// Chance that a RoCE frame is cut to a random shorter UDP payload.
    #[arg(long, default_value_t = 0.0)]
    truncate: f64,
    /// Chance that one random bit of a RoCE frame's UDP payload is flipped.
    #[arg(long, default_value_t = 0.0)]
    corrupt: f64,
    /// After truncating or corrupting, rewrite the IPv4 and UDP lengths and
    /// checksums to match, so the receiver's kernel delivers the datagram
    /// and the RoCE ICRC check is what sees the harm (`=false`: the
    /// receiver's kernel drops them).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true")]
    fix_udp_checksum: bool,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// File to keep the counters in, as one JSON line rewritten every second.
    #[arg(long)]
    stats: Option<PathBuf>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// SIGTERM and SIGINT set [`STOP`]; without SA_RESTART, so the relay's
/// poll returns at once.
fn catch_signals() -> std::io::Result<()> {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: all-zero is a valid sigaction (empty mask, no flags).
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only stores to an atomic, which is
        // async-signal-safe; `action` is a valid sigaction.
        if unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let faults = Faults {
        drop: args.drop,
        dup: args.dup,
        reorder: args.reorder,
        reorder_gap: args.reorder_gap,
        reorder_timeout: Duration::from_micros(args.reorder_timeout_us),
        delay: Duration::from_micros(args.delay_us),
        delay_rate: args.delay_rate,
        truncate: args.truncate,
        corrupt: args.corrupt,
        fix_udp_checksum: args.fix_udp_checksum,
        seed: args.seed,
    };
    if let Err(e) = catch_signals() {
        eprintln!("vrdma-relay: cannot catch SIGTERM and SIGINT: {e}");
        return ExitCode::FAILURE;
    }
    match relay::run(&args.ifaces, faults, args.stats.as_deref(), &STOP) {
        Ok(stats) => {
            eprintln!(
                "vrdma-relay: {} frames in, {} out ({} flooded), {} RoCE: {} dropped, {} \
                 duplicated, {} reordered, {} delayed, {} truncated, {} corrupted; {} checksums \
                 completed, {} send errors, {} lost in socket buffers",
                stats.frames_in,
                stats.frames_out,
                stats.flooded,
                stats.roce,
                stats.dropped,
                stats.duplicated,
                stats.reordered,
                stats.delayed,
                stats.truncated,
                stats.corrupted,
                stats.checksums_completed,
                stats.send_errors,
                stats.socket_drops
            );
            println!("{}", stats.to_json());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vrdma-relay: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
