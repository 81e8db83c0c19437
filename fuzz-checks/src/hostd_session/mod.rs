//! hostd's handling of a compromised vdev's requests (protocol 3): the
//! real [`Server`] (policy, registry, accounts, datapath, software NIC)
//! serves one connection per input over an `AF_UNIX` seqpacket
//! socketpair, and the input plays the vdev: a Hello (mostly as tenant
//! `alpha`, sometimes hostile), then every kind of request with hostile
//! numbers, sealed, unsealed and wrong descriptors, memory, rings and MR
//! pieces in and out of the memory it added, raw garbage and empty
//! messages.
//!
//! A model of what the connection holds (its memory slots, MRs, doorbell,
//! event rings, CQs and QPs with their states) predicts every answer —
//! `Welcome`, `Ok`, `MrKeys`, `QpState` or `Refused` with its errno — and
//! the check asserts:
//! - every request gets exactly one answer, the predicted one (descriptors
//!   only with a Welcome: one, the notification channel), and the
//!   connection closes only after a protocol violation (undecodable,
//!   oversized or empty message);
//! - a refused request changes nothing: alpha's usage by hostd's accounts
//!   (devices, physical queues, MRs, MR bytes, QPs) always equals the
//!   model's, which only accepted requests change;
//! - keys hostd assigns are never 0, an lkey is not its rkey, and no key
//!   is one alpha or beta holds; an accepted MR names only memory this
//!   connection added and has not removed; alpha stays within its quotas;
//! - once the connection is gone, alpha holds nothing, and the admin
//!   socket's report ([`Server::stats`]) agrees;
//! - `beta`, a well-behaved tenant connected once per process with memory,
//!   a doorbell page, an event ring, a CQ, two MRs and a connected QP,
//!   keeps all of them (its MRs deregister and register again, its QP is
//!   in RTS and takes new access and a new connection, its doorbell, event
//!   ring and CQ are still there), and `delta`'s device (a network alpha
//!   may not reach) stays untouched.
//!
//! The server lives for the whole process and serves inputs one at a time
//! (a mutex): hostd is built to outlive its vdevs, so reusing it is what
//! it promises, and every input starts from "alpha holds nothing". Each
//! input gets fresh memfds: what hostd wrote into one input's memory must
//! not be the next input's rings.

mod generate;
mod model;

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};

use vrdma_hostd::server::Server;
use vrdma_hostd::stats::Usage;
use vrdma_hostd_protocol::channel::{Channel, ChannelError, MAX_FDS};
use vrdma_hostd_protocol::messages::{
    self, MrRegistration, MrSegment, QpConnection, QpModify, QpSetup, Request, Response, WorkRing,
    PROTOCOL_VERSION,
};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::verbs::{access, QpState};

use crate::input::Input;
use crate::server::{eventfd, Hostd};
use generate::Step;
use model::{Expect, Model};

/// Requests of one input after its first Hello: enough to build rings,
/// CQs, MRs and QPs and take them through their states, short enough that
/// hostd's table limits are never the reason for a refusal.
const MAX_OPS: usize = 48;
/// The fuzzed tenant and its quotas (set in [`POLICY`]).
const ALPHA: &str = "alpha";
const ALPHA_QUEUES: usize = 2;
const ALPHA_MAX_MR: usize = 6;
const ALPHA_MAX_MR_BYTES: u64 = 256 * 1024;
const ALPHA_MAX_TOTAL_MR_BYTES: u64 = 512 * 1024;
/// The well-behaved tenant, its device, its memory and objects.
const BETA: &str = "beta";
const BETA_DEVICE: &str = "steady";
const BETA_GPA: u64 = 0x10_0000;
const BETA_SLOT_BYTES: u64 = 64 * 1024;
const BETA_CQN: u32 = 7;
const BETA_QP: u32 = 1;
/// beta's MRs: (offset in its slot, bytes).
const BETA_MRS: [(u64, u64); 2] = [(0, BETA_SLOT_BYTES), (4096, 4096)];
/// A connected tenant in a network alpha may not reach.
const DELTA: &str = "delta";
const DELTA_DEVICE: &str = "quiet";
/// A tenant whose uid this process does not have.
const GAMMA: &str = "gamma";
/// Sizes of the sealed memfds the vdev offers as memory.
const MEMFD_SIZES: [u64; 4] = [4096, 64 * 1024, 1 << 20, 16 << 20];
const PAGE: u64 = 4096;

