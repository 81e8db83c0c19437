//! `vrdma-bench`: perftest-like measurements of the whole vrdma path —
//! guest driver → vdev → hostd → peer — between two process-mode tenants,
//! with baselines measured in the same run on the same machine: a
//! single-thread memcpy of the same size (the bandwidth a copy can reach)
//! and a TCP loopback ping-pong (what a tenant would use without RDMA).
//!
//! The daemons (`hostd`, two `vdev`s) run as separate processes on unix
//! sockets in a scratch directory; the two tenants are two vhost-user
//! frontends in this process, each driven by its own thread.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use vrdma_guest_driver::error::chain;
use vrdma_guest_driver::{MemoryRegion, QueuePair, RecvWr, SendPayload, SendWr, WorkCompletion};
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::{access, SendOpcode, WcStatus};
use vrdma_tools::supervisor::{self, find_binary, Daemon, Launch, Scratch};
use vrdma_tools::verbs::{bring_up, default_caps, Connection, Opened};
use vrdma_tools::vmm::{self, Vmm};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Test {
    WriteLat,
    ReadLat,
    SendLat,
    WriteBw,
    ReadBw,
    MsgRate,
    RegMr,
    /// Latency of a realtime tenant while a normal tenant floods, against
    /// the same without a policy (everyone normal).
    Isolation,
    /// Bandwidth shares of two flooding normal tenants weighted 1:3.
    Weights,
}

/// Measures vrdma against memcpy and TCP loopback on this machine.
#[derive(Debug, Parser)]
struct Args {
    /// Tests to run (all when none is given).
    #[arg(long, value_enum, value_delimiter = ',')]
    test: Vec<Test>,
    /// Message sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 65536])]
    size: Vec<usize>,
    /// Iterations of each latency test.
    #[arg(long, default_value_t = 10_000)]
    iters: usize,
    /// Bytes each bandwidth test moves.
    #[arg(long, default_value_t = 1 << 30)]
    bytes: usize,
    /// Size of the memory region the registration test registers.
    #[arg(long, default_value_t = 1 << 30)]
    reg_size: usize,
    /// Line rate (Mbit/s) of the modelled NIC port in the isolation and
    /// weights tests: below what this host's CPUs can move, so that the
    /// port, as on a real NIC, is the resource tenants contend for.
    #[arg(long, default_value_t = 10_000)]
    line_rate_mbps: u32,
    /// Message size of the flooding tenant in the isolation test.
    #[arg(long, default_value_t = 65536)]
    flood_size: usize,
    /// What the flooding tenant sends in the isolation test.
    #[arg(long, value_enum, default_value_t = FloodOp::Write)]
    flood_op: FloodOp,
}

/// The flooding tenant's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FloodOp {
    /// RDMA WRITEs into the peer's memory region.
    Write,
    /// SENDs into receives the peer keeps posted.
    Send,
}

const RW: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
/// Work requests in flight in the bandwidth tests.
const WINDOW: usize = 64;
/// Work requests posted with one `post_send` (one doorbell at most).
const POST_BATCH: usize = 16;
/// Bandwidth trials; the best is reported, for vrdma and memcpy alike.
const TRIALS: usize = 3;
/// How long to let the daemons' pollers fall asleep before measuring TCP,
/// so that TCP runs on an otherwise idle machine, as a user would see it.
const SETTLE: Duration = Duration::from_millis(20);

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
}

/// How `main` fails: the error chain, once.
struct Failed(BenchError);

impl std::fmt::Debug for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "vrdma-bench: {}", chain(&self.0))
    }
}

impl From<BenchError> for Failed {
    fn from(e: BenchError) -> Self {
        Failed(e)
    }
}

/// hostd and the vdevs of one measurement, as separate processes in a
/// scratch directory. Fields drop in order: hostd before its directory.
struct Host {
    hostd: Daemon,
    vdev: std::path::PathBuf,
    dir: Scratch,
    vdevs: std::cell::Cell<u32>,
}

