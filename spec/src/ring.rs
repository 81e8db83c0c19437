//! Send, receive and completion rings in guest memory, like a hardware NIC's.
//!
//! Each ring is one guest-physical range: a [`RingHeader`] (two cache lines,
//! one written only by the driver, one only by the device, so they never
//! share a line) followed by `depth` entries of a fixed stride. Indices are
//! free-running `u32` counters; entry `i` lives in slot `i & (depth - 1)`.
//!
//! - Send / receive rings: the driver writes entries, then publishes them by
//!   storing `driver.index` (the producer) with release ordering. The device
//!   consumes them and stores `device.index` (the consumer).
//! - Completion rings: the device writes CQEs, then stores `device.index`
//!   (producer); the driver consumes and stores `driver.index`.
//!
//! Doorbells: while the device is polling it leaves
//! [`DEVICE_FLAG_NEED_KICK`] clear and the driver just publishes. Before it
//! sleeps, the device sets the flag on every ring it serves, issues a full
//! fence and checks the producers once more. After publishing, the driver
//! issues a full fence and, if the flag is set, notifies the doorbell queue.
//! This is virtio's notification-suppression handshake applied per ring.
//!
//! CQ arming (`ibv_req_notify_cq`) is a driver-line write, no exit: the driver
//! stores `arm = (sn << 8) | kind`. When the device produces a CQE that
//! matches an arm whose `sn` differs from the device's `notified_sn`, it sends
//! one completion event on the CQ's event queue and stores `notified_sn = sn`.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Rings start on this boundary (a page: rings never straddle more pages
/// than they need, and both lines of the header are cache-line aligned).
pub const RING_ALIGN: u64 = 4096;
/// Size of a cache line; each half of the ring header is one.
pub const CACHE_LINE: usize = 64;

/// The half of the ring header only the driver writes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct DriverLine {
    /// Producer index of a send/receive ring; consumer index of a CQ.
    pub index: U32,
    /// CQ only: `(sn << 8) | kind`, kind one of [`CQ_ARM_NONE`],
    /// [`CQ_ARM_NEXT`], [`CQ_ARM_SOLICITED`].
    pub arm: U32,
    pub reserved: [u8; CACHE_LINE - 8],
}

/// The half of the ring header only the device writes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct DeviceLine {
    /// Consumer index of a send/receive ring; producer index of a CQ.
    pub index: U32,
    /// [`DEVICE_FLAG_NEED_KICK`], [`DEVICE_FLAG_ERROR`].
    pub flags: U32,
    /// CQ only: the arm sequence number last answered with an event.
    pub notified_sn: U32,
    pub reserved: [u8; CACHE_LINE - 12],
}

/// Header at the start of every ring.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct RingHeader {
    pub driver: DriverLine,
    pub device: DeviceLine,
}

/// Size of [`RingHeader`].
pub const RING_HEADER_SIZE: usize = core::mem::size_of::<RingHeader>();
/// Offset of the driver-written index in a ring.
pub const DRIVER_INDEX_OFFSET: u64 = core::mem::offset_of!(RingHeader, driver) as u64;
/// Offset of the driver-written CQ arm word in a ring.
pub const DRIVER_ARM_OFFSET: u64 = core::mem::offset_of!(DriverLine, arm) as u64;
/// Offset of the device-written index in a ring.
pub const DEVICE_INDEX_OFFSET: u64 = core::mem::offset_of!(RingHeader, device) as u64;
/// Offset of the device-written flags in a ring.
pub const DEVICE_FLAGS_OFFSET: u64 = DEVICE_INDEX_OFFSET + 4;
/// Offset of the device-written `notified_sn` in a ring.
pub const DEVICE_NOTIFIED_SN_OFFSET: u64 = DEVICE_INDEX_OFFSET + 8;