/// alpha reaches beta's network, not delta's; gamma must connect as
/// another uid. Physical queues: 8 on the NIC, 1 + 1 + 2 in use and 1 kept
/// for gamma's first device, so alpha's Hello always finds its 2.
const POLICY: &str = r#"
[[tenant]]
name = "alpha"
network = "red"
reachable = ["blue"]
physical_queues = 2
quotas = { max_mr = 6, max_mr_bytes = 262144, max_total_mr_bytes = 524288 }

[[tenant]]
name = "beta"
network = "blue"
physical_queues = 1

[[tenant]]
name = "delta"
network = "hidden"
physical_queues = 1

[[tenant]]
name = "gamma"
network = "green"
physical_queues = 1
uid = OTHER_UID
"#;

/// A descriptor the vdev attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fd {
    /// The input's sealed memfd of `MEMFD_SIZES[i]` bytes.
    Sealed(usize),
    /// A memfd without seals (hostd must not map it).
    Unsealed,
    Eventfd,
    /// The read end of a pipe (no eventfd, no memory).
    Pipe,
}

/// What the server and the steady tenants are, set up once per process.
struct Harness {
    hostd: Hostd,
    /// Hands a connection to the thread that runs `Server::connection`.
    run: Sender<Arc<Channel>>,
    /// One message per connection served to its end.
    done: Receiver<()>,
    beta: Channel,
    beta_lid: u16,
    /// beta's MRs' keys: lkey, rkey of the first, then of the second.
    beta_keys: [u32; 4],
    beta_usage: Usage,
    /// Open for the process: delta's device stays connected.
    _delta: Channel,
    delta_lid: u16,
    delta_usage: Usage,
    unsealed: File,
    eventfd: File,
    /// A pipe's read end (sent) and write end (kept open).
    pipe: (File, File),
    page: u64,
}

static HARNESS: OnceLock<Mutex<Harness>> = OnceLock::new();

/// Plays `data` as one vdev connection against the shared server.
pub fn check(data: &[u8]) {
    let harness = HARNESS.get_or_init(|| Mutex::new(Harness::new()));
    // A failed input (property tests go on after one) leaves its
    // connection closed and torn down: the state is still sound.
    let mut h = harness.lock().unwrap_or_else(|e| e.into_inner());
    h.play(data);
}

