//! Errors of the verbs control path, each with the errno a verbs library
//! hands to the application.

use vrdma_spec::qp_state::TransitionError;

use super::FdError;
use crate::fabric::FabricError;
use crate::shadow::ShadowError;

/// Why a control verb failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbError {
    #[error("Invalid argument: {0}")]
    Invalid(String),
    #[error("No {kind} with handle {handle}")]
    NoObject { kind: &'static str, handle: u32 },
    #[error("{kind} {handle} is still used by {users}")]
    Busy {
        kind: &'static str,
        handle: u32,
        users: String,
    },
    #[error("Limit `{limit}` reached ({current} of {max})")]
    Limit {
        limit: &'static str,
        current: u64,
        max: u64,
    },
    #[error("Bad guest memory range")]
    Fault(#[source] ShadowError),
    #[error("Ring at {addr:#x} ({bytes} bytes) is misaligned or not in guest memory")]
    Ring { addr: u64, bytes: u64 },
    #[error("Not supported: {0}")]
    Unsupported(&'static str),
    #[error("Invalid QP transition")]
    Transition(#[source] TransitionError),
    #[error("Malformed command: {0}")]
    Malformed(String),
    #[error("Already set: {0}")]
    Exists(String),
    #[error("The fabric (hostd) refused")]
    Fabric(#[source] FabricError),
    #[error("No eventfd for hostd")]
    Notify(#[source] FdError),
    #[error("Not permitted: {0}")]
    Privileged(&'static str),
    #[error("No such device: {0}")]
    NoDevice(&'static str),
    #[error("The connection manager refused")]
    Cm(#[source] crate::cm::CmError),
    #[error("Cannot watch a CM channel")]
    Io(#[source] std::io::Error),
    #[error("The device's context was lost with its previous vdev: {0}")]
    Lost(String),
    #[error("The previous vdev answered this command with errno {0}")]
    Replayed(i32),
    #[error("hostd refused the guest memory at {gpa:#x}: {reason}")]
    SlotRefused {
        gpa: u64,
        errno: i32,
        reason: String,
    },
}

impl VerbError {
    /// The request to hostd met a handover: the command can run again once
    /// the context is on the new hostd.
    pub fn handed_over(&self) -> bool {
        matches!(self, VerbError::Fabric(FabricError::HandedOver))
    }

    /// The positive Linux errno this error is reported as.
    pub fn errno(&self) -> i32 {
        match self {
            VerbError::Invalid(_)
            | VerbError::NoObject { .. }
            | VerbError::Transition(_)
            | VerbError::Ring { .. }
            | VerbError::Malformed(_) => libc::EINVAL,
            VerbError::Busy { .. } => libc::EBUSY,
            VerbError::Limit { .. } => libc::ENOMEM,
            VerbError::Fault(_) => libc::EFAULT,
            VerbError::Unsupported(_) => libc::EOPNOTSUPP,
            VerbError::Exists(_) => libc::EEXIST,
            VerbError::Fabric(e) => e.errno(),
            VerbError::Notify(e) => e.errno(),
            VerbError::Privileged(_) => libc::EPERM,
            VerbError::NoDevice(_) => libc::ENODEV,
            VerbError::Cm(e) => e.errno(),
            VerbError::Io(_) | VerbError::Lost(_) => libc::EIO,
            VerbError::Replayed(errno) => *errno,
            VerbError::SlotRefused { errno, .. } => *errno,
        }
    }
}

/// Result of a control verb.
pub type VerbResult<T> = Result<T, VerbError>;
