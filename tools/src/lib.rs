//! vrdma's user-facing programs and what they share with the tests.
//!
//! The programs (`src/bin/`): `vrdma-demo` (RDMA between two tenants on
//! one host, no hardware, no VM), `vrdma-bench` (perftest-like
//! measurements with baselines) and `vrdma-guest` (the VM test's guest
//! side, also runnable on the host).
//!
//! The library:
//! - [`supervisor`]: hostd and vdevs as separate processes on unix
//!   sockets in a scratch directory, started, watched and stopped with
//!   every failure an error (the tests use it through `vrdma_tests::daemon`);
//! - [`relay`]: the hostile network between hosts of a multi-host test
//!   (`vrdma-relay`): a learning switch that harms RoCEv2 frames;
//! - [`verbs`]: opening a device, RC queue pairs and their connection,
//!   signaled RDMA work requests, polling for completions;
//! - [`app_memory`]: memory as an application owns it, for `reg_mr`;
//! - [`vmm`]: playing the VMM over the vhost-user protocol with memfd guest
//!   memory and hand-written descriptor chains (the bench times control
//!   commands with it; the tests write hostile chains with it). As a
//!   test fixture, it panics on what it does not expect.

pub mod app_memory;
pub mod relay;
pub mod supervisor;
pub mod verbs;
pub mod vmm;
