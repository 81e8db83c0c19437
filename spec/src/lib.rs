//! The vrdma device contract, shared by every side that speaks it.
//!
//! This crate is the single definition of the bytes that cross the guest ↔ vdev
//! boundary (and, later, vdev ↔ hostd): `docs/device-spec.md` is its prose twin.
//! Every structure is `#[repr(C)]` over little-endian, alignment-1 integer types
//! from `zerocopy`, so a structure *is* its wire layout: no padding, no host
//! endianness, and decoding untrusted bytes is a bounds-checked copy.
//!
//! - [`config`]: the virtio config space (device capabilities and limits).
//! - [`gid`]: the port's GID (an IPv4-mapped RoCEv2 address).
//! - [`control`]: control-queue commands and their payloads.
//! - [`cm`]: the connection manager's commands (`CM_*`) and the event
//!   records of the CM event queue.
//! - [`limits`]: what the format carries (SGEs, inline bytes, depths, QPs)
//!   and the arithmetic of what a QP is granted: one source for every side.
//! - [`ring`]: send/receive/completion/event ring layouts, WQE, CQE and
//!   event formats, the doorbell page.
//! - [`verbs`]: the verbs enumerations (states, opcodes, access flags, MTUs,
//!   work-completion status) with the numeric values libibverbs uses.
//! - [`qp_state`]: the RC queue-pair state machine and its attribute-mask rules.

pub mod cm;
pub mod config;
pub mod control;
pub mod gid;
pub mod limits;
pub mod qp_state;
pub mod ring;
pub mod verbs;

pub use zerocopy;

/// Defines a wire structure: `#[repr(C)]` over alignment-1 fields, so that
/// it is its own byte layout, with the zerocopy traits that read it from
/// untrusted bytes and write it back. Every field is public. A structure
/// marked `no Default:` has none (it holds a reserved array too long to
/// have one).
macro_rules! wire_struct {
    (no Default: $(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[derive(::zerocopy::FromBytes, ::zerocopy::IntoBytes, ::zerocopy::KnownLayout)]
        #[derive(::zerocopy::Immutable, ::zerocopy::Unaligned)]
        #[repr(C)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
        }
    };
    ($(#[$meta:meta])* pub struct $name:ident $fields:tt) => {
        $crate::wire_struct! { no Default: $(#[$meta])* #[derive(Default)] pub struct $name $fields }
    };
}
pub(crate) use wire_struct;

/// The virtio device id the virtio specification reserves for an RDMA device.
pub const VIRTIO_ID_RDMA: u32 = 42;

/// Device feature bit 0: the driver (the vhost-user frontend) comes back
/// to a restarted backend with its queues where they were, so the device
/// keeps its objects running while no backend serves it (device-spec §2).
/// A driver that does not ack it gets its device released with its
/// backend: its memory may be reused meanwhile (a VM's guest RAM), so no
/// work of it may run on.
pub const VRDMA_F_RECONNECT: u64 = 1 << 0;

/// Version of this contract. The major number changes when a layout changes
/// incompatibly; a driver refuses a device whose major number it does not know.
/// 2: hostd reads the rings itself — one doorbell page per device
/// (`SET_DOORBELL`), events in event rings (`CREATE_EQ`), send and receive
/// slots freed at completion. 3: the send WQE's fixed part is 48 bytes
/// (SGEs and inline data at slot offset 48, not 64), so that a one-SGE WQE
/// is one cache line.
pub const SPEC_VERSION_MAJOR: u16 = 3;
/// Minor version: changes that keep every layout, so an older driver of
/// the same major version works unchanged. 1: the port is RoCEv2 — link
/// layer Ethernet, LID 0, GID 0 an IPv4-mapped address of type RoCEv2 —
/// and MODIFY_QP's address vector must carry a GRH naming the peer's GID.
/// 2: shared receive queues (`CREATE_SRQ` … `DESTROY_SRQ`, `srqn` in
/// `CREATE_QP`, the SRQ_LIMIT and QP_LAST_WQE_REACHED events).
/// 3: the port's link layer may be InfiniBand — the port has a LID, an
/// address vector without a GRH names its destination by `dlid`, and a UD
/// receive's CQE carries the sender's LID in `slid` (the upper half of what
/// was a 32-bit `vendor_err`, never set before).
/// 4: the connection manager — the `CM_*` control commands and the CM
/// event queue (`DeviceAttr::cm_queue`, [`cm`]).
pub const SPEC_VERSION_MINOR: u16 = 4;

/// Index of the control virtqueue (verbs control path).
pub const CONTROL_QUEUE: u16 = 0;
/// Index of the doorbell virtqueue: a notification on it wakes the device's
/// ring poller ([`ring::doorbell`]). It carries no descriptors.
pub const DOORBELL_QUEUE: u16 = 1;
/// Index of the first event virtqueue; there is one per completion vector.
/// They carry no descriptors either: events are written into the vector's
/// event ring in guest memory (`CREATE_EQ`), and the queue's interrupt
/// (its used-buffer notification) says one arrived.
pub const FIRST_EVENT_QUEUE: u16 = 2;

/// Number of virtqueues a device with `num_comp_vectors` completion vectors has.
pub const fn num_queues(num_comp_vectors: u16) -> u16 {
    FIRST_EVENT_QUEUE + num_comp_vectors
}

/// Index of the CM event queue of a device with `num_comp_vectors`
/// completion vectors and a connection manager: the queue after the event
/// queues (a device with a CM has `num_queues(n) + 1` queues).
pub const fn cm_queue(num_comp_vectors: u16) -> u16 {
    FIRST_EVENT_QUEUE + num_comp_vectors
}

/// Largest control request or response the device accepts, header included.
pub const MAX_CONTROL_MSG: usize = 4096;
