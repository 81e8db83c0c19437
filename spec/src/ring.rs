//! Send, receive, completion and event rings in guest memory, like a
//! hardware NIC's, and the device's doorbell page.
//!
//! Each ring is one guest-physical range: a [`RingHeader`] (two cache lines,
//! one written only by the driver, one only by the device, so they never
//! share a line) followed by `depth` entries of a fixed stride. Indices are
//! free-running `u32` counters; entry `i` lives in slot `i & (depth - 1)`.
//!
//! - Send / receive rings: the driver writes entries, then publishes them by
//!   storing `driver.index` (the producer) with release ordering. The device
//!   reads each entry once and stores `device.index` when the entry's work
//!   is *complete* (or flushed): `device.index` counts the slots the driver
//!   may reuse, so a ring of `depth` slots bounds the work in flight, and a
//!   post beyond it fails (`ENOMEM`) until completions free slots, as on
//!   rdma-core devices.
//! - Completion rings: the device writes CQEs, then stores `device.index`
//!   (producer); the driver consumes and stores `driver.index`.
//! - Event rings (one per completion vector, [`Event`] entries): like a
//!   completion ring. The device writes an event and then signals the
//!   vector's interrupt.
//!
//! **Doorbells.** Every device has one [`doorbell`] page. After publishing
//! work on a QP's send or receive ring, the driver sets the QP's bit in the
//! page's bitmap and its word's bit in the summary (atomic ORs, in that
//! order), so the device finds which QPs have work by reading a few summary
//! words instead of every ring. While the device polls, that is all. Before
//! it sleeps, the device sets [`doorbell::NEED_KICK`] in the page's device
//! line, issues a full fence and reads the summary once more; after its
//! ORs the driver reads the flag (the OR is a full fence) and, if it is
//! set, notifies the doorbell virtqueue. This is virtio's
//! notification-suppression handshake for the whole device.
//!
//! CQ arming (`ibv_req_notify_cq`) is a driver-line write, no exit: the driver
//! stores `arm = (sn << 8) | kind`. When the device produces a CQE that
//! matches an arm whose `sn` differs from the device's `notified_sn`, it writes
//! one completion event into the event ring of the CQ's completion vector,
//! stores `notified_sn = sn` and interrupts. Asynchronous events of a QP
//! (it failed on its own) go to event ring 0, those of a CQ (it overran) to
//! the CQ's own.

use zerocopy::little_endian::{U16, U32, U64};

use crate::wire_struct;

/// Rings start on this boundary (a page: rings never straddle more pages
/// than they need, and both lines of the header are cache-line aligned).
pub const RING_ALIGN: u64 = 4096;
/// Size of a cache line; each half of the ring header is one.
pub const CACHE_LINE: usize = 64;

wire_struct! {
    no Default:
    /// The half of the ring header only the driver writes.
    pub struct DriverLine {
        /// Producer index of a send/receive ring; consumer index of a CQ.
        pub index: U32,
        /// CQ only: `(sn << 8) | kind`, kind one of [`CQ_ARM_NONE`],
        /// [`CQ_ARM_NEXT`], [`CQ_ARM_SOLICITED`].
        pub arm: U32,
        pub reserved: [u8; CACHE_LINE - 8],
    }
}

wire_struct! {
    no Default:
    /// The half of the ring header only the device writes.
    pub struct DeviceLine {
        /// Consumer index of a send/receive ring; producer index of a CQ.
        pub index: U32,
        /// [`DEVICE_FLAG_ERROR`].
        pub flags: U32,
        /// CQ only: the arm sequence number last answered with an event.
        pub notified_sn: U32,
        pub reserved: [u8; CACHE_LINE - 12],
    }
}

