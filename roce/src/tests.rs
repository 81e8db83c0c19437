//! Whole-packet tests: a golden vector, round trips of every opcode, and
//! the hostile-input properties (every bit flip and every truncation of a
//! packet is dropped).

use std::net::Ipv4Addr;

use proptest::prelude::*;

use crate::*;

fn bth(opcode: Opcode) -> Bth {
    Bth {
        opcode,
        solicited: false,
        migreq: false,
        pad: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qp: 0x11,
        ack_req: true,
        psn: Psn(0x100),
    }
}

fn golden_ip() -> Ipv4Meta {
    Ipv4Meta::outgoing(
        Ipv4Addr::new(10, 200, 1, 1),
        Ipv4Addr::new(10, 200, 1, 2),
        0xc000,
    )
}

/// Rewrites the ICRC of a (tampered) packet so that only the header checks
/// can refuse it.
fn seal(pkt: &mut [u8], ip: &Ipv4Meta) {
    let (body, crc) = pkt.split_at_mut(pkt.len() - ICRC_LEN);
    crc.copy_from_slice(&icrc(ip, body).to_le_bytes());
}

/// An RC SEND ONLY of "hello" from 10.200.1.1:49152 to 10.200.1.2:4791,
/// QP 0x11, PSN 0x100, AckReq, P_Key 0xffff. Its ICRC was computed
/// independently of this crate, with Python's zlib (a finalised CRC-32
/// continues from 0 as from the register 0xffffffff, so the 8 bytes of 0xff
/// in front give rxe's seed 0xdebb20e3; masked: TOS, TTL, IP checksum, UDP
/// checksum, BTH byte 4):
///
/// ```python
/// import zlib
/// ip  = bytes.fromhex("45ff003400004000ff11ffff0ac801010ac80102")
/// udp = bytes.fromhex("c00012b70020ffff")
/// bth = bytes.fromhex("0430ffffff00001180000100")
/// crc = zlib.crc32(b"\xff" * 8 + ip + udp + bth + b"hello\0\0\0")
/// assert crc == 0xdbbd0d3b   # on the wire little-endian: 3b 0d bd db
/// ```
#[test]
fn golden_rc_send_only() {
    let ip = golden_ip();
    let h = Headers::new(bth(Opcode::RcSendOnly));
    let mut out = [0u8; 64];
    let n = build(&mut out, &h, b"hello", &ip).expect("build");
    let expect: [u8; 24] = [
        0x04, 0x30, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x01, 0x00, // BTH
        b'h', b'e', b'l', b'l', b'o', 0, 0, 0, // payload, pad 3
        0x3b, 0x0d, 0xbd, 0xdb, // ICRC 0xdbbd0d3b, little-endian
    ];
    assert_eq!(&out[..n], &expect);
    assert_eq!(icrc(&ip, &expect[..20]), 0xdbbd_0d3b);

    let p = parse(&expect, &ip).expect("parse");
    assert_eq!(
        p.bth,
        Bth {
            pad: 3,
            ..bth(Opcode::RcSendOnly)
        }
    );
    assert_eq!(p.payload, b"hello");

    // The same as a raw socket hands it.
    let mut dgram = [0u8; 52];
    assert_eq!(write_ipv4_udp_header(&mut dgram, &ip, 0x0, 64, n), Ok(28));
    dgram[28..].copy_from_slice(&expect);
    let (meta, p2) = parse_ipv4(&dgram).expect("parse_ipv4");
    assert_eq!(meta, ip);
    assert_eq!(p2, p);
    // TOS and TTL are masked: any values check.
    assert_eq!(write_ipv4_udp_header(&mut dgram, &ip, 0xb8, 1, n), Ok(28));
    assert_eq!(parse_ipv4(&dgram).map(|(_, p)| p), Ok(p));
}

