//! Streams of work requests on one QP, as perftest's `ib_write_bw`,
//! `ib_read_bw` and `ib_send_bw` run them: a window of requests in
//! flight, posted in lists, the last of each list signaled (so one
//! completion retires a list); and floods, the same until told to stop.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use vrdma_guest_driver::{QueuePair, RecvWr, SendPayload, SendWr, WorkCompletion};
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::SendOpcode;

use crate::baselines::{memcpy_rate, pause};
use crate::host::{poll_ok, Link, Tenant};
use crate::report::{Bound, Targets};
use crate::{BenchError, Result};

/// Bandwidth trials; the best is reported, for vrdma and memcpy alike.
const TRIALS: usize = 5;

/// The shape of a stream.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub opcode: SendOpcode,
    pub size: usize,
    /// Work requests in flight at most (the send queue's depth).
    pub window: usize,
    /// Work requests per `post_send`, the last one signaled.
    pub batch: usize,
}

impl Shape {
    /// Bulk transfers: 64 in flight, in lists of 16.
    pub fn bulk(opcode: SendOpcode, size: usize) -> Self {
        Shape {
            opcode,
            size,
            window: 64,
            batch: 16,
        }
    }

    /// A flood, as `ib_write_bw` and `ib_send_bw` flood by default: one
    /// work request per post, and a queue deep enough (256) that the port
    /// stays busy through the milliseconds in which the flooding thread
    /// does not get a core (here it shares one with other tenants).
    pub fn flood(opcode: SendOpcode, size: usize) -> Self {
        Shape {
            opcode,
            size,
            window: 256,
            batch: 1,
        }
    }

    /// Small messages as fast as they go: 256 in flight, in lists of 32.
    pub fn rate(opcode: SendOpcode, size: usize) -> Self {
        Shape {
            opcode,
            size,
            window: 256,
            batch: 32,
        }
    }
}

/// How long a stream runs.
#[derive(Clone, Copy)]
pub enum Until<'a> {
    /// This many work requests.
    Count(usize),
    /// Until the flood is stopped.
    Stopped(&'a Flood),
}

/// A flood's controls, shared with the thread running it.
#[derive(Debug, Default)]
pub struct Flood {
    /// Set to stop it.
    pub stop: AtomicBool,
    /// Work requests completed so far, for rates over part of a flood.
    pub done: AtomicUsize,
}

impl Flood {
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Work requests completed and the time they took.
#[derive(Debug, Clone, Copy)]
pub struct Completed {
    pub ops: usize,
    pub elapsed: Duration,
    /// Work requests posted (all completed) in all.
    pub posted: usize,
}

impl Completed {
    pub fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }
}

/// Posts each QP's list until `window` work requests are in flight on
/// it, counting them in `in_flight`: the start of a completion-driven
/// stream (each completion then reposts its list).
pub fn fill_windows<'q>(
    qps: impl Iterator<Item = &'q QueuePair>,
    lists: &[Vec<SendWr<'_>>],
    in_flight: &mut [usize],
    window: usize,
) -> Result<()> {
    for ((qp, list), flight) in qps.zip(lists).zip(in_flight) {
        while *flight + list.len() <= window {
            qp.post_send(list).map_err(BenchError::Post)?;
            *flight += list.len();
        }
    }
    Ok(())
}

/// An operation rate measured from a running count: over `duration`,
/// after a tenth as long of warm-up.
pub struct Meter {
    warm: Instant,
    end: Instant,
    /// When counting began, and the count then.
    from: Option<(Instant, usize)>,
}

impl Meter {
    /// A window starting now.
    pub fn new(duration: Duration) -> Meter {
        let warm = Instant::now() + duration / 10;
        Meter {
            warm,
            end: warm + duration,
            from: None,
        }
    }

    /// Takes the count `done` at `now`; once the window has ended, the
    /// operations per second counted in it.
    pub fn tick(&mut self, now: Instant, done: usize) -> Option<f64> {
        if self.from.is_none() && now >= self.warm {
            self.from = Some((now, done));
        }
        let (from, before) = self.from?;
        let counted = now.duration_since(from).as_secs_f64();
        (now >= self.end && counted > 0.0).then(|| (done - before) as f64 / counted)
    }
}

/// Runs a stream of `shape` from `a` into `b` on a link of its own (SENDs
/// into receives a thread keeps posted on `b`).
pub fn stream(a: &Tenant, b: &Tenant, shape: Shape, until: Until<'_>) -> Result<Completed> {
    let l = Link::new(a, b, shape.size, shape.window as u32)?;
    let sge = [l.ma.sge(0, shape.size as u32)];
    let mut wr = SendWr::new(0, shape.opcode, SendPayload::Sges(&sge));
    wr.remote_addr = l.mb.iova();
    wr.rkey = l.mb.rkey();
    let mut list = vec![wr; shape.batch];
    if let Some(last) = list.last_mut() {
        last.flags = SIGNALED;
    }
    // How many SENDs the receiver must see: unknown until the sender is
    // done.
    let sent = AtomicUsize::new(usize::MAX);
    std::thread::scope(|scope| {
        let receiver = (shape.opcode == SendOpcode::Send)
            .then(|| scope.spawn(|| keep_receiving(&l, shape, &sent)));
        let done = send_stream(&l, &list, shape, until);
        sent.store(done.as_ref().map_or(0, |d| d.posted), Ordering::Release);
        let received = receiver.map_or(Ok(()), |t| t.join().map_err(|_| BenchError::Panicked)?);
        received.and(done)
    })
}

