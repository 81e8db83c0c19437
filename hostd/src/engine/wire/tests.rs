//! The RC transport between two engines ("hosts") over the in-memory
//! [`Link`]: every operation byte-checked, then the same under loss,
//! duplication, reordering and corruption; RNR, dead peers, access errors
//! and strangers' packets.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_hostd_protocol::messages::{QpConnection, QpModify};
use vrdma_spec::ring::Cqe;
use vrdma_spec::verbs::{QpState, SendOpcode, WcOpcode, WcStatus};
use vrdma_tenant_policy::{Policy, PriorityClass};

use super::link::{Faults, Link};
use super::Wire;
use crate::engine::testing::{connection, gid, remote, send, sge, tenant, Side, CAPS, IOVA};
use crate::engine::Engine;
use crate::net::directory::{Directory, DirectoryError, GidEntry, HostEntry};
use crate::scheduler::Scheduler;
use crate::seccomp::Threads;

/// A directory that knows a fixed set of GIDs (the static and etcd
/// directories have their own tests).
pub(super) struct Known(pub(super) HashMap<Ipv4Addr, GidEntry>);

impl Directory for Known {
    fn lookup(&self, gid: Ipv4Addr) -> Option<GidEntry> {
        self.0.get(&gid).cloned()
    }
    fn hosts(&self) -> Vec<HostEntry> {
        Vec::new()
    }
    fn publish(&self, _: &GidEntry) -> Result<(), DirectoryError> {
        Ok(())
    }
    fn withdraw(&self, _: Ipv4Addr) -> Result<(), DirectoryError> {
        Ok(())
    }
    fn generation(&self) -> u64 {
        1
    }
    fn reload(&self, _: &Policy) -> Result<Vec<String>, DirectoryError> {
        Ok(Vec::new())
    }
    fn start(&self, _: &Threads) -> Result<(), DirectoryError> {
        Ok(())
    }
    fn cluster_file(&self) -> PathBuf {
        PathBuf::new()
    }
}

pub(super) fn ip(n: u16) -> Ipv4Addr {
    Ipv4Addr::from(vrdma_spec::gid::ipv4_of(&gid(n)).unwrap_or([0; 4]))
}

/// Two hosts, one device and QP each: A (GID n=10, QP 100) on host "ha",
/// B (n=20, QP 200) on "hb".
pub(super) struct Hosts {
    pub(super) link: Link,
    pub(super) a: Engine,
    pub(super) b: Engine,
    pub(super) sa: Side,
    pub(super) sb: Side,
    pub(super) now: Instant,
    /// B's host is down (its engine runs no rounds).
    b_down: bool,
}

/// GID n=10 on host "ha" and n=20 on "hb", both in tenant t's network.
fn directory() -> Arc<dyn Directory> {
    directory_with(&[(10, "ha", "t"), (20, "hb", "t")])
}

/// A directory of `(n, host, network)` entries.
pub(super) fn directory_with(entries: &[(u16, &str, &str)]) -> Arc<dyn Directory> {
    let entry = |&(n, host, network): &(u16, &str, &str)| {
        (
            ip(n),
            GidEntry {
                gid: ip(n),
                host: host.into(),
                tenant: "t".into(),
                network: network.into(),
            },
        )
    };
    Arc::new(Known(entries.iter().map(entry).collect()))
}

impl Hosts {
    pub(super) fn new(mtu: u32) -> Self {
        Self::with_directory(mtu, directory())
    }

    /// [`Hosts::new`] with `directory` as both hosts' view.
    pub(super) fn with_directory(mtu: u32, directory: Arc<dyn Directory>) -> Self {
        let link = Link::default();
        let policy = tenant("t", PriorityClass::Normal);
        let mut a = Engine::new(Scheduler::new(None));
        let mut b = Engine::new(Scheduler::new(None));
        let mut sa = Side::new(&mut a, 1, 10, &policy);
        let mut sb = Side::new(&mut b, 1, 20, &policy);
        sa.add_qp(&mut a, 100, CAPS);
        sb.add_qp(&mut b, 200, CAPS);
        a.attach_wire(Wire::new(
            Box::new(link.end(&[ip(10)])),
            Arc::clone(&directory),
        ));
        b.attach_wire(Wire::new(Box::new(link.end(&[ip(20)])), directory));
        let mut hosts = Hosts {
            link,
            a,
            b,
            sa,
            sb,
            now: Instant::now(),
            b_down: false,
        };
        hosts.connect(mtu, |_| {});
        hosts
    }

