//! The hostile network between hosts (`vrdma-relay`): an L2 forwarder
//! between two or more interfaces that learns MAC addresses as a switch
//! does and harms RoCEv2 traffic on the way.
//!
//! Every frame received on one interface (an AF_PACKET socket bound to it,
//! promiscuous) is sent out of the interface its destination MAC was last
//! seen on, or flooded to all the others (broadcast, multicast, unknown).
//! Only IPv4 UDP datagrams to port 4791 are harmed: dropped, duplicated,
//! held back behind later frames (reorder), delayed, truncated or
//! corrupted (one bit of the UDP payload flipped), each at its own rate
//! ([`Faults`]). ARP, TCP and everything else pass untouched. The random
//! choices come from a seeded generator and are drawn in the order frames
//! arrive, so a run with the same seed and the same traffic makes the same
//! choices.
//!
//! The kernel may hand a frame that a local socket sent with its transport
//! checksum left for the NIC (veth offloads it: `CHECKSUM_PARTIAL`); the
//! relay completes it, as the NIC would have, before anything else
//! (`PACKET_AUXDATA` says which). Frames larger than the interface's MTU
//! (segmentation offloaded, GSO/TSO) cannot be sent on: the interfaces the
//! relay serves must have segmentation offloads off (`ethtool -K IFACE tso
//! off gso off tx-udp-segmentation off` on the sending side), or such frames
//! are counted as send errors.
//!
//! By default a corrupted or truncated datagram has its IPv4 and UDP
//! lengths and checksums rewritten to match ([`Faults::fix_udp_checksum`]),
//! as a switch that rewrites headers would, so the receiver's kernel
//! delivers it and the harm reaches the RoCE ICRC check; without it the
//! receiver's kernel drops them.

mod frame;
mod packet_socket;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub use frame::ROCE_V2_PORT;
use packet_socket::PacketSocket;

/// The largest frame received whole (larger ones come from segmentation
/// offload and are counted, not forwarded whole).
const MAX_FRAME: usize = 65_536 + 64;
/// How long `run` sleeps at most between looks at the stop flag.
const TICK: Duration = Duration::from_millis(100);
/// How often the stats file is rewritten.
const STATS_EVERY: Duration = Duration::from_secs(1);
/// Frames read from one socket before the others get a turn.
const BURST: usize = 64;

/// What goes wrong with RoCEv2 frames, and how often (each rate in 0..=1,
/// the chance for each frame).
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    pub drop: f64,
    pub dup: f64,
    /// A frame held back and sent after the next `reorder_gap` frames the
    /// relay forwards (or after `reorder_timeout` if fewer come).
    pub reorder: f64,
    pub reorder_gap: u32,
    pub reorder_timeout: Duration,
    /// A frame sent `delay` later (the frames behind it overtake it).
    pub delay: Duration,
    pub delay_rate: f64,
    /// Cut to a random shorter UDP payload (0 bytes or more).
    pub truncate: f64,
    /// One random bit of the UDP payload flipped.
    pub corrupt: f64,
    /// Rewrite lengths and checksums after truncate and corrupt.
    pub fix_udp_checksum: bool,
    pub seed: u64,
}

impl Default for Faults {
    /// No harm: a plain learning switch.
    fn default() -> Self {
        Self {
            drop: 0.0,
            dup: 0.0,
            reorder: 0.0,
            reorder_gap: 1,
            reorder_timeout: Duration::from_millis(10),
            delay: Duration::ZERO,
            delay_rate: 0.0,
            truncate: 0.0,
            corrupt: 0.0,
            fix_udp_checksum: true,
            seed: 0,
        }
    }
}

