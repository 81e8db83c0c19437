//! A compromised vdev of the attacker, speaking hostd's protocol by hand
//! and writing its own rings.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vrdma_hostd::engine::testing::{remote, send, sge, CAPS};
use vrdma_hostd_protocol::messages::{QpConnection, QpModify, Request, MAX_MODIFIES};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::ring::{event_kind, Cqe, SendWqe};
use vrdma_spec::verbs::{QpState, SendOpcode, WcStatus};
use vrdma_tests::rogue::{Answer, RogueVdev, CQN, DATA, DATA_LEN, DEPTH, IOVA, MEM};
use zerocopy::IntoBytes;

use super::*;
use crate::*;

/// The compromised vdev's QP (index 0 of its driver).
const QP: usize = 0;

/// Its QPs fail fast: one retry of each kind.
fn connection(dgid: [u8; 16], dest_qpn: u32) -> QpConnection {
    QpConnection {
        dgid,
        dlid: None,
        dest_qpn,
        flow_label: 0,
        hop_limit: 64,
        traffic_class: 0,
        access: 0,
        rnr_retry: 1,
        retry_cnt: 1,
        min_rnr_timer: 1,
        timeout: 1,
        path_mtu: 4096,
        sq_psn: 0,
        rq_psn: 0,
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
    }
}

/// What the compromised vdev sends, one WQE at a time, over the
/// connection the victim accepted, and how hostd must complete it.
struct Attack {
    what: &'static str,
    wqe: SendWqe,
    /// `(iova, length, lkey)` of its one SGE.
    local: (u64, u32, u32),
    expected: WcStatus,
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

