//! Tests of the crate as a whole: byte layouts against the offsets of the
//! notes (§2.5), round trips, and agents wired back to back.

mod agent;
mod layout;
mod roundtrip;
