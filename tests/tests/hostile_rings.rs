//! A hostile guest writes what it likes into its own work rings: garbage
//! WQEs (random opcodes, flags, SGE counts, inline lengths, keys and
//! addresses), another tenant's rkey, producer indices beyond the ring.
//! The guest driver never writes such rings, so this test plays the VMM
//! (`vrdma_tests::vmm`) and the driver, and writes the rings, the
//! doorbell page and the doorbell kicks by hand, against a real vdev and
//! hostd, whose WQE reader takes them (device spec §6.8). The fuzz
//! targets drive the same reader in-process; this is the end-to-end wall:
//! whatever the rings hold, no byte outside the guest's own memory regions
//! changes, the other tenant's memory stays as it was, every completion is
//! one the guest asked for (once), a broken ring is reported with a
//! QP_FATAL event, and vdev and hostd go on serving.
//!
//! The rounds are random: a failing run prints its seed, and
//! `VRDMA_CHAOS_SEED=<seed>` replays it.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, VolatileMemory};
use vrdma_spec::config::DeviceAttr;
use vrdma_spec::control::*;
use vrdma_spec::ring::{
    self, doorbell, event_kind, send_flags, Cqe, Event, RecvWqe, SendWqe, Sge, WorkRingGeometry,
    DEVICE_INDEX_OFFSET, DRIVER_INDEX_OFFSET, RING_HEADER_SIZE, SGE_SIZE,
};
use vrdma_spec::verbs::{access, QpState, SendOpcode, WcStatus};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};
use vrdma_tests::daemon::{Hostd, Vdev};
use vrdma_tests::rng::{env_number, seed_from_env, Rng};
use vrdma_tests::vmm::{self, alloc_pd, cq_req, qp_req, reg, Vmm, FREE, GUEST_BASE};
use vrdma_tools::verbs::{transitions, Connection};

/// The guest's memory region: [`FREE`, `FREE + MR_LEN`).
const MR_LEN: u64 = 1 << 20;
/// Guest memory no memory region covers, on both sides of the MR: nothing
/// may write it.
const CANARY_BELOW: u64 = FREE - 0x10000;
const CANARY_ABOVE: u64 = FREE + MR_LEN;
const CANARY_LEN: u64 = 0x10000;
const CQ_RING: u64 = FREE + (2 << 20);
const CQ_DEPTH: u32 = 256;
/// The rings of the round's two QPs, 64 KiB apart.
const QP_RINGS: u64 = FREE + (3 << 20);
/// Where the doorbell queue's and the first event queue's (unused)
/// descriptor rings live.
const DOORBELL_RING: u64 = GUEST_BASE + 0x20000;
const EVENT_QUEUE_RING: u64 = GUEST_BASE + 0x30000;
/// The device's doorbell page, and the event ring of vector 0.
const DOORBELL_PAGE: u64 = FREE + (4 << 20);
const EVENT_RING: u64 = FREE + (5 << 20);
const EVENT_DEPTH: u32 = 64;
/// The victim tenant's memory region, which only its own QPs may write.
const VICTIM_MR: u64 = FREE;
const VICTIM_LEN: u64 = 0x10000;

/// Work requests each way of the round's QPs.
const DEPTH: u32 = 8;
const SGES: u32 = 4;
const INLINE: u32 = 64;
const SEND_WQE: usize = std::mem::size_of::<SendWqe>();
const RECV_WQE: usize = std::mem::size_of::<RecvWqe>();

fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read(vmm: &Vmm, addr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    vmm.mem
        .read_slice(&mut out, GuestAddress(addr))
        .expect("guest memory");
    out
}

/// One RC QP of the attacker, with its rings and its doorbell bit.
#[derive(Debug, Clone, Copy)]
struct Qp {
    qpn: u32,
    db_index: u32,
    sq: u64,
    rq: u64,
    sq_geometry: WorkRingGeometry,
    rq_geometry: WorkRingGeometry,
}

