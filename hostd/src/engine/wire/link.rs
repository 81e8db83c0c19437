//! An in-memory network between engines, for the transport's unit tests:
//! a [`PacketIo`] whose sends become whole IPv4 datagrams (the headers a
//! kernel would write: ID 0, DF) in the queue of the engine whose GIDs
//! they are addressed to, with faults a test asks for. The real queues
//! (UDP and raw sockets) are tested in `hostd/tests/packet_io.rs` and the
//! multi-host tests; this one makes loss, duplication, reordering and
//! corruption deterministic.

use std::collections::VecDeque;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_roce::{write_ipv4_udp_header, Ipv4Meta};

use crate::net::io::{InPacket, IoCounters, OutPacket, PacketIo, MAX_IN_PACKET};

/// What the network does to the packets it carries: each fault hits a
/// packet with probability 1/n (0: never), drawn from a seeded generator
/// (periodic faults could hit the same packet of every retransmission).
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    pub drop_one_in: u32,
    /// Sent twice.
    pub dup_one_in: u32,
    /// Held back behind the next packet.
    pub swap_one_in: u32,
    /// A bit of its UDP payload flipped.
    pub corrupt_one_in: u32,
    pub seed: u64,
}

/// One end's inbox and the addresses it owns.
#[derive(Debug)]
struct Port {
    gids: Vec<Ipv4Addr>,
    inbox: VecDeque<Vec<u8>>,
    ready: EventFd,
}

/// The shared medium.
#[derive(Debug, Default)]
struct Medium {
    ports: Vec<Port>,
    faults: Faults,
    /// The fault generator's state.
    count: u64,
    /// A packet held back, sent after the next one.
    held: Option<Vec<u8>>,
    /// Packets carried, and packets the faults harmed.
    carried: u64,
    harmed: u64,
}

/// The network: hand out one end per engine.
#[derive(Debug, Clone, Default)]
pub struct Link(Arc<Mutex<Medium>>);

impl Link {
    fn medium(&self) -> MutexGuard<'_, Medium> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An end owning `gids`.
    pub fn end(&self, gids: &[Ipv4Addr]) -> LinkIo {
        let mut m = self.medium();
        let ready = EventFd::new(EFD_NONBLOCK).unwrap_or_else(|e| panic!("eventfd: {e}"));
        let fd = ready.as_raw_fd();
        m.ports.push(Port {
            gids: gids.to_vec(),
            inbox: VecDeque::new(),
            ready,
        });
        LinkIo {
            link: self.clone(),
            port: m.ports.len() - 1,
            fd,
        }
    }

    /// From now on, `faults` apply.
    pub fn set_faults(&self, faults: Faults) {
        self.medium().faults = faults;
    }

    /// Every packet waiting in an inbox is lost (a test's precise loss).
    pub fn lose_queued(&self) -> usize {
        let mut m = self.medium();
        m.ports
            .iter_mut()
            .map(|p| std::mem::take(&mut p.inbox).len())
            .sum()
    }

    /// Packets harmed by faults so far.
    pub fn harmed(&self) -> u64 {
        self.medium().harmed
    }
}

/// One engine's end of the [`Link`].
#[derive(Debug)]
pub struct LinkIo {
    link: Link,
    port: usize,
    fd: RawFd,
}

impl Medium {
    fn deliver(&mut self, dst: Ipv4Addr, datagram: Vec<u8>) {
        if let Some(p) = self.ports.iter_mut().find(|p| p.gids.contains(&dst)) {
            p.inbox.push_back(datagram);
            let _ = p.ready.write(1);
        }
    }

    /// The next number of the seeded generator (xorshift64*).
    fn next(&mut self) -> u64 {
        let mut x = self.count ^ self.faults.seed ^ 0x9e37_79b9_7f4a_7c15;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.count = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn hits(&mut self, one_in: u32) -> bool {
        one_in != 0 && self.next().is_multiple_of(u64::from(one_in))
    }

    fn carry(&mut self, dst: Ipv4Addr, mut datagram: Vec<u8>) {
        self.carried += 1;
        let f = self.faults;
        if self.hits(f.drop_one_in) {
            self.harmed += 1;
            return;
        }
        if self.hits(f.corrupt_one_in) && datagram.len() > 40 {
            self.harmed += 1;
            let r = self.next() as usize;
            let i = 28 + r % (datagram.len() - 28);
            datagram[i] ^= 1 << (r % 8);
        }
        if self.hits(f.dup_one_in) {
            self.harmed += 1;
            self.deliver(dst, datagram.clone());
        }
        if self.held.is_none() && self.hits(f.swap_one_in) {
            // Kept for after the next packet.
            self.harmed += 1;
            self.held = Some(datagram);
            return;
        }
        self.deliver(dst, datagram);
        if let Some(held) = self.held.take() {
            let to = Ipv4Addr::new(held[16], held[17], held[18], held[19]);
            self.deliver(to, held);
        }
    }
}

impl PacketIo for LinkIo {
    fn send(&mut self, batch: &[OutPacket]) -> io::Result<usize> {
        let mut m = self.link.medium();
        for p in batch {
            let payload = p.payload();
            let mut datagram = vec![0u8; 28 + payload.len()];
            let meta = Ipv4Meta::outgoing(p.src, p.dst, self.src_port());
            write_ipv4_udp_header(&mut datagram, &meta, p.tos, 64, payload.len())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            datagram[28..].copy_from_slice(payload);
            m.carry(p.dst, datagram);
        }
        Ok(batch.len())
    }

    fn recv(&mut self, bufs: &mut [InPacket]) -> io::Result<usize> {
        let mut m = self.link.medium();
        let Some(port) = m.ports.get_mut(self.port) else {
            return Ok(0);
        };
        let _ = port.ready.read();
        let mut n = 0;
        while n < bufs.len() {
            let Some(d) = port.inbox.pop_front() else {
                break;
            };
            let len = d.len().min(MAX_IN_PACKET);
            bufs[n].buf[..len].copy_from_slice(&d[..len]);
            bufs[n].len = len;
            n += 1;
        }
        Ok(n)
    }

    fn rx_fd(&self) -> RawFd {
        self.fd
    }

    fn src_port(&self) -> u16 {
        0xc000 + self.port as u16
    }

    fn counters(&self) -> IoCounters {
        IoCounters::default()
    }
}