#[test]
fn specific_drops_with_a_valid_icrc() {
    let ip = golden_ip();
    let mut out = [0u8; 64];
    let n = build(
        &mut out,
        &Headers::new(bth(Opcode::RcSendOnly)),
        b"hello",
        &ip,
    )
    .expect("build");
    let good = out[..n].to_vec();
    let tamper = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut v = good.clone();
        f(&mut v);
        seal(&mut v, &ip);
        parse(&v, &ip).map(|_| ())
    };
    assert_eq!(tamper(&|_| {}), Ok(()));
    assert_eq!(
        tamper(&|v| v[0] = 0x15),
        Err(DropReason::UnknownOpcode(0x15))
    );
    assert_eq!(
        tamper(&|v| v[0] = 0x81),
        Err(DropReason::UnknownOpcode(0x81))
    );
    assert_eq!(tamper(&|v| v[1] |= 1), Err(DropReason::BadVersion));
    assert_eq!(tamper(&|v| v[8] |= 0x40), Err(DropReason::ReservedBits));
    assert_eq!(tamper(&|v| v[18] = 1), Err(DropReason::BadPad));
    assert_eq!(tamper(&|v| v.insert(20, 0)), Err(DropReason::BadLength));
    // Pad 3 of a 0-byte region: nothing after the BTH.
    assert_eq!(
        tamper(&|v| {
            v.drain(12..20);
        }),
        Err(DropReason::BadPad)
    );
    // An ACK with payload, and with a pad count.
    let ack = Headers {
        aeth: Some(Aeth::Ack { credits: 3, msn: 9 }),
        ..Headers::new(bth(Opcode::RcAck))
    };
    let n = build(&mut out, &ack, &[], &ip).expect("build ack");
    let ack_pkt = out[..n].to_vec();
    let mut v = ack_pkt.clone();
    v.splice(16..16, [0u8; 4]);
    seal(&mut v, &ip);
    assert_eq!(parse(&v, &ip).map(|_| ()), Err(DropReason::BadLength));
    let mut v = ack_pkt.clone();
    v[1] |= 0x10;
    seal(&mut v, &ip);
    assert_eq!(parse(&v, &ip).map(|_| ()), Err(DropReason::BadPad));
    // An ACK cut before its AETH ends (sealed, so only the length refuses it).
    let mut v = ack_pkt[..12].to_vec();
    v.extend_from_slice(&[0; 4]);
    seal(&mut v, &ip);
    assert_eq!(parse(&v, &ip).map(|_| ()), Err(DropReason::Truncated));
    // Reserved AETH syndrome.
    let mut v = ack_pkt.clone();
    v[12] = 0x40;
    seal(&mut v, &ip);
    assert_eq!(parse(&v, &ip).map(|_| ()), Err(DropReason::BadAeth));
    // Wrong port.
    let other = Ipv4Meta {
        dst_port: 4790,
        ..ip
    };
    assert_eq!(parse(&good, &other).map(|_| ()), Err(DropReason::NotRoce));
    // Any other source, destination, ID or flags: the ICRC covers them.
    for other in [
        Ipv4Meta {
            src: Ipv4Addr::new(10, 200, 1, 3),
            ..ip
        },
        Ipv4Meta {
            dst: Ipv4Addr::new(10, 200, 1, 3),
            ..ip
        },
        Ipv4Meta { id: 1, ..ip },
        Ipv4Meta {
            flags_frag: 0,
            ..ip
        },
        Ipv4Meta {
            src_port: 4791,
            ..ip
        },
    ] {
        assert_eq!(parse(&good, &other).map(|_| ()), Err(DropReason::BadIcrc));
    }
}