impl Qp {
    fn create(vmm: &mut Vmm, pdn: u32, cqn: u32, rings: u64) -> Qp {
        let (sq, rq) = (rings, rings + 0x8000);
        vmm.mem
            .write_slice(&[0u8; 0x10000], GuestAddress(rings))
            .expect("clear rings");
        let req = CreateQpReq {
            cap: QpCap {
                max_send_wr: DEPTH.into(),
                max_recv_wr: DEPTH.into(),
                max_send_sge: SGES.into(),
                max_recv_sge: SGES.into(),
                max_inline_data: INLINE.into(),
            },
            ..qp_req(pdn, cqn, sq, rq)
        };
        let resp: CreateQpResp = vmm.ok(Opcode::CreateQp, req.as_bytes());
        let cap = resp.cap;
        let sq_geometry = ring::sq_geometry(
            cap.max_send_wr.get(),
            cap.max_send_sge.get(),
            cap.max_inline_data.get(),
        )
        .expect("granted SQ geometry");
        let rq_geometry = ring::rq_geometry(cap.max_recv_wr.get(), cap.max_recv_sge.get())
            .expect("granted RQ geometry");
        assert!(sq_geometry.ring_bytes() <= 0x8000 && rq_geometry.ring_bytes() <= 0x8000);
        Qp {
            qpn: resp.qpn.get(),
            db_index: resp.db_index.get(),
            sq,
            rq,
            sq_geometry,
            rq_geometry,
        }
    }

    fn modify(&self, vmm: &mut Vmm, attr_mask: u32, attr: QpAttr) {
        let req = vmm::modify_req(self.qpn, attr_mask, attr);
        let errno = vmm.errno(Opcode::ModifyQp, req.as_bytes());
        assert_eq!(errno, 0, "modify_qp to {}", attr.qp_state);
    }

    /// INIT → RTR → RTS towards QP `dest_qpn` at GID `dgid`, with
    /// every remote access, and one RNR retry so that a SEND without a
    /// receive ends.
    fn connect(&self, vmm: &mut Vmm, dgid: [u8; 16], dest_qpn: u32) {
        let how = Connection {
            access: access::QP_SUPPORTED,
            rnr_retry: 1,
            min_rnr_timer: 1,
            timeout: 1,
            retry_cnt: 1,
            rd_atomic: 1,
        };
        for (attr, attr_mask) in transitions(dest_qpn, dgid, how) {
            self.modify(vmm, attr_mask, attr);
        }
    }

    fn state(&self, vmm: &mut Vmm) -> u8 {
        let q: QueryQpResp = vmm.ok(
            Opcode::QueryQp,
            QueryQpReq {
                qpn: self.qpn.into(),
                attr_mask: 0.into(),
            }
            .as_bytes(),
        );
        q.attr.qp_state
    }

    fn destroy(&self, vmm: &mut Vmm) {
        let handle = QpHandle {
            qpn: self.qpn.into(),
            reserved: 0.into(),
        };
        let errno = vmm.errno(Opcode::DestroyQp, handle.as_bytes());
        assert_eq!(errno, 0, "destroy_qp {}", self.qpn);
    }
}

/// Writes `slots` into the ring at `ring` (from index 0) and publishes
/// `producer` with release ordering.
fn publish(vmm: &Vmm, ring: u64, geometry: WorkRingGeometry, slots: &[Vec<u8>], producer: u32) {
    for (i, slot) in slots.iter().enumerate() {
        let at = ring
            + RING_HEADER_SIZE as u64
            + (i as u64 & u64::from(geometry.depth - 1)) * u64::from(geometry.stride);
        vmm.mem.write_slice(slot, GuestAddress(at)).expect("slot");
    }
    vmm.mem
        .store(
            producer,
            GuestAddress(ring + DRIVER_INDEX_OFFSET),
            Ordering::Release,
        )
        .expect("producer index");
}

/// The device's index of a ring: WQEs completed (SQ, RQ), entries
/// produced (CQ, event ring).
fn device_index(vmm: &Vmm, ring: u64) -> u32 {
    vmm.mem
        .load(GuestAddress(ring + DEVICE_INDEX_OFFSET), Ordering::Acquire)
        .expect("device index")
}

/// `f` of the atomic `T` of guest memory at `addr`.
fn atomic<T: vm_memory::AtomicInteger, R>(vmm: &Vmm, addr: u64, f: impl FnOnce(&T) -> R) -> R {
    let slice = vmm
        .mem
        .get_slice(GuestAddress(addr), std::mem::size_of::<T>());
    let slice = slice.expect("in guest memory");
    f(slice.get_atomic_ref::<T>(0).expect("aligned"))
}

