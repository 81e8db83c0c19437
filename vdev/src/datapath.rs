//! vdev's datapath: guest rings in, physical queues out, and back.
//!
//! One thread per device moves work between the tenant's rings in guest
//! memory and the physical QPs hostd granted:
//!
//! - send/receive rings: each WQE is copied out of guest memory once,
//!   checked against the tenant's shadows (key, PD, bounds, access) and
//!   rewritten as a [`PhysWqe`] on the physical QP its virtual QP maps to.
//!   A WQE that fails vdev's checks is not dropped — that would reorder
//!   completions — but sent with lkey 0 (never a key), so hostd completes it
//!   with a protection error in order.
//! - physical completion rings: each [`PhysCqe`] becomes a CQE in the guest
//!   CQ ring of its virtual QP; an armed CQ gets one completion event on its
//!   event queue.
//!
//! Polling is adaptive, for a machine with few cores: the thread polls
//! while there is work and for `spin` after it, then asks every producer to
//! wake it (guest rings' NEED_KICK, hostd rings' sleeping flag), checks
//! once more and sleeps on its eventfds.
//!
//! With `class_cpu_priority`, the thread's CPU priority follows the
//! tenant's priority class: where vdevs' polling threads share cores, the
//! kernel's scheduler decides whose work reaches hostd first, and it must
//! not undo what hostd's scheduler does with the policy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::entries::{cqe_marker, kind, PhysCqe, PhysWqe, MAX_PHYS_SGE};
use vrdma_hostd_protocol::shm::Ring;
use vrdma_spec::ring::{
    self, event_kind, send_flags, Cqe, Event, RecvWqe, SendWqe, Sge, CQ_ARM_NEXT, CQ_ARM_NONE,
    CQ_ARM_SOLICITED, DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR, DEVICE_FLAG_NEED_KICK,
    DEVICE_INDEX_OFFSET, DEVICE_NOTIFIED_SN_OFFSET, DRIVER_ARM_OFFSET, DRIVER_INDEX_OFFSET,
};
use vrdma_spec::verbs::{access, QpState, SendOpcode, WcStatus};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};

use vrdma_tenant_policy::PriorityClass;

use crate::fabric::Fabric;
use crate::verbs::RdmaDevice;

/// Most WQEs taken from one guest ring per pass, so one busy QP cannot
/// starve the others.
const BATCH: u32 = 64;

/// The device's vrings, captured from the vhost-user side so the datapath
/// can deliver events on the event queues.
#[derive(Default)]
pub struct SharedVrings(Mutex<Vec<VringRwLock>>);

impl SharedVrings {
    /// Keeps `vrings` (the daemon hands the same set on every event).
    pub fn capture(&self, vrings: &[VringRwLock]) {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() != vrings.len() {
            *kept = vrings.to_vec();
        }
    }

    fn get(&self) -> Vec<VringRwLock> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl std::fmt::Debug for SharedVrings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map(|v| v.len()).unwrap_or(0);
        write!(f, "SharedVrings({n})")
    }
}

/// What the datapath thread needs besides the device.
#[derive(Debug)]
pub struct DatapathContext {
    pub device: Arc<Mutex<RdmaDevice>>,
    pub mem: Arc<Mutex<Option<GuestMemoryAtomic<GuestMemoryMmap>>>>,
    pub vrings: Arc<SharedVrings>,
    pub fabric: Arc<Fabric>,
    /// Written by the vhost-user side on doorbells and new event buffers.
    pub wake: Arc<EventFd>,
    pub stop: Arc<AtomicBool>,
    /// How long to keep polling after the last work.
    pub spin: Duration,
    /// Whether the thread's niceness follows the tenant's class.
    pub class_cpu_priority: bool,
}