#[test]
fn build_refuses_what_does_not_match_the_opcode() {
    let ip = golden_ip();
    let mut out = [0u8; 256];
    let send_with_reth = Headers {
        reth: Some(Reth::default()),
        ..Headers::new(bth(Opcode::RcSendOnly))
    };
    assert_eq!(
        build(&mut out, &send_with_reth, &[], &ip),
        Err(BuildError::HeadersMismatch {
            opcode: Opcode::RcSendOnly,
            header: "RETH",
            problem: "has no",
        })
    );
    let write_without_reth = Headers::new(bth(Opcode::RcWriteOnly));
    assert!(matches!(
        build(&mut out, &write_without_reth, &[], &ip),
        Err(BuildError::HeadersMismatch {
            header: "RETH",
            problem: "requires",
            ..
        })
    ));
    let read = Headers {
        reth: Some(Reth::default()),
        ..Headers::new(bth(Opcode::RcReadRequest))
    };
    assert_eq!(
        build(&mut out, &read, &[1], &ip),
        Err(BuildError::PayloadNotAllowed(Opcode::RcReadRequest))
    );
    assert_eq!(build(&mut out, &read, &[], &ip), Ok(32));
    let send = Headers::new(bth(Opcode::RcSendOnly));
    assert_eq!(
        build(&mut out[..20], &send, &[1, 2, 3, 4, 5], &ip),
        Err(BuildError::BufferTooSmall {
            needed: 24,
            available: 20
        })
    );
    let big = vec![0u8; 70_000];
    let mut big_out = vec![0u8; 70_100];
    assert!(matches!(
        build(&mut big_out, &send, &big, &ip),
        Err(BuildError::TooLong(_))
    ));
    let wide = Headers::new(Bth {
        dest_qp: 1 << 24,
        ..bth(Opcode::RcSendOnly)
    });
    assert!(matches!(
        build(&mut out, &wide, &[], &ip),
        Err(BuildError::OutOfRange { .. })
    ));
}

#[test]
fn finish_in_place_and_pieces_give_the_same_bytes() {
    let ip = golden_ip();
    let h = Headers {
        reth: Some(Reth {
            va: 0x1000,
            rkey: 0xabcd,
            dma_len: 4099,
        }),
        imm: Some([1, 2, 3, 4]),
        ..Headers::new(bth(Opcode::RcWriteOnlyImm))
    };
    let payload: Vec<u8> = (0..4099u32).map(|i| i as u8).collect();
    let mut a = vec![0xeeu8; 4200];
    let na = build(&mut a, &h, &payload, &ip).expect("build");
    assert_eq!(na, packet_len(&h, payload.len()));
    assert_eq!(na, 32 + 4099 + 1 + 4);

    let mut b = vec![0xeeu8; 4200];
    let hl = header_len(&h);
    b[hl..hl + payload.len()].copy_from_slice(&payload);
    let nb = finish_in_place(&mut b, &h, payload.len(), &ip).expect("finish");
    assert_eq!(&a[..na], &b[..nb]);

    let mut c = vec![0u8; 4200];
    let (p1, rest) = payload.split_at(7);
    let (p2, p3) = rest.split_at(2048);
    let nc = build_vectored(&mut c, &h, &[p1, &[], p2, p3], &ip).expect("vectored");
    assert_eq!(&a[..na], &c[..nc]);
}

