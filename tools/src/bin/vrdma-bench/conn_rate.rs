//! Connection setup rate (`conn-rate`, and in `--cross-host`): Debian's
//! unmodified `cmtime` (rdmacm-utils) on vrdma's drop-in `librdmacm.so.1`,
//! its server on alpha's device, its client on beta's naming the server by
//! its device's address, [`CONNECTIONS`] RC connections at once. cmtime
//! times each step over all connections (create ID, resolve address,
//! resolve route, create QP, connect, then disconnect and destroy), one
//! step after the other; the setup rate is the connections over the sum of
//! the setup steps, the teardown rate over the sum of the other two.
//!
//! Against the kernel's TCP connection setup between the same two places
//! in the same run, at its best: [`CONNECTIONS`] blocking `connect`s one
//! after the other (on loopback and a veth each completes its handshake
//! in the kernel before it returns), all held open until the server has
//! accepted them.
//!
//! The tenants' quotas are raised for it ([`crate::host::BENCH_POLICY`],
//! and every vdev's [`crate::host::VDEV_LIMITS`]):
//! each side holds [`CONNECTIONS`] QPs at once.

use std::io;
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vrdma_tools::supervisor::{self, Scratch};

use crate::host::Tenant;
use crate::report::{Bound, Targets};
use crate::{baseline, cores, BenchError, Result};

/// Connections each cmtime run sets up at once.
pub const CONNECTIONS: usize = 1000;
/// cmtime runs; each one's figures are printed, the median checked.
const TRIALS: usize = 3;
/// The target, connections per second.
const TARGET: f64 = 2000.0;