/// Runs the datapath until `ctx.stop` is set (and `ctx.wake` written).
pub fn run(ctx: DatapathContext) {
    let tenant = ctx
        .device
        .lock()
        .map(|d| d.tenant().to_owned())
        .unwrap_or_default();
    let epoll = match setup_epoll(&ctx) {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(tenant, error = %e, "Datapath cannot wait for events; stopped");
            return;
        }
    };
    let mut last_work = Instant::now();
    let mut class = None;
    while !ctx.stop.load(Ordering::Acquire) {
        if ctx.class_cpu_priority {
            let now_class = ctx.fabric.priority_class();
            if class != Some(now_class) {
                class = Some(now_class);
                set_cpu_priority(&tenant, now_class);
            }
        }
        let work = pass(&ctx, false);
        if work > 0 {
            last_work = Instant::now();
            continue;
        }
        if last_work.elapsed() < ctx.spin {
            std::thread::yield_now();
            continue;
        }
        // Going to sleep: ask every producer for a wake-up, then look once
        // more so that nothing published before the request is missed.
        if pass(&ctx, true) > 0 {
            last_work = Instant::now();
            continue;
        }
        let mut events = [EpollEvent::default(); 4];
        let _ = epoll.wait(100, &mut events);
        let _ = ctx.wake.read();
        let _ = ctx.fabric.completions.read();
        pass_wake(&ctx);
        last_work = Instant::now();
    }
    tracing::debug!(tenant, "Datapath stopped");
}

/// Niceness of the datapath thread per class. Realtime keeps the default:
/// an unprivileged vdev cannot go below it, and it need not — the classes
/// below it step aside.
pub fn nice_of(class: PriorityClass) -> i32 {
    match class {
        PriorityClass::Realtime => 0,
        PriorityClass::Priority => 5,
        PriorityClass::Normal => 10,
    }
}

/// Gives the calling thread the CPU priority of `class`.
fn set_cpu_priority(tenant: &str, class: PriorityClass) {
    let nice = nice_of(class);
    // SAFETY: setpriority takes no pointers; PRIO_PROCESS with who = 0 is
    // the calling thread (the nice value is per thread on Linux).
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    if rc == 0 {
        tracing::debug!(tenant, ?class, nice, "Datapath CPU priority set");
    } else {
        // Raising it back needs RLIMIT_NICE, which a container may forbid.
        tracing::warn!(
            tenant,
            ?class,
            nice,
            error = %std::io::Error::last_os_error(),
            "Cannot raise the datapath's CPU priority (RLIMIT_NICE); it follows at the next vdev start"
        );
    }
}

fn setup_epoll(ctx: &DatapathContext) -> std::io::Result<Epoll> {
    use std::os::fd::AsRawFd;
    let epoll = Epoll::new()?;
    for fd in [ctx.wake.as_raw_fd(), ctx.fabric.completions.as_raw_fd()] {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, fd as u64),
        )?;
    }
    Ok(epoll)
}

/// One pass over every ring. With `arm`, also asks producers to wake us.
fn pass(ctx: &DatapathContext, arm: bool) -> usize {
    let Some(mem) = ctx
        .mem
        .lock()
        .ok()
        .and_then(|m| m.as_ref().map(|a| a.memory()))
    else {
        return 0;
    };
    let Ok(mut dev) = ctx.device.lock() else {
        return 0;
    };
    let vrings = ctx.vrings.get();
    let mut work = dev.drain_completions(&mem, &ctx.fabric, &vrings, arm);
    work += dev.drain_work_rings(&mem, &ctx.fabric, arm);
    work
}

/// After waking: clear the wake-up requests (they cost the producers).
fn pass_wake(ctx: &DatapathContext) {
    let Some(mem) = ctx
        .mem
        .lock()
        .ok()
        .and_then(|m| m.as_ref().map(|a| a.memory()))
    else {
        return;
    };
    if let Ok(mut dev) = ctx.device.lock() {
        dev.set_need_kick(&mem, &ctx.fabric, false);
    }
}

impl RdmaDevice {
    /// Moves WQEs from the guest's send/receive rings to the physical QPs.
    fn drain_work_rings(&mut self, mem: &GuestMemoryMmap, fabric: &Fabric, arm: bool) -> usize {
        if arm {
            self.set_need_kick(mem, fabric, true);
        }
        let mut moved = 0;
        let qpns: Vec<u32> = self.qps_iter().map(|qp| qp.qpn).collect();
        for qpn in qpns {
            moved += self.drain_qp(mem, fabric, qpn, true);
            moved += self.drain_qp(mem, fabric, qpn, false);
        }
        moved
    }

