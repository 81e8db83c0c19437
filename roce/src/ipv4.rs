//! The IPv4 and UDP headers around a RoCEv2 packet: what of them the ICRC
//! covers, and their checks when a raw socket hands the whole datagram.

use std::net::Ipv4Addr;

use crate::{BuildError, DropReason, ROCE_V2_PORT};

/// An IPv4 header without options.
pub const IPV4_HEADER_LEN: usize = 20;
/// A UDP header.
pub const UDP_HEADER_LEN: usize = 8;
/// IPv4's "don't fragment" flag in the flags + fragment-offset word.
pub const IP_DF: u16 = 0x4000;
const IP_MF: u16 = 0x2000;
const IP_FRAG_OFFSET: u16 = 0x1fff;
const IPPROTO_UDP: u8 = 17;

/// The IPv4 + UDP fields the ICRC covers (TOS, TTL and both checksums are
/// masked out of it, so they are not here). Total length, protocol (17) and
/// IHL (5) derive from the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Meta {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// IP identification. Linux puts 0 in every packet with DF set, which
    /// is why vrdma sends with DF: the ICRC covers this field.
    pub id: u16,
    /// The 16-bit flags + fragment-offset word.
    pub flags_frag: u16,
    pub src_port: u16,
    pub dst_port: u16,
}

impl Ipv4Meta {
    /// The metadata of a packet vrdma sends from `src` to `dst` through a
    /// UDP socket with DF set (ID 0, DF, destination port 4791).
    pub const fn outgoing(src: Ipv4Addr, dst: Ipv4Addr, src_port: u16) -> Ipv4Meta {
        Ipv4Meta {
            src,
            dst,
            id: 0,
            flags_frag: IP_DF,
            src_port,
            dst_port: ROCE_V2_PORT,
        }
    }
}

/// The IPv4 and UDP headers as the ICRC sees them: TOS, TTL, the header
/// checksum and the UDP checksum all ones (rxe's `rxe_icrc_hdr`).
pub(crate) fn icrc_pseudo_header(ip: &Ipv4Meta, udp_payload_len: usize) -> [u8; 28] {
    // Lengths are 16-bit on the wire; `build` refuses longer packets and
    // `parse` gets them from a 16-bit field, so the truncation is never hit.
    let total = (IPV4_HEADER_LEN + UDP_HEADER_LEN + udp_payload_len) as u16;
    let udp_len = (UDP_HEADER_LEN + udp_payload_len) as u16;
    let mut h = ipv4_udp_header(ip, 0xff, 0xff, total, udp_len);
    // Header checksum and UDP checksum masked.
    h[10] = 0xff;
    h[11] = 0xff;
    h[26] = 0xff;
    h[27] = 0xff;
    h
}

/// IPv4 + UDP headers with a zero IP checksum and a zero UDP checksum.
fn ipv4_udp_header(ip: &Ipv4Meta, tos: u8, ttl: u8, total: u16, udp_len: u16) -> [u8; 28] {
    let [t0, t1] = total.to_be_bytes();
    let [i0, i1] = ip.id.to_be_bytes();
    let [f0, f1] = ip.flags_frag.to_be_bytes();
    let [s0, s1, s2, s3] = ip.src.octets();
    let [d0, d1, d2, d3] = ip.dst.octets();
    let [sp0, sp1] = ip.src_port.to_be_bytes();
    let [dp0, dp1] = ip.dst_port.to_be_bytes();
    let [u0, u1] = udp_len.to_be_bytes();
    [
        0x45,
        tos,
        t0,
        t1,
        i0,
        i1,
        f0,
        f1,
        ttl,
        IPPROTO_UDP,
        0,
        0,
        s0,
        s1,
        s2,
        s3,
        d0,
        d1,
        d2,
        d3,
        sp0,
        sp1,
        dp0,
        dp1,
        u0,
        u1,
        0,
        0,
    ]
}

