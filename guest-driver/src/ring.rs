//! The driver's half of the data-path rings: send/receive rings it
//! produces into and completion rings it consumes from.
//!
//! Layouts, index rules and the doorbell handshake are those of
//! [`vrdma_spec::ring`]; this module only writes and reads them. Rings live
//! in DMA memory shared with the device, so every access is a volatile copy
//! or an atomic on the ring header.

use std::sync::atomic::{fence, AtomicU32, Ordering};

use vrdma_spec::ring::{
    self as spec, send_flags, wc_flags, Cqe, RecvWqe, SendWqe, WorkRingGeometry, CQE_SIZE,
    DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR, DEVICE_FLAG_NEED_KICK, DEVICE_INDEX_OFFSET,
    DRIVER_ARM_OFFSET, DRIVER_INDEX_OFFSET, RING_ALIGN, RING_HEADER_SIZE, SGE_SIZE,
};
use vrdma_spec::verbs::{SendOpcode, WcOpcode, WcStatus};
use zerocopy::{FromBytes, IntoBytes};

use crate::dma::DmaBuf;
use crate::error::{Error, PostError};

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
    /// Whether the producer moved since the last `take_published`.
    published: bool,
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
            published: false,
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

    /// Slots the device has not consumed yet, and so cannot be reused.
    fn outstanding(&self) -> u32 {
        let consumer = self
            .mem
            .atomic_u32(DEVICE_INDEX_OFFSET as usize)
            .load(Ordering::Acquire);
        let used = self.producer.wrapping_sub(u32::from_le(consumer));
        // A consumer ahead of the producer is a device bug: treat the ring as full.
        used.min(self.geometry.depth)
    }

    fn slot_offset(&self, index: u32) -> usize {
        let slot = index & (self.geometry.depth - 1);
        RING_HEADER_SIZE + slot as usize * self.geometry.stride as usize
    }

    /// Writes one entry (via `write`) into the next slot, if there is room.
    fn push(&mut self, write: impl FnOnce(&DmaBuf, usize)) -> Result<(), Error> {
        if self.outstanding() >= self.limit {
            return Err(Error::QueueFull);
        }
        write(&self.mem, self.slot_offset(self.producer));
        self.producer = self.producer.wrapping_add(1);
        Ok(())
    }

    /// Makes every written entry visible to the device.
    fn publish(&mut self) {
        // Release: the slot contents are visible before the new producer.
        self.mem
            .atomic_u32(DRIVER_INDEX_OFFSET as usize)
            .store(self.producer.to_le(), Ordering::Release);
        self.published = true;
    }

    /// Whether entries were published since the previous call, and the
    /// device asked to be kicked (the spec's NEED_KICK handshake).
    pub(crate) fn take_kick(&mut self) -> bool {
        if !std::mem::take(&mut self.published) {
            return false;
        }
        // Full fence: the producer store is ordered before reading the
        // flags; the device sets the flag, fences, and re-reads the producer.
        fence(Ordering::SeqCst);
        self.device_flags() & DEVICE_FLAG_NEED_KICK != 0
    }

    fn device_flags(&self) -> u32 {
        u32::from_le(
            self.mem
                .atomic_u32(DEVICE_FLAGS_OFFSET as usize)
                .load(Ordering::Acquire),
        )
    }

    /// Whether the device put the ring's object in error.
    pub(crate) fn in_error(&self) -> bool {
        self.device_flags() & DEVICE_FLAG_ERROR != 0
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
    max_sge: u32,
    max_inline: u32,
}

impl SendRing {
    pub(crate) fn new(ring: WorkRing, max_sge: u32, max_inline: u32) -> Self {
        Self {
            ring,
            max_sge,
            max_inline,
        }
    }

    /// Writes and publishes `wrs` in order, stopping at the first that fails.
    pub(crate) fn post(&mut self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let result = wrs.iter().enumerate().try_for_each(|(i, wr)| {
            self.post_one(wr)
                .map_err(|error| PostError { bad_wr: i, error })
        });
        if result
            .as_ref()
            .map_or_else(|e| e.bad_wr > 0, |()| !wrs.is_empty())
        {
            self.ring.publish();
        }
        result
    }

    fn post_one(&mut self, wr: &SendWr<'_>) -> Result<(), Error> {
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
                // max_sge fits the stride, and MAX_WQE_STRIDE bounds it below 256.
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
    max_sge: u32,
}

impl RecvRing {
    pub(crate) fn new(ring: WorkRing, max_sge: u32) -> Self {
        Self { ring, max_sge }
    }

