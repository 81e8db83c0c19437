//! `vrdma-bench`: perftest-like measurements of the whole vrdma path —
//! guest driver → hostd → peer, vdev serving the control plane — between
//! process-mode tenants, each against baselines measured in the same run
//! on the same machine at their best: TCP loopback (blocking and
//! busy-polling), a shared-memory ping-pong (direct and relayed), memcpy.
//! It ends with every target of docs/performance.md against this run.
//!
//! The daemons (`hostd`, one `vdev` per tenant) run as separate processes
//! on unix sockets in a scratch directory; the tenants are vhost-user
//! frontends in this process, each side of a test on its own thread.

mod baselines;
mod conn_rate;
mod cores;
mod cross;
mod cross_floor;
mod cross_ud;
mod host;
mod hostd_cost;
mod latency;
mod netns;
mod reg_mr;
mod report;
mod restart;
mod scale;
mod sharing;
mod throughput;

use std::time::Duration;

use clap::{Parser, ValueEnum};
use vrdma_errors::error_chain;
use vrdma_guest_driver::PostError;
use vrdma_spec::verbs::{SendOpcode, WcStatus};
use vrdma_tools::supervisor;

use host::Host;
use report::Targets;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Test {
    WriteLat,
    ReadLat,
    SendLat,
    WriteBw,
    ReadBw,
    SendBw,
    MsgRate,
    RegMr,
    /// Many tenants with many QPs each against two, then the daemons' CPU
    /// when idle.
    Scale,
    /// Latency of a realtime tenant while a normal tenant floods, against
    /// the same without a policy (everyone normal).
    Isolation,
    /// Bandwidth shares of two flooding normal tenants weighted 1:3.
    Weights,
    /// Connection setup rate through rdma_cm (Debian's cmtime on the
    /// drop-in librdmacm, 1,000 connections) against TCP's.
    ConnRate,
    /// The longest gap between an application's completions while its
    /// device's vdev is SIGKILLed and restarted, and while hostd is
    /// upgraded by handover, against the same traffic without either (and
    /// hostd SIGKILLed and restarted, for comparison).
    Restart,
}

impl Test {
    /// What `--cross-host` makes of this test, if anything.
    fn across_hosts(self) -> Option<cross::Measure> {
        Some(match self {
            Test::WriteLat => cross::Measure::Latency,
            Test::WriteBw => cross::Measure::Bandwidth,
            Test::MsgRate => cross::Measure::MessageRate,
            Test::Restart => cross::Measure::Handover,
            Test::ConnRate => cross::Measure::ConnRate,
            _ => return None,
        })
    }
}

/// The flooding tenants' operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FloodOp {
    /// RDMA WRITEs into the peer's memory region.
    Write,
    /// SENDs into receives the peer keeps posted.
    Send,
}

impl From<FloodOp> for SendOpcode {
    fn from(op: FloodOp) -> Self {
        match op {
            FloodOp::Write => SendOpcode::RdmaWrite,
            FloodOp::Send => SendOpcode::Send,
        }
    }
}

