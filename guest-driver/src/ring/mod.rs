//! The driver's half of the data-path rings: send/receive rings it
//! produces into and completion rings it consumes from.
//!
//! Layouts, index rules and the doorbell handshake are those of
//! [`vrdma_spec::ring`]; this module only writes and reads them. Rings live
//! in DMA memory shared with the device, so every access is a volatile copy
//! or an atomic on the ring header.

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;

use vrdma_spec::limits::{MAX_INLINE_DATA, MAX_SGE};
use vrdma_spec::ring::doorbell::{self, Bit};
pub use vrdma_spec::ring::UdDest;
use vrdma_spec::ring::{
    self as spec, send_flags, wc_flags, Cqe, RecvWqe, SendWqe, WorkRingGeometry, CQE_SIZE,
    DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR, DEVICE_INDEX_OFFSET, DRIVER_ARM_OFFSET,
    DRIVER_INDEX_OFFSET, RING_ALIGN, RING_HEADER_SIZE, SGE_SIZE,
};
use vrdma_spec::verbs::{QpType, SendOpcode, WcOpcode, WcStatus};
use zerocopy::IntoBytes;

use crate::dma::DmaBuf;
use crate::error::Error;

/// A scatter/gather element: `length` bytes at `addr` (in the IOVA space of
/// the memory region whose local key is `lkey`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// What a send work request carries.
#[derive(Debug, Clone, Copy)]
pub enum SendPayload<'a> {
    /// Gather from registered memory.
    Sges(&'a [Sge]),
    /// Copy these bytes into the WQE (`IBV_SEND_INLINE`); no lkey needed.
    Inline(&'a [u8]),
}

/// A send work request (`struct ibv_send_wr`, one of them).
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub opcode: SendOpcode,
    /// [`send_flags`] bits; `INLINE` is set from the payload.
    pub flags: u8,
    pub payload: SendPayload<'a>,
    /// Immediate data, in the order the application gives it.
    pub imm_data: [u8; 4],
    /// RDMA and atomics: the remote address and key.
    pub remote_addr: u64,
    pub rkey: u32,
    /// Atomics: compare value (CAS) or addend (FAA), and swap value (CAS).
    pub compare_add: u64,
    pub swap: u64,
}

impl<'a> SendWr<'a> {
    /// A work request with the given opcode and payload, everything else zero.
    pub fn new(wr_id: u64, opcode: SendOpcode, payload: SendPayload<'a>) -> Self {
        Self {
            wr_id,
            opcode,
            flags: 0,
            payload,
            imm_data: [0; 4],
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
        }
    }

    /// The same, sent on a UD QP to `dest` (its AH, remote QPN and Q_Key
    /// travel in the WQE's `rkey` and `remote_addr`, device spec §6.3).
    pub fn to_ud(self, dest: UdDest) -> Self {
        let mut wqe = SendWqe::default();
        dest.write(&mut wqe);
        Self {
            rkey: wqe.rkey.get(),
            remote_addr: wqe.remote_addr.get(),
            ..self
        }
    }
}

/// A receive work request (`struct ibv_recv_wr`, one of them).
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sg_list: &'a [Sge],
}

/// A work completion (`struct ibv_wc`), decoded from a CQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    /// `None` when the device reported an opcode this driver does not know
    /// (error completions need not carry a meaningful one).
    pub opcode: Option<WcOpcode>,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Immediate data, when the completion carries some.
    pub imm_data: Option<[u8; 4]>,
    pub qp_num: u32,
    pub src_qp: u32,
    /// [`wc_flags`] bits.
    pub wc_flags: u8,
    /// A UD receive's sender's LID on an InfiniBand port, else 0.
    pub slid: u16,
}

impl Default for WorkCompletion {
    fn default() -> Self {
        Self {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: None,
            vendor_err: 0,
            byte_len: 0,
            imm_data: None,
            qp_num: 0,
            src_qp: 0,
            wc_flags: 0,
            slid: 0,
        }
    }
}

