//! How the driver core reaches a device: the [`Transport`] trait.
//!
//! The core (virtqueues, rings, verbs) only needs what every virtio transport
//! offers: feature negotiation, config space, queue setup, notifications
//! both ways, and a way to tell the device which memory it may use. Process
//! mode implements it over vhost-user ([`vhost_user`]), VM mode over
//! virtio-pci from userspace ([`virtio_pci`]).

use std::io;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use crate::dma::DmaRegion;

pub mod vhost_user;
pub mod virtio_pci;

pub use vhost_user::VhostUserTransport;
pub use virtio_pci::{PciDevice, VirtioPciTransport};

/// How the device reaches the driver's memory: a property of the transport,
/// which decides where DMA arenas come from and what `reg_mr` does with
/// application memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryModel {
    /// Process mode (vhost-user): the device sees only memory the driver
    /// shares with [`Transport::add_memory`] — memfd arenas, and application
    /// pages moved onto memfds by `reg_mr` — at device address == virtual
    /// address.
    SharedFiles,
    /// VM mode (virtio-pci): the device reaches all guest-physical memory and
    /// is told nothing. DMA arenas are hugepages at known physical
    /// addresses; `reg_mr` pins application pages, translates them through
    /// `/proc/self/pagemap` and registers their physical segments
    /// (`REG_MR_SG`).
    GuestPhysical,
}

/// `VIRTIO_F_VERSION_1`: a virtio 1.x (modern, little-endian) device.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// `VIRTIO_RING_F_EVENT_IDX`: `used_event`/`avail_event` suppression.
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

