//! hostd's handling of a compromised vdev's requests: the real
//! [`Server`] (policy, registry, accounts, datapath, software NIC) serves
//! one connection per input over an `AF_UNIX` seqpacket socketpair, and the
//! input plays the vdev: a Hello (mostly as tenant `alpha`, sometimes
//! hostile), then every kind of request with hostile numbers, sealed,
//! unsealed and wrong descriptors, MR pieces in and out of the memory it
//! added, raw garbage and empty messages.
//!
//! A model of what the connection holds (its memory slots, MRs, QPs)
//! predicts each answer where the protocol decides it, and the check
//! asserts:
//! - every request gets exactly one answer (Welcome to a Hello, Ok or
//!   Refused with errno > 0, descriptors only with a Welcome), and the
//!   connection closes only after a protocol violation (undecodable or
//!   empty message);
//! - a refused request changes nothing: alpha's usage as the admin socket
//!   reports it ([`Server::stats`]: devices, physical queues, MRs, MR
//!   bytes, QPs) always equals the model's, which only accepted requests
//!   change;
//! - an accepted MR registration names only memory this connection added
//!   and has not removed; alpha's registered bytes and MRs never exceed its
//!   policy's quotas;
//! - once the connection is gone, alpha holds nothing;
//! - `beta`, a well-behaved tenant connected once per process, keeps its
//!   usage, its MRs (its keys deregister and register again as its own)
//!   and its QP; `delta`'s device (a network alpha may not reach) stays
//!   untouched.
//!
//! The server lives for the whole process and serves inputs one at a time
//! (a mutex): hostd is built to outlive its vdevs, so reusing it is what
//! it promises, and every input starts from "alpha holds nothing".

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};

use vrdma_hostd::config::{Args, Config};
use vrdma_hostd::datapath::Datapath;
use vrdma_hostd::server::Server;
use vrdma_hostd::stats::Usage;
use vrdma_hostd_protocol::channel::{Channel, ChannelError, MAX_FDS};
use vrdma_hostd_protocol::messages::{
    self, MrRegistration, MrSegment, QpConnection, Request, Response, MAX_MESSAGE, PROTOCOL_VERSION,
};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::verbs::access;
use vrdma_tenant_policy::Limits;

use crate::input::Input;

/// Requests of one input after its first Hello: enough to build MRs over
/// several slots and QPs through their states, short enough that the NIC's
/// table limits (1024 slots, 65536 MRs and QPs per device) are never the
/// reason for a refusal.
const MAX_OPS: usize = 48;
/// The fuzzed tenant and its quotas (set in [`POLICY`]).
const ALPHA: &str = "alpha";
const ALPHA_QUEUES: usize = 2;
const ALPHA_MAX_MR: usize = 6;
const ALPHA_MAX_MR_BYTES: u64 = 256 * 1024;
const ALPHA_MAX_TOTAL_MR_BYTES: u64 = 512 * 1024;
/// The well-behaved tenant, its device and its objects.
const BETA: &str = "beta";
const BETA_DEVICE: &str = "steady";
const BETA_SLOT_BYTES: u64 = 64 * 1024;
const BETA_MRS: [(u32, u32, u64, u64); 2] = [
    // (lkey, rkey, offset, len)
    (0xb0b0_0001, 0xb0b0_0002, 0, BETA_SLOT_BYTES),
    (0xb0b0_0003, 0xb0b0_0004, 4096, 4096),
];
const BETA_QP: u32 = 1;
/// A connected tenant in a network alpha may not reach.
const DELTA: &str = "delta";
const DELTA_DEVICE: &str = "quiet";
/// A tenant whose uid this process does not have.
const GAMMA: &str = "gamma";
/// Sizes of the sealed memfds the vdev offers as memory.
const MEMFD_SIZES: [u64; 4] = [4096, 64 * 1024, 1 << 20, 16 << 20];

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
    /// A sealed memfd of `MEMFD_SIZES[i]` bytes.
    Sealed(usize),
    /// A memfd without seals (hostd must not map it).
    Unsealed,
    /// Not a memfd at all.
    Eventfd,
}