    /// Sets or clears NEED_KICK on every ring the datapath serves, and the
    /// sleeping flag on the physical completion rings.
    fn set_need_kick(&mut self, mem: &GuestMemoryMmap, fabric: &Fabric, sleeping: bool) {
        for qp in self.qps_iter() {
            for (addr, _) in [qp.sq, qp.rq] {
                let flags_addr = GuestAddress(addr + DEVICE_FLAGS_OFFSET);
                let flags: u32 = mem.load(flags_addr, Ordering::Relaxed).unwrap_or(0);
                let flags = if sleeping {
                    flags | DEVICE_FLAG_NEED_KICK
                } else {
                    flags & !DEVICE_FLAG_NEED_KICK
                };
                let _ = mem.store(flags, flags_addr, Ordering::Relaxed);
            }
        }
        for queue in &fabric.queues {
            if let Some(cq) = Ring::<PhysCqe>::new(&queue.mem, queue.layout.cq) {
                cq.prepare_sleep(sleeping);
            }
        }
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Moves up to [`BATCH`] WQEs of one ring of one QP; returns how many.
    fn drain_qp(&mut self, mem: &GuestMemoryMmap, fabric: &Fabric, qpn: u32, send: bool) -> usize {
        let Some(qp) = self.qp(qpn) else { return 0 };
        let runs = if send {
            matches!(qp.state, QpState::Rts | QpState::Err | QpState::Sqe)
        } else {
            matches!(
                qp.state,
                QpState::Init
                    | QpState::Rtr
                    | QpState::Rts
                    | QpState::Sqd
                    | QpState::Err
                    | QpState::Sqe
            )
        };
        if !runs {
            return 0;
        }
        let (ring_addr, geometry) = if send { qp.sq } else { qp.rq };
        let consumer = if send { qp.sq_consumer } else { qp.rq_consumer };
        let pqp = fabric.pqp_index_for(qpn);
        let Some(queue) = fabric.queues.get(pqp) else {
            return 0;
        };
        let Some(sq) = Ring::<PhysWqe>::new(&queue.mem, queue.layout.sq) else {
            return 0;
        };
        let producer: u32 = match mem.load(
            GuestAddress(ring_addr + DRIVER_INDEX_OFFSET),
            Ordering::Acquire,
        ) {
            Ok(p) => p,
            Err(_) => return 0,
        };
        let pending = producer.wrapping_sub(consumer);
        if pending > geometry.depth {
            tracing::warn!(tenant = %self.tenant(), qpn, producer, consumer,
                "Guest ring index beyond the ring; QP moved to error");
            self.fail_qp(mem, fabric, qpn);
            return 0;
        }
        let mut moved = 0;
        let mut index = consumer;
        while index != producer && moved < BATCH {
            let slot = ring_addr
                + ring::RING_HEADER_SIZE as u64
                + u64::from(index & (geometry.depth - 1)) * u64::from(geometry.stride);
            let mut bytes = vec![0u8; geometry.stride as usize];
            if mem.read_slice(&mut bytes, GuestAddress(slot)).is_err() {
                self.fail_qp(mem, fabric, qpn);
                return moved as usize;
            }
            let wqe = if send {
                self.translate_send(qpn, &bytes)
            } else {
                self.translate_recv(qpn, &bytes)
            };
            match sq.push(&wqe) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::error!(tenant = %self.tenant(), error = %e, "Physical queue corrupt");
                    break;
                }
            }
            index = index.wrapping_add(1);
            moved += 1;
        }
        if moved > 0 {
            if let Some(qp) = self.qp_mut(qpn) {
                if send {
                    qp.sq_consumer = index;
                } else {
                    qp.rq_consumer = index;
                }
            }
            let _ = mem.store(
                index,
                GuestAddress(ring_addr + DEVICE_INDEX_OFFSET),
                Ordering::Release,
            );
            if sq.consumer_sleeping() {
                let _ = fabric.doorbell.write(1);
            }
        }
        moved as usize
    }

    /// Translates one guest WQE ring slot (`bytes`) of QP `qpn` as the
    /// datapath does — a send WQE when `send`, else a receive WQE — without
    /// touching rings. Only for the fuzz targets and property tests of
    /// `vrdma-fuzz-checks`, which must drive the real translation; not an
    /// API.
    #[doc(hidden)]
    pub fn translate_wqe_for_fuzzing(&self, qpn: u32, send: bool, bytes: &[u8]) -> PhysWqe {
        if send {
            self.translate_send(qpn, bytes)
        } else {
            self.translate_recv(qpn, bytes)
        }
    }

    /// A guest send WQE (`bytes`, one ring slot) as a physical WQE.
    fn translate_send(&self, qpn: u32, bytes: &[u8]) -> PhysWqe {
        let mut out = PhysWqe::default();
        let Some(qp) = self.qp(qpn) else { return out };
        out.kind = kind::SEND;
        out.vqpn = qpn.into();
        let Ok((wqe, payload)) = SendWqe::read_from_prefix(bytes) else {
            return poison(out);
        };
        out.token = wqe.wr_id;
        out.opcode = wqe.opcode;
        out.flags = wqe.flags
            & (send_flags::FENCE
                | send_flags::SIGNALED
                | send_flags::SOLICITED
                | send_flags::INLINE);
        if qp.sq_sig_all {
            out.flags |= send_flags::SIGNALED;
        }
        out.remote_addr = wqe.remote_addr;
        out.rkey = wqe.rkey;
        out.imm_data = wqe.imm_data;
        out.compare_add = wqe.compare_add;
        out.swap = wqe.swap;
        if wqe.flags & send_flags::INLINE != 0 {
            let len = wqe.inline_len.get() as usize;
            let limit = payload
                .len()
                .min(out.payload.len())
                .min(qp.cap.max_inline_data.get() as usize);
            if len > limit {
                return poison(out);
            }
            out.payload[..len].copy_from_slice(&payload[..len]);
            out.inline_len = (len as u32).into();
            return out;
        }
        // Reads and atomics write into local memory; everything else reads it.
        let local_access = match SendOpcode::try_from(wqe.opcode) {
            Ok(
                SendOpcode::RdmaRead | SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd,
            ) => access::LOCAL_WRITE,
            _ => 0,
        };
        match self.checked_sges(
            qp.pdn,
            wqe.num_sge,
            payload,
            qp.cap.max_send_sge.get(),
            local_access,
        ) {
            Some(sges) if out.set_sges(&sges) => out,
            _ => poison(out),
        }
    }

    /// A guest receive WQE (`bytes`, one ring slot) as a physical WQE.
    fn translate_recv(&self, qpn: u32, bytes: &[u8]) -> PhysWqe {
        let mut out = PhysWqe {
            kind: kind::RECV,
            vqpn: qpn.into(),
            ..PhysWqe::default()
        };
        let Some(qp) = self.qp(qpn) else { return out };
        let Ok((wqe, payload)) = RecvWqe::read_from_prefix(bytes) else {
            return poison(out);
        };
        out.token = wqe.wr_id;
        match self.checked_sges(
            qp.pdn,
            wqe.num_sge,
            payload,
            qp.cap.max_recv_sge.get(),
            access::LOCAL_WRITE,
        ) {
            Some(sges) if out.set_sges(&sges) => out,
            _ => poison(out),
        }
    }

    /// The WQE's SGEs, if each names an MR of `pd` granting `want` over its
    /// whole range (checked against the shadows; hostd checks again).
    fn checked_sges(
        &self,
        pd: u32,
        num_sge: u8,
        payload: &[u8],
        max_sge: u32,
        want: u32,
    ) -> Option<Vec<Sge>> {
        let n = usize::from(num_sge);
        if n > MAX_PHYS_SGE || n as u32 > max_sge || n * ring::SGE_SIZE > payload.len() {
            return None;
        }
        let sges = <[Sge]>::ref_from_bytes(&payload[..n * ring::SGE_SIZE]).ok()?;
        for sge in sges {
            if sge.length.get() == 0 {
                continue;
            }
            self.translate_local(
                pd,
                sge.lkey.get(),
                sge.addr.get(),
                sge.length.get().into(),
                want,
            )
            .ok()?;
        }
        Some(sges.to_vec())
    }

    /// Moves physical completions into the guest's CQ rings.
    fn drain_completions(
        &mut self,
        mem: &GuestMemoryMmap,
        fabric: &Fabric,
        vrings: &[VringRwLock],
        _arm: bool,
    ) -> usize {
        let mut moved = 0;
        for queue in &fabric.queues {
            let Some(cq) = Ring::<PhysCqe>::new(&queue.mem, queue.layout.cq) else {
                continue;
            };
            while moved < 4 * BATCH as usize {
                match cq.pop() {
                    Ok(Some(cqe)) => {
                        self.complete(mem, vrings, &cqe);
                        moved += 1;
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::error!(tenant = %self.tenant(), error = %e, "Physical completion ring corrupt");
                        break;
                    }
                }
            }
        }
        moved
    }

    /// Delivers one physical completion to its guest CQ.
    fn complete(&mut self, mem: &GuestMemoryMmap, vrings: &[VringRwLock], p: &PhysCqe) {
        let qpn = p.vqpn.get();
        let Some(qp) = self.qp(qpn) else { return };
        let status = WcStatus::try_from(p.status).unwrap_or(WcStatus::GeneralErr);
        let unsignaled = p.wc_flags & cqe_marker::UNSIGNALED != 0;
        if status != WcStatus::Success && status != WcStatus::WrFlushErr && qp.state != QpState::Err
        {
            tracing::info!(tenant = %self.tenant(), qpn, ?status, "Work completed in error; QP moved to ERR");
            self.mark_qp_error(mem, qpn);
        }
        if unsignaled && status == WcStatus::Success {
            return;
        }
        let Some(qp) = self.qp(qpn) else { return };
        let cqn = if p.kind == kind::RECV {
            qp.recv_cqn
        } else {
            qp.send_cqn
        };
        let cqe = Cqe {
            wr_id: p.token,
            status: p.status,
            opcode: p.opcode,
            wc_flags: p.wc_flags & !cqe_marker::ALL,
            reserved: 0,
            vendor_err: 0.into(),
            byte_len: p.byte_len,
            imm_data: p.imm_data,
            qp_num: qpn.into(),
            src_qp: p.src_qp,
        };
        // What wakes a CQ armed for solicited events: a solicited message or
        // an error.
        let solicited = status != WcStatus::Success || p.wc_flags & cqe_marker::SOLICITED != 0;
        self.write_cqe(mem, vrings, cqn, &cqe, solicited);
    }

    /// Writes `cqe` into CQ `cqn` and raises its event if it is armed.
    fn write_cqe(
        &mut self,
        mem: &GuestMemoryMmap,
        vrings: &[VringRwLock],
        cqn: u32,
        cqe: &Cqe,
        solicited: bool,
    ) {
        let tenant = self.tenant().to_owned();
        let Some(cq) = self.cq_mut(cqn) else { return };
        let base = cq.ring_addr;
        let consumer: u32 = mem
            .load(GuestAddress(base + DRIVER_INDEX_OFFSET), Ordering::Acquire)
            .unwrap_or(cq.producer);
        if cq.producer.wrapping_sub(consumer) >= cq.depth {
            if !cq.overrun {
                tracing::warn!(tenant, cqn, "CQ overrun: completions lost");
                cq.overrun = true;
                let comp_vector = cq.comp_vector;
                post_event(mem, vrings, comp_vector, event_kind::CQ_ERROR, cqn);
            }
            return;
        }
        let slot = base
            + ring::RING_HEADER_SIZE as u64
            + u64::from(cq.producer & (cq.depth - 1)) * ring::CQE_SIZE as u64;
        if mem.write_slice(cqe.as_bytes(), GuestAddress(slot)).is_err() {
            return;
        }
        cq.producer = cq.producer.wrapping_add(1);
        let _ = mem.store(
            cq.producer,
            GuestAddress(base + DEVICE_INDEX_OFFSET),
            Ordering::Release,
        );
        // Arming: the driver's arm word, read after the CQE is published.
        std::sync::atomic::fence(Ordering::SeqCst);
        let arm: u32 = mem
            .load(GuestAddress(base + DRIVER_ARM_OFFSET), Ordering::Acquire)
            .unwrap_or(0);
        let (sn, kind) = (arm >> 8, arm & 0xff);
        let fire = match kind {
            CQ_ARM_NEXT => true,
            CQ_ARM_SOLICITED => solicited,
            CQ_ARM_NONE => false,
            _ => false,
        };
        if fire && sn != cq.notified_sn {
            cq.notified_sn = sn;
            let _ = mem.store(
                sn,
                GuestAddress(base + DEVICE_NOTIFIED_SN_OFFSET),
                Ordering::Release,
            );
            let comp_vector = cq.comp_vector;
            post_event(mem, vrings, comp_vector, event_kind::COMPLETION, cqn);
        }
    }

    /// The QP entered ERR on its own (an error completion or a bad ring):
    /// record it, flag its rings and tell hostd to flush.
    fn fail_qp(&mut self, mem: &GuestMemoryMmap, fabric: &Fabric, qpn: u32) {
        self.mark_qp_error(mem, qpn);
        if let Err(e) = fabric.error_qp(qpn) {
            tracing::warn!(tenant = %self.tenant(), qpn, error = %e, "hostd did not flush the QP");
        }
    }

    fn mark_qp_error(&mut self, mem: &GuestMemoryMmap, qpn: u32) {
        if let Some(qp) = self.qp_mut(qpn) {
            qp.state = QpState::Err;
            qp.attr.qp_state = QpState::Err.into();
            qp.attr.cur_qp_state = QpState::Err.into();
            for (addr, _) in [qp.sq, qp.rq] {
                let flags_addr = GuestAddress(addr + DEVICE_FLAGS_OFFSET);
                let flags: u32 = mem.load(flags_addr, Ordering::Relaxed).unwrap_or(0);
                let _ = mem.store(flags | DEVICE_FLAG_ERROR, flags_addr, Ordering::Release);
            }
        }
    }
}

