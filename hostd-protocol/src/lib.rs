//! The interface between vdev (one per tenant, untrusted by hostd) and
//! hostd (one per host, the NIC).
//!
//! - [`messages`]: control messages on the unix socket (serde JSON, one
//!   message per `SOCK_SEQPACKET` datagram, bounded), with file descriptors
//!   (guest memory, doorbell and interrupt eventfds) passed as `SCM_RIGHTS`.
//! - [`channel`]: the seqpacket socket itself, peer credentials included.
//! - [`shm`]: guest memory as it is passed: memfds sealed against
//!   shrinking (hostd maps them in `vrdma_hostd::engine::guest`).
//!
//! There is no datapath between the two: hostd reads the guest's rings
//! itself, as a NIC does by DMA. hostd treats everything a vdev sends —
//! messages, ring addresses, descriptors — as hostile: a compromised vdev
//! is a hostile guest with more reach.

pub mod channel;
pub mod messages;
pub mod shm;
