//! The interface between vdev (one per tenant, untrusted by hostd) and
//! hostd (one per host, the NIC).
//!
//! - [`messages`]: control messages on the unix socket (serde JSON, one
//!   message per `SOCK_SEQPACKET` datagram, bounded), with file descriptors
//!   (guest memory, queue memory, eventfds) passed as `SCM_RIGHTS`.
//! - [`channel`]: the seqpacket socket itself, peer credentials included.
//! - [`shm`]: shared memory mappings and the single-producer single-consumer
//!   rings that carry physical work and completions.
//! - [`entries`]: the physical WQE and CQE formats in those rings.
//!
//! hostd treats everything a vdev sends — messages, ring indices, entries —
//! as hostile: a compromised vdev is a hostile guest with more reach.

pub mod channel;
pub mod entries;
pub mod messages;
pub mod shm;