/// A physical WQE that hostd must fail with a local protection error: one
/// SGE with lkey 0, which is never a key.
fn poison(mut wqe: PhysWqe) -> PhysWqe {
    wqe.flags &= !send_flags::INLINE;
    wqe.inline_len = 0.into();
    wqe.set_sges(&[Sge {
        addr: 0.into(),
        length: 1.into(),
        lkey: 0.into(),
    }]);
    wqe
}

/// Writes an event into the next buffer of event queue `comp_vector`.
fn post_event(
    mem: &GuestMemoryMmap,
    vrings: &[VringRwLock],
    comp_vector: u32,
    kind: u16,
    object: u32,
) {
    let index = usize::from(vrdma_spec::FIRST_EVENT_QUEUE) + comp_vector as usize;
    let Some(vring) = vrings.get(index) else {
        tracing::debug!(comp_vector, "Event dropped: the event queue is not set up");
        return;
    };
    let chain = vring.get_mut().get_queue_mut().pop_descriptor_chain(mem);
    let Some(chain) = chain else {
        tracing::debug!(comp_vector, "Event dropped: no event buffer posted");
        return;
    };
    let head = chain.head_index();
    let event = Event {
        kind: kind.into(),
        reserved: 0.into(),
        object: object.into(),
        reserved2: 0.into(),
    };
    let written = match virtio_queue::Writer::new(mem, chain) {
        Ok(mut w) => {
            use std::io::Write;
            if w.write_all(event.as_bytes()).is_ok() {
                event.as_bytes().len() as u32
            } else {
                0
            }
        }
        Err(_) => 0,
    };
    let _ = vring.add_used(head, written);
    if vring.needs_notification().unwrap_or(true) {
        let _ = vring.signal_used_queue();
    }
}
