//! The RoCEv2 packet parser (`vrdma_roce::parse`, `parse_ipv4`): what a
//! peer host (or anyone who can send to UDP port 4791 in a tenant network)
//! puts on the wire. Parsing must never panic; what it accepts is a
//! well-formed packet that `build` writes back to exactly the same bytes;
//! a bit flipped in an accepted packet is dropped (but for the congestion
//! bits the ICRC leaves out); what it refuses has a counter label.
//!
//! The first byte picks the mode (random bytes almost never carry a
//! matching ICRC, so some modes fix it up to reach the header checks):
//! - 0: the rest is an `Ipv4Meta` and a UDP payload, as is;
//! - 1: the same with its ICRC made valid;
//! - 2: the rest is a whole IPv4 datagram, as is;
//! - 3: the same with its IPv4 version and IHL, lengths, protocol, header
//!   checksum and ICRC made valid (addresses, ID, flags, ports, TOS, TTL
//!   and the UDP payload are the input's);
//! - 4..: structured: headers of an opcode the input picks, fields and
//!   payload from the input, built (when `build` accepts them), parsed
//!   back and compared.

use std::net::Ipv4Addr;

use vrdma_roce::{
    build, icrc, packet_len, pad_for, parse, parse_ipv4, write_ipv4_udp_header, Aeth, AtomicAckEth,
    AtomicEth, Bth, Deth, DropReason, Headers, Ipv4Meta, NakCode, Opcode, Packet, Psn, Reth,
    ICRC_LEN, IPV4_HEADER_LEN, MAX_HEADER_LEN, ROCE_V2_PORT, UDP_HEADER_LEN,
};

use crate::input::Input;

const IP_UDP_LEN: usize = IPV4_HEADER_LEN + UDP_HEADER_LEN;

pub fn check(data: &[u8]) {
    run(data);
}

/// [`check`], returning whether the parser accepted a packet (for tests of
/// the check itself: inputs meant to reach the accepted path do).
pub fn run(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let mode = input.u8();
    let flip = input.u16();
    match mode % 8 {
        0 | 1 => {
            let ip = meta(&mut input);
            let mut udp = input.bytes(usize::MAX).to_vec();
            if mode % 8 == 1 {
                seal_icrc(&mut udp, &ip);
            }
            check_udp(&udp, &ip, flip)
        }
        2 | 3 => {
            let mut dgram = input.bytes(usize::MAX).to_vec();
            if mode % 8 == 3 {
                seal_datagram(&mut dgram);
            }
            check_datagram(&dgram, flip)
        }
        _ => check_structured(&mut input, flip),
    }
}

fn meta(input: &mut Input) -> Ipv4Meta {
    let dst_port = if input.u8() == 0xff {
        input.u16()
    } else {
        ROCE_V2_PORT
    };
    Ipv4Meta {
        src: Ipv4Addr::from(input.array::<4>()),
        dst: Ipv4Addr::from(input.array::<4>()),
        id: input.u16(),
        flags_frag: input.u16(),
        src_port: input.u16(),
        dst_port,
    }
}

/// Rewrites the last 4 bytes of a UDP payload as its ICRC.
fn seal_icrc(udp: &mut [u8], ip: &Ipv4Meta) {
    if let Some(body_len) = udp.len().checked_sub(ICRC_LEN) {
        let (body, crc) = udp.split_at_mut(body_len);
        crc.copy_from_slice(&icrc(ip, body).to_le_bytes());
    }
}

