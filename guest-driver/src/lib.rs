//! The vrdma guest driver: the library an RDMA application links to drive a
//! vrdma device.
//!
//! In process ("virtio-user") mode the application itself is the vhost-user
//! frontend of vdev, the way DPDK's virtio-user works: its memfd-backed DMA
//! memory is the "guest memory" (guest-physical address == virtual address),
//! and it sets the virtqueues up itself. A virtio-pci transport for VM mode
//! reuses the same core behind the [`transport::Transport`] trait: inside a
//! Linux guest the application drives the virtio-pci function from
//! userspace (like DPDK's virtio PMD), and the transport's
//! [`transport::MemoryModel`] decides how DMA memory is made (memfds shared
//! over vhost-user, or hugepages and pinned pages at guest-physical
//! addresses).
//!
//! Modules, bottom up:
//! - [`dma`]: DMA arenas (memfds or hugepages) and their allocator.
//! - [`pagemap`]: physical addresses of this process's pages.
//! - `memory`: the memory model of the transport (arenas, `reg_mr` memory).
//! - [`virtqueue`]: the driver side of a split virtqueue.
//! - [`transport`]: the transport trait, vhost-user and virtio-pci.
//! - [`ring`]: the send/receive/completion rings of the data path.
//! - `doorbell`: the doorbell page (which QPs have new work).
//! - `event_ring`: the event rings, one per completion vector.
//! - `user_mem`: moving application memory onto shared memory for `reg_mr`;
//!   `write_freeze` holds the other threads' writes while pages move,
//!   `fork_copy` gives a forked child its own copy of the shared pages,
//!   `raw_mm` makes the mapping system calls past programs' hooks.
//! - `control`: the control queue (verbs commands).
//! - [`device`]: device bring-up, commands, doorbells, events.
//! - [`verbs`]: the verbs-shaped API ([`Context`] and the objects it makes).
//! - [`cm`]: the device's connection manager (rdma_cm): CM channels
//!   ([`Context::cm_channel`]) over the `CM_*` commands, and the CM event
//!   queue whose records are dispatched to their channels.
//!
//! Wire formats all come from [`vrdma_spec`].

pub mod cm;
mod control;
pub mod device;
pub mod dma;
pub mod error;
mod event_ring;
mod fork_copy;
mod memory;
pub mod pagemap;
mod raw_mm;
pub mod ring;
#[cfg(test)]
mod testing;
pub mod transport;
mod user_mem;
pub mod verbs;
pub mod virtqueue;
mod write_freeze;

pub use cm::{move_flags, CmChannel, CmEvent, CmId, ConnParam, MoveOverrides};
pub use device::{DeviceEvent, DeviceOptions};
pub use error::{DestroyError, Error, PostError, Result};
pub use ring::{RecvWr, SendPayload, SendWr, Sge, UdDest, WorkCompletion};
pub use transport::{MemoryModel, PciDevice, Transport, VhostUserTransport, VirtioPciTransport};
pub use verbs::{
    AddressHandle, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpCapabilities,
    QpInitAttr, QueuePair, RecvBatch, SendBatch, SharedReceiveQueue,
};
pub use vrdma_spec;