impl Host {
    /// hostd with `args`, on `policy` (or its embedded default one).
    fn start(policy: Option<&str>, args: &[&str]) -> Result<Self, BenchError> {
        let dir = Scratch::new("bench")?;
        let hostd = find_binary("hostd", "vrdma-hostd")?;
        let mut launch = Launch::hostd(&hostd, dir.path()).args(args);
        if let Some(policy) = policy {
            launch = launch
                .arg("--policy")
                .arg(dir.write("policy.toml", policy)?);
        }
        Ok(Self {
            hostd: launch.start()?,
            vdev: find_binary("vdev", "vrdma-vdev")?,
            dir,
            vdevs: std::cell::Cell::new(0),
        })
    }

    /// A vdev for `tenant` attached to hostd.
    fn vdev(&self, tenant: &str, args: &[&str]) -> Result<Daemon, BenchError> {
        let n = self.vdevs.replace(self.vdevs.get() + 1);
        let launch = Launch::vdev(
            &self.vdev,
            self.dir.path(),
            tenant,
            Some(self.hostd.socket()),
        );
        Ok(launch.file(&format!("{tenant}-{n}")).args(args).start()?)
    }

    /// A vdev for `tenant` and its device, opened.
    fn tenant(&self, tenant: &str, args: &[&str]) -> Result<Tenant, BenchError> {
        let vdev = self.vdev(tenant, args)?;
        let dev = Opened::open(vdev.socket(), 1024).map_err(|source| BenchError::Open {
            tenant: tenant.into(),
            source,
        })?;
        Ok(Tenant { dev, _vdev: vdev })
    }
}

/// A tenant's device, opened, and the vdev serving it (fields drop in
/// order: the device first).
struct Tenant {
    dev: Opened,
    _vdev: Daemon,
}

impl std::ops::Deref for Tenant {
    type Target = Opened;
    fn deref(&self) -> &Opened {
        &self.dev
    }
}

fn main() -> Result<(), Failed> {
    let args = Args::parse();
    let tests = if args.test.is_empty() {
        vec![
            Test::WriteLat,
            Test::ReadLat,
            Test::SendLat,
            Test::WriteBw,
            Test::ReadBw,
            Test::MsgRate,
            Test::RegMr,
            Test::Isolation,
            Test::Weights,
        ]
    } else {
        args.test.clone()
    };
    // These two start hostds of their own, with a policy each.
    if tests.contains(&Test::Isolation) {
        isolation_under_load(
            args.iters.min(5000),
            args.line_rate_mbps,
            args.flood_size,
            args.flood_op,
        )?;
    }
    if tests.contains(&Test::Weights) {
        weighted_shares(args.line_rate_mbps)?;
    }
    let tests: Vec<Test> = tests
        .into_iter()
        .filter(|t| !matches!(t, Test::Isolation | Test::Weights))
        .collect();
    if tests.is_empty() {
        return Ok(());
    }
    let host = Host::start(None, &[])?;
    let a = host.tenant("alpha", &[])?;
    let b = host.tenant("beta", &[])?;
    println!("vrdma-bench: hostd + 2 vdevs (separate processes), tenants alpha (LID {}) and beta (LID {})", a.lid, b.lid);
    println!(
        "{:<10} {:>8} {:>12} {:>12} {:>14} {:>14} {:>10}",
        "test", "size", "p50", "p99", "bandwidth", "baseline", "ratio"
    );
    for test in tests {
        if test == Test::RegMr {
            reg_mr(&host, args.reg_size)?;
            continue;
        }
        for &size in &args.size {
            match test {
                Test::WriteLat | Test::SendLat | Test::ReadLat => {
                    latency(test, &a, &b, size, args.iters)
                }
                Test::WriteBw | Test::ReadBw | Test::MsgRate => {
                    let size = if test == Test::MsgRate { 64 } else { size };
                    bandwidth(test, &a, &b, size, args.bytes);
                    if test == Test::MsgRate {
                        break;
                    }
                }
                Test::RegMr | Test::Isolation | Test::Weights => {}
            }
        }
    }
    Ok(())
}