    fn connect(&mut self, mtu: u32, tweak: impl Fn(&mut QpConnection)) {
        for (engine, vqpn, dest, n) in [(&mut self.a, 100, 200, 20), (&mut self.b, 200, 100, 10)] {
            for state in [QpState::Init, QpState::Rtr, QpState::Rts] {
                let connection = (state != QpState::Init).then(|| {
                    let mut c = connection(gid(n), dest);
                    c.path_mtu = mtu;
                    c.retry_cnt = 7;
                    c.timeout = 10;
                    c.sq_psn = 0xff_fff0;
                    c.rq_psn = 0xff_fff0;
                    tweak(&mut c);
                    c
                });
                let m = QpModify {
                    vqpn,
                    state: state.into(),
                    connection,
                    access: None,
                    qkey: None,
                };
                engine.modify_qp(1, &m).expect("modify");
            }
        }
    }

    /// Runs both hosts until neither has work, advancing the clock past
    /// timers when both are idle, for up to `limit` of simulated time.
    /// Returns A's and B's completions.
    pub(super) fn run_for(&mut self, limit: Duration) -> (Vec<Cqe>, Vec<Cqe>) {
        let end = self.now + limit;
        let (mut ca, mut cb) = (Vec::new(), Vec::new());
        while self.now < end {
            let mut worked = false;
            for _ in 0..200 {
                let ra = self.a.round(&[1], self.now);
                let rb = if self.b_down {
                    crate::engine::Round::default()
                } else {
                    self.b.round(&[1], self.now)
                };
                let w = ra.worked || ra.busy || rb.worked || rb.busy;
                worked |= w;
                if !w {
                    break;
                }
            }
            ca.extend(self.sa.poll());
            cb.extend(self.sb.poll());
            // Time passes between bursts of work as well as when idle
            // (work that never ends must not stop the clock).
            self.now += if worked {
                Duration::from_micros(20)
            } else {
                Duration::from_millis(1)
            };
        }
        (ca, cb)
    }
}

pub(super) fn status(c: &Cqe) -> WcStatus {
    WcStatus::try_from(c.status).unwrap_or(WcStatus::GeneralErr)
}