/// What the server and the steady tenants are, set up once per process.
struct Harness {
    server: Arc<Server>,
    /// The server's datapath, whose accounts the admin socket reports.
    datapath: Arc<Datapath>,
    /// Hands a connection to the thread that runs `Server::connection`.
    run: Sender<Arc<Channel>>,
    /// One message per connection served to its end.
    done: Receiver<()>,
    beta: Channel,
    beta_lid: u16,
    beta_pqp: u32,
    beta_usage: Usage,
    /// Open for the process: delta's device stays connected.
    _delta: Channel,
    delta_lid: u16,
    delta_pqp: u32,
    delta_usage: Usage,
    sealed: Vec<File>,
    unsealed: File,
    eventfd: File,
    page: u64,
}

static HARNESS: OnceLock<Mutex<Harness>> = OnceLock::new();

/// Plays `data` as one vdev connection against the shared server.
pub fn check(data: &[u8]) {
    let harness = HARNESS.get_or_init(|| Mutex::new(Harness::new()));
    // A failed input (property tests go on after one) leaves its
    // connection closed and torn down: the state is still sound.
    let h = harness.lock().unwrap_or_else(|e| e.into_inner());
    h.play(data);
}

/// What a request's answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Accept,
    /// Refused, with this errno if the protocol decides it.
    Refuse(Option<i32>),
    /// Either (inputs the model does not decide).
    Either,
}

fn decide(accept: bool) -> Expect {
    if accept {
        Expect::Accept
    } else {
        Expect::Refuse(None)
    }
}

/// What the fuzzed connection holds, as hostd's answers established it.
#[derive(Debug, Default)]
struct Model {
    /// After a Welcome: the device's LID and physical QPs.
    greeted: Option<(u16, Vec<u32>)>,
    /// Memory slots added and not removed: slot → bytes.
    slots: BTreeMap<u32, u64>,
    /// MRs: lkey → (rkey, bytes).
    mrs: BTreeMap<u32, (u32, u64)>,
    /// QPs: vqpn → in the error state.
    qps: BTreeMap<u32, bool>,
}

impl Model {
    fn mr_bytes(&self) -> u64 {
        self.mrs.values().map(|&(_, len)| len).sum()
    }

    fn key_in_use(&self, key: u32) -> bool {
        self.mrs.contains_key(&key) || self.mrs.values().any(|&(rkey, _)| rkey == key)
    }

    /// Whether `seg` lies inside memory this connection added.
    fn inside(&self, seg: &MrSegment) -> bool {
        self.slots.get(&seg.slot).is_some_and(|&bytes| {
            seg.len > 0 && seg.offset.checked_add(seg.len).is_some_and(|e| e <= bytes)
        })
    }

    /// alpha's usage as hostd must report it.
    fn usage(&self) -> Usage {
        let greeted = u64::from(self.greeted.is_some());
        Usage {
            devices: greeted,
            physical_queues: greeted * ALPHA_QUEUES as u64,
            mr_bytes: self.mr_bytes(),
            mrs: self.mrs.len() as u64,
            qps: self.qps.len() as u64,
        }
    }
}

