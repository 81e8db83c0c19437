//! The victim: a well-behaved tenant with verified traffic and a canary
//! region nobody may write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use vrdma_guest_driver::{
    CompletionQueue, MemoryRegion, QueuePair, RecvWr, SendPayload, SendWr, WorkCompletion,
};
use vrdma_spec::qp_state::mask;
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::{access, QpState, SendOpcode, WcStatus};
use vrdma_tests::daemon::Hostd;
use vrdma_tests::rng::Rng;
use vrdma_tests::tenant::{
    bring_up, connect, default_caps, rdma, read_mr, wait_completions, Connection, Tenant,
};

use crate::*;

/// The well-behaved tenant. Its traffic runs between two of its own QPs
/// (`qa` → `qb`, PD `t.pd`, CQ `t.cq`); a separate PD holds the canary and
/// the QP it exposes to the attacker, as a server exposes read-only data.
/// Fields drop in order: objects before the device.
pub(crate) struct Victim {
    /// Connected to the attacker's current link QP (re-connected when the
    /// attacker asks, as a server accepts a new connection).
    pub(crate) exposed: Mutex<QueuePair>,
    pub(crate) qa: QueuePair,
    pub(crate) qb: QueuePair,
    /// `REMOTE_READ` only: its rkey exists, and no one may write it.
    pub(crate) canary: MemoryRegion,
    pub(crate) src: MemoryRegion,
    pub(crate) dst: MemoryRegion,
    pub(crate) exposed_cq: CompletionQueue,
    pub(crate) t: Tenant,
    pub(crate) canary_bytes: Vec<u8>,
}

/// How the victim's exposed QP is connected: it grants every remote
/// access (the canary's own access flags must stop writes), and answers a
/// SEND without a receive with the shortest RNR delay.
pub(crate) const EXPOSED: Connection = Connection {
    access: access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
    rnr_retry: 7,
    min_rnr_timer: 1,
    ..Connection::DEFAULT
};

impl Victim {
    pub(crate) fn start(hostd: &Hostd, seed: u64) -> Self {
        let t = Tenant::start(hostd, "alpha");
        let qa = t.qp(default_caps());
        let qb = t.qp(default_caps());
        connect(&t, &qa, &t, &qb, Connection::default());
        let src = t.pd.alloc_mr(REGION, RW).expect("victim src");
        let dst = t.pd.alloc_mr(REGION, RW).expect("victim dst");
        let exposed_pd = t.ctx.alloc_pd().expect("exposed PD");
        let exposed_cq = t.ctx.create_cq(64, 0).expect("exposed CQ");
        let canary = exposed_pd
            .alloc_mr(REGION, access::REMOTE_READ)
            .expect("canary");
        let canary_bytes = Rng(seed ^ 0xca4a).bytes(REGION);
        canary.write(0, &canary_bytes).expect("fill the canary");
        let exposed = Mutex::new(rc_qp(&exposed_pd, &exposed_cq));
        Victim {
            exposed,
            qa,
            qb,
            canary,
            src,
            dst,
            exposed_cq,
            t,
            canary_bytes,
        }
    }

    pub(crate) fn assert_canary_intact(&self) {
        let now = read_mr(&self.canary, 0, REGION);
        if let Some(i) = (0..REGION).find(|&i| now[i] != self.canary_bytes[i]) {
            panic!(
                "the victim's canary changed at byte {i}: {:#04x} instead of {:#04x}",
                now[i], self.canary_bytes[i]
            );
        }
    }

    /// Everything an attacker may know or learn about the victim.
    pub(crate) fn secrets(&self) -> Secrets {
        let key = |mr: &MemoryRegion| (mr.iova(), mr.lkey(), mr.rkey());
        Secrets {
            gid: self.t.gid,
            canary: key(&self.canary),
            traffic: [key(&self.src), key(&self.dst)],
            qpns: [
                self.qa.qp_num(),
                self.qb.qp_num(),
                self.exposed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .qp_num(),
            ],
        }
    }

    /// Resets the exposed QP and connects it to `peer_qpn` at `peer_gid`.
    pub(crate) fn accept(&self, peer_qpn: u32, peer_gid: [u8; 16]) -> u32 {
        let exposed = self.exposed.lock().unwrap_or_else(|e| e.into_inner());
        exposed
            .modify(&to_state(QpState::Reset), mask::STATE)
            .expect("reset the exposed QP");
        bring_up(&exposed, peer_qpn, peer_gid, EXPOSED).expect("connect the exposed QP");
        exposed.qp_num()
    }
}

