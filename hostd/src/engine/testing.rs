//! A driver's side of a device, for testing hostd: [`Driver`] is the
//! guest memory of one device (a memfd, at guest address 0, with a fixed
//! layout) and writes WQEs into its rings, rings its doorbell and reads its
//! CQ and event ring exactly as the spec says — no hostd code on that
//! side. [`Env`] wires two of them to an engine in-process; hostd's
//! integration tests drive one through the control socket. Used by the
//! engine's unit tests, hostd's tests and the fuzz checks; compiled only
//! for them.

use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_hostd_protocol::messages::{
    MrRegistration, MrSegment, QpConnection, QpModify, QpSetup, SrqSetup, WorkRing,
};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::ring::{
    doorbell, Cqe, Event, RecvWqe, SendWqe, Sge, CQE_SIZE, DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR,
    DEVICE_INDEX_OFFSET, DRIVER_ARM_OFFSET, DRIVER_INDEX_OFFSET, EVENT_SIZE, RING_HEADER_SIZE,
};
use vrdma_spec::verbs::{access, QpState, SendOpcode};
use vrdma_tenant_policy::{Policy, PriorityClass, TenantPolicy};
use zerocopy::{FromBytes, IntoBytes};

use super::guest::{SharedMapping, MAX_SLOTS};
use super::{Address, DeviceId, Engine, EngineError};
use crate::gids::Gid;
use crate::scheduler::Scheduler;

/// Bytes of each device's guest memory (one slot at guest address 0).
pub const MEM: u64 = 1 << 20;
/// The doorbell page.
pub const DOORBELL: u64 = 0;
/// The event ring of vector 0 (64 events).
pub const EQ: u64 = 0x1000;
pub const EQ_DEPTH: u32 = 64;
/// The CQ ring (send and receive CQ of the QP).
pub const CQ: u64 = 0x2000;
pub const CQ_DEPTH: u32 = 256;
pub const CQN: u32 = 7;
/// The first QP's send and receive rings; more QPs follow at [`QP_STEP`].
pub const SQ: u64 = 0x1_0000;
pub const RQ: u64 = 0x1_8000;
pub const QP_STEP: u64 = 0x1_0000;
pub const DEPTH: u32 = 64;
pub const STRIDE: u32 = 256;
/// The registered data region: IOVA [`IOVA`].. is guest address [`DATA`]..
pub const DATA: u64 = 0x8_0000;
pub const DATA_LEN: u64 = MEM - DATA;
pub const IOVA: u64 = 0x10_0000;
/// Every access flag a region can have.
pub const ALL: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// One QP of a test device, as its driver tracks it.
#[derive(Debug, Clone, Copy)]
pub struct TestQp {
    pub vqpn: u32,
    pub db_index: u32,
    pub sq: u64,
    pub rq: u64,
    pub depth: u32,
    pub stride: u32,
    pub sq_producer: u32,
    pub rq_producer: u32,
}

/// A shared receive queue of a test device, as its driver tracks it
/// (slots of [`SRQ_STRIDE`] bytes).
#[derive(Debug, Clone, Copy)]
pub struct TestSrq {
    pub srqn: u32,
    pub ring: u64,
    pub depth: u32,
    pub producer: u32,
}

/// Stride of a test SRQ's slots (up to 3 SGEs).
pub const SRQ_STRIDE: u32 = 64;

/// A device's guest memory as its driver uses it.
#[derive(Debug)]
pub struct Driver {
    /// The driver's view of its guest memory.
    pub mem: SharedMapping,
    pub qps: Vec<TestQp>,
    cq_consumer: u32,
    eq_consumer: u32,
}

/// One device on an in-process engine, and its driver.
#[derive(Debug)]
pub struct Side {
    pub id: DeviceId,
    pub gid: Gid,
    pub driver: Driver,
    pub lkey: u32,
    pub rkey: u32,
    /// The eventfd the driver would kick; the event ring's interrupt.
    pub kick: EventFd,
    pub irq: EventFd,
}

impl std::ops::Deref for Side {
    type Target = Driver;
    fn deref(&self) -> &Driver {
        &self.driver
    }
}

impl std::ops::DerefMut for Side {
    fn deref_mut(&mut self) -> &mut Driver {
        &mut self.driver
    }
}