/// Why the relay cannot run.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("Rate --{name} is {value}, not between 0 and 1")]
    Rate { name: &'static str, value: f64 },
    #[error("A relay needs at least two interfaces, got {0}")]
    TooFewInterfaces(usize),
    #[error("Cannot open a packet socket on interface {iface}")]
    Socket {
        iface: String,
        #[source]
        source: io::Error,
    },
    #[error("Cannot receive on interface {iface}")]
    Receive {
        iface: String,
        #[source]
        source: io::Error,
    },
    #[error("Cannot wait for frames")]
    Poll(#[source] io::Error),
    #[error("Cannot write the stats file {}", path.display())]
    Stats {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl Faults {
    /// Every rate in 0..=1.
    pub fn validate(&self) -> Result<(), RelayError> {
        let rates = [
            ("drop", self.drop),
            ("dup", self.dup),
            ("reorder", self.reorder),
            ("delay-rate", self.delay_rate),
            ("truncate", self.truncate),
            ("corrupt", self.corrupt),
        ];
        match rates.iter().find(|(_, v)| !(0.0..=1.0).contains(v)) {
            Some(&(name, value)) => Err(RelayError::Rate { name, value }),
            None => Ok(()),
        }
    }
}

/// What the relay did, frame by frame (written as one JSON line).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    /// Frames received on any interface.
    pub frames_in: u64,
    /// Frames sent (a flooded frame counts once per interface).
    pub frames_out: u64,
    /// Frames sent to every other interface (destination unknown or group).
    pub flooded: u64,
    /// Received frames that were RoCEv2 (IPv4 UDP to 4791): the ones harmed.
    pub roce: u64,
    /// Partial transport checksums completed (offloaded by the sender).
    pub checksums_completed: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub delayed: u64,
    pub truncated: u64,
    pub corrupted: u64,
    /// Frames the kernel refused to send (e.g. larger than the MTU).
    pub send_errors: u64,
    /// Frames the kernel dropped before the relay read them (its sockets'
    /// receive buffers were full): lost by the relay, not by a fault.
    pub socket_drops: u64,
}

impl Stats {
    /// One JSON line.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// SplitMix64: small, seedable, the same everywhere.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// MAC learning: which port each source address was last seen on.
#[derive(Debug, Default)]
struct Switch {
    ports: usize,
    table: HashMap<[u8; 6], usize>,
}

impl Switch {
    /// The ports a frame from `port` goes to; learns its source.
    fn egress(&mut self, port: usize, frame: &[u8], stats: &mut Stats) -> Vec<usize> {
        let Some((dst, src)) = frame::macs(frame) else {
            return Vec::new();
        };
        if src[0] & 1 == 0 {
            self.table.insert(src, port);
        }
        match self.table.get(&dst) {
            Some(&out) if dst[0] & 1 == 0 => {
                // A frame for the port it came from goes nowhere.
                if out == port {
                    Vec::new()
                } else {
                    vec![out]
                }
            }
            _ => {
                stats.flooded += 1;
                (0..self.ports).filter(|&p| p != port).collect()
            }
        }
    }
}

/// Frames to send: (port, frame), in order.
pub type Output = Vec<(usize, Vec<u8>)>;

/// A frame (and its duplicate, if any) leaving later.
#[derive(Debug)]
struct Pending {
    ports: Vec<usize>,
    frame: Vec<u8>,
    copies: u8,
}

#[derive(Debug)]
struct Held {
    pending: Pending,
    /// Frames still to pass it.
    after: u32,
    deadline: Instant,
}

/// The switching and the faults, without sockets: frames in, frames out.
#[derive(Debug)]
pub struct Engine {
    faults: Faults,
    rng: Rng,
    switch: Switch,
    held: Vec<Held>,
    /// Delayed frames by (deadline, arrival number).
    delayed: BinaryHeap<Reverse<(Instant, u64)>>,
    delayed_frames: HashMap<u64, Pending>,
    arrivals: u64,
    pub stats: Stats,
}

impl Engine {
    /// A relay between `ports` interfaces.
    pub fn new(faults: Faults, ports: usize) -> Self {
        let rng = Rng(faults.seed);
        Self {
            faults,
            rng,
            switch: Switch {
                ports,
                table: HashMap::new(),
            },
            held: Vec::new(),
            delayed: BinaryHeap::new(),
            delayed_frames: HashMap::new(),
            arrivals: 0,
            stats: Stats::default(),
        }
    }

    /// A frame received on `port` at `now` (`csum_not_ready`: its transport
    /// checksum is partial); what is to be sent now goes to `out`.
    pub fn receive(
        &mut self,
        port: usize,
        mut frame: Vec<u8>,
        csum_not_ready: bool,
        now: Instant,
        out: &mut Output,
    ) {
        self.stats.frames_in += 1;
        self.arrivals += 1;
        if csum_not_ready {
            if let Some(ip) = frame::ipv4(&frame) {
                if frame::fix_l4_checksum(&mut frame, &ip) {
                    self.stats.checksums_completed += 1;
                }
            }
        }
        let ports = self.switch.egress(port, &frame, &mut self.stats);
        if ports.is_empty() {
            return;
        }
        let Some(ip) = frame::roce(&frame) else {
            self.emit(
                Pending {
                    ports,
                    frame,
                    copies: 1,
                },
                out,
            );
            return;
        };
        self.stats.roce += 1;
        // Six draws for every RoCE frame, whatever the rates: the choices
        // for frame n do not depend on the rates' effect on frames before.
        let f = &self.faults;
        let [drop, truncate, corrupt, dup, reorder, delay] = [(); 6].map(|()| self.rng.unit());
        let (drop, truncate, corrupt, dup, reorder, delay) = (
            drop < f.drop,
            truncate < f.truncate,
            corrupt < f.corrupt,
            dup < f.dup,
            reorder < f.reorder,
            delay < f.delay_rate && !f.delay.is_zero(),
        );
        let fix = f.fix_udp_checksum;
        if drop {
            self.stats.dropped += 1;
            return;
        }
        let mut ip = ip;
        let payload = frame::udp_payload_len(&ip);
        if truncate && payload > 0 {
            let keep = self.rng.below(payload);
            let len = frame::truncate(&mut frame, &ip, keep, fix);
            frame.truncate(len);
            ip.end = len;
            self.stats.truncated += 1;
        }
        let payload = frame::udp_payload_len(&ip);
        if corrupt && payload > 0 {
            let bit = self.rng.below(payload * 8);
            frame::corrupt(&mut frame, &ip, bit, fix);
            self.stats.corrupted += 1;
        }
        let copies = if dup {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        let pending = Pending {
            ports,
            frame,
            copies,
        };
        if delay {
            self.stats.delayed += 1;
            let at = now + self.faults.delay;
            self.delayed.push(Reverse((at, self.arrivals)));
            self.delayed_frames.insert(self.arrivals, pending);
        } else if reorder {
            self.stats.reordered += 1;
            self.held.push(Held {
                pending,
                after: self.faults.reorder_gap.max(1),
                deadline: now + self.faults.reorder_timeout,
            });
        } else {
            self.emit(pending, out);
        }
    }

    /// Sends `pending` now, then the held frames it was the last to pass.
    fn emit(&mut self, pending: Pending, out: &mut Output) {
        for _ in 0..pending.copies {
            for &port in &pending.ports {
                out.push((port, pending.frame.clone()));
            }
        }
        let mut released = Vec::new();
        self.held.retain_mut(|h| {
            h.after -= 1;
            if h.after == 0 {
                released.push(std::mem::replace(
                    &mut h.pending,
                    Pending {
                        ports: Vec::new(),
                        frame: Vec::new(),
                        copies: 0,
                    },
                ));
                false
            } else {
                true
            }
        });
        for p in released {
            Self::push(p, out);
        }
    }

    fn push(p: Pending, out: &mut Output) {
        for _ in 0..p.copies {
            for &port in &p.ports {
                out.push((port, p.frame.clone()));
            }
        }
    }

    /// Sends the delayed and held frames whose time has come by `now`.
    pub fn due(&mut self, now: Instant, out: &mut Output) {
        while let Some(&Reverse((at, n))) = self.delayed.peek() {
            if at > now {
                break;
            }
            self.delayed.pop();
            if let Some(p) = self.delayed_frames.remove(&n) {
                Self::push(p, out);
            }
        }
        let (late, kept): (Vec<Held>, Vec<Held>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| h.deadline <= now);
        self.held = kept;
        for h in late {
            Self::push(h.pending, out);
        }
    }

    /// When [`Engine::due`] has something to send next.
    pub fn next_deadline(&self) -> Option<Instant> {
        let delayed = self.delayed.peek().map(|Reverse((at, _))| *at);
        let held = self.held.iter().map(|h| h.deadline).min();
        delayed.into_iter().chain(held).min()
    }
}

/// Writes `stats` as one JSON line to `path`, whole (through a temporary
/// file renamed over it).
pub fn write_stats(path: &Path, stats: &Stats) -> Result<(), RelayError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let failed = |source| RelayError::Stats {
        path: path.to_owned(),
        source,
    };
    std::fs::write(&tmp, format!("{}\n", stats.to_json())).map_err(failed)?;
    std::fs::rename(&tmp, path).map_err(failed)
}

/// Relays between `ifaces` with `faults` until `stop` is set; writes
/// `stats_file` (if any) once the sockets are open, every second, and at
/// the end. Returns what it did.
pub fn run(
    ifaces: &[String],
    faults: Faults,
    stats_file: Option<&Path>,
    stop: &AtomicBool,
) -> Result<Stats, RelayError> {
    faults.validate()?;
    if ifaces.len() < 2 {
        return Err(RelayError::TooFewInterfaces(ifaces.len()));
    }
    let sockets = ifaces
        .iter()
        .map(|iface| {
            PacketSocket::open(iface).map_err(|source| RelayError::Socket {
                iface: iface.clone(),
                source,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut engine = Engine::new(faults, sockets.len());
    let mut pollfds: Vec<libc::pollfd> = sockets
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut buf = vec![0u8; MAX_FRAME];
    let mut out = Output::new();
    let mut next_stats = Instant::now();
    let mut reported_error = false;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if let Some(path) = stats_file {
            if now >= next_stats {
                count_socket_drops(&sockets, &mut engine.stats);
                write_stats(path, &engine.stats)?;
                next_stats = now + STATS_EVERY;
            }
        }
        let wake = engine
            .next_deadline()
            .map_or(TICK, |at| at.saturating_duration_since(now))
            .min(TICK);
        let timeout = wake.as_millis().min(i32::MAX as u128) as libc::c_int;
        // Round a sub-millisecond wait up rather than spin at 0.
        let timeout = if timeout == 0 && !wake.is_zero() {
            1
        } else {
            timeout
        };
        // SAFETY: `pollfds` is a live array of that many pollfd.
        let ready =
            unsafe { libc::poll(pollfds.as_mut_ptr(), pollfds.len() as libc::nfds_t, timeout) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(RelayError::Poll(e));
        }
        for (port, socket) in sockets.iter().enumerate() {
            if pollfds[port].revents == 0 {
                continue;
            }
            for _ in 0..BURST {
                let received = socket
                    .recv(&mut buf)
                    .map_err(|source| RelayError::Receive {
                        iface: socket.name.clone(),
                        source,
                    })?;
                let Some(r) = received else { break };
                let frame = buf[..r.len].to_vec();
                engine.receive(port, frame, r.csum_not_ready, Instant::now(), &mut out);
                send_all(&sockets, &mut out, &mut engine.stats, &mut reported_error);
            }
        }
        engine.due(Instant::now(), &mut out);
        send_all(&sockets, &mut out, &mut engine.stats, &mut reported_error);
    }
    count_socket_drops(&sockets, &mut engine.stats);
    if let Some(path) = stats_file {
        write_stats(path, &engine.stats)?;
    }
    Ok(engine.stats)
}

fn count_socket_drops(sockets: &[PacketSocket], stats: &mut Stats) {
    // A socket whose count cannot be read has dropped nothing we know of.
    let dropped: u64 = sockets.iter().filter_map(|s| s.take_drops().ok()).sum();
    stats.socket_drops += dropped;
}

fn send_all(sockets: &[PacketSocket], out: &mut Output, stats: &mut Stats, reported: &mut bool) {
    for (port, frame) in out.drain(..) {
        match sockets[port].send(&frame) {
            Ok(()) => stats.frames_out += 1,
            Err(e) => {
                stats.send_errors += 1;
                if !*reported {
                    *reported = true;
                    eprintln!(
                        "vrdma-relay: cannot send a frame of {} bytes on {}: {e} (counted in \
                         send_errors; this is said once)",
                        frame.len(),
                        sockets[port].name
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::frame::tests::udp_frame;
    use super::*;

    const A: [u8; 6] = [2, 0, 0, 0, 0, 1];
    const B: [u8; 6] = [2, 0, 0, 0, 0, 2];

    /// A RoCE frame from A to B with `n` in its payload.
    fn roce(n: u32) -> Vec<u8> {
        udp_frame(ROCE_V2_PORT, &n.to_be_bytes().repeat(8))
    }

    fn frame_from(src: [u8; 6], dst: [u8; 6], ethertype: u16) -> Vec<u8> {
        let mut f = dst.to_vec();
        f.extend_from_slice(&src);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(&[0; 46]);
        f
    }

    /// Feeds `frames` from port 0, after B announced itself on port 1.
    fn relay(faults: Faults, frames: impl IntoIterator<Item = Vec<u8>>) -> (Output, Stats) {
        let mut e = Engine::new(faults, 3);
        let mut out = Output::new();
        let now = Instant::now();
        e.receive(1, frame_from(B, [0xff; 6], 0x0806), false, now, &mut out);
        out.clear();
        for f in frames {
            e.receive(0, f, false, now, &mut out);
        }
        e.due(now + Duration::from_secs(1), &mut out);
        (out, e.stats)
    }

    #[test]
    fn it_learns_where_addresses_are_and_floods_the_rest() {
        let mut e = Engine::new(Faults::default(), 3);
        let mut out = Output::new();
        let now = Instant::now();
        e.receive(0, frame_from(A, [0xff; 6], 0x0806), false, now, &mut out);
        let ports: Vec<usize> = out.drain(..).map(|(p, _)| p).collect();
        assert_eq!(ports, [1, 2], "a broadcast is flooded");
        e.receive(1, frame_from(B, A, 0x0806), false, now, &mut out);
        let ports: Vec<usize> = out.drain(..).map(|(p, _)| p).collect();
        assert_eq!(ports, [0], "A was seen on port 0");
        e.receive(
            0,
            frame_from(A, [2, 9, 9, 9, 9, 9], 0x0800),
            false,
            now,
            &mut out,
        );
        assert_eq!(out.len(), 2, "an unknown destination is flooded");
        assert_eq!(e.stats.flooded, 2);
    }

    #[test]
    fn without_faults_roce_passes_intact_and_in_order() {
        let frames: Vec<Vec<u8>> = (0..100).map(roce).collect();
        let (out, stats) = relay(Faults::default(), frames.clone());
        let sent: Vec<Vec<u8>> = out.into_iter().map(|(_, f)| f).collect();
        assert_eq!(sent, frames);
        assert_eq!((stats.roce, stats.dropped), (100, 0));
    }

    #[test]
    fn only_roce_is_harmed() {
        let all = Faults {
            drop: 1.0,
            ..Faults::default()
        };
        let other = udp_frame(4792, b"not roce");
        let mut arp = frame_from(A, B, 0x0806);
        arp[20] = 0x42;
        let (out, stats) = relay(all, [roce(1), other.clone(), arp.clone()]);
        let sent: Vec<Vec<u8>> = out.into_iter().map(|(_, f)| f).collect();
        assert_eq!(sent, [other, arp]);
        assert_eq!((stats.roce, stats.dropped), (1, 1));
    }

    #[test]
    fn the_same_seed_makes_the_same_choices() {
        let faults = Faults {
            drop: 0.3,
            dup: 0.2,
            corrupt: 0.2,
            truncate: 0.1,
            reorder: 0.2,
            seed: 7,
            ..Faults::default()
        };
        let frames = || (0..500).map(roce);
        let (a, sa) = relay(faults.clone(), frames());
        let (b, sb) = relay(faults.clone(), frames());
        assert_eq!((a, sa.clone()), (b, sb));
        let (c, _) = relay(Faults { seed: 8, ..faults }, frames());
        assert_ne!(c.len(), 0);
        assert!(sa.dropped > 100 && sa.dropped < 200, "{sa:?}");
    }

    #[test]
    fn a_reordered_frame_comes_after_the_next_k() {
        let faults = Faults {
            reorder: 1.0,
            reorder_gap: 2,
            ..Faults::default()
        };
        let mut e = Engine::new(faults, 2);
        let mut out = Output::new();
        let now = Instant::now();
        e.receive(1, frame_from(B, [0xff; 6], 0x0806), false, now, &mut out);
        out.clear();
        // Every RoCE frame is held: non-RoCE frames pass it.
        e.receive(0, roce(1), false, now, &mut out);
        assert!(out.is_empty());
        let other = udp_frame(53, b"x");
        e.receive(0, other.clone(), false, now, &mut out);
        e.receive(0, other.clone(), false, now, &mut out);
        let sent: Vec<Vec<u8>> = out.drain(..).map(|(_, f)| f).collect();
        assert_eq!(sent, [other.clone(), other.clone(), roce(1)]);
        // A held frame goes after its timeout if nothing passes it.
        e.receive(0, roce(2), false, now, &mut out);
        assert!(out.is_empty());
        assert_eq!(e.next_deadline(), Some(now + Duration::from_millis(10)));
        e.due(now + Duration::from_millis(10), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(e.stats.reordered, 2);
    }

    #[test]
    fn a_delayed_frame_waits_its_time() {
        let faults = Faults {
            delay: Duration::from_micros(200),
            delay_rate: 1.0,
            ..Faults::default()
        };
        let mut e = Engine::new(faults, 2);
        let mut out = Output::new();
        let now = Instant::now();
        e.receive(1, frame_from(B, [0xff; 6], 0x0806), false, now, &mut out);
        out.clear();
        e.receive(0, roce(1), false, now, &mut out);
        e.due(now + Duration::from_micros(199), &mut out);
        assert!(out.is_empty());
        e.due(now + Duration::from_micros(200), &mut out);
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn duplicates_truncations_and_corruptions_are_counted_and_seen() {
        let faults = Faults {
            dup: 1.0,
            truncate: 1.0,
            corrupt: 1.0,
            ..Faults::default()
        };
        let (out, stats) = relay(faults, [roce(5)]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], out[1]);
        assert!(out[0].1.len() < roce(5).len());
        assert_eq!(
            (stats.duplicated, stats.truncated, stats.corrupted),
            (1, 1, 1)
        );
    }

    #[test]
    fn rates_outside_0_to_1_are_refused() {
        let bad = Faults {
            corrupt: 1.5,
            ..Faults::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(RelayError::Rate {
                name: "corrupt",
                ..
            })
        ));
    }
}
