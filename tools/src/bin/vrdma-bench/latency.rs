//! Latency, as perftest's `ib_write_lat`, `ib_send_lat` and `ib_read_lat`
//! measure it: a ping-pong between two tenants, each side on its own
//! thread busy-polling (its buffer for WRITEs, its CQ for SENDs); WRITE
//! and SEND report half the round trip, READ the whole of it. Every 16th
//! work request is signaled, as a latency-minded application does.

use std::time::{Duration, Instant};

use vrdma_guest_driver::{CompletionQueue, QueuePair, RecvWr, SendPayload, SendWr, WorkCompletion};
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::SendOpcode;

use crate::baselines::{self, pause, pause_every, Tcp};
use crate::cores::{self, SHARED_YIELD_EVERY};
use crate::host::{poll_ok, Buffer, Link, Tenant};
use crate::report::{percentiles, us, Bound, Targets};
use crate::{BenchError, Result};

/// Latency test kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Write,
    Send,
    Read,
}

/// One work request in this many is signaled.
const SIGNAL_EVERY: usize = 16;
/// Send slots of each QP.
const SEND_WR: u32 = 64;
/// Fewest ping-pongs of warm-up.
const WARMUP_ITERS: usize = 20_000;

/// Measures `kind` with `size`-byte messages against the baselines and
/// prints one line; 64-byte WRITEs are checked against their targets.
pub fn run(
    kind: Kind,
    a: &Tenant,
    b: &Tenant,
    size: usize,
    iters: usize,
    targets: &mut Targets,
) -> Result<()> {
    let (p50, p99) = ping_pong(kind, a, b, size, iters)?;
    // Let hostd's poller fall asleep, so that the baselines have the
    // cores; they warm up before measuring, so an idle CPU costs them
    // nothing.
    std::thread::sleep(Duration::from_millis(20));
    let tcp = Tcp::measure(size, iters.min(10_000))?;
    let shm = baselines::shared_memory_half_rtt(iters)?;
    let relay = baselines::relayed_half_rtt(iters)?;
    let name = match kind {
        Kind::Write => "write_lat",
        Kind::Send => "send_lat",
        Kind::Read => "read_lat",
    };
    // READ's figure is a round trip; compare it with TCP's.
    let tcp_same = if kind == Kind::Read {
        tcp.best() * 2
    } else {
        tcp.best()
    };
    let ratio = p50.as_secs_f64() / tcp_same.as_secs_f64();
    println!(
        "{name:<10} {size:>7} B  p50 {} p99 {}  | tcp blocking {} busy-poll {}  | shm {} relayed {}  | vrdma/tcp-best {ratio:.2}",
        us(p50),
        us(p99),
        us(tcp.blocking),
        us(tcp.busy_poll),
        us(shm),
        us(relay),
    );
    if kind == Kind::Write && size == 64 {
        let what = "64 B WRITE p50 one way";
        targets.check(what, p50.as_secs_f64() * 1e6, " µs", Bound::AtMost(2.0));
        let what = "64 B WRITE p50 / TCP best half round trip";
        targets.check(what, ratio, "", Bound::AtMost(0.75));
    }
    Ok(())
}

/// p50 and p99 of `iters` ping-pongs (after a tenth as many of warm-up).
pub fn ping_pong(
    kind: Kind,
    a: &Tenant,
    b: &Tenant,
    size: usize,
    iters: usize,
) -> Result<(Duration, Duration)> {
    let l = Link::new(a, b, size.max(1), SEND_WR)?;
    // A tenth of the iterations, and at least WARMUP_ITERS (tens of
    // milliseconds): caches, the vCPUs and hostd's poller all warm before
    // the first sample, also in the first test after the daemons start.
    let warmup = (iters / 10).max(WARMUP_ITERS);
    let total = iters + warmup;
    let mut samples = Vec::with_capacity(iters);
    std::thread::scope(|scope| -> Result<()> {
        let pong = (kind != Kind::Read).then(|| scope.spawn(|| pong(kind, &l, size, total)));
        if kind == Kind::Send {
            // The pong side's first receive, before the first ping.
            post_recv(&l.qb, &l.mb, 0, size)?;
        }
        let mut run = || -> Result<()> {
            for i in 0..total {
                let start = Instant::now();
                ping(kind, &l, size, i)?;
                if i >= warmup {
                    samples.push(start.elapsed());
                }
            }
            Ok(())
        };
        let pinged = run();
        let ponged = pong.map_or(Ok(()), |t| t.join().map_err(|_| BenchError::Panicked)?);
        pinged.and(ponged)
    })?;
    let (p50, p99) = percentiles(&mut samples);
    Ok(if kind == Kind::Read {
        (p50, p99)
    } else {
        (p50 / 2, p99 / 2)
    })
}

/// The sequence byte of iteration `i` (never 0, the buffers' first value).
fn seq(i: usize) -> u8 {
    (i % 255) as u8 + 1
}

fn signaled(i: usize) -> bool {
    i % SIGNAL_EVERY == SIGNAL_EVERY - 1
}