pub(super) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn every_rc_operation_moves_the_right_bytes_between_hosts() {
    for mtu in [256, 1024, 4096] {
        let mut h = Hosts::new(mtu);
        let (lkey_a, rkey_b, lkey_b) = (h.sa.lkey, h.sb.rkey, h.sb.lkey);
        // WRITE of 10,000 bytes (several packets, PSNs wrapping at 2^24).
        let data = pattern(10_000, 1);
        h.sa.fill(0, &data);
        let w = remote(send(1, SendOpcode::RdmaWrite), IOVA + 0x1000, rkey_b);
        h.sa.post_sges(0, &w, &[sge(IOVA, 10_000, lkey_a)]);
        // SEND with immediate into a posted receive.
        h.sb.post_recv(0, 9, &[sge(IOVA + 0x8000, 20_000, lkey_b)]);
        let mut s = send(2, SendOpcode::SendWithImm);
        s.imm_data = [1, 2, 3, 4];
        h.sa.post_sges(0, &s, &[sge(IOVA, 5000, lkey_a)]);
        // READ back 6,000 bytes B holds.
        let theirs = pattern(6000, 7);
        h.sb.fill(0x10000, &theirs);
        let r = remote(send(3, SendOpcode::RdmaRead), IOVA + 0x10000, rkey_b);
        h.sa.post_sges(0, &r, &[sge(IOVA + 0x20000, 6000, lkey_a)]);
        // Atomics on a counter of B's.
        h.sb.fill(0x30000, &40u64.to_le_bytes());
        let mut fa = remote(
            send(4, SendOpcode::AtomicFetchAndAdd),
            IOVA + 0x30000,
            rkey_b,
        );
        fa.compare_add = 2.into();
        h.sa.post_sges(0, &fa, &[sge(IOVA + 0x30000, 8, lkey_a)]);
        let mut cs = remote(send(5, SendOpcode::AtomicCmpAndSwp), IOVA + 0x30000, rkey_b);
        cs.compare_add = 42.into();
        cs.swap = 7.into();
        h.sa.post_sges(0, &cs, &[sge(IOVA + 0x30008, 8, lkey_a)]);
        let (a, b) = h.run_for(Duration::from_millis(200));
        let got: Vec<_> = a.iter().map(|c| (c.wr_id.get(), status(c))).collect();
        assert_eq!(
            got,
            (1..=5).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>(),
            "mtu {mtu}"
        );
        assert_eq!(h.sb.bytes(0x1000, 10_000), data, "WRITE, mtu {mtu}");
        assert_eq!(b.len(), 1, "mtu {mtu}");
        assert_eq!(status(&b[0]), WcStatus::Success);
        assert_eq!(b[0].opcode, u8::from(WcOpcode::Recv));
        assert_eq!(b[0].byte_len.get(), 5000);
        assert_eq!(b[0].imm_data, [1, 2, 3, 4]);
        assert_eq!((b[0].qp_num.get(), b[0].src_qp.get()), (200, 100));
        assert_eq!(h.sb.bytes(0x8000, 5000), data[..5000]);
        assert_eq!(h.sa.bytes(0x20000, 6000), theirs, "READ, mtu {mtu}");
        assert_eq!(
            h.sa.bytes(0x30000, 8),
            40u64.to_le_bytes(),
            "fetch-add's original"
        );
        assert_eq!(
            h.sa.bytes(0x30008, 8),
            42u64.to_le_bytes(),
            "cmp-swap's original"
        );
        assert_eq!(
            h.sb.bytes(0x30000, 8),
            7u64.to_le_bytes(),
            "40 + 2, then swapped"
        );
    }
}

#[test]
fn a_hostile_network_loses_no_byte_and_runs_no_atomic_twice() {
    for seed in [17, 34, 51] {
        hostile_run(seed);
    }
}

