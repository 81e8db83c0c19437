//! Hostile packets from the network against hostd's engine on a wire
//! (`engine::wire`: `dispatch`, then the RC responder and requester, the
//! UC responder and UD delivery behind it).
//!
//! One engine, as a host: the victim device (tenant "t", GID `gid(10)`)
//! has an RC QP and a UC QP connected to QPs of the remote GID `gid(20)`
//! (another host, which the directory knows, in network "t"), and a UD QP
//! with a Q_Key and an address handle towards that GID, all in RTS with
//! receives posted; a bystander device of another tenant ("by", GID
//! `gid(40)`) has an RC QP connected to a GID the directory does not know
//! and a UD QP with the same Q_Key and receives posted, both in RTS. The
//! wire's packet queues are the check's: what the input sends arrives,
//! whole IPv4 datagrams, and what the engine sends is checked.
//!
//! The input is a sequence of steps, mostly batches of packets: raw bytes
//! as they are, raw bytes made a valid IPv4/UDP/RoCEv2 datagram (addresses,
//! P_Key and destination QP chosen, checksum and ICRC sealed), or packets
//! built from fields (`vrdma_roce::build`): any opcode, DETH, RETH, AETH,
//! AtomicETH, AtomicAckETH, immediate and IETH fields, a PSN near what
//! the victim's QPs expect or sent last (or anywhere), the destination QP
//! among the real ones (the victim's, the bystander's) and random ones,
//! keys (the victim's, the bystander's, random) and addresses at and
//! across the victim's region's edges, payloads up to past a receive
//! buffer's size, from the known remote GID, a GID of another network,
//! this host's own GIDs, an unknown one or anywhere. Between batches the
//! victim's driver posts sends (so that responses have requests to
//! answer), time passes (retransmissions, RNR waits), its QPs are reset
//! and reconnected, and the packet queues misbehave (full, failing). After
//! each step the engine runs rounds until it is idle.
//!
//! The host is made once per thread and brought back to the same state
//! at the start of every input (its network empty, the victim's QPs reset
//! and connected again with receives posted): see [`Host::begin`].
//!
//! Invariants: no panic; every CQE the victim gets has a valid status and
//! names one of its QPs; every packet the engine sends parses, comes from
//! the victim's GID and goes to the remote GID (no packet of anyone's
//! makes hostd answer a source it is not connected to); the bystander's
//! memory (its rings, CQ and a data region filled with a pattern) never
//! changes and its QPs stay in RTS; the victim's UD QP stays in RTS; and
//! afterwards a well-formed datagram from the remote GID still lands in a
//! posted receive, GRH and bytes as sent.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_hostd::engine::guest::SharedMapping;
use vrdma_hostd::engine::testing::{
    connection, gid, qp_setup, remote, send, sge, tenant, Driver, ALL, CAPS, CQ, CQN, CQ_DEPTH,
    DOORBELL, EQ, EQ_DEPTH, IOVA,
};
use vrdma_hostd::engine::wire::Wire;
use vrdma_hostd::engine::{Address, DeviceId, Engine};
use vrdma_hostd::net::directory::{Directory, DirectoryError, GidEntry, HostEntry};
use vrdma_hostd::net::io::{InPacket, IoCounters, OutPacket, PacketIo, MAX_IN_PACKET};
use vrdma_hostd::scheduler::Scheduler;
use vrdma_hostd::seccomp::Threads;
use vrdma_hostd_protocol::messages::{
    AhSetup, MrRegistration, MrSegment, QpConnection, QpModify, QpSetup, WorkRing,
};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_roce::{
    build, parse, write_ipv4_udp_header, Aeth, AtomicAckEth, AtomicEth, Bth, Deth, Headers,
    Ipv4Meta, NakCode, Opcode, Operation, Psn, Reth, Transport, DEFAULT_PKEY, IPV4_HEADER_LEN,
    IP_DF, MAX_HEADER_LEN, ROCE_V2_PORT, UDP_HEADER_LEN,
};
use vrdma_spec::ring::{wc_flags, Cqe, UdDest, GRH_SIZE};
use vrdma_spec::verbs::{QpState, SendOpcode, WcOpcode, WcStatus};
use vrdma_tenant_policy::{Policy, PriorityClass};

use crate::input::Input;

/// Steps one input drives at most.
const MAX_STEPS: usize = 32;
/// Rounds the engine runs after a step at most (it stops when idle; a
/// packet queue that takes nothing keeps it busy).
const ROUNDS: usize = 64;

/// The victim device, its tenant's network, and the bystander.
const VICTIM: DeviceId = 1;
const VICTIM_N: u16 = 10;
const BYSTANDER: DeviceId = 2;
const BYSTANDER_N: u16 = 40;
/// The other host's GID (known, network "t"), a GID of another network
/// (known), and one the directory does not know (the bystander's peer).
const REMOTE_N: u16 = 20;
const OTHER_N: u16 = 30;
const UNKNOWN_N: u16 = 50;

/// The victim's QPs (index in its driver: RC 0, UD 1, UC 2) and their
/// peers on the remote host.
const RC: u32 = 0x100;
const UD: u32 = 0x101;
const UC: u32 = 0x102;
const PEER_RC: u32 = 0x200;
const PEER_UD: u32 = 0x201;
const PEER_UC: u32 = 0x202;
/// The bystander's QPs (RC 0, UD 1).
const BY_RC: u32 = 0x400;
const BY_UD: u32 = 0x401;
const QKEY: u32 = 0x1111_1111;
/// The victim's address handle towards the remote GID.
const AH: u32 = 9;
/// The connections' path MTU (small: multi-packet messages are cheap).
const MTU: u32 = 256;
/// First PSNs of the victim's connections (they wrap soon).
const SQ_PSN: u32 = 0xff_fff0;
const RQ_PSN: u32 = 0xff_fff8;