/// One iteration on the measuring side (`a`).
fn ping(kind: Kind, l: &Link<'_>, size: usize, i: usize) -> Result<()> {
    let signal = signaled(i);
    match kind {
        Kind::Write => {
            // The last byte of the message carries the sequence number;
            // the echo lands in the second half.
            l.ma.set_byte(size - 1, seq(i));
            write(&l.qa, &l.ma, 0, &l.mb, 0, size, signal)?;
            spin_until(&l.ma, 2 * size - 1, seq(i));
            if signal {
                poll(&l.a.cq, 1)?;
            }
        }
        Kind::Send => {
            post_recv(&l.qa, &l.ma, size, size)?;
            send(&l.qa, &l.ma, 0, size, signal)?;
            poll(&l.a.cq, 1 + usize::from(signal))?;
        }
        Kind::Read => {
            let sge = [l.ma.sge(0, size as u32)];
            let mut wr = SendWr::new(i as u64, SendOpcode::RdmaRead, SendPayload::Sges(&sge));
            wr.flags = SIGNALED;
            wr.remote_addr = l.mb.iova();
            wr.rkey = l.mb.rkey();
            l.qa.post_send(&[wr]).map_err(BenchError::Post)?;
            // Nothing on the tenants' cores produces this completion
            // (hostd does), so yielding at once would only hand the core
            // to whatever else runs there.
            poll_yielding(&l.a.cq, 1, SHARED_YIELD_EVERY)?;
        }
    }
    Ok(())
}

/// The echoing side (`b`) of the WRITE and SEND ping-pongs.
fn pong(kind: Kind, l: &Link<'_>, size: usize, total: usize) -> Result<()> {
    for i in 0..total {
        let signal = signaled(i);
        match kind {
            Kind::Write => {
                spin_until(&l.mb, size - 1, seq(i));
                l.mb.set_byte(2 * size - 1, seq(i));
                write(&l.qb, &l.mb, size, &l.ma, size, size, signal)?;
                if signal {
                    poll(&l.b.cq, 1)?;
                }
            }
            Kind::Send => {
                poll(&l.b.cq, 1)?;
                if i + 1 < total {
                    post_recv(&l.qb, &l.mb, 0, size)?;
                }
                send(&l.qb, &l.mb, size, size, signal)?;
                if signal {
                    poll(&l.b.cq, 1)?;
                }
            }
            Kind::Read => {}
        }
    }
    Ok(())
}

/// An RDMA WRITE of `src[from..from + size]` to `dst[to..]`.
pub fn write(
    qp: &QueuePair,
    src: &Buffer,
    from: usize,
    dst: &Buffer,
    to: usize,
    size: usize,
    signal: bool,
) -> Result<()> {
    let sge = [src.sge(from as u64, size as u32)];
    let mut wr = SendWr::new(0, SendOpcode::RdmaWrite, SendPayload::Sges(&sge));
    wr.remote_addr = dst.iova() + to as u64;
    wr.rkey = dst.rkey();
    wr.flags = if signal { SIGNALED } else { 0 };
    qp.post_send(&[wr]).map_err(BenchError::Post)
}

/// A SEND of `buf[from..from + size]`.
fn send(qp: &QueuePair, buf: &Buffer, from: usize, size: usize, signal: bool) -> Result<()> {
    let sge = [buf.sge(from as u64, size as u32)];
    let mut wr = SendWr::new(0, SendOpcode::Send, SendPayload::Sges(&sge));
    wr.flags = if signal { SIGNALED } else { 0 };
    qp.post_send(&[wr]).map_err(BenchError::Post)
}

/// A receive into `buf[at..at + size]`.
fn post_recv(qp: &QueuePair, buf: &Buffer, at: usize, size: usize) -> Result<()> {
    qp.post_recv(&[RecvWr {
        wr_id: 0,
        sg_list: &[buf.sge(at as u64, size as u32)],
    }])
    .map_err(BenchError::Post)
}

/// Busy-polls `cq` until `want` successful completions arrived.
pub fn poll(cq: &CompletionQueue, want: usize) -> Result<()> {
    poll_yielding(cq, want, cores::yield_every())
}

/// [`poll`], yielding the core every `every` empty polls.
fn poll_yielding(cq: &CompletionQueue, want: usize, every: u32) -> Result<()> {
    let mut got = 0;
    let mut wcs = [WorkCompletion::default(); 32];
    let mut spins = 0u32;
    while got < want {
        let room = (want - got).min(wcs.len());
        let n = poll_ok(cq, &mut wcs[..room])?;
        got += n;
        if n == 0 {
            spins = spins.wrapping_add(1);
            pause_every(spins, every);
        }
    }
    Ok(())
}

/// Busy-polls `buf[offset]` until it holds `value`.
fn spin_until(buf: &Buffer, offset: usize, value: u8) {
    let mut spins = 0u32;
    while buf.byte(offset) != value {
        spins = spins.wrapping_add(1);
        pause(spins);
    }
}
