//! The floor of a 64 B message across hosts with a software NIC per host
//! (`--cross-host`, first): the same four parties as vrdma's WRITE
//! ping-pong on the same CPUs — a "tenant" thread on each host on the
//! tenants' CPU, a "hostd" thread on each host on the datapath CPU (both
//! hostds share it, as in the RDMA runs) — handing a 64-byte payload over
//! shared memory to the local "hostd", which sends it through hostd's own
//! packet path (`vrdma_hostd::net::io`, the same code, AF_XDP or UDP) to
//! the other, which hands it to its tenant, which answers the same way.
//! No RDMA logic: no rings, no QPs, no ACKs, no ICRC. What remains is what
//! this machine charges any design that relays through a user-space
//! datapath per host: two hand-offs between cores and one packet per way.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_hostd::net::io::{InPacket, OutPacket, PacketIo, UdpIo, XdpIo, ROCE_V2_PORT};

use crate::cores;
use crate::cross::PacketIo as Path;
use crate::netns::{NetHost, Pair};
use crate::report::us;
use crate::{BenchError, Result};

/// Round trips before measuring.
const WARMUP: usize = 2_000;
/// Bytes of each message.
const SIZE: usize = 64;

/// A one-word mailbox between a tenant thread and its host's relay: the
/// sequence number of the last message put in it.
#[derive(Default)]
struct Mailbox(AtomicU64);

impl Mailbox {
    fn put(&self, seq: u64) {
        self.0.store(seq, Ordering::Release);
    }

    /// Waits (spinning, yielding as the bench's waiters do) for `seq`;
    /// false if `stop` came first.
    fn wait(&self, seq: u64, stop: &AtomicBool) -> bool {
        self.wait_for(seq, stop, Instant::now() + Duration::from_secs(3600))
    }
}

/// The packet path of `host`, opened in its namespace by the calling
/// thread.
fn open(host: &NetHost, path: Path) -> Result<Box<dyn PacketIo>> {
    let setup = |e: std::io::Error| BenchError::Setup {
        what: format!("open the {} packet path on {}", path.name(), host.name),
        detail: e.to_string(),
    };
    host.enter().map_err(setup)?;
    let kernel = UdpIo::open(Ipv4Addr::UNSPECIFIED, ROCE_V2_PORT).map_err(setup)?;
    Ok(match path {
        Path::Udp => Box::new(kernel),
        Path::AfXdp => Box::new(XdpIo::open(host.underlay, None, kernel).map_err(setup)?),
    })
}

/// One host's relay: its tenant's mailbox out to the wire (`send_to`), the
/// wire into its tenant's other mailbox. Runs until `stop`.
fn relay(
    io: &mut dyn PacketIo,
    (me, peer): (Ipv4Addr, Ipv4Addr),
    outbox: &Mailbox,
    inbox: &Mailbox,
    stop: &AtomicBool,
) {
    let mut out = vec![OutPacket::new()];
    let mut bufs: Vec<InPacket> = (0..16).map(|_| InPacket::new()).collect();
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let mut busy = false;
        let want = outbox.0.load(Ordering::Acquire);
        if want > sent {
            let p = &mut out[0];
            p.src = me;
            p.dst = peer;
            p.len = SIZE;
            p.buf[..8].copy_from_slice(&want.to_le_bytes());
            // A full queue: try again next turn.
            if io.send(&out).unwrap_or(0) == 1 {
                sent = want;
            }
            busy = true;
        }
        let n = io.recv(&mut bufs).unwrap_or(0);
        for b in &bufs[..n] {
            // The IPv4 and UDP headers (28 bytes) before the payload.
            if let Some(seq) = b.packet().get(28..36) {
                let mut word = [0u8; 8];
                word.copy_from_slice(seq);
                inbox.put(u64::from_le_bytes(word));
            }
        }
        busy |= n > 0;
        // The two relays share a CPU: an idle turn gives it to the other,
        // as hostd's adaptive polling does.
        if !busy {
            std::thread::yield_now();
        }
    }
}

