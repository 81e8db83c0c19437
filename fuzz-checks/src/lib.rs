//! Check functions for vrdma's decoders of untrusted input.
//!
//! Each module has one `check(data: &[u8])` that turns fuzzer bytes into
//! input for a real decoder of vrdma (not a copy), runs it and asserts the
//! decoder's invariants, panicking on a violation. The cargo-fuzz targets in
//! `fuzz/` and the property tests and corpus replay in `tests/` call the
//! same functions, so a finding of one is a test of the other.
//!
//! - [`control`]: control-queue chains through `control::process_chain`
//!   and commands through `RdmaDevice::execute`, on a device alone or
//!   attached to a real hostd.
//! - [`wqe`]: hostd's WQE reader over any ring slot.
//! - [`rings`]: a hostile guest's own rings against hostd's engine.
//! - [`hostd`]: hostd's request decoder and its reading of doorbell pages.
//! - [`hostd_session`]: hostd's handling of a compromised vdev's requests,
//!   through a real `Server` over a socketpair.
//! - [`policy`]: the tenant policy file parser.
//! - [`journal`]: a dead vdev's journal as its successor rebuilds a
//!   context from it.
//! - [`handover`]: the blob a running hostd hands a new hostd.
//! - [`memory`]: memory-table changes interleaved with MRs and key lookups.
//! - [`roce`]: the RoCEv2 packet parser (what a peer host sends).
//! - [`cm`]: the IB CM MAD codec and agent (what a peer's CM sends to QP1).
//! - [`wire`]: hostile packets from the network against hostd's engine on
//!   a wire (UD, UC and RC between hosts).

pub mod cm;
pub mod control;
pub mod handover;
pub mod hostd;
pub mod hostd_session;
pub mod input;
pub mod journal;
pub mod memory;
pub mod policy;
pub mod rings;
pub mod roce;
pub mod server;
pub mod wire;
pub mod wqe;

/// A check function: panics when `data` breaks an invariant.
pub type Check = fn(&[u8]);

/// The fuzz targets, by the name of their corpus directory.
pub const TARGETS: &[(&str, Check)] = &[
    ("control", control::check),
    ("wqe", wqe::check),
    ("rings", rings::check),
    ("hostd_request", hostd::check),
    ("hostd_session", hostd_session::check),
    ("policy", policy::check),
    ("memory", memory::check),
    ("roce_packet", roce::check),
    ("cm_mad", cm::check),
    ("wire_packets", wire::check),
    ("journal", journal::check),
    ("handover", handover::check),
];
