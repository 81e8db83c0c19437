//! Harness for vrdma's integration tests.
//!
//! The tests run the real daemons as separate processes on real unix
//! sockets ([`daemon`], over `vrdma_tools::supervisor`) and drive them the
//! way their peers do: as a tenant application through the guest driver
//! ([`tenant`]: devices, connected queue pairs, completions), as a VMM with
//! the `vhost` crate's vhost-user frontend over memfd guest memory
//! ([`vmm`]), or as a compromised vdev speaking hostd's protocol by hand
//! ([`rogue`]); and they boot real guests under QEMU with vdev attached
//! ([`vm`]), recording what QEMU says to vdev on the way ([`vhost_tap`]),
//! and a guest running Linux Soft-RoCE on a tap in a network namespace
//! ([`vm::rxe`]). [`netns`] builds a cluster of hosts (network namespaces)
//! joined by a bridge or by the hostile relay, for the multi-host tests.
//! [`two_tenants`] runs unmodified client/server programs between two
//! tenants through the drop-in libibverbs, [`c_program`] compiles the C and
//! MPI programs they need, and [`ucx`] holds what UCX on vrdma needs (its
//! device node) and says (the transports it chose).
//! [`pyunit`] reads Python unittest's report (rdma-core's test suite).
//! [`need`] makes a missing tool a failure that says what to install.

pub use vrdma_tools::{app_memory, vmm};

pub mod c_program;
pub mod daemon;
pub mod hosts;
pub mod need;
pub mod netns;
pub mod pyunit;
pub mod qperf;
pub mod rng;
pub mod rogue;
pub mod tenant;
pub mod two_tenants;
pub mod ucx;
pub mod vhost_tap;
pub mod vm;
pub mod wrapped;

/// A program's arguments as owned strings (for argument lists built from
/// literals and formatted values).
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| (*a).to_owned()).collect()
}
