//! Harness for vrdma's integration tests.
//!
//! The tests run the real daemons as separate processes on real unix
//! sockets ([`daemon`]) and drive them the way their peers do: as a VMM with
//! the `vhost` crate's vhost-user frontend over memfd guest memory
//! ([`vmm`]), or as a tenant application through the guest driver; and as
//! a compromised vdev speaking hostd's protocol by hand ([`rogue`]).

pub mod daemon;
pub mod rogue;
pub mod tenant;
pub mod vmm;