    /// The compromised vdev's next completion: it must be `wr_id`'s, with
    /// `expected`.
    fn expect_cqe(&mut self, rogue: &mut RogueVdev, wr_id: u64, expected: WcStatus, what: &str) {
        let cqe: Cqe = rogue
            .completion(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{}: no completion for {what}", self.context()));
        let status = WcStatus::try_from(cqe.status).expect("a known status");
        self.note(format!("{status:?}"));
        assert_eq!(
            (cqe.wr_id.get(), status),
            (wr_id, expected),
            "{}: {what}: {cqe:?}",
            self.context()
        );
    }

    /// A compromised vdev of beta: hostile control requests; then WQEs in
    /// its own rings over a connection the victim accepted, aimed at the
    /// victim's keys and at made-up ones, and malformed; then memory it
    /// removed; then a corrupt ring, which sends that QP to ERR while the
    /// device keeps being served.
    pub(super) fn compromised_vdev(&mut self) {
        let mut rogue = self.rogue_hello();
        self.hostile_control(&mut rogue);
        let vqpn = 0x00ab_0000 | self.rng.below(0xffff) as u32;
        let (lkey, exposed) = self.own_objects(&mut rogue, vqpn);
        self.hostile_wqes(&mut rogue, vqpn, lkey, exposed);
        self.removed_memory(&mut rogue, vqpn, lkey, exposed);
        self.corrupt_ring(&mut rogue, vqpn);
    }

    /// Requests it has no business making, each refused; leaves it with
    /// its rings in memory slot 0 and its data region in slot 1.
    fn hostile_control(&mut self, rogue: &mut RogueVdev) {
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
        let memfd = sealed_memfd("rogue-probe", MEM).expect("memfd");
        self.expect_answer(
            "memory beyond its file",
            rogue.add_memory(0, 0, &memfd, 2 * MEM, 0),
            Answer::Refused(libc::EINVAL),
        );
        let unsealed = std::fs::File::open("/proc/self/exe").expect("an unsealed file");
        self.expect_answer(
            "an unsealed file as memory",
            rogue.add_memory(0, 0, &unsealed, 4096, 0),
            Answer::Refused(libc::EINVAL),
        );
        rogue.memory(&[(0, 0, DATA), (1, DATA, DATA_LEN)]);
        self.expect_refused("a slot twice", rogue.add_memory(0, 0, &memfd, DATA, 0));
        self.expect_answer(
            "memory without its fd",
            rogue.call(
                &Request::AddMemory {
                    slot: 2,
                    gpa: MEM,
                    len: 4096,
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
        rogue.rings();
        let kick = vmm_sys_util::eventfd::EventFd::new(0).expect("eventfd");
        self.expect_answer(
            "a second doorbell page",
            rogue.call(&Request::SetDoorbell { gpa: 0 }, &[kick.as_raw_fd()]),
            Answer::Refused(libc::EEXIST),
        );
        self.expect_refused(
            "registering over a slot it does not have",
            rogue.register(7, 0, 4096),
        );
        self.expect_refused(
            "registering across the end of its slot",
            rogue.register(1, 4096, DATA_LEN),
        );
        let victim_keys = self.secrets.keys();
        let stolen = victim_keys[self.rng.below(victim_keys.len() as u64) as usize];
        self.expect_answer(
            "deregistering the victim's MR",
            rogue.call(&Request::DeregisterMr { lkey: stolen }, &[]),
            Answer::Refused(libc::ENOENT),
        );
        for victims_qpn in self.secrets.qpns {
            for (what, answer) in [
                (
                    "DestroyQp",
                    rogue.call(&Request::DestroyQp { vqpn: victims_qpn }, &[]),
                ),
                ("ERR", rogue.modify(victims_qpn, QpState::Err, None)),
                ("RESET", rogue.modify(victims_qpn, QpState::Reset, None)),
                ("QueryQp", rogue.query_qp(victims_qpn)),
            ] {
                let what = format!("{what} of the victim's QP {victims_qpn:#x}");
                self.expect_answer(&what, answer, Answer::Refused(libc::ENOENT));
            }
        }
        self.hostile_create_qp(rogue);
        self.hostile_mads(rogue);
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
    }

    /// QP1 carries connection-manager MADs only, to GIDs the tenant may
    /// reach, and hands the device only what came for it.
    fn hostile_mads(&mut self, rogue: &mut RogueVdev) {
        use vrdma_hostd_protocol::messages::MadOut;
        let mut cm = vec![0u8; 256];
        cm[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
        let send = |peer: [u8; 16], mad: Vec<u8>| {
            Request::SendMad(MadOut {
                peer,
                traffic_class: 0,
                mad,
            })
        };
        let mut smp = cm.clone();
        smp[1] = 0x81; // a subnet management MAD
        for (what, request, errno) in [
            (
                "a MAD of another class",
                send(self.secrets.gid, smp),
                libc::EINVAL,
            ),
            (
                "a short MAD",
                send(self.secrets.gid, cm[..100].to_vec()),
                libc::EINVAL,
            ),
            (
                "a MAD to a GID nobody has",
                send(vrdma_spec::gid::ipv4_mapped([127, 99, 9, 9]), cm.clone()),
                libc::ENOENT,
            ),
            (
                "GsiNotify without its eventfd",
                Request::GsiNotify,
                libc::EINVAL,
            ),
        ] {
            self.expect_answer(what, rogue.call(&request, &[]), Answer::Refused(errno));
        }
        self.expect_answer(
            "MADs of another device",
            rogue.call(&Request::TakeMads { max: 64 }, &[]),
            Answer::Mads(Vec::new()),
        );
    }

    /// QPs whose rings, CQ or doorbell bit are not its to use.
    fn hostile_create_qp(&mut self, rogue: &mut RogueVdev) {
        let base = rogue.next_qp(0x00cd_0000 | self.rng.below(0xffff) as u32, CAPS);
        let mut outside = base;
        outside.sq.gpa = MEM + 0x1_0000;
        let mut across = base;
        across.rq.gpa = DATA - 0x1000;
        let mut foreign_cq = base;
        foreign_cq.recv_cqn = CQN + 1 + self.rng.below(1000) as u32;
        let mut wide = base;
        wide.vqpn = 0x0100_0000;
        for (what, setup, errno) in [
            ("a send ring outside its memory", outside, libc::EINVAL),
            ("a receive ring across its two slots", across, libc::EINVAL),
            ("a CQ it does not have", foreign_cq, libc::ENOENT),
            ("a QP number beyond 24 bits", wide, libc::EINVAL),
        ] {
            self.expect_answer(what, rogue.create_qp(&setup), Answer::Refused(errno));
        }
    }

    /// Its own MR (slot 1) and QP `vqpn` (rings in slot 0), connected to
    /// the QP the victim exposes; returns its lkey and the victim's QPN.
    fn own_objects(&mut self, rogue: &mut RogueVdev, vqpn: u32) -> (u32, u32) {
        let lkey = match rogue.register(1, 0, DATA_LEN) {
            Answer::Keys(lkey, _) => lkey,
            other => panic!("{}: its own MR: {other:?}", self.context()),
        };
        let setup = rogue.next_qp(vqpn, CAPS);
        self.expect_answer("its own QP", rogue.create_qp(&setup), Answer::Ok);
        let mut taken = rogue.next_qp(vqpn + 1, CAPS);
        taken.db_index = setup.db_index;
        self.expect_answer(
            "a doorbell bit another QP has",
            rogue.create_qp(&taken),
            Answer::Refused(libc::EINVAL),
        );
        self.expect_answer(
            "a GID nobody has",
            rogue.connect(
                vqpn,
                connection(vrdma_spec::gid::ipv4_mapped([10, 9, 8, 7]), 1),
            ),
            Answer::Refused(libc::ENOENT),
        );
        self.hostile_transitions(rogue, vqpn);
        let exposed = self.victim.accept(vqpn, rogue.gid());
        // The victim now talks to the compromised vdev, not to beta's link.
        self.discard(true);
        self.reconnect(rogue, vqpn, exposed);
        (lkey, exposed)
    }

    /// A QP's transitions in one request (`ModifyQps`, what vdev's
    /// CM_MOVE_QP sends) are each checked as one `ModifyQp`: too many, or
    /// of two QPs, are refused whole; one towards a GID nobody has stops
    /// the batch there, the ones before applied.
    fn hostile_transitions(&mut self, rogue: &RogueVdev, vqpn: u32) {
        let step = |vqpn: u32, state: QpState, connection: Option<QpConnection>| QpModify {
            vqpn,
            state: state.into(),
            connection,
            access: None,
            qkey: None,
        };
        let nobody = connection(vrdma_spec::gid::ipv4_mapped([10, 9, 8, 7]), 1);
        let reset = step(vqpn, QpState::Reset, None);
        let batch = |steps: Vec<QpModify>| rogue.call(&Request::ModifyQps(steps), &[]);
        self.expect_answer(
            "reset",
            rogue.modify(vqpn, QpState::Reset, None),
            Answer::Ok,
        );
        self.expect_answer(
            "five transitions in one request",
            batch(vec![reset; MAX_MODIFIES + 1]),
            Answer::Refused(libc::EINVAL),
        );
        self.expect_answer(
            "transitions of two QPs in one request",
            batch(vec![
                step(vqpn, QpState::Init, None),
                step(vqpn + 7, QpState::Init, None),
            ]),
            Answer::Refused(libc::EINVAL),
        );
        self.expect_answer(
            "the refused batches changed nothing",
            rogue.query_qp(vqpn),
            Answer::State(QpState::Reset.into()),
        );
        self.expect_answer(
            "INIT then RTR towards a GID nobody has",
            batch(vec![
                step(vqpn, QpState::Init, None),
                step(vqpn, QpState::Rtr, Some(nobody)),
                step(vqpn, QpState::Rts, Some(nobody)),
            ]),
            Answer::Refused(libc::ENOENT),
        );
        self.expect_answer(
            "stopped after INIT",
            rogue.query_qp(vqpn),
            Answer::State(QpState::Init.into()),
        );
    }

    /// RESET and connected again to the victim's exposed QP.
    fn reconnect(&mut self, rogue: &RogueVdev, vqpn: u32, exposed: u32) {
        let conn = connection(self.secrets.gid, exposed);
        self.expect_answer("connect", rogue.connect(vqpn, conn), Answer::Ok);
    }

    /// Posts `attack` on its QP; checks its completion; reconnects after
    /// an error (the QP is in ERR).
    fn run_attack(&mut self, rogue: &mut RogueVdev, attack: Attack, vqpn: u32, exposed: u32) {
        let wr_id = self.wr_id();
        let mut wqe = attack.wqe;
        wqe.wr_id = wr_id.into();
        let (iova, length, lkey) = attack.local;
        rogue
            .driver()
            .post_sges(QP, &wqe, &[sge(iova, length, lkey)]);
        rogue.kick_if_needed();
        self.expect_cqe(rogue, wr_id, attack.expected, attack.what);
        if attack.expected != WcStatus::Success {
            self.reconnect(rogue, vqpn, exposed);
        }
    }

    /// WQEs naming the victim's keys, made-up keys, and malformed ones.
    fn hostile_wqes(&mut self, rogue: &mut RogueVdev, vqpn: u32, lkey: u32, exposed: u32) {
        let secrets = self.secrets;
        let (canary_iova, _, canary_rkey) = secrets.canary;
        let (dst_iova, dst_lkey, dst_rkey) = secrets.traffic[1];
        let (src_iova, src_lkey, _) = secrets.traffic[0];
        let made_up = loop {
            let guess = self.guessed_key();
            if guess != lkey && !secrets.keys().contains(&guess) {
                break guess;
            }
        };
        let off = self.rng.below((REGION - 256) as u64);
        let read = |addr, rkey| remote(send(0, SendOpcode::RdmaRead), addr, rkey);
        let write = |addr, rkey| remote(send(0, SendOpcode::RdmaWrite), addr, rkey);
        let own = |len| (IOVA, len, lkey);
        let attacks = [
            Attack {
                what: "READ of the canary (the victim allows it)",
                wqe: read(canary_iova + off, canary_rkey),
                local: own(256),
                expected: WcStatus::Success,
            },
            Attack {
                what: "WRITE into the canary with its rkey",
                wqe: write(canary_iova, canary_rkey),
                local: own(64),
                expected: WcStatus::RemAccessErr,
            },
            Attack {
                what: "WRITE with the rkey of the victim's other PD",
                wqe: write(dst_iova, dst_rkey),
                local: own(64),
                expected: WcStatus::RemAccessErr,
            },
            Attack {
                what: "FETCH_AND_ADD on the canary",
                wqe: remote(
                    send(0, SendOpcode::AtomicFetchAndAdd),
                    canary_iova,
                    canary_rkey,
                ),
                local: own(8),
                expected: WcStatus::RemAccessErr,
            },
            Attack {
                what: "READ with a made-up rkey",
                wqe: read(canary_iova, made_up),
                local: own(64),
                expected: WcStatus::RemAccessErr,
            },
            // The victim's lkeys as local keys: reading its memory out, or
            // writing the canary into it.
            Attack {
                what: "WRITE from the victim's lkey",
                wqe: write(canary_iova, canary_rkey),
                local: (src_iova, 64, src_lkey),
                expected: WcStatus::LocProtErr,
            },
            Attack {
                what: "READ into the victim's lkey",
                wqe: read(canary_iova, canary_rkey),
                local: (dst_iova, 64, dst_lkey),
                expected: WcStatus::LocProtErr,
            },
            Attack {
                what: "READ into a made-up lkey",
                wqe: read(canary_iova, canary_rkey),
                local: (IOVA, 64, made_up),
                expected: WcStatus::LocProtErr,
            },
            Attack {
                what: "an unknown opcode",
                wqe: SendWqe {
                    opcode: 0x77,
                    ..read(canary_iova, canary_rkey)
                },
                local: own(64),
                expected: WcStatus::LocQpOpErr,
            },
        ];
        for attack in attacks {
            let success = attack.expected == WcStatus::Success;
            self.run_attack(rogue, attack, vqpn, exposed);
            if success {
                let got = rogue.memory_bytes(DATA, 256);
                let off = off as usize;
                assert!(
                    got == self.victim.canary_bytes[off..off + 256],
                    "{}: the canary read by the compromised vdev differs",
                    self.context()
                );
            }
        }
        // More SGEs than the QP was granted (its 256-byte slot holds 12),
        // and more than its slot holds.
        let granted = CAPS.0 as usize;
        for (what, num_sge) in [("granted SGEs + 1", granted + 1), ("200 SGEs", 200)] {
            let wr_id = self.wr_id();
            let mut wqe = write(canary_iova, canary_rkey);
            wqe.wr_id = wr_id.into();
            wqe.num_sge = num_sge as u8;
            let sges = vec![sge(IOVA, 8, lkey); num_sge.min(granted + 1)];
            rogue.driver().post_send(QP, &wqe, sges.as_bytes());
            rogue.kick_if_needed();
            self.expect_cqe(rogue, wr_id, WcStatus::LocLenErr, what);
            self.reconnect(rogue, vqpn, exposed);
        }
    }

    /// Memory it removed is never touched again: its MR there is revoked,
    /// and a READ into it completes LOC_PROT_ERR with the bytes untouched.
    fn removed_memory(&mut self, rogue: &mut RogueVdev, vqpn: u32, lkey: u32, exposed: u32) {
        let before = self.rng.bytes(256);
        assert!(rogue.driver().mem.write(DATA as usize, &before));
        self.expect_answer(
            "removing its data slot",
            rogue.call(&Request::RemoveMemory { slot: 1 }, &[]),
            Answer::Ok,
        );
        let (canary_iova, _, canary_rkey) = self.secrets.canary;
        let attack = Attack {
            what: "READ into removed memory",
            wqe: remote(send(0, SendOpcode::RdmaRead), canary_iova, canary_rkey),
            local: (IOVA, 256, lkey),
            expected: WcStatus::LocProtErr,
        };
        self.run_attack(rogue, attack, vqpn, exposed);
        assert!(
            rogue.memory_bytes(DATA, 256) == before,
            "{}: hostd wrote memory that was removed",
            self.context()
        );
    }

    /// A producer index far beyond the ring: the QP goes to ERR without a
    /// completion and with a QP_FATAL event on event ring 0; the device
    /// keeps being served, and the victim's exposed QP is unaffected.
    fn corrupt_ring(&mut self, rogue: &mut RogueVdev, vqpn: u32) {
        let earlier = rogue.driver().events();
        assert!(
            !earlier.iter().any(|e| e.0 == event_kind::QP_FATAL),
            "{}: QP_FATAL before the ring broke: {earlier:?}",
            self.context()
        );
        let done = rogue.driver().sq_done(QP);
        let beyond = self.rng.below(1 << 20) as u32 + 1;
        rogue.corrupt_send_ring(QP, done.wrapping_add(DEPTH + beyond));
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut events = Vec::new();
        while !events.contains(&(event_kind::QP_FATAL, vqpn)) {
            assert!(
                Instant::now() < deadline,
                "{}: no QP_FATAL for a corrupt ring; events {events:?}",
                self.context()
            );
            std::thread::sleep(Duration::from_millis(1));
            events.extend(rogue.driver().events());
        }
        self.note("QP_FATAL for a corrupt ring");
        self.expect_answer(
            "QueryQp of the QP with the corrupt ring",
            rogue.query_qp(vqpn),
            Answer::State(QpState::Err.into()),
        );
        assert!(
            rogue.completion(Duration::from_millis(20)).is_none(),
            "{}: a completion for a corrupt ring",
            self.context()
        );
        let probe = Request::QuotaRejected {
            quota: "max_qp".into(),
        };
        self.expect_answer(
            "the device is still served",
            rogue.call(&probe, &[]),
            Answer::Ok,
        );
        let exposed = self
            .victim
            .exposed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        assert_eq!(
            qp_state(&exposed),
            u8::from(QpState::Rts),
            "{}: the victim's exposed QP",
            self.context()
        );
    }
}