/// The floor's half round trip p50 and p99 on `path`, over `iters` round
/// trips.
pub fn run(path: Path, iters: usize) -> Result<(Duration, Duration)> {
    let pair = Pair::new()?;
    let [h1, h2] = &pair.hosts;
    let stop = Arc::new(AtomicBool::new(false));
    // h1's tenant → h1's relay, h1's relay → h1's tenant; the same on h2.
    let boxes: [Mailbox; 4] = Default::default();
    let barrier = std::sync::Barrier::new(3);
    let result = std::thread::scope(|scope| -> Result<Vec<Duration>> {
        let (stop, boxes) = (&*stop, &boxes);
        // Nothing is sent before both relays have their sockets: a packet
        // to a host without one would be lost, and the ping-pong with it.
        let ready = &barrier;
        let mut relays = Vec::new();
        for (host, peer, outbox, inbox) in [
            (h1, h2, &boxes[0], &boxes[1]),
            (h2, h1, &boxes[2], &boxes[3]),
        ] {
            relays.push(scope.spawn(move || -> Result<()> {
                cores::on_datapath_cpu(|| -> Result<()> {
                    let mut io = open(host, path).inspect_err(|_| {
                        stop.store(true, Ordering::Relaxed);
                        ready.wait();
                    })?;
                    ready.wait();
                    relay(
                        io.as_mut(),
                        (host.underlay, peer.underlay),
                        outbox,
                        inbox,
                        stop,
                    );
                    Ok(())
                })
                .map_err(BenchError::Cores)?
            }));
        }
        // h2's tenant: answers each message with the same number.
        let echo = scope.spawn(move || {
            let _ = cores::enter_tenant_cores();
            let mut seq = 1;
            while boxes[3].wait(seq, stop) {
                boxes[2].put(seq);
                seq += 1;
            }
        });
        // h1's tenant: the clock.
        cores::enter_tenant_cores().map_err(BenchError::Cores)?;
        ready.wait();
        let mut halves = Vec::with_capacity(iters);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut unanswered = None;
        for seq in 1..=(WARMUP + iters) as u64 {
            let t = Instant::now();
            boxes[0].put(seq);
            if !boxes[1].wait_for(seq, stop, deadline) {
                unanswered = Some(seq);
                break;
            }
            if seq as usize > WARMUP {
                halves.push(t.elapsed() / 2);
            }
        }
        stop.store(true, Ordering::Relaxed);
        let _ = echo.join();
        // A relay's failure says more than the silence it caused.
        for r in relays {
            r.join().map_err(|_| BenchError::Panicked)??;
        }
        if let Some(seq) = unanswered {
            return Err(BenchError::Setup {
                what: format!("run the {} floor", path.name()),
                detail: format!("no answer to message {seq} within 60 s"),
            });
        }
        Ok(halves)
    });
    stop.store(true, Ordering::Relaxed);
    let mut halves = result?;
    halves.sort_unstable();
    let at = |q: f64| halves[((halves.len() - 1) as f64 * q) as usize];
    if halves.is_empty() {
        return Err(BenchError::Panicked);
    }
    let (p50, p99) = (at(0.5), at(0.99));
    println!(
        "cross floor [{}]     64 B  relayed ping-pong (2 tenant threads, 2 relays on the datapath CPU, hostd's packet path, no RDMA): half round trip p50 {} p99 {} over {iters}",
        path.name(),
        us(p50),
        us(p99)
    );
    Ok((p50, p99))
}

impl Mailbox {
    /// [`Mailbox::wait`] until `until` at the latest.
    fn wait_for(&self, seq: u64, stop: &AtomicBool, until: Instant) -> bool {
        let every = cores::yield_every().max(1);
        let mut spins = 0u32;
        while self.0.load(Ordering::Acquire) < seq {
            if stop.load(Ordering::Relaxed) || Instant::now() > until {
                return false;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(every) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        true
    }
}
