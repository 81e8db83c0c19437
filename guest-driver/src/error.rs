//! The crate's error type, and the errno each error means to a verbs caller.

use std::io;

use crate::dma::DmaError;
use crate::transport::virtio_pci::PciError;
use crate::transport::TransportError;
use crate::virtqueue::QueueError;

/// Errors of the driver.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device refused a command with this positive Linux errno.
    #[error("Device refused the request with errno {0}")]
    Device(i32),
    #[error("Transport failure")]
    Transport(#[from] TransportError),
    #[error("DMA memory failure")]
    Dma(#[from] DmaError),
    #[error("Virtqueue failure")]
    Queue(#[from] QueueError),
    #[error("Invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The work queue has no free slot (`ENOMEM`, as mlx5 reports it).
    #[error("Work queue is full")]
    QueueFull,
    #[error("Device is not a usable vrdma device: {0}")]
    BadDevice(String),
    #[error("Device broke the protocol: {0}")]
    Protocol(&'static str),
    #[error("Device did not answer within {0:?}")]
    Timeout(std::time::Duration),
    #[error("Control queue is unusable after an earlier failure")]
    ControlBroken,
    #[error("Cannot {what}")]
    Os {
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// The positive errno a verbs library returns for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Device(errno) => *errno,
            Error::InvalidArgument(_) => libc::EINVAL,
            Error::QueueFull => libc::ENOMEM,
            Error::Dma(DmaError::OutOfMemory { .. }) => libc::ENOMEM,
            Error::Timeout(_) => libc::ETIMEDOUT,
            Error::Protocol(_) => libc::EPROTO,
            Error::BadDevice(_) => libc::ENODEV,
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Transport(TransportError::Busy { .. }) => libc::EBUSY,
            Error::Transport(TransportError::Pci(e))
                if matches!(**e, PciError::Busy(_) | PciError::AllBusy { .. }) =>
            {
                libc::EBUSY
            }
            Error::Transport(_) | Error::Dma(_) | Error::Queue(_) | Error::ControlBroken => {
                libc::EIO
            }
        }
    }
}

/// Result of the driver.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failed `post_send`/`post_recv`: work requests before `bad_wr` were
/// posted, the one at `bad_wr` and those after it were not.
#[derive(Debug, thiserror::Error)]
#[error("Work request {bad_wr} was not posted")]
pub struct PostError {
    pub bad_wr: usize,
    #[source]
    pub error: Error,
}

impl PostError {
    /// The errno of the failure.
    pub fn errno(&self) -> i32 {
        self.error.errno()
    }
}

/// A failed explicit destroy: the object is handed back, still alive.
#[derive(Debug, thiserror::Error)]
#[error("Cannot destroy the object")]
pub struct DestroyError<T: std::fmt::Debug> {
    pub object: T,
    #[source]
    pub error: Error,
}

impl<T: std::fmt::Debug> DestroyError<T> {
    /// The outcome of destroying `object`: on failure, `object` is handed
    /// back with the error.
    pub(crate) fn hand_back(object: T, result: Result<()>) -> Result<(), Self> {
        result.map_err(|error| DestroyError { object, error })
    }

    /// The errno of the failure (e.g. `EBUSY` for a PD that still has MRs).
    pub fn errno(&self) -> i32 {
        self.error.errno()
    }
}