    /// Writes and publishes `wrs` in order, stopping at the first that fails.
    pub(crate) fn post(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let result = wrs.iter().enumerate().try_for_each(|(i, wr)| {
            self.post_one(wr)
                .map_err(|error| PostError { bad_wr: i, error })
        });
        if result
            .as_ref()
            .map_or_else(|e| e.bad_wr > 0, |()| !wrs.is_empty())
        {
            self.ring.publish();
        }
        result
    }

    fn post_one(&mut self, wr: &RecvWr<'_>) -> Result<(), Error> {
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

/// A completion ring the driver consumes.
#[derive(Debug)]
pub(crate) struct CqRing {
    mem: DmaBuf,
    depth: u32,
    /// Next CQE to read (the shadow of `driver.index`).
    consumer: u32,
    /// Last arm sequence number used (24 bits).
    arm_sn: u32,
}

impl CqRing {
    /// A ring of `depth` CQEs in `mem`: zeroed, [`RING_ALIGN`]-aligned and
    /// at least `cq_ring_bytes(depth)` long (see [`CqRing::alloc_args`]).
    pub(crate) fn new(mem: DmaBuf, depth: u32) -> Self {
        debug_assert!(mem.len() as u64 >= spec::cq_ring_bytes(depth));
        debug_assert!(mem.device_addr() & (RING_ALIGN - 1) == 0);
        Self {
            mem,
            depth,
            consumer: 0,
            arm_sn: 0,
        }
    }

    /// Length and alignment of the memory a ring of `depth` CQEs needs.
    pub(crate) fn alloc_args(depth: u32) -> Result<(usize, usize), Error> {
        let bytes = usize::try_from(spec::cq_ring_bytes(depth))
            .map_err(|_| Error::InvalidArgument("CQ too large"))?;
        Ok((bytes, RING_ALIGN as usize))
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.mem.device_addr()
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub(crate) fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize, Error> {
        let producer = u32::from_le(
            self.mem
                .atomic_u32(DEVICE_INDEX_OFFSET as usize)
                .load(Ordering::Acquire),
        );
        let ready = producer.wrapping_sub(self.consumer);
        if ready > self.depth {
            return Err(Error::Protocol(
                "CQ producer index is more than a ring ahead",
            ));
        }
        let n = out.len().min(ready as usize);
        let mut raw = [0u8; CQE_SIZE];
        for wc in &mut out[..n] {
            let slot = (self.consumer & (self.depth - 1)) as usize;
            self.mem
                .read_at(RING_HEADER_SIZE + slot * CQE_SIZE, &mut raw);
            let cqe =
                Cqe::read_from_bytes(&raw).map_err(|_| Error::Protocol("CQE size mismatch"))?;
            *wc = WorkCompletion::from(&cqe);
            self.consumer = self.consumer.wrapping_add(1);
        }
        if n > 0 {
            // Release: our reads of the slots happen before the device may
            // reuse them.
            self.mem
                .atomic_u32(DRIVER_INDEX_OFFSET as usize)
                .store(self.consumer.to_le(), Ordering::Release);
        }
        Ok(n)
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
        self.mem.atomic_u32(DRIVER_ARM_OFFSET as usize)
    }

    /// The arm sequence number the device last answered with an event.
    #[cfg(test)]
    fn notified_sn(&self) -> u32 {
        u32::from_le(
            self.mem
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

    fn arena() -> Arc<DmaArena> {
        DmaArena::new(1 << 20).unwrap()
    }

    fn work_ring(geo: WorkRingGeometry) -> WorkRing {
        let (len, align) = WorkRing::alloc_args(geo).unwrap();
        WorkRing::new(arena().alloc_zeroed(len, align).unwrap(), geo)
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

    fn device_consumes(ring: &WorkRing, index: u32) {
        ring.mem
            .atomic_u32(DEVICE_INDEX_OFFSET as usize)
            .store(index.to_le(), Ordering::Release);
    }

    #[test]
    fn send_wqe_bytes_match_the_spec() {
        let geo = sq_geometry(4, 2, 32).unwrap();
        let mut sq = SendRing::new(work_ring(geo), 2, 32);
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
        sq.post(&[wr, inline]).unwrap();

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
        let mut sq = SendRing::new(work_ring(geo), 1, 16);
        let sges = [Sge::default(); 2];
        let err = sq
            .post(&[
                SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&sges[..1])),
                SendWr::new(2, SendOpcode::Send, SendPayload::Sges(&sges)),
            ])
            .unwrap_err();
        assert_eq!((err.bad_wr, err.errno()), (1, libc::EINVAL));
        // The first one was still published.
        assert_eq!(read(&sq.ring.mem, 0, 4), 1u32.to_le_bytes());
        let long = [0u8; 17];
        let err = sq
            .post(&[SendWr::new(3, SendOpcode::Send, SendPayload::Inline(&long))])
            .unwrap_err();
        assert_eq!((err.bad_wr, err.errno()), (0, libc::EINVAL));
        let err = sq
            .post(&[SendWr::new(
                3,
                SendOpcode::RdmaRead,
                SendPayload::Inline(b"x"),
            )])
            .unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        assert_eq!(read(&sq.ring.mem, 0, 4), 1u32.to_le_bytes());
    }

    #[test]
    fn full_ring_is_enomem_until_the_device_consumes() {
        let geo = sq_geometry(4, 1, 0).unwrap();
        assert_eq!(geo.depth, 4);
        let mut sq = SendRing::new(work_ring(geo), 1, 0);
        let sge = [Sge {
            addr: 1,
            length: 1,
            lkey: 1,
        }];
        let wrs: Vec<_> = (0..5)
            .map(|i| SendWr::new(i, SendOpcode::Send, SendPayload::Sges(&sge)))
            .collect();
        let err = sq.post(&wrs).unwrap_err();
        assert_eq!(err.bad_wr, 4);
        assert_eq!(err.errno(), libc::ENOMEM);
        assert!(matches!(err.error, Error::QueueFull));
        assert!(!sq.ring.take_kick(), "device is polling: no kick");
        // The device consumes two; two more fit, wrapping to slots 0 and 1.
        device_consumes(&sq.ring, 2);
        sq.post(&wrs[..2]).unwrap();
        assert_eq!(sq.post(&wrs[..1]).unwrap_err().errno(), libc::ENOMEM);
        let slot0 = read(&sq.ring.mem, RING_HEADER_SIZE, 64);
        assert_eq!(SendWqe::read_from_bytes(&slot0).unwrap().wr_id.get(), 0);
        // Many wraps of the u32-free-running index modulo depth.
        for round in 0..100u32 {
            device_consumes(&sq.ring, sq.ring.producer);
            sq.post(&wrs[..4]).unwrap();
            assert_eq!(sq.ring.producer, 10 + 4 * round);
        }
    }

    #[test]
    fn kick_only_when_the_device_sleeps() {
        let geo = sq_geometry(4, 1, 0).unwrap();
        let mut sq = SendRing::new(work_ring(geo), 1, 0);
        let sge = [Sge::default()];
        let wr = SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&sge));
        assert!(!sq.ring.take_kick(), "nothing published");
        sq.post(&[wr]).unwrap();
        assert!(!sq.ring.take_kick(), "device is polling");
        sq.ring
            .mem
            .atomic_u32(DEVICE_FLAGS_OFFSET as usize)
            .store(DEVICE_FLAG_NEED_KICK.to_le(), Ordering::Release);
        sq.post(&[wr]).unwrap();
        assert!(sq.ring.take_kick());
        assert!(!sq.ring.take_kick(), "already kicked for this batch");
        assert!(!sq.ring.in_error());
    }

    #[test]
    fn recv_wqe_bytes() {
        let geo = rq_geometry(2, 3).unwrap();
        let mut rq = RecvRing::new(work_ring(geo), 3);
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
        rq.post(&[RecvWr {
            wr_id: 99,
            sg_list: &sges,
        }])
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
            .post(&[RecvWr {
                wr_id: 1,
                sg_list: &too_many,
            }])
            .unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
    }

    /// Writes CQEs the way the device does: slots first, then the producer
    /// index with release ordering.
    fn device_completes(cq: &CqRing, producer: &mut u32, cqes: &[Cqe]) {
        for cqe in cqes {
            let slot = (*producer & (cq.depth - 1)) as usize;
            cq.mem
                .write_at(RING_HEADER_SIZE + slot * CQE_SIZE, cqe.as_bytes());
            *producer = producer.wrapping_add(1);
        }
        cq.mem
            .atomic_u32(DEVICE_INDEX_OFFSET as usize)
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
            read(&cq.mem, DRIVER_INDEX_OFFSET as usize, 4),
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
            read(&cq.mem, DRIVER_ARM_OFFSET as usize, 4),
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