/// Strategy: headers of `op` with random fields and exactly its extension
/// headers, and a payload length for it.
fn headers_for(op: Opcode, max_payload: usize) -> impl Strategy<Value = (Headers, usize)> {
    let info = op.info();
    let bth = (
        any::<(bool, bool, u16, bool, bool)>(),
        0u32..=0xff_ffff,
        any::<bool>(),
        0u32..=PSN_MASK,
    )
        .prop_map(move |((se, m, pkey, fecn, becn), qp, a, psn)| Bth {
            opcode: op,
            solicited: se,
            migreq: m,
            pad: 0,
            pkey,
            fecn,
            becn,
            dest_qp: qp,
            ack_req: a,
            psn: Psn(psn),
        });
    let aeth = prop_oneof![
        (0u8..32, 0u32..=PSN_MASK).prop_map(|(credits, msn)| Aeth::Ack { credits, msn }),
        (0u8..32, 0u32..=PSN_MASK).prop_map(|(timer, msn)| Aeth::RnrNak { timer, msn }),
        (
            prop_oneof![
                Just(NakCode::PsnSequenceError),
                Just(NakCode::InvalidRequest),
                Just(NakCode::RemoteAccessError),
                Just(NakCode::RemoteOperationalError),
                Just(NakCode::InvalidRdRequest),
            ],
            0u32..=PSN_MASK
        )
            .prop_map(|(code, msn)| Aeth::Nak { code, msn }),
    ];
    let payload = if info.payload { 0..=max_payload } else { 0..=0 };
    (
        bth,
        (any::<u32>(), 0u32..=0xff_ffff).prop_map(|(qkey, src_qp)| Deth { qkey, src_qp }),
        any::<(u64, u32, u32)>().prop_map(|(va, rkey, dma_len)| Reth { va, rkey, dma_len }),
        aeth,
        any::<(u64, u32, u64, u64)>().prop_map(|(va, rkey, swap_add, compare)| AtomicEth {
            va,
            rkey,
            swap_add,
            compare,
        }),
        any::<u64>().prop_map(|orig| AtomicAckEth { orig }),
        any::<[u8; 4]>(),
        any::<u32>(),
        payload,
    )
        .prop_map(
            move |(bth, deth, reth, aeth, atomic, ack, imm, ieth, len)| {
                let h = Headers {
                    bth,
                    deth: info.deth.then_some(deth),
                    reth: info.reth.then_some(reth),
                    aeth: info.aeth.then_some(aeth),
                    atomic: info.atomic_eth.then_some(atomic),
                    atomic_ack: info.atomic_ack_eth.then_some(ack),
                    imm: info.imm.then_some(imm),
                    ieth: info.ieth.then_some(ieth),
                };
                (h, len)
            },
        )
}

fn any_headers(max_payload: usize) -> impl Strategy<Value = (Headers, usize)> {
    proptest::sample::select(Opcode::ALL.to_vec())
        .prop_flat_map(move |op| headers_for(op, max_payload))
}

fn any_ip() -> impl Strategy<Value = Ipv4Meta> {
    (
        any::<[u8; 4]>(),
        any::<[u8; 4]>(),
        any::<u16>(),
        any::<bool>(),
        any::<u16>(),
    )
        .prop_map(|(s, d, id, df, sport)| Ipv4Meta {
            src: Ipv4Addr::from(s),
            dst: Ipv4Addr::from(d),
            id,
            flags_frag: if df { IP_DF } else { 0 },
            src_port: sport,
            dst_port: ROCE_V2_PORT,
        })
}

