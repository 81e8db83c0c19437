//! The attacker: what it knows of the victim, its device and channels,
//! its moves and their data-path half; [`control`] holds the control-path
//! moves, [`in_flight`] the moves against work in flight and the vdev
//! kills, [`compromised`] a compromised vdev of its own.

mod compromised;
mod control;
mod in_flight;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use vrdma_guest_driver::{
    CompletionQueue, MemoryRegion, QueuePair, SendPayload, SendWr, Sge, WorkCompletion,
};
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::{access, SendOpcode, WcStatus};
use vrdma_tests::daemon::{Hostd, Vdev};
use vrdma_tests::rng::Rng;
use vrdma_tests::tenant::{bring_up, connect, rdma, read_mr, wait_completions, Connection, Tenant};

use crate::victim::{Secrets, Victim};
use crate::*;

/// The attacker's QPs fail fast: one RNR retry.
const ATTACKER: Connection = Connection {
    access: access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
    rnr_retry: 1,
    min_rnr_timer: 1,
    ..Connection::DEFAULT
};

/// A set of connected QPs (the requester first) with their own CQ, so
/// completions of a discarded set never reach the next one.
struct Channel {
    qps: Vec<QueuePair>,
    cq: CompletionQueue,
}

impl Channel {
    fn requester(&self) -> &QueuePair {
        &self.qps[0]
    }
}

/// The attacker's device and objects. Fields drop in order.
struct Beta {
    /// Two of beta's own QPs connected to each other.
    pair: Option<Channel>,
    /// One QP connected to the victim's exposed QP.
    link: Option<Channel>,
    /// Read-write, 64 KiB.
    mr: MemoryRegion,
    /// Remote read only (no local write).
    read_only: MemoryRegion,
    t: Tenant,
}

impl Beta {
    fn new(t: Tenant) -> Self {
        let mr = t.pd.alloc_mr(REGION, RW).expect("attacker MR");
        let read_only =
            t.pd.alloc_mr(4 * KIB, access::REMOTE_READ)
                .expect("attacker read-only MR");
        Beta {
            pair: None,
            link: None,
            mr,
            read_only,
            t,
        }
    }

    fn own_keys(&self) -> [u32; 4] {
        [
            self.mr.lkey(),
            self.mr.rkey(),
            self.read_only.lkey(),
            self.read_only.rkey(),
        ]
    }
}

/// The attacker's moves. Each round plays every move once, in a random
/// order, with random parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Move {
    /// Valid: a WRITE between beta's own QPs, bytes checked.
    OwnWrite,
    /// Valid: a READ of the canary over the link (it allows remote reads).
    CanaryRead,
    /// Valid: a zero-length WRITE at the canary (no rkey check, as on IB).
    ZeroLengthWrite,
    /// The canary's real rkey: WRITE → remote access error.
    CanaryWrite,
    /// The canary's real rkey: atomics → remote access error.
    CanaryAtomic,
    /// The victim's traffic MR rkey over the link (another PD of the victim).
    TrafficRkeyOverLink,
    /// The victim's rkeys through a connection between beta's own QPs.
    VictimRkeyOverOwnPair,
    /// Random rkeys.
    GuessedRkey,
    /// Remote addresses past the canary or wrapping around.
    RemoteOutOfRange,
    /// The victim's lkeys as local keys.
    VictimLkey,
    /// Random lkeys.
    GuessedLkey,
    /// Local SGEs past beta's MR, or of huge length.
    LocalOutOfRange,
    /// READ into an MR without local write.
    ReadIntoReadOnly,
    /// Atomic at an address that is not 8-byte aligned.
    MisalignedAtomic,
    /// LOCAL_INV, BIND_MW, SEND_WITH_INV.
    UnsupportedOpcode,
    /// SEND to the exposed QP, which never posts receives.
    SendWithoutReceive,
    /// More SGEs or inline bytes than the QP allows.
    OversizedWr,
    /// A QP connected to one of the victim's QPs, which is not connected
    /// back to it.
    Hijack,
    /// Transitions and values the RC state machine refuses.
    BogusModify,
    /// Random states, masks and attributes.
    RandomModify,
    /// Inconsistent or unknown MR access flags, zero length.
    BadRegistration,
    /// Every PD and QP the quota allows.
    Exhaust,
    /// Destroying a CQ a QP uses, a PD that has an MR.
    DestroyBusy,
    /// Destroying QPs and their CQ with work in flight.
    DestroyInFlight,
    /// Deregistering an MR that work in flight uses.
    DeregInFlight,
    /// Forcing a QP to ERR with work in flight.
    ErrorInFlight,
    /// Deregistering an MR over the application's own memory (a vhost-user
    /// memory-table change) while WRITEs into it are in flight.
    UserMemoryInFlight,
    /// SIGKILL of beta's vdev with work in flight, restart, reconnect.
    KillVdev,
    /// SIGKILL of beta's vdev in the middle of control verbs.
    KillMidControl,
    /// A compromised vdev of beta talking to hostd directly: hostile
    /// requests, and WQEs in its own rings naming the victim's keys.
    CompromisedVdev,
}