/// The registration of the data region ([`DATA`] at [`IOVA`], every
/// access) in slot 0.
pub fn data_region() -> MrRegistration {
    data_region_in(MEM)
}

/// The registration of the data region of a device whose slot 0 has
/// `mem` bytes (the same layout, a longer data region: [`DATA`]..`mem`).
pub fn data_region_in(mem: u64) -> MrRegistration {
    let len = mem - DATA;
    MrRegistration {
        pd: 1,
        access: ALL,
        iova: IOVA,
        len,
        segments: vec![MrSegment {
            slot: 0,
            offset: DATA,
            len,
        }],
    }
}

/// The setup of the `n`th QP numbered `vqpn`, with rings of `depth` slots
/// of `stride` bytes (each at most 32 KiB) and `caps` (max_send_sge,
/// max_inline, max_recv_sge).
pub fn qp_setup(n: usize, vqpn: u32, caps: (u32, u32, u32), depth: u32, stride: u32) -> QpSetup {
    let n = n as u64;
    let ring = |gpa| WorkRing { gpa, depth, stride };
    let (max_sge, max_inline, max_recv_sge) = caps;
    QpSetup {
        vqpn,
        pd: 1,
        db_index: n as u32,
        send_cqn: CQN,
        recv_cqn: CQN,
        sq_sig_all: false,
        sq: ring(SQ + n * QP_STEP),
        rq: ring(RQ + n * QP_STEP),
        max_send_sge: max_sge,
        max_recv_sge,
        max_inline_data: max_inline,
        srqn: None,
        qp_type: 2,
    }
}

/// Two devices on one engine, A (id 1, GID `gid(10)`) and B (id 2, GID
/// `gid(20)`), each
/// with its doorbell page, event ring, CQ, a registered data region and
/// one QP connected to the other's.
pub struct Env {
    pub engine: Engine,
    pub a: Side,
    pub b: Side,
    pub now: Instant,
}

/// A tenant policy for the tests: class `class`, unlimited, its network
/// its name.
pub fn tenant(name: &str, class: PriorityClass) -> TenantPolicy {
    let mut t = Policy::default_policy().tenants[0].clone();
    t.name = name.into();
    t.network = None;
    t.reachable.clear();
    t.priority.class = class;
    t
}

/// An SGE.
pub fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
    Sge {
        addr: addr.into(),
        length: length.into(),
        lkey: lkey.into(),
    }
}

/// The GID of the test device numbered `n` (hostd's GID of LID `n`).
pub fn gid(n: u16) -> Gid {
    vrdma_spec::gid::loopback_gid(n)
}

/// The connection [`Env::connect`] gives a QP: to `dest_qpn` at
/// `dest_gid`, every access, RNR retries for ever, 3 transport retries,
/// MTU 4096, PSNs 0.
pub fn connection(dest_gid: Gid, dest_qpn: u32) -> QpConnection {
    QpConnection {
        dgid: dest_gid,
        dlid: None,
        dest_qpn,
        flow_label: 0,
        hop_limit: 64,
        traffic_class: 0,
        access: access::QP_SUPPORTED,
        rnr_retry: 7,
        retry_cnt: 3,
        min_rnr_timer: 1,
        timeout: 14,
        path_mtu: 4096,
        sq_psn: 0,
        rq_psn: 0,
        max_rd_atomic: 16,
        max_dest_rd_atomic: 16,
    }
}

/// A signaled send WQE.
pub fn send(wr_id: u64, opcode: SendOpcode) -> SendWqe {
    SendWqe {
        wr_id: wr_id.into(),
        opcode: opcode.into(),
        flags: vrdma_spec::ring::send_flags::SIGNALED,
        ..SendWqe::default()
    }
}

/// `wqe` aimed at `addr` with `rkey`.
pub fn remote(mut wqe: SendWqe, addr: u64, rkey: u32) -> SendWqe {
    wqe.remote_addr = addr.into();
    wqe.rkey = rkey.into();
    wqe
}