/// 20 rounds of WRITE, fetch-add and READ through a network that drops,
/// duplicates, reorders and corrupts packets as `seed` draws.
fn hostile_run(seed: u64) {
    let mut h = Hosts::new(1024);
    h.link.set_faults(Faults {
        drop_one_in: 20,
        dup_one_in: 20,
        swap_one_in: 10,
        corrupt_one_in: 25,
        seed,
    });
    let (lkey_a, rkey_b, lkey_b) = (h.sa.lkey, h.sb.rkey, h.sb.lkey);
    let data = pattern(3000, 3);
    h.sa.fill(0, &data);
    h.sb.fill(0x30000, &0u64.to_le_bytes());
    // Away from where the WRITEs land.
    let theirs = pattern(2500, 9);
    h.sb.fill(0x60000, &theirs);
    let mut expect = Vec::new();
    for i in 0..20u64 {
        let wr = 10 * i;
        let w = remote(
            send(wr, SendOpcode::RdmaWrite),
            IOVA + 0x1000 + i * 4096,
            rkey_b,
        );
        h.sa.post_sges(0, &w, &[sge(IOVA, 3000, lkey_a)]);
        let mut fa = remote(
            send(wr + 1, SendOpcode::AtomicFetchAndAdd),
            IOVA + 0x30000,
            rkey_b,
        );
        fa.compare_add = 1.into();
        h.sa.post_sges(0, &fa, &[sge(IOVA + 0x40000 + i * 8, 8, lkey_a)]);
        let r = remote(send(wr + 2, SendOpcode::RdmaRead), IOVA + 0x60000, rkey_b);
        h.sa.post_sges(0, &r, &[sge(IOVA + 0x50000 + i * 4096, 2500, lkey_a)]);
        expect.extend([wr, wr + 1, wr + 2]);
        // The QP's ring has 64 slots: run between batches.
        if i % 5 == 4 {
            let (a, _) = h.run_for(Duration::from_secs(5));
            if !a.iter().all(|c| status(c) == WcStatus::Success) {
                let pa = h.a.wire().map(|w| w.peers.snapshot());
                let pb = h.b.wire().map(|w| w.peers.snapshot());
                panic!("{a:?}\nA: {pa:#?}\nB: {pb:#?}");
            }
            let got: Vec<u64> = a.iter().map(|c| c.wr_id.get()).collect();
            let want = std::mem::take(&mut expect);
            assert_eq!(got, want, "completions in posting order");
        }
    }
    assert!(
        h.link.harmed() > 20,
        "faults were applied: {}",
        h.link.harmed()
    );
    for i in 0..20u64 {
        assert!(h.sb.bytes(0x1000 + i * 4096, 3000) == data, "WRITE {i}");
        assert!(h.sa.bytes(0x50000 + i * 4096, 2500) == theirs, "READ {i}");
    }
    // 20 fetch-adds of 1: each ran once, each saw a distinct original.
    assert_eq!(h.sb.bytes(0x30000, 8), 20u64.to_le_bytes());
    let mut seen: Vec<u64> = (0..20u64)
        .map(|i| {
            let b = h.sa.bytes(0x40000 + i * 8, 8);
            u64::from_le_bytes(b.try_into().unwrap_or([0xff; 8]))
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..20).collect::<Vec<_>>());
    let peers = h.a.wire().map(|w| w.peers.snapshot()).unwrap_or_default();
    let hb = peers
        .iter()
        .find(|p| p.host == "hb")
        .expect("peer hb counted");
    assert!(hb.retransmissions > 0 && hb.tx_packets > 100, "{hb:?}");
    let peers_b = h.b.wire().map(|w| w.peers.snapshot()).unwrap_or_default();
    let bad_icrc: u64 = peers_b.iter().filter_map(|p| p.drops.get("bad_icrc")).sum();
    assert!(bad_icrc > 0, "corrupted packets dropped at B: {peers_b:?}");
    let _ = lkey_b;
}

#[test]
fn a_send_without_a_receive_waits_for_one_rnr_nak_by_rnr_nak() {
    let mut h = Hosts::new(4096);
    let lkey_a = h.sa.lkey;
    h.sa.fill(0, b"late");
    let s = send(1, SendOpcode::Send);
    h.sa.post_sges(0, &s, &[sge(IOVA, 4, lkey_a)]);
    let (a, _) = h.run_for(Duration::from_millis(30));
    assert!(a.is_empty(), "no receive yet: the SEND waits");
    let nak = h.b.wire().map(|w| w.peers.snapshot()).unwrap_or_default();
    assert!(
        nak.iter()
            .any(|p| p.naks_sent.get("rnr").is_some_and(|&n| n > 0)),
        "{nak:?}"
    );
    let lkey_b = h.sb.lkey;
    h.sb.post_recv(0, 5, &[sge(IOVA + 0x100, 64, lkey_b)]);
    let (a, b) = h.run_for(Duration::from_millis(100));
    assert_eq!(a.len(), 1);
    assert_eq!(status(&a[0]), WcStatus::Success);
    assert_eq!(b.len(), 1);
    assert_eq!(h.sb.bytes(0x100, 4), b"late");
}