/// Where the two cmtime processes run: on the two tenants' devices (a
/// second context of each, beside the bench's own), in their hosts'
/// network namespaces, on the tenants' CPUs — and the host's daemons
/// (`host_side`: hostds, vdevs) on the datapath's CPU meanwhile
/// ([`cores::HostSide`]), as a cloud host's control plane runs on host
/// cores, never on its tenants' vCPUs. cmtime's main thread waits for
/// each step's completions spinning on `sched_yield`: on this machine's
/// two CPUs, beside the daemons, that spinner took CPU from the very
/// threads it waited for.
pub struct Ends<'a> {
    /// `same host` or `across hosts`.
    pub label: &'static str,
    /// The server's tenant and network namespace (`None`: this one).
    pub server: (&'a Tenant, Option<PathBuf>),
    /// The client's.
    pub client: (&'a Tenant, Option<PathBuf>),
    /// The admin sockets of the hostds the connections go through, whose
    /// QP1 drops each trial reports (a dropped MAD costs a connection the
    /// CM's retry, seconds).
    pub hostds: Vec<PathBuf>,
    /// The processes of the host's side: the hostds and the two vdevs.
    pub host_side: Vec<u32>,
}

/// What the hostds at `admins` counted so far of CM MADs (`vrdmactl stats
/// --json`, every tenant's `gsi`: sent, received, dropped because a
/// device's QP1 queue was full) and of packets their transport dropped
/// (`vrdmactl peers --json`, every peer's drops by reason); `None` if a
/// hostd could not say. Over a run, MADs sent but neither received nor
/// dropped at QP1 were lost between the hostds.
#[derive(Debug, Default, Clone, Copy)]
struct Mads {
    sent: u64,
    received: u64,
    queue_full: u64,
    wire_drops: u64,
}

impl Mads {
    fn read(admins: &[PathBuf]) -> Option<Mads> {
        let mut m = Mads::default();
        for admin in admins {
            let stats = crate::host::vrdmactl_json(admin, "stats")?;
            for t in stats["tenants"].as_array()? {
                let n = |k: &str| t["gsi"][k].as_u64().unwrap_or(0);
                m.sent += n("sent");
                m.received += n("received");
                m.queue_full += n("queue_full");
            }
            let peers = crate::host::vrdmactl_json(admin, "peers")?;
            for p in peers.as_array()? {
                if let Some(drops) = p["drops"].as_object() {
                    m.wire_drops += drops
                        .values()
                        .filter_map(serde_json::Value::as_u64)
                        .sum::<u64>();
                }
            }
        }
        Some(m)
    }

    /// What changed from `before` to `self`, as the report says it.
    fn since(&self, before: &Mads) -> String {
        let (sent, received) = (self.sent - before.sent, self.received - before.received);
        let full = self.queue_full - before.queue_full;
        format!(
            "MADs dropped at QP1 {full} (sent {sent}, received {received}, lost between the hostds {}), packets the transports dropped {}",
            sent.saturating_sub(received + full),
            self.wire_drops - before.wire_drops
        )
    }
}

/// One cmtime run: milliseconds of each step over all connections.
#[derive(Debug, Default, Clone, Copy)]
struct Steps {
    create_id: f64,
    resolve_addr: f64,
    resolve_route: f64,
    create_qp: f64,
    connect: f64,
    disconnect: f64,
    destroy: f64,
}

impl Steps {
    /// From cmtime's table: `<step> : <total ms> <max ms> <min us> <us/conn>`.
    fn parse(text: &str) -> Option<Steps> {
        // The step's name is what precedes the colon ("connecting", a
        // progress line, is not "connect").
        let total = |name: &str| -> Option<f64> {
            text.lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(step, _)| step.trim() == name)?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        Some(Steps {
            create_id: total("create id")?,
            resolve_addr: total("resolve addr")?,
            resolve_route: total("resolve route")?,
            create_qp: total("create qp")?,
            connect: total("connect")?,
            disconnect: total("disconnect")?,
            destroy: total("destroy")?,
        })
    }

    fn setup_ms(&self) -> f64 {
        self.create_id + self.resolve_addr + self.resolve_route + self.create_qp + self.connect
    }

    fn teardown_ms(&self) -> f64 {
        self.disconnect + self.destroy
    }
}

/// The drop-in libraries: `libibverbs.so` beside this binary (built by
/// `cargo build --release -p vrdma-libibverbs`) under both its names.
fn shim() -> Result<Scratch> {
    let exe = std::env::current_exe().map_err(baseline("find vrdma-bench's directory"))?;
    let lib = exe
        .parent()
        .map(|d| d.join("libibverbs.so"))
        .filter(|l| l.exists())
        .ok_or_else(|| BenchError::Baseline {
            what: "find the drop-in libibverbs.so beside vrdma-bench",
            source: io::Error::new(
                io::ErrorKind::NotFound,
                "build it: cargo build --release -p vrdma-libibverbs",
            ),
        })?;
    let dir = Scratch::new("bench-shim")?;
    for name in ["libibverbs.so.1", "librdmacm.so.1"] {
        std::os::unix::fs::symlink(&lib, dir.path().join(name))
            .map_err(baseline("link the drop-in libraries"))?;
    }
    Ok(dir)
}

fn cmtime(shim: &Path, device: &Path, netns: Option<&Path>, args: &[String]) -> Result<Command> {
    let mut cmd = Command::new("cmtime");
    cmd.args(args)
        .env("LD_LIBRARY_PATH", shim)
        .env("VRDMA_DEVICES", device)
        .env_remove("VRDMA_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(netns) = netns {
        supervisor::enter_netns(&mut cmd, netns)?;
    }
    Ok(cmd)
}

/// One cmtime run between `ends` on `port`.
fn run_cmtime(shim: &Path, ends: &Ends, port: u16) -> Result<Steps> {
    let p = port.to_string();
    let (server, client) = (&ends.server, &ends.client);
    // The tenants' programs on the tenants' CPUs (this thread's), the
    // host's daemons on the host's.
    let _host = cores::HostSide::enter(&ends.host_side).map_err(BenchError::Cores)?;
    let mut server = cmtime(
        shim,
        server.0.socket(),
        server.1.as_deref(),
        &["-p".into(), p.clone()],
    )
    .and_then(|mut c| {
        c.spawn()
            .map_err(baseline("start cmtime (apt-get install rdmacm-utils)"))
    })?;
    // cmtime's server prints nothing when it listens: give it time.
    std::thread::sleep(Duration::from_millis(500));
    let args = [
        "-s".into(),
        ends.server.0.ip().to_string(),
        "-p".into(),
        p,
        "-c".into(),
        CONNECTIONS.to_string(),
    ];
    let client = cmtime(shim, client.0.socket(), client.1.as_deref(), &args)
        .and_then(|mut c| c.output().map_err(baseline("run cmtime's client")));
    // cmtime's server serves until it is killed.
    let _ = server.kill();
    let _ = server.wait();
    let client = client?;
    let text = String::from_utf8_lossy(&client.stdout);
    let errors = String::from_utf8_lossy(&client.stderr);
    match Steps::parse(&text) {
        // cmtime exits 0 and times every step even when connections
        // failed (a QP it could not create, a request rejected): those
        // are skipped, not counted, and the rate would be of fewer.
        Some(steps) if client.status.success() && failures(&text, &errors).is_none() => Ok(steps),
        _ => Err(BenchError::Baseline {
            what: "set up connections with cmtime",
            source: io::Error::other(format!(
                "cmtime's client ({}): {text}{}",
                client.status,
                String::from_utf8_lossy(&client.stderr)
            )),
        }),
    }
}

/// What in cmtime's output says a connection failed: its `perror`s
/// (`failure creating qp: ...`) and error events (`event: REJECTED,
/// error: 28`), the first of them.
fn failures<'a>(stdout: &'a str, stderr: &'a str) -> Option<&'a str> {
    let failed = |l: &&str| l.contains("failure") || l.contains("error");
    (stdout.lines().chain(stderr.lines())).find(failed)
}

/// [`CONNECTIONS`] TCP connections to `addr` (listening in
/// `server_netns`), from `client_netns`: connections per second.
pub fn tcp_setup_rate(
    addr: SocketAddrV4,
    server_netns: Option<&Path>,
    client_netns: Option<&Path>,
) -> io::Result<f64> {
    let enter = |netns: Option<&Path>| netns.map_or(Ok(()), crate::netns::enter);
    cores::on_every_cpu(|| {
        std::thread::scope(|scope| {
            let (ready, listening) = std::sync::mpsc::channel();
            let server = scope.spawn(move || -> io::Result<Vec<TcpStream>> {
                let listener = enter(server_netns).and_then(|()| {
                    let l = TcpListener::bind(addr)?;
                    // Room for every connection in the accept queue (std
                    // listens with 128): an overflow costs a SYN
                    // retransmission, a second.
                    // SAFETY: listen(2) on the listener's own open fd.
                    if unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&l), 4096) } != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(l)
                });
                let _ = ready.send(listener.is_ok());
                let listener = listener?;
                (0..CONNECTIONS).map(|_| Ok(listener.accept()?.0)).collect()
            });
            let client = scope.spawn(move || -> io::Result<f64> {
                if !listening.recv().unwrap_or(false) {
                    return Err(io::Error::other("the TCP server could not listen"));
                }
                enter(client_netns)?;
                let start = Instant::now();
                let held: Vec<TcpStream> = (0..CONNECTIONS)
                    .map(|_| TcpStream::connect(addr))
                    .collect::<io::Result<_>>()?;
                let took = start.elapsed();
                drop(held);
                Ok(CONNECTIONS as f64 / took.as_secs_f64())
            });
            let rate = client
                .join()
                .map_err(|_| io::Error::other("the TCP client panicked"))?;
            let accepted = server
                .join()
                .map_err(|_| io::Error::other("the TCP server panicked"))?;
            accepted.map(drop)?;
            rate
        })
    })?
}

