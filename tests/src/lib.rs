//! Harness for vrdma's integration tests.
//!
//! The tests run the real daemons as separate processes on real unix
//! sockets ([`daemon`]) and drive them the way their peers do: as a VMM with
//! the `vhost` crate's vhost-user frontend over memfd guest memory
//! ([`vmm`]), or as a tenant application through the guest driver, or as
//! a compromised vdev speaking hostd's protocol by hand ([`rogue`]); and
//! they boot real guests under QEMU with vdev attached ([`vm`]), recording
//! what QEMU says to vdev on the way ([`vhost_tap`]).

pub mod app_memory;
pub mod daemon;
pub mod rng;
pub mod rogue;
pub mod tenant;
pub mod vhost_tap;
pub mod vm;
pub mod vmm;