/// The driver's side of the doorbell after publishing a ring of QP `qp`
/// (device spec §6.6): its bit in the bitmap, its word's bit in the
/// summary, then, if the device sleeps (NEED_KICK), a kick of the doorbell
/// queue. Returns whether it kicked.
fn ring_doorbell(vmm: &Vmm, qp: &Qp, kick: &vmm_sys_util::eventfd::EventFd) -> bool {
    let bit = doorbell::bit(qp.db_index).expect("db_index below MAX_QPS");
    let set = |offset, mask: u64| {
        atomic(vmm, DOORBELL_PAGE + offset, |w: &AtomicU64| {
            w.fetch_or(mask.to_le(), Ordering::SeqCst)
        })
    };
    set(bit.word_offset, bit.mask);
    set(bit.summary_offset, bit.summary_mask);
    let flags = atomic(
        vmm,
        DOORBELL_PAGE + doorbell::FLAGS_OFFSET,
        |f: &AtomicU32| u32::from_le(f.load(Ordering::SeqCst)),
    );
    let sleeping = flags & doorbell::NEED_KICK != 0;
    if sleeping {
        kick.write(1).expect("doorbell kick");
    }
    sleeping
}

/// What the attacker knows: its own keys, and the victim's rkey (a real
/// attacker would guess it; here it gets it for free).
#[derive(Debug, Clone, Copy)]
struct Keys {
    lkey: u32,
    rkey: u32,
    victim_rkey: u32,
}

/// A range of `len` bytes in `base..base + size`, or (one time in four)
/// across one of its edges by a few bytes: the boundary checks' cases.
fn range_near(rng: &mut Rng, base: u64, size: u64, len: u64) -> u64 {
    match rng.below(8) {
        0 => base.wrapping_sub(1 + rng.below(64)),
        1 => base + size - len + 1 + rng.below(64),
        _ => base + rng.below(size - len + 1),
    }
}

/// Overwrites a few random bytes of `slot` (a field or two of a WQE or
/// an SGE), or all of it.
fn corrupt(rng: &mut Rng, slot: &mut [u8]) {
    match rng.below(6) {
        0 => rng.fill(slot),
        1..=3 => {
            for _ in 0..1 + rng.below(3) {
                let at = rng.below(slot.len() as u64) as usize;
                let n = (1 + rng.below(8) as usize).min(slot.len() - at);
                rng.fill(&mut slot[at..at + n]);
            }
        }
        _ => {}
    }
}

/// Well-formed SGEs over the guest's MR (some across its edges), `total`
/// bytes in all, at `at` in `slot`.
fn sges(rng: &mut Rng, slot: &mut [u8], at: usize, count: usize, total: u64, lkey: u32) {
    if count == 0 {
        return;
    }
    let each = (total / count as u64).max(1);
    for i in 0..count {
        let sge = Sge {
            addr: range_near(rng, FREE, MR_LEN, each).into(),
            length: (each as u32).into(),
            lkey: lkey.into(),
        };
        let at = at + i * SGE_SIZE;
        slot[at..at + SGE_SIZE].copy_from_slice(sge.as_bytes());
    }
}