/// Each device's guest memory: doorbell page, event ring and CQ where
/// `engine::testing` puts them, then this check's smaller rings and data
/// region (the bystander's memory, all of it compared after every input,
/// stays small).
const MEM: u64 = 0x20000;
const RINGS: u64 = 0x5000;
/// Each QP's send ring, then its receive ring half-way.
const QP_SPAN: u64 = 0x2000;
const DEPTH: u32 = 8;
const STRIDE: u32 = 256;
const DATA: u64 = 0xc000;
const DATA_LEN: u64 = MEM - DATA;
/// The bystander's memory: the same layout, a 4 KiB data region (the
/// whole of it is compared after every input).
const BY_MEM: u64 = DATA + 0x1000;
/// Receive buffers at the start of the data region: room for a GRH and a
/// 4096-byte datagram.
const RECV_LEN: u64 = 0x1080;
const RECV_SLOTS: u64 = 8;
/// Receives each QP keeps posted.
const RECVS: u32 = 4;
/// Input bytes of a structured packet's fields (reads past them give
/// zeros; the longest opcode reads about 100 when every choice takes its
/// widest branch).
pub const FIELDS: usize = 64;

fn ip(n: u16) -> Ipv4Addr {
    Ipv4Addr::from(vrdma_spec::gid::ipv4_of(&gid(n)).unwrap_or([0; 4]))
}

pub fn check(data: &[u8]) {
    exec(data, false);
}

/// What one input came to, for the tests of the check itself.
#[derive(Debug, Default)]
pub struct Report {
    /// Every CQE the victim got.
    pub cqes: Vec<Cqe>,
    /// Packets the engine sent (opcode, destination QP, PSN).
    pub sent: Vec<(Opcode, u32, Psn)>,
    /// Packets the wire dropped in this input, by reason (every peer).
    pub drops: BTreeMap<String, u64>,
}

/// [`check`], returning what happened.
pub fn run(data: &[u8]) -> Report {
    exec(data, true)
}

/// [`check`]; with `report`, what happened (the drops are counted only
/// then: the wire's counters are maps of strings).
fn exec(data: &[u8], report: bool) -> Report {
    let mut input = Input::new(data);
    // Out of its cell while it runs: a check that fails drops it, and the
    // next input gets a new one.
    let mut host = HOST
        .with(|h| h.borrow_mut().take())
        .unwrap_or_else(Host::new);
    host.begin(report);
    for _ in 0..MAX_STEPS {
        if input.is_empty() {
            break;
        }
        host.step(&mut input);
    }
    let report = host.finish(report);
    HOST.with(|h| *h.borrow_mut() = Some(host));
    report
}

/// A directory that knows the remote GID (network "t"), a GID of network
/// "other", and nothing else.
struct Known(HashMap<Ipv4Addr, GidEntry>);

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

fn directory() -> Arc<dyn Directory> {
    static DIRECTORY: OnceLock<Arc<Known>> = OnceLock::new();
    let known = DIRECTORY.get_or_init(|| {
        let entry = |n, host: &str, network: &str| {
            let gid = ip(n);
            let e = GidEntry {
                gid,
                host: host.into(),
                tenant: network.into(),
                network: network.into(),
            };
            (gid, e)
        };
        Arc::new(Known(HashMap::from([
            entry(REMOTE_N, "hb", "t"),
            entry(OTHER_N, "hc", "other"),
        ])))
    });
    Arc::clone(known) as Arc<dyn Directory>
}

/// How the packet queues behave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trouble {
    None,
    /// Sends take nothing (the kernel's queue is full).
    Full,
    /// Sends fail (each call drops its first packet).
    SendErrors,
    /// Sends take one packet per call.
    OneAtATime,
    /// The next receive fails.
    RecvError,
}

/// The network as the engine sees it: datagrams waiting to be received,
/// and what it sent.
#[derive(Debug)]
struct Net {
    inbox: VecDeque<Vec<u8>>,
    trouble: Trouble,
    sent: Vec<(Opcode, u32, Psn)>,
    /// The PSN of the last packet sent to each destination QP.
    last_psn: HashMap<u32, Psn>,
}

/// The check's [`PacketIo`]: one shared [`Net`].
#[derive(Debug, Clone)]
struct Queues(Arc<Mutex<Net>>);

impl Queues {
    fn net(&self) -> MutexGuard<'_, Net> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl PacketIo for Queues {
    fn send(&mut self, batch: &[OutPacket]) -> io::Result<usize> {
        let mut net = self.net();
        let n = match net.trouble {
            Trouble::Full => return Ok(0),
            Trouble::SendErrors => return Err(io::Error::from_raw_os_error(libc::EPERM)),
            Trouble::OneAtATime => batch.len().min(1),
            _ => batch.len(),
        };
        for p in &batch[..n] {
            // Every packet hostd sends is well-formed, from the victim's
            // GID to the one host it is connected to.
            assert_eq!(p.src, ip(VICTIM_N), "a packet from another source");
            assert_eq!(
                p.dst,
                ip(REMOTE_N),
                "a packet to a GID nothing is connected to"
            );
            let meta = Ipv4Meta::outgoing(p.src, p.dst, self.src_port());
            let pkt = match parse(p.payload(), &meta) {
                Ok(pkt) => pkt,
                Err(e) => panic!("hostd sent a packet that does not parse: {e}"),
            };
            net.last_psn.insert(pkt.bth.dest_qp, pkt.bth.psn);
            if net.sent.len() < 4096 {
                net.sent
                    .push((pkt.bth.opcode, pkt.bth.dest_qp, pkt.bth.psn));
            }
        }
        Ok(n)
    }