/// Makes a datagram's IPv4 version and IHL, total length, protocol, UDP
/// length, header checksum and ICRC valid (for the addresses and ports its
/// headers hold), leaving every other byte.
pub(crate) fn seal_datagram(dgram: &mut [u8]) {
    if dgram.len() < IP_UDP_LEN || dgram.len() > usize::from(u16::MAX) {
        return;
    }
    let [t0, t1] = (dgram.len() as u16).to_be_bytes();
    let [u0, u1] = ((dgram.len() - IPV4_HEADER_LEN) as u16).to_be_bytes();
    dgram[0] = 0x45;
    dgram[2] = t0;
    dgram[3] = t1;
    dgram[9] = 17;
    dgram[24] = u0;
    dgram[25] = u1;
    let ip = Ipv4Meta {
        src: Ipv4Addr::new(dgram[12], dgram[13], dgram[14], dgram[15]),
        dst: Ipv4Addr::new(dgram[16], dgram[17], dgram[18], dgram[19]),
        id: u16::from_be_bytes([dgram[4], dgram[5]]),
        flags_frag: u16::from_be_bytes([dgram[6], dgram[7]]),
        src_port: u16::from_be_bytes([dgram[20], dgram[21]]),
        dst_port: u16::from_be_bytes([dgram[22], dgram[23]]),
    };
    seal_icrc(&mut dgram[IP_UDP_LEN..], &ip);
    dgram[10] = 0;
    dgram[11] = 0;
    let sum = dgram[..IPV4_HEADER_LEN]
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum::<u32>();
    let folded = (sum & 0xffff) + (sum >> 16);
    let folded = (folded & 0xffff) + (folded >> 16);
    let [a, b] = (!(folded as u16)).to_be_bytes();
    dgram[10] = a;
    dgram[11] = b;
}

/// Parses a UDP payload and checks the invariants of the outcome.
fn check_udp(udp: &[u8], ip: &Ipv4Meta, flip: u16) -> bool {
    let first = parse(udp, ip);
    assert_eq!(first, parse(udp, ip), "parse is not deterministic");
    match first {
        Ok(p) => {
            check_accepted(&p, udp, ip);
            check_flip(udp, ip, &p, flip);
            true
        }
        Err(e) => check_refused(e),
    }
}

fn check_datagram(dgram: &[u8], flip: u16) -> bool {
    match parse_ipv4(dgram) {
        Ok((ip, p)) => {
            let udp = &dgram[IP_UDP_LEN..];
            assert_eq!(
                parse(udp, &ip),
                Ok(p),
                "parse_ipv4 and parse disagree on the UDP payload"
            );
            assert_eq!(ip.dst_port, ROCE_V2_PORT);
            assert_eq!(ip.flags_frag & 0x3fff, 0, "accepted a fragment");
            check_accepted(&p, udp, &ip);
            // The IPv4/UDP header written back from what was parsed (and the
            // TOS and TTL, which the ICRC leaves out) is the datagram's, but
            // for the checksums (0 and 0xffff are both a valid IPv4 checksum
            // of zero; vrdma ignores the UDP checksum).
            let mut hdr = [0u8; IP_UDP_LEN];
            let written = write_ipv4_udp_header(&mut hdr, &ip, dgram[1], dgram[8], udp.len());
            assert_eq!(written, Ok(IP_UDP_LEN));
            for (i, (a, b)) in hdr.iter().zip(dgram).enumerate() {
                if !matches!(i, 10 | 11 | 26 | 27) {
                    assert_eq!(a, b, "IPv4/UDP header byte {i} differs after a round trip");
                }
            }
            // A flipped bit of the datagram: dropped unless it is one of
            // the UDP checksum's or BTH byte 4's congestion bits.
            let bit = usize::from(flip) % (dgram.len() * 8);
            let mut v = dgram.to_vec();
            v[bit / 8] ^= 0x80 >> (bit % 8);
            let unprotected =
                matches!(bit / 8, 26 | 27) || (bit / 8 == IP_UDP_LEN + 4 && bit % 8 < 2);
            let r = parse_ipv4(&v);
            assert_eq!(r.is_ok(), unprotected, "flip of bit {bit}: {r:?}");
            true
        }
        Err(e) => check_refused(e),
    }
}

/// What `parse` accepted is exactly what `build` makes of its parts.
fn check_accepted(p: &Packet, udp: &[u8], ip: &Ipv4Meta) {
    let h = p.headers();
    let info = p.bth.opcode.info();
    assert_eq!(p.bth.pad, pad_for(p.payload.len()), "pad count not minimal");
    assert_eq!(
        packet_len(&h, p.payload.len()),
        udp.len(),
        "length mismatch"
    );
    assert_eq!(
        p.payload,
        &udp[info.header_len..info.header_len + p.payload.len()],
        "payload is not the bytes after the headers"
    );
    assert!(info.payload || p.payload.is_empty());
    assert!(p.bth.dest_qp < 1 << 24 && p.bth.psn.0 < 1 << 24);
    let mut out = vec![0u8; udp.len()];
    match build(&mut out, &h, p.payload, ip) {
        Ok(n) => assert_eq!(&out[..n], udp, "accepted packet re-builds differently"),
        Err(e) => panic!("accepted packet does not re-build: {e} ({h:?})"),
    }
}