wire_struct! {
    no Default:
    /// Header at the start of every ring.
    pub struct RingHeader {
        pub driver: DriverLine,
        pub device: DeviceLine,
    }
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

/// The ring's object is in error: a QP's send and receive rings once it
/// entered ERR (what is posted is flushed), an event ring that overflowed
/// (events were lost).
pub const DEVICE_FLAG_ERROR: u32 = 2;

/// CQ not armed.
pub const CQ_ARM_NONE: u32 = 0;
/// Event on the next completion.
pub const CQ_ARM_NEXT: u32 = 1;
/// Event on the next solicited (or error) completion.
pub const CQ_ARM_SOLICITED: u32 = 2;

wire_struct! {
    /// A scatter/gather element (`struct ibv_sge`).
    pub struct Sge {
        /// Address in the MR's IOVA space.
        pub addr: U64,
        pub length: U32,
        pub lkey: U32,
    }
}

/// Send WQE flags (`enum ibv_send_flags`).
pub mod send_flags {
    pub const FENCE: u8 = 1;
    pub const SIGNALED: u8 = 1 << 1;
    pub const SOLICITED: u8 = 1 << 2;
    pub const INLINE: u8 = 1 << 3;
}

wire_struct! {
    /// Fixed part of a send WQE; `num_sge` [`Sge`]s or `inline_len` inline bytes
    /// follow it in the same slot. 48 bytes, so that a WQE with one SGE (the
    /// common case) is one cache line: one line for the driver to write and
    /// the device to fetch, as a NIC's 64-byte WQE basic block.
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
    }
}

/// Where a UD send WQE carries its destination (`wr.ud` of
/// `ibv_send_wr`): the address handle's number in `rkey`, the remote QPN
/// in bits 0–31 and the remote Q_Key in bits 32–63 of `remote_addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UdDest {
    /// The AH's number (CREATE_AH's response).
    pub ah: u32,
    pub remote_qpn: u32,
    /// With bit 31 set, the sending QP's own Q_Key is used instead.
    pub remote_qkey: u32,
}

impl UdDest {
    /// The destination `wqe` carries.
    pub fn of(wqe: &SendWqe) -> Self {
        Self::of_parts(wqe.rkey.get(), wqe.remote_addr.get())
    }

    /// The destination a WQE's `rkey` and `remote_addr` carry.
    pub fn of_parts(rkey: u32, remote_addr: u64) -> Self {
        UdDest {
            ah: rkey,
            remote_qpn: remote_addr as u32,
            remote_qkey: (remote_addr >> 32) as u32,
        }
    }

    /// Writes it into `wqe`.
    pub fn write(&self, wqe: &mut SendWqe) {
        wqe.rkey = self.ah.into();
        wqe.remote_addr = (u64::from(self.remote_qpn) | (u64::from(self.remote_qkey) << 32)).into();
    }
}

/// Bytes of the GRH a UD receive buffer starts with (before the message),
/// as on every RDMA device: on RoCEv2 over IPv4 the first 20 bytes are
/// zero and the last 20 are the packet's IPv4 header.
pub const GRH_SIZE: u32 = 40;

/// Q_Keys with this bit set are controlled: a UD send naming one uses the
/// sending QP's own Q_Key instead (IBA 10.2.5).
pub const QKEY_CONTROLLED: u32 = 0x8000_0000;

wire_struct! {
    /// Fixed part of a receive WQE; `num_sge` [`Sge`]s follow it.
    pub struct RecvWqe {
        pub wr_id: U64,
        pub num_sge: u8,
        pub reserved: [u8; 7],
    }
}

/// Completion flags (`enum ibv_wc_flags`).
pub mod wc_flags {
    pub const GRH: u8 = 1;
    pub const WITH_IMM: u8 = 1 << 1;
}