pub(crate) const MOVES: [Move; 30] = [
    Move::OwnWrite,
    Move::CanaryRead,
    Move::ZeroLengthWrite,
    Move::CanaryWrite,
    Move::CanaryAtomic,
    Move::TrafficRkeyOverLink,
    Move::VictimRkeyOverOwnPair,
    Move::GuessedRkey,
    Move::RemoteOutOfRange,
    Move::VictimLkey,
    Move::GuessedLkey,
    Move::LocalOutOfRange,
    Move::ReadIntoReadOnly,
    Move::MisalignedAtomic,
    Move::UnsupportedOpcode,
    Move::SendWithoutReceive,
    Move::OversizedWr,
    Move::Hijack,
    Move::BogusModify,
    Move::RandomModify,
    Move::BadRegistration,
    Move::Exhaust,
    Move::DestroyBusy,
    Move::DestroyInFlight,
    Move::DeregInFlight,
    Move::ErrorInFlight,
    Move::UserMemoryInFlight,
    Move::KillVdev,
    Move::KillMidControl,
    Move::CompromisedVdev,
];

/// What the attacker saw: per move, how often it ran and each outcome.
pub(crate) type Tally = BTreeMap<Move, BTreeMap<String, u64>>;

pub(crate) struct Attacker<'v> {
    rng: Rng,
    /// hostd's vdev socket, for the compromised vdev.
    hostd_socket: std::path::PathBuf,
    victim: &'v Victim,
    secrets: Secrets,
    beta: Option<Beta>,
    next_wr: u64,
    tally: Tally,
    /// The move being played, for failure messages.
    playing: Move,
    seed: u64,
}

impl<'v> Attacker<'v> {
    pub(crate) fn new(hostd: &Hostd, victim: &'v Victim, seed: u64) -> Self {
        Attacker {
            rng: Rng(seed),
            hostd_socket: hostd.socket.clone(),
            victim,
            secrets: victim.secrets(),
            // Its vdev is killed and not waited for (`kill_vdev`).
            beta: Some(Beta::new(Tenant::open_without_reconnect(Vdev::on_hostd(
                hostd,
                "beta",
                &[],
            )))),
            next_wr: 0,
            tally: Tally::new(),
            playing: Move::OwnWrite,
            seed,
        }
    }

    fn beta(&self) -> &Beta {
        self.beta.as_ref().expect("beta's device is open")
    }

    fn note(&mut self, outcome: impl Into<String>) {
        *self
            .tally
            .entry(self.playing)
            .or_default()
            .entry(outcome.into())
            .or_insert(0) += 1;
    }

    fn context(&self) -> String {
        format!(
            "attacker move {:?} (VRDMA_CHAOS_SEED={})",
            self.playing, self.seed
        )
    }

    fn wr_id(&mut self) -> u64 {
        self.next_wr += 1;
        self.next_wr
    }

    /// Runs until `deadline` (and at least one round), or `stop`.
    /// Returns what it saw, the rounds it played and its vdev's log.
    pub(crate) fn run(mut self, deadline: Instant, stop: &AtomicBool) -> (Tally, u64, String) {
        let mut rounds = 0;
        while (rounds == 0 || Instant::now() < deadline) && !stop.load(Ordering::Relaxed) {
            let mut deck = MOVES;
            self.rng.shuffle(&mut deck);
            for m in deck {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                self.playing = m;
                self.play(m);
            }
            rounds += 1;
        }
        let log = self.beta().t.vdev.log();
        (self.tally, rounds, log)
    }

    /// A random key that is none of beta's own.
    fn guessed_key(&mut self) -> u32 {
        let own = self.beta().own_keys();
        loop {
            let guess = self.rng.next_u64() as u32;
            if !own.contains(&guess) {
                return guess;
            }
        }
    }

