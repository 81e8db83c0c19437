//! The attacker's moves against work in flight: destroys, deregistrations
//! and errors under a burst, and its vdev killed (in the middle of traffic
//! or of control verbs) and restarted.

use std::time::{Duration, Instant};

use vrdma_guest_driver::{CompletionQueue, MemoryRegion, QpInitAttr, Sge};
use vrdma_spec::qp_state::mask;
use vrdma_spec::verbs::{access, QpState, QpType, SendOpcode, WcStatus};
use vrdma_tests::app_memory::AppMemory;
use vrdma_tests::tenant::{bring_up, default_caps, rdma, read_mr, wait_completions, Tenant};

use super::*;
use crate::*;

impl Attacker<'_> {
    /// Posts up to `n` signaled WRITEs of `src` (4 KiB, or up to 32 KiB)
    /// over the pair, round robin into the 32 KiB from `dst` (iova, rkey)
    /// in slots of the source's length; returns how many were posted.
    pub(super) fn burst(&mut self, n: usize, src: Sge, dst: (u64, u32)) -> usize {
        let first = self.next_wr + 1;
        self.next_wr += n as u64;
        let slot = (src.length as usize).max(4 * KIB);
        let slots = (32 * KIB / slot).max(1);
        let ch = self.pair();
        let sge = [src];
        (0..n)
            .take_while(|&i| {
                let wr = rdma(
                    first + i as u64,
                    SendOpcode::RdmaWrite,
                    &sge,
                    dst.0 + ((i % slots) * slot) as u64,
                    dst.1,
                );
                ch.requester().post_send(&[wr]).is_ok()
            })
            .count()
    }

    /// Where bursts write by default: the upper half of beta's MR.
    pub(super) fn scratch(&self) -> (u64, u32) {
        let mr = &self.beta().mr;
        (mr.iova() + 32 * KIB as u64, mr.rkey())
    }

    /// Memory of destroyed objects is never written again: fresh MRs
    /// (the allocator is first-fit, so they take the rings just freed) keep
    /// a pattern while late completions would land.
    pub(super) fn assert_freed_memory_untouched(&mut self) {
        let pattern = self.rng.bytes(4 * KIB);
        let sentinels: Vec<MemoryRegion> = (0..24)
            .map(|_| {
                let mr = self
                    .beta()
                    .t
                    .pd
                    .alloc_mr(4 * KIB, access::LOCAL_WRITE)
                    .expect("sentinel MR");
                mr.write(0, &pattern).expect("fill sentinel");
                mr
            })
            .collect();
        std::thread::sleep(Duration::from_millis(10));
        for mr in &sentinels {
            assert!(
                read_mr(mr, 0, 4 * KIB) == pattern,
                "{}: memory of a destroyed object was written after its destroy",
                self.context()
            );
        }
    }

    /// Drains `cq` for a moment and checks every status is one of `allowed`.
    pub(super) fn drain(
        &mut self,
        cq: &CompletionQueue,
        want: usize,
        allowed: &[WcStatus],
    ) -> usize {
        let wcs = collect(cq, want, Duration::from_millis(200));
        for wc in &wcs {
            self.note(format!("{:?}", wc.status));
            assert!(
                allowed.contains(&wc.status),
                "{}: {wc:?} not in {allowed:?}",
                self.context()
            );
        }
        wcs.len()
    }

    /// The pair a burst was posted on, taken out of beta's hands.
    fn take_pair(&mut self) -> Channel {
        let beta = self.beta.as_mut().expect("beta's device is open");
        beta.pair.take().expect("the burst made a pair")
    }

    pub(super) fn destroy_in_flight(&mut self) {
        let ctx = self.context();
        let n = 8 + self.rng.below(24) as usize;
        let src = self.beta().mr.sge(0, 4 * KIB as u32);
        let posted = self.burst(n, src, self.scratch());
        let Channel { qps, cq } = self.take_pair();
        for qp in qps {
            qp.destroy()
                .unwrap_or_else(|e| panic!("{ctx}: destroy_qp in flight: {e}"));
        }
        // Sometimes the CQ goes with completions still in it.
        if self.rng.chance(2) {
            self.drain(&cq, posted, &[WcStatus::Success, WcStatus::WrFlushErr]);
        }
        cq.destroy()
            .unwrap_or_else(|e| panic!("{ctx}: destroy_cq after its QPs: {e}"));
        self.note("destroyed in flight");
        self.assert_freed_memory_untouched();
    }

    pub(super) fn dereg_in_flight(&mut self) {
        let ctx = self.context();
        let x = self.beta().t.pd.alloc_mr(32 * KIB, RW).expect("MR");
        x.write(0, &self.rng.bytes(32 * KIB)).expect("fill");
        let n = 8 + self.rng.below(24) as usize;
        // Half the time 32 KiB WRITEs: hostd moves them in segments while
        // the realtime victim is busy, so the deregistration can land
        // between two segments of one message.
        let len = if self.rng.chance(2) {
            32 * KIB
        } else {
            4 * KIB
        };
        let posted = self.burst(n, x.sge(0, len as u32), self.scratch());
        x.dereg()
            .unwrap_or_else(|e| panic!("{ctx}: dereg_mr in flight: {e}"));
        let ch = self.take_pair();
        let got = self.drain(
            &ch.cq,
            posted,
            &[
                WcStatus::Success,
                WcStatus::LocProtErr,
                WcStatus::WrFlushErr,
            ],
        );
        assert_eq!(got, posted, "{ctx}: every WR in flight completes");
    }

    pub(super) fn error_in_flight(&mut self) {
        let ctx = self.context();
        let n = 8 + self.rng.below(24) as usize;
        let src = self.beta().mr.sge(0, 4 * KIB as u32);
        let posted = self.burst(n, src, self.scratch());
        let ch = self.take_pair();
        ch.requester()
            .modify(&to_state(QpState::Err), mask::STATE)
            .unwrap_or_else(|e| panic!("{ctx}: to ERR: {e}"));
        let wcs = collect(&ch.cq, posted, Duration::from_secs(10));
        assert_eq!(wcs.len(), posted, "{ctx}: every WR in flight completes");
        // In order: the ones that ran, then the flushed ones.
        let first_flush = wcs
            .iter()
            .position(|wc| wc.status != WcStatus::Success)
            .unwrap_or(wcs.len());
        for wc in &wcs[first_flush..] {
            assert_eq!(wc.status, WcStatus::WrFlushErr, "{ctx}: {wcs:?}");
        }
        self.note(if first_flush < wcs.len() {
            "some flushed"
        } else {
            "all ran before ERR"
        });
        // And later work is flushed too.
        let id = self.wr_id();
        let sge = [src];
        ch.requester()
            .post_send(&[rdma(id, SendOpcode::RdmaWrite, &sge, 0, 0)])
            .unwrap_or_else(|e| panic!("{ctx}: post in ERR: {e}"));
        let wc = wait_completions(&ch.cq, 1)[0];
        self.expect_status(&wc, WcStatus::WrFlushErr);
    }

    pub(super) fn kill_vdev(&mut self) {
        let ctx = self.context();
        // Work in flight on both channels.
        let src = self.beta().mr.sge(0, 4 * KIB as u32);
        self.burst(16, src, self.scratch());
        let (iova, _, rkey) = self.secrets.canary;
        let id = self.wr_id();
        let sge = [self.beta().mr.sge(0, 4 * KIB as u32)];
        let link = self.link();
        let _ = link
            .requester()
            .post_send(&[rdma(id, SendOpcode::RdmaRead, &sge, iova, rkey)]);
        let mut beta = self.beta.take().expect("beta's device is open");
        beta.t.vdev.kill();
        // The dead device fails verbs at once instead of hanging.
        let started = Instant::now();
        let errno = beta.t.ctx.alloc_pd().map(drop).map_err(|e| e.errno());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{ctx}: a verb on a dead device took {:?}",
            started.elapsed()
        );
        self.expect_errno("alloc_pd on a killed vdev", errno, &[libc::EIO]);
        self.restart(beta);
    }

    /// SIGKILL of beta's vdev at a random moment while this thread runs
    /// control verbs (registrations, connections, destroys): the verb in
    /// progress and every later one fail with EIO, none hangs.
    pub(super) fn kill_mid_control(&mut self) {
        let ctx = self.context();
        let pid = self.beta().t.vdev.pid() as libc::pid_t;
        let delay = Duration::from_micros(self.rng.below(20_000));
        let killer = std::thread::spawn(move || {
            std::thread::sleep(delay);
            // SAFETY: kill() has no memory effects; `pid` is our child,
            // not reaped before `Vdev::kill` below, so it names no other
            // process.
            unsafe { libc::kill(pid, libc::SIGKILL) }
        });
        let started = Instant::now();
        let mut verbs = 0u64;
        let errno = loop {
            let beta = self.beta();
            let step = || -> Result<(), vrdma_guest_driver::Error> {
                let pd = beta.t.ctx.alloc_pd()?;
                let cq = beta.t.ctx.create_cq(16, 0)?;
                let mr = pd.alloc_mr(8 * KIB, RW)?;
                let make = |cq| {
                    pd.create_qp(&QpInitAttr {
                        send_cq: cq,
                        recv_cq: cq,
                        cap: default_caps(),
                        qp_type: QpType::Rc,
                        sq_sig_all: false,
                        srq: None,
                    })
                };
                let (q1, q2) = (make(&cq)?, make(&cq)?);
                bring_up(&q1, q2.qp_num(), beta.t.gid, ATTACKER)?;
                bring_up(&q2, q1.qp_num(), beta.t.gid, ATTACKER)?;
                q1.destroy().map_err(|e| e.error)?;
                q2.destroy().map_err(|e| e.error)?;
                mr.dereg().map_err(|e| e.error)?;
                cq.destroy().map_err(|e| e.error)?;
                pd.destroy().map_err(|e| e.error)
            };
            let result = step();
            verbs += 1;
            if let Err(e) = result {
                break e.errno();
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{ctx}: the vdev did not die"
            );
        };
        assert_eq!(killer.join().expect("killer thread"), 0, "{ctx}: kill(2)");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{ctx}: verbs on a dying device took {:?}",
            started.elapsed()
        );
        self.note(if verbs > 1 {
            "died after a cycle or more"
        } else {
            "died in the first cycle"
        });
        self.expect_errno(
            "a verb while the vdev dies",
            Err::<(), _>(errno),
            &[libc::EIO],
        );
        let beta = self.beta.take().expect("beta's device is open");
        self.restart(beta);
    }

    /// Closes `beta` (its vdev killed, if not yet), restarts its vdev on
    /// the same socket and opens the device again.
    pub(super) fn restart(&mut self, beta: Beta) {
        let ctx = self.context();
        let gid = beta.t.gid;
        let Beta {
            pair,
            link,
            mr,
            read_only,
            t,
        } = beta;
        drop((pair, link, mr, read_only));
        let mut vdev = t.close();
        vdev.restart();
        let t = Tenant::open_without_reconnect(vdev);
        assert_eq!(t.gid, gid, "{ctx}: a restarted vdev keeps its GID");
        self.beta = Some(Beta::new(t));
    }

    /// An MR over the application's own (anonymous) memory, which the
    /// driver moves onto shared memory and vdev adds to its memory table,
    /// deregistered while WRITEs into it are in flight: once `dereg_mr`
    /// returns, nothing writes that memory any more.
    pub(super) fn user_memory_in_flight(&mut self) {
        let ctx = self.context();
        let map = AppMemory::new(64 * KIB).expect("application memory");
        // SAFETY: `map` is a private anonymous mapping of this thread's,
        // mapped until `map` drops after the MR is gone; no other thread
        // knows it, so none writes it while the driver remaps it.
        let mr = unsafe { self.beta().t.pd.reg_mr(map.as_ptr(), map.len(), RW) }
            .unwrap_or_else(|e| panic!("{ctx}: reg_mr over user memory: {e}"));
        let src = self.beta().mr.sge(0, 4 * KIB as u32);
        let n = 8 + self.rng.below(24) as usize;
        let posted = self.burst(n, src, (mr.iova(), mr.rkey()));
        mr.dereg()
            .unwrap_or_else(|e| panic!("{ctx}: dereg_mr in flight: {e}"));
        let pattern = self.rng.bytes(map.len());
        map.write(&pattern);
        let ch = self.take_pair();
        self.drain(
            &ch.cq,
            posted,
            &[
                WcStatus::Success,
                WcStatus::RemAccessErr,
                WcStatus::WrFlushErr,
            ],
        );
        std::thread::sleep(Duration::from_millis(5));
        assert!(
            map.read() == pattern,
            "{ctx}: memory was written after its MR was deregistered"
        );
    }
}
