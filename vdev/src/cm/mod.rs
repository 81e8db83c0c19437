//! The device's connection manager: rdma_cm's semantics (CM IDs, port
//! spaces, address and route resolution, connect/accept/reject,
//! disconnect, SIDR for UD) over vrdma-cm's sans-IO [`Agent`], whose MADs
//! travel on the device's QP1 through hostd (`GsiNotify`, `SendMad`,
//! `TakeMads`).
//!
//! - [`ports`]: the device's port spaces (bind, EADDRINUSE, port 0).
//! - [`ids`]: CM IDs and their states.
//! - [`state`]: the service's state under one lock — the agent, the IDs,
//!   the owners' event queues — and every command and MAD applied to it;
//!   `state/events.rs` turns the agent's events into rdma_cm events and
//!   checks connect requests as Linux's cma does.
//! - [`event`]: rdma_cm events as fixed-size records, queued per owner
//!   with an eventfd.
//! - [`qp_attr`]: `rdma_init_qp_attr` for INIT, RTR and RTS.
//! - [`counters`]: what the service did, for reports.
//! - [`service`]: [`CmService`], the thread that sleeps on QP1's eventfd
//!   and the agent's next deadline, and [`CmOwner`], the handle through
//!   which one owner (an event channel of a context) issues commands.
//!
//! Each command of [`CmOwner`] is one rdma_cm call (one control-queue
//! command of the device), answered at once; what rdma_cm reports
//! asynchronously comes as a [`CmEvent`] on the owner's queue, whose
//! eventfd is signalled when one is queued. Nothing here touches a QP: the
//! caller moves its QPs with [`CmOwner::init_qp_attr`]'s attributes.

pub mod counters;
pub mod event;
pub mod ids;
pub mod ports;
pub mod qp_attr;
pub mod service;
pub mod state;

use std::fmt;

pub use counters::CmCounters;
pub use event::{AhAttr, CmEvent, CmEventKind};
pub use ids::{IdInfo, IdState, PathRecord};
pub use qp_attr::QpAttr;
pub use service::{CmOwner, CmService};
pub use state::{CmConfig, ADDR_ERROR_STATUS, UNREACHABLE_STATUS};
pub use vrdma_cm::PortSpace;

use crate::fabric::FabricError;

/// A CM ID, unique within its device's service for the service's life
/// (never 0: 0 means "none" in an event's `listen_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdNum(pub u32);

impl fmt::Display for IdNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cm-id {}", self.0)
    }
}

/// An owner of CM IDs (an event channel of one context): its IDs'
/// events go to its queue, and closing it destroys its IDs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId(pub u32);

pub use vrdma_spec::cm::ConnParam;

/// Why a command was refused (nothing changed), with the errno rdma_cm
/// would give.
#[derive(Debug, thiserror::Error)]
pub enum CmError {
    #[error("No CM ID {0} for this owner")]
    UnknownId(IdNum),
    #[error("No owner {0:?}")]
    UnknownOwner(OwnerId),
    #[error("{id} is {state:?}, where {op} is not allowed")]
    WrongState {
        id: IdNum,
        state: IdState,
        op: &'static str,
    },
    #[error("Cannot bind")]
    Port(#[source] ports::PortError),
    #[error("{0} is not an address of this device")]
    AddressNotAvailable(std::net::Ipv4Addr),
    #[error("Port space {0:?} with this QP type is not supported")]
    Unsupported(PortSpace),
    #[error("{len} bytes of private data do not fit the {max} the message carries")]
    PrivateDataTooLong { len: usize, max: usize },
    #[error("The device's GID is not an IPv4-mapped address")]
    NotIpv4,
    #[error("Too many {0}")]
    TooMany(&'static str),
    #[error("The connection manager refused")]
    Agent(#[source] vrdma_cm::AgentError),
    #[error("Cannot talk to hostd")]
    Fabric(#[source] FabricError),
    #[error("Cannot create an eventfd")]
    Io(#[source] std::io::Error),
    #[error("Cannot start the connection manager's thread")]
    Thread(#[source] std::io::Error),
}

impl CmError {
    /// The errno to hand the command's caller.
    pub fn errno(&self) -> i32 {
        match self {
            CmError::UnknownId(_) | CmError::UnknownOwner(_) | CmError::WrongState { .. } => {
                libc::EINVAL
            }
            CmError::Port(ports::PortError::InUse { .. }) => libc::EADDRINUSE,
            CmError::Port(ports::PortError::Exhausted(_)) => libc::EADDRNOTAVAIL,
            CmError::AddressNotAvailable(_) => libc::EADDRNOTAVAIL,
            CmError::Unsupported(_) => libc::EOPNOTSUPP,
            CmError::PrivateDataTooLong { .. } => libc::EINVAL,
            CmError::NotIpv4 => libc::EAFNOSUPPORT,
            CmError::TooMany(_) => libc::ENOMEM,
            CmError::Agent(vrdma_cm::AgentError::TooManyConnections(_))
            | CmError::Agent(vrdma_cm::AgentError::TooManyListeners(_)) => libc::ENOMEM,
            CmError::Agent(vrdma_cm::AgentError::AlreadyListening(_)) => libc::EADDRINUSE,
            CmError::Agent(_) => libc::EINVAL,
            CmError::Fabric(e) => e.errno(),
            CmError::Io(_) | CmError::Thread(_) => libc::EIO,
        }
    }
}

#[cfg(test)]
mod tests;