impl Harness {
    fn new() -> Self {
        // SAFETY: getuid has no preconditions.
        let other_uid = unsafe { libc::getuid() }.wrapping_add(1);
        let policy = POLICY.replace("OTHER_UID", &other_uid.to_string());
        let hostd = Hostd::start("session", &policy, 8, false);

        let (run, runs) = mpsc::channel::<Arc<Channel>>();
        let (finished, done) = mpsc::channel();
        let runner = Arc::clone(&hostd.server);
        std::thread::Builder::new()
            .name("fuzz-vdev-conn".into())
            .spawn(move || {
                for channel in runs {
                    runner.connection(channel);
                    if finished.send(()).is_err() {
                        break;
                    }
                }
            })
            .expect("connection thread");

        let (beta, beta_lid) = steady(&hostd.server, BETA, BETA_DEVICE);
        let beta_keys = set_up_beta(&beta, beta_lid);
        let (delta, delta_lid) = steady(&hostd.server, DELTA, DELTA_DEVICE);
        let beta_usage = hostd.usage(BETA);
        let delta_usage = hostd.usage(DELTA);
        assert_eq!(
            (beta_usage.mrs, beta_usage.qps, delta_usage.devices),
            (2, 1, 1),
            "steady tenants set up"
        );
        // SAFETY: sysconf only reads a system constant.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        Harness {
            hostd,
            run,
            done,
            beta,
            beta_lid,
            beta_keys,
            beta_usage,
            _delta: delta,
            delta_lid,
            delta_usage,
            unsealed: unsealed_memfd(),
            eventfd: eventfd(),
            pipe: pipe(),
            page: u64::try_from(page).unwrap_or(4096),
        }
    }

    fn usage(&self, tenant: &str) -> Usage {
        self.hostd.usage(tenant)
    }

    fn play(&mut self, data: &[u8]) {
        assert_eq!(
            self.usage(ALPHA),
            Usage::default(),
            "alpha holds something before its connection"
        );
        let mut session = self.connect();
        let mut input = Input::new(data);
        let (hello, fds) = session.gen_hello(&mut input);
        session.step(&hello, &fds);
        let mut ops = 0;
        while !session.closed && !input.is_empty() && ops < MAX_OPS {
            ops += 1;
            match session.gen_step(&mut input) {
                Step::Request(request, fds) => session.step(&request, &fds),
                Step::Raw(bytes) => session.raw(&bytes),
            }
        }
        session.finish();
        self.check_steady();
    }

    /// A new connection of the fuzzed vdev, with fresh memfds.
    fn connect(&self) -> Session<'_> {
        let (ours, theirs) = Channel::pair().expect("socketpair");
        self.run.send(Arc::new(theirs)).expect("connection thread");
        Session {
            h: self,
            chan: ours,
            model: Model::default(),
            closed: false,
            ended: false,
            memfds: MEMFD_SIZES
                .iter()
                .map(|&size| sealed_memfd("fuzz-mem", size).expect("sealed memfd"))
                .collect(),
        }
    }

    /// beta and delta kept everything: beta's MRs are still its own (they
    /// deregister, and register again), its QP is in RTS and takes new
    /// access and a new connection, its doorbell page, event ring and CQ
    /// are still there; the admin socket's report agrees with the accounts.
    fn check_steady(&mut self) {
        let stats = self.hostd.server.stats();
        for (tenant, usage) in [
            (ALPHA, Usage::default()),
            (BETA, self.beta_usage),
            (DELTA, self.delta_usage),
        ] {
            let reported = stats.tenants.iter().find(|t| t.tenant == tenant);
            assert_eq!(
                reported.map(|t| t.usage.clone()),
                Some(entries(usage)),
                "{tenant}'s usage as the admin socket reports it"
            );
        }
        assert_eq!(self.usage(BETA), self.beta_usage, "beta's usage");
        assert_eq!(self.usage(DELTA), self.delta_usage, "delta's usage");
        let beta = &self.beta;
        for (i, &(offset, len)) in BETA_MRS.iter().enumerate() {
            let lkey = self.beta_keys[2 * i];
            expect_ok(beta, &Request::DeregisterMr { lkey }, &[]);
            let (l, r) = register(beta, offset, len);
            self.beta_keys[2 * i] = l;
            self.beta_keys[2 * i + 1] = r;
        }
        match call(beta, &Request::QueryQp { vqpn: BETA_QP }, &[]) {
            Response::QpState { state } if state == u8::from(QpState::Rts) => {}
            other => panic!("beta's QP is no longer in RTS: {other:?}"),
        }
        let access = Some(access::REMOTE_READ);
        expect_ok(beta, &modify(QpState::Rts, None, access), &[]);
        let again = modify(QpState::Rts, Some(beta_connection(self.beta_lid)), None);
        expect_ok(beta, &again, &[]);
        let kick = self.eventfd.as_raw_fd();
        let exists = [
            (
                Request::SetDoorbell { gpa: BETA_GPA },
                vec![kick],
                libc::EEXIST,
            ),
            (beta_eq(), vec![kick], libc::EEXIST),
            (beta_cq(), vec![], libc::EEXIST),
            (Request::DestroyCq { cqn: BETA_CQN }, vec![], libc::EBUSY),
        ];
        for (request, fds, errno) in exists {
            match call(beta, &request, &fds) {
                Response::Refused { errno: e, .. } if e == errno => {}
                other => panic!("beta's {request:?} answered {other:?}: its object is gone"),
            }
        }
        assert_eq!(
            self.usage(BETA),
            self.beta_usage,
            "beta's usage after its probe"
        );
    }
}

/// One connection of the fuzzed vdev.
struct Session<'h> {
    h: &'h Harness,
    chan: Channel,
    model: Model,
    /// hostd closed the connection (after a protocol violation).
    closed: bool,
    /// hostd's connection handling returned.
    ended: bool,
    /// This input's sealed memfds, of [`MEMFD_SIZES`].
    memfds: Vec<File>,
}

