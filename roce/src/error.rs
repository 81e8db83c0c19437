//! Why a received packet is dropped, and why a packet cannot be built.

use crate::opcode::Opcode;

/// Why a received packet was dropped. Every packet from the wire is hostile:
/// each malformation has its own variant, and [`DropReason::name`] gives a
/// stable label for the drop counters (`vrdmactl` shows them, so an
/// operator can tell a misconfigured peer from a corrupting link).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DropReason {
    /// Shorter than its headers (IPv4, UDP, BTH, the opcode's extension
    /// headers, ICRC) say it must be.
    #[error("Packet shorter than its headers")]
    Truncated,
    /// Not IPv4, an IPv4 header with options (IHL other than 5), not UDP,
    /// or an IPv4 total length that is not the packet's length.
    #[error("Malformed IPv4 header")]
    BadIpHeader,
    /// The IPv4 header checksum is wrong (the ICRC leaves it out).
    #[error("Bad IPv4 header checksum")]
    BadIpChecksum,
    /// An IPv4 fragment (MF set or a fragment offset): RoCEv2 packets are
    /// never fragmented, and the ICRC could not be checked on a piece.
    #[error("IPv4 fragment")]
    IpFragment,
    /// The UDP length field disagrees with the IPv4 length.
    #[error("Malformed UDP header")]
    BadUdpHeader,
    /// UDP destination port is not 4791.
    #[error("Not a RoCEv2 packet (UDP destination port is not 4791)")]
    NotRoce,
    /// BTH transport header version is not 0.
    #[error("BTH transport version is not 0")]
    BadVersion,
    /// An opcode vrdma does not speak (RD, CNP, FLUSH, reserved ones...).
    #[error("Unknown or unsupported opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// The UDP payload is not a multiple of 4 bytes, or an opcode without
    /// payload carries bytes after its headers.
    #[error("Packet length does not fit its opcode")]
    BadLength,
    /// The BTH pad count is larger than the payload, pad bytes are not
    /// zero, or an opcode without payload has a pad count.
    #[error("Bad BTH pad count or pad bytes")]
    BadPad,
    /// A reserved field (BTH resv6a and resv7, DETH's top byte) is not 0.
    #[error("Reserved header bits set")]
    ReservedBits,
    /// An AETH with a reserved syndrome or an unknown NAK code.
    #[error("Malformed AETH syndrome")]
    BadAeth,
    /// The invariant CRC does not match the packet.
    #[error("Bad ICRC")]
    BadIcrc,
}

impl DropReason {
    /// How many distinct labels [`DropReason::name`] gives (the size of a
    /// counter array indexed by [`DropReason::index`]).
    pub const COUNT: usize = 13;

    /// Every label, in [`DropReason::index`] order.
    pub const NAMES: [&'static str; Self::COUNT] = [
        "truncated",
        "bad_ip_header",
        "bad_ip_checksum",
        "ip_fragment",
        "bad_udp_header",
        "not_roce",
        "bad_version",
        "unknown_opcode",
        "bad_length",
        "bad_pad",
        "reserved_bits",
        "bad_aeth",
        "bad_icrc",
    ];

    /// A dense index below [`DropReason::COUNT`], for counter arrays.
    pub fn index(&self) -> usize {
        match self {
            DropReason::Truncated => 0,
            DropReason::BadIpHeader => 1,
            DropReason::BadIpChecksum => 2,
            DropReason::IpFragment => 3,
            DropReason::BadUdpHeader => 4,
            DropReason::NotRoce => 5,
            DropReason::BadVersion => 6,
            DropReason::UnknownOpcode(_) => 7,
            DropReason::BadLength => 8,
            DropReason::BadPad => 9,
            DropReason::ReservedBits => 10,
            DropReason::BadAeth => 11,
            DropReason::BadIcrc => 12,
        }
    }

    /// A stable snake_case label for counters and logs.
    pub fn name(&self) -> &'static str {
        Self::NAMES[self.index()]
    }
}

/// Why a packet could not be built: always a bug of the caller (the
/// transport), never of the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// The output buffer cannot hold the packet.
    #[error("Output buffer of {available} bytes too small for {needed}")]
    BufferTooSmall { needed: usize, available: usize },
    /// An extension header the opcode requires is missing, or one it does
    /// not have is given.
    #[error("Opcode {opcode:?} {problem} header {header}")]
    HeadersMismatch {
        opcode: Opcode,
        header: &'static str,
        problem: &'static str,
    },
    /// Payload given to an opcode that carries none.
    #[error("Opcode {0:?} carries no payload")]
    PayloadNotAllowed(Opcode),
    /// A field does not fit its width on the wire.
    #[error("Field {field} value {value:#x} does not fit its width")]
    OutOfRange { field: &'static str, value: u64 },
    /// The packet would not fit in one IPv4 datagram.
    #[error("Packet of {0} bytes too long for a UDP datagram")]
    TooLong(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_snake_case_and_indexed() {
        let all = [
            DropReason::Truncated,
            DropReason::BadIpHeader,
            DropReason::BadIpChecksum,
            DropReason::IpFragment,
            DropReason::BadUdpHeader,
            DropReason::NotRoce,
            DropReason::BadVersion,
            DropReason::UnknownOpcode(0x99),
            DropReason::BadLength,
            DropReason::BadPad,
            DropReason::ReservedBits,
            DropReason::BadAeth,
            DropReason::BadIcrc,
        ];
        assert_eq!(all.len(), DropReason::COUNT);
        for (i, r) in all.iter().enumerate() {
            assert_eq!(r.index(), i);
            assert_eq!(r.name(), DropReason::NAMES[i]);
            assert!(r.name().chars().all(|c| c.is_ascii_lowercase() || c == '_'));
            let msg = r.to_string();
            assert!(msg.starts_with(|c: char| c.is_ascii_uppercase()), "{msg}");
        }
        let mut names = DropReason::NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), DropReason::COUNT);
    }
}