#[test]
fn a_dead_peer_fails_the_requester_with_retry_exceeded_within_its_timeout() {
    let mut h = Hosts::new(4096);
    h.connect(4096, |c| {
        c.retry_cnt = 2;
        c.timeout = 12; // 16.8 ms
    });
    h.b_down = true;
    let (lkey_a, rkey_b) = (h.sa.lkey, h.sb.rkey);
    let w = remote(send(1, SendOpcode::RdmaWrite), IOVA, rkey_b);
    h.sa.post_sges(0, &w, &[sge(IOVA, 64, lkey_a)]);
    let (a, _) = h.run_for(Duration::from_millis(40));
    assert!(a.is_empty(), "still retrying: {a:?}");
    let (a, _) = h.run_for(Duration::from_millis(100));
    assert_eq!(a.len(), 1);
    assert_eq!(status(&a[0]), WcStatus::RetryExcErr);
    assert!(h.sa.sq_error(0), "the QP is in ERR");
}

#[test]
fn a_destroyed_qp_acknowledges_again_what_it_took_and_nothing_new() {
    let mut h = Hosts::new(4096);
    let (lkey_a, rkey_b) = (h.sa.lkey, h.sb.rkey);
    h.sa.fill(0, b"last");
    let w = remote(send(1, SendOpcode::RdmaWrite), IOVA + 0x100, rkey_b);
    h.sa.post_sges(0, &w, &[sge(IOVA, 4, lkey_a)]);
    // B takes the WRITE and acknowledges it; the network loses the ACK and
    // B's program exits (its QP destroyed) before A hears anything.
    for _ in 0..20 {
        h.a.round(&[1], h.now);
        h.b.round(&[1], h.now);
        if h.sb.bytes(0x100, 4) == b"last" {
            break;
        }
    }
    assert_eq!(h.sb.bytes(0x100, 4), b"last", "B took the WRITE");
    assert!(h.link.lose_queued() >= 1, "B's ACK was lost");
    h.b.destroy_qp(1, 200).expect("destroy");
    // A message B never took is not acknowledged by the closed QP.
    let w = remote(send(2, SendOpcode::RdmaWrite), IOVA + 0x200, rkey_b);
    h.sa.post_sges(0, &w, &[sge(IOVA, 4, lkey_a)]);
    let (a, _) = h.run_for(Duration::from_millis(90));
    let got: Vec<_> = a.iter().map(|c| (c.wr_id.get(), status(c))).collect();
    assert_eq!(
        got,
        [(1, WcStatus::Success), (2, WcStatus::RetryExcErr)],
        "the first WRITE acknowledged again, the second never"
    );
    assert_eq!(
        h.sb.bytes(0x200, 4),
        [0; 4],
        "nothing written by the second"
    );
    let peers = h.b.wire().map(|w| w.peers.snapshot()).unwrap_or_default();
    let ha = peers.iter().find(|p| p.host == "ha").expect("host ha");
    assert!(ha.duplicates >= 1, "{ha:?}");
    assert!(ha.drops.get("unknown_qp") >= Some(&1), "{ha:?}");
}

#[test]
fn a_bad_rkey_fails_the_requester_only() {
    let mut h = Hosts::new(4096);
    let lkey_a = h.sa.lkey;
    let w = remote(send(1, SendOpcode::RdmaWrite), IOVA, 0xdead_beef);
    h.sa.post_sges(0, &w, &[sge(IOVA, 64, lkey_a)]);
    let (a, b) = h.run_for(Duration::from_millis(20));
    assert_eq!(a.len(), 1);
    assert_eq!(status(&a[0]), WcStatus::RemAccessErr);
    assert!(b.is_empty());
    assert!(!h.sb.sq_error(0), "the responder is unaffected");
}

