//! A compromised vdev of the attacker, speaking hostd's protocol by hand.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vrdma_guest_driver::Sge;
use vrdma_hostd_protocol::entries::{PhysCqe, PhysWqe};
use vrdma_hostd_protocol::messages::Request;
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::{SendOpcode, WcStatus};
use vrdma_tests::rogue::{Answer, RogueVdev};

use super::*;
use crate::*;

/// A physical completion's status, as the tally names it.
fn status_name(status: u8) -> String {
    match WcStatus::try_from(status) {
        Ok(s) => format!("{s:?}"),
        Err(raw) => format!("status {raw}"),
    }
}

/// A physical send WQE of the compromised vdev.
fn phys_wqe(token: u64, op: SendOpcode, vqpn: u32, local: Sge, remote: (u64, u32)) -> PhysWqe {
    let mut wqe = PhysWqe {
        token: token.into(),
        kind: vrdma_hostd_protocol::entries::kind::SEND,
        opcode: op.into(),
        flags: SIGNALED,
        vqpn: vqpn.into(),
        remote_addr: remote.0.into(),
        rkey: remote.1.into(),
        ..PhysWqe::default()
    };
    let wire = vrdma_spec::ring::Sge {
        addr: local.addr.into(),
        length: local.length.into(),
        lkey: local.lkey.into(),
    };
    assert!(wqe.set_sges(&[wire]));
    wqe
}