    fn play(&mut self, m: Move) {
        match m {
            Move::OwnWrite => self.own_write(),
            Move::CanaryRead => self.canary_read(),
            Move::ZeroLengthWrite => self.zero_length_write(),
            Move::CanaryWrite => {
                let (iova, _, rkey) = self.secrets.canary;
                let off = self.rng.below((REGION - 64) as u64);
                self.remote_op(true, SendOpcode::RdmaWrite, iova + off, rkey, 64);
            }
            Move::CanaryAtomic => {
                let (iova, _, rkey) = self.secrets.canary;
                let off = self.rng.below((REGION / 8) as u64) * 8;
                let op = if self.rng.chance(2) {
                    SendOpcode::AtomicFetchAndAdd
                } else {
                    SendOpcode::AtomicCmpAndSwp
                };
                self.remote_op(true, op, iova + off, rkey, 8);
            }
            Move::TrafficRkeyOverLink => {
                let (iova, _, rkey) = self.secrets.traffic[self.rng.below(2) as usize];
                self.remote_op(true, SendOpcode::RdmaWrite, iova, rkey, 256);
            }
            Move::VictimRkeyOverOwnPair => {
                let keys = [self.secrets.canary, self.secrets.traffic[0]];
                let (iova, _, rkey) = keys[self.rng.below(2) as usize];
                let op = [SendOpcode::RdmaWrite, SendOpcode::RdmaRead][self.rng.below(2) as usize];
                self.remote_op(false, op, iova, rkey, 256);
            }
            Move::GuessedRkey => {
                let rkey = self.guessed_key();
                let over_link = self.rng.chance(2);
                let iova = self.secrets.canary.0;
                self.remote_op(over_link, SendOpcode::RdmaWrite, iova, rkey, 64);
            }
            Move::RemoteOutOfRange => {
                let (iova, _, rkey) = self.secrets.canary;
                let addr = match self.rng.below(3) {
                    0 => iova + REGION as u64 - 32,
                    1 => iova.wrapping_sub(64),
                    _ => u64::MAX - 16,
                };
                self.remote_op(true, SendOpcode::RdmaRead, addr, rkey, 64);
            }
            Move::VictimLkey => {
                let keys = self.secrets.keys();
                let lkey = keys[self.rng.below(keys.len() as u64) as usize];
                self.local_op(lkey, 0, 64);
            }
            Move::GuessedLkey => {
                let lkey = self.guessed_key();
                self.local_op(lkey, 0, 64);
            }
            Move::LocalOutOfRange => {
                let lkey = self.beta().mr.lkey();
                let (off, len) = match self.rng.below(3) {
                    0 => (REGION as u64 - 16, 64),
                    1 => (0, 1 << 30),
                    _ => (REGION as u64 * 2, 8),
                };
                self.local_op(lkey, off, len);
            }
            Move::ReadIntoReadOnly => self.read_into_read_only(),
            Move::MisalignedAtomic => {
                let (iova, _, rkey) = self.secrets.canary;
                let off = 8 * self.rng.below(64) + 1 + self.rng.below(7);
                self.remote_op(true, SendOpcode::AtomicFetchAndAdd, iova + off, rkey, 8);
            }
            Move::UnsupportedOpcode => self.unsupported_opcode(),
            Move::SendWithoutReceive => self.send_without_receive(),
            Move::OversizedWr => self.oversized_wr(),
            Move::Hijack => self.hijack(),
            Move::BogusModify => self.bogus_modify(),
            Move::RandomModify => self.random_modify(),
            Move::BadRegistration => self.bad_registration(),
            Move::Exhaust => self.exhaust(),
            Move::DestroyBusy => self.destroy_busy(),
            Move::DestroyInFlight => self.destroy_in_flight(),
            Move::DeregInFlight => self.dereg_in_flight(),
            Move::ErrorInFlight => self.error_in_flight(),
            Move::UserMemoryInFlight => self.user_memory_in_flight(),
            Move::KillVdev => self.kill_vdev(),
            Move::KillMidControl => self.kill_mid_control(),
            Move::CompromisedVdev => self.compromised_vdev(),
        }
    }

    // -- channels ------------------------------------------------------