/// p50 and p99 of `samples` (sorted in place).
fn percentiles(samples: &mut [Duration]) -> (Duration, Duration) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.99))
}

fn us(d: Duration) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6)
}

/// A connected QP pair with a buffer on each side.
struct Link<'t> {
    qa: QueuePair,
    qb: QueuePair,
    ma: MemoryRegion,
    mb: MemoryRegion,
    a: &'t Tenant,
    b: &'t Tenant,
}

fn link<'t>(a: &'t Tenant, b: &'t Tenant, size: usize) -> Link<'t> {
    let qa = a.rc_qp(default_caps()).expect("QP on alpha");
    let qb = b.rc_qp(default_caps()).expect("QP on beta");
    bring_up(&qa, qb.qp_num(), b.lid, Connection::default()).expect("connect alpha's QP");
    bring_up(&qb, qa.qp_num(), a.lid, Connection::default()).expect("connect beta's QP");
    let len = (2 * size).max(4096);
    let ma = a.pd.alloc_mr(len, RW).expect("MR on alpha");
    let mb = b.pd.alloc_mr(len, RW).expect("MR on beta");
    Link {
        qa,
        qb,
        ma,
        mb,
        a,
        b,
    }
}

fn drain(cq: &vrdma_guest_driver::CompletionQueue, want: usize) {
    let mut got = 0;
    let mut wcs = [WorkCompletion::default(); 32];
    while got < want {
        let n = cq.poll(&mut wcs).expect("poll");
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        got += n;
        if n == 0 {
            // A polling application that leaves the core to the daemons
            // when it has nothing to do: on 2 cores they need it.
            std::thread::yield_now();
        }
    }
}

fn spin_until(mr: &MemoryRegion, offset: usize, value: u8) {
    let mut byte = [0u8; 1];
    let mut spins = 0u32;
    loop {
        mr.read(offset, &mut byte).expect("read");
        if byte[0] == value {
            return;
        }
        spins += 1;
        if spins.is_multiple_of(4) {
            std::thread::yield_now();
        }
    }
}

fn latency(test: Test, a: &Tenant, b: &Tenant, size: usize, iters: usize) {
    let l = link(a, b, size);
    let mut samples = Vec::with_capacity(iters);
    let warmup = iters / 10;
    std::thread::scope(|scope| {
        let (qb, mb, ma, bq) = (&l.qb, &l.mb, &l.ma, l.b);
        if test != Test::ReadLat {
            scope.spawn(move || pong(test, qb, mb, ma, bq, size, iters + warmup));
        }
        for i in 0..iters + warmup {
            let seq = (i % 255) as u8 + 1;
            let start = Instant::now();
            ping(test, &l, size, seq, i);
            if i >= warmup {
                samples.push(start.elapsed());
            }
        }
    });
    let (p50, p99) = percentiles(&mut samples);
    // Write and send latency are half a round trip, as perftest reports them.
    let (p50, p99, halved) = if test == Test::ReadLat {
        (p50, p99, false)
    } else {
        (p50 / 2, p99 / 2, true)
    };
    std::thread::sleep(SETTLE);
    let tcp = tcp_half_rtt(size, iters.min(5000));
    let name = format!("{test:?}").to_lowercase();
    println!(
        "{:<10} {:>8} {:>12} {:>12} {:>14} {:>14} {:>10}",
        name,
        size,
        us(p50),
        us(p99),
        "",
        format!("tcp {}", us(tcp)),
        format!("{:.2}", p50.as_secs_f64() / tcp.as_secs_f64())
    );
    let _ = halved;
}

