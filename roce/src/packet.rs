//! Whole packets: parsing a UDP payload (BTH..ICRC) and building one.
//!
//! Neither allocates: the datapath calls them once per packet. The parser
//! borrows the payload from the datagram; the builder writes into the
//! caller's buffer.

use crate::headers::{Aeth, AtomicAckEth, AtomicEth, Bth, Deth, Reth};
use crate::icrc::icrc;
use crate::ipv4::{split_ipv4, Ipv4Meta, IPV4_HEADER_LEN, UDP_HEADER_LEN};
use crate::opcode::OpcodeInfo;
use crate::{BuildError, DropReason, BTH_LEN, ICRC_LEN, ROCE_V2_PORT};

/// A parsed packet, borrowing its payload from the datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packet<'a> {
    pub bth: Bth,
    /// UD only.
    pub deth: Option<Deth>,
    pub reth: Option<Reth>,
    pub aeth: Option<Aeth>,
    pub atomic: Option<AtomicEth>,
    pub atomic_ack: Option<AtomicAckEth>,
    /// Immediate data, the big-endian bytes as on the wire (the guest's
    /// `imm_data` is a `__be32` too).
    pub imm: Option<[u8; 4]>,
    /// IETH: the rkey a SEND with invalidate asks to invalidate.
    pub ieth: Option<u32>,
    /// The payload, without pad and ICRC.
    pub payload: &'a [u8],
}

impl Packet<'_> {
    /// The headers to build this packet again.
    pub fn headers(&self) -> Headers {
        Headers {
            bth: self.bth,
            deth: self.deth,
            reth: self.reth,
            aeth: self.aeth,
            atomic: self.atomic,
            atomic_ack: self.atomic_ack,
            imm: self.imm,
            ieth: self.ieth,
        }
    }
}

/// The headers of a packet to build. Exactly the extension headers of
/// `bth.opcode`'s table entry must be `Some`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers {
    /// `bth.pad` is ignored: the builder computes it from the payload.
    pub bth: Bth,
    pub deth: Option<Deth>,
    pub reth: Option<Reth>,
    pub aeth: Option<Aeth>,
    pub atomic: Option<AtomicEth>,
    pub atomic_ack: Option<AtomicAckEth>,
    pub imm: Option<[u8; 4]>,
    pub ieth: Option<u32>,
}

impl Headers {
    /// A BTH alone (every extension header `None`).
    pub fn new(bth: Bth) -> Headers {
        Headers {
            bth,
            deth: None,
            reth: None,
            aeth: None,
            atomic: None,
            atomic_ack: None,
            imm: None,
            ieth: None,
        }
    }
}

/// Takes the next `N` bytes of `rest`.
fn take<'a, const N: usize>(rest: &mut &'a [u8]) -> Result<&'a [u8; N], DropReason> {
    let (head, tail) = rest.split_first_chunk::<N>().ok_or(DropReason::Truncated)?;
    *rest = tail;
    Ok(head)
}