/// A send slot that is nearly right: a known opcode with SGEs or inline
/// data over the guest's own MR and a remote range in its own MR or the
/// victim's (some across an edge), then a few bytes of it overwritten, or
/// all of it.
fn garbage_send(rng: &mut Rng, stride: u32, keys: Keys, wr_id: u64) -> Vec<u8> {
    let mut slot = rng.bytes(stride as usize);
    let opcode = rng.below(7) as u8;
    let atomic = opcode >= u8::from(SendOpcode::AtomicCmpAndSwp);
    let len = if atomic { 8 } else { 1 + rng.below(2048) };
    let inline = !atomic && opcode != u8::from(SendOpcode::RdmaRead) && rng.chance(4);
    let (rkey, base, size) = match rng.below(3) {
        0 => (keys.victim_rkey, VICTIM_MR, VICTIM_LEN),
        _ => (keys.rkey, FREE, MR_LEN),
    };
    let mut remote = range_near(rng, base, size, len);
    if atomic {
        remote &= !7;
    }
    let num_sge = if inline {
        0
    } else {
        1 + rng.below(u64::from(SGES))
    };
    let wqe = SendWqe {
        wr_id: wr_id.into(),
        opcode,
        flags: (rng.next_u64() as u8 & (send_flags::SIGNALED | send_flags::SOLICITED))
            | if inline { send_flags::INLINE } else { 0 },
        num_sge: num_sge as u8,
        inline_len: (if inline {
            len.min(u64::from(INLINE))
        } else {
            0
        } as u32)
            .into(),
        rkey: rkey.into(),
        remote_addr: remote.into(),
        compare_add: rng.next_u64().into(),
        swap: rng.next_u64().into(),
        ..SendWqe::default()
    };
    slot[..SEND_WQE].copy_from_slice(wqe.as_bytes());
    sges(rng, &mut slot, SEND_WQE, num_sge as usize, len, keys.lkey);
    corrupt(rng, &mut slot);
    // The wr_id stays the test's, to tell completions apart.
    slot[..8].copy_from_slice(&wr_id.to_le_bytes());
    slot
}

/// A receive slot built and damaged the same way.
fn garbage_recv(rng: &mut Rng, stride: u32, keys: Keys, wr_id: u64) -> Vec<u8> {
    let mut slot = rng.bytes(stride as usize);
    let num_sge = 1 + rng.below(u64::from(SGES));
    let wqe = RecvWqe {
        wr_id: wr_id.into(),
        num_sge: num_sge as u8,
        ..RecvWqe::default()
    };
    slot[..RECV_WQE].copy_from_slice(wqe.as_bytes());
    let len = 1 + rng.below(4096);
    sges(rng, &mut slot, RECV_WQE, num_sge as usize, len, keys.lkey);
    corrupt(rng, &mut slot);
    slot[..8].copy_from_slice(&wr_id.to_le_bytes());
    slot
}

/// A well-formed signaled WQE with one SGE over the guest's own MR.
fn well_formed(
    opcode: SendOpcode,
    wr_id: u64,
    local: Sge,
    rkey: u32,
    remote: u64,
    stride: u32,
) -> Vec<u8> {
    let wqe = SendWqe {
        wr_id: wr_id.into(),
        opcode: opcode.into(),
        flags: send_flags::SIGNALED,
        num_sge: 1,
        rkey: rkey.into(),
        remote_addr: remote.into(),
        compare_add: 1.into(),
        ..SendWqe::default()
    };
    let mut slot = vec![0u8; stride as usize];
    slot[..SEND_WQE].copy_from_slice(wqe.as_bytes());
    slot[SEND_WQE..SEND_WQE + SGE_SIZE].copy_from_slice(local.as_bytes());
    slot
}

/// A ring the device produces into (the CQ, an event ring), read the way
/// a driver reads it.
struct Consumer {
    ring: u64,
    depth: u32,
    consumer: u32,
}

impl Consumer {
    /// Every entry produced since the last call; the slots are given back.
    fn drain<T: FromBytes>(&mut self, vmm: &Vmm) -> Vec<T> {
        let producer = device_index(vmm, self.ring);
        let size = std::mem::size_of::<T>() as u64;
        let mut out = Vec::new();
        while self.consumer != producer {
            let slot = u64::from(self.consumer & (self.depth - 1));
            let bytes = read(vmm, self.ring + RING_HEADER_SIZE as u64 + slot * size, size);
            out.push(T::read_from_bytes(&bytes).expect("entry size"));
            self.consumer = self.consumer.wrapping_add(1);
        }
        vmm.mem
            .store(
                self.consumer,
                GuestAddress(self.ring + DRIVER_INDEX_OFFSET),
                Ordering::Release,
            )
            .expect("consumer index");
        out
    }
}

/// The attacker's completion queue.
struct Completions {
    cqn: u32,
    ring: Consumer,
}

impl Completions {
    fn drain(&mut self, vmm: &Vmm) -> Vec<Cqe> {
        self.ring.drain(vmm)
    }