fn device_name_ok(device: &str) -> bool {
    (1..=64).contains(&device.len())
        && device
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

impl Harness {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("vrdma-fuzz-hostd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        let policy_file = dir.join("policy.toml");
        // SAFETY: getuid has no preconditions.
        let other_uid = unsafe { libc::getuid() }.wrapping_add(1);
        std::fs::write(
            &policy_file,
            POLICY.replace("OTHER_UID", &other_uid.to_string()),
        )
        .expect("write the policy file");
        // As hostd's command line gives it; the sockets are never bound
        // (connections arrive over socketpairs).
        let config = Config::try_from(Args {
            socket: Some(dir.join("hostd.sock")),
            admin_socket: None,
            config: None,
            policy: Some(policy_file),
            physical_qps: Some(8),
            sq_depth: Some(64),
            cq_depth: Some(64),
            datapath_threads: Some(1),
            spin_us: Some(0),
            device_credits: None,
            total_credits: None,
            line_rate_mbps: None,
            sandbox: Default::default(),
        })
        .expect("a valid hostd configuration");
        let _ = std::fs::remove_dir_all(&dir);
        let datapath = vrdma_hostd::datapath(&config).expect("datapath");
        datapath
            .start(&vrdma_hostd::seccomp::Threads::unfiltered())
            .expect("datapath threads");
        let server = Server::new(config, Arc::clone(&datapath));

        let (run, runs) = mpsc::channel::<Arc<Channel>>();
        let (finished, done) = mpsc::channel();
        let runner = Arc::clone(&server);
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

        let (beta, beta_lid, beta_pqp) = steady(&server, BETA, BETA_DEVICE);
        let slot = sealed_memfd("fuzz-beta", BETA_SLOT_BYTES).expect("beta's memory");
        let add = Request::AddMemory {
            slot: 0,
            gpa: 0,
            len: BETA_SLOT_BYTES,
            file_offset: 0,
        };
        expect_ok(&beta, &add, &[slot.as_raw_fd()]);
        for (lkey, rkey, offset, len) in BETA_MRS {
            expect_ok(&beta, &beta_mr(lkey, rkey, offset, len), &[]);
        }
        let create = Request::CreateQp {
            vqpn: BETA_QP,
            pd: 1,
            pqp: beta_pqp,
        };
        expect_ok(&beta, &create, &[]);
        expect_ok(&beta, &beta_connect(beta_lid), &[]);
        let (delta, delta_lid, delta_pqp) = steady(&server, DELTA, DELTA_DEVICE);

        let beta_usage = usage(&datapath, BETA);
        let delta_usage = usage(&datapath, DELTA);
        assert_eq!(
            (beta_usage.mrs, beta_usage.qps, delta_usage.devices),
            (2, 1, 1),
            "steady tenants set up"
        );
        let unsealed = {
            let name = c"fuzz-unsealed";
            // SAFETY: a valid NUL-terminated name; the result is checked.
            let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
            assert!(fd >= 0, "memfd_create");
            // SAFETY: a fresh descriptor nobody else owns.
            let file = unsafe { File::from_raw_fd(fd) };
            file.set_len(64 * 1024).expect("size the unsealed memfd");
            file
        };
        let eventfd = {
            // SAFETY: eventfd has no memory preconditions; the result is checked.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            assert!(fd >= 0, "eventfd");
            // SAFETY: a fresh descriptor nobody else owns.
            unsafe { File::from_raw_fd(fd) }
        };
        // SAFETY: sysconf only reads a system constant.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        Harness {
            server,
            datapath,
            run,
            done,
            beta,
            beta_lid,
            beta_pqp,
            beta_usage,
            _delta: delta,
            delta_lid,
            delta_pqp,
            delta_usage,
            sealed: MEMFD_SIZES
                .iter()
                .map(|&size| sealed_memfd("fuzz-mem", size).expect("sealed memfd"))
                .collect(),
            unsealed,
            eventfd,
            page: u64::try_from(page).unwrap_or(4096),
        }
    }

    fn raw_fd(&self, fd: Fd) -> RawFd {
        match fd {
            Fd::Sealed(i) => self.sealed[i].as_raw_fd(),
            Fd::Unsealed => self.unsealed.as_raw_fd(),
            Fd::Eventfd => self.eventfd.as_raw_fd(),
        }
    }

    fn usage(&self, tenant: &str) -> Usage {
        usage(&self.datapath, tenant)
    }

    fn beta_keys(&self) -> [u32; 4] {
        [BETA_MRS[0].0, BETA_MRS[0].1, BETA_MRS[1].0, BETA_MRS[1].1]
    }

    fn play(&self, data: &[u8]) {
        assert_eq!(
            self.usage(ALPHA),
            Model::default().usage(),
            "alpha holds something before its connection"
        );
        let (ours, theirs) = Channel::pair().expect("socketpair");
        self.run.send(Arc::new(theirs)).expect("connection thread");
        let mut session = Session {
            h: self,
            chan: ours,
            model: Model::default(),
            closed: false,
            ended: false,
        };
        let mut input = Input::new(data);
        let first = session.gen_hello(&mut input);
        session.step(first.0, &first.1);
        let mut ops = 0;
        while !session.closed && !input.is_empty() && ops < MAX_OPS {
            ops += 1;
            session.op(&mut input);
        }
        session.finish();
        self.check_steady();
    }

    /// beta and delta kept everything; beta's MRs and QP are still its own;
    /// the admin socket's report agrees with the accounts.
    fn check_steady(&self) {
        let stats = self.server.stats();
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
        let (lkey, rkey, offset, len) = BETA_MRS[1];
        expect_ok(&self.beta, &Request::DeregisterMr { lkey }, &[]);
        expect_ok(&self.beta, &beta_mr(lkey, rkey, offset, len), &[]);
        let again = beta_mr(BETA_MRS[0].0, BETA_MRS[0].1, 0, 4096);
        match call(&self.beta, &again, &[]) {
            Response::Refused { errno, .. } if errno == libc::EEXIST => {}
            other => panic!("beta's first MR is no longer registered: {other:?}"),
        }
        let access = access::REMOTE_READ;
        expect_ok(
            &self.beta,
            &Request::SetQpAccess {
                vqpn: BETA_QP,
                access,
            },
            &[],
        );
        expect_ok(&self.beta, &beta_connect(self.beta_lid), &[]);
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
}

impl Drop for Session<'_> {
    /// Also when a check failed (property tests go on with the next case):
    /// the next input's connection must not be taken for this one.
    fn drop(&mut self) {
        self.end();
    }
}