/// Device is about to sleep: notify the doorbell queue after publishing.
pub const DEVICE_FLAG_NEED_KICK: u32 = 1;
/// The ring's object is in error; nothing more will be consumed.
pub const DEVICE_FLAG_ERROR: u32 = 2;

/// CQ not armed.
pub const CQ_ARM_NONE: u32 = 0;
/// Event on the next completion.
pub const CQ_ARM_NEXT: u32 = 1;
/// Event on the next solicited (or error) completion.
pub const CQ_ARM_SOLICITED: u32 = 2;

/// A scatter/gather element (`struct ibv_sge`).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct Sge {
    /// Address in the MR's IOVA space.
    pub addr: U64,
    pub length: U32,
    pub lkey: U32,
}

/// Send WQE flags (`enum ibv_send_flags`).
pub mod send_flags {
    pub const FENCE: u8 = 1;
    pub const SIGNALED: u8 = 1 << 1;
    pub const SOLICITED: u8 = 1 << 2;
    pub const INLINE: u8 = 1 << 3;
}

/// Fixed part of a send WQE; `num_sge` [`Sge`]s or `inline_len` inline bytes
/// follow it in the same slot.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct SendWqe {
    pub wr_id: U64,
    /// A [`crate::verbs::SendOpcode`].
    pub opcode: u8,
    /// [`send_flags`].
    pub flags: u8,
    pub num_sge: u8,
    pub reserved: u8,
    /// Immediate data, opaque bytes in the order the application gave them
    /// (`ibv_send_wr.imm_data` is big-endian already).
    pub imm_data: [u8; 4],
    /// Number of inline bytes when [`send_flags::INLINE`] is set.
    pub inline_len: U32,
    pub rkey: U32,
    pub remote_addr: U64,
    /// Atomics: compare value (CAS) or addend (FAA).
    pub compare_add: U64,
    /// Atomics: swap value (CAS).
    pub swap: U64,
    pub reserved2: [u8; 16],
}

/// Fixed part of a receive WQE; `num_sge` [`Sge`]s follow it.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct RecvWqe {
    pub wr_id: U64,
    pub num_sge: u8,
    pub reserved: [u8; 7],
}

/// Completion flags (`enum ibv_wc_flags`).
pub mod wc_flags {
    pub const GRH: u8 = 1;
    pub const WITH_IMM: u8 = 1 << 1;
}

/// A completion-queue entry.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct Cqe {
    pub wr_id: U64,
    /// A [`crate::verbs::WcStatus`].
    pub status: u8,
    /// A [`crate::verbs::WcOpcode`].
    pub opcode: u8,
    /// [`wc_flags`].
    pub wc_flags: u8,
    pub reserved: u8,
    pub vendor_err: U32,
    pub byte_len: U32,
    pub imm_data: [u8; 4],
    pub qp_num: U32,
    pub src_qp: U32,
}

/// Size of a [`Cqe`], which is also a CQ ring's stride.
pub const CQE_SIZE: usize = core::mem::size_of::<Cqe>();
/// Size of an [`Sge`].
pub const SGE_SIZE: usize = core::mem::size_of::<Sge>();

/// Event kinds written to an event queue.
pub mod event_kind {
    /// A CQ's armed completion event; `object` is the CQN.
    pub const COMPLETION: u16 = 1;
    /// A CQ overran; `object` is the CQN.
    pub const CQ_ERROR: u16 = 2;
    /// A QP entered the error state on its own; `object` is the QPN.
    pub const QP_FATAL: u16 = 3;
    /// The port became active.
    pub const PORT_ACTIVE: u16 = 4;
}

/// One entry of an event queue (device-writable buffers the driver posts).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct Event {
    pub kind: zerocopy::little_endian::U16,
    pub reserved: zerocopy::little_endian::U16,
    pub object: U32,
    pub reserved2: U64,
}

/// Largest number of entries any ring may have.
pub const MAX_RING_DEPTH: u32 = 1 << 16;
/// Largest stride of a work-queue entry.
pub const MAX_WQE_STRIDE: u32 = 4096;