/// Parses the UDP payload of a datagram received from `ip`: checks the
/// destination port, the ICRC, then the BTH and the opcode's extension
/// headers, the length and the pad.
///
/// The ICRC is checked before the headers so that damage on the way counts
/// as `bad_icrc` and the header reasons count what a peer really sent.
pub fn parse<'a>(udp_payload: &'a [u8], ip: &Ipv4Meta) -> Result<Packet<'a>, DropReason> {
    if ip.dst_port != ROCE_V2_PORT {
        return Err(DropReason::NotRoce);
    }
    if udp_payload.len() + IPV4_HEADER_LEN + UDP_HEADER_LEN > usize::from(u16::MAX) {
        // Cannot have come in one IPv4 datagram; its ICRC would cover a
        // wrapped length.
        return Err(DropReason::BadLength);
    }
    let (body, wire_icrc) = udp_payload
        .split_last_chunk::<ICRC_LEN>()
        .ok_or(DropReason::Truncated)?;
    let mut rest = body;
    let bth = take::<BTH_LEN>(&mut rest)?;
    if icrc(ip, body) != u32::from_le_bytes(*wire_icrc) {
        return Err(DropReason::BadIcrc);
    }
    let bth = Bth::decode(bth)?;
    let info = bth.opcode.info();
    if body.len() < info.header_len {
        return Err(DropReason::Truncated);
    }
    if body.len() % 4 != 0 {
        return Err(DropReason::BadLength);
    }
    // Wire order: DETH, RETH, AETH, AtomicETH, AtomicAckETH, ImmDt, IETH.
    let deth = if info.deth {
        Some(Deth::decode(take(&mut rest)?)?)
    } else {
        None
    };
    let reth = if info.reth {
        Some(Reth::decode(take(&mut rest)?))
    } else {
        None
    };
    let aeth = if info.aeth {
        Some(Aeth::decode(take(&mut rest)?)?)
    } else {
        None
    };
    let atomic = if info.atomic_eth {
        Some(AtomicEth::decode(take(&mut rest)?))
    } else {
        None
    };
    let atomic_ack = if info.atomic_ack_eth {
        Some(AtomicAckEth::decode(take(&mut rest)?))
    } else {
        None
    };
    let imm = if info.imm {
        Some(*take::<4>(&mut rest)?)
    } else {
        None
    };
    let ieth = if info.ieth {
        Some(u32::from_be_bytes(*take(&mut rest)?))
    } else {
        None
    };
    let pad = usize::from(bth.pad);
    let payload = if info.payload {
        let len = rest.len().checked_sub(pad).ok_or(DropReason::BadPad)?;
        let (payload, pad_bytes) = rest.split_at(len);
        if pad_bytes.iter().any(|&b| b != 0) {
            return Err(DropReason::BadPad);
        }
        payload
    } else {
        if !rest.is_empty() {
            return Err(DropReason::BadLength);
        }
        if pad != 0 {
            return Err(DropReason::BadPad);
        }
        rest
    };
    Ok(Packet {
        bth,
        deth,
        reth,
        aeth,
        atomic,
        atomic_ack,
        imm,
        ieth,
        payload,
    })
}

/// Parses a whole IPv4 packet as a raw socket hands it (IPv4 header, UDP
/// header, BTH…ICRC): checks IHL 5, the header checksum, protocol 17, no
/// fragment, the lengths and UDP destination port 4791, then [`parse`]s the
/// UDP payload.
pub fn parse_ipv4(ip_packet: &[u8]) -> Result<(Ipv4Meta, Packet<'_>), DropReason> {
    let (meta, udp_payload) = split_ipv4(ip_packet)?;
    let packet = parse(udp_payload, &meta)?;
    Ok((meta, packet))
}

/// The length of BTH and extension headers of `h`'s opcode: where the
/// payload starts in the UDP payload.
pub fn header_len(h: &Headers) -> usize {
    h.bth.opcode.info().header_len
}

/// The pad count that makes `payload_len` a multiple of 4.
pub const fn pad_for(payload_len: usize) -> u8 {
    ((4 - payload_len % 4) % 4) as u8
}

/// The UDP payload length of a packet with `h`'s headers and
/// `payload_len` bytes of payload (headers, payload, pad, ICRC).
pub fn packet_len(h: &Headers, payload_len: usize) -> usize {
    header_len(h) + payload_len + usize::from(pad_for(payload_len)) + ICRC_LEN
}

/// Writes headers, payload, pad (computed: payload to a multiple of 4, put
/// in the BTH's pad count) and ICRC into `out` (the UDP payload); returns
/// its length. Errors if `out` is too small, a field does not fit its
/// width, or the headers do not match the opcode's table entry.
pub fn build(
    out: &mut [u8],
    h: &Headers,
    payload: &[u8],
    ip: &Ipv4Meta,
) -> Result<usize, BuildError> {
    build_vectored(out, h, &[payload], ip)
}

/// [`build`] with the payload given in pieces (a gather list), copied in
/// order without an intermediate buffer.
pub fn build_vectored(
    out: &mut [u8],
    h: &Headers,
    pieces: &[&[u8]],
    ip: &Ipv4Meta,
) -> Result<usize, BuildError> {
    let payload_len = pieces
        .iter()
        .try_fold(0usize, |n, p| n.checked_add(p.len()))
        .ok_or(BuildError::TooLong(usize::MAX))?;
    let info = check(out, h, payload_len)?;
    let mut at = info.header_len;
    for piece in pieces {
        let end = at + piece.len();
        let available = out.len();
        out.get_mut(at..end)
            .ok_or(BuildError::BufferTooSmall {
                needed: end,
                available,
            })?
            .copy_from_slice(piece);
        at = end;
    }
    finish_in_place(out, h, payload_len, ip)
}