impl Attacker<'_> {
    /// Registers a compromised vdev of beta, retrying while hostd still
    /// tears down the previous device of the same name (EBUSY) or earlier
    /// ones that still count against beta's `max_devices` (EDQUOT).
    pub(super) fn rogue_hello(&mut self) -> RogueVdev {
        let name = format!("rogue-{}", self.rng.below(4));
        let transient = [libc::EBUSY, libc::EDQUOT];
        RogueVdev::hello_retrying(&self.hostd_socket, "beta", &name, &transient)
            .unwrap_or_else(|errno| panic!("{}: Hello refused with errno {errno}", self.context()))
    }

    /// The compromised vdev's next completion, which must have `status`.
    fn expect_cqe(&mut self, rogue: &RogueVdev, status: WcStatus) -> PhysCqe {
        let cqe = rogue.completion(0, Duration::from_secs(10));
        let cqe = cqe.unwrap_or_else(|| panic!("{}: no completion", self.context()));
        self.note(status_name(cqe.status));
        assert_eq!(cqe.status, u8::from(status), "{}", self.context());
        cqe
    }

    pub(super) fn expect_answer(&mut self, what: &str, got: Answer, expected: Answer) {
        self.note(format!("{got:?}"));
        assert_eq!(got, expected, "{}: {what}", self.context());
    }

    pub(super) fn expect_refused(&mut self, what: &str, got: Answer) {
        self.note(format!("{got:?}"));
        assert!(
            matches!(got, Answer::Refused(_)),
            "{}: {what}: {got:?}",
            self.context()
        );
    }

    /// A compromised vdev of beta: hostile control requests, then physical
    /// WQEs over a connection the victim accepted, naming the victim's keys
    /// as remote and as local keys; then revoked memory; then a corrupt
    /// ring, for which hostd drops the device.
    pub(super) fn compromised_vdev(&mut self) {
        use vrdma_hostd_protocol::messages::{MrRegistration, MrSegment, QpConnection};
        use vrdma_hostd_protocol::shm::{sealed_memfd, SharedMapping};
        const LEN: u64 = 64 * 1024;
        const IOVA: u64 = 0x10_0000;
        let rogue = self.rogue_hello();
        let secrets = self.secrets;

        // Control requests it has no business making.
        let again = Request::Hello {
            version: vrdma_hostd_protocol::messages::PROTOCOL_VERSION,
            tenant: "alpha".into(),
            device: "alpha-impostor".into(),
        };
        self.expect_answer(
            "a second Hello",
            rogue.call(&again, &[]),
            Answer::Refused(libc::EPROTO),
        );
        let memfd = sealed_memfd("rogue", LEN).expect("memfd");
        let mine = SharedMapping::map(memfd.try_clone().expect("dup"), 0, LEN).expect("map");
        self.expect_answer(
            "memory beyond its file",
            rogue.add_memory(0, &memfd, 2 * LEN),
            Answer::Refused(libc::EINVAL),
        );
        let unsealed = std::fs::File::open("/proc/self/exe").expect("an unsealed file");
        self.expect_answer(
            "an unsealed file as memory",
            rogue.add_memory(0, &unsealed, 4096),
            Answer::Refused(libc::EINVAL),
        );
        self.expect_answer("memory", rogue.add_memory(0, &memfd, LEN), Answer::Ok);
        self.expect_refused("a slot twice", rogue.add_memory(0, &memfd, LEN));
        self.expect_answer(
            "memory without its fd",
            rogue.call(
                &Request::AddMemory {
                    slot: 1,
                    gpa: 0,
                    len: LEN,
                    file_offset: 0,
                },
                &[],
            ),
            Answer::Refused(libc::EINVAL),
        );
        self.expect_answer(
            "an fd with a request that takes none",
            rogue.call(&Request::RemoveMemory { slot: 9 }, &[memfd.as_raw_fd()]),
            Answer::Refused(libc::EINVAL),
        );
        let registration = |lkey, rkey, slot| {
            Request::RegisterMr(MrRegistration {
                lkey,
                rkey,
                pd: 1,
                access: RW,
                iova: IOVA,
                len: LEN,
                segments: vec![MrSegment {
                    slot,
                    offset: 0,
                    len: LEN,
                }],
            })
        };
        let victim_keys = secrets.keys();
        let stolen = victim_keys[self.rng.below(victim_keys.len() as u64) as usize];
        let fresh = (
            self.rng.next_u64() as u32 | 1,
            self.rng.next_u64() as u32 | 2,
        );
        self.expect_refused(
            "registering the victim's key as an lkey",
            rogue.call(&registration(stolen, fresh.1, 0), &[]),
        );
        self.expect_refused(
            "registering the victim's key as an rkey",
            rogue.call(&registration(fresh.0, stolen, 0), &[]),
        );
        self.expect_refused(
            "registering over a slot it does not have",
            rogue.call(&registration(fresh.0, fresh.1, 7), &[]),
        );
        self.expect_refused(
            "deregistering the victim's MR",
            rogue.call(&Request::DeregisterMr { lkey: stolen }, &[]),
        );
        let vqpn = 0x00ab_0000 | self.rng.below(0xffff) as u32;
        for victims_qpn in secrets.qpns {
            for request in [
                Request::DestroyQp { vqpn: victims_qpn },
                Request::ErrorQp { vqpn: victims_qpn },
                Request::ResetQp { vqpn: victims_qpn },
            ] {
                self.expect_refused("touching a QP it does not have", rogue.call(&request, &[]));
            }
        }
        let foreign_pqp = (0..64).find(|p| !rogue.welcome.queues.iter().any(|q| q.pqp == *p));
        self.expect_refused(
            "a QP on another device's physical queue",
            rogue.call(
                &Request::CreateQp {
                    vqpn,
                    pd: 1,
                    pqp: foreign_pqp.expect("a pQP not granted"),
                },
                &[],
            ),
        );
        self.expect_answer(
            "an unknown quota key",
            rogue.call(
                &Request::QuotaRejected {
                    quota: "not-a-quota".into(),
                },
                &[],
            ),
            Answer::Refused(libc::EINVAL),
        );

        // Its own MR and a QP the victim accepts a connection from.
        let (lkey, rkey) = loop {
            let keys = (
                self.rng.next_u64() as u32 | 1,
                self.rng.next_u64() as u32 | 2,
            );
            if keys.0 != keys.1 && rogue.call(&registration(keys.0, keys.1, 0), &[]) == Answer::Ok {
                break keys;
            }
        };
        let pqp = rogue.pqp(0);
        let create = Request::CreateQp { vqpn, pd: 1, pqp };
        self.expect_answer("its own QP", rogue.call(&create, &[]), Answer::Ok);
        let connect = |dest_lid, dest_qpn| {
            Request::ConnectQp(QpConnection {
                vqpn,
                dest_lid,
                dest_qpn,
                access: 0,
                rnr_retry: 1,
                retry_cnt: 1,
                min_rnr_timer: 1,
            })
        };
        self.expect_answer(
            "a LID nobody has",
            rogue.call(&connect(0xbffe, 1), &[]),
            Answer::Refused(libc::ENOENT),
        );
        let exposed = self.victim.accept(vqpn, rogue.lid());
        // The victim now talks to the compromised vdev, not to beta's link.
        self.discard(true);
        let reconnect = Request::ResetQp { vqpn };
        self.expect_answer(
            "connect",
            rogue.call(&connect(secrets.lid, exposed), &[]),
            Answer::Ok,
        );

        // Physical WQEs: one at a time, the QP reconnected after each error.
        let own = |off: u64, len: u32| Sge {
            addr: IOVA + off,
            length: len,
            lkey,
        };
        let (canary_iova, _, canary_rkey) = secrets.canary;
        let (dst_iova, dst_lkey, dst_rkey) = secrets.traffic[1];
        let (src_iova, src_lkey, _) = secrets.traffic[0];
        let off = self.rng.below((REGION - 256) as u64);
        let attacks = [
            (
                SendOpcode::RdmaRead,
                own(0, 256),
                (canary_iova + off, canary_rkey),
                WcStatus::Success,
            ),
            (
                SendOpcode::RdmaWrite,
                own(0, 64),
                (canary_iova, canary_rkey),
                WcStatus::RemAccessErr,
            ),
            (
                SendOpcode::RdmaWrite,
                own(0, 64),
                (dst_iova, dst_rkey),
                WcStatus::RemAccessErr,
            ),
            (
                SendOpcode::AtomicFetchAndAdd,
                own(0, 8),
                (canary_iova, canary_rkey),
                WcStatus::RemAccessErr,
            ),
            // The victim's lkeys as local keys: reading its memory out, or
            // writing the canary into it.
            (
                SendOpcode::RdmaWrite,
                Sge {
                    addr: src_iova,
                    length: 64,
                    lkey: src_lkey,
                },
                (IOVA, rkey),
                WcStatus::LocProtErr,
            ),
            (
                SendOpcode::RdmaRead,
                Sge {
                    addr: dst_iova,
                    length: 64,
                    lkey: dst_lkey,
                },
                (canary_iova, canary_rkey),
                WcStatus::LocProtErr,
            ),
        ];
        for (i, (op, local, remote, expected)) in attacks.into_iter().enumerate() {
            let token = self.wr_id();
            rogue.post(0, &phys_wqe(token, op, vqpn, local, remote));
            let cqe = rogue
                .completion(0, Duration::from_secs(10))
                .unwrap_or_else(|| panic!("{}: no completion for attack {i}", self.context()));
            assert_eq!(cqe.token.get(), token, "{}", self.context());
            let status = WcStatus::try_from(cqe.status).expect("a known status");
            self.note(format!("{status:?}"));
            assert_eq!(status, expected, "{}: attack {i}: {cqe:?}", self.context());
            if status == WcStatus::Success {
                let mut got = vec![0u8; 256];
                assert!(mine.read(0, &mut got));
                let off = off as usize;
                assert!(
                    got == self.victim.canary_bytes[off..off + 256],
                    "{}: the canary read by the compromised vdev differs",
                    self.context()
                );
            } else {
                self.expect_answer("reset", rogue.call(&reconnect, &[]), Answer::Ok);
                self.expect_answer(
                    "reconnect",
                    rogue.call(&connect(secrets.lid, exposed), &[]),
                    Answer::Ok,
                );
            }
        }
        // Too many SGEs, and work of a QP it does not have.
        let token = self.wr_id();
        let mut wqe = phys_wqe(token, SendOpcode::RdmaWrite, vqpn, own(0, 8), (IOVA, rkey));
        wqe.num_sge = 200;
        rogue.post(0, &wqe);
        let token2 = self.wr_id();
        let other = secrets.qpns[0];
        rogue.post(
            0,
            &phys_wqe(token2, SendOpcode::Send, other, own(0, 8), (0, 0)),
        );
        // Two QPs: their completions come in either order.
        let mut tokens = Vec::new();
        for _ in 0..2 {
            let cqe = self.expect_cqe(&rogue, WcStatus::LocQpOpErr);
            tokens.push(cqe.token.get());
        }
        tokens.sort_unstable();
        assert_eq!(tokens, [token, token2], "{}", self.context());
        self.expect_answer("reset", rogue.call(&reconnect, &[]), Answer::Ok);
        self.expect_answer(
            "reconnect",
            rogue.call(&connect(secrets.lid, exposed), &[]),
            Answer::Ok,
        );

        // Memory it removed is never touched again.
        self.expect_answer(
            "removing its memory",
            rogue.call(&Request::RemoveMemory { slot: 0 }, &[]),
            Answer::Ok,
        );
        let before = {
            let mut b = vec![0u8; 256];
            assert!(mine.read(0, &mut b));
            b
        };
        let token = self.wr_id();
        rogue.post(
            0,
            &phys_wqe(
                token,
                SendOpcode::RdmaRead,
                vqpn,
                own(0, 256),
                (canary_iova, canary_rkey),
            ),
        );
        self.expect_cqe(&rogue, WcStatus::LocProtErr);
        let mut after = vec![0u8; 256];
        assert!(mine.read(0, &mut after));
        assert!(
            after == before,
            "{}: hostd wrote memory that was removed",
            self.context()
        );

        // A corrupt ring: hostd drops the device.
        let depth = self.rng.below(1 << 20) as u32;
        rogue.corrupt_submission_ring(0, depth.wrapping_add(1 << 31));
        let deadline = Instant::now() + Duration::from_secs(5);
        let probe = Request::QuotaRejected {
            quota: "max_qp".into(),
        };
        loop {
            match rogue.call(&probe, &[]) {
                Answer::Gone => break,
                Answer::Ok if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                other => panic!("{}: after a corrupt ring: {other:?}", self.context()),
            }
        }
        self.note("dropped for a corrupt ring");
    }
}