/// Depth of a CQ that must hold `cqe` entries: the next power of two.
pub fn cq_depth(cqe: u32) -> Option<u32> {
    ring_depth(cqe)
}

/// Bytes of a CQ ring of `depth` entries, header included.
pub fn cq_ring_bytes(depth: u32) -> u64 {
    RING_HEADER_SIZE as u64 + u64::from(depth) * CQE_SIZE as u64
}

fn ring_depth(entries: u32) -> Option<u32> {
    let depth = entries.max(1).checked_next_power_of_two()?;
    (depth <= MAX_RING_DEPTH).then_some(depth)
}

/// Shape of a work ring: its number of slots and the bytes of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRingGeometry {
    pub depth: u32,
    pub stride: u32,
}

impl WorkRingGeometry {
    /// Bytes of the ring, header included.
    pub fn ring_bytes(&self) -> u64 {
        RING_HEADER_SIZE as u64 + u64::from(self.depth) * u64::from(self.stride)
    }
}

/// Geometry of a send ring for `max_send_wr` WQEs with up to `max_sge` SGEs
/// or `max_inline` inline bytes; `None` when no slot could hold that.
pub fn sq_geometry(max_send_wr: u32, max_sge: u32, max_inline: u32) -> Option<WorkRingGeometry> {
    let payload = (u64::from(max_sge) * SGE_SIZE as u64).max(u64::from(max_inline));
    work_geometry(
        max_send_wr,
        core::mem::size_of::<SendWqe>() as u64 + payload,
    )
}

/// Geometry of a receive ring for `max_recv_wr` WQEs of up to `max_sge` SGEs.
pub fn rq_geometry(max_recv_wr: u32, max_sge: u32) -> Option<WorkRingGeometry> {
    let payload = u64::from(max_sge) * SGE_SIZE as u64;
    work_geometry(
        max_recv_wr,
        core::mem::size_of::<RecvWqe>() as u64 + payload,
    )
}

fn work_geometry(entries: u32, slot_bytes: u64) -> Option<WorkRingGeometry> {
    let stride = u32::try_from(slot_bytes.checked_next_power_of_two()?).ok()?;
    (stride <= MAX_WQE_STRIDE).then_some(())?;
    Some(WorkRingGeometry {
        depth: ring_depth(entries)?,
        stride: stride.max(CACHE_LINE as u32),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_are_fixed() {
        assert_eq!(RING_HEADER_SIZE, 128);
        assert_eq!(DEVICE_INDEX_OFFSET, 64);
        assert_eq!(DRIVER_ARM_OFFSET, 4);
        assert_eq!(size_of::<SendWqe>(), 64);
        assert_eq!(size_of::<RecvWqe>(), 16);
        assert_eq!(SGE_SIZE, 16);
        assert_eq!(CQE_SIZE, 32);
        assert_eq!(size_of::<Event>(), 16);
    }

    #[test]
    fn geometry_rounds_up_and_bounds() {
        let sq = sq_geometry(100, 4, 64).expect("fits");
        assert_eq!(
            sq,
            WorkRingGeometry {
                depth: 128,
                stride: 128
            }
        );
        assert_eq!(sq.ring_bytes(), 128 + 128 * 128);
        let sq_inline = sq_geometry(1, 1, 200).expect("fits");
        assert_eq!(sq_inline.stride, 512);
        let rq = rq_geometry(0, 1).expect("fits");
        assert_eq!(
            rq,
            WorkRingGeometry {
                depth: 1,
                stride: 64
            }
        );
        assert_eq!(sq_geometry(1, 1000, 0), None, "stride above MAX_WQE_STRIDE");
        assert_eq!(rq_geometry(MAX_RING_DEPTH + 1, 1), None);
        assert_eq!(cq_depth(u32::MAX), None);
        assert_eq!(cq_depth(1000), Some(1024));
    }
}
