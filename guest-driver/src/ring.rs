//! The driver's half of the data-path rings: send/receive rings it
//! produces into and completion rings it consumes from.
//!
//! Layouts, index rules and the doorbell handshake are those of
//! [`vrdma_spec::ring`]; this module only writes and reads them. Rings live
//! in DMA memory shared with the device, so every access is a volatile copy
//! or an atomic on the ring header.

use std::sync::atomic::{fence, AtomicU32, Ordering};

use vrdma_spec::limits::{MAX_INLINE_DATA, MAX_SGE};
use vrdma_spec::ring::doorbell::Bit;
use vrdma_spec::ring::{
    self as spec, send_flags, wc_flags, Cqe, RecvWqe, SendWqe, WorkRingGeometry, CQE_SIZE,
    DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR, DEVICE_INDEX_OFFSET, DRIVER_ARM_OFFSET,
    DRIVER_INDEX_OFFSET, RING_ALIGN, RING_HEADER_SIZE, SGE_SIZE,
};
use vrdma_spec::verbs::{SendOpcode, WcOpcode, WcStatus};
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
            vendor_err: cqe.vendor_err.get(),
            byte_len: cqe.byte_len.get(),
            imm_data: (cqe.wc_flags & wc_flags::WITH_IMM != 0).then_some(cqe.imm_data),
            qp_num: cqe.qp_num.get(),
            src_qp: cqe.src_qp.get(),
            wc_flags: cqe.wc_flags,
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
    /// so cannot be reused: `device.index` moves at completion.
    fn outstanding(&self) -> u32 {
        let completed = self
            .mem
            .atomic_u32(DEVICE_INDEX_OFFSET as usize)
            .load(Ordering::Acquire);
        let used = self.producer.wrapping_sub(u32::from_le(completed));
        // A device index ahead of the producer is a device bug: treat the
        // ring as full rather than overwrite work in flight.
        if used > self.geometry.depth {
            self.geometry.depth
        } else {
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
    /// The QP's bit in the doorbell page.
    pub(crate) doorbell: Bit,
    max_sge: u32,
    max_inline: u32,
}

impl SendRing {
    /// A send ring on which at most `max_sge` SGEs or `max_inline` inline
    /// bytes may be posted (the grant, and never more than the format
    /// carries, whatever the device granted).
    pub(crate) fn new(ring: WorkRing, doorbell: Bit, max_sge: u32, max_inline: u32) -> Self {
        Self {
            ring,
            doorbell,
            max_sge: max_sge.min(MAX_SGE),
            max_inline: max_inline.min(MAX_INLINE_DATA),
        }
    }

    /// Writes one WQE into the next slot (unpublished).
    pub(crate) fn push(&mut self, wr: &SendWr<'_>) -> Result<(), Error> {
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
    /// The QP's bit in the doorbell page.
    pub(crate) doorbell: Bit,
    max_sge: u32,
}

impl RecvRing {
    /// A receive ring on which at most `max_sge` SGEs may be posted (never
    /// more than the format carries).
    pub(crate) fn new(ring: WorkRing, doorbell: Bit, max_sge: u32) -> Self {
        Self {
            ring,
            doorbell,
            max_sge: max_sge.min(MAX_SGE),
        }
    }

    /// Writes one WQE into the next slot (unpublished).
    pub(crate) fn push(&mut self, wr: &RecvWr<'_>) -> Result<(), Error> {
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
    mem: DmaBuf,
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
            mem,
            depth,
            stride,
            consumer: 0,
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::DmaArena;
    use std::sync::Arc;
    use vrdma_spec::ring::{rq_geometry, sq_geometry};
    use zerocopy::FromBytes;

    fn arena() -> Arc<DmaArena> {
        DmaArena::new(1 << 20).unwrap()
    }

    fn work_ring(geo: WorkRingGeometry) -> WorkRing {
        let (len, align) = WorkRing::alloc_args(geo).unwrap();
        WorkRing::new(arena().alloc_zeroed(len, align).unwrap(), geo)
    }

    fn bit() -> Bit {
        spec::doorbell::bit(0).unwrap()
    }

    fn cq_ring(depth: u32) -> CqRing {
        let (len, align) = CqRing::alloc_args(depth).unwrap();
        CqRing::new(arena().alloc_zeroed(len, align).unwrap(), depth)
    }

    fn read(mem: &DmaBuf, offset: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        mem.read_at(offset, &mut v);
        v
    }

    /// The device completed (or flushed) the work up to `index`.
    fn device_completes_work(ring: &WorkRing, index: u32) {
        ring.mem
            .atomic_u32(DEVICE_INDEX_OFFSET as usize)
            .store(index.to_le(), Ordering::Release);
    }

    /// Posts `wrs` the way a post batch does: in order up to the first
    /// failure (its index and error), then one publish.
    fn post(sq: &mut SendRing, wrs: &[SendWr<'_>]) -> Result<(), (usize, Error)> {
        let result = wrs
            .iter()
            .enumerate()
            .try_for_each(|(i, wr)| sq.push(wr).map_err(|e| (i, e)));
        sq.ring.publish();
        result
    }

    #[test]
    fn send_wqe_bytes_match_the_spec() {
        let geo = sq_geometry(4, 2, 32).unwrap();
        let mut sq = SendRing::new(work_ring(geo), bit(), 2, 32);
        let sges = [
            Sge {
                addr: 0x1111_2222_3333_4444,
                length: 100,
                lkey: 7,
            },
            Sge {
                addr: 0x5000,
                length: 8,
                lkey: 9,
            },
        ];
        let mut wr = SendWr::new(
            0xabcd,
            SendOpcode::RdmaWriteWithImm,
            SendPayload::Sges(&sges),
        );
        wr.flags = send_flags::SIGNALED | send_flags::SOLICITED;
        wr.imm_data = [1, 2, 3, 4];
        wr.remote_addr = 0xdead_beef_0000;
        wr.rkey = 0x77;
        let inline = SendWr::new(5, SendOpcode::Send, SendPayload::Inline(b"inline payload"));
        post(&mut sq, &[wr, inline]).unwrap();

        let mem = &sq.ring.mem;
        assert_eq!(
            read(mem, DRIVER_INDEX_OFFSET as usize, 4),
            2u32.to_le_bytes()
        );
        let stride = geo.stride as usize;
        let slot0 = read(mem, RING_HEADER_SIZE, stride);
        let wqe = SendWqe::read_from_bytes(&slot0[..64]).unwrap();
        assert_eq!(wqe.wr_id.get(), 0xabcd);
        assert_eq!(wqe.opcode, u8::from(SendOpcode::RdmaWriteWithImm));
        assert_eq!(wqe.flags, send_flags::SIGNALED | send_flags::SOLICITED);
        assert_eq!(wqe.num_sge, 2);
        assert_eq!(wqe.imm_data, [1, 2, 3, 4]);
        assert_eq!(wqe.rkey.get(), 0x77);
        assert_eq!(wqe.remote_addr.get(), 0xdead_beef_0000);
        // Raw little-endian bytes of the first SGE right after the fixed part.
        let mut sge0 = Vec::new();
        sge0.extend_from_slice(&0x1111_2222_3333_4444u64.to_le_bytes());
        sge0.extend_from_slice(&100u32.to_le_bytes());
        sge0.extend_from_slice(&7u32.to_le_bytes());
        assert_eq!(&slot0[64..80], &sge0[..]);
        let sge1 = spec::Sge::read_from_bytes(&slot0[80..96]).unwrap();
        assert_eq!(
            (sge1.addr.get(), sge1.length.get(), sge1.lkey.get()),
            (0x5000, 8, 9)
        );

        let slot1 = read(mem, RING_HEADER_SIZE + stride, stride);
        let wqe = SendWqe::read_from_bytes(&slot1[..64]).unwrap();
        assert_eq!(wqe.wr_id.get(), 5);
        assert_eq!(wqe.flags, send_flags::INLINE);
        assert_eq!(wqe.num_sge, 0);
        assert_eq!(wqe.inline_len.get(), 14);
        assert_eq!(&slot1[64..78], b"inline payload");
    }

    #[test]
    fn send_limits_are_checked() {
        let geo = sq_geometry(4, 1, 16).unwrap();
        let mut sq = SendRing::new(work_ring(geo), bit(), 1, 16);
        let sges = [Sge::default(); 2];
        let (bad, err) = post(
            &mut sq,
            &[
                SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&sges[..1])),
                SendWr::new(2, SendOpcode::Send, SendPayload::Sges(&sges)),
            ],
        )
        .unwrap_err();
        assert_eq!((bad, err.errno()), (1, libc::EINVAL));
        // The first one was still published.
        assert_eq!(read(&sq.ring.mem, 0, 4), 1u32.to_le_bytes());
        let long = [0u8; 17];
        let err = sq
            .push(&SendWr::new(
                3,
                SendOpcode::Send,
                SendPayload::Inline(&long),
            ))
            .unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        let err = sq
            .push(&SendWr::new(
                3,
                SendOpcode::RdmaRead,
                SendPayload::Inline(b"x"),
            ))
            .unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        assert!(!sq.ring.publish(), "nothing new to publish");
        assert_eq!(read(&sq.ring.mem, 0, 4), 1u32.to_le_bytes());
    }

    #[test]
    fn a_device_granting_beyond_the_format_is_held_to_it() {
        let geo = sq_geometry(1, MAX_SGE, MAX_INLINE_DATA).unwrap();
        let mut sq = SendRing::new(work_ring(geo), bit(), 1000, 100_000);
        let sges = [Sge::default(); MAX_SGE as usize + 1];
        let err = sq
            .push(&SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&sges)))
            .unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        let fits = &sges[..MAX_SGE as usize];
        sq.push(&SendWr::new(1, SendOpcode::Send, SendPayload::Sges(fits)))
            .unwrap();
        let data = [0u8; MAX_INLINE_DATA as usize + 1];
        let err = sq
            .push(&SendWr::new(
                2,
                SendOpcode::Send,
                SendPayload::Inline(&data),
            ))
            .unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        let mut rq = RecvRing::new(work_ring(rq_geometry(1, MAX_SGE).unwrap()), bit(), 1000);
        let err = rq
            .push(&RecvWr {
                wr_id: 1,
                sg_list: &sges,
            })
            .unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
    }

    #[test]
    fn full_ring_is_enomem_until_the_device_completes() {
        let geo = sq_geometry(4, 1, 0).unwrap();
        assert_eq!(geo.depth, 4);
        let mut sq = SendRing::new(work_ring(geo), bit(), 1, 0);
        let sge = [Sge {
            addr: 1,
            length: 1,
            lkey: 1,
        }];
        let wrs: Vec<_> = (0..5)
            .map(|i| SendWr::new(i, SendOpcode::Send, SendPayload::Sges(&sge)))
            .collect();
        let (bad, err) = post(&mut sq, &wrs).unwrap_err();
        assert_eq!(bad, 4);
        assert_eq!(err.errno(), libc::ENOMEM);
        assert!(matches!(err, Error::QueueFull));
        // The device completes two; two more fit, wrapping to slots 0 and 1.
        device_completes_work(&sq.ring, 2);
        post(&mut sq, &wrs[..2]).unwrap();
        assert_eq!(
            post(&mut sq, &wrs[..1]).unwrap_err().1.errno(),
            libc::ENOMEM
        );
        let slot0 = read(&sq.ring.mem, RING_HEADER_SIZE, 64);
        assert_eq!(SendWqe::read_from_bytes(&slot0).unwrap().wr_id.get(), 0);
        // Many wraps of the u32-free-running index modulo depth.
        for round in 0..100u32 {
            device_completes_work(&sq.ring, sq.ring.producer);
            post(&mut sq, &wrs[..4]).unwrap();
            assert_eq!(sq.ring.producer, 10 + 4 * round);
        }
        // A device index ahead of the producer: treated as full.
        device_completes_work(&sq.ring, sq.ring.producer.wrapping_add(3));
        assert_eq!(sq.push(&wrs[0]).unwrap_err().errno(), libc::ENOMEM);
    }

    #[test]
    fn publish_reports_new_entries_once() {
        let geo = sq_geometry(4, 1, 0).unwrap();
        let mut sq = SendRing::new(work_ring(geo), bit(), 1, 0);
        let sge = [Sge::default()];
        let wr = SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&sge));
        assert!(!sq.ring.publish(), "nothing written");
        sq.push(&wr).unwrap();
        sq.push(&wr).unwrap();
        assert_eq!(read(&sq.ring.mem, 0, 4), 0u32.to_le_bytes(), "unpublished");
        assert!(sq.ring.publish());
        assert_eq!(read(&sq.ring.mem, 0, 4), 2u32.to_le_bytes());
        assert!(!sq.ring.publish(), "already published");
        assert!(!sq.ring.in_error());
        sq.ring
            .mem
            .atomic_u32(DEVICE_FLAGS_OFFSET as usize)
            .store(DEVICE_FLAG_ERROR.to_le(), Ordering::Release);
        assert!(sq.ring.in_error());
    }

    #[test]
    fn recv_wqe_bytes() {
        let geo = rq_geometry(2, 3).unwrap();
        let mut rq = RecvRing::new(work_ring(geo), bit(), 3);
        let sges = [
            Sge {
                addr: 0x10,
                length: 20,
                lkey: 30,
            },
            Sge {
                addr: 0x40,
                length: 50,
                lkey: 60,
            },
        ];
        rq.push(&RecvWr {
            wr_id: 99,
            sg_list: &sges,
        })
        .unwrap();
        let slot = read(&rq.ring.mem, RING_HEADER_SIZE, 48);
        let wqe = RecvWqe::read_from_bytes(&slot[..16]).unwrap();
        assert_eq!((wqe.wr_id.get(), wqe.num_sge), (99, 2));
        let sge = spec::Sge::read_from_bytes(&slot[32..48]).unwrap();
        assert_eq!(
            (sge.addr.get(), sge.length.get(), sge.lkey.get()),
            (0x40, 50, 60)
        );
        let too_many = [Sge::default(); 4];
        let err = rq
            .push(&RecvWr {
                wr_id: 1,
                sg_list: &too_many,
            })
            .unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
    }

    /// Writes CQEs the way the device does: slots first, then the producer
    /// index with release ordering.
    fn device_completes(cq: &CqRing, producer: &mut u32, cqes: &[Cqe]) {
        let (mem, depth) = (&cq.ring.mem, cq.ring.depth);
        for cqe in cqes {
            let slot = (*producer & (depth - 1)) as usize;
            mem.write_at(RING_HEADER_SIZE + slot * CQE_SIZE, cqe.as_bytes());
            *producer = producer.wrapping_add(1);
        }
        mem.atomic_u32(DEVICE_INDEX_OFFSET as usize)
            .store(producer.to_le(), Ordering::Release);
    }

    fn cqe(wr_id: u64, status: u8, opcode: u8, flags: u8) -> Cqe {
        Cqe {
            wr_id: wr_id.into(),
            status,
            opcode,
            wc_flags: flags,
            byte_len: 64.into(),
            imm_data: [9, 8, 7, 6],
            qp_num: 17.into(),
            src_qp: 18.into(),
            ..Default::default()
        }
    }

    #[test]
    fn poll_reads_device_cqes_and_advances_the_consumer() {
        let mut cq = cq_ring(4);
        let mut producer = 0;
        let mut wc = [WorkCompletion::default(); 8];
        assert_eq!(cq.poll(&mut wc).unwrap(), 0);
        device_completes(
            &cq,
            &mut producer,
            &[
                cqe(1, 0, u8::from(WcOpcode::Send), 0),
                cqe(
                    2,
                    0,
                    u8::from(WcOpcode::RecvRdmaWithImm),
                    wc_flags::WITH_IMM,
                ),
                cqe(3, u8::from(WcStatus::RemAccessErr), 0xee, 0),
            ],
        );
        assert_eq!(cq.poll(&mut wc[..2]).unwrap(), 2);
        assert_eq!(wc[0].wr_id, 1);
        assert_eq!(wc[0].status, WcStatus::Success);
        assert_eq!(wc[0].opcode, Some(WcOpcode::Send));
        assert_eq!(wc[0].imm_data, None);
        assert_eq!((wc[0].byte_len, wc[0].qp_num, wc[0].src_qp), (64, 17, 18));
        assert_eq!(wc[1].opcode, Some(WcOpcode::RecvRdmaWithImm));
        assert_eq!(wc[1].imm_data, Some([9, 8, 7, 6]));
        // The consumer index tells the device two slots are free.
        assert_eq!(
            read(&cq.ring.mem, DRIVER_INDEX_OFFSET as usize, 4),
            2u32.to_le_bytes()
        );
        assert_eq!(cq.poll(&mut wc).unwrap(), 1);
        assert_eq!(wc[0].wr_id, 3);
        assert_eq!(wc[0].status, WcStatus::RemAccessErr);
        assert_eq!(wc[0].opcode, None);
        // Wrap around the 4-slot ring a few times.
        for round in 0..10u64 {
            let batch: Vec<_> = (0..4).map(|i| cqe(100 * round + i, 0, 0, 0)).collect();
            device_completes(&cq, &mut producer, &batch);
            assert_eq!(cq.poll(&mut wc).unwrap(), 4);
            let ids: Vec<u64> = wc[..4].iter().map(|w| w.wr_id).collect();
            assert_eq!(ids, (0..4).map(|i| 100 * round + i).collect::<Vec<_>>());
        }
        // A producer more than a ring ahead is refused.
        producer = producer.wrapping_add(5);
        device_completes(&cq, &mut producer, &[]);
        assert_eq!(cq.poll(&mut wc).unwrap_err().errno(), libc::EPROTO);
    }

    #[test]
    fn arming_writes_fresh_sequence_numbers() {
        let mut cq = cq_ring(2);
        assert_eq!(cq.notified_sn(), 0);
        cq.arm(false);
        let word = u32::from_le(cq.arm_word().load(Ordering::Acquire));
        assert_eq!(word, (1 << 8) | spec::CQ_ARM_NEXT);
        cq.arm(true);
        let word = u32::from_le(cq.arm_word().load(Ordering::Acquire));
        assert_eq!(word, (2 << 8) | spec::CQ_ARM_SOLICITED);
        assert_eq!(
            read(&cq.ring.mem, DRIVER_ARM_OFFSET as usize, 4),
            word.to_le_bytes()
        );
        cq.arm_sn = 0x00ff_ffff;
        cq.arm(false);
        assert_eq!(
            u32::from_le(cq.arm_word().load(Ordering::Acquire)) >> 8,
            1,
            "24-bit wrap skips 0"
        );
    }
}