/// Hands each entry the device produced in the ring at `base` (`depth`
/// entries of `N` bytes) to `f`, from `*consumer` on, and gives the slots
/// back (the driver index).
fn drain<const N: usize>(
    mem: &SharedMapping,
    base: u64,
    depth: u32,
    consumer: &mut u32,
    mut f: impl FnMut(&[u8; N]),
) {
    let producer = word(mem, base + DEVICE_INDEX_OFFSET);
    while *consumer != producer {
        let at = base + RING_HEADER_SIZE as u64 + u64::from(*consumer % depth) * N as u64;
        let mut raw = [0u8; N];
        assert!(mem.read(at as usize, &mut raw));
        f(&raw);
        *consumer = consumer.wrapping_add(1);
    }
    set_word(mem, base + DRIVER_INDEX_OFFSET, *consumer);
}

fn word(mem: &SharedMapping, at: u64) -> u32 {
    mem.atomic_u32(at as usize).map_or(0, |w| {
        u32::from_le(w.load(std::sync::atomic::Ordering::Acquire))
    })
}

fn set_word(mem: &SharedMapping, at: u64, v: u32) {
    if let Some(w) = mem.atomic_u32(at as usize) {
        w.store(v.to_le(), std::sync::atomic::Ordering::Release);
    }
}

impl Side {
    /// A device `id` with GID `gid(n)` attached to `engine` (on an
    /// Ethernet port): memory, doorbell, event ring, CQ and the data
    /// region registered.
    pub fn new(engine: &mut Engine, id: DeviceId, n: u16, policy: &TenantPolicy) -> Self {
        let address = Address {
            gid: gid(n),
            lid: 0,
        };
        Self::at(engine, id, address, policy)
    }

    /// [`Side::new`] with the port at `address` (a LID: InfiniBand).
    pub fn at(engine: &mut Engine, id: DeviceId, address: Address, policy: &TenantPolicy) -> Self {
        let gid = address.gid;
        let file = sealed_memfd("engine-test", MEM).expect("memfd");
        let mem = SharedMapping::map(file.try_clone().expect("dup"), 0, MEM).expect("map");
        engine
            .attach_device(id, &policy.name, address, &[id as u32 - 1], policy)
            .expect("attach");
        engine
            .add_memory(
                id,
                0,
                0,
                SharedMapping::map(file, 0, MEM).expect("map"),
                MAX_SLOTS,
            )
            .expect("memory");
        let kick = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        engine
            .set_doorbell(id, DOORBELL, kick.try_clone().expect("dup"))
            .expect("doorbell");
        engine
            .create_eq(id, 0, EQ, EQ_DEPTH, irq.try_clone().expect("dup"))
            .expect("eq");
        engine.create_cq(id, CQN, CQ, CQ_DEPTH, 0).expect("cq");
        let (lkey, rkey) = engine.register_mr(id, &data_region()).expect("mr");
        Side {
            id,
            gid,
            driver: Driver::new(mem),
            lkey,
            rkey,
            kick,
            irq,
        }
    }

    /// Creates QP number `vqpn` (the `n`th of this side) in RESET.
    pub fn add_qp(&mut self, engine: &mut Engine, vqpn: u32, caps: (u32, u32, u32)) -> usize {
        self.add_qp_shaped(engine, vqpn, caps, DEPTH, STRIDE)
    }

    /// Creates SRQ `srqn` of `depth` slots with its ring at `at` and its
    /// limit armed at `limit`.
    pub fn add_srq(
        &mut self,
        engine: &mut Engine,
        srqn: u32,
        at: u64,
        depth: u32,
        limit: u32,
    ) -> TestSrq {
        let setup = SrqSetup {
            srqn,
            pd: 1,
            ring: WorkRing {
                gpa: at,
                depth,
                stride: SRQ_STRIDE,
            },
            max_sge: 3,
            limit,
        };
        engine.create_srq(self.id, &setup).expect("srq");
        TestSrq {
            srqn,
            ring: at,
            depth,
            producer: 0,
        }
    }

    /// Creates QP number `vqpn` in RESET, taking its receives from SRQ
    /// `srqn`.
    pub fn add_qp_on_srq(&mut self, engine: &mut Engine, vqpn: u32, srqn: u32) -> usize {
        let setup = QpSetup {
            srqn: Some(srqn),
            ..qp_setup(self.qps.len(), vqpn, CAPS, DEPTH, STRIDE)
        };
        engine.create_qp(self.id, &setup).expect("qp");
        self.driver.add_qp(&setup)
    }