/// A bit flip of an accepted packet is dropped, but for FECN and BECN.
fn check_flip(udp: &[u8], ip: &Ipv4Meta, good: &Packet, flip: u16) {
    let bit = usize::from(flip) % (udp.len() * 8);
    let mut v = udp.to_vec();
    v[bit / 8] ^= 0x80 >> (bit % 8);
    match parse(&v, ip) {
        Ok(p) if bit == 32 => assert_eq!(
            p.bth,
            Bth {
                fecn: !good.bth.fecn,
                ..good.bth
            }
        ),
        Ok(p) if bit == 33 => assert_eq!(
            p.bth,
            Bth {
                becn: !good.bth.becn,
                ..good.bth
            }
        ),
        Ok(p) => panic!("flip of bit {bit} accepted: {p:?}"),
        Err(_) => {}
    }
}

fn check_refused(e: DropReason) -> bool {
    assert!(e.index() < DropReason::COUNT);
    assert_eq!(e.name(), DropReason::NAMES[e.index()]);
    assert!(!e.to_string().is_empty());
    false
}

/// Headers of an opcode the input picks, with the input's fields (some out
/// of their widths), built, parsed back and compared.
fn check_structured(input: &mut Input, flip: u16) -> bool {
    let Some(&opcode) = input.pick(&Opcode::ALL) else {
        return false;
    };
    let info = opcode.info();
    let bth = Bth {
        opcode,
        solicited: input.bool(),
        migreq: input.bool(),
        pad: input.u8(),
        pkey: input.u16(),
        fecn: input.bool(),
        becn: input.bool(),
        // Now and then wider than 24 bits: build must refuse it.
        dest_qp: input.u32()
            & if input.u8() == 0xff {
                u32::MAX
            } else {
                0xff_ffff
            },
        ack_req: input.bool(),
        psn: Psn(input.u32()
            & if input.u8() == 0xff {
                u32::MAX
            } else {
                0xff_ffff
            }),
    };
    let aeth = match input.u8() % 3 {
        0 => Aeth::Ack {
            credits: input.u8() % 33,
            msn: input.u32() % (1 << 24),
        },
        1 => Aeth::RnrNak {
            timer: input.u8() % 33,
            msn: input.u32() % (1 << 24),
        },
        _ => {
            let codes = [
                NakCode::PsnSequenceError,
                NakCode::InvalidRequest,
                NakCode::RemoteAccessError,
                NakCode::RemoteOperationalError,
                NakCode::InvalidRdRequest,
            ];
            let code = *input.pick(&codes).unwrap_or(&NakCode::InvalidRequest);
            Aeth::Nak {
                code,
                msn: input.u32() % (1 << 24),
            }
        }
    };
    // Usually the opcode's headers; now and then one more or one missing.
    let toggle = input.u8();
    let want = |bit: u8, wanted: bool| wanted != (toggle == (0xf0 | bit));
    let h = Headers {
        bth,
        deth: want(0, info.deth).then(|| Deth {
            qkey: input.u32(),
            src_qp: input.u32() % (1 << 24),
        }),
        reth: want(1, info.reth).then(|| Reth {
            va: input.u64(),
            rkey: input.u32(),
            dma_len: input.u32(),
        }),
        aeth: want(2, info.aeth).then_some(aeth),
        atomic: want(3, info.atomic_eth).then(|| AtomicEth {
            va: input.u64(),
            rkey: input.u32(),
            swap_add: input.u64(),
            compare: input.u64(),
        }),
        atomic_ack: want(4, info.atomic_ack_eth).then(|| AtomicAckEth { orig: input.u64() }),
        imm: want(5, info.imm).then(|| input.array::<4>()),
        ieth: want(6, info.ieth).then(|| input.u32()),
    };
    let ip = meta(input);
    let payload_len = usize::from(input.u16() % 4200);
    let payload: Vec<u8> = (0..payload_len).map(|i| i as u8 ^ 0x5a).collect();
    let mut out = vec![0u8; MAX_HEADER_LEN + payload_len + 8];
    match build(&mut out, &h, &payload, &ip) {
        Ok(n) => {
            let udp = &out[..n];
            if ip.dst_port != ROCE_V2_PORT {
                assert_eq!(parse(udp, &ip), Err(DropReason::NotRoce));
                return false;
            }
            let p = match parse(udp, &ip) {
                Ok(p) => p,
                Err(e) => panic!("built packet refused: {e} ({h:?})"),
            };
            let mut expect = h;
            expect.bth.pad = pad_for(payload.len());
            assert_eq!(p.headers(), expect, "headers changed on the wire");
            assert_eq!(p.payload, &payload[..], "payload changed on the wire");
            check_accepted(&p, udp, &ip);
            check_flip(udp, &ip, &p, flip);
            true
        }
        Err(_) => {
            // Refused only for a real reason.
            let width_ok = h.bth.dest_qp < 1 << 24
                && h.bth.psn.0 < 1 << 24
                && match h.aeth {
                    Some(Aeth::Ack { credits: v, .. }) | Some(Aeth::RnrNak { timer: v, .. }) => {
                        v < 32
                    }
                    _ => true,
                };
            let headers_ok = h.deth.is_some() == info.deth
                && h.reth.is_some() == info.reth
                && h.aeth.is_some() == info.aeth
                && h.atomic.is_some() == info.atomic_eth
                && h.atomic_ack.is_some() == info.atomic_ack_eth
                && h.imm.is_some() == info.imm
                && h.ieth.is_some() == info.ieth;
            let payload_ok = info.payload || payload.is_empty();
            assert!(
                !(width_ok && headers_ok && payload_ok),
                "build refused valid headers {h:?} with {payload_len} bytes"
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The golden RC SEND ONLY of vrdma-roce's tests ("hello", ICRC
    /// 0xdbbd0d3b) from 10.200.1.1:49152 to 10.200.1.2:4791.
    const GOLDEN: [u8; 24] = [
        0x04, 0x30, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x01, 0x00, b'h', b'e', b'l',
        b'l', b'o', 0, 0, 0, 0x3b, 0x0d, 0xbd, 0xdb,
    ];
    /// Port selector (RoCE), addresses, ID 0, DF, source port 0xc000, in
    /// the check's input order (little-endian numbers).
    const META: [u8; 15] = [
        0, 10, 200, 1, 1, 10, 200, 1, 2, 0, 0, 0x00, 0x40, 0x00, 0xc0,
    ];

    fn input(mode: u8, flip: u16, rest: &[&[u8]]) -> Vec<u8> {
        let mut v = vec![mode];
        v.extend_from_slice(&flip.to_le_bytes());
        for r in rest {
            v.extend_from_slice(r);
        }
        v
    }

    #[test]
    fn valid_packets_reach_the_accepted_path_in_every_mode() {
        let ip = Ipv4Meta::outgoing(
            Ipv4Addr::new(10, 200, 1, 1),
            Ipv4Addr::new(10, 200, 1, 2),
            0xc000,
        );
        let mut dgram = [0u8; 52];
        assert_eq!(write_ipv4_udp_header(&mut dgram, &ip, 0, 64, 24), Ok(28));
        dgram[28..].copy_from_slice(&GOLDEN);
        for flip in [0, 33, 100, 415] {
            assert!(run(&input(0, flip, &[&META, &GOLDEN])));
            assert!(run(&input(2, flip, &[&dgram])));
            // Broken ICRC / checksums, fixed by the sealing modes.
            let mut broken = GOLDEN;
            broken[23] ^= 1;
            assert!(!run(&input(0, flip, &[&META, &broken])));
            assert!(run(&input(1, flip, &[&META, &broken])));
            let mut broken = dgram;
            broken[2] = 0;
            broken[10] ^= 1;
            broken[51] ^= 1;
            assert!(!run(&input(2, flip, &[&broken])));
            assert!(run(&input(3, flip, &[&broken])));
        }
        // Structured: every opcode, all-zero fields (valid widths) and a
        // payload length from the end of the input (zero-padded).
        for i in 0..Opcode::ALL.len() {
            assert!(
                run(&input(4, 7, &[&[i as u8]])),
                "opcode {:?}",
                Opcode::ALL[i]
            );
        }
    }
}