impl Drop for Session<'_> {
    /// Also when a check failed (property tests go on with the next case):
    /// the next input's connection must not be taken for this one.
    fn drop(&mut self) {
        self.end();
    }
}

impl Session<'_> {
    fn raw_fd(&self, fd: Fd) -> RawFd {
        match fd {
            Fd::Sealed(i) => self.memfds[i].as_raw_fd(),
            Fd::Unsealed => self.h.unsealed.as_raw_fd(),
            Fd::Eventfd => self.h.eventfd.as_raw_fd(),
            Fd::Pipe => self.h.pipe.0.as_raw_fd(),
        }
    }

    /// `bytes` sent as they are: what decodes is a request like any other;
    /// the rest (and anything over `MAX_MESSAGE`) is a protocol violation,
    /// answered with `EPROTO` before hostd hangs up; an empty message is
    /// the peer hanging up.
    fn raw(&mut self, bytes: &[u8]) {
        if let Ok(request) = messages::decode::<Request>(bytes) {
            if let Request::Hello { tenant, .. } = &request {
                // A vdev with beta's or delta's credentials *is* beta or
                // delta: it could add a device to them, which would be
                // no attack. The generator's Hellos cover their names.
                if tenant == BETA || tenant == DELTA {
                    return;
                }
            }
            self.exchange(&request, bytes, &[]);
            return;
        }
        self.chan.send_bytes(bytes, &[]).expect("send raw bytes");
        if bytes.is_empty() {
            assert!(
                matches!(self.chan.recv::<Response>(), Err(ChannelError::Closed)),
                "an empty message did not end the connection"
            );
        } else {
            match self.chan.recv::<Response>() {
                Ok((Response::Refused { errno, .. }, files)) if errno == libc::EPROTO => {
                    assert!(files.is_empty(), "descriptors with a refusal");
                }
                other => panic!("garbage {bytes:?} answered with {other:?}"),
            }
            assert!(
                matches!(self.chan.recv::<Response>(), Err(ChannelError::Closed)),
                "hostd kept a connection after a protocol violation"
            );
        }
        // hostd's end is closed, so its teardown is done.
        self.closed = true;
        self.model = Model::default();
        self.check_usage("a protocol violation");
    }

    fn step(&mut self, request: &Request, fds: &[Fd]) {
        let bytes = messages::encode(request).expect("a request encodes");
        self.exchange(request, &bytes, fds);
    }

    /// Sends one request, reads its one answer, checks it against the
    /// model's prediction and hostd's reported usage.
    fn exchange(&mut self, request: &Request, bytes: &[u8], fds: &[Fd]) {
        assert!(fds.len() <= MAX_FDS);
        let lids = (self.h.beta_lid, self.h.delta_lid);
        let expect = self.model.predict(request, fds, lids, self.h.page);
        let raw: Vec<RawFd> = fds.iter().map(|&fd| self.raw_fd(fd)).collect();
        self.chan.send_bytes(bytes, &raw).expect("send a request");
        let (response, files) = match self.chan.recv::<Response>() {
            Ok(answer) => answer,
            Err(e) => panic!("no answer to {request:?}: {e:?}"),
        };
        assert_no_pending(&self.chan, request);
        if !matches!(response, Response::Welcome(_)) {
            assert!(files.is_empty(), "descriptors with {response:?}");
        }
        let mut keys = None;
        let accepted = match (&response, expect) {
            (Response::Welcome(w), Expect::Welcome | Expect::Either) => {
                self.welcomed(w.lid, w.gid, w.physical_queues, &files);
                true
            }
            (Response::Ok, Expect::Ok | Expect::OkOrErr | Expect::Either) => true,
            // No MAD is ever sent to the session's devices.
            (Response::Mads(mads), Expect::Either) => {
                assert!(mads.is_empty(), "MADs for {request:?}: {mads:?}");
                false
            }
            (Response::MrKeys { lkey, rkey }, Expect::Keys) => {
                self.check_keys(request, *lkey, *rkey);
                keys = Some((*lkey, *rkey));
                true
            }
            (Response::QpState { state: got }, Expect::State { state, or_err }) => {
                let err = u8::from(QpState::Err);
                if *got != u8::from(state) && !(or_err && *got == err) {
                    unexpected(request, &response, expect);
                }
                if let (Request::QueryQp { vqpn }, true) = (request, *got == err) {
                    self.model.failed(*vqpn);
                }
                false
            }
            (Response::Refused { errno, reason }, _) => {
                assert!(*errno > 0, "errno {errno} ({reason}) for {request:?}");
                match expect {
                    Expect::Refuse(want) => {
                        assert_eq!(*errno, want, "errno for {request:?} ({reason})")
                    }
                    Expect::OkOrErr if *errno == libc::EINVAL => {
                        if let Request::ModifyQp(m) = request {
                            self.model.failed(m.vqpn);
                        }
                    }
                    Expect::Either => {}
                    _ => unexpected(request, &response, expect),
                }
                false
            }
            _ => unexpected(request, &response, expect),
        };
        if accepted {
            self.model.apply(request, fds, keys);
        }
        self.check_usage(&format!("{request:?}"));
    }

    /// A Welcome: alpha's queues, the notification channel, a LID of its
    /// own and the GID hostd derives from it (no fabric).
    fn welcomed(&mut self, lid: u16, gid: [u8; 16], queues: u32, files: &[File]) {
        assert_eq!(queues as usize, ALPHA_QUEUES, "alpha's physical queues");
        let [notify] = files else {
            panic!("Welcome with {} descriptors, not 1", files.len());
        };
        let is_socket = notify.metadata().is_ok_and(|m| m.file_type().is_socket());
        assert!(is_socket, "the notification channel is no socket");
        assert!(
            ![0, self.h.beta_lid, self.h.delta_lid].contains(&lid),
            "alpha got LID {lid:#x}"
        );
        assert_eq!(gid, vrdma_spec::gid::loopback_gid(lid), "alpha's GID");
        self.model.greeted = Some(lid);
    }

    /// Keys hostd assigned: never 0, two distinct ones, none that alpha or
    /// beta holds; the MR lies in memory this connection added.
    fn check_keys(&self, request: &Request, lkey: u32, rkey: u32) {
        assert!(
            lkey != 0 && rkey != 0 && lkey != rkey,
            "keys {lkey:#x}/{rkey:#x}"
        );
        for key in [lkey, rkey] {
            assert!(
                !self.model.keys().any(|k| k == key) && !self.h.beta_keys.contains(&key),
                "key {key:#x} is already taken"
            );
        }
        if let Request::RegisterMr(mr) = request {
            assert!(
                mr.segments.iter().all(|s| self.model.inside(s)),
                "hostd registered an MR over memory this connection did not add: {mr:?}"
            );
        }
    }

    /// alpha's usage is the model's (so a refused request changed
    /// nothing), within its quotas; the steady tenants' is unchanged.
    fn check_usage(&self, after: &str) {
        let alpha = self.h.usage(ALPHA);
        assert_eq!(alpha, self.model.usage(), "alpha's usage after {after}");
        assert!(
            alpha.mr_bytes <= ALPHA_MAX_TOTAL_MR_BYTES && alpha.mrs <= ALPHA_MAX_MR as u64,
            "alpha is over its memory quota after {after}: {alpha:?}"
        );
        assert_eq!(
            self.h.usage(BETA),
            self.h.beta_usage,
            "beta's usage after alpha's {after}"
        );
    }

    /// The vdev hangs up: hostd must send nothing more, tear the device
    /// down and leave alpha holding nothing.
    fn finish(mut self) {
        self.end();
        assert_no_pending(&self.chan, &"the end of the connection");
        assert_eq!(
            self.h.usage(ALPHA),
            Usage::default(),
            "alpha still holds something after its connection closed"
        );
    }

    /// Hangs up (write side: what hostd still sends stays readable) and
    /// waits for hostd's connection handling to return.
    fn end(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        // SAFETY: shutdown on a socket this session owns; no memory effects.
        unsafe { libc::shutdown(self.chan.as_raw_fd(), libc::SHUT_WR) };
        if self.h.done.recv().is_err() && !std::thread::panicking() {
            panic!("hostd's connection handling never returned (it panicked)");
        }
    }
}