impl Session<'_> {
    fn gen_hello(&self, input: &mut Input) -> (Request, Vec<Fd>) {
        let kind = input.u8();
        let name = input.u8();
        let good = ["fuzz0", "fuzz1", "fuzz2", "fuzz3"][usize::from(name % 4)];
        let hello = |version: u32, tenant: &str, device: &str| Request::Hello {
            version,
            tenant: tenant.to_owned(),
            device: device.to_owned(),
        };
        let request = match kind % 12 {
            6 => hello(u32::from(name), ALPHA, good),
            7 => {
                let bad = ["", "a b", "../x", "caf\u{e9}", &"a".repeat(65)];
                hello(PROTOCOL_VERSION, ALPHA, bad[usize::from(name) % bad.len()])
            }
            8 => hello(
                PROTOCOL_VERSION,
                ["nobody", "", "ALPHA"][usize::from(name % 3)],
                good,
            ),
            9 => hello(PROTOCOL_VERSION, GAMMA, good),
            10 => {
                let (tenant, device) = if name & 1 == 0 {
                    (BETA, BETA_DEVICE)
                } else {
                    (DELTA, DELTA_DEVICE)
                };
                hello(PROTOCOL_VERSION, tenant, device)
            }
            11 => {
                return (
                    hello(PROTOCOL_VERSION, ALPHA, good),
                    vec![Fd::Sealed(usize::from(name % 4))],
                )
            }
            _ => hello(PROTOCOL_VERSION, ALPHA, good),
        };
        (request, Vec::new())
    }

    fn slot(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        if b & 0x80 != 0 {
            input.u32()
        } else {
            u32::from(b % 4)
        }
    }

    fn key(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        let m = &self.model;
        match b % 16 {
            0..=3 => self.h.beta_keys()[usize::from(b % 4)],
            4 => 0,
            13 if !m.mrs.is_empty() => {
                *m.mrs.keys().nth(usize::from(b) % m.mrs.len()).unwrap_or(&0)
            }
            14 if !m.mrs.is_empty() => m
                .mrs
                .values()
                .nth(usize::from(b) % m.mrs.len())
                .map_or(0, |v| v.0),
            15 => input.u32(),
            _ => u32::from(b % 16) - 4,
        }
    }

    fn vqpn(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        match b % 8 {
            7 => input.u32(),
            6 => 0x00ff_ffff,
            _ => u32::from(b % 4) + 1,
        }
    }

    fn pqp(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        let granted = self.model.greeted.as_ref().map(|(_, p)| p.as_slice());
        match (b % 5, granted) {
            (0 | 1, Some(p)) if !p.is_empty() => p[usize::from(b) % p.len()],
            (2, _) => self.h.beta_pqp,
            (3, _) => self.h.delta_pqp,
            _ => input.u32(),
        }
    }

    fn lid(&self, input: &mut Input) -> u16 {
        let b = input.u8();
        match b % 6 {
            0 => self.model.greeted.as_ref().map_or(0, |g| g.0),
            1 => self.h.beta_lid,
            2 => self.h.delta_lid,
            3 => 0,
            4 => 0xffff,
            _ => input.u16(),
        }
    }

    fn mr_access(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        match b % 8 {
            0 => access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE,
            1 => access::LOCAL_WRITE,
            2 => access::REMOTE_READ,
            3 => access::REMOTE_WRITE,
            4 => access::LOCAL_WRITE | access::REMOTE_ATOMIC,
            5 => access::ZERO_BASED | access::LOCAL_WRITE,
            6 => input.u32(),
            _ => 0,
        }
    }

    fn qp_access(&self, input: &mut Input) -> u32 {
        let b = input.u8();
        match b % 5 {
            0 => 0,
            1 => access::REMOTE_READ | access::REMOTE_WRITE,
            2 => access::QP_SUPPORTED,
            3 => access::LOCAL_WRITE,
            _ => input.u32(),
        }
    }

    fn segment(&self, input: &mut Input) -> MrSegment {
        let b = input.u8();
        let slots: Vec<(u32, u64)> = self.model.slots.iter().map(|(&s, &l)| (s, l)).collect();
        let (slot, bytes) = match slots.get(usize::from(b >> 2) % slots.len().max(1)) {
            Some(&(s, l)) if b & 3 != 3 => (s, l),
            _ => (self.slot(input), 4096),
        };
        let offset = match input.u8() % 5 {
            0 => 0,
            1 => u64::from(input.u8()) * 4096,
            2 => bytes.saturating_sub(u64::from(input.u8())),
            3 => input.u64(),
            _ => u64::from(input.u16()),
        };
        let rest = bytes.saturating_sub(offset);
        let len = match input.u8() % 6 {
            0 => rest,
            1 => rest + 1,
            2 => 0,
            3 => input.u64(),
            _ => u64::from(input.u16()).min(rest.max(1)),
        };
        MrSegment { slot, offset, len }
    }

    /// One request from the input, sent and checked.
    fn op(&mut self, input: &mut Input) {
        let code = input.u8();
        let (request, fds) = match code % 16 {
            0 => {
                let slot = self.slot(input);
                let b = input.u8();
                let fds = match b % 8 {
                    0..=3 => vec![Fd::Sealed(usize::from(b % 4))],
                    4 => vec![Fd::Unsealed],
                    5 => vec![Fd::Eventfd],
                    6 => Vec::new(),
                    _ => vec![Fd::Sealed(0), Fd::Sealed(1)],
                };
                let size = match fds.first() {
                    Some(Fd::Sealed(i)) => MEMFD_SIZES[*i],
                    _ => 64 * 1024,
                };
                let file_offset = match input.u8() % 4 {
                    0 | 1 => 0,
                    2 => 64 * 1024,
                    _ => u64::from(input.u16()),
                };
                let len = match input.u8() % 5 {
                    0 | 1 => size.saturating_sub(file_offset),
                    2 => 4096,
                    3 => size + 4096,
                    _ => input.u64(),
                };
                let gpa = input.u64();
                let request = Request::AddMemory {
                    slot,
                    gpa,
                    len,
                    file_offset,
                };
                (request, fds)
            }
            1 => (
                Request::RemoveMemory {
                    slot: self.slot(input),
                },
                Vec::new(),
            ),
            2 | 3 => {
                let lkey = self.key(input);
                let rkey = self.key(input);
                let pd = u32::from(input.u8() % 4);
                let access = self.mr_access(input);
                let iova = if input.bool() {
                    input.u64()
                } else {
                    u64::from(input.u16()) << 12
                };
                let n = usize::from(input.u8() % 5);
                let segments: Vec<MrSegment> = (0..n).map(|_| self.segment(input)).collect();
                let sum = segments
                    .iter()
                    .try_fold(0u64, |acc, s| acc.checked_add(s.len));
                let len = match (input.u8() % 6, sum) {
                    (0, Some(s)) => s.wrapping_add(1),
                    (1, Some(s)) => s.wrapping_sub(1),
                    (2, _) | (_, None) => input.u64(),
                    (_, Some(s)) => s,
                };
                let mr = MrRegistration {
                    lkey,
                    rkey,
                    pd,
                    access,
                    iova,
                    len,
                    segments,
                };
                (Request::RegisterMr(mr), Vec::new())
            }
            4 => (
                Request::DeregisterMr {
                    lkey: self.key(input),
                },
                Vec::new(),
            ),
            5 | 6 => {
                let vqpn = self.vqpn(input);
                let pd = u32::from(input.u8() % 4);
                let pqp = self.pqp(input);
                (Request::CreateQp { vqpn, pd, pqp }, Vec::new())
            }
            7 => {
                let vqpn = self.vqpn(input);
                let dest_lid = self.lid(input);
                let dest_qpn = match input.u8() % 4 {
                    0 => 0x0100_0000,
                    1 => input.u32(),
                    _ => u32::from(input.u8() % 4) + 1,
                };
                let conn = QpConnection {
                    vqpn,
                    dest_lid,
                    dest_qpn,
                    access: self.qp_access(input),
                    rnr_retry: input.u8() % 9,
                    retry_cnt: input.u8() % 9,
                    min_rnr_timer: input.u8() % 33,
                };
                (Request::ConnectQp(conn), Vec::new())
            }
            8 => {
                let vqpn = self.vqpn(input);
                let access = self.qp_access(input);
                (Request::SetQpAccess { vqpn, access }, Vec::new())
            }
            9 => (
                Request::ErrorQp {
                    vqpn: self.vqpn(input),
                },
                Vec::new(),
            ),
            10 => (
                Request::ResetQp {
                    vqpn: self.vqpn(input),
                },
                Vec::new(),
            ),
            11 => (
                Request::DestroyQp {
                    vqpn: self.vqpn(input),
                },
                Vec::new(),
            ),
            12 => {
                let b = input.u8();
                let quota = match b % 6 {
                    0 => "max_qp".to_owned(),
                    1 => "max_total_mr_bytes".to_owned(),
                    2 => "bogus".to_owned(),
                    3 => String::new(),
                    4 => "mrs".to_owned(),
                    _ => String::from_utf8_lossy(input.bytes(usize::from(b % 24))).into_owned(),
                };
                (Request::QuotaRejected { quota }, Vec::new())
            }
            13 => self.gen_hello(input),
            14 => {
                let n = input.u8();
                let bytes = if n == 0xff {
                    vec![b' '; MAX_MESSAGE + 1]
                } else {
                    input.bytes(usize::from(n % 96)).to_vec()
                };
                self.raw(&bytes);
                return;
            }
            _ => {
                // A request that carries no descriptor, with one.
                let b = input.u8();
                let request = match b % 3 {
                    0 => Request::RemoveMemory { slot: 0 },
                    1 => Request::DestroyQp { vqpn: 1 },
                    _ => Request::QuotaRejected {
                        quota: "max_qp".into(),
                    },
                };
                let fd = [Fd::Sealed(0), Fd::Unsealed, Fd::Eventfd][usize::from(b % 3)];
                (request, vec![fd])
            }
        };
        self.step(request, &fds);
    }

    /// `bytes` sent as they are: what decodes is a request like any other;
    /// the rest (and anything over [`MAX_MESSAGE`]) is a protocol
    /// violation, answered with `EPROTO` before hostd hangs up; an empty
    /// message is the peer hanging up.
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

    fn step(&mut self, request: Request, fds: &[Fd]) {
        let bytes = messages::encode(&request).expect("a request encodes");
        self.exchange(&request, &bytes, fds);
    }

    /// Sends one request, reads its one answer, checks it against the
    /// model's prediction and hostd's reported usage.
    fn exchange(&mut self, request: &Request, bytes: &[u8], fds: &[Fd]) {
        assert!(fds.len() <= MAX_FDS);
        let expect = self.predict(request, fds);
        let raw: Vec<RawFd> = fds.iter().map(|&fd| self.h.raw_fd(fd)).collect();
        self.chan.send_bytes(bytes, &raw).expect("send a request");
        let (response, files) = match self.chan.recv::<Response>() {
            Ok(answer) => answer,
            Err(e) => panic!("no answer to {request:?}: {e:?}"),
        };
        assert_no_pending(&self.chan, request);
        let accepted = match &response {
            Response::Welcome(w) => {
                assert!(
                    matches!(request, Request::Hello { .. }),
                    "Welcome to {request:?}"
                );
                assert_eq!(w.queues.len(), ALPHA_QUEUES, "alpha's physical queues");
                assert_eq!(files.len(), w.queues.len() + 3, "Welcome's descriptors");
                let pqps: Vec<u32> = w.queues.iter().map(|q| q.pqp).collect();
                assert!(
                    !pqps.contains(&self.h.beta_pqp) && !pqps.contains(&self.h.delta_pqp),
                    "alpha was granted another tenant's physical queue"
                );
                assert!(
                    ![0, self.h.beta_lid, self.h.delta_lid].contains(&w.lid),
                    "alpha got LID {:#x}",
                    w.lid
                );
                self.model.greeted = Some((w.lid, pqps));
                true
            }
            Response::Ok => {
                assert!(files.is_empty(), "descriptors with Ok");
                assert!(!matches!(request, Request::Hello { .. }), "Ok to a Hello");
                true
            }
            Response::Refused { errno, reason } => {
                assert!(files.is_empty(), "descriptors with a refusal");
                assert!(*errno > 0, "errno {errno} ({reason}) for {request:?}");
                if let Expect::Refuse(Some(want)) = expect {
                    assert_eq!(*errno, want, "errno for {request:?} ({reason})");
                }
                false
            }
        };
        if accepted {
            if let Request::RegisterMr(mr) = request {
                assert!(
                    mr.segments.iter().all(|s| self.model.inside(s)),
                    "hostd registered an MR over memory this connection did not add: {mr:?}"
                );
            }
        }
        match (expect, accepted) {
            (Expect::Accept, false) => panic!("{request:?} refused: {response:?}"),
            (Expect::Refuse(_), true) => panic!("{request:?} accepted: {response:?}"),
            _ => {}
        }
        if accepted {
            self.apply(request);
        }
        self.check_usage(&format!("{request:?}"));
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

    fn predict(&self, request: &Request, fds: &[Fd]) -> Expect {
        let m = &self.model;
        if !matches!(request, Request::AddMemory { .. }) && !fds.is_empty() {
            return Expect::Refuse(Some(libc::EINVAL));
        }
        if let Request::Hello {
            version,
            tenant,
            device,
        } = request
        {
            if m.greeted.is_some() || *version != PROTOCOL_VERSION {
                return Expect::Refuse(Some(libc::EPROTO));
            }
            if !device_name_ok(device) {
                return Expect::Refuse(Some(libc::EINVAL));
            }
            return match tenant.as_str() {
                ALPHA => Expect::Accept,
                GAMMA => Expect::Refuse(Some(libc::EPERM)),
                BETA if device == BETA_DEVICE => Expect::Refuse(Some(libc::EBUSY)),
                DELTA if device == DELTA_DEVICE => Expect::Refuse(Some(libc::EBUSY)),
                BETA | DELTA => Expect::Either,
                _ => Expect::Refuse(Some(libc::EACCES)),
            };
        }
        let Some((lid, pqps)) = &m.greeted else {
            return Expect::Refuse(Some(libc::EPROTO));
        };
        let qp = |vqpn: &u32| m.qps.get(vqpn).copied();
        match request {
            Request::Hello { .. } => Expect::Either,
            Request::AddMemory {
                slot,
                len,
                file_offset,
                ..
            } => {
                let [Fd::Sealed(i)] = fds else {
                    return Expect::Refuse(Some(libc::EINVAL));
                };
                let maps = *len > 0
                    && file_offset % self.h.page == 0
                    && file_offset
                        .checked_add(*len)
                        .is_some_and(|end| end <= MEMFD_SIZES[*i]);
                decide(maps && !m.slots.contains_key(slot))
            }
            Request::RemoveMemory { slot } => decide(m.slots.contains_key(slot)),
            Request::RegisterMr(mr) => {
                let keys = mr.lkey != 0
                    && mr.rkey != 0
                    && mr.lkey != mr.rkey
                    && [mr.lkey, mr.rkey]
                        .iter()
                        .all(|k| !self.h.beta_keys().contains(k) && !m.key_in_use(*k));
                let remote = access::REMOTE_WRITE | access::REMOTE_ATOMIC;
                let flags = mr.access & !access::MR_KNOWN == 0
                    && (mr.access & remote == 0 || mr.access & access::LOCAL_WRITE != 0);
                let pieces = mr.segments.iter().all(|s| m.inside(s))
                    && mr
                        .segments
                        .iter()
                        .try_fold(0u64, |acc, s| acc.checked_add(s.len))
                        == Some(mr.len);
                let quota = mr.len <= ALPHA_MAX_MR_BYTES
                    && m.mrs.len() < ALPHA_MAX_MR
                    && m.mr_bytes().saturating_add(mr.len) <= ALPHA_MAX_TOTAL_MR_BYTES;
                let iova = mr.iova.checked_add(mr.len).is_some();
                decide(keys && flags && pieces && quota && iova)
            }
            Request::DeregisterMr { lkey } => decide(m.mrs.contains_key(lkey)),
            Request::CreateQp { vqpn, pqp, .. } => decide(pqps.contains(pqp) && qp(vqpn).is_none()),
            Request::ConnectQp(conn) => {
                if conn.dest_lid == self.h.delta_lid {
                    return Expect::Refuse(Some(libc::EACCES));
                }
                if conn.dest_lid != *lid && conn.dest_lid != self.h.beta_lid {
                    return Expect::Refuse(Some(libc::ENOENT));
                }
                decide(
                    conn.dest_qpn <= 0xff_ffff
                        && conn.access & !access::QP_SUPPORTED == 0
                        && conn.rnr_retry <= 7
                        && conn.retry_cnt <= 7
                        && conn.min_rnr_timer <= 31
                        && qp(&conn.vqpn) == Some(false),
                )
            }
            Request::SetQpAccess { vqpn, access: a } => {
                decide(a & !access::QP_SUPPORTED == 0 && qp(vqpn).is_some())
            }
            Request::ErrorQp { vqpn } | Request::ResetQp { vqpn } | Request::DestroyQp { vqpn } => {
                decide(qp(vqpn).is_some())
            }
            Request::QuotaRejected { quota } => {
                let limits = serde_json::to_value(Limits::default()).ok();
                let known = limits
                    .as_ref()
                    .and_then(|v| v.as_object())
                    .is_some_and(|keys| keys.contains_key(quota));
                decide(known)
            }
        }
    }

    fn apply(&mut self, request: &Request) {
        let m = &mut self.model;
        match request {
            Request::Hello { .. } | Request::ConnectQp(_) | Request::SetQpAccess { .. } => {}
            Request::QuotaRejected { .. } => {}
            Request::AddMemory { slot, len, .. } => {
                m.slots.insert(*slot, *len);
            }
            Request::RemoveMemory { slot } => {
                // Its MRs stay registered (revoked) until deregistered.
                m.slots.remove(slot);
            }
            Request::RegisterMr(mr) => {
                m.mrs.insert(mr.lkey, (mr.rkey, mr.len));
            }
            Request::DeregisterMr { lkey } => {
                m.mrs.remove(lkey);
            }
            Request::CreateQp { vqpn, .. } => {
                m.qps.insert(*vqpn, false);
            }
            Request::ErrorQp { vqpn } => {
                m.qps.insert(*vqpn, true);
            }
            Request::ResetQp { vqpn } => {
                m.qps.insert(*vqpn, false);
            }
            Request::DestroyQp { vqpn } => {
                m.qps.remove(vqpn);
            }
        }
    }

    /// The vdev hangs up: hostd must send nothing more, tear the device
    /// down and leave alpha holding nothing.
    fn finish(mut self) {
        self.end();
        assert_no_pending(&self.chan, &"the end of the connection");
        assert_eq!(
            self.h.usage(ALPHA),
            Model::default().usage(),
            "alpha still holds something after its connection closed"
        );
    }
}