/// Errors of a transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("Cannot connect to the vhost-user socket {path}")]
    Connect {
        path: std::path::PathBuf,
        #[source]
        source: vhost::Error,
    },
    #[error("vhost-user request {request} failed")]
    VhostUser {
        request: &'static str,
        #[source]
        source: vhost::Error,
    },
    #[error("The device went away (its vhost-user socket closed)")]
    Disconnected,
    #[error("The device came back with {now} queues instead of {was}")]
    QueueCountChanged { was: u16, now: u64 },
    #[error("Queue {0}'s used ring is not in memory the device was given")]
    RingOutsideMemory(u16),
    #[error("Cannot read the used index of queue {queue}")]
    UsedIndex {
        queue: u16,
        #[source]
        source: io::Error,
    },
    #[error("Cannot keep a memory region's file descriptor")]
    RegionFd(#[source] io::Error),
    #[error(
        "vdev at {path} did not take this connection within {waited:?}: it serves \
         another application (one application per device at a time)"
    )]
    Busy {
        path: std::path::PathBuf,
        waited: Duration,
    },
    #[error("Cannot watch the vhost-user socket")]
    Watch(#[source] io::Error),
    #[error("Device does not offer {0}")]
    MissingFeature(&'static str),
    #[error("Device has {0} queues, more than vhost-user allows")]
    TooManyQueues(u64),
    #[error("Queue {0} does not exist")]
    NoQueue(u16),
    #[error("Config read of {expected} bytes returned {got}")]
    ConfigSize { expected: usize, got: usize },
    #[error("Cannot create an eventfd")]
    EventFd(#[source] io::Error),
    #[error("Cannot notify queue {queue}")]
    Notify {
        queue: u16,
        #[source]
        source: io::Error,
    },
    #[error("Cannot wait for an interrupt of queue {queue}")]
    Wait {
        queue: u16,
        #[source]
        source: io::Error,
    },
    /// Boxed: it is large, and every driver error carries a transport error.
    #[error("virtio-pci device")]
    Pci(#[source] Box<virtio_pci::PciError>),
}

impl From<virtio_pci::PciError> for TransportError {
    fn from(e: virtio_pci::PciError) -> Self {
        TransportError::Pci(Box::new(e))
    }
}

/// Addresses of one virtqueue, as the device sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSetup {
    pub index: u16,
    pub size: u16,
    pub desc_addr: u64,
    pub avail_addr: u64,
    pub used_addr: u64,
}

/// A way to reach a vrdma device. All methods take `&self`: notifications
/// come from any thread, so implementations lock what they must.
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// How long the transport waits for a device that went away to come
    /// back (a restarted vdev) before it reports it gone; zero: not at all.
    /// Transports whose device cannot go away ignore it.
    fn set_reconnect_patience(&self, _patience: Duration) {}

    /// Whether the transport comes back to a restarted backend with its
    /// queues where they were (the driver then acks `VRDMA_F_RECONNECT`).
    fn reconnects(&self) -> bool {
        false
    }

    /// How the device reaches the driver's memory.
    fn memory_model(&self) -> MemoryModel {
        MemoryModel::SharedFiles
    }

    /// Acknowledges the features in `wanted` that the device offers and
    /// returns them (transport bits the transport needs itself are added).
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError>;

    /// Number of virtqueues the device has.
    fn num_queues(&self) -> u16;

    /// Reads `buf.len()` bytes of config space at `offset`.
    fn read_config(&self, offset: u32, buf: &mut [u8]) -> Result<(), TransportError>;

    /// Lets the device use a region of memory ([`MemoryModel::SharedFiles`]
    /// only: the driver never calls it for the other model).
    fn add_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError>;

    /// Takes a region added with [`Transport::add_memory`] away again.
    fn remove_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError>;

    /// Sets a virtqueue up and enables it.
    fn setup_queue(&self, queue: &QueueSetup) -> Result<(), TransportError>;

    /// Every queue is set up: the device may start (virtio's DRIVER_OK).
    /// Queues are notified only after this.
    fn activate(&self) -> Result<(), TransportError> {
        Ok(())
    }

    /// Notifies ("kicks") a queue.
    fn notify(&self, queue: u16) -> Result<(), TransportError>;

    /// Waits for an interrupt of `queue`, up to `timeout` (`None`: forever).
    /// Returns whether one came.
    fn wait(&self, queue: u16, timeout: Option<Duration>) -> Result<bool, TransportError>;

    /// A file descriptor that becomes readable on an interrupt of `queue`,
    /// for applications that multiplex with poll/epoll. After it was
    /// readable, [`Transport::acknowledge`] clears it.
    fn interrupt_fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        let _ = queue;
        None
    }

    /// Clears the interrupt [`Transport::interrupt_fd`] of `queue` reported
    /// (without blocking), so that the next one makes it readable again.
    fn acknowledge(&self, queue: u16) -> Result<(), TransportError> {
        let _ = queue;
        Ok(())
    }
}

/// A shared transport is a transport (lets a caller keep a handle on it).
impl<T: Transport + ?Sized> Transport for std::sync::Arc<T> {
    fn set_reconnect_patience(&self, patience: Duration) {
        (**self).set_reconnect_patience(patience)
    }
    fn reconnects(&self) -> bool {
        (**self).reconnects()
    }
    fn memory_model(&self) -> MemoryModel {
        (**self).memory_model()
    }
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        (**self).negotiate_features(wanted)
    }
    fn num_queues(&self) -> u16 {
        (**self).num_queues()
    }
    fn read_config(&self, offset: u32, buf: &mut [u8]) -> Result<(), TransportError> {
        (**self).read_config(offset, buf)
    }
    fn add_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        (**self).add_memory(region)
    }
    fn remove_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        (**self).remove_memory(region)
    }
    fn setup_queue(&self, queue: &QueueSetup) -> Result<(), TransportError> {
        (**self).setup_queue(queue)
    }
    fn activate(&self) -> Result<(), TransportError> {
        (**self).activate()
    }
    fn notify(&self, queue: u16) -> Result<(), TransportError> {
        (**self).notify(queue)
    }
    fn wait(&self, queue: u16, timeout: Option<Duration>) -> Result<bool, TransportError> {
        (**self).wait(queue, timeout)
    }
    fn interrupt_fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        (**self).interrupt_fd(queue)
    }
    fn acknowledge(&self, queue: u16) -> Result<(), TransportError> {
        (**self).acknowledge(queue)
    }
}