    /// Creates QP number `vqpn` of type `qp_type` (RC 2, UC 3, UD 4) in
    /// RESET.
    pub fn add_qp_of(&mut self, engine: &mut Engine, vqpn: u32, qp_type: u8) -> usize {
        let setup = QpSetup {
            qp_type,
            ..qp_setup(self.qps.len(), vqpn, CAPS, DEPTH, STRIDE)
        };
        engine.create_qp(self.id, &setup).expect("qp");
        self.driver.add_qp(&setup)
    }

    /// The same with rings of `depth` slots of `stride` bytes.
    pub fn add_qp_shaped(
        &mut self,
        engine: &mut Engine,
        vqpn: u32,
        caps: (u32, u32, u32),
        depth: u32,
        stride: u32,
    ) -> usize {
        let setup = qp_setup(self.qps.len(), vqpn, caps, depth, stride);
        engine.create_qp(self.id, &setup).expect("qp");
        self.driver.add_qp(&setup)
    }
}

impl Driver {
    /// The driver of the guest memory `mem` maps (laid out as this module
    /// says; the device's rings are created by the caller).
    pub fn new(mem: SharedMapping) -> Self {
        Driver {
            mem,
            qps: Vec::new(),
            cq_consumer: 0,
            eq_consumer: 0,
        }
    }

    /// Tracks the QP `setup` created; returns its index.
    pub fn add_qp(&mut self, setup: &QpSetup) -> usize {
        self.qps.push(TestQp {
            vqpn: setup.vqpn,
            db_index: setup.db_index,
            sq: setup.sq.gpa,
            rq: setup.rq.gpa,
            depth: setup.sq.depth,
            stride: setup.sq.stride,
            sq_producer: 0,
            rq_producer: 0,
        });
        self.qps.len() - 1
    }

    /// Writes `data` at byte `offset` of the data region.
    pub fn fill(&self, offset: u64, data: &[u8]) {
        assert!(self.mem.write((DATA + offset) as usize, data));
    }