impl From<&Cqe> for WorkCompletion {
    fn from(cqe: &Cqe) -> Self {
        let status = WcStatus::try_from(cqe.status).unwrap_or_else(|raw| {
            tracing::warn!(
                raw,
                "Unknown completion status, reported as a general error"
            );
            WcStatus::GeneralErr
        });
        Self {
            wr_id: cqe.wr_id.get(),
            status,
            opcode: WcOpcode::try_from(cqe.opcode).ok(),
            vendor_err: u32::from(cqe.vendor_err.get()),
            byte_len: cqe.byte_len.get(),
            imm_data: (cqe.wc_flags & wc_flags::WITH_IMM != 0).then_some(cqe.imm_data),
            qp_num: cqe.qp_num.get(),
            src_qp: cqe.src_qp.get(),
            wc_flags: cqe.wc_flags,
            slid: cqe.slid.get(),
        }
    }
}

fn to_u32(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// A send or receive ring the driver produces into.
#[derive(Debug)]
pub(crate) struct WorkRing {
    mem: DmaBuf,
    geometry: WorkRingGeometry,
    /// Next index to write (the shadow of `driver.index`).
    producer: u32,
    /// The producer index last stored in `driver.index`.
    published: u32,
    /// `device.index` as last read. The device only moves it forward, so
    /// a stale copy overstates what is outstanding, never understates it:
    /// posts read the shared word (a cache line the device's core writes)
    /// only when the copy says the ring is full.
    completed: u32,
    /// Most entries outstanding at once: the work requests the device
    /// granted, which may be fewer than the ring's power-of-two depth.
    limit: u32,
}

impl WorkRing {
    /// A ring of `geometry` in `mem`: zeroed, [`RING_ALIGN`]-aligned and at
    /// least `geometry.ring_bytes()` long (see [`WorkRing::alloc_args`]).
    pub(crate) fn new(mem: DmaBuf, geometry: WorkRingGeometry) -> Self {
        debug_assert!(mem.len() as u64 >= geometry.ring_bytes());
        debug_assert!(mem.device_addr() & (RING_ALIGN - 1) == 0);
        Self {
            mem,
            geometry,
            producer: 0,
            published: 0,
            completed: 0,
            limit: geometry.depth,
        }
    }

    /// Caps outstanding entries at `granted` (never above the depth).
    pub(crate) fn limit_to(&mut self, granted: u32) {
        self.limit = granted.clamp(1, self.geometry.depth);
    }

    /// Length and alignment of the memory a ring of `geometry` needs.
    pub(crate) fn alloc_args(geometry: WorkRingGeometry) -> Result<(usize, usize), Error> {
        let bytes = usize::try_from(geometry.ring_bytes())
            .map_err(|_| Error::InvalidArgument("ring too large"))?;
        Ok((bytes, RING_ALIGN as usize))
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.mem.device_addr()
    }

    /// Slots whose work the device has not completed (or flushed) yet, and
    /// so cannot be reused: `device.index` moves at completion. Below
    /// `limit` by the last copy of `device.index`, it is below it now.
    fn outstanding(&mut self) -> u32 {
        let used = self.producer.wrapping_sub(self.completed);
        if used < self.limit {
            return used;
        }
        let completed = self
            .mem
            .atomic_u32(DEVICE_INDEX_OFFSET as usize)
            .load(Ordering::Acquire);
        let used = self.producer.wrapping_sub(u32::from_le(completed));
        // A device index ahead of the producer is a device bug: treat the
        // ring as full rather than overwrite work in flight (and keep the
        // old copy).
        if used > self.geometry.depth {
            self.geometry.depth
        } else {
            self.completed = u32::from_le(completed);
            used
        }
    }

    fn slot_offset(&self, index: u32) -> usize {
        let slot = index & (self.geometry.depth - 1);
        RING_HEADER_SIZE + slot as usize * self.geometry.stride as usize
    }

    /// Writes one entry (via `write`) into the next slot, if there is room;
    /// the device sees it after [`WorkRing::publish`].
    fn push(&mut self, write: impl FnOnce(&DmaBuf, usize)) -> Result<(), Error> {
        if self.outstanding() >= self.limit {
            return Err(Error::QueueFull);
        }
        write(&self.mem, self.slot_offset(self.producer));
        self.producer = self.producer.wrapping_add(1);
        Ok(())
    }

    /// Makes every written entry visible to the device; returns whether
    /// there were new ones (and so the doorbell must be rung).
    pub(crate) fn publish(&mut self) -> bool {
        if self.published == self.producer {
            return false;
        }
        // Release: the slot contents are visible before the new producer.
        self.mem
            .atomic_u32(DRIVER_INDEX_OFFSET as usize)
            .store(self.producer.to_le(), Ordering::Release);
        self.published = self.producer;
        true
    }

    /// Forgets every entry written since the last [`WorkRing::publish`]:
    /// the device never saw them, and their slots are free again.
    pub(crate) fn discard_unpublished(&mut self) {
        self.producer = self.published;
    }

    /// Whether the device put the ring's object in error.
    pub(crate) fn in_error(&self) -> bool {
        let flags = self
            .mem
            .atomic_u32(DEVICE_FLAGS_OFFSET as usize)
            .load(Ordering::Acquire);
        u32::from_le(flags) & DEVICE_FLAG_ERROR != 0
    }
}

fn write_sges(mem: &DmaBuf, mut offset: usize, sges: &[Sge]) {
    for sge in sges {
        let wire = spec::Sge {
            addr: sge.addr.into(),
            length: sge.length.into(),
            lkey: sge.lkey.into(),
        };
        mem.write_at(offset, wire.as_bytes());
        offset += SGE_SIZE;
    }
}

/// A send ring with the limits it was created for.
#[derive(Debug)]
pub(crate) struct SendRing {
    pub(crate) ring: WorkRing,
    /// The QP's doorbell.
    pub(crate) doorbell: Doorbell,
    max_sge: u32,
    max_inline: u32,
    /// Its QP's type: what opcodes it may post.
    qp_type: QpType,
}

impl SendRing {
    /// A send ring on which at most `max_sge` SGEs or `max_inline` inline
    /// bytes may be posted (the grant, and never more than the format
    /// carries, whatever the device granted).
    pub(crate) fn new(ring: WorkRing, doorbell: Doorbell, max_sge: u32, max_inline: u32) -> Self {
        Self {
            ring,
            doorbell,
            max_sge: max_sge.min(MAX_SGE),
            max_inline: max_inline.min(MAX_INLINE_DATA),
            qp_type: QpType::Rc,
        }
    }

    /// The same for a QP of type `qp_type`.
    pub(crate) fn of_type(self, qp_type: QpType) -> Self {
        Self { qp_type, ..self }
    }

    /// Writes one WQE into the next slot (unpublished).
    pub(crate) fn push(&mut self, wr: &SendWr<'_>) -> Result<(), Error> {
        use SendOpcode as Op;
        let allowed = match self.qp_type {
            QpType::Rc => true,
            // No READ or atomics without a reliable connection.
            QpType::Uc => matches!(
                wr.opcode,
                Op::Send | Op::SendWithImm | Op::RdmaWrite | Op::RdmaWriteWithImm
            ),
            QpType::Ud => matches!(wr.opcode, Op::Send | Op::SendWithImm),
        };
        if !allowed {
            return Err(Error::InvalidArgument(
                "opcode not available on this QP type",
            ));
        }
        let stride = self.ring.geometry.stride as usize;
        let fixed = core::mem::size_of::<SendWqe>();
        let mut wqe = SendWqe {
            wr_id: wr.wr_id.into(),
            opcode: wr.opcode.into(),
            flags: wr.flags & !send_flags::INLINE,
            imm_data: wr.imm_data,
            rkey: wr.rkey.into(),
            remote_addr: wr.remote_addr.into(),
            compare_add: wr.compare_add.into(),
            swap: wr.swap.into(),
            ..Default::default()
        };
        match wr.payload {
            SendPayload::Sges(sges) => {
                if to_u32(sges.len()) > self.max_sge || fixed + sges.len() * SGE_SIZE > stride {
                    return Err(Error::InvalidArgument("too many SGEs"));
                }
                // At most MAX_SGE (64), checked above.
                wqe.num_sge = u8::try_from(sges.len())
                    .map_err(|_| Error::InvalidArgument("too many SGEs"))?;
                self.ring.push(|mem, offset| {
                    mem.write_at(offset, wqe.as_bytes());
                    write_sges(mem, offset + fixed, sges);
                })
            }
            SendPayload::Inline(data) => {
                let inline_ok = matches!(
                    wr.opcode,
                    SendOpcode::Send
                        | SendOpcode::SendWithImm
                        | SendOpcode::RdmaWrite
                        | SendOpcode::RdmaWriteWithImm
                );
                if !inline_ok {
                    return Err(Error::InvalidArgument(
                        "inline data with a non-send/write opcode",
                    ));
                }
                if to_u32(data.len()) > self.max_inline || fixed + data.len() > stride {
                    return Err(Error::InvalidArgument("inline data too long"));
                }
                wqe.flags |= send_flags::INLINE;
                wqe.inline_len = to_u32(data.len()).into();
                self.ring.push(|mem, offset| {
                    mem.write_at(offset, wqe.as_bytes());
                    mem.write_at(offset + fixed, data);
                })
            }
        }
    }
}

/// A receive ring with the limits it was created for.
#[derive(Debug)]
pub(crate) struct RecvRing {
    pub(crate) ring: WorkRing,
    /// The QP's doorbell; none for an SRQ's ring (the device reads it when
    /// a message arrives, so a post needs no doorbell).
    pub(crate) doorbell: Option<Doorbell>,
    max_sge: u32,
    /// A QP attached to an SRQ: nothing may be posted here (EINVAL, as
    /// rdma-core's providers answer).
    shared: bool,
}

impl RecvRing {
    /// A receive ring on which at most `max_sge` SGEs may be posted (never
    /// more than the format carries).
    pub(crate) fn new(ring: WorkRing, doorbell: Option<Doorbell>, max_sge: u32) -> Self {
        Self {
            ring,
            doorbell,
            max_sge: max_sge.min(MAX_SGE),
            shared: false,
        }
    }

    /// The unused ring of a QP whose receives come from an SRQ.
    pub(crate) fn of_srq_qp(ring: WorkRing) -> Self {
        Self {
            shared: true,
            ..Self::new(ring, None, 0)
        }
    }

    /// Writes one WQE into the next slot (unpublished).
    pub(crate) fn push(&mut self, wr: &RecvWr<'_>) -> Result<(), Error> {
        if self.shared {
            return Err(Error::InvalidArgument(
                "the QP takes its receives from an SRQ (ibv_post_srq_recv)",
            ));
        }
        let fixed = core::mem::size_of::<RecvWqe>();
        let stride = self.ring.geometry.stride as usize;
        if to_u32(wr.sg_list.len()) > self.max_sge || fixed + wr.sg_list.len() * SGE_SIZE > stride {
            return Err(Error::InvalidArgument("too many SGEs"));
        }
        let wqe = RecvWqe {
            wr_id: wr.wr_id.into(),
            num_sge: u8::try_from(wr.sg_list.len())
                .map_err(|_| Error::InvalidArgument("too many SGEs"))?,
            reserved: [0; 7],
        };
        self.ring.push(|mem, offset| {
            mem.write_at(offset, wqe.as_bytes());
            write_sges(mem, offset + fixed, wr.sg_list);
        })
    }
}

/// A ring the device produces into and the driver consumes: a completion
/// ring or an event ring. Each entry is read once, into the driver's own
/// copy, before its slot is handed back.
#[derive(Debug)]
pub(crate) struct ConsumerRing {
    /// Shared with [`RingIndices`], which reads the two indices without
    /// the ring's owner.
    mem: Arc<DmaBuf>,
    depth: u32,
    stride: usize,
    /// Next entry to read (the shadow of `driver.index`).
    consumer: u32,
}

impl ConsumerRing {
    /// A ring of `depth` entries of `stride` bytes in `mem`: zeroed,
    /// [`RING_ALIGN`]-aligned and large enough (see
    /// [`ConsumerRing::alloc_args`]).
    pub(crate) fn new(mem: DmaBuf, depth: u32, stride: usize) -> Self {
        debug_assert!(depth.is_power_of_two());
        debug_assert!(mem.len() >= RING_HEADER_SIZE + depth as usize * stride);
        debug_assert!(mem.device_addr() & (RING_ALIGN - 1) == 0);
        Self {
            mem: Arc::new(mem),
            depth,
            stride,
            consumer: 0,
        }
    }

    /// The ring's two indices, readable without `&mut` to the ring.
    pub(crate) fn indices(&self) -> RingIndices {
        RingIndices(Arc::clone(&self.mem))
    }

    /// Length and alignment of the memory of a ring of `bytes`.
    pub(crate) fn alloc_args(bytes: u64) -> Result<(usize, usize), Error> {
        let bytes = usize::try_from(bytes).map_err(|_| Error::InvalidArgument("ring too large"))?;
        Ok((bytes, RING_ALIGN as usize))
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.mem.device_addr()
    }

    /// Entries the device produced that were not read yet.
    fn ready(&self) -> Result<u32, Error> {
        let producer = u32::from_le(
            self.mem
                .atomic_u32(DEVICE_INDEX_OFFSET as usize)
                .load(Ordering::Acquire),
        );
        let ready = producer.wrapping_sub(self.consumer);
        if ready > self.depth {
            return Err(Error::Protocol("producer index is more than a ring ahead"));
        }
        Ok(ready)
    }

    /// Copies the next unread entry into `out` (`stride` bytes) and moves
    /// past it, without handing the slot back yet.
    fn read_next(&mut self, out: &mut [u8]) {
        let slot = (self.consumer & (self.depth - 1)) as usize;
        self.mem.read_at(RING_HEADER_SIZE + slot * self.stride, out);
        self.consumer = self.consumer.wrapping_add(1);
    }

    /// Hands every slot read so far back to the device.
    fn release(&self) {
        // Release: our reads of the slots happen before the device may
        // reuse them.
        self.mem
            .atomic_u32(DRIVER_INDEX_OFFSET as usize)
            .store(self.consumer.to_le(), Ordering::Release);
    }

    /// The device's flags in the ring header.
    pub(crate) fn device_flags(&self) -> u32 {
        u32::from_le(
            self.mem
                .atomic_u32(DEVICE_FLAGS_OFFSET as usize)
                .load(Ordering::Acquire),
        )
    }

    /// Reads up to `out.len()` entries, each decoded by `decode` from its
    /// raw bytes, and hands their slots back; returns how many.
    pub(crate) fn consume<T, const STRIDE: usize>(
        &mut self,
        out: &mut [T],
        decode: impl Fn(&[u8; STRIDE]) -> T,
    ) -> Result<usize, Error> {
        debug_assert_eq!(STRIDE, self.stride);
        let n = out.len().min(self.ready()? as usize);
        let mut raw = [0u8; STRIDE];
        for item in &mut out[..n] {
            self.read_next(&mut raw);
            *item = decode(&raw);
        }
        if n > 0 {
            self.release();
        }
        Ok(n)
    }

    #[cfg(test)]
    pub(crate) fn mem(&self) -> &DmaBuf {
        &self.mem
    }
}

/// A consumer ring's header, read from another thread than the one
/// consuming: whether the ring has nothing unread, without its lock.
#[derive(Debug)]
pub(crate) struct RingIndices(Arc<DmaBuf>);

impl RingIndices {
    /// Whether every entry the device had produced when this was called
    /// has been consumed and handed back. The consumer index is read
    /// first: it only trails what was consumed, and the device's index
    /// only moves ahead, so equal indices cannot hide an unread entry
    /// (an answer of `false` may still find nothing).
    pub(crate) fn drained(&self) -> bool {
        let consumed = self
            .0
            .atomic_u32(DRIVER_INDEX_OFFSET as usize)
            .load(Ordering::Acquire);
        let produced = self
            .0
            .atomic_u32(DEVICE_INDEX_OFFSET as usize)
            .load(Ordering::Acquire);
        consumed == produced
    }
}

/// A completion ring the driver consumes.
#[derive(Debug)]
pub(crate) struct CqRing {
    ring: ConsumerRing,
    /// Last arm sequence number used (24 bits).
    arm_sn: u32,
}

impl CqRing {
    /// A ring of `depth` CQEs in `mem`: zeroed, [`RING_ALIGN`]-aligned and
    /// at least `cq_ring_bytes(depth)` long (see [`CqRing::alloc_args`]).
    pub(crate) fn new(mem: DmaBuf, depth: u32) -> Self {
        Self {
            ring: ConsumerRing::new(mem, depth, CQE_SIZE),
            arm_sn: 0,
        }
    }

    /// Length and alignment of the memory a ring of `depth` CQEs needs.
    pub(crate) fn alloc_args(depth: u32) -> Result<(usize, usize), Error> {
        ConsumerRing::alloc_args(spec::cq_ring_bytes(depth))
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.ring.device_addr()
    }

    /// Its indices, for lock-free emptiness checks.
    pub(crate) fn indices(&self) -> RingIndices {
        self.ring.indices()
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub(crate) fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize, Error> {
        self.ring.consume(out, |raw: &[u8; CQE_SIZE]| {
            let cqe: Cqe = zerocopy::transmute!(*raw);
            WorkCompletion::from(&cqe)
        })
    }

    /// Arms the CQ for one event on the next (solicited) completion.
    pub(crate) fn arm(&mut self, solicited_only: bool) {
        // 24 bits; 0 is skipped because it is the device's initial
        // `notified_sn`, which would make the arm look answered already.
        self.arm_sn = match (self.arm_sn + 1) & 0x00ff_ffff {
            0 => 1,
            sn => sn,
        };
        let kind = if solicited_only {
            spec::CQ_ARM_SOLICITED
        } else {
            spec::CQ_ARM_NEXT
        };
        self.arm_word()
            .store(((self.arm_sn << 8) | kind).to_le(), Ordering::Release);
        // Full fence: the arm is visible before the caller polls again, so a
        // completion the device wrote before seeing the arm is found by that poll.
        fence(Ordering::SeqCst);
    }

    fn arm_word(&self) -> &AtomicU32 {
        self.ring.mem.atomic_u32(DRIVER_ARM_OFFSET as usize)
    }

    /// The arm sequence number the device last answered with an event.
    #[cfg(test)]
    fn notified_sn(&self) -> u32 {
        u32::from_le(
            self.ring
                .mem
                .atomic_u32(spec::DEVICE_NOTIFIED_SN_OFFSET as usize)
                .load(Ordering::Acquire),
        )
    }
}

// The device's doorbell page ([`vrdma_spec::ring::doorbell`]): how the
// driver tells the device which QPs have new work.
//
// One page per device, given to it with `SET_DOORBELL`. After publishing a
// ring's producer index the driver sets the QP's bit in the bitmap, then
// the bitmap word's bit in the summary, then reads the device's flags: a
// polling device finds the bits by reading the summary; a device about to
// sleep has set NEED_KICK first and is woken through the doorbell
// virtqueue. Ringing is lock-free (two atomic ORs and a load), so QPs
// posting on several threads never serialize on the page.

/// The doorbell page in DMA memory.
#[derive(Debug)]
pub(crate) struct DoorbellPage {
    mem: DmaBuf,
}

impl DoorbellPage {
    /// Length and alignment of the memory the page needs.
    pub(crate) const ALLOC_ARGS: (usize, usize) =
        (doorbell::PAGE_SIZE as usize, RING_ALIGN as usize);

    /// The page in `mem`: zeroed, allocated with [`DoorbellPage::ALLOC_ARGS`].
    pub(crate) fn new(mem: DmaBuf) -> Self {
        debug_assert!(mem.len() as u64 >= doorbell::PAGE_SIZE);
        debug_assert!(mem.device_addr() & (RING_ALIGN - 1) == 0);
        Self { mem }
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.mem.device_addr()
    }

    /// Marks the QP of `bit` as having new work; returns whether the device
    /// asked to be kicked. Call after the producer index is published.
    pub(crate) fn ring(&self, bit: &Bit) -> bool {
        // The words are little-endian; OR-ing a byte-swapped mask is the
        // same as byte-swapping the OR, so `to_le` suffices on any host.
        //
        // Bitmap word first: a device that saw the summary bit and cleared
        // it must then find the QP's bit. SeqCst RMWs also order the
        // producer store before them (release) for the device that takes
        // the bits with its swap (acquire).
        self.mem
            .atomic_u64(to_offset(bit.word_offset))
            .fetch_or(bit.mask.to_le(), Ordering::SeqCst);
        self.mem
            .atomic_u64(to_offset(bit.summary_offset))
            .fetch_or(bit.summary_mask.to_le(), Ordering::SeqCst);
        // The device sets NEED_KICK, fences and re-reads the summary before
        // it sleeps; we OR (a full fence) and then read the flag: either it
        // sees our bits or we see its flag.
        let flags = self
            .mem
            .atomic_u32(to_offset(doorbell::FLAGS_OFFSET))
            .load(Ordering::SeqCst);
        u32::from_le(flags) & doorbell::NEED_KICK != 0
    }
}

/// A QP's doorbell: its bit in the device's page.
#[derive(Debug, Clone)]
pub(crate) struct Doorbell {
    page: Arc<DoorbellPage>,
    bit: Bit,
}

impl Doorbell {
    pub(crate) fn new(page: Arc<DoorbellPage>, bit: Bit) -> Self {
        Self { page, bit }
    }

    /// Rings it (after the ring's producer index is published); returns
    /// whether the device asked to be kicked.
    pub(crate) fn ring(&self) -> bool {
        self.page.ring(&self.bit)
    }
}

/// An offset inside the page (bounded by the spec's layout, checked by
/// [`vrdma_spec::ring::doorbell::bit`]).
fn to_offset(offset: u64) -> usize {
    usize::try_from(offset).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests;