    fn recv(&mut self, bufs: &mut [InPacket]) -> io::Result<usize> {
        let mut net = self.net();
        if net.trouble == Trouble::RecvError {
            net.trouble = Trouble::None;
            return Err(io::Error::from_raw_os_error(libc::ENOBUFS));
        }
        let mut n = 0;
        while n < bufs.len() {
            let Some(d) = net.inbox.pop_front() else {
                break;
            };
            // A longer datagram is cut to the buffer, as a truncating
            // receive would.
            let len = d.len().min(MAX_IN_PACKET);
            bufs[n].buf[..len].copy_from_slice(&d[..len]);
            bufs[n].len = len;
            n += 1;
        }
        Ok(n)
    }

    fn rx_fd(&self) -> std::os::fd::RawFd {
        // The check runs the engine's rounds itself and never sleeps.
        -1
    }

    fn src_port(&self) -> u16 {
        0xc000
    }

    fn counters(&self) -> IoCounters {
        IoCounters::default()
    }
}

/// The engine, its two devices' drivers and the network: made once per
/// thread (an engine with its wire and two devices takes hundreds of
/// allocations, which would dominate every input under the fuzzer's
/// sanitizer), and brought back to the same state at the start of every
/// input ([`Host::begin`]).
struct Host {
    engine: Engine,
    victim: Driver,
    bystander: Driver,
    lkey: u32,
    rkey: u32,
    by_lkey: u32,
    by_rkey: u32,
    net: Queues,
    now: Instant,
    /// Receives posted so far (their buffers go round the slots).
    recvs: u64,
    /// Send WQEs posted so far.
    sends: u64,
    /// The PSN the victim's RC and UC responders expect next, as far as
    /// the packets sent "in sequence" go.
    rc_epsn: Psn,
    uc_epsn: Psn,
    /// The victim's CQEs in this input.
    cqes: Vec<Cqe>,
    /// The bystander's memory once its driver had set it up.
    snapshot: Vec<u8>,
    /// The wire's drops by reason when the input began.
    drops: BTreeMap<String, u64>,
}

thread_local! {
    /// One per thread (property tests run in parallel).
    static HOST: RefCell<Option<Host>> = const { RefCell::new(None) };
}

/// The setup of the `n`th QP of a device, in this check's layout.
fn setup(n: usize, vqpn: u32, qp_type: u8) -> QpSetup {
    let base = RINGS + n as u64 * QP_SPAN;
    let ring = |gpa| WorkRing {
        gpa,
        depth: DEPTH,
        stride: STRIDE,
    };
    QpSetup {
        sq: ring(base),
        rq: ring(base + QP_SPAN / 2),
        qp_type,
        ..qp_setup(n, vqpn, CAPS, DEPTH, STRIDE)
    }
}

/// Attaches device `id` (GID `gid(n)`, tenant `name`) with its memory,
/// doorbell, event ring, CQ and data region; returns its driver and keys.
fn device(engine: &mut Engine, id: DeviceId, n: u16, name: &str, mem: u64) -> (Driver, u32, u32) {
    let address = Address {
        gid: gid(n),
        lid: 0,
    };
    let policy = tenant(name, PriorityClass::Normal);
    engine
        .attach_device(id, name, address, &[id as u32 - 1], &policy)
        .expect("attach");
    let file = sealed_memfd("fuzz-wire", mem).expect("memfd");
    let map = |file: &File| {
        let dup = file.try_clone().expect("dup memfd");
        SharedMapping::map(dup, 0, mem).expect("map memfd")
    };
    engine
        .add_memory(id, 0, 0, map(&file), vrdma_hostd::engine::guest::MAX_SLOTS)
        .expect("memory");
    let kick = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    engine.set_doorbell(id, DOORBELL, kick).expect("doorbell");
    let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    engine.create_eq(id, 0, EQ, EQ_DEPTH, irq).expect("eq");
    engine.create_cq(id, CQN, CQ, CQ_DEPTH, 0).expect("cq");
    let region = MrRegistration {
        pd: 1,
        access: ALL,
        iova: IOVA,
        len: mem - DATA,
        segments: vec![MrSegment {
            slot: 0,
            offset: DATA,
            len: mem - DATA,
        }],
    };
    let (lkey, rkey) = engine.register_mr(id, &region).expect("mr");
    (Driver::new(map(&file)), lkey, rkey)
}

/// The connection of a victim QP to `dest_qpn` at the remote GID.
fn conn(dest_gid: u16, dest_qpn: u32) -> QpConnection {
    let mut c = connection(gid(dest_gid), dest_qpn);
    c.path_mtu = MTU;
    c.sq_psn = SQ_PSN;
    c.rq_psn = RQ_PSN;
    c.timeout = 10;
    c.retry_cnt = 3;
    c.rnr_retry = 3;
    c
}

fn modify(
    engine: &mut Engine,
    id: DeviceId,
    vqpn: u32,
    state: QpState,
    connection: Option<QpConnection>,
    qkey: Option<u32>,
) {
    let m = QpModify {
        vqpn,
        state: state.into(),
        connection,
        access: None,
        qkey,
    };
    engine.modify_qp(id, &m).expect("modify");
}

/// Moves a connected QP from RESET to RTS towards `dest_qpn` at `gid(n)`.
fn connect(engine: &mut Engine, id: DeviceId, vqpn: u32, n: u16, dest_qpn: u32) {
    modify(engine, id, vqpn, QpState::Init, None, None);
    for state in [QpState::Rtr, QpState::Rts] {
        modify(engine, id, vqpn, state, Some(conn(n, dest_qpn)), None);
    }
}