/// [`build`] when the caller has already written `payload_len` bytes of
/// payload at `out[header_len(h)..]` (the engine copies guest memory
/// straight in): writes headers, pad and ICRC around it.
pub fn finish_in_place(
    out: &mut [u8],
    h: &Headers,
    payload_len: usize,
    ip: &Ipv4Meta,
) -> Result<usize, BuildError> {
    let info = check(out, h, payload_len)?;
    let pad = pad_for(payload_len);
    let body_len = info.header_len + payload_len + usize::from(pad);
    let total = body_len + ICRC_LEN;
    let available = out.len();
    let too_small = BuildError::BufferTooSmall {
        needed: total,
        available,
    };
    let packet = out.get_mut(..total).ok_or(too_small)?;
    let (body, icrc_out) = packet.split_at_mut(body_len);
    let (headers, rest) = body.split_at_mut(info.header_len);
    write_headers(headers, h, pad)?;
    let (_, pad_out) = rest.split_at_mut(payload_len);
    pad_out.fill(0);
    icrc_out.copy_from_slice(&icrc(ip, body).to_le_bytes());
    Ok(total)
}

/// Checks `h` against its opcode's table entry and the sizes; returns the
/// entry.
fn check(out: &[u8], h: &Headers, payload_len: usize) -> Result<&'static OpcodeInfo, BuildError> {
    let info = h.bth.opcode.info();
    let opcode = h.bth.opcode;
    let pairs = [
        ("DETH", h.deth.is_some(), info.deth),
        ("RETH", h.reth.is_some(), info.reth),
        ("AETH", h.aeth.is_some(), info.aeth),
        ("AtomicETH", h.atomic.is_some(), info.atomic_eth),
        ("AtomicAckETH", h.atomic_ack.is_some(), info.atomic_ack_eth),
        ("ImmDt", h.imm.is_some(), info.imm),
        ("IETH", h.ieth.is_some(), info.ieth),
    ];
    for (header, given, wanted) in pairs {
        if given != wanted {
            let problem = if wanted { "requires" } else { "has no" };
            return Err(BuildError::HeadersMismatch {
                opcode,
                header,
                problem,
            });
        }
    }
    if !info.payload && payload_len != 0 {
        return Err(BuildError::PayloadNotAllowed(opcode));
    }
    let total = info
        .header_len
        .checked_add(payload_len)
        .and_then(|n| n.checked_add(usize::from(pad_for(payload_len)) + ICRC_LEN))
        .ok_or(BuildError::TooLong(payload_len))?;
    if total + IPV4_HEADER_LEN + UDP_HEADER_LEN > usize::from(u16::MAX) {
        return Err(BuildError::TooLong(total));
    }
    if total > out.len() {
        return Err(BuildError::BufferTooSmall {
            needed: total,
            available: out.len(),
        });
    }
    Ok(info)
}

/// Takes the next `N` bytes of `rest` to write.
fn put<'a, const N: usize>(rest: &mut &'a mut [u8]) -> Result<&'a mut [u8; N], BuildError> {
    let available = rest.len();
    let (head, tail) =
        std::mem::take(rest)
            .split_first_chunk_mut::<N>()
            .ok_or(BuildError::BufferTooSmall {
                needed: N,
                available,
            })?;
    *rest = tail;
    Ok(head)
}

/// Writes BTH and extension headers into `out` (exactly their length).
fn write_headers(mut out: &mut [u8], h: &Headers, pad: u8) -> Result<(), BuildError> {
    let rest = &mut out;
    h.bth.encode(pad, put(rest)?)?;
    if let Some(deth) = &h.deth {
        deth.encode(put(rest)?)?;
    }
    if let Some(reth) = &h.reth {
        reth.encode(put(rest)?);
    }
    if let Some(aeth) = &h.aeth {
        aeth.encode(put(rest)?)?;
    }
    if let Some(atomic) = &h.atomic {
        atomic.encode(put(rest)?);
    }
    if let Some(ack) = &h.atomic_ack {
        ack.encode(put(rest)?);
    }
    if let Some(imm) = &h.imm {
        *put(rest)? = *imm;
    }
    if let Some(ieth) = h.ieth {
        *put(rest)? = ieth.to_be_bytes();
    }
    Ok(())
}