/// Measures vrdma against TCP, shared memory and memcpy on this machine.
#[derive(Debug, Parser)]
struct Args {
    /// Tests to run (all when none is given).
    #[arg(long, value_enum, value_delimiter = ',')]
    test: Vec<Test>,
    /// Message sizes in bytes of the latency and bandwidth tests.
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 65536])]
    size: Vec<usize>,
    /// Iterations of each latency test.
    #[arg(long, default_value_t = 20_000)]
    iters: usize,
    /// Bytes each bandwidth trial moves (at most 4 Mi messages).
    #[arg(long, default_value_t = 8 << 30)]
    bytes: usize,
    /// Size of the memory region the registration test registers.
    #[arg(long, default_value_t = 1 << 30)]
    reg_size: usize,
    /// Tenants of the scale test (one vdev each).
    #[arg(long, default_value_t = 64)]
    tenants: usize,
    /// QPs with traffic per tenant in the scale test.
    #[arg(long, default_value_t = 16)]
    qps_per_tenant: usize,
    /// Seconds each fleet of the scale test streams.
    #[arg(long, default_value_t = 2)]
    scale_secs: u64,
    /// Line rate (Mbit/s) of the modelled NIC port in the isolation and
    /// weights tests: below what this host's CPUs can move, so that the
    /// port, as on a real NIC, is the resource tenants contend for.
    #[arg(long, default_value_t = 10_000)]
    line_rate_mbps: u32,
    /// Message size of the flooding tenant in the isolation test.
    #[arg(long, default_value_t = 65536)]
    flood_size: usize,
    /// An argument for every hostd the bench starts (repeat for more), e.g.
    /// `--hostd-arg=--datapath-threads=2`.
    #[arg(long, allow_hyphen_values = true)]
    hostd_arg: Vec<String>,
    /// Where the threads run: hostd's datapath on a core of its own and
    /// the tenants on the others, or everything where the kernel puts it.
    #[arg(long, value_enum, default_value_t = cores::Layout::Dedicated)]
    layout: cores::Layout,
    /// What the flooding tenants send in the isolation and weights tests.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [FloodOp::Write, FloodOp::Send])]
    flood_op: Vec<FloodOp>,
    /// Measures across hosts instead: two network namespaces joined by a
    /// veth pair, a hostd in each ([fabric]), against TCP between them
    /// (needs root). `--iters` and `--layout` apply.
    #[arg(long)]
    cross_host: bool,
    /// Bytes each 64 KiB WRITE trial across hosts moves.
    #[arg(long, default_value_t = 2 << 30)]
    cross_bytes: usize,
    /// Seconds each TCP stream and message-rate trial across hosts runs.
    #[arg(long, default_value_t = 2)]
    cross_secs: u64,
    /// The hostds' packet paths measured across hosts, one after the
    /// other in the same run (each against TCP again).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [cross::PacketIo::Udp, cross::PacketIo::AfXdp])]
    packet_io: Vec<cross::PacketIo>,
}

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error(transparent)]
    Daemon(#[from] supervisor::Error),
    #[error("Cannot open tenant {tenant}'s device")]
    Open {
        tenant: String,
        #[source]
        source: vrdma_guest_driver::Error,
    },
    #[error("Cannot {what}")]
    Verbs {
        what: &'static str,
        #[source]
        source: vrdma_guest_driver::Error,
    },
    #[error("Cannot post work request {}", .0.bad_wr)]
    Post(#[source] PostError),
    #[error("A work request completed with {0:?}")]
    Completion(WcStatus),
    #[error("Cannot measure {what}")]
    Baseline {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot read the CPU time of process {pid}")]
    Cpu {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot place the bench's threads on their CPUs")]
    Cores(#[source] std::io::Error),
    #[error("Cannot {what}: {detail}")]
    Setup { what: String, detail: String },
    #[error("A benchmark thread panicked")]
    Panicked,
}

type Result<T, E = BenchError> = std::result::Result<T, E>;

/// Maps a driver error to the verb that failed.
fn verbs(what: &'static str) -> impl FnOnce(vrdma_guest_driver::Error) -> BenchError {
    move |source| BenchError::Verbs { what, source }
}

/// How `main` fails: the error chain, once.
struct Failed(BenchError);

impl std::fmt::Debug for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "vrdma-bench: {}", error_chain(&self.0))
    }
}

impl From<BenchError> for Failed {
    fn from(e: BenchError) -> Self {
        Failed(e)
    }
}

fn main() -> Result<(), Failed> {
    let args = Args::parse();
    host::set_extra_hostd_args(args.hostd_arg.clone());
    let command: Vec<String> = std::env::args().collect();
    println!("vrdma-bench: {}", command.join(" "));
    if args.cross_host {
        cores::choose(args.layout).map_err(BenchError::Cores)?;
        match cores::datapath_cpu() {
            Some(cpu) => println!(
                "vrdma-bench: across hosts; both hostds on CPU {cpu} (not told it is theirs), the tenants on the others"
            ),
            None => println!("vrdma-bench: across hosts; every thread where the kernel puts it"),
        }
        let mut targets = Targets::default();
        let params = cross::Params {
            iters: args.iters,
            bytes: args.cross_bytes,
            secs: Duration::from_secs(args.cross_secs),
            packet_io: args.packet_io.clone(),
            only: (args.test.iter())
                .filter_map(|t| t.across_hosts())
                .collect(),
        };
        if params.only.is_empty() && !args.test.is_empty() {
            return Err(BenchError::Setup {
                what: "measure that across hosts".into(),
                detail:
                    "--cross-host measures write-lat, write-bw, msg-rate, restart and conn-rate"
                        .into(),
            }
            .into());
        }
        cross::run(params, &mut targets)?;
        print!("{}", targets.summary());
        return Ok(());
    }
    cores::choose(args.layout).map_err(BenchError::Cores)?;
    match cores::datapath_cpu() {
        Some(cpu) => {
            println!("vrdma-bench: hostd's datapath on CPU {cpu}, the tenants on the others")
        }
        None => println!("vrdma-bench: every thread where the kernel puts it"),
    }
    let tests = if args.test.is_empty() {
        Test::value_variants().to_vec()
    } else {
        args.test.clone()
    };
    let mut targets = Targets::default();
    run(&args, &tests, &mut targets)?;
    print!("{}", targets.summary());
    Ok(())
}

/// What a baseline's I/O error means: `what` could not be measured.
fn baseline(what: &'static str) -> impl FnOnce(std::io::Error) -> BenchError {
    move |source| BenchError::Baseline { what, source }
}

fn run(args: &Args, tests: &[Test], targets: &mut Targets) -> Result<()> {
    // The two-tenant tests share one hostd on its embedded default policy.
    let two_tenant = |t: &Test| {
        !matches!(
            t,
            Test::Scale | Test::Isolation | Test::Weights | Test::Restart
        )
    };
    if tests.iter().any(two_tenant) {
        let host = Host::start(Some(host::BENCH_POLICY), &[])?;
        let a = host.tenant("alpha")?;
        let b = host.tenant("beta")?;
        println!(
            "vrdma-bench: hostd + 2 vdevs (separate processes), tenants alpha (GID {}) and beta (GID {})",
            std::net::Ipv6Addr::from(a.gid),
            std::net::Ipv6Addr::from(b.gid)
        );
        for &test in tests.iter().filter(|t| two_tenant(t)) {
            let latency = match test {
                Test::WriteLat => Some(latency::Kind::Write),
                Test::SendLat => Some(latency::Kind::Send),
                Test::ReadLat => Some(latency::Kind::Read),
                _ => None,
            };
            let bandwidth = match test {
                Test::WriteBw => Some(throughput::Kind::WriteBw),
                Test::ReadBw => Some(throughput::Kind::ReadBw),
                Test::SendBw => Some(throughput::Kind::SendBw),
                Test::MsgRate => Some(throughput::Kind::MsgRate),
                _ => None,
            };
            if let Some(kind) = latency {
                for &size in &args.size {
                    latency::run(kind, &a, &b, size, args.iters, targets)?;
                }
            } else if let Some(kind) = bandwidth {
                let sizes = if kind == throughput::Kind::MsgRate {
                    &[64][..]
                } else {
                    &args.size
                };
                for &size in sizes {
                    throughput::run(kind, &a, &b, size, args.bytes, targets)?;
                }
            } else if test == Test::RegMr {
                reg_mr::run(&host, args.reg_size)?;
                reg_mr::run_app_memory(&a)?;
            } else if test == Test::ConnRate {
                let ends = conn_rate::Ends {
                    label: "same host",
                    server: (&a, None),
                    client: (&b, None),
                    hostds: vec![host.admin_socket()],
                    host_side: vec![host.hostd_pid(), a.vdev_pid(), b.vdev_pid()],
                };
                let tcp = std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 7481);
                let baseline = || conn_rate::tcp_setup_rate(tcp, None, None);
                conn_rate::run(&ends, baseline, 7482, targets)?;
            }
        }
    }
    // These start hostds of their own.
    if tests.contains(&Test::Restart) {
        restart::run(targets)?;
    }
    if tests.contains(&Test::Scale) {
        let secs = Duration::from_secs(args.scale_secs);
        scale::run(args.tenants, args.qps_per_tenant, secs, targets)?;
    }
    for &op in &args.flood_op {
        if tests.contains(&Test::Isolation) {
            let iters = args.iters.min(5000);
            let (mbps, size) = (args.line_rate_mbps, args.flood_size);
            sharing::isolation(iters, mbps, size, op.into(), targets)?;
        }
        if tests.contains(&Test::Weights) {
            sharing::weights(args.line_rate_mbps, op.into(), targets)?;
        }
    }
    Ok(())
}