    /// Waits up to 5 s for the completion of `wr_id`.
    fn wait_for(&mut self, vmm: &Vmm, wr_id: u64, seen: &mut Vec<Cqe>) -> Cqe {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            seen.extend(self.drain(vmm));
            if let Some(cqe) = seen.iter().find(|c| c.wr_id.get() == wr_id) {
                return *cqe;
            }
            assert!(
                Instant::now() < deadline,
                "no completion for wr_id {wr_id:#x}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The doorbell virtqueue (its kick is hostd's), the doorbell page, the
/// first event virtqueue (its call is hostd's interrupt) and event ring 0,
/// given as a driver gives them before its first QP.
fn doorbell_and_events(vmm: &mut Vmm) -> (vmm::RawQueue, vmm::RawQueue) {
    let doorbell = vmm.queue(vrdma_spec::DOORBELL_QUEUE, DOORBELL_RING);
    let events = vmm.queue(vrdma_spec::FIRST_EVENT_QUEUE, EVENT_QUEUE_RING);
    for page in [DOORBELL_PAGE, EVENT_RING] {
        vmm.mem
            .write_slice(&[0u8; 0x1000], GuestAddress(page))
            .expect("clear");
    }
    let page = vmm::doorbell_req(DOORBELL_PAGE);
    assert_eq!(vmm.errno(Opcode::SetDoorbell, page.as_bytes()), 0);
    let eq = vmm::eq_req(0, EVENT_DEPTH, EVENT_RING);
    assert_eq!(vmm.errno(Opcode::CreateEq, eq.as_bytes()), 0);
    (doorbell, events)
}

/// The events of `ring`: (kind, object), waiting up to 1 s for `n` of
/// them, then 10 ms for any more.
fn wait_events(vmm: &Vmm, ring: &mut Consumer, n: usize) -> Vec<(u16, u32)> {
    let mut out = Vec::new();
    let mut take = |ring: &mut Consumer| {
        let got: Vec<Event> = ring.drain(vmm);
        out.extend(got.iter().map(|e| (e.kind.get(), e.object.get())));
        out.len()
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    while take(ring) < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(10));
    take(ring);
    out
}

#[test]
fn garbage_in_a_guests_own_rings_reaches_nothing_beyond_its_memory_regions() {
    let seed = seed_from_env();
    let rounds = env_number("VRDMA_HOSTILE_RING_ROUNDS").unwrap_or(300);
    println!("hostile rings: seed {seed:#x} (VRDMA_CHAOS_SEED replays), {rounds} rounds");
    let mut rng = Rng(seed);

    let hostd = Hostd::start(None);
    let mut attacker_vdev = Vdev::on_hostd(&hostd, "alpha", &[]);
    let mut victim_vdev = Vdev::on_hostd(&hostd, "beta", &[]);
    let mut vmm = Vmm::attach(&attacker_vdev.socket);
    let mut victim = Vmm::attach(&victim_vdev.socket);

    // The victim: one MR, written by nobody else.
    let victim_pdn = alloc_pd(&mut victim);
    let victim_bytes = pattern(0x5a, VICTIM_LEN);
    victim
        .mem
        .write_slice(&victim_bytes, GuestAddress(VICTIM_MR))
        .expect("victim pattern");
    let all = access::LOCAL_WRITE | access::QP_SUPPORTED;
    let victim_mr: RegMrResp = victim.ok(
        Opcode::RegMr,
        reg(victim_pdn, VICTIM_MR, VICTIM_LEN, all).as_bytes(),
    );
    let victim_usage = hostd.usage("beta");

    // The attacker: an MR between two canaries, a CQ, and a doorbell.
    let pdn = alloc_pd(&mut vmm);
    let below = pattern(0xa5, CANARY_LEN);
    let above = pattern(0x3c, CANARY_LEN);
    vmm.mem
        .write_slice(&below, GuestAddress(CANARY_BELOW))
        .expect("canary");
    vmm.mem
        .write_slice(&above, GuestAddress(CANARY_ABOVE))
        .expect("canary");
    let mr: RegMrResp = vmm.ok(Opcode::RegMr, reg(pdn, FREE, MR_LEN, all).as_bytes());
    vmm.mem
        .write_slice(&[0u8; 0x3000], GuestAddress(CQ_RING))
        .expect("clear CQ ring");
    let cq: CqHandle = vmm.ok(Opcode::CreateCq, cq_req(CQ_RING, CQ_DEPTH).as_bytes());
    let mut cq = Completions {
        cqn: cq.cqn.get(),
        ring: Consumer {
            ring: CQ_RING,
            depth: CQ_DEPTH,
            consumer: 0,
        },
    };
    let (doorbell, _event_queue) = doorbell_and_events(&mut vmm);
    let mut events = Consumer {
        ring: EVENT_RING,
        depth: EVENT_DEPTH,
        consumer: 0,
    };
    let mut kicks = 0;
    let gid = vmm.config.gid;
    let keys = Keys {
        lkey: mr.lkey.get(),
        rkey: mr.rkey.get(),
        victim_rkey: victim_mr.rkey.get(),
    };

    let mut posted: HashSet<u64> = HashSet::new();
    let mut qpns: HashSet<u32> = HashSet::new();
    let mut statuses: BTreeMap<u8, usize> = BTreeMap::new();
    let mut bad_indices = 0;
    for round in 0..rounds {
        let a = Qp::create(&mut vmm, pdn, cq.cqn, QP_RINGS);
        let b = Qp::create(&mut vmm, pdn, cq.cqn, QP_RINGS + 0x10000);
        a.connect(&mut vmm, gid, b.qpn);
        b.connect(&mut vmm, gid, a.qpn);
        qpns.extend([a.qpn, b.qpn]);
        let wr_id = |side: u64, i: u64| (side << 63) | (round << 8) | i;
        let stride = a.sq_geometry.stride;
        let mut seen = Vec::new();
        match round % 4 {
            // A well-formed operation on the victim's memory, with the
            // victim's rkey: the responder refuses it.
            0 => {
                let ops = [
                    SendOpcode::RdmaWrite,
                    SendOpcode::RdmaRead,
                    SendOpcode::AtomicCmpAndSwp,
                    SendOpcode::AtomicFetchAndAdd,
                ];
                let op = ops[(round / 4) as usize % ops.len()];
                let remote = VICTIM_MR + 8 * rng.below(VICTIM_LEN / 8);
                let local = Sge {
                    addr: FREE.into(),
                    length: 8.into(),
                    lkey: keys.lkey.into(),
                };
                let slot = well_formed(op, wr_id(0, 0), local, keys.victim_rkey, remote, stride);
                posted.insert(wr_id(0, 0));
                publish(&vmm, a.sq, a.sq_geometry, &[slot], 1);
                kicks += u32::from(ring_doorbell(&vmm, &a, &doorbell.kick));
                let cqe = cq.wait_for(&vmm, wr_id(0, 0), &mut seen);
                assert_eq!(
                    (cqe.status, cqe.qp_num.get()),
                    (u8::from(WcStatus::RemAccessErr), a.qpn),
                    "round {round}: {op:?} with the victim's rkey"
                );
            }
            // A well-formed WRITE inside the guest's own MR still works
            // after everything before it.
            1 if round % 8 == 1 => {
                let data = rng.bytes(256);
                let (src, dst) = (FREE + 0x1000, FREE + 0x80000);
                vmm.mem
                    .write_slice(&data, GuestAddress(src))
                    .expect("source");
                let local = Sge {
                    addr: src.into(),
                    length: 256.into(),
                    lkey: keys.lkey.into(),
                };
                let slot = well_formed(
                    SendOpcode::RdmaWrite,
                    wr_id(0, 0),
                    local,
                    keys.rkey,
                    dst,
                    stride,
                );
                posted.insert(wr_id(0, 0));
                publish(&vmm, a.sq, a.sq_geometry, &[slot], 1);
                kicks += u32::from(ring_doorbell(&vmm, &a, &doorbell.kick));
                let cqe = cq.wait_for(&vmm, wr_id(0, 0), &mut seen);
                assert_eq!(
                    cqe.status,
                    u8::from(WcStatus::Success),
                    "round {round}: a valid WRITE"
                );
                assert_eq!(read(&vmm, dst, 256), data, "round {round}: WRITE landed");
            }
            // Garbage: receives on B, sends on A, and now and then a
            // producer index beyond the ring.
            _ => {
                let recvs: Vec<Vec<u8>> = (0..rng.below(u64::from(DEPTH) + 1))
                    .map(|i| garbage_recv(&mut rng, b.rq_geometry.stride, keys, wr_id(1, i)))
                    .collect();
                let sends: Vec<Vec<u8>> = (1..=rng.below(u64::from(DEPTH)) + 1)
                    .map(|i| garbage_send(&mut rng, stride, keys, wr_id(0, i)))
                    .collect();
                posted.extend((0..recvs.len() as u64).map(|i| wr_id(1, i)));
                posted.extend((1..=sends.len() as u64).map(|i| wr_id(0, i)));
                publish(&vmm, b.rq, b.rq_geometry, &recvs, recvs.len() as u32);
                kicks += u32::from(ring_doorbell(&vmm, &b, &doorbell.kick));
                let bad_index = rng.chance(8);
                let producer = if bad_index {
                    bad_indices += 1;
                    a.sq_geometry.depth + 1 + rng.below(u64::from(u32::MAX - DEPTH)) as u32
                } else {
                    sends.len() as u32
                };
                publish(&vmm, a.sq, a.sq_geometry, &sends, producer);
                kicks += u32::from(ring_doorbell(&vmm, &a, &doorbell.kick));
                // hostd completes (or flushes) every send WQE, freeing its
                // slot; an index beyond the ring fails the QP instead. B's
                // receives complete only when a SEND takes them.
                let deadline = Instant::now() + Duration::from_secs(5);
                loop {
                    let done = if bad_index {
                        a.state(&mut vmm) == u8::from(QpState::Err)
                    } else {
                        device_index(&vmm, a.sq) == producer
                    };
                    if done {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "round {round}: hostd did not complete the WQEs"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                // A broken ring is reported on event ring 0 (once), and
                // only a broken ring is.
                let fatal = vec![(event_kind::QP_FATAL, a.qpn)];
                let reported = wait_events(&vmm, &mut events, if bad_index { 1 } else { 0 });
                let expected = if bad_index { fatal } else { Vec::new() };
                assert_eq!(reported, expected, "round {round}: events");
            }
        }
        // Destroying is final once answered: no WQE of these QPs runs after.
        a.destroy(&mut vmm);
        b.destroy(&mut vmm);
        seen.extend(cq.drain(&vmm));
        let mut ids: Vec<u64> = seen.iter().map(|c| c.wr_id.get()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(
            ids.len(),
            seen.len(),
            "round {round}: a WQE completed twice: {seen:?}"
        );
        for cqe in &seen {
            assert!(
                WcStatus::try_from(cqe.status).is_ok(),
                "round {round}: status {} of {cqe:?}",
                cqe.status
            );
            assert!(
                posted.contains(&cqe.wr_id.get()) && qpns.contains(&cqe.qp_num.get()),
                "round {round}: a completion nobody asked for: {cqe:?}"
            );
            *statuses.entry(cqe.status).or_default() += 1;
        }
        assert_eq!(
            read(&victim, VICTIM_MR, VICTIM_LEN),
            victim_bytes,
            "round {round}: the victim's memory changed"
        );
        assert!(
            read(&vmm, CANARY_BELOW, CANARY_LEN) == below
                && read(&vmm, CANARY_ABOVE, CANARY_LEN) == above,
            "round {round}: guest memory outside its MR changed"
        );
    }
    println!(
        "hostile rings: completions by status {statuses:?}, {bad_indices} indices beyond the \
         ring, {kicks} doorbell kicks"
    );

    assert!(
        attacker_vdev.is_running(),
        "attacker's vdev:\n{}",
        attacker_vdev.log()
    );
    assert!(
        victim_vdev.is_running(),
        "victim's vdev:\n{}",
        victim_vdev.log()
    );
    // Both vdevs still answer, and hostd holds nothing of the attacker's
    // QPs, and the victim's objects as they were.
    let _: DeviceAttr = vmm.ok(Opcode::QueryDevice, &[]);
    let _: DeviceAttr = victim.ok(Opcode::QueryDevice, &[]);
    assert_eq!(
        hostd.usage("alpha")["qps"],
        0,
        "the attacker's QPs are gone"
    );
    assert_eq!(hostd.usage("beta"), victim_usage, "the victim's usage");
    assert!(
        statuses.len() > 3,
        "the garbage reached few checks: {statuses:?}"
    );
}