/// One iteration on the measuring side.
fn ping(test: Test, l: &Link<'_>, size: usize, seq: u8, i: usize) {
    let signal = i % 16 == 15;
    match test {
        Test::WriteLat => {
            l.ma.write(size - 1, &[seq]).expect("seq");
            post_write(&l.qa, &l.ma, &l.mb, size, signal);
            spin_until(&l.ma, 2 * size.max(1) - 1, seq);
            if signal {
                drain(&l.a.cq, 1);
            }
        }
        Test::SendLat => {
            l.qa.post_recv(&[RecvWr {
                wr_id: 0,
                sg_list: &[l.ma.sge(size as u64, size as u32)],
            }])
            .expect("recv");
            l.ma.write(size - 1, &[seq]).expect("seq");
            let sge = [l.ma.sge(0, size as u32)];
            let mut wr = SendWr::new(0, SendOpcode::Send, SendPayload::Sges(&sge));
            wr.flags = SIGNALED;
            l.qa.post_send(&[wr]).expect("send");
            drain(&l.a.cq, 2);
        }
        Test::ReadLat => {
            let sge = [l.ma.sge(0, size as u32)];
            let mut wr = SendWr::new(0, SendOpcode::RdmaRead, SendPayload::Sges(&sge));
            wr.flags = SIGNALED;
            wr.remote_addr = l.mb.iova();
            wr.rkey = l.mb.rkey();
            l.qa.post_send(&[wr]).expect("read");
            drain(&l.a.cq, 1);
        }
        _ => {}
    }
}

/// The echoing side of write_lat/send_lat.
fn pong(
    test: Test,
    qb: &QueuePair,
    mb: &MemoryRegion,
    ma: &MemoryRegion,
    b: &Tenant,
    size: usize,
    iters: usize,
) {
    for i in 0..iters {
        let seq = (i % 255) as u8 + 1;
        let signal = i % 16 == 15;
        match test {
            Test::WriteLat => {
                spin_until(mb, size - 1, seq);
                mb.write(2 * size - 1, &[seq]).expect("seq");
                // Echo into alpha's second half, last byte last.
                let sge = [mb.sge(size as u64, size as u32)];
                let mut wr = SendWr::new(0, SendOpcode::RdmaWrite, SendPayload::Sges(&sge));
                wr.remote_addr = ma.iova() + size as u64;
                wr.rkey = ma.rkey();
                wr.flags = if signal { SIGNALED } else { 0 };
                qb.post_send(&[wr]).expect("echo");
                if signal {
                    drain(&b.cq, 1);
                }
            }
            Test::SendLat => {
                qb.post_recv(&[RecvWr {
                    wr_id: 0,
                    sg_list: &[mb.sge(0, size as u32)],
                }])
                .expect("recv");
                drain(&b.cq, 1);
                let sge = [mb.sge(size as u64, size as u32)];
                let mut wr = SendWr::new(0, SendOpcode::Send, SendPayload::Sges(&sge));
                wr.flags = SIGNALED;
                qb.post_send(&[wr]).expect("send");
                drain(&b.cq, 1);
            }
            _ => {}
        }
    }
}

fn post_write(qp: &QueuePair, src: &MemoryRegion, dst: &MemoryRegion, size: usize, signal: bool) {
    let sge = [src.sge(0, size as u32)];
    let mut wr = SendWr::new(0, SendOpcode::RdmaWrite, SendPayload::Sges(&sge));
    wr.remote_addr = dst.iova();
    wr.rkey = dst.rkey();
    wr.flags = if signal { SIGNALED } else { 0 };
    qp.post_send(&[wr]).expect("write");
}

