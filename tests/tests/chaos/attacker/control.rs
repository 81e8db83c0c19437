//! The attacker's control-path moves: the QP state machine walked wrong
//! and at random, quotas exhausted, a hijacked connection, refused
//! registrations and destroys.

use std::time::Duration;

use vrdma_guest_driver::{QpInitAttr, QueuePair, SendPayload, SendWr, WorkCompletion};
use vrdma_spec::control::QpAttr;
use vrdma_spec::qp_state::mask;
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::{access, QpState, QpType, SendOpcode, WcStatus};
use vrdma_tests::tenant::{bring_up, mask_to, wait_completions};

use super::*;
use crate::*;

impl Attacker<'_> {
    pub(super) fn fresh_qp(&self) -> QueuePair {
        let beta = self.beta();
        rc_qp(&beta.t.pd, &beta.t.cq)
    }

    pub(super) fn bogus_modify(&mut self) {
        let qp = self.fresh_qp();
        let (attr, attr_mask, expected): (QpAttr, u32, &[i32]) = match self.rng.below(6) {
            // RESET → RTR/RTS skips INIT.
            0 => (to_state(QpState::Rtr), mask::STATE, &[libc::EINVAL]),
            1 => (to_state(QpState::Rts), mask::STATE, &[libc::EINVAL]),
            // No such state.
            2 => (
                QpAttr {
                    qp_state: 8 + self.rng.below(248) as u8,
                    ..QpAttr::default()
                },
                mask::STATE,
                &[libc::EINVAL],
            ),
            // Mask bits that name nothing.
            3 => (
                QpAttr::default(),
                1 << (26 + self.rng.below(6)),
                &[libc::EINVAL],
            ),
            // A current state that is not the QP's.
            4 => (
                QpAttr {
                    qp_state: QpState::Init.into(),
                    cur_qp_state: QpState::Rts.into(),
                    ..QpAttr::default()
                },
                mask::STATE | mask::CUR_STATE,
                &[libc::EINVAL],
            ),
            // Alternate paths: not supported.
            _ => (QpAttr::default(), mask::ALT_PATH, &[libc::EOPNOTSUPP]),
        };
        let result = qp.modify(&attr, attr_mask).map_err(|e| e.errno());
        self.expect_errno("an invalid modify_qp", result, expected);
        assert_eq!(
            qp_state(&qp),
            u8::from(QpState::Reset),
            "{}: a refused modify_qp changed the QP",
            self.context()
        );
        qp.destroy()
            .unwrap_or_else(|e| panic!("{}: destroy: {e}", self.context()));
    }

    /// Random walks through the state machine: each step aims at a random
    /// state with the usual attribute mask for it (sometimes a bit off) and
    /// random values, towards the victim's or beta's own GID and QPs. A
    /// refused step changes nothing; an accepted one reaches its state.
    pub(super) fn random_modify(&mut self) {
        let qp = self.fresh_qp();
        let beta_gid = self.beta().t.gid;
        for _ in 0..6 {
            let target = [
                QpState::Reset,
                QpState::Init,
                QpState::Rtr,
                QpState::Rts,
                QpState::Sqd,
                QpState::Err,
            ][self.rng.below(6) as usize];
            // The usual mask for it: the state alone, or with the
            // attributes a connecting transition requires.
            let usual = mask_to(target);
            let attr_mask = if self.rng.chance(2) {
                usual ^ 1 << self.rng.below(21)
            } else {
                usual
            };
            let mut attr = QpAttr {
                qp_state: target.into(),
                qp_access_flags: (self.rng.next_u64() as u32 & 0x1f).into(),
                port_num: self.rng.below(3) as u8,
                path_mtu: self.rng.below(7) as u8,
                dest_qp_num: [
                    self.secrets.qpns[self.rng.below(3) as usize],
                    qp.qp_num(),
                    self.rng.next_u64() as u32 & 0xff_ffff,
                ][self.rng.below(3) as usize]
                    .into(),
                max_dest_rd_atomic: self.rng.below(32) as u8,
                max_rd_atomic: self.rng.below(32) as u8,
                min_rnr_timer: self.rng.below(40) as u8,
                timeout: self.rng.below(40) as u8,
                retry_cnt: self.rng.below(10) as u8,
                rnr_retry: self.rng.below(10) as u8,
                ..QpAttr::default()
            };
            let nobody = vrdma_spec::gid::ipv4_mapped((self.rng.next_u64() as u32).to_be_bytes());
            attr.ah_attr.dgid = [self.secrets.gid, beta_gid, nobody][self.rng.below(3) as usize];
            attr.ah_attr.is_global = u8::from(!self.rng.chance(8));
            attr.ah_attr.port_num = 1;
            let before = qp_state(&qp);
            let result = qp.modify(&attr, attr_mask);
            let after = qp_state(&qp);
            match result {
                Ok(()) => {
                    self.note("ok");
                    let reached = if attr_mask & mask::STATE != 0 {
                        u8::from(target)
                    } else {
                        before
                    };
                    assert_eq!(
                        after,
                        reached,
                        "{}: an accepted modify_qp({attr_mask:#x}) did not reach its state",
                        self.context()
                    );
                }
                Err(e) => {
                    self.note(format!("errno {}", e.errno()));
                    assert_eq!(
                        after,
                        before,
                        "{}: a refused modify_qp({attr_mask:#x}) changed the state ({e})",
                        self.context()
                    );
                }
            }
        }
        // Wherever the walk led, work aimed at the victim's memory fails.
        let (iova, _, rkey) = self.secrets.traffic[1];
        let id = self.wr_id();
        let mut wr = SendWr::new(id, SendOpcode::RdmaWrite, SendPayload::Inline(b"walk"));
        wr.flags |= SIGNALED;
        wr.remote_addr = iova;
        wr.rkey = rkey;
        if qp.post_send(&[wr]).is_ok() {
            let cq = &self.beta().t.cq;
            if let Some(wc) = collect(cq, 1, Duration::from_millis(100)).first() {
                self.note(format!("{:?}", wc.status));
                assert_ne!(wc.status, WcStatus::Success, "{}", self.context());
            }
        }
        qp.destroy()
            .unwrap_or_else(|e| panic!("{}: destroy: {e}", self.context()));
        // A late completion of that write must not confuse a later move.
        let mut batch = [WorkCompletion::default(); 4];
        while self.beta().t.cq.poll(&mut batch).expect("poll") > 0 {}
    }

    /// Beta takes every PD and QP its quota allows: the quota says
    /// ENOMEM, and the victim can still create both.
    pub(super) fn exhaust(&mut self) {
        let ctx = self.context();
        let beta = self.beta();
        let mut pds = Vec::new();
        let pd_errno = loop {
            match beta.t.ctx.alloc_pd() {
                Ok(pd) if pds.len() < 1000 => pds.push(pd),
                Ok(_) => panic!("{ctx}: no PD quota"),
                Err(e) => break e.errno(),
            }
        };
        let caps = vrdma_guest_driver::QpCapabilities {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut qps = Vec::new();
        let qp_errno = loop {
            let made = beta.t.pd.create_qp(&QpInitAttr {
                send_cq: &beta.t.cq,
                recv_cq: &beta.t.cq,
                cap: caps,
                qp_type: QpType::Rc,
                sq_sig_all: false,
                srq: None,
            });
            match made {
                Ok(qp) if qps.len() < 1000 => qps.push(qp),
                Ok(_) => panic!("{ctx}: no QP quota"),
                Err(e) => break e.errno(),
            }
        };
        let victim = &self.victim.t;
        let pd = victim
            .ctx
            .alloc_pd()
            .unwrap_or_else(|e| panic!("{ctx}: the victim's alloc_pd: {e}"));
        let qp = pd
            .create_qp(&QpInitAttr {
                send_cq: &victim.cq,
                recv_cq: &victim.cq,
                cap: caps,
                qp_type: QpType::Rc,
                sq_sig_all: false,
                srq: None,
            })
            .unwrap_or_else(|e| panic!("{ctx}: the victim's create_qp: {e}"));
        drop((qp, pd, qps, pds));
        self.expect_errno("a PD over quota", Err::<(), _>(pd_errno), &[libc::ENOMEM]);
        self.expect_errno("a QP over quota", Err::<(), _>(qp_errno), &[libc::ENOMEM]);
    }

    /// A QP of beta connected to one of the victim's QPs, which is not
    /// connected back to it: its SENDs (the victim posts receives) and
    /// WRITEs with the victim's real rkey are lost on the fabric.
    pub(super) fn hijack(&mut self) {
        let ctx = self.context();
        let target = self.secrets.qpns[self.rng.below(3) as usize];
        let victim_gid = self.secrets.gid;
        let (iova, _, rkey) = self.secrets.traffic[1];
        let id = self.wr_id();
        let write = self.rng.chance(2);
        let beta = self.beta();
        let cq = beta.t.ctx.create_cq(16, 0).expect("CQ");
        let qp = rc_qp(&beta.t.pd, &cq);
        bring_up(&qp, target, victim_gid, ATTACKER)
            .unwrap_or_else(|e| panic!("{ctx}: connect towards the victim: {e}"));
        let wr = if write {
            let mut wr = SendWr::new(id, SendOpcode::RdmaWrite, SendPayload::Inline(b"hijack"));
            wr.remote_addr = iova;
            wr.rkey = rkey;
            wr
        } else {
            SendWr::new(id, SendOpcode::Send, SendPayload::Inline(b"hijack"))
        };
        let mut wr = wr;
        wr.flags |= SIGNALED;
        qp.post_send(&[wr])
            .unwrap_or_else(|e| panic!("{ctx}: post: {e}"));
        let wc = wait_completions(&cq, 1)[0];
        self.expect_status(&wc, WcStatus::RetryExcErr);
    }

    pub(super) fn bad_registration(&mut self) {
        let choice = self.rng.below(3);
        let pd = &self.beta().t.pd;
        let (what, result) = match choice {
            0 => (
                "remote write without local write",
                pd.alloc_mr(4 * KIB, access::REMOTE_WRITE),
            ),
            1 => (
                "unknown access bits",
                pd.alloc_mr(4 * KIB, access::LOCAL_WRITE | 1 << 24),
            ),
            _ => ("a zero-length MR", pd.alloc_mr(0, access::LOCAL_WRITE)),
        };
        let result = result.map(drop).map_err(|e| e.errno());
        self.expect_errno(what, result, &[libc::EINVAL]);
    }

    pub(super) fn destroy_busy(&mut self) {
        let ctx = self.context();
        let beta = self.beta();
        let cq = beta.t.ctx.create_cq(16, 0).expect("CQ");
        let pd = beta.t.ctx.alloc_pd().expect("PD");
        let qp = rc_qp(&pd, &cq);
        let mr = pd.alloc_mr(4 * KIB, RW).expect("MR");
        let cq_err = cq.destroy().expect_err("a CQ a QP uses cannot go");
        let cq_errno = cq_err.errno();
        let cq = cq_err.object;
        drop(qp);
        let pd_err = pd.destroy().expect_err("a PD with an MR cannot go");
        let pd_errno = pd_err.errno();
        let pd = pd_err.object;
        mr.dereg().unwrap_or_else(|e| panic!("{ctx}: dereg: {e}"));
        pd.destroy()
            .unwrap_or_else(|e| panic!("{ctx}: dealloc_pd: {e}"));
        cq.destroy()
            .unwrap_or_else(|e| panic!("{ctx}: destroy_cq: {e}"));
        self.expect_errno(
            "destroying a busy CQ",
            Err::<(), _>(cq_errno),
            &[libc::EBUSY],
        );
        self.expect_errno(
            "destroying a busy PD",
            Err::<(), _>(pd_errno),
            &[libc::EBUSY],
        );
    }
}
