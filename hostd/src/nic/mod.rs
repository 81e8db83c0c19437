//! The narrow interface hostd drives its NIC through.
//!
//! Everything a vdev asks of the hardware goes through [`Nic`]: memory slots
//! attached per device, memory regions, virtual QPs, posted work and a
//! progress call that executes work and emits completions per
//! (device, physical QP). [`soft::SoftNic`] models a BlueField-3-style NIC in
//! software; a VFIO or rdma-core backend can replace it behind this trait.
//!
//! Contract for every implementation: all checks (key owner, PD, access,
//! bounds, QP state) happen when a WQE *executes*, against the NIC's own
//! tables, so once a `deregister_mr` / `remove_memory` / `destroy_qp` call
//! returns, no later execution touches what it removed.

pub mod soft;

use std::time::Instant;

use vrdma_hostd_protocol::entries::{PhysCqe, PhysWqe};
use vrdma_hostd_protocol::messages::{MrRegistration, QpConnection};
use vrdma_hostd_protocol::shm::SharedMapping;

/// hostd's handle of one connected vdev. Never reused while hostd runs, so a
/// stale handle can only miss.
pub type DeviceId = u64;

pub use vrdma_hostd_protocol::entries::cqe_marker::UNSIGNALED as WC_UNSIGNALED;

/// Why a NIC operation was refused; each maps to the errno vdev receives.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NicError {
    #[error("Unknown device")]
    UnknownDevice,
    #[error("Memory slot {0} already exists")]
    SlotExists(u32),
    #[error("Unknown memory slot {0}")]
    UnknownSlot(u32),
    #[error("Key {0:#x} is already in use")]
    KeyInUse(u32),
    #[error("Unknown key {0:#x}")]
    UnknownKey(u32),
    #[error("Unknown virtual QP {0}")]
    UnknownQp(u32),
    #[error("Virtual QP {0} already exists")]
    QpExists(u32),
    #[error("Physical QP {0} is not granted to this device")]
    ForeignPqp(u32),
    #[error("Invalid argument: {0}")]
    Invalid(&'static str),
    #[error("Too many {0} for one device")]
    Limit(&'static str),
}

impl NicError {
    /// The Linux errno vdev gets for this refusal.
    pub fn errno(&self) -> i32 {
        match self {
            NicError::UnknownDevice
            | NicError::UnknownSlot(_)
            | NicError::UnknownKey(_)
            | NicError::UnknownQp(_) => libc::ENOENT,
            NicError::SlotExists(_) | NicError::KeyInUse(_) | NicError::QpExists(_) => libc::EEXIST,
            NicError::ForeignPqp(_) | NicError::Invalid(_) => libc::EINVAL,
            NicError::Limit(_) => libc::ENOSPC,
        }
    }
}

/// One completion for the completion ring of `pqp` of `device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub device: DeviceId,
    pub pqp: u32,
    pub cqe: PhysCqe,
}

/// What a progress call did and when the NIC next needs one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Some WQE executed, failed or was retried.
    pub worked: bool,
    /// Work is runnable right now (the call stopped at its budget).
    pub busy: bool,
    /// Earliest time a waiting WQE (RNR or transport retry) is due.
    pub next_due: Option<Instant>,
    /// A long message stopped between segments because a device of a
    /// higher rank is busy ([`Nic::set_rank`]).
    pub preempted: bool,
}

/// The NIC as hostd drives it.
pub trait Nic: Send {
    /// A vdev connected with `lid` and was granted `pqps`.
    fn attach_device(&mut self, device: DeviceId, lid: u16, pqps: &[u32]) -> Result<(), NicError>;
    /// The vdev is gone: its QPs, keys and memory go, nothing is completed.
    fn detach_device(&mut self, device: DeviceId);
    /// Memory slot `slot` of `device` is `mem`.
    fn add_memory(
        &mut self,
        device: DeviceId,
        slot: u32,
        mem: SharedMapping,
    ) -> Result<(), NicError>;
    /// Unmaps a slot; every key over it is revoked (it stays reserved until
    /// deregistered, but no access through it succeeds any more).
    fn remove_memory(&mut self, device: DeviceId, slot: u32) -> Result<(), NicError>;
    /// Records a memory region under its lkey and rkey.
    fn register_mr(&mut self, device: DeviceId, mr: &MrRegistration) -> Result<(), NicError>;
    /// Revokes a memory region by its lkey.
    fn deregister_mr(&mut self, device: DeviceId, lkey: u32) -> Result<(), NicError>;
    /// A virtual QP on one of the device's physical QPs.
    fn create_qp(&mut self, device: DeviceId, vqpn: u32, pd: u32, pqp: u32)
        -> Result<(), NicError>;
    /// Connects a virtual QP to its peer (reachability is the caller's job).
    fn connect_qp(&mut self, device: DeviceId, conn: &QpConnection) -> Result<(), NicError>;
    /// The remote access the QP grants its peer.
    fn set_qp_access(&mut self, device: DeviceId, vqpn: u32, access: u32) -> Result<(), NicError>;
    /// Moves the QP to ERR, flushing its work with WR_FLUSH_ERR.
    fn error_qp(&mut self, device: DeviceId, vqpn: u32) -> Result<(), NicError>;
    /// Moves the QP to RESET, discarding its work and connection.
    fn reset_qp(&mut self, device: DeviceId, vqpn: u32) -> Result<(), NicError>;
    /// Destroys the QP, discarding its work.
    fn destroy_qp(&mut self, device: DeviceId, vqpn: u32) -> Result<(), NicError>;
    /// Queues one WQE read from the submission ring of `pqp`.
    fn post(&mut self, device: DeviceId, pqp: u32, wqe: &PhysWqe);
    /// WQEs posted on `pqp` that have not completed yet (for back-pressure).
    fn outstanding(&self, device: DeviceId, pqp: u32) -> usize;
    /// Send WQEs of `device` posted and not completed or discarded yet
    /// (receives excluded): what the datapath's credits bound.
    fn queued_sends(&self, device: DeviceId) -> usize;
    /// [`Nic::queued_sends`] of every device together.
    fn total_queued_sends(&self) -> usize;
    /// The service rank of `device`'s work (0 first; hostd's priority
    /// classes). A NIC's arbiter lets work of a higher rank in between the
    /// packets of a lower rank's long message; a NIC that cannot may
    /// ignore it.
    fn set_rank(&mut self, device: DeviceId, rank: u8) {
        let _ = (device, rank);
    }

    /// Executes runnable work, at most about `budget` WQEs.
    fn progress(&mut self, now: Instant, budget: usize) -> Progress;
    /// Moves the completions produced so far into `out`, in order.
    fn take_completions(&mut self, out: &mut Vec<Completion>);
}