wire_struct! {
    /// A completion-queue entry.
    pub struct Cqe {
        pub wr_id: U64,
        /// A [`crate::verbs::WcStatus`].
        pub status: u8,
        /// A [`crate::verbs::WcOpcode`].
        pub opcode: u8,
        /// [`wc_flags`].
        pub wc_flags: u8,
        pub reserved: u8,
        pub vendor_err: U16,
        /// A UD receive's sender's LID on an InfiniBand port (0 on an
        /// Ethernet port, which has no LIDs, and in every other CQE).
        pub slid: U16,
        pub byte_len: U32,
        pub imm_data: [u8; 4],
        pub qp_num: U32,
        pub src_qp: U32,
    }
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
    /// The armed limit of an SRQ was crossed (fewer WQEs posted than
    /// `srq_limit`); `object` is the SRQN. The limit is disarmed.
    pub const SRQ_LIMIT: u16 = 5;
    /// A QP attached to an SRQ entered the error state: it takes no more
    /// receives from the SRQ; `object` is the QPN.
    pub const QP_LAST_WQE_REACHED: u16 = 6;
    /// The port went down (the host's datapath is gone); `object` is the
    /// port number (1). Written by the device's control plane, never by
    /// the datapath, which is what went away.
    pub const PORT_ERROR: u16 = 7;
}

wire_struct! {
    /// One entry of an event queue (device-writable buffers the driver posts).
    pub struct Event {
        pub kind: zerocopy::little_endian::U16,
        pub reserved: zerocopy::little_endian::U16,
        pub object: U32,
        pub reserved2: U64,
    }
}

pub use crate::limits::{MAX_CQ_DEPTH, MAX_RING_DEPTH, MAX_WQE_STRIDE};

/// Depth of a CQ that must hold `cqe` entries: the next power of two, up
/// to [`MAX_CQ_DEPTH`].
pub fn cq_depth(cqe: u32) -> Option<u32> {
    depth_up_to(cqe, MAX_CQ_DEPTH)
}

/// Bytes of a CQ ring of `depth` entries, header included.
pub fn cq_ring_bytes(depth: u32) -> u64 {
    RING_HEADER_SIZE as u64 + u64::from(depth) * CQE_SIZE as u64
}

/// Size of an [`Event`], which is also an event ring's stride.
pub const EVENT_SIZE: usize = core::mem::size_of::<Event>();

/// Bytes of an event ring of `depth` entries, header included.
pub fn event_ring_bytes(depth: u32) -> u64 {
    RING_HEADER_SIZE as u64 + u64::from(depth) * EVENT_SIZE as u64
}

/// Byte offset, from the ring's start, of entry `index` of an event ring of
/// `depth` entries (a valid depth: a power of two).
pub fn event_entry_offset(index: u32, depth: u32) -> u64 {
    RING_HEADER_SIZE as u64 + u64::from(index & depth.wrapping_sub(1)) * EVENT_SIZE as u64
}

/// Whether `depth` is a valid depth of an event ring: a power of two up to
/// [`MAX_RING_DEPTH`].
pub fn valid_depth(depth: u32) -> bool {
    depth.is_power_of_two() && depth <= MAX_RING_DEPTH
}

fn ring_depth(entries: u32) -> Option<u32> {
    depth_up_to(entries, MAX_RING_DEPTH)
}

