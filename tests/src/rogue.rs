//! A compromised vdev: it speaks hostd's protocol (version 3) directly,
//! sending whatever it likes, the way a vdev taken over by its guest
//! could, and plays its own guest driver: its guest memory is a sealed
//! memfd laid out as `vrdma_hostd::engine::testing` says (doorbell page,
//! event ring, CQ, QP rings, data region), and it writes WQEs into its
//! rings and reads CQEs from its CQ through that module's [`Driver`].
//! hostd must treat it like any hostile peer.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_hostd::engine::guest::SharedMapping;
pub use vrdma_hostd::engine::testing::{
    qp_setup, Driver, ALL, CQ, CQN, CQ_DEPTH, DATA, DATA_LEN, DEPTH, DOORBELL, EQ, EQ_DEPTH, IOVA,
    MEM, STRIDE,
};
use vrdma_hostd_protocol::channel::Channel;
use vrdma_hostd_protocol::messages::{
    MrRegistration, MrSegment, QpConnection, QpModify, QpSetup, Request, Response, Welcome,
    PROTOCOL_VERSION,
};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::ring::{Cqe, DRIVER_INDEX_OFFSET};
use vrdma_spec::verbs::QpState;

/// A device registered with hostd by hand.
#[derive(Debug)]
pub struct RogueVdev {
    channel: Channel,
    pub welcome: Welcome,
    /// Kept open: closing it is no message to hostd.
    _notifications: File,
    /// Its guest memory and rings, once [`RogueVdev::memory`] made them.
    driver: Option<Driver>,
    /// The memfd behind the guest memory.
    memfd: Option<File>,
    /// The doorbell queue's kick (hostd sleeps on it) and vector 0's
    /// interrupt (hostd signals it after writing an event).
    kick: EventFd,
    irq: EventFd,
    /// Completions taken from the CQ and not yet handed out.
    polled: VecDeque<Cqe>,
}

/// How hostd answered a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Ok,
    /// A RegisterMr's keys.
    Keys(u32, u32),
    /// A QueryQp's state.
    State(u8),
    /// A QuerySrq's limit.
    SrqLimit(u32),
    /// A TakeMads's MADs.
    Mads(Vec<vrdma_hostd_protocol::messages::MadIn>),
    Refused(i32),
    /// An Adopt's count of records.
    Adopted(u32),
    /// A TakeRecords's records, and whether more follow.
    Records(Vec<vrdma_hostd_protocol::messages::Record>, bool),
    /// A GsiPush's answer, with how many descriptors came with it (one:
    /// the socket).
    MadPush(usize),
    /// hostd closed the connection (or it broke).
    Gone,
}

