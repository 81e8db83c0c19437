//! Ethernet frames as the relay sees them: which ones are RoCEv2 (IPv4,
//! UDP, destination port 4791, not a fragment), the internet checksums it
//! completes or recomputes, and the two faults that rewrite a frame's
//! bytes (truncate, corrupt).

/// UDP port of RoCEv2.
pub const ROCE_V2_PORT: u16 = 4791;
/// Bytes of an Ethernet header without VLAN tag.
pub const ETH_LEN: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const UDP_LEN: usize = 8;
/// Offset of the checksum in a UDP and in a TCP header.
const UDP_CSUM_AT: usize = 6;
const TCP_CSUM_AT: usize = 16;

/// Where an IPv4 frame's headers are, and its transport protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Frame {
    /// Offset of the transport header (after IPv4 options).
    pub l4: usize,
    /// End of the IPv4 packet in the frame (frames may carry padding past it).
    pub end: usize,
    pub protocol: u8,
    /// Whether it is a fragment (more fragments, or a non-zero offset):
    /// its transport header is not whole, or not there.
    pub fragment: bool,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

/// The IPv4 headers of `frame`, if it is an untagged IPv4 frame whose
/// header and total length are consistent with the frame.
pub fn ipv4(frame: &[u8]) -> Option<Ipv4Frame> {
    if frame.len() < ETH_LEN + 20 || be16(frame, 12) != ETHERTYPE_IPV4 {
        return None;
    }
    let ip = &frame[ETH_LEN..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(be16(ip, 2));
    if ip[0] >> 4 != 4 || ihl < 20 || total < ihl || total > ip.len() {
        return None;
    }
    let flags_frag = be16(ip, 6);
    Some(Ipv4Frame {
        l4: ETH_LEN + ihl,
        end: ETH_LEN + total,
        protocol: ip[9],
        fragment: flags_frag & 0x3fff != 0,
    })
}

/// The IPv4 frame of `frame` if it is a whole UDP datagram to the RoCEv2
/// port: the only frames the relay harms.
pub fn roce(frame: &[u8]) -> Option<Ipv4Frame> {
    let ip = ipv4(frame)?;
    let udp_fits = ip.end >= ip.l4 + UDP_LEN;
    let roce = ip.protocol == PROTO_UDP
        && !ip.fragment
        && udp_fits
        && be16(frame, ip.l4 + 2) == ROCE_V2_PORT;
    roce.then_some(ip)
}

/// Ones'-complement sum of `bytes` (odd length padded with a zero) added to
/// `sum`, not folded.
fn sum16(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    for pair in &mut chunks {
        sum += u32::from(u16::from_be_bytes([pair[0], pair[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    // Truncation intended: folded to 16 bits above.
    sum as u16
}

/// Recomputes the IPv4 header checksum.
pub fn fix_ip_checksum(frame: &mut [u8], ip: &Ipv4Frame) {
    let header = ETH_LEN..ip.l4;
    put16(frame, ETH_LEN + 10, 0);
    let sum = !fold(sum16(0, &frame[header]));
    put16(frame, ETH_LEN + 10, sum);
}

/// Computes the TCP or UDP checksum of the IPv4 packet from scratch (what
/// a NIC does for a frame the kernel left with `CHECKSUM_PARTIAL`).
/// Returns false (and changes nothing) for other protocols and fragments.
pub fn fix_l4_checksum(frame: &mut [u8], ip: &Ipv4Frame) -> bool {
    let at = match ip.protocol {
        PROTO_UDP if ip.end >= ip.l4 + UDP_LEN => ip.l4 + UDP_CSUM_AT,
        PROTO_TCP if ip.end >= ip.l4 + 20 => ip.l4 + TCP_CSUM_AT,
        _ => return false,
    };
    if ip.fragment {
        return false;
    }
    put16(frame, at, 0);
    let l4_len = ip.end - ip.l4;
    // Pseudo header: source, destination, protocol, transport length.
    let mut sum = sum16(0, &frame[ETH_LEN + 12..ETH_LEN + 20]);
    sum += u32::from(ip.protocol);
    sum += l4_len as u32;
    sum = sum16(sum, &frame[ip.l4..ip.end]);
    let mut csum = !fold(sum);
    if csum == 0 && ip.protocol == PROTO_UDP {
        // 0 means "no checksum" in UDP over IPv4.
        csum = 0xffff;
    }
    put16(frame, at, csum);
    true
}

/// Whether the UDP checksum of a RoCE frame verifies (0: none sent).
#[cfg(test)]
pub fn udp_checksum_ok(frame: &[u8], ip: &Ipv4Frame) -> bool {
    let stored = be16(frame, ip.l4 + UDP_CSUM_AT);
    if stored == 0 {
        return true;
    }
    let mut copy = frame.to_vec();
    fix_l4_checksum(&mut copy, ip);
    be16(&copy, ip.l4 + UDP_CSUM_AT) == stored
}

/// Flips bit `bit` (counted from the first bit of the UDP payload) of a
/// RoCE frame with a UDP payload of at least one byte; with `fix`, then
/// recomputes the UDP checksum so the receiver's stack does not drop it
/// and the RoCE ICRC is what catches it.
pub fn corrupt(frame: &mut [u8], ip: &Ipv4Frame, bit: usize, fix: bool) {
    let payload = ip.l4 + UDP_LEN;
    frame[payload + bit / 8] ^= 0x80 >> (bit % 8);
    if fix {
        fix_l4_checksum(frame, ip);
    }
}

/// Cuts a RoCE frame so that `keep` bytes of UDP payload remain (fewer
/// than it had); returns the new frame length. With `fix`, the IPv4 total
/// length, UDP length and both checksums are made to match, as a switch
/// that rewrites headers would (the RoCE ICRC check then sees a short
/// packet); without, only the frame is shorter, and the receiver's IP
/// layer drops it.
pub fn truncate(frame: &mut [u8], ip: &Ipv4Frame, keep: usize, fix: bool) -> usize {
    let end = ip.l4 + UDP_LEN + keep;
    debug_assert!(end < ip.end);
    if fix {
        let total = (end - ETH_LEN) as u16;
        put16(frame, ETH_LEN + 2, total);
        put16(frame, ip.l4 + 4, (end - ip.l4) as u16);
        let cut = Ipv4Frame { end, ..*ip };
        fix_ip_checksum(frame, &cut);
        fix_l4_checksum(frame, &cut);
    }
    end
}

/// Bytes of UDP payload of a RoCE frame.
pub fn udp_payload_len(ip: &Ipv4Frame) -> usize {
    ip.end - ip.l4 - UDP_LEN
}

/// Destination and source MAC addresses.
pub fn macs(frame: &[u8]) -> Option<([u8; 6], [u8; 6])> {
    let dst = frame.get(0..6)?.try_into().ok()?;
    let src = frame.get(6..12)?.try_into().ok()?;
    Some((dst, src))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An Ethernet + IPv4 + UDP frame from 10.0.0.1:5000 to 10.0.0.2:`port`
    /// with `payload` and a valid UDP checksum.
    pub(crate) fn udp_frame(port: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; ETH_LEN + 20 + UDP_LEN];
        f[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        put16(&mut f, 12, ETHERTYPE_IPV4);
        let total = (20 + UDP_LEN + payload.len()) as u16;
        f[ETH_LEN] = 0x45;
        put16(&mut f, ETH_LEN + 2, total);
        put16(&mut f, ETH_LEN + 6, 0x4000);
        f[ETH_LEN + 8] = 64;
        f[ETH_LEN + 9] = PROTO_UDP;
        f[ETH_LEN + 12..ETH_LEN + 16].copy_from_slice(&[10, 0, 0, 1]);
        f[ETH_LEN + 16..ETH_LEN + 20].copy_from_slice(&[10, 0, 0, 2]);
        put16(&mut f, ETH_LEN + 20, 5000);
        put16(&mut f, ETH_LEN + 22, port);
        put16(&mut f, ETH_LEN + 24, (UDP_LEN + payload.len()) as u16);
        f.extend_from_slice(payload);
        let ip = ipv4(&f).expect("IPv4");
        fix_ip_checksum(&mut f, &ip);
        fix_l4_checksum(&mut f, &ip);
        f
    }

    #[test]
    fn only_whole_udp_datagrams_to_4791_are_roce() {
        let f = udp_frame(ROCE_V2_PORT, b"hello");
        let ip = roce(&f).expect("RoCE");
        assert_eq!((ip.l4, ip.end, ip.protocol), (34, f.len(), PROTO_UDP));
        assert_eq!(roce(&udp_frame(4792, b"hello")), None);
        let mut fragment = f.clone();
        put16(&mut fragment, ETH_LEN + 6, 0x2000);
        assert_eq!(roce(&fragment), None);
        let mut arp = f.clone();
        put16(&mut arp, 12, 0x0806);
        assert_eq!(roce(&arp), None);
        // A frame shorter than its IPv4 total length is not parsed.
        assert_eq!(roce(&f[..f.len() - 1]), None);
        // Ethernet padding past the IPv4 packet is allowed.
        let mut padded = f.clone();
        padded.extend_from_slice(&[0; 10]);
        assert_eq!(roce(&padded).map(|ip| ip.end), Some(f.len()));
    }

    #[test]
    fn checksums_match_a_known_datagram() {
        // The IPv4 header of the classic example (Wikipedia, RFC 1071
        // style): checksum 0xb861.
        let mut f = vec![0u8; ETH_LEN];
        put16(&mut f, 12, ETHERTYPE_IPV4);
        f.extend_from_slice(&[
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ]);
        f.resize(ETH_LEN + 0x73, 0);
        let ip = ipv4(&f).expect("IPv4");
        fix_ip_checksum(&mut f, &ip);
        assert_eq!(be16(&f, ETH_LEN + 10), 0xb861);
        // A checksum verifies: the sum over the header is all ones.
        assert_eq!(fold(sum16(0, &f[ETH_LEN..ip.l4])), 0xffff);
    }

    #[test]
    fn a_udp_checksum_detects_a_flipped_bit_until_fixed() {
        let mut f = udp_frame(ROCE_V2_PORT, &[0x5a; 40]);
        let ip = roce(&f).expect("RoCE");
        assert!(udp_checksum_ok(&f, &ip));
        let original = f.clone();
        corrupt(&mut f, &ip, 13, false);
        assert!(!udp_checksum_ok(&f, &ip));
        let diff: u32 = f
            .iter()
            .zip(&original)
            .map(|(a, b)| (a ^ b).count_ones())
            .sum();
        assert_eq!(diff, 1);
        assert_eq!(f[ip.l4 + UDP_LEN + 1] ^ original[ip.l4 + UDP_LEN + 1], 0x04);
        let mut fixed = original.clone();
        corrupt(&mut fixed, &ip, 13, true);
        assert!(udp_checksum_ok(&fixed, &ip));
        assert_eq!(fixed[ip.l4 + UDP_LEN..], f[ip.l4 + UDP_LEN..]);
    }

    #[test]
    fn a_fixed_truncation_is_a_consistent_shorter_datagram() {
        let payload: Vec<u8> = (0..100).collect();
        let mut f = udp_frame(ROCE_V2_PORT, &payload);
        let ip = roce(&f).expect("RoCE");
        let len = truncate(&mut f, &ip, 30, true);
        f.truncate(len);
        let cut = roce(&f).expect("still a RoCE frame");
        assert_eq!(udp_payload_len(&cut), 30);
        assert_eq!(&f[cut.l4 + UDP_LEN..], &payload[..30]);
        assert!(udp_checksum_ok(&f, &cut));
        assert_eq!(fold(sum16(0, &f[ETH_LEN..cut.l4])), 0xffff);

        let mut g = udp_frame(ROCE_V2_PORT, &payload);
        let len = truncate(&mut g, &ip, 30, false);
        g.truncate(len);
        assert_eq!(
            roce(&g),
            None,
            "its IPv4 total length is longer than the frame"
        );
    }

    #[test]
    fn a_partial_checksum_is_completed() {
        let mut f = udp_frame(ROCE_V2_PORT, b"partial");
        let ip = roce(&f).expect("RoCE");
        let good = f.clone();
        // What CHECKSUM_PARTIAL leaves: the pseudo-header sum.
        put16(&mut f, ip.l4 + UDP_CSUM_AT, 0x1234);
        assert!(!udp_checksum_ok(&f, &ip));
        assert!(fix_l4_checksum(&mut f, &ip));
        assert_eq!(f, good);
    }
}