/// Measures the setup rate between `ends` against `tcp` (the baseline's
/// connections per second, measured here between the same places) and
/// checks the target.
pub fn run(
    ends: &Ends,
    tcp: impl Fn() -> io::Result<f64>,
    port: u16,
    targets: &mut Targets,
) -> Result<()> {
    let shim = shim()?;
    let mut setups = Vec::with_capacity(TRIALS);
    for trial in 0..TRIALS {
        let tcp_rate = tcp().map_err(baseline("set up TCP connections"))?;
        let before = Mads::read(&ends.hostds);
        let steps = run_cmtime(shim.path(), ends, port + trial as u16)?;
        let mads = match (before, Mads::read(&ends.hostds)) {
            (Some(b), Some(a)) => a.since(&b),
            _ => "MADs: the hostds could not say".to_owned(),
        };
        let setup = CONNECTIONS as f64 / (steps.setup_ms() / 1000.0);
        let teardown = CONNECTIONS as f64 / (steps.teardown_ms() / 1000.0);
        println!(
            "conn_rate  {}: {CONNECTIONS} RC connections (cmtime) set up at {setup:.0}/s \
             (ms: id {:.1} addr {:.1} route {:.1} qp {:.1} connect {:.1}), torn down at \
             {teardown:.0}/s, {mads} | TCP {tcp_rate:.0}/s | ratio {:.2}",
            ends.label,
            steps.create_id,
            steps.resolve_addr,
            steps.resolve_route,
            steps.create_qp,
            steps.connect,
            setup / tcp_rate,
        );
        setups.push(setup);
    }
    setups.sort_by(f64::total_cmp);
    let median = setups[setups.len() / 2];
    targets.check(
        format!(
            "{} connection setup (cmtime, {CONNECTIONS}), median of {TRIALS}",
            ends.label
        ),
        median,
        "conn/s",
        Bound::AtLeast(TARGET),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_cmtime_could_not_make_fails_the_run() {
        let table = "step              total ms     max ms     min us  us / conn\n\
                     connect        :     133.50       1.00      10.00     133.50\n";
        assert_eq!(super::failures(table, ""), None);
        let rejected = format!("{table}event: REJECTED, error: 28\n");
        assert_eq!(
            super::failures(&rejected, ""),
            Some("event: REJECTED, error: 28")
        );
        let no_qp = "failure creating qp: Cannot allocate memory\n";
        assert_eq!(super::failures(table, no_qp), Some(no_qp.trim_end()));
    }

    #[test]
    fn cmtime_table_is_read_step_by_step() {
        let text = "creating id\nconnecting\n\
step              total ms     max ms     min us  us / conn\n\
create id    :        0.50       0.06       0.00       0.50\n\
resolve addr :      175.91     100.03     134.00     175.91\n\
resolve route:       57.23      49.01     170.00      57.23\n\
create qp    :      162.66       2.39      85.00     162.66\n\
connect      :      228.87     187.18    8599.00     228.87\n\
disconnect   :       91.72       2.64     677.00      91.72\n\
destroy      :       14.44       3.24       4.00      14.44\n";
        let s = Steps::parse(text).expect("a table");
        assert_eq!(s.resolve_route, 57.23);
        assert!((s.setup_ms() - 625.17).abs() < 1e-9, "{}", s.setup_ms());
        assert!((s.teardown_ms() - 106.16).abs() < 1e-9);
        assert!(Steps::parse("connecting\n").is_none());
    }
}