/// Moves a UD QP from RESET to RTS with [`QKEY`].
fn ud_up(engine: &mut Engine, id: DeviceId, vqpn: u32) {
    modify(engine, id, vqpn, QpState::Init, None, Some(QKEY));
    modify(engine, id, vqpn, QpState::Rtr, None, None);
    modify(engine, id, vqpn, QpState::Rts, None, None);
}

/// Which of the victim's QPs a QP number is (its driver index).
fn victim_index(vqpn: u32) -> Option<usize> {
    match vqpn {
        RC => Some(0),
        UD => Some(1),
        UC => Some(2),
        _ => None,
    }
}

impl Host {
    fn new() -> Self {
        let mut engine = Engine::new(Scheduler::new(None));
        let net = Queues(Arc::new(Mutex::new(Net {
            inbox: VecDeque::new(),
            trouble: Trouble::None,
            sent: Vec::new(),
            last_psn: HashMap::new(),
        })));
        engine.attach_wire(Wire::new(Box::new(net.clone()), directory()));
        let (mut victim, lkey, rkey) = device(&mut engine, VICTIM, VICTIM_N, "t", MEM);
        let (mut bystander, by_lkey, by_rkey) =
            device(&mut engine, BYSTANDER, BYSTANDER_N, "by", BY_MEM);
        for (n, vqpn, qp_type) in [(0, RC, 2), (1, UD, 4), (2, UC, 3)] {
            let s = setup(n, vqpn, qp_type);
            engine.create_qp(VICTIM, &s).expect("qp");
            victim.add_qp(&s);
        }
        for (n, vqpn, qp_type) in [(0, BY_RC, 2), (1, BY_UD, 4)] {
            let s = setup(n, vqpn, qp_type);
            engine.create_qp(BYSTANDER, &s).expect("qp");
            bystander.add_qp(&s);
        }
        connect(&mut engine, VICTIM, RC, REMOTE_N, PEER_RC);
        connect(&mut engine, VICTIM, UC, REMOTE_N, PEER_UC);
        ud_up(&mut engine, VICTIM, UD);
        connect(&mut engine, BYSTANDER, BY_RC, UNKNOWN_N, 0x500);
        ud_up(&mut engine, BYSTANDER, BY_UD);
        let ah = AhSetup {
            ahn: AH,
            pd: 1,
            dgid: gid(REMOTE_N),
            dlid: None,
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
        };
        engine.create_ah(VICTIM, &ah).expect("remote AH");
        // The bystander's data region: `i % 251 ^ 0x5a` at byte `i`.
        let pattern: Vec<u8> = (0..BY_MEM - DATA).map(|i| (i % 251) as u8 ^ 0x5a).collect();
        assert!(bystander.mem.write(DATA as usize, &pattern));
        let mut host = Host {
            engine,
            victim,
            bystander,
            lkey,
            rkey,
            by_lkey,
            by_rkey,
            net,
            now: Instant::now(),
            recvs: 0,
            sends: 0,
            rc_epsn: Psn::new(RQ_PSN),
            uc_epsn: Psn::new(RQ_PSN),
            cqes: Vec::new(),
            snapshot: Vec::new(),
            drops: BTreeMap::new(),
        };
        // The bystander's receives (whole buffers of its data region),
        // then the victim's.
        let by_lkey = host.by_lkey;
        for (qp, wr_id) in [(0, 0), (1, 1)] {
            let buf = sge(IOVA + wr_id * 0x800, 0x800, by_lkey);
            host.bystander.post_recv(qp, wr_id, &[buf]);
        }
        host.top_up();
        host.settle();
        // What no packet may change: the bystander's memory as its driver
        // left it.
        host.snapshot = host.bystander_bytes().to_vec();
        host
    }

    /// The start of an input: the network empty and well, the victim's
    /// QPs reset and connected again (fresh PSNs, nothing posted) with
    /// receives posted. The rest of the host is as the last input left it
    /// (which its end checked): its memory, CQ and event ring positions,
    /// the wire's counters, the clock.
    fn begin(&mut self, report: bool) {
        {
            let mut net = self.net.net();
            net.inbox.clear();
            net.trouble = Trouble::None;
            net.sent.clear();
            net.last_psn.clear();
        }
        self.cqes.clear();
        if report {
            self.drops = self.drops();
        }
        self.reconnect(RC, PEER_RC);
        self.reconnect(UC, PEER_UC);
        modify(&mut self.engine, VICTIM, UD, QpState::Reset, None, None);
        ud_up(&mut self.engine, VICTIM, UD);
        self.top_up();
    }

    /// The packets the wire dropped so far, by reason (every peer).
    fn drops(&self) -> BTreeMap<String, u64> {
        let peers = self.engine.wire().map(|w| w.peers.snapshot());
        let mut all = BTreeMap::new();
        for (reason, n) in peers.into_iter().flatten().flat_map(|p| p.drops) {
            *all.entry(reason).or_insert(0) += n;
        }
        all
    }

    /// The bystander's memory now.
    fn bystander_bytes(&self) -> &[u8] {
        let mem = &self.bystander.mem;
        // SAFETY: the bystander's memory is a memfd only this thread uses
        // (its engine and driver included), and nothing of this thread runs
        // while the slice is alive (callers only compare or copy it), so
        // nothing writes it meanwhile; the slice borrows `self`, which
        // keeps the mapping.
        unsafe { std::slice::from_raw_parts(mem.as_ptr(), mem.len()) }
    }