impl Session<'_> {
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

/// A steady device of `tenant`: its channel, LID and physical QP.
fn steady(server: &Arc<Server>, tenant: &str, device: &str) -> (Channel, u16, u32) {
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
        Response::Welcome(w) => (ours, w.lid, w.queues[0].pqp),
        other => panic!("{tenant} refused: {other:?}"),
    }
}

fn beta_mr(lkey: u32, rkey: u32, offset: u64, len: u64) -> Request {
    Request::RegisterMr(MrRegistration {
        lkey,
        rkey,
        pd: 1,
        access: access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE,
        iova: 0x10_0000 + offset,
        len,
        segments: vec![MrSegment {
            slot: 0,
            offset,
            len,
        }],
    })
}

fn beta_connect(lid: u16) -> Request {
    Request::ConnectQp(QpConnection {
        vqpn: BETA_QP,
        dest_lid: lid,
        dest_qpn: BETA_QP,
        access: access::REMOTE_READ | access::REMOTE_WRITE,
        rnr_retry: 7,
        retry_cnt: 7,
        min_rnr_timer: 12,
    })
}

fn call(chan: &Channel, request: &Request, fds: &[RawFd]) -> Response {
    let (response, _files): (Response, Vec<File>) = chan.call(request, fds).expect("hostd answers");
    response
}

fn expect_ok(chan: &Channel, request: &Request, fds: &[RawFd]) {
    let response = call(chan, request, fds);
    assert_eq!(response, Response::Ok, "{request:?}");
}

/// What `tenant` holds by hostd's accounts.
fn usage(datapath: &Datapath, tenant: &str) -> Usage {
    datapath.lock().accounts().usage(tenant)
}

/// `usage` as the admin socket reports it ([`Server::stats`]).
fn entries(usage: Usage) -> BTreeMap<String, u64> {
    usage
        .entries()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
}
