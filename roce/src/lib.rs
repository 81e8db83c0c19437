//! The RoCEv2 wire format vrdma speaks between hosts: InfiniBand transport
//! headers (BTH and extension headers) in UDP datagrams to port 4791, ended
//! by the invariant CRC, exactly as Linux rxe sends them (see
//! `docs/wire.md`).
//!
//! - [`parse`] / [`parse_ipv4`]: a received datagram (UDP payload, or the
//!   whole IPv4 packet a raw socket hands) to a [`Packet`] borrowing its
//!   payload, or the [`DropReason`] it is dropped for. Every byte is hostile:
//!   bounds-checked, no panic path, each malformation its own counter label.
//! - [`build`] / [`build_vectored`] / [`finish_in_place`]: [`Headers`] and a
//!   payload to the UDP payload of a packet (headers, payload, pad, ICRC).
//! - [`icrc`]: the invariant CRC, over the IPv4/UDP/BTH fields no router
//!   changes.
//! - [`Psn`]: 24-bit sequence number arithmetic.
//!
//! Nothing here allocates: the datapath runs it per packet.

mod error;
mod headers;
mod icrc;
mod ipv4;
mod opcode;
mod packet;
mod psn;

#[cfg(test)]
mod tests;

pub use error::{BuildError, DropReason};
pub use headers::{
    Aeth, AtomicAckEth, AtomicEth, Bth, Deth, NakCode, Reth, AETH_CREDITS_INVALID, DEFAULT_PKEY,
};
pub use icrc::{icrc, ICRC_SEED};
pub use ipv4::{write_ipv4_udp_header, Ipv4Meta, IPV4_HEADER_LEN, IP_DF, UDP_HEADER_LEN};
pub use opcode::{Opcode, OpcodeInfo, Operation, Position, Transport, OPCODES};
pub use packet::{
    build, build_vectored, finish_in_place, header_len, packet_len, pad_for, parse, parse_ipv4,
    Headers, Packet,
};
pub use psn::{Psn, PSN_MASK};

/// The UDP destination port of RoCEv2 (IANA).
pub const ROCE_V2_PORT: u16 = 4791;
/// Base Transport Header.
pub const BTH_LEN: usize = 12;
/// RDMA Extended Transport Header.
pub const RETH_LEN: usize = 16;
/// ACK Extended Transport Header.
pub const AETH_LEN: usize = 4;
/// Atomic Extended Transport Header.
pub const ATOMIC_ETH_LEN: usize = 28;
/// Atomic Acknowledge Extended Transport Header.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
/// Immediate data.
pub const IMM_LEN: usize = 4;
/// Invalidate Extended Transport Header.
pub const IETH_LEN: usize = 4;
/// Datagram Extended Transport Header.
pub const DETH_LEN: usize = 8;
/// Invariant CRC.
pub const ICRC_LEN: usize = 4;
/// The longest BTH + extension headers of any opcode (RC COMPARE SWAP).
pub const MAX_HEADER_LEN: usize = BTH_LEN + ATOMIC_ETH_LEN;