    fn step(&mut self, input: &mut Input<'_>) {
        // A driver whose RC or UC QP failed (a peer's invalid request
        // fails an RC responder) connects it again: the next packets find
        // it ready.
        for (vqpn, peer) in [(RC, PEER_RC), (UC, PEER_UC)] {
            if self.engine.query_qp(VICTIM, vqpn) == Ok(QpState::Err) {
                self.reconnect(vqpn, peer);
            }
        }
        match input.u8() % 8 {
            0..=3 => {
                let n = 1 + input.u8() % 8;
                for _ in 0..n {
                    let datagram = self.packet(input);
                    self.net.net().inbox.push_back(datagram);
                }
            }
            4 => self.post_send(input),
            5 => {
                self.now += match input.u8() % 4 {
                    0 => Duration::from_micros(10 * u64::from(input.u8())),
                    1 => Duration::from_millis(u64::from(input.u8())),
                    2 => Duration::from_millis(100),
                    _ => Duration::from_secs(1),
                }
            }
            6 => self.driver_moves(input),
            _ => {
                let trouble = match input.u8() % 4 {
                    0 => Trouble::Full,
                    1 => Trouble::SendErrors,
                    2 => Trouble::OneAtATime,
                    _ => Trouble::RecvError,
                };
                self.net.net().trouble = trouble;
                // What the victim's driver posted meanwhile meets it.
                if input.bool() {
                    self.post_send(input);
                }
                self.settle();
                self.net.net().trouble = Trouble::None;
            }
        }
        self.settle();
    }

    /// Runs rounds until the engine is idle; checks and keeps the CQEs,
    /// and posts receives again.
    fn settle(&mut self) {
        for _ in 0..ROUNDS {
            let r = self.engine.round(&[VICTIM, BYSTANDER], self.now);
            if !r.worked && !r.busy {
                break;
            }
        }
        let cqes = &mut self.cqes;
        self.victim.poll_each(|cqe| {
            assert!(WcStatus::try_from(cqe.status).is_ok(), "{cqe:?}");
            let qpn = cqe.qp_num.get();
            assert!(victim_index(qpn).is_some(), "a CQE of QP {qpn}: {cqe:?}");
            if cqes.len() < 4096 {
                cqes.push(cqe);
            }
        });
        // Events (a QP's fatal error) are taken as a driver does.
        self.victim.events_each(|_, _| {});
        self.top_up();
    }

    /// Keeps [`RECVS`] receives posted on each of the victim's QPs that
    /// can take them.
    fn top_up(&mut self) {
        for (qp, vqpn) in [(0, RC), (1, UD), (2, UC)] {
            let ready = matches!(
                self.engine.query_qp(VICTIM, vqpn),
                Ok(QpState::Rtr | QpState::Rts)
            );
            if !ready {
                continue;
            }
            let posted = self.victim.qps[qp].rq_producer;
            let outstanding = posted.wrapping_sub(self.victim.rq_done(qp));
            for _ in outstanding.min(RECVS)..RECVS {
                let slot = self.recvs % RECV_SLOTS;
                self.recvs += 1;
                let at = slot * RECV_LEN;
                let buf = sge(IOVA + at, RECV_LEN as u32, self.lkey);
                // The buffer's offset in the low half of the WR ID.
                self.victim.post_recv(qp, self.recvs << 32 | at, &[buf]);
            }
        }
    }

    /// One send WQE of the victim's driver, to the remote host.
    fn post_send(&mut self, input: &mut Input<'_>) {
        let qp = usize::from(input.u8() % 3);
        if self.victim.sq_free(qp) == 0 {
            return;
        }
        let opcodes: &[SendOpcode] = match qp {
            0 => &[
                SendOpcode::Send,
                SendOpcode::SendWithImm,
                SendOpcode::RdmaWrite,
                SendOpcode::RdmaWriteWithImm,
                SendOpcode::RdmaRead,
                SendOpcode::AtomicCmpAndSwp,
                SendOpcode::AtomicFetchAndAdd,
            ],
            1 => &[SendOpcode::Send, SendOpcode::SendWithImm],
            _ => &[
                SendOpcode::Send,
                SendOpcode::SendWithImm,
                SendOpcode::RdmaWrite,
                SendOpcode::RdmaWriteWithImm,
            ],
        };
        let opcode = *input.pick(opcodes).unwrap_or(&SendOpcode::Send);
        let atomic = matches!(
            opcode,
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
        );
        let len = if atomic {
            8
        } else {
            u64::from(input.u16() % 2048)
        };
        // Its local buffer past the receive buffers (a READ's lands there).
        let room = DATA_LEN - RECV_SLOTS * RECV_LEN - len;
        let at = RECV_SLOTS * RECV_LEN + ((u64::from(input.u16()) % room) & !7);
        self.sends += 1;
        let mut wqe = send(self.sends, opcode);
        wqe.imm_data = input.array();
        if qp == 1 {
            UdDest {
                ah: AH,
                remote_qpn: PEER_UD,
                remote_qkey: QKEY,
            }
            .write(&mut wqe);
        } else {
            wqe = remote(wqe, input.u64() & !7, input.u32());
            wqe.compare_add = input.u64().into();
            wqe.swap = input.u64().into();
        }
        let lkey = self.lkey;
        self.victim
            .post_sges(qp, &wqe, &[sge(IOVA + at, len as u32, lkey)]);
    }

    /// The victim's driver resets and reconnects a QP, or moves its RC QP
    /// to ERR.
    fn driver_moves(&mut self, input: &mut Input<'_>) {
        match input.u8() % 4 {
            0 => self.reconnect(RC, PEER_RC),
            1 => self.reconnect(UC, PEER_UC),
            2 => {
                modify(&mut self.engine, VICTIM, UD, QpState::Reset, None, None);
                ud_up(&mut self.engine, VICTIM, UD);
            }
            _ => modify(&mut self.engine, VICTIM, RC, QpState::Err, None, None),
        }
    }