fn bandwidth(test: Test, a: &Tenant, b: &Tenant, size: usize, bytes: usize) {
    let l = link(a, b, size);
    let count = (bytes / size).max(WINDOW * 4);
    let opcode = if test == Test::ReadBw {
        SendOpcode::RdmaRead
    } else {
        SendOpcode::RdmaWrite
    };
    let sge = [l.ma.sge(0, size as u32)];
    let mut wr = SendWr::new(0, opcode, SendPayload::Sges(&sge));
    wr.remote_addr = l.mb.iova();
    wr.rkey = l.mb.rkey();
    wr.flags = SIGNALED;
    let batch = [wr; POST_BATCH];
    let trial = || {
        let start = Instant::now();
        let (mut posted, mut done) = (0, 0);
        let mut wcs = [WorkCompletion::default(); 32];
        while done < count {
            while posted < count && posted - done + POST_BATCH <= WINDOW {
                let n = POST_BATCH.min(count - posted);
                l.qa.post_send(&batch[..n]).expect("post");
                posted += n;
            }
            let n = l.a.cq.poll(&mut wcs).expect("poll");
            for wc in &wcs[..n] {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            }
            done += n;
            if n == 0 {
                std::thread::yield_now();
            }
        }
        start.elapsed()
    };
    let elapsed = (0..TRIALS).map(|_| trial()).min().unwrap_or_default();
    let rate = (count * size) as f64 / elapsed.as_secs_f64();
    let ops = count as f64 / elapsed.as_secs_f64();
    let copy = (0..TRIALS)
        .map(|_| memcpy_rate(size, (count * size).min(1 << 30)))
        .fold(0.0, f64::max);
    let name = format!("{test:?}").to_lowercase();
    println!(
        "{:<10} {:>8} {:>12} {:>12} {:>14} {:>14} {:>10}",
        name,
        size,
        format!("{:.3} Mop/s", ops / 1e6),
        "",
        format!("{:.2} GB/s", rate / 1e9),
        format!("memcpy {:.2} GB/s", copy / 1e9),
        format!("{:.2}", rate / copy)
    );
}

/// Single-thread memcpy of `size`-byte messages, bytes per second.
fn memcpy_rate(size: usize, total: usize) -> f64 {
    let src = vec![0x5au8; size];
    let mut dst = vec![0u8; size];
    let rounds = (total / size).max(1);
    let start = Instant::now();
    for i in 0..rounds {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        if i % 4096 == 0 {
            std::hint::black_box(&src);
        }
    }
    (rounds * size) as f64 / start.elapsed().as_secs_f64()
}

/// Median half round trip of a TCP loopback ping-pong of `size` bytes.
fn tcp_half_rtt(size: usize, iters: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let addr = listener.local_addr().expect("address");
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = vec![0u8; size];
        for _ in 0..iters {
            s.read_exact(&mut buf).expect("read");
            s.write_all(&buf).expect("write");
        }
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_nodelay(true).expect("nodelay");
    let mut buf = vec![1u8; size];
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        c.write_all(&buf).expect("write");
        c.read_exact(&mut buf).expect("read");
        samples.push(start.elapsed());
    }
    let _ = server.join();
    percentiles(&mut samples).0 / 2
}

/// Registration of a large region of already-shared guest memory, timed
/// at the control queue: a VMM-style frontend with a sparse memfd as guest
/// memory, vdev attached to hostd (so hostd records the key too).
fn reg_mr(host: &Host, size: usize) -> Result<(), BenchError> {
    use vrdma_spec::control::{Opcode, PdHandle, RegMrReq, RegMrResp};
    use vrdma_spec::zerocopy::IntoBytes;
    let vdev = host.vdev("alpha", &[])?;
    let mut vmm = Vmm::attach_with_memory(vdev.socket(), size + (16 << 20));
    let pd: PdHandle = vmm.ok(Opcode::AllocPd, &[]);
    let mut samples = Vec::new();
    for _ in 0..20 {
        let req = RegMrReq {
            pdn: pd.pdn,
            access: RW.into(),
            addr: vmm::FREE.into(),
            length: (size as u64).into(),
            iova: vmm::FREE.into(),
        };
        let start = Instant::now();
        let resp: RegMrResp = vmm.ok(Opcode::RegMr, req.as_bytes());
        samples.push(start.elapsed());
        let dereg = vrdma_spec::control::MrHandle {
            handle: resp.handle,
            reserved: 0.into(),
        };
        let _: () = {
            let (status, _) = vmm.command(Opcode::DeregMr, dereg.as_bytes());
            assert_eq!(status, 0, "dereg");
        };
    }
    let small = {
        let req = RegMrReq {
            pdn: pd.pdn,
            access: RW.into(),
            addr: vmm::FREE.into(),
            length: 4096.into(),
            iova: vmm::FREE.into(),
        };
        let start = Instant::now();
        let _: RegMrResp = vmm.ok(Opcode::RegMr, req.as_bytes());
        start.elapsed()
    };
    let (p50, p99) = percentiles(&mut samples);
    println!(
        "{:<10} {:>8} {:>12} {:>12} {:>14} {:>14} {:>10}",
        "reg_mr",
        format!("{}M", size >> 20),
        us(p50),
        us(p99),
        "",
        format!("4K: {}", us(small)),
        format!("{:.2}", p50.as_secs_f64() / small.as_secs_f64())
    );
    Ok(())
}