#[test]
fn packets_from_strangers_are_dropped_and_counted() {
    let mut h = Hosts::new(4096);
    // A third "host" the directory does not know sends B a valid packet
    // for QP 200.
    let mut stranger = h.link.end(&[Ipv4Addr::new(127, 100, 0, 99)]);
    let mut pkt = crate::net::io::OutPacket::new();
    let bth = super::bth(super::op::WRITE_ONLY, 200, vrdma_roce::Psn::new(0xff_fff0));
    let mut hd = super::headers(bth);
    hd.reth = Some(vrdma_roce::Reth {
        va: IOVA,
        rkey: h.sb.rkey,
        dma_len: 4,
    });
    let meta = vrdma_roce::Ipv4Meta::outgoing(Ipv4Addr::new(127, 100, 0, 99), ip(20), 0xc002);
    let n = vrdma_roce::build(&mut pkt.buf[..], &hd, b"evil", &meta).expect("build");
    pkt.len = n;
    pkt.src = meta.src;
    pkt.dst = meta.dst;
    use crate::net::io::PacketIo;
    stranger.send(std::slice::from_ref(&pkt)).expect("send");
    h.sb.fill(0, b"good");
    let _ = h.run_for(Duration::from_millis(5));
    assert_eq!(h.sb.bytes(0, 4), b"good", "nothing written");
    let peers = h.b.wire().map(|w| w.peers.snapshot()).unwrap_or_default();
    assert_eq!(peers[0].drops.get("unknown_source"), Some(&1), "{peers:?}");
    // From a known GID (A's) to a QP number B does not have: dropped and
    // counted under A's host.
    let bth = super::bth(super::op::WRITE_ONLY, 0x999, vrdma_roce::Psn::new(0));
    hd.bth = bth;
    let meta = vrdma_roce::Ipv4Meta::outgoing(ip(10), ip(20), 0xc002);
    pkt.len = vrdma_roce::build(&mut pkt.buf[..], &hd, b"evil", &meta).expect("build");
    pkt.src = meta.src;
    stranger.send(std::slice::from_ref(&pkt)).expect("send");
    let _ = h.run_for(Duration::from_millis(5));
    assert_eq!(h.sb.bytes(0, 4), b"good", "nothing written");
    let peers = h.b.wire().map(|w| w.peers.snapshot()).unwrap_or_default();
    let ha = peers.iter().find(|p| p.host == "ha").expect("host ha");
    assert_eq!(ha.drops.get("unknown_qp"), Some(&1), "{ha:?}");
}

#[test]
fn a_rate_limit_holds_what_a_tenant_puts_on_the_wire() {
    let mut h = Hosts::new(4096);
    // A may send 1 MB/s after a 64 KiB burst.
    let mut t = tenant("t", PriorityClass::Normal);
    t.rate.send.bytes_per_sec = Some(1_000_000);
    t.rate.send.bytes_burst = Some(64 * 1024);
    h.a.configure_tenants(&[t], h.now);
    let (lkey_a, rkey_b) = (h.sa.lkey, h.sb.rkey);
    h.sa.fill(0, &pattern(16 * 1024, 5));
    for i in 0..20u64 {
        let w = remote(
            send(i, SendOpcode::RdmaWrite),
            IOVA + 0x1000 + i * 0x4000,
            rkey_b,
        );
        h.sa.post_sges(0, &w, &[sge(IOVA, 16 * 1024, lkey_a)]);
    }
    // 100 ms: the burst (4 WRITEs) and 100 KB of refill (6 more) at most.
    let (a, _) = h.run_for(Duration::from_millis(100));
    assert!(
        (5..=11).contains(&a.len()),
        "{} of 20 WRITEs of 16 KiB within 100 ms at 1 MB/s",
        a.len()
    );
    let peers = h.a.wire().map(|w| w.peers.snapshot()).unwrap_or_default();
    let sent: u64 = peers.iter().map(|p| p.tx_bytes).sum();
    assert!(
        sent < 64 * 1024 + 100_000 + 32 * 1024,
        "{sent} bytes on the wire in 100 ms"
    );
    // Given time, every one goes, with the right bytes.
    let (rest, _) = h.run_for(Duration::from_millis(400));
    assert_eq!(a.len() + rest.len(), 20);
    assert!((a.iter().chain(&rest)).all(|c| status(c) == WcStatus::Success));
    assert!(h.sb.bytes(0x1000 + 19 * 0x4000, 16 * 1024) == pattern(16 * 1024, 5));
}