/// The sending side of [`stream`].
fn send_stream(
    l: &Link<'_>,
    list: &[SendWr<'_>],
    shape: Shape,
    until: Until<'_>,
) -> Result<Completed> {
    let (mut posted, mut done) = (0usize, 0usize);
    let mut wcs = [WorkCompletion::default(); 32];
    let mut spins = 0u32;
    let start = Instant::now();
    let more = |posted: usize| match until {
        Until::Count(count) => posted < count,
        Until::Stopped(flood) => !flood.stop.load(Ordering::Relaxed),
    };
    let mut elapsed = None;
    while done < posted || more(posted) {
        if more(posted) && posted - done + shape.batch <= shape.window {
            l.qa.post_send(list).map_err(BenchError::Post)?;
            posted += shape.batch;
        } else if elapsed.is_none() && !more(posted) {
            // Stopped: the rate counts what completed until now.
            elapsed = Some((done, start.elapsed()));
        }
        let n = poll_ok(&l.a.cq, &mut wcs)?;
        done += n * shape.batch;
        if let Until::Stopped(flood) = until {
            flood.done.store(done, Ordering::Relaxed);
        }
        if n == 0 {
            spins = spins.wrapping_add(1);
            pause(spins);
        }
    }
    let (ops, elapsed) = match until {
        Until::Count(_) => (done, start.elapsed()),
        Until::Stopped(_) => elapsed.unwrap_or((done, start.elapsed())),
    };
    Ok(Completed {
        ops,
        elapsed,
        posted,
    })
}

/// The receiving side of a SEND stream: a receive posted for every SEND
/// in flight, reposted as each completes, until every SEND the sender
/// posted has arrived.
fn keep_receiving(l: &Link<'_>, shape: Shape, sent: &AtomicUsize) -> Result<()> {
    let sge = [l.mb.sge(0, shape.size as u32)];
    let recv = RecvWr {
        wr_id: 0,
        sg_list: &sge,
    };
    let recvs = vec![recv; shape.window];
    l.qb.post_recv(&recvs).map_err(BenchError::Post)?;
    let mut wcs = [WorkCompletion::default(); 32];
    let (mut received, mut spins) = (0usize, 0u32);
    while received < sent.load(Ordering::Acquire) {
        let n = poll_ok(&l.b.cq, &mut wcs)?;
        received += n;
        if n == 0 {
            spins = spins.wrapping_add(1);
            pause(spins);
            continue;
        }
        l.qb.post_recv(&recvs[..n]).map_err(BenchError::Post)?;
    }
    Ok(())
}

/// Bandwidth tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    WriteBw,
    ReadBw,
    SendBw,
    /// 64-byte WRITEs, as many per second as go.
    MsgRate,
}

/// Measures `kind` with `size`-byte messages (`bytes` in all, the best of
/// five trials) against memcpy and prints one line.
pub fn run(
    kind: Kind,
    a: &Tenant,
    b: &Tenant,
    size: usize,
    bytes: usize,
    targets: &mut Targets,
) -> Result<()> {
    let (name, shape) = match kind {
        Kind::WriteBw => ("write_bw", Shape::bulk(SendOpcode::RdmaWrite, size)),
        Kind::ReadBw => ("read_bw", Shape::bulk(SendOpcode::RdmaRead, size)),
        Kind::SendBw => ("send_bw", Shape::bulk(SendOpcode::Send, size)),
        Kind::MsgRate => ("msg_rate", Shape::rate(SendOpcode::RdmaWrite, 64)),
    };
    let count = (bytes / shape.size).clamp(shape.window * 16, 4 << 20);
    let count = count.next_multiple_of(shape.batch);
    // A warm-up stream, then the trials.
    stream(a, b, shape, Until::Count(count / 8))?;
    let best = (0..TRIALS)
        .map(|_| stream(a, b, shape, Until::Count(count)))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .max_by(|x, y| x.ops_per_sec().total_cmp(&y.ops_per_sec()))
        .ok_or(BenchError::Panicked)?;
    let ops = best.ops_per_sec();
    let rate = ops * shape.size as f64;
    let copy = memcpy_rate(shape.size, (count * shape.size).min(4 << 30), TRIALS);
    println!(
        "{name:<10} {:>7} B  {:.3} Mop/s  {:.2} GB/s  | memcpy {:.2} GB/s  | vrdma/memcpy {:.2}",
        shape.size,
        ops / 1e6,
        rate / 1e9,
        copy / 1e9,
        rate / copy
    );
    match kind {
        Kind::MsgRate => {
            let what = "64 B WRITE message rate, one QP";
            targets.check(what, ops / 1e6, " Mop/s", Bound::AtLeast(4.0));
        }
        Kind::WriteBw if shape.size == 65536 => {
            let what = "64 KiB WRITE bandwidth / memcpy";
            targets.check(what, rate / copy, "", Bound::AtLeast(0.7));
        }
        _ => {}
    }
    Ok(())
}