/// A policy of tenants in one network with the given classes and weights.
fn policy(tenants: &[(&str, &str, u32)]) -> String {
    tenants
        .iter()
        .map(|(name, class, weight)| {
            format!("[[tenant]]\nname = \"{name}\"\nnetwork = \"bench\"\npriority = {{ class = \"{class}\", weight = {weight} }}\n\n")
        })
        .collect()
}

/// Floods `size`-byte RDMA WRITEs from `from` into `to` until `stop`;
/// returns bytes per second.
/// Floods from `from` to `to` with `size`-byte WRITEs or SENDs (a window
/// of them in flight) until `stop`; returns the bytes/s completed.
fn flood(from: &Tenant, to: &Tenant, size: usize, op: FloodOp, stop: &AtomicBool) -> f64 {
    let l = link(from, to, size);
    let sge = [l.ma.sge(0, size as u32)];
    let opcode = match op {
        FloodOp::Write => SendOpcode::RdmaWrite,
        FloodOp::Send => SendOpcode::Send,
    };
    let mut wr = SendWr::new(0, opcode, SendPayload::Sges(&sge));
    wr.remote_addr = l.mb.iova();
    wr.rkey = l.mb.rkey();
    wr.flags = SIGNALED;
    let batch = [wr; POST_BATCH];
    let sender_done = AtomicBool::new(false);
    let recv_sge = [l.mb.sge(0, size as u32)];
    std::thread::scope(|scope| {
        if op == FloodOp::Send {
            // The peer keeps a receive posted for every SEND in flight.
            let (l, sender_done) = (&l, &sender_done);
            let recv = RecvWr {
                wr_id: 0,
                sg_list: &recv_sge,
            };
            l.qb.post_recv(&vec![recv; WINDOW]).expect("recv");
            scope.spawn(move || {
                let mut wcs = [WorkCompletion::default(); 32];
                while !sender_done.load(Ordering::Relaxed) {
                    let n = to.cq.poll(&mut wcs).expect("poll");
                    if n == 0 {
                        std::thread::yield_now();
                        continue;
                    }
                    l.qb.post_recv(&vec![recv; n]).expect("recv");
                }
            });
        }
        let (mut posted, mut done) = (0usize, 0usize);
        let mut wcs = [WorkCompletion::default(); 32];
        let start = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            if posted - done + POST_BATCH <= WINDOW {
                l.qa.post_send(&batch).expect("post");
                posted += POST_BATCH;
            }
            let n = from.cq.poll(&mut wcs).expect("poll");
            done += n;
            if n == 0 {
                std::thread::yield_now();
            }
        }
        let rate = (done * size) as f64 / start.elapsed().as_secs_f64();
        while done < posted {
            done += from.cq.poll(&mut wcs).expect("poll");
        }
        sender_done.store(true, Ordering::Relaxed);
        rate
    })
}

/// p50/p99 of `iters` 64-byte RDMA READs from `probe` to `peer`.
fn read_probe(probe: &Tenant, peer: &Tenant, iters: usize) -> (Duration, Duration) {
    let l = link(probe, peer, 64);
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let start = Instant::now();
        ping(Test::ReadLat, &l, 64, 1, 0);
        if i >= iters / 10 {
            samples.push(start.elapsed());
        }
    }
    percentiles(&mut samples)
}