fn unexpected(request: &Request, response: &Response, expect: Expect) -> ! {
    panic!("{request:?} answered {response:?}, expected {expect:?}")
}

/// No message waits on `chan`: hostd answered `after` exactly once.
fn assert_no_pending(chan: &Channel, after: &dyn std::fmt::Debug) {
    let mut byte = [0u8; 1];
    // SAFETY: a non-blocking peek into a 1-byte buffer we own.
    let n = unsafe {
        libc::recv(
            chan.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    assert!(n <= 0, "hostd sent more than one answer to {after:?}");
}

/// A steady device of `tenant`: its channel and LID.
fn steady(server: &Arc<Server>, tenant: &str, device: &str) -> (Channel, u16) {
    let (ours, theirs) = Channel::pair().expect("socketpair");
    let conn = Arc::clone(server);
    std::thread::Builder::new()
        .name(format!("fuzz-{tenant}"))
        .spawn(move || conn.connection(Arc::new(theirs)))
        .expect("steady connection thread");
    let hello = Request::Hello {
        version: PROTOCOL_VERSION,
        tenant: tenant.into(),
        device: device.into(),
    };
    let (response, _files): (Response, Vec<File>) = ours.call(&hello, &[]).expect("Hello");
    match response {
        Response::Welcome(w) => (ours, w.lid),
        other => panic!("{tenant} refused: {other:?}"),
    }
}

/// beta's memory, doorbell page, event ring, CQ, MRs and a QP connected to
/// itself in RTS; returns its MRs' keys.
fn set_up_beta(beta: &Channel, lid: u16) -> [u32; 4] {
    let mem = sealed_memfd("fuzz-beta", BETA_SLOT_BYTES).expect("beta's memory");
    let add = Request::AddMemory {
        slot: 0,
        gpa: BETA_GPA,
        len: BETA_SLOT_BYTES,
        file_offset: 0,
    };
    expect_ok(beta, &add, &[mem.as_raw_fd()]);
    let (kick, irq) = (eventfd(), eventfd());
    let doorbell = Request::SetDoorbell { gpa: BETA_GPA };
    expect_ok(beta, &doorbell, &[kick.as_raw_fd()]);
    expect_ok(beta, &beta_eq(), &[irq.as_raw_fd()]);
    expect_ok(beta, &beta_cq(), &[]);
    let mut keys = [0; 4];
    for (i, &(offset, len)) in BETA_MRS.iter().enumerate() {
        (keys[2 * i], keys[2 * i + 1]) = register(beta, offset, len);
    }
    let ring = |page: u64, stride| WorkRing {
        gpa: BETA_GPA + page * PAGE,
        depth: 16,
        stride,
    };
    let qp = Request::CreateQp(QpSetup {
        vqpn: BETA_QP,
        pd: 1,
        db_index: 0,
        send_cqn: BETA_CQN,
        recv_cqn: BETA_CQN,
        sq_sig_all: false,
        sq: ring(4, 128),
        rq: ring(5, 64),
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
        srqn: None,
        qp_type: 2,
    });
    expect_ok(beta, &qp, &[]);
    expect_ok(beta, &modify(QpState::Init, None, Some(0)), &[]);
    for state in [QpState::Rtr, QpState::Rts] {
        expect_ok(beta, &modify(state, Some(beta_connection(lid)), None), &[]);
    }
    keys
}

fn beta_eq() -> Request {
    Request::CreateEq {
        vector: 0,
        gpa: BETA_GPA + PAGE,
        depth: 64,
    }
}

fn beta_cq() -> Request {
    Request::CreateCq {
        cqn: BETA_CQN,
        gpa: BETA_GPA + 2 * PAGE,
        depth: 64,
        vector: 0,
    }
}

/// Registers `len` bytes at `offset` of beta's slot; returns the keys.
fn register(beta: &Channel, offset: u64, len: u64) -> (u32, u32) {
    let request = Request::RegisterMr(MrRegistration {
        pd: 1,
        access: access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE,
        iova: BETA_GPA + offset,
        len,
        segments: vec![MrSegment {
            slot: 0,
            offset,
            len,
        }],
    });
    match call(beta, &request, &[]) {
        Response::MrKeys { lkey, rkey } => (lkey, rkey),
        other => panic!("beta's MR refused: {other:?}"),
    }
}

/// beta's QP to `state`.
fn modify(state: QpState, connection: Option<QpConnection>, access: Option<u32>) -> Request {
    Request::ModifyQp(QpModify {
        vqpn: BETA_QP,
        state: state.into(),
        connection,
        access,
        qkey: None,
    })
}

fn beta_connection(lid: u16) -> QpConnection {
    QpConnection {
        dgid: vrdma_spec::gid::loopback_gid(lid),
        dlid: None,
        dest_qpn: BETA_QP,
        flow_label: 0,
        hop_limit: 64,
        traffic_class: 0,
        access: access::REMOTE_READ | access::REMOTE_WRITE,
        rnr_retry: 7,
        retry_cnt: 7,
        min_rnr_timer: 12,
        timeout: 14,
        path_mtu: 4096,
        sq_psn: 0,
        rq_psn: 0,
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
    }
}

fn call(chan: &Channel, request: &Request, fds: &[RawFd]) -> Response {
    let (response, _files): (Response, Vec<File>) = chan.call(request, fds).expect("hostd answers");
    response
}

fn expect_ok(chan: &Channel, request: &Request, fds: &[RawFd]) {
    let response = call(chan, request, fds);
    assert_eq!(response, Response::Ok, "{request:?}");
}

/// A memfd of 64 KiB without seals.
fn unsealed_memfd() -> File {
    let name = c"fuzz-unsealed";
    // SAFETY: a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: a fresh descriptor nobody else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(64 * 1024).expect("size the unsealed memfd");
    file
}

/// A pipe: (read end, write end).
fn pipe() -> (File, File) {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2");
    // SAFETY: two fresh descriptors nobody else owns.
    unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
}

/// `usage` as the admin socket reports it ([`Server::stats`]).
fn entries(usage: Usage) -> BTreeMap<String, u64> {
    usage
        .entries()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        // One session at a time, each closed before the next: no context
        // is ever kept for a successor.
        .chain([("orphaned_contexts".to_owned(), 0)])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A QP whose send ring lies on the doorbell page may read hostd's
    /// NEED_KICK as its producer index (when hostd resets it while its
    /// datapath sleeps, or looks at it from the control path), so the model
    /// lets its state be ERR from then on; hostd's answers to such a QP
    /// taken through RESET and RTS stay within what the model allows.
    #[test]
    fn a_ring_on_the_doorbell_page_is_allowed_to_fail() {
        let harness = HARNESS.get_or_init(|| Mutex::new(Harness::new()));
        let mut h = harness.lock().unwrap_or_else(|e| e.into_inner());
        let mut s = h.connect();
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            tenant: ALPHA.into(),
            device: "fuzz0".into(),
        };
        s.step(&hello, &[]);
        let add = Request::AddMemory {
            slot: 0,
            gpa: 0,
            len: MEMFD_SIZES[1],
            file_offset: 0,
        };
        s.step(&add, &[Fd::Sealed(1)]);
        s.step(&Request::SetDoorbell { gpa: 0 }, &[Fd::Eventfd]);
        let cq = Request::CreateCq {
            cqn: 1,
            gpa: PAGE,
            depth: 64,
            vector: 0,
        };
        s.step(&cq, &[]);
        let ring = |gpa| WorkRing {
            gpa,
            depth: 4,
            stride: 64,
        };
        let qp = QpSetup {
            vqpn: 1,
            pd: 1,
            db_index: 0,
            send_cqn: 1,
            recv_cqn: 1,
            sq_sig_all: true,
            sq: ring(0),
            rq: ring(2 * PAGE),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            srqn: None,
            qp_type: 2,
        };
        s.step(&Request::CreateQp(qp), &[]);
        assert!(s.model.wild, "the ring lies on the doorbell page");
        let rts = Request::ModifyQp(QpModify {
            vqpn: 1,
            state: QpState::Rts.into(),
            connection: None,
            access: None,
            qkey: None,
        });
        let reset = Request::ModifyQp(QpModify {
            vqpn: 1,
            state: QpState::Reset.into(),
            connection: None,
            access: None,
            qkey: None,
        });
        for _ in 0..20 {
            s.step(&rts, &[]);
            std::thread::sleep(std::time::Duration::from_millis(1));
            s.step(&Request::QueryQp { vqpn: 1 }, &[]);
            s.step(&reset, &[]);
        }
        assert_eq!(s.model.qps[&1].state, QpState::Reset);
        s.finish();
        h.check_steady();
    }
}