impl RogueVdev {
    /// [`RogueVdev::hello`], tried again every 2 ms for up to 5 s while
    /// hostd refuses with one of `transient` (errnos that go away once it
    /// has seen devices close, which it does asynchronously).
    pub fn hello_retrying(
        socket: &Path,
        tenant: &str,
        device: &str,
        transient: &[i32],
    ) -> Result<Self, i32> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match Self::hello(socket, tenant, device) {
                Err(errno) if transient.contains(&errno) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                result => return result,
            }
        }
    }

    /// Connects to hostd at `socket` and says Hello as `device` of
    /// `tenant`; `Err(errno)` when hostd refuses.
    pub fn hello(socket: &Path, tenant: &str, device: &str) -> Result<Self, i32> {
        let channel = Channel::connect(socket).expect("connect to hostd");
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            tenant: tenant.into(),
            device: device.into(),
        };
        let (response, mut files): (Response, Vec<File>) =
            channel.call(&hello, &[]).expect("hostd answers Hello");
        let welcome = match response {
            Response::Welcome(w) => *w,
            Response::Refused { errno, .. } => return Err(errno),
            other => panic!("hostd answered {other:?} to Hello"),
        };
        assert_eq!(files.len(), 1, "a Welcome carries the notification channel");
        Ok(RogueVdev {
            channel,
            welcome,
            _notifications: files.remove(0),
            driver: None,
            memfd: None,
            kick: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
            irq: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
            polled: VecDeque::new(),
        })
    }

    /// The LID hostd assigned.
    pub fn lid(&self) -> u16 {
        self.welcome.lid
    }

    /// The GID hostd assigned (what connections towards it name).
    pub fn gid(&self) -> [u8; 16] {
        self.welcome.gid
    }

    /// Sends a journal (hostd does not answer it).
    pub fn journal(&self, journal: vrdma_hostd_protocol::messages::Journal) {
        self.channel
            .send(&Request::Journal(journal), &[])
            .expect("send a journal");
    }

    /// Sends `request` with `fds` and returns hostd's answer.
    pub fn call(&self, request: &Request, fds: &[RawFd]) -> Answer {
        match self.channel.call::<_, Response>(request, fds) {
            Ok((Response::Ok, _)) => Answer::Ok,
            Ok((Response::MrKeys { lkey, rkey }, _)) => Answer::Keys(lkey, rkey),
            Ok((Response::QpState { state }, _)) => Answer::State(state),
            Ok((Response::SrqLimit { limit }, _)) => Answer::SrqLimit(limit),
            Ok((Response::Mads(mads), _)) => Answer::Mads(mads),
            Ok((Response::Adopted { records }, _)) => Answer::Adopted(records),
            Ok((Response::Records { records, more }, _)) => Answer::Records(records, more),
            Ok((Response::MadPush, files)) => Answer::MadPush(files.len()),
            Ok((Response::Refused { errno, .. }, _)) => Answer::Refused(errno),
            Ok((Response::Welcome(_), _)) => panic!("hostd answered Welcome to {request:?}"),
            // Closed, or reset while hostd shut a failed device down.
            Err(_) => Answer::Gone,
        }
    }

    /// Asks for QP1's push socket ([`Request::GsiPush`]): its end.
    pub fn gsi_push(&self) -> vrdma_hostd_protocol::channel::Channel {
        match self.channel.call::<_, Response>(&Request::GsiPush, &[]) {
            Ok((Response::MadPush, mut files)) if files.len() == 1 => {
                std::os::fd::OwnedFd::from(files.remove(0)).into()
            }
            other => panic!("GsiPush answered {other:?}"),
        }
    }

    /// Offers `len` bytes of `file` from `file_offset` as memory slot
    /// `slot` at guest address `gpa`.
    pub fn add_memory(
        &self,
        slot: u32,
        gpa: u64,
        file: &File,
        len: u64,
        file_offset: u64,
    ) -> Answer {
        let add = Request::AddMemory {
            slot,
            gpa,
            len,
            file_offset,
        };
        self.call(&add, &[file.as_raw_fd()])
    }

    /// Its guest memory: a sealed memfd of [`MEM`] bytes at guest address
    /// 0, offered as the slots `(slot, gpa, len)` of `slots` (each the
    /// file's bytes at the same offset), which hostd must accept.
    pub fn memory(&mut self, slots: &[(u32, u64, u64)]) {
        let file = sealed_memfd("rogue", MEM).expect("memfd");
        for &(slot, gpa, len) in slots {
            let answer = self.add_memory(slot, gpa, &file, len, gpa);
            assert_eq!(answer, Answer::Ok, "memory slot {slot}");
        }
        let map = SharedMapping::map(file.try_clone().expect("dup"), 0, MEM).expect("map");
        self.driver = Some(Driver::new(map));
        self.memfd = Some(file);
    }

    /// The memfd behind its guest memory.
    pub fn memfd(&self) -> &File {
        self.memfd.as_ref().expect("memory attached")
    }

    /// Its guest memory and rings.
    pub fn driver(&mut self) -> &mut Driver {
        self.driver.as_mut().expect("memory attached")
    }

    /// Its doorbell page (with the kick eventfd), vector 0's event ring
    /// (with the interrupt eventfd) and its CQ, where the layout puts
    /// them; hostd must accept them.
    pub fn rings(&self) {
        let doorbell = Request::SetDoorbell { gpa: DOORBELL };
        assert_eq!(self.call(&doorbell, &[self.kick.as_raw_fd()]), Answer::Ok);
        let eq = Request::CreateEq {
            vector: 0,
            gpa: EQ,
            depth: EQ_DEPTH,
        };
        assert_eq!(self.call(&eq, &[self.irq.as_raw_fd()]), Answer::Ok);
        let cq = Request::CreateCq {
            cqn: CQN,
            gpa: CQ,
            depth: CQ_DEPTH,
            vector: 0,
        };
        assert_eq!(self.call(&cq, &[]), Answer::Ok);
    }

    /// Registers `len` bytes at `offset` of slot `slot` as IOVA [`IOVA`]..
    /// in PD 1 with every access: [`Answer::Keys`] or a refusal.
    pub fn register(&self, slot: u32, offset: u64, len: u64) -> Answer {
        let reg = Request::RegisterMr(MrRegistration {
            pd: 1,
            access: ALL,
            iova: IOVA,
            len,
            segments: vec![MrSegment { slot, offset, len }],
        });
        self.call(&reg, &[])
    }

    /// The setup of its next QP, numbered `vqpn`, with caps
    /// (max_send_sge, max_inline_data, max_recv_sge).
    pub fn next_qp(&mut self, vqpn: u32, caps: (u32, u32, u32)) -> QpSetup {
        qp_setup(self.driver().qps.len(), vqpn, caps, DEPTH, STRIDE)
    }

    /// Creates the QP `setup` describes; the driver tracks it from now on
    /// if hostd accepted it (its index there is `driver().qps.len() - 1`).
    pub fn create_qp(&mut self, setup: &QpSetup) -> Answer {
        let answer = self.call(&Request::CreateQp(*setup), &[]);
        if answer == Answer::Ok {
            self.driver().add_qp(setup);
        }
        answer
    }

    /// Moves QP `vqpn` to `state`, with `connection` (at RTR and RTS).
    pub fn modify(&self, vqpn: u32, state: QpState, connection: Option<QpConnection>) -> Answer {
        let modify = QpModify {
            vqpn,
            state: state.into(),
            connection,
            access: None,
            qkey: None,
        };
        self.call(&Request::ModifyQp(modify), &[])
    }

    /// RESET, INIT, RTR and RTS with `connection`: the first answer that
    /// is not Ok, or Ok.
    pub fn connect(&self, vqpn: u32, connection: QpConnection) -> Answer {
        [
            (QpState::Reset, None),
            (QpState::Init, None),
            (QpState::Rtr, Some(connection)),
            (QpState::Rts, Some(connection)),
        ]
        .into_iter()
        .map(|(state, c)| self.modify(vqpn, state, c))
        .find(|a| *a != Answer::Ok)
        .unwrap_or(Answer::Ok)
    }

    /// The state of QP `vqpn` as hostd's datapath sees it.
    pub fn query_qp(&self, vqpn: u32) -> Answer {
        self.call(&Request::QueryQp { vqpn }, &[])
    }

    /// Notifies the doorbell queue if hostd asked for it (NEED_KICK at
    /// offset 0 of the doorbell page), as a driver does after ringing.
    pub fn kick_if_needed(&mut self) {
        if self.driver().needs_kick() {
            self.kick.write(1).expect("kick");
        }
    }

    /// Publishes `producer` as the send ring's producer index of QP `qp`
    /// whatever it holds, rings its doorbell bit and kicks.
    pub fn corrupt_send_ring(&mut self, qp: usize, producer: u32) {
        let sq = self.driver().qps[qp].sq;
        let at = (sq + DRIVER_INDEX_OFFSET) as usize;
        assert!(self.driver().mem.write(at, &producer.to_le_bytes()));
        self.driver().ring(qp);
        self.kick_if_needed();
    }

    /// The next completion in its CQ, waiting up to `within`.
    pub fn completion(&mut self, within: Duration) -> Option<Cqe> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(cqe) = self.polled.pop_front() {
                return Some(cqe);
            }
            let driver = self.driver.as_mut().expect("memory attached");
            driver.poll_each(|cqe| self.polled.push_back(cqe));
            if self.polled.is_empty() {
                if Instant::now() > deadline {
                    return None;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// `len` bytes of its guest memory at guest address `gpa`.
    pub fn memory_bytes(&mut self, gpa: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        assert!(self.driver().mem.read(gpa as usize, &mut out));
        out
    }
}