    /// Resets the victim's connected QP `vqpn` and connects it again to
    /// `peer` (the responder expects its first PSN again).
    fn reconnect(&mut self, vqpn: u32, peer: u32) {
        modify(&mut self.engine, VICTIM, vqpn, QpState::Reset, None, None);
        connect(&mut self.engine, VICTIM, vqpn, REMOTE_N, peer);
        if vqpn == RC {
            self.rc_epsn = Psn::new(RQ_PSN);
        } else {
            self.uc_epsn = Psn::new(RQ_PSN);
        }
        // Receives again (the reset discarded those posted).
        self.top_up();
    }

    /// A source address: mostly the remote host.
    fn source(&self, input: &mut Input<'_>) -> Ipv4Addr {
        match input.u8() % 16 {
            0..=10 => ip(REMOTE_N),
            11 => ip(OTHER_N),
            12 => ip(VICTIM_N),
            13 => ip(BYSTANDER_N),
            14 => ip(UNKNOWN_N),
            _ => Ipv4Addr::from(input.array::<4>()),
        }
    }

    /// A destination address: mostly the victim.
    fn destination(&self, input: &mut Input<'_>) -> Ipv4Addr {
        match input.u8() % 8 {
            0..=5 => ip(VICTIM_N),
            6 => ip(BYSTANDER_N),
            _ => Ipv4Addr::from(input.array::<4>()),
        }
    }

    /// A destination QP: mostly the victim's QP of the opcode's transport.
    fn dest_qp(&self, input: &mut Input<'_>, transport: Transport) -> u32 {
        match input.u8() % 8 {
            0..=3 => match transport {
                Transport::Rc => RC,
                Transport::Uc => UC,
                Transport::Ud => UD,
            },
            4 => match transport {
                Transport::Rc => BY_RC,
                Transport::Uc => BY_RC + 2,
                Transport::Ud => BY_UD,
            },
            5 => *input.pick(&[RC, UD, UC, BY_RC, BY_UD]).unwrap_or(&RC),
            6 => input.u32() & 0xff_ffff,
            _ => u32::from(input.u8()),
        }
    }

    /// A key: mostly the victim's rkey.
    fn key(&self, input: &mut Input<'_>) -> u32 {
        match input.u8() % 8 {
            0..=3 => self.rkey,
            4 => self.lkey,
            5 => self.by_rkey,
            6 => self.by_lkey,
            _ => input.u32(),
        }
    }

    /// A PSN for a packet to `qpn` with `opcode`: in sequence (what the
    /// responder expects; for a response, what the requester sent last),
    /// near it, or anywhere.
    fn psn(&mut self, input: &mut Input<'_>, qpn: u32, opcode: Opcode, reth: Option<Reth>) -> Psn {
        let response = matches!(
            opcode.info().operation,
            Operation::Ack | Operation::AtomicAck | Operation::ReadResp
        );
        let peer = match qpn {
            RC => PEER_RC,
            UC => PEER_UC,
            _ => PEER_UD,
        };
        let sent = self.net.net().last_psn.get(&peer).copied();
        let expected = match qpn {
            UC => self.uc_epsn,
            _ => self.rc_epsn,
        };
        let base = if response {
            sent.unwrap_or(Psn::new(SQ_PSN))
        } else {
            expected
        };
        match input.u8() % 4 {
            0 => {
                if !response {
                    // In sequence: the next one takes the following PSNs
                    // (a READ one per response packet).
                    let n = match (opcode, reth) {
                        (Opcode::RcReadRequest, Some(r)) => {
                            u64::from(r.dma_len).div_ceil(u64::from(MTU)).max(1) as u32
                        }
                        _ => 1,
                    };
                    match qpn {
                        UC => self.uc_epsn = expected.add(n),
                        RC => self.rc_epsn = expected.add(n),
                        _ => {}
                    }
                }
                base
            }
            1 => Psn::new(base.0.wrapping_add(input.u8() as i8 as u32) & 0xff_ffff),
            2 => Psn::new(sent.unwrap_or(base).0.wrapping_add(input.u8() as i8 as u32) & 0xff_ffff),
            _ => Psn::new(input.u32() & 0xff_ffff),
        }
    }

    /// One datagram as the network hands it to hostd.
    fn packet(&mut self, input: &mut Input<'_>) -> Vec<u8> {
        match input.u8() % 4 {
            0 | 1 => {
                // A fixed share of the input, whatever the opcode reads:
                // a change to one packet's fields leaves the next ones.
                let fields = input.bytes(FIELDS);
                self.structured(&mut Input::new(fields))
            }
            2 => {
                // Raw bytes made a valid datagram to a chosen QP.
                let len = usize::from(input.u16()) % (MAX_IN_PACKET + 64);
                let mut d = input.bytes(len).to_vec();
                if d.len() >= IP_UDP_LEN + 12 {
                    d[12..16].copy_from_slice(&self.source(input).octets());
                    d[16..20].copy_from_slice(&self.destination(input).octets());
                    let t = [Transport::Rc, Transport::Uc, Transport::Ud];
                    let transport = *input.pick(&t).unwrap_or(&Transport::Rc);
                    let qpn = self.dest_qp(input, transport);
                    d[IP_UDP_LEN + 2..IP_UDP_LEN + 4].copy_from_slice(&DEFAULT_PKEY.to_be_bytes());
                    d[IP_UDP_LEN + 5..IP_UDP_LEN + 8].copy_from_slice(&qpn.to_be_bytes()[1..]);
                    d[22..24].copy_from_slice(&ROCE_V2_PORT.to_be_bytes());
                    d[6] &= 0x40;
                    d[7] = 0;
                }
                crate::roce::seal_datagram(&mut d);
                d
            }
            _ => {
                let len = usize::from(input.u16()) % (MAX_IN_PACKET + 64);
                input.bytes(len).to_vec()
            }
        }
    }