/// The next power of two of `entries` (at least 1), if it is at most `max`.
fn depth_up_to(entries: u32, max: u32) -> Option<u32> {
    let depth = entries.max(1).checked_next_power_of_two()?;
    (depth <= max).then_some(depth)
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

/// The device's doorbell page: which QPs have new work.
///
/// One [`RING_ALIGN`]-aligned page of guest memory per device, given to it
/// with `SET_DOORBELL`. Its first cache line is written only by the device;
/// the summary and the bitmap are set by the driver (atomic OR) and cleared
/// by the device (atomic swap with 0, summary first, then the words it
/// named). A QP's bit is bit `db_index % 64` of bitmap word `db_index / 64`
/// (its `db_index` comes from `CREATE_QP`); that word's bit in the summary
/// is bit `(db_index / 64) % 64` of summary word `db_index / 4096`.
/// Bits only say where to look: the device reads the rings themselves, so a
/// driver that sets too many bits costs itself time, and one that sets too
/// few delays its own work.
pub mod doorbell {
    use crate::limits::MAX_QPS;

    /// Bytes of the page.
    pub const PAGE_SIZE: u64 = super::RING_ALIGN;
    /// Offset of the device's flags (`u32`, [`NEED_KICK`]).
    pub const FLAGS_OFFSET: u64 = 0;
    /// The device is about to sleep: after setting bits, notify the
    /// doorbell virtqueue.
    pub const NEED_KICK: u32 = 1;
    /// Offset of the summary: [`SUMMARY_WORDS`] little-endian `u64`s.
    pub const SUMMARY_OFFSET: u64 = super::CACHE_LINE as u64;
    /// Words of the bitmap, one bit per QP.
    pub const BITMAP_WORDS: usize = MAX_QPS as usize / 64;
    /// Words of the summary, one bit per bitmap word.
    pub const SUMMARY_WORDS: usize = BITMAP_WORDS.div_ceil(64);
    /// Offset of the bitmap: [`BITMAP_WORDS`] little-endian `u64`s.
    pub const BITMAP_OFFSET: u64 = 2 * super::CACHE_LINE as u64;

    const _: () = assert!(SUMMARY_WORDS * 8 <= super::CACHE_LINE);
    const _: () = assert!(BITMAP_OFFSET + BITMAP_WORDS as u64 * 8 <= PAGE_SIZE);

    /// Where the bit of the QP with doorbell index `db_index` is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Bit {
        /// Offset of its bitmap word in the page.
        pub word_offset: u64,
        /// Its mask in that word.
        pub mask: u64,
        /// Offset of the summary word naming that word.
        pub summary_offset: u64,
        /// The bitmap word's mask in the summary word.
        pub summary_mask: u64,
    }

    /// The bit of `db_index`, or `None` beyond [`MAX_QPS`].
    pub fn bit(db_index: u32) -> Option<Bit> {
        if db_index >= MAX_QPS {
            return None;
        }
        let word = u64::from(db_index / 64);
        Some(Bit {
            word_offset: BITMAP_OFFSET + word * 8,
            mask: 1 << (db_index % 64),
            summary_offset: SUMMARY_OFFSET + word / 64 * 8,
            summary_mask: 1 << (word % 64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn event_entries_follow_the_header_and_wrap() {
        assert_eq!(event_entry_offset(0, 8), 128);
        assert_eq!(event_entry_offset(3, 8), 128 + 3 * 16);
        assert_eq!(event_entry_offset(8, 8), 128, "index 8 wraps to slot 0");
        assert_eq!(event_entry_offset(u32::MAX, 8), 128 + 7 * 16);
    }

    #[test]
    fn layouts_are_fixed() {
        assert_eq!(RING_HEADER_SIZE, 128);
        assert_eq!(DEVICE_INDEX_OFFSET, 64);
        assert_eq!(DRIVER_ARM_OFFSET, 4);
        assert_eq!(size_of::<SendWqe>(), 48);
        assert_eq!(size_of::<RecvWqe>(), 16);
        assert_eq!(SGE_SIZE, 16);
        assert_eq!(CQE_SIZE, 32);
        assert_eq!(size_of::<Event>(), 16);
        assert_eq!(event_ring_bytes(4), 128 + 64);
    }

    #[test]
    fn doorbell_bits_cover_every_qp_inside_the_page() {
        let first = doorbell::bit(0).expect("first");
        assert_eq!(first.word_offset, doorbell::BITMAP_OFFSET);
        assert_eq!((first.mask, first.summary_mask), (1, 1));
        let b = doorbell::bit(64 * 65 + 3).expect("in range");
        assert_eq!(b.word_offset, doorbell::BITMAP_OFFSET + 65 * 8);
        assert_eq!(b.mask, 1 << 3);
        assert_eq!(b.summary_offset, doorbell::SUMMARY_OFFSET + 8);
        assert_eq!(b.summary_mask, 1 << 1);
        let last = doorbell::bit(crate::limits::MAX_QPS - 1).expect("last");
        assert!(last.word_offset + 8 <= doorbell::PAGE_SIZE);
        assert!(last.summary_offset < doorbell::BITMAP_OFFSET);
        assert_eq!(doorbell::bit(crate::limits::MAX_QPS), None);
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
        assert_eq!(sq_inline.stride, 256);
        // A WQE with one SGE is one cache line.
        assert_eq!(sq_geometry(1, 1, 16).expect("fits").stride, 64);
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