    fn pair(&mut self) -> &Channel {
        let beta = self.beta.as_mut().expect("beta's device is open");
        if beta.pair.is_none() {
            let cq = beta.t.ctx.create_cq(256, 0).expect("attacker CQ");
            let q1 = rc_qp(&beta.t.pd, &cq);
            let q2 = rc_qp(&beta.t.pd, &cq);
            connect(&beta.t, &q1, &beta.t, &q2, ATTACKER);
            beta.pair = Some(Channel {
                qps: vec![q1, q2],
                cq,
            });
        }
        beta.pair.as_ref().expect("just made")
    }

    fn link(&mut self) -> &Channel {
        let victim = self.victim;
        let beta = self.beta.as_mut().expect("beta's device is open");
        if beta.link.is_none() {
            let cq = beta.t.ctx.create_cq(256, 0).expect("attacker CQ");
            let q = rc_qp(&beta.t.pd, &cq);
            let exposed = victim.accept(q.qp_num(), beta.t.gid);
            bring_up(&q, exposed, victim.t.gid, ATTACKER).expect("connect the link");
            beta.link = Some(Channel { qps: vec![q], cq });
        }
        beta.link.as_ref().expect("just made")
    }

    /// Discards the pair or the link (after an error it is in ERR).
    fn discard(&mut self, link: bool) {
        let beta = self.beta.as_mut().expect("beta's device is open");
        if link {
            beta.link = None;
        } else {
            beta.pair = None;
        }
    }

    /// Posts `wr` on the link or the pair and returns its one completion.
    fn run_one(&mut self, over_link: bool, wr: SendWr<'_>) -> WorkCompletion {
        let ctx = self.context();
        let ch = if over_link { self.link() } else { self.pair() };
        ch.requester()
            .post_send(&[wr])
            .unwrap_or_else(|e| panic!("{ctx}: post: {e}"));
        let mut wcs = wait_completions(&ch.cq, 1);
        let wc = wcs.remove(0);
        assert_eq!(wc.wr_id, wr.wr_id, "{ctx}: {wc:?}");
        wc
    }

    fn expect_status(&mut self, wc: &WorkCompletion, expected: WcStatus) {
        self.note(format!("{:?}", wc.status));
        assert_eq!(wc.status, expected, "{}: {wc:?}", self.context());
    }

    fn expect_errno<T>(&mut self, what: &str, result: Result<T, i32>, expected: &[i32]) {
        match result {
            Ok(_) => panic!("{}: {what} succeeded", self.context()),
            Err(errno) => {
                self.note(format!("errno {errno}"));
                assert!(
                    expected.contains(&errno),
                    "{}: {what}: errno {errno}, expected one of {expected:?}",
                    self.context()
                );
            }
        }
    }

    // -- data-path moves -----------------------------------------------

    fn own_write(&mut self) {
        // Up to 32 KiB: longer than hostd's segments, which it uses while
        // the realtime victim is busy.
        let len = 1 + self.rng.below(32 * KIB as u64) as usize;
        let data = self.rng.bytes(len);
        let dst_off = 32 * KIB + self.rng.below((32 * KIB - len + 1) as u64) as usize;
        let id = self.wr_id();
        let beta = self.beta();
        beta.mr.write(0, &data).expect("fill");
        let sge = [beta.mr.sge(0, len as u32)];
        let (iova, rkey) = (beta.mr.iova(), beta.mr.rkey());
        let wr = rdma(id, SendOpcode::RdmaWrite, &sge, iova + dst_off as u64, rkey);
        let wc = self.run_one(false, wr);
        self.expect_status(&wc, WcStatus::Success);
        let landed = read_mr(&self.beta().mr, dst_off, len);
        assert!(landed == data, "{}: own WRITE data differs", self.context());
    }

    fn canary_read(&mut self) {
        let len = 1 + self.rng.below(8 * KIB as u64) as usize;
        let off = self.rng.below((REGION - len) as u64) as usize;
        let id = self.wr_id();
        let (iova, _, rkey) = self.secrets.canary;
        let sge = [self.beta().mr.sge(0, len as u32)];
        let wr = rdma(id, SendOpcode::RdmaRead, &sge, iova + off as u64, rkey);
        let wc = self.run_one(true, wr);
        self.expect_status(&wc, WcStatus::Success);
        let got = read_mr(&self.beta().mr, 0, len);
        assert!(
            got == self.victim.canary_bytes[off..off + len],
            "{}: the canary read back differs",
            self.context()
        );
    }