    /// A packet built from fields.
    fn structured(&mut self, input: &mut Input<'_>) -> Vec<u8> {
        let opcode = *input.pick(&Opcode::ALL).unwrap_or(&Opcode::RcSendOnly);
        let info = opcode.info();
        let src = self.source(input);
        let dst = self.destination(input);
        let qpn = self.dest_qp(input, info.transport);
        let flags = input.u8();
        let pkey = if input.u8() == 0xff {
            input.u16()
        } else {
            DEFAULT_PKEY
        };
        let payload_len = if info.payload {
            match input.u8() % 4 {
                0 => usize::from(input.u8()),
                1 => MTU as usize,
                2 => usize::from(input.u16() % 4097),
                _ => 4096 + usize::from(input.u8()),
            }
        } else {
            0
        };
        let reth = info.reth.then(|| Reth {
            va: addr(input),
            rkey: self.key(input),
            dma_len: match input.u8() % 4 {
                0 => payload_len as u32,
                1 => u32::from(input.u16()),
                2 => (payload_len as u32).wrapping_add(u32::from(input.u8())),
                _ => input.u32(),
            },
        });
        let deth = info.deth.then(|| Deth {
            qkey: match input.u8() % 4 {
                0 | 1 => QKEY,
                2 => QKEY ^ (1 << (input.u8() % 32)),
                _ => input.u32(),
            },
            src_qp: if input.bool() {
                input.u32() & 0xff_ffff
            } else {
                PEER_UD
            },
        });
        let aeth = info.aeth.then(|| {
            let msn = input.u32() & 0xff_ffff;
            match input.u8() % 4 {
                0 | 1 => Aeth::Ack {
                    credits: input.u8() % 32,
                    msn,
                },
                2 => Aeth::RnrNak {
                    timer: input.u8() % 32,
                    msn,
                },
                _ => {
                    let codes = [
                        NakCode::PsnSequenceError,
                        NakCode::InvalidRequest,
                        NakCode::RemoteAccessError,
                        NakCode::RemoteOperationalError,
                        NakCode::InvalidRdRequest,
                    ];
                    let code = *input.pick(&codes).unwrap_or(&NakCode::InvalidRequest);
                    Aeth::Nak { code, msn }
                }
            }
        });
        let atomic = info.atomic_eth.then(|| {
            let va = addr(input);
            AtomicEth {
                va: if input.u8() == 0xff { va } else { va & !7 },
                rkey: self.key(input),
                swap_add: input.u64(),
                compare: input.u64(),
            }
        });
        let atomic_ack = info
            .atomic_ack_eth
            .then(|| AtomicAckEth { orig: input.u64() });
        let imm = info.imm.then(|| input.array::<4>());
        let ieth = info.ieth.then(|| input.u32());
        let psn = self.psn(input, qpn, opcode, reth);
        let h = Headers {
            bth: Bth {
                opcode,
                solicited: flags & 1 != 0,
                migreq: flags & 2 != 0,
                pad: 0,
                pkey,
                fecn: flags & 4 != 0,
                becn: flags & 8 != 0,
                dest_qp: qpn,
                ack_req: flags & 16 != 0,
                psn,
            },
            deth,
            reth,
            aeth,
            atomic,
            atomic_ack,
            imm,
            ieth,
        };
        let odd = input.u8();
        let meta = Ipv4Meta {
            src,
            dst,
            id: if odd == 0xff { input.u16() } else { 0 },
            flags_frag: if odd == 0xff { input.u16() } else { IP_DF },
            src_port: 0xc000,
            dst_port: if odd == 0xfe {
                input.u16()
            } else {
                ROCE_V2_PORT
            },
        };
        let seed = input.u8();
        let payload: Vec<u8> = (0..payload_len).map(|i| i as u8 ^ seed).collect();
        let mut d = vec![0u8; IP_UDP_LEN + MAX_HEADER_LEN + payload_len + 8];
        let Ok(n) = build(&mut d[IP_UDP_LEN..], &h, &payload, &meta) else {
            panic!("valid headers refused: {h:?}");
        };
        let tos = if odd == 0xfd { input.u8() } else { 0 };
        let header = write_ipv4_udp_header(&mut d, &meta, tos, 64, n);
        assert_eq!(header, Ok(IP_UDP_LEN));
        d.truncate(IP_UDP_LEN + n);
        d
    }