/// What the victim did, all of it verified.
#[derive(Debug, Default)]
pub(crate) struct TrafficReport {
    pub(crate) writes: u64,
    pub(crate) reads: u64,
    pub(crate) sends: u64,
    pub(crate) bytes: u64,
}

/// The victim's traffic until `stop`: WRITE, READ and SEND with random
/// lengths and offsets, every completion successful and every byte checked
/// on the other side.
pub(crate) fn victim_traffic(v: &Victim, seed: u64, stop: &AtomicBool) -> TrafficReport {
    let mut rng = Rng(seed ^ 0x0071_c714);
    let mut report = TrafficReport::default();
    let mut wr_id = 0u64;
    let success = |wcs: &[WorkCompletion], ids: &[u64]| {
        let mut got: Vec<_> = wcs.iter().map(|wc| wc.wr_id).collect();
        got.sort_unstable();
        assert_eq!(got, ids, "victim completions {wcs:?}");
        for wc in wcs {
            assert_eq!(wc.status, WcStatus::Success, "victim completion {wc:?}");
        }
    };
    while !stop.load(Ordering::Relaxed) {
        wr_id += 1;
        let len = 1 + rng.below(16 * KIB as u64) as usize;
        let off = rng.below(32 * KIB as u64) as usize;
        let data = rng.bytes(len);
        let (landed, kind) = match wr_id % 3 {
            kind @ (0 | 1) => {
                // A WRITE from src[0..] into dst[off..], or a READ of
                // dst[off..] into src[32 KiB..].
                let write = kind == 0;
                let (op, filled, filled_at, local_at) = if write {
                    (SendOpcode::RdmaWrite, &v.src, 0, 0)
                } else {
                    (SendOpcode::RdmaRead, &v.dst, off, 32 * KIB)
                };
                filled.write(filled_at, &data).expect("fill");
                let sge = [v.src.sge(local_at as u64, len as u32)];
                let wr = rdma(wr_id, op, &sge, v.dst.iova() + off as u64, v.dst.rkey());
                v.qa.post_send(&[wr]).expect("victim post");
                success(&wait_completions(&v.t.cq, 1), &[wr_id]);
                if write {
                    report.writes += 1;
                    (read_mr(&v.dst, off, len), "WRITE")
                } else {
                    report.reads += 1;
                    (read_mr(&v.src, 32 * KIB, len), "READ")
                }
            }
            _ => {
                v.src.write(0, &data).expect("fill src");
                let recv_id = wr_id | 1 << 63;
                v.qb.post_recv(&[RecvWr {
                    wr_id: recv_id,
                    sg_list: &[v.dst.sge(off as u64, len as u32)],
                }])
                .expect("victim post RECV");
                let sge = [v.src.sge(0, len as u32)];
                let mut wr = SendWr::new(wr_id, SendOpcode::Send, SendPayload::Sges(&sge));
                wr.flags |= SIGNALED;
                v.qa.post_send(&[wr]).expect("victim post SEND");
                let wcs = wait_completions(&v.t.cq, 2);
                success(&wcs, &[wr_id, recv_id]);
                let recv = wcs.iter().find(|wc| wc.wr_id == recv_id);
                assert_eq!(recv.map(|wc| wc.byte_len), Some(len as u32));
                report.sends += 1;
                (read_mr(&v.dst, off, len), "SEND")
            }
        };
        assert!(
            landed == data,
            "victim {kind} #{wr_id} of {len} bytes at {off}: data differs on the other side"
        );
        report.bytes += len as u64;
    }
    report
}

/// What the attacker knows of the victim: (iova, lkey, rkey) of its MRs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Secrets {
    /// Its GID (what a connection towards it names).
    pub(crate) gid: [u8; 16],
    pub(crate) canary: (u64, u32, u32),
    pub(crate) traffic: [(u64, u32, u32); 2],
    /// The traffic QPs `qa`, `qb` and the exposed QP.
    pub(crate) qpns: [u32; 3],
}

impl Secrets {
    pub(crate) fn keys(&self) -> Vec<u32> {
        let mut keys = vec![self.canary.1, self.canary.2];
        for (_, lkey, rkey) in self.traffic {
            keys.extend([lkey, rkey]);
        }
        keys
    }
}