fn payload_of(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn built(h: &Headers, len: usize, seed: u8, ip: &Ipv4Meta) -> Vec<u8> {
    let payload = payload_of(len, seed);
    let mut out = vec![0u8; MAX_HEADER_LEN + len + 8];
    let n = build(&mut out, h, &payload, ip).expect("build");
    out.truncate(n);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// build → parse gives back the headers (with the computed pad) and
    /// the payload, for every opcode; the packet is a multiple of 4 bytes.
    #[test]
    fn round_trip((h, len) in any_headers(4200), seed in any::<u8>(), ip in any_ip()) {
        let bytes = built(&h, len, seed, &ip);
        prop_assert_eq!(bytes.len() % 4, 0);
        prop_assert_eq!(bytes.len(), packet_len(&h, len));
        let p = parse(&bytes, &ip).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut expect = h;
        expect.bth.pad = pad_for(len);
        prop_assert_eq!(p.headers(), expect);
        prop_assert_eq!(p.payload, &payload_of(len, seed)[..]);
        // And through a whole datagram.
        let mut dgram = vec![0u8; 28 + bytes.len()];
        prop_assert_eq!(write_ipv4_udp_header(&mut dgram, &ip, 0, 64, bytes.len()), Ok(28));
        dgram[28..].copy_from_slice(&bytes);
        let (meta, p2) = parse_ipv4(&dgram).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(meta, ip);
        prop_assert_eq!(p2, p);
    }

    /// Every truncation of a packet, and of its datagram, is dropped.
    #[test]
    fn every_truncation_is_dropped((h, len) in any_headers(80), ip in any_ip()) {
        let bytes = built(&h, len, 7, &ip);
        for cut in 0..bytes.len() {
            prop_assert!(parse(&bytes[..cut], &ip).is_err(), "cut at {}", cut);
        }
        let mut dgram = vec![0u8; 28 + bytes.len()];
        prop_assert_eq!(write_ipv4_udp_header(&mut dgram, &ip, 0, 64, bytes.len()), Ok(28));
        dgram[28..].copy_from_slice(&bytes);
        for cut in 0..dgram.len() {
            prop_assert_eq!(parse_ipv4(&dgram[..cut]).map(|_| ()), Err(DropReason::Truncated));
        }
    }

    /// Every single-bit flip of a built packet is dropped — except the two
    /// congestion bits of BTH byte 4 (FECN, BECN), which the ICRC leaves out
    /// by design so that switches may set them: those parse to the same
    /// packet with that bit toggled. (The other six bits of that byte are
    /// reserved and refused.)
    #[test]
    fn every_bit_flip_is_dropped((h, len) in any_headers(64), ip in any_ip()) {
        let bytes = built(&h, len, 3, &ip);
        let good = parse(&bytes, &ip).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut v = bytes.clone();
        for bit in 0..bytes.len() * 8 {
            let (byte, mask) = (bit / 8, 0x80u8 >> (bit % 8));
            v[byte] ^= mask;
            match parse(&v, &ip) {
                Ok(p) if byte == 4 && mask == 0x80 => {
                    prop_assert_eq!(p, Packet { bth: Bth { fecn: !good.bth.fecn, ..good.bth }, ..good });
                }
                Ok(p) if byte == 4 && mask == 0x40 => {
                    prop_assert_eq!(p, Packet { bth: Bth { becn: !good.bth.becn, ..good.bth }, ..good });
                }
                Ok(p) => prop_assert!(false, "flip of bit {} accepted: {:?}", bit, p),
                Err(_) => {}
            }
            v[byte] ^= mask;
        }
    }

    /// Every bit flip of a whole datagram is dropped, except FECN/BECN (as
    /// above) and the UDP checksum, which neither the ICRC nor vrdma checks
    /// (RoCEv2 senders may leave it 0; the ICRC protects the packet).
    #[test]
    fn every_datagram_bit_flip_is_dropped((h, len) in any_headers(32), ip in any_ip()) {
        let bytes = built(&h, len, 5, &ip);
        let mut dgram = vec![0u8; 28 + bytes.len()];
        prop_assert_eq!(write_ipv4_udp_header(&mut dgram, &ip, 0x10, 64, bytes.len()), Ok(28));
        dgram[28..].copy_from_slice(&bytes);
        for bit in 0..dgram.len() * 8 {
            let byte = bit / 8;
            let unprotected = byte == 26 || byte == 27 || (byte == 28 + 4 && bit % 8 < 2);
            dgram[byte] ^= 0x80 >> (bit % 8);
            let r = parse_ipv4(&dgram);
            prop_assert_eq!(r.is_ok(), unprotected, "bit {}: {:?}", bit, r);
            dgram[byte] ^= 0x80 >> (bit % 8);
        }
    }

    /// Random bytes are dropped (a random ICRC matches once in 2^32), and
    /// never panic the parsers.
    #[test]
    fn garbage_is_dropped(data in proptest::collection::vec(any::<u8>(), 0..200), ip in any_ip()) {
        prop_assert!(parse(&data, &ip).is_err());
        prop_assert!(parse_ipv4(&data).is_err());
    }
}