    /// The invariants at the end, and that the engine still serves.
    fn finish(&mut self, report: bool) -> Report {
        for vqpn in [BY_RC, BY_UD] {
            assert_eq!(
                self.engine.query_qp(BYSTANDER, vqpn),
                Ok(QpState::Rts),
                "the bystander's QP {vqpn:#x} left RTS"
            );
        }
        assert_eq!(
            self.engine.query_qp(VICTIM, UD),
            Ok(QpState::Rts),
            "the victim's UD QP left RTS"
        );
        let same = self.snapshot == self.bystander_bytes();
        assert!(same, "the bystander's memory changed");
        // A well-formed datagram from the remote host still lands.
        self.net.net().trouble = Trouble::None;
        self.settle();
        let before = self.cqes.len();
        let text = b"still serving";
        let d = datagram(text);
        self.net.net().inbox.push_back(d.clone());
        self.settle();
        let landed: Vec<Cqe> = (self.cqes[before..].iter())
            .filter(|c| c.qp_num.get() == UD && is_receive(c))
            .copied()
            .collect();
        let [cqe] = landed[..] else {
            panic!("the datagram did not land once: {landed:?}");
        };
        assert_eq!(WcStatus::try_from(cqe.status), Ok(WcStatus::Success));
        assert_eq!(cqe.opcode, u8::from(WcOpcode::Recv));
        assert_eq!(cqe.wc_flags, wc_flags::GRH);
        assert_eq!(cqe.byte_len.get(), GRH_SIZE + text.len() as u32);
        assert_eq!(cqe.src_qp.get(), PEER_UD);
        let at = (DATA + (cqe.wr_id.get() & 0xffff_ffff)) as usize;
        let mut got = vec![0u8; GRH_SIZE as usize + text.len()];
        assert!(self.victim.mem.read(at, &mut got));
        assert_eq!(got[..20], [0; 20], "GRH");
        assert_eq!(got[20..40], d[..20], "GRH: the IPv4 header");
        assert_eq!(&got[40..], text);
        if !report {
            self.cqes.clear();
            return Report::default();
        }
        let mut drops = self.drops();
        for (reason, before) in &self.drops {
            if let Some(n) = drops.get_mut(reason) {
                *n -= before;
            }
        }
        drops.retain(|_, n| *n > 0);
        Report {
            cqes: std::mem::take(&mut self.cqes),
            sent: std::mem::take(&mut self.net.net().sent),
            drops,
        }
    }
}

const IP_UDP_LEN: usize = IPV4_HEADER_LEN + UDP_HEADER_LEN;

/// Whether `c` completes a receive.
fn is_receive(c: &Cqe) -> bool {
    c.opcode == u8::from(WcOpcode::Recv) || c.opcode == u8::from(WcOpcode::RecvRdmaWithImm)
}

/// An address near the victim's region's edges, or anywhere.
fn addr(input: &mut Input<'_>) -> u64 {
    match input.u8() % 4 {
        0 => IOVA + u64::from(input.u16()) % DATA_LEN,
        1 => IOVA + DATA_LEN - u64::from(input.u16() % 64),
        2 => IOVA - u64::from(input.u8()),
        _ => input.u64(),
    }
}

/// A UD SEND ONLY of `text` from the remote host's UD QP to the victim's,
/// with its Q_Key: a whole IPv4 datagram.
fn datagram(text: &[u8]) -> Vec<u8> {
    let mut h = Headers::new(Bth {
        opcode: Opcode::UdSendOnly,
        solicited: false,
        migreq: false,
        pad: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qp: UD,
        ack_req: false,
        psn: Psn::new(7),
    });
    h.deth = Some(Deth {
        qkey: QKEY,
        src_qp: PEER_UD,
    });
    let meta = Ipv4Meta::outgoing(ip(REMOTE_N), ip(VICTIM_N), 0xc000);
    let mut d = vec![0u8; IP_UDP_LEN + MAX_HEADER_LEN + text.len() + 8];
    let n = build(&mut d[IP_UDP_LEN..], &h, text, &meta).expect("build");
    assert_eq!(
        write_ipv4_udp_header(&mut d, &meta, 0, 64, n),
        Ok(IP_UDP_LEN)
    );
    d.truncate(IP_UDP_LEN + n);
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(opcode: Opcode) -> u8 {
        Opcode::ALL
            .iter()
            .position(|&o| o == opcode)
            .expect("opcode") as u8
    }

    /// One batch of one structured packet of `opcode`, every other field
    /// its default (zeros): from the remote host to the victim's QP of
    /// the opcode's transport, in sequence, with an empty payload.
    fn one(opcode: Opcode) -> Vec<u8> {
        // Reads past the end give zeros: the input ends after its byte.
        vec![0, 0, 0, index(opcode)]
    }

    fn received(r: &Report, qpn: u32) -> Vec<(WcStatus, u32)> {
        (r.cqes.iter())
            .filter(|c| c.qp_num.get() == qpn && is_receive(c))
            .map(|c| {
                let status = WcStatus::try_from(c.status).unwrap_or(WcStatus::GeneralErr);
                (status, c.byte_len.get())
            })
            .collect()
    }

    #[test]
    fn a_valid_ud_uc_and_rc_packet_reach_the_accepted_path() {
        // UD: the datagram and the final one land (40-byte GRH each).
        let r = run(&one(Opcode::UdSendOnly));
        let ud = received(&r, UD);
        assert_eq!(ud[0], (WcStatus::Success, GRH_SIZE), "{r:?}");
        assert_eq!(ud.len(), 2, "{r:?}");
        assert!(r.drops.is_empty(), "{:?}", r.drops);
        // UC and RC: the SEND lands in a receive; nothing is dropped.
        for (opcode, qpn) in [(Opcode::UcSendOnly, UC), (Opcode::RcSendOnly, RC)] {
            let r = run(&one(opcode));
            assert_eq!(received(&r, qpn), vec![(WcStatus::Success, 0)], "{r:?}");
            assert!(r.drops.is_empty(), "{opcode:?}: {:?}", r.drops);
        }
        // An RC SEND asking for an acknowledgement gets one.
        let mut v = one(Opcode::RcSendOnly);
        v.extend([0, 0, 0, 16]);
        let r = run(&v);
        assert_eq!(received(&r, RC), vec![(WcStatus::Success, 0)], "{r:?}");
        assert_eq!(r.sent, vec![(Opcode::RcAck, PEER_RC, Psn::new(RQ_PSN))]);
    }

    #[test]
    fn garbage_and_empty_inputs_pass() {
        check(&[]);
        check(&[0; 600]);
        check(&[3; 600]);
        check(&(0..2000).map(|i| (i * 7 % 256) as u8).collect::<Vec<_>>());
    }
}