    /// `len` bytes at byte `offset` of the data region.
    pub fn bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        assert!(self.mem.read((DATA + offset) as usize, &mut out));
        out
    }

    /// Sets QP `qp`'s bit in the doorbell page, as a driver after posting.
    pub fn ring(&self, qp: usize) {
        let bit = doorbell::bit(self.qps[qp].db_index).expect("db index");
        let word = self.mem.atomic_u64(bit.word_offset as usize).expect("word");
        word.fetch_or(bit.mask.to_le(), std::sync::atomic::Ordering::SeqCst);
        let summary = (self.mem.atomic_u64(bit.summary_offset as usize)).expect("summary");
        summary.fetch_or(
            bit.summary_mask.to_le(),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    /// Writes raw `bytes` at byte `offset` of send slot `index` of QP `qp`
    /// (no publish).
    pub fn write_send_slot_at(&self, qp: usize, index: u32, offset: usize, bytes: &[u8]) {
        let q = &self.qps[qp];
        let room = (q.stride as usize).saturating_sub(offset);
        let at = q.sq + RING_HEADER_SIZE as u64 + u64::from(index % q.depth) * u64::from(q.stride);
        assert!(self
            .mem
            .write(at as usize + offset, &bytes[..bytes.len().min(room)]));
    }

    /// Writes raw `bytes` into send slot `index` of QP `qp` (no publish).
    pub fn write_send_slot(&self, qp: usize, index: u32, bytes: &[u8]) {
        self.write_send_slot_at(qp, index, 0, bytes);
    }

    /// Publishes send producer index `producer` of QP `qp` and rings.
    pub fn publish_send(&mut self, qp: usize, producer: u32) {
        self.qps[qp].sq_producer = producer;
        set_word(&self.mem, self.qps[qp].sq + DRIVER_INDEX_OFFSET, producer);
        self.ring(qp);
    }

    /// Posts a send WQE with `payload` (SGEs or inline bytes) on QP `qp`.
    pub fn post_send(&mut self, qp: usize, wqe: &SendWqe, payload: &[u8]) {
        let index = self.qps[qp].sq_producer;
        self.write_send_slot_at(qp, index, 0, wqe.as_bytes());
        self.write_send_slot_at(qp, index, core::mem::size_of::<SendWqe>(), payload);
        self.publish_send(qp, index.wrapping_add(1));
    }

    /// Posts a send WQE gathering from `sges` on QP `qp`.
    pub fn post_sges(&mut self, qp: usize, wqe: &SendWqe, sges: &[Sge]) {
        let mut wqe = *wqe;
        wqe.num_sge = u8::try_from(sges.len()).unwrap_or(u8::MAX);
        self.post_send(qp, &wqe, sges.as_bytes());
    }

    /// Posts a receive of `sges` on QP `qp`.
    pub fn post_recv(&mut self, qp: usize, wr_id: u64, sges: &[Sge]) {
        let q = self.qps[qp];
        self.qps[qp].rq_producer =
            self.push_recv((q.rq, q.depth, q.stride), q.rq_producer, wr_id, sges);
        self.ring(qp);
    }

    /// Posts a receive of `sges` on SRQ `srq` (no doorbell: the device
    /// reads an SRQ when a message arrives).
    pub fn post_srq_recv(&mut self, srq: &mut TestSrq, wr_id: u64, sges: &[Sge]) {
        let ring = (srq.ring, srq.depth, SRQ_STRIDE);
        srq.producer = self.push_recv(ring, srq.producer, wr_id, sges);
    }

    /// Writes a receive WQE into slot `producer` of the receive ring
    /// `(address, depth, stride)` and publishes it; the next producer.
    fn push_recv(&self, ring: (u64, u32, u32), producer: u32, wr_id: u64, sges: &[Sge]) -> u32 {
        let (base, depth, stride) = ring;
        let wqe = RecvWqe {
            wr_id: wr_id.into(),
            num_sge: sges.len() as u8,
            reserved: [0; 7],
        };
        let at = base + RING_HEADER_SIZE as u64 + u64::from(producer % depth) * u64::from(stride);
        assert!(self.mem.write(at as usize, wqe.as_bytes()));
        assert!(self.mem.write(at as usize + 16, sges.as_bytes()));
        let next = producer.wrapping_add(1);
        set_word(&self.mem, base + DRIVER_INDEX_OFFSET, next);
        next
    }

    /// The SRQ's device index (WQEs taken by its QPs).
    pub fn srq_taken(&self, srq: &TestSrq) -> u32 {
        word(&self.mem, srq.ring + DEVICE_INDEX_OFFSET)
    }

    /// The send ring's device index of QP `qp` (WQEs completed).
    pub fn sq_done(&self, qp: usize) -> u32 {
        word(&self.mem, self.qps[qp].sq + DEVICE_INDEX_OFFSET)
    }

    /// Free slots of QP `qp`'s send ring: `depth - (producer -
    /// device.index)`, what the driver may still post (0: a real driver's
    /// post fails with ENOMEM).
    pub fn sq_free(&self, qp: usize) -> u32 {
        let q = &self.qps[qp];
        q.depth
            .saturating_sub(q.sq_producer.wrapping_sub(self.sq_done(qp)))
    }

    /// Whether the device flagged QP `qp`'s send ring with
    /// DEVICE_FLAG_ERROR (the QP is in ERR).
    pub fn sq_error(&self, qp: usize) -> bool {
        word(&self.mem, self.qps[qp].sq + DEVICE_FLAGS_OFFSET) & DEVICE_FLAG_ERROR != 0
    }

    /// The receive ring's device index of QP `qp` (receives completed).
    pub fn rq_done(&self, qp: usize) -> u32 {
        word(&self.mem, self.qps[qp].rq + DEVICE_INDEX_OFFSET)
    }

    /// Whether the device asked to be notified (it is going to sleep): the
    /// doorbell page's NEED_KICK flag. Read after ringing, with the
    /// ordering the spec asks for (SeqCst after the summary's fetch_or), a
    /// driver that finds it set notifies the doorbell queue.
    pub fn needs_kick(&self) -> bool {
        let flags = (self
            .mem
            .atomic_u32((DOORBELL + doorbell::FLAGS_OFFSET) as usize))
        .map_or(0, |w| {
            u32::from_le(w.load(std::sync::atomic::Ordering::SeqCst))
        });
        flags & doorbell::NEED_KICK != 0
    }

    /// Takes every CQE the device wrote.
    pub fn poll(&mut self) -> Vec<Cqe> {
        let mut out = Vec::new();
        self.poll_each(|cqe| out.push(cqe));
        out
    }

    /// Hands every CQE the device wrote to `f` (allocating nothing).
    pub fn poll_each(&mut self, mut f: impl FnMut(Cqe)) {
        drain::<CQE_SIZE>(&self.mem, CQ, CQ_DEPTH, &mut self.cq_consumer, |raw| {
            f(Cqe::read_from_bytes(raw).expect("cqe"));
        });
    }

    /// Arms the CQ: `(sn << 8) | kind`.
    pub fn arm(&self, sn: u32, kind: u32) {
        set_word(&self.mem, CQ + DRIVER_ARM_OFFSET, (sn << 8) | kind);
    }

    /// Takes every event of ring 0: (kind, object).
    pub fn events(&mut self) -> Vec<(u16, u32)> {
        let mut out = Vec::new();
        self.events_each(|kind, object| out.push((kind, object)));
        out
    }

    /// Hands every event of ring 0 to `f` (allocating nothing).
    pub fn events_each(&mut self, mut f: impl FnMut(u16, u32)) {
        drain::<EVENT_SIZE>(&self.mem, EQ, EQ_DEPTH, &mut self.eq_consumer, |raw| {
            let e = Event::read_from_bytes(raw).expect("event");
            f(e.kind.get(), e.object.get());
        });
    }
}

/// The caps of the default test QPs: (max_send_sge, max_inline, max_recv_sge).
pub const CAPS: (u32, u32, u32) = (8, 128, 8);

impl Env {
    /// Both tenants in the normal class.
    pub fn new() -> Self {
        Self::with_classes(PriorityClass::Normal, PriorityClass::Normal)
    }

    /// A in class `a`, B in class `b`.
    pub fn with_classes(a: PriorityClass, b: PriorityClass) -> Self {
        let mut engine = Engine::new(Scheduler::new(None));
        let now = Instant::now();
        let mut side_a = Side::new(&mut engine, 1, 10, &tenant("ta", a));
        let mut side_b = Side::new(&mut engine, 2, 20, &tenant("tb", b));
        side_a.add_qp(&mut engine, 100, CAPS);
        side_b.add_qp(&mut engine, 200, CAPS);
        let mut env = Env {
            engine,
            a: side_a,
            b: side_b,
            now,
        };
        env.connect(0, 0);
        env
    }

    /// One more device (id `id`, GID `gid(n)`) on the engine, with its own
    /// data region and a QP `vqpn` in RESET.
    pub fn add_side(&mut self, id: DeviceId, n: u16, policy: &TenantPolicy, vqpn: u32) -> Side {
        let mut side = Side::new(&mut self.engine, id, n, policy);
        side.add_qp(&mut self.engine, vqpn, CAPS);
        side
    }

    /// Connects A's QP `qa` and B's QP `qb` to each other and moves both
    /// to RTS.
    pub fn connect(&mut self, qa: usize, qb: usize) {
        let (a, b) = (self.a.qps[qa].vqpn, self.b.qps[qb].vqpn);
        for (id, vqpn, n, dest) in [(1, a, 20, b), (2, b, 10, a)] {
            for state in [QpState::Init, QpState::Rtr, QpState::Rts] {
                let connection = (state != QpState::Init).then(|| connection(gid(n), dest));
                self.modify(id, vqpn, state, connection).expect("modify");
            }
        }
    }

    /// Moves device `id`'s QP `vqpn` to `state`, with `connection` (for
    /// RTR and RTS).
    pub fn modify(
        &mut self,
        id: DeviceId,
        vqpn: u32,
        state: QpState,
        connection: Option<QpConnection>,
    ) -> Result<(), EngineError> {
        let m = QpModify {
            vqpn,
            state: state.into(),
            connection,
            access: None,
            qkey: None,
        };
        self.engine.modify_qp(id, &m)
    }

    /// Runs rounds over both devices until one does nothing; returns the
    /// CQEs of A and of B.
    pub fn run(&mut self) -> (Vec<Cqe>, Vec<Cqe>) {
        for _ in 0..10_000 {
            let round = self.engine.round(&[1, 2], self.now);
            if !round.worked && !round.busy {
                break;
            }
        }
        (self.a.poll(), self.b.poll())
    }

    /// Advances the clock, then runs.
    pub fn advance(&mut self, by: Duration) -> (Vec<Cqe>, Vec<Cqe>) {
        self.now += by;
        self.run()
    }
}

impl Default for Env {
    fn default() -> Self {
        Self::new()
    }
}