/// The Internet checksum of an IPv4 header (0 when a header with its
/// checksum filled in is correct).
fn ipv4_checksum(h: &[u8; IPV4_HEADER_LEN]) -> u16 {
    let mut sum: u32 = h
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Writes an IPv4 header (no options, checksum filled in) and a UDP header
/// (checksum 0: the ICRC protects the packet) for a UDP payload of
/// `udp_payload_len` bytes into `out`; returns the header length (28).
/// For raw sends and tests: packets sent through a UDP socket get theirs
/// from the kernel.
pub fn write_ipv4_udp_header(
    out: &mut [u8],
    ip: &Ipv4Meta,
    tos: u8,
    ttl: u8,
    udp_payload_len: usize,
) -> Result<usize, BuildError> {
    const LEN: usize = IPV4_HEADER_LEN + UDP_HEADER_LEN;
    let total = LEN
        .checked_add(udp_payload_len)
        .filter(|&t| t <= usize::from(u16::MAX))
        .ok_or(BuildError::TooLong(udp_payload_len))?;
    let available = out.len();
    let dst = out.get_mut(..LEN).ok_or(BuildError::BufferTooSmall {
        needed: LEN,
        available,
    })?;
    let mut h = ipv4_udp_header(ip, tos, ttl, total as u16, (total - IPV4_HEADER_LEN) as u16);
    let (iph, _) = h.split_at(IPV4_HEADER_LEN);
    let iph: [u8; IPV4_HEADER_LEN] = iph.try_into().unwrap_or([0; IPV4_HEADER_LEN]);
    let [c0, c1] = ipv4_checksum(&iph).to_be_bytes();
    h[10] = c0;
    h[11] = c1;
    dst.copy_from_slice(&h);
    Ok(LEN)
}

/// Checks a whole IPv4 datagram as a raw socket hands it (IPv4 header
/// without options, UDP to port 4791) and splits off its UDP payload.
pub(crate) fn split_ipv4(packet: &[u8]) -> Result<(Ipv4Meta, &[u8]), DropReason> {
    let (iph, rest) = packet
        .split_first_chunk::<IPV4_HEADER_LEN>()
        .ok_or(DropReason::Truncated)?;
    let [ver_ihl, _tos, t0, t1, i0, i1, f0, f1, _ttl, proto, _c0, _c1, s0, s1, s2, s3, d0, d1, d2, d3] =
        *iph;
    if ver_ihl != 0x45 {
        // Not IPv4, or options (IHL > 5) the ICRC's pseudo-header has no
        // room for, or an IHL below the minimum.
        return Err(DropReason::BadIpHeader);
    }
    let total = usize::from(u16::from_be_bytes([t0, t1]));
    if total > packet.len() {
        return Err(DropReason::Truncated);
    }
    if total < packet.len() {
        return Err(DropReason::BadIpHeader);
    }
    if ipv4_checksum(iph) != 0 {
        return Err(DropReason::BadIpChecksum);
    }
    if proto != IPPROTO_UDP {
        return Err(DropReason::BadIpHeader);
    }
    let flags_frag = u16::from_be_bytes([f0, f1]);
    if flags_frag & (IP_MF | IP_FRAG_OFFSET) != 0 {
        return Err(DropReason::IpFragment);
    }
    let (udph, payload) = rest
        .split_first_chunk::<UDP_HEADER_LEN>()
        .ok_or(DropReason::Truncated)?;
    let [sp0, sp1, dp0, dp1, u0, u1, _k0, _k1] = *udph;
    if usize::from(u16::from_be_bytes([u0, u1])) != UDP_HEADER_LEN + payload.len() {
        return Err(DropReason::BadUdpHeader);
    }
    let meta = Ipv4Meta {
        src: Ipv4Addr::new(s0, s1, s2, s3),
        dst: Ipv4Addr::new(d0, d1, d2, d3),
        id: u16::from_be_bytes([i0, i1]),
        flags_frag,
        src_port: u16::from_be_bytes([sp0, sp1]),
        dst_port: u16::from_be_bytes([dp0, dp1]),
    };
    if meta.dst_port != ROCE_V2_PORT {
        return Err(DropReason::NotRoce);
    }
    Ok((meta, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Ipv4Meta {
        Ipv4Meta::outgoing(
            Ipv4Addr::new(10, 200, 1, 1),
            Ipv4Addr::new(10, 200, 1, 2),
            0xc123,
        )
    }

    fn datagram(payload: &[u8]) -> Vec<u8> {
        let mut v = vec![0; 28 + payload.len()];
        assert_eq!(
            write_ipv4_udp_header(&mut v, &meta(), 0x02, 64, payload.len()),
            Ok(28)
        );
        v[28..].copy_from_slice(payload);
        v
    }

    #[test]
    fn header_checksum_is_valid_and_round_trips() {
        let v = datagram(&[1, 2, 3, 4]);
        // A known header: checksum by hand from the one's complement sum.
        assert_eq!(&v[..4], &[0x45, 0x02, 0x00, 0x20]);
        assert_eq!(&v[6..8], &[0x40, 0x00]);
        let iph: [u8; 20] = v[..20].try_into().expect("20 bytes");
        assert_eq!(ipv4_checksum(&iph), 0);
        let (m, p) = split_ipv4(&v).expect("accepted");
        assert_eq!(m, meta());
        assert_eq!(p, &[1, 2, 3, 4]);
    }

    #[test]
    fn malformed_datagrams_are_refused() {
        let good = datagram(&[0; 16]);
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut v = good.clone();
            f(&mut v);
            split_ipv4(&v).map(|_| ())
        };
        let refix = |v: &mut Vec<u8>| {
            v[10] = 0;
            v[11] = 0;
            let iph: [u8; 20] = v[..20].try_into().expect("20 bytes");
            let [a, b] = ipv4_checksum(&iph).to_be_bytes();
            v[10] = a;
            v[11] = b;
        };
        assert_eq!(with(&|v| v[0] = 0x46), Err(DropReason::BadIpHeader));
        assert_eq!(with(&|v| v[0] = 0x65), Err(DropReason::BadIpHeader));
        assert_eq!(with(&|v| v[12] ^= 1), Err(DropReason::BadIpChecksum));
        assert_eq!(
            with(&|v| {
                v[9] = 6;
                refix(v)
            }),
            Err(DropReason::BadIpHeader)
        );
        assert_eq!(
            with(&|v| {
                v[6] = 0x20;
                refix(v)
            }),
            Err(DropReason::IpFragment)
        );
        assert_eq!(
            with(&|v| {
                v[7] = 0x01;
                refix(v)
            }),
            Err(DropReason::IpFragment)
        );
        assert_eq!(with(&|v| v[25] ^= 1), Err(DropReason::BadUdpHeader));
        assert_eq!(with(&|v| v[23] ^= 1), Err(DropReason::NotRoce));
        assert_eq!(with(&|v| v.push(0)), Err(DropReason::BadIpHeader));
        for n in 0..good.len() {
            assert_eq!(
                split_ipv4(&good[..n]).map(|_| ()),
                Err(DropReason::Truncated),
                "{n}"
            );
        }
    }

    #[test]
    fn pseudo_header_masks_what_rxe_masks() {
        let h = icrc_pseudo_header(&meta(), 16);
        assert_eq!(h[1], 0xff); // TOS
        assert_eq!(h[8], 0xff); // TTL
        assert_eq!(&h[10..12], &[0xff, 0xff]); // header checksum
        assert_eq!(&h[26..28], &[0xff, 0xff]); // UDP checksum
        assert_eq!(&h[2..4], &[0, 44]); // total length
        assert_eq!(&h[24..26], &[0, 24]); // UDP length
    }
}