/// hostd with `policy` and a port of `mbps`.
fn hostd_at_line_rate(policy: &str, mbps: u32) -> Result<Host, BenchError> {
    Host::start(Some(policy), &["--line-rate-mbps", &mbps.to_string()])
}

fn isolation_under_load(
    iters: usize,
    mbps: u32,
    flood_size: usize,
    flood_op: FloodOp,
) -> Result<(), BenchError> {
    let setups = [
        (
            "policy: probe realtime, flood normal",
            [
                ("probe", "realtime", 1),
                ("flood", "normal", 1),
                ("peer", "realtime", 1),
            ],
        ),
        (
            "no policy: everyone normal, weight 1",
            [
                ("probe", "normal", 1),
                ("flood", "normal", 1),
                ("peer", "normal", 1),
            ],
        ),
    ];
    for (label, classes) in setups {
        let hostd = hostd_at_line_rate(&policy(&classes), mbps)?;
        // The vdevs' datapath threads share this machine's two cores, the
        // case `--class-cpu-priority` is for.
        let vdev_args = ["--class-cpu-priority"];
        let probe = hostd.tenant("probe", &vdev_args)?;
        let flooder = hostd.tenant("flood", &vdev_args)?;
        let peer = hostd.tenant("peer", &vdev_args)?;
        let (alone50, alone99) = read_probe(&probe, &peer, iters);
        let stop = AtomicBool::new(false);
        let ((load50, load99), flood_rate) = std::thread::scope(|scope| {
            let f = scope.spawn(|| flood(&flooder, &peer, flood_size, flood_op, &stop));
            std::thread::sleep(Duration::from_millis(200));
            let probe_result = read_probe(&probe, &peer, iters);
            stop.store(true, Ordering::Relaxed);
            (probe_result, f.join().expect("flood thread"))
        });
        println!(
            "isolation  port {mbps} Mbit/s, {label}: probe read_lat 64 B alone p50 {} p99 {}; with a {flood_size}-byte {flood_op:?} flood ({:.2} GB/s) p50 {} p99 {}; p99 ratio {:.2}",
            us(alone50),
            us(alone99),
            flood_rate / 1e9,
            us(load50),
            us(load99),
            load99.as_secs_f64() / alone99.as_secs_f64()
        );
    }
    Ok(())
}

fn weighted_shares(mbps: u32) -> Result<(), BenchError> {
    let hostd = hostd_at_line_rate(
        &policy(&[
            ("light", "normal", 1),
            ("heavy", "normal", 3),
            ("sink", "normal", 1),
        ]),
        mbps,
    )?;
    let light = hostd.tenant("light", &[])?;
    let heavy = hostd.tenant("heavy", &[])?;
    let sink = hostd.tenant("sink", &[])?;
    let stop = AtomicBool::new(false);
    let (l, h) = std::thread::scope(|scope| {
        let l = scope.spawn(|| flood(&light, &sink, 65536, FloodOp::Write, &stop));
        let h = scope.spawn(|| flood(&heavy, &sink, 65536, FloodOp::Write, &stop));
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        (l.join().expect("light"), h.join().expect("heavy"))
    });
    println!(
        "weights    port {mbps} Mbit/s, normal 1:3 flooding 64 KiB writes for 3 s: light {:.2} GB/s, heavy {:.2} GB/s (port {:.0} % busy), heavy/light {:.2} (target 3 ± 10 %)",
        l / 1e9,
        h / 1e9,
        (l + h) * 8.0 / (f64::from(mbps) * 1e6) * 100.0,
        h / l
    );
    if (l + h) * 8.0 < 0.9 * f64::from(mbps) * 1e6 {
        println!(
            "weights    the port was not the bottleneck (the CPUs were): measure on an idle machine or with a lower --line-rate-mbps"
        );
    }
    Ok(())
}