    fn zero_length_write(&mut self) {
        let id = self.wr_id();
        let (iova, _, rkey) = self.secrets.canary;
        let rkey = if self.rng.chance(2) {
            rkey
        } else {
            self.rng.next_u64() as u32
        };
        let wr = rdma(id, SendOpcode::RdmaWrite, &[], iova, rkey);
        let wc = self.run_one(true, wr);
        self.expect_status(&wc, WcStatus::Success);
    }

    /// An RDMA or atomic op from beta's MR to `addr`/`rkey` of length
    /// `len`, over the link or the pair; it must fail with a remote error.
    fn remote_op(&mut self, over_link: bool, op: SendOpcode, addr: u64, rkey: u32, len: u32) {
        let id = self.wr_id();
        let sge = [self.beta().mr.sge(0, len)];
        let mut wr = rdma(id, op, &sge, addr, rkey);
        wr.compare_add = self.rng.next_u64();
        wr.swap = self.rng.next_u64();
        let wc = self.run_one(over_link, wr);
        let misaligned = matches!(
            op,
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
        ) && !addr.is_multiple_of(8);
        let expected = if misaligned {
            WcStatus::RemInvReqErr
        } else {
            WcStatus::RemAccessErr
        };
        self.expect_status(&wc, expected);
        self.discard(over_link);
    }

    /// A WRITE over the pair whose local SGE is `lkey`/`off`/`len`: it must
    /// fail with a local protection error.
    fn local_op(&mut self, lkey: u32, off: u64, len: u32) {
        let id = self.wr_id();
        let beta = self.beta();
        let sge = [Sge {
            addr: beta.mr.iova() + off,
            length: len,
            lkey,
        }];
        let (iova, rkey) = (beta.mr.iova(), beta.mr.rkey());
        let op = if self.rng.chance(2) {
            SendOpcode::RdmaWrite
        } else {
            SendOpcode::RdmaRead
        };
        let wc = self.run_one(false, rdma(id, op, &sge, iova + 32 * KIB as u64, rkey));
        self.expect_status(&wc, WcStatus::LocProtErr);
        self.discard(false);
    }

    fn read_into_read_only(&mut self) {
        let id = self.wr_id();
        let beta = self.beta();
        let sge = [beta.read_only.sge(0, 64)];
        let (iova, rkey) = (beta.mr.iova(), beta.mr.rkey());
        let wc = self.run_one(false, rdma(id, SendOpcode::RdmaRead, &sge, iova, rkey));
        self.expect_status(&wc, WcStatus::LocProtErr);
        self.discard(false);
    }

    fn unsupported_opcode(&mut self) {
        let op = [
            SendOpcode::LocalInv,
            SendOpcode::BindMw,
            SendOpcode::SendWithInv,
        ][self.rng.below(3) as usize];
        let id = self.wr_id();
        let sge = [self.beta().mr.sge(0, 8)];
        let wc = self.run_one(false, rdma(id, op, &sge, 0, 0));
        self.expect_status(&wc, WcStatus::LocQpOpErr);
        self.discard(false);
    }

    fn send_without_receive(&mut self) {
        let id = self.wr_id();
        let len = self.rng.below(64) as u32;
        let sge = [self.beta().mr.sge(0, len)];
        let mut wr = SendWr::new(id, SendOpcode::Send, SendPayload::Sges(&sge));
        wr.flags |= SIGNALED;
        let wc = self.run_one(true, wr);
        self.expect_status(&wc, WcStatus::RnrRetryExcErr);
        self.discard(true);
    }

    fn oversized_wr(&mut self) {
        let sges: Vec<Sge> = {
            let mr = &self.beta().mr;
            (0..64).map(|i| mr.sge(i * 16, 16)).collect()
        };
        let inline = self.rng.bytes(4 * KIB);
        let ch = self.pair();
        let cap = ch.requester().cap();
        let post = |wr_id, payload| {
            let wr = SendWr::new(wr_id, SendOpcode::Send, payload);
            ch.requester().post_send(&[wr]).map_err(|e| e.errno())
        };
        let too_many = post(1, SendPayload::Sges(&sges[..cap.max_send_sge as usize + 1]));
        let too_long = post(
            2,
            SendPayload::Inline(&inline[..cap.max_inline_data as usize + 1]),
        );
        self.expect_errno("too many SGEs", too_many, &[libc::EINVAL]);
        self.expect_errno("too much inline data", too_long, &[libc::EINVAL]);
    }
}
