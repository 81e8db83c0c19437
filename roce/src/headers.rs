//! The InfiniBand transport headers: BTH and the extension headers (IBA
//! 9.2–9.4, Linux rxe's `rxe_hdr.h`). All fields are big-endian on the wire.
//!
//! Decoders take fixed-size arrays (the caller has bounds-checked the
//! packet), so nothing here can index out of bounds.

use crate::psn::{Psn, PSN_MASK};
use crate::{BuildError, DropReason, Opcode};

/// The default (full-membership) partition key.
pub const DEFAULT_PKEY: u16 = 0xffff;

/// Base Transport Header (12 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bth {
    pub opcode: Opcode,
    /// Solicited event (SE).
    pub solicited: bool,
    /// Migration request (M).
    pub migreq: bool,
    /// Pad count, 0..=3: bytes after the payload that make it a multiple of
    /// 4. Filled by the parser; `build` computes it and ignores this value.
    pub pad: u8,
    pub pkey: u16,
    /// Forward/backward explicit congestion notification. These bits are
    /// outside the ICRC (switches may set them), so they are never trusted
    /// for anything but congestion hints.
    pub fecn: bool,
    pub becn: bool,
    /// Destination QP, 24 bits.
    pub dest_qp: u32,
    /// Acknowledge request (A).
    pub ack_req: bool,
    pub psn: Psn,
}

/// RDMA Extended Transport Header (16 bytes): WRITE FIRST/ONLY, READ request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reth {
    pub va: u64,
    pub rkey: u32,
    pub dma_len: u32,
}

/// NAK codes of an AETH (IBA 9.7.5.2.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    PsnSequenceError = 0,
    InvalidRequest = 1,
    RemoteAccessError = 2,
    RemoteOperationalError = 3,
    InvalidRdRequest = 4,
}

impl NakCode {
    fn from_u8(v: u8) -> Option<NakCode> {
        Some(match v {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            _ => return None,
        })
    }
}

/// ACK Extended Transport Header (4 bytes): a syndrome byte (bit 7
/// reserved, bits 6..5 the type: 00 ACK, 01 RNR NAK, 11 NAK; bits 4..0 the
/// credit count, RNR timer or NAK code) and a 24-bit MSN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aeth {
    /// `credits`: the 5-bit credit code; 31 means "no credit count"
    /// (unlimited / invalid).
    Ack {
        credits: u8,
        msn: u32,
    },
    /// `timer`: the 5-bit RNR timer code (IBA table 45).
    RnrNak {
        timer: u8,
        msn: u32,
    },
    Nak {
        code: NakCode,
        msn: u32,
    },
}

/// The credit code of an ACK that carries no credit count.
pub const AETH_CREDITS_INVALID: u8 = 0x1f;

impl Aeth {
    pub fn msn(&self) -> u32 {
        match *self {
            Aeth::Ack { msn, .. } | Aeth::RnrNak { msn, .. } | Aeth::Nak { msn, .. } => msn,
        }
    }
}

/// Atomic Extended Transport Header (28 bytes): COMPARE SWAP, FETCH ADD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicEth {
    pub va: u64,
    pub rkey: u32,
    /// The swap value (compare-swap) or the addend (fetch-add).
    pub swap_add: u64,
    pub compare: u64,
}

/// Atomic Acknowledge Extended Transport Header (8 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicAckEth {
    pub orig: u64,
}

/// Datagram Extended Transport Header (8 bytes): UD packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Deth {
    pub qkey: u32,
    /// Source QP, 24 bits.
    pub src_qp: u32,
}

const BTH_SE: u8 = 0x80;
const BTH_MIG: u8 = 0x40;
const BTH_PAD_SHIFT: u8 = 4;
const BTH_PAD: u8 = 0x30;
const BTH_TVER: u8 = 0x0f;
const BTH_FECN: u8 = 0x80;
const BTH_BECN: u8 = 0x40;
const BTH_RESV6A: u8 = 0x3f;
const BTH_ACK: u8 = 0x80;
const BTH_RESV7: u8 = 0x7f;
const QPN_MASK: u32 = 0x00ff_ffff;

fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

fn be24(b: [u8; 3]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

fn put24(out: &mut [u8; 3], v: u32) {
    let [_, a, b, c] = v.to_be_bytes();
    *out = [a, b, c];
}

impl Bth {
    /// Decodes a BTH, checking the version and reserved bits.
    pub fn decode(b: &[u8; 12]) -> Result<Bth, DropReason> {
        let [op, flags, p0, p1, ecn, q0, q1, q2, a, s0, s1, s2] = *b;
        let opcode = Opcode::try_from(op)?;
        if flags & BTH_TVER != 0 {
            return Err(DropReason::BadVersion);
        }
        if ecn & BTH_RESV6A != 0 || a & BTH_RESV7 != 0 {
            return Err(DropReason::ReservedBits);
        }
        Ok(Bth {
            opcode,
            solicited: flags & BTH_SE != 0,
            migreq: flags & BTH_MIG != 0,
            pad: (flags & BTH_PAD) >> BTH_PAD_SHIFT,
            pkey: be16([p0, p1]),
            fecn: ecn & BTH_FECN != 0,
            becn: ecn & BTH_BECN != 0,
            dest_qp: be24([q0, q1, q2]),
            ack_req: a & BTH_ACK != 0,
            psn: Psn(be24([s0, s1, s2])),
        })
    }

    /// Encodes the BTH with pad count `pad` (TVer 0, reserved bits 0).
    pub fn encode(&self, pad: u8, out: &mut [u8; 12]) -> Result<(), BuildError> {
        check_width("bth.dest_qp", self.dest_qp, QPN_MASK)?;
        check_width("bth.psn", self.psn.0, PSN_MASK)?;
        let mut flags = (pad << BTH_PAD_SHIFT) & BTH_PAD;
        if self.solicited {
            flags |= BTH_SE;
        }
        if self.migreq {
            flags |= BTH_MIG;
        }
        let mut ecn = 0;
        if self.fecn {
            ecn |= BTH_FECN;
        }
        if self.becn {
            ecn |= BTH_BECN;
        }
        let [p0, p1] = self.pkey.to_be_bytes();
        let [_, q0, q1, q2] = self.dest_qp.to_be_bytes();
        let [_, s0, s1, s2] = self.psn.0.to_be_bytes();
        let a = if self.ack_req { BTH_ACK } else { 0 };
        *out = [
            self.opcode as u8,
            flags,
            p0,
            p1,
            ecn,
            q0,
            q1,
            q2,
            a,
            s0,
            s1,
            s2,
        ];
        Ok(())
    }
}

fn check_width(field: &'static str, v: u32, mask: u32) -> Result<(), BuildError> {
    if v & !mask != 0 {
        Err(BuildError::OutOfRange {
            field,
            value: u64::from(v),
        })
    } else {
        Ok(())
    }
}

impl Reth {
    pub fn decode(b: &[u8; 16]) -> Reth {
        let (va, rkey, len) = split3_8_4_4(b);
        Reth {
            va: u64::from_be_bytes(va),
            rkey: u32::from_be_bytes(rkey),
            dma_len: u32::from_be_bytes(len),
        }
    }

    pub fn encode(&self, out: &mut [u8; 16]) {
        let (va, rest) = out.split_at_mut(8);
        let (rkey, len) = rest.split_at_mut(4);
        va.copy_from_slice(&self.va.to_be_bytes());
        rkey.copy_from_slice(&self.rkey.to_be_bytes());
        len.copy_from_slice(&self.dma_len.to_be_bytes());
    }
}

fn split3_8_4_4(b: &[u8; 16]) -> ([u8; 8], [u8; 4], [u8; 4]) {
    let [a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3] = *b;
    (
        [a0, a1, a2, a3, a4, a5, a6, a7],
        [b0, b1, b2, b3],
        [c0, c1, c2, c3],
    )
}

const AETH_RESERVED_BIT: u8 = 0x80;
const AETH_TYPE_SHIFT: u8 = 5;
const AETH_VALUE: u8 = 0x1f;

impl Aeth {
    /// Decodes an AETH, refusing the reserved syndromes.
    pub fn decode(b: &[u8; 4]) -> Result<Aeth, DropReason> {
        let [syn, m0, m1, m2] = *b;
        let msn = be24([m0, m1, m2]);
        if syn & AETH_RESERVED_BIT != 0 {
            return Err(DropReason::BadAeth);
        }
        let value = syn & AETH_VALUE;
        match syn >> AETH_TYPE_SHIFT {
            0 => Ok(Aeth::Ack {
                credits: value,
                msn,
            }),
            1 => Ok(Aeth::RnrNak { timer: value, msn }),
            3 => NakCode::from_u8(value)
                .map(|code| Aeth::Nak { code, msn })
                .ok_or(DropReason::BadAeth),
            _ => Err(DropReason::BadAeth),
        }
    }

    pub fn encode(&self, out: &mut [u8; 4]) -> Result<(), BuildError> {
        let (syn, msn) = match *self {
            Aeth::Ack { credits, msn } => {
                check_width("aeth.credits", u32::from(credits), u32::from(AETH_VALUE))?;
                (credits, msn)
            }
            Aeth::RnrNak { timer, msn } => {
                check_width("aeth.timer", u32::from(timer), u32::from(AETH_VALUE))?;
                ((1 << AETH_TYPE_SHIFT) | timer, msn)
            }
            Aeth::Nak { code, msn } => ((3 << AETH_TYPE_SHIFT) | code as u8, msn),
        };
        check_width("aeth.msn", msn, PSN_MASK)?;
        let [_, m0, m1, m2] = msn.to_be_bytes();
        *out = [syn, m0, m1, m2];
        Ok(())
    }
}

impl AtomicEth {
    pub fn decode(b: &[u8; 28]) -> AtomicEth {
        let (va, rest) = b.split_at(8);
        let (rkey, rest) = rest.split_at(4);
        let (swap_add, compare) = rest.split_at(8);
        AtomicEth {
            va: u64::from_be_bytes(arr(va)),
            rkey: u32::from_be_bytes(arr(rkey)),
            swap_add: u64::from_be_bytes(arr(swap_add)),
            compare: u64::from_be_bytes(arr(compare)),
        }
    }

    pub fn encode(&self, out: &mut [u8; 28]) {
        let (va, rest) = out.split_at_mut(8);
        let (rkey, rest) = rest.split_at_mut(4);
        let (swap_add, compare) = rest.split_at_mut(8);
        va.copy_from_slice(&self.va.to_be_bytes());
        rkey.copy_from_slice(&self.rkey.to_be_bytes());
        swap_add.copy_from_slice(&self.swap_add.to_be_bytes());
        compare.copy_from_slice(&self.compare.to_be_bytes());
    }
}

/// A fixed array from a slice of exactly its length (the callers split
/// fixed arrays, so the lengths always match; a mismatch gives zeros
/// rather than a panic path).
fn arr<const N: usize>(s: &[u8]) -> [u8; N] {
    s.try_into().unwrap_or([0; N])
}

impl AtomicAckEth {
    pub fn decode(b: &[u8; 8]) -> AtomicAckEth {
        AtomicAckEth {
            orig: u64::from_be_bytes(*b),
        }
    }

    pub fn encode(&self, out: &mut [u8; 8]) {
        *out = self.orig.to_be_bytes();
    }
}

impl Deth {
    /// Decodes a DETH, refusing a non-zero reserved byte before the source QP.
    pub fn decode(b: &[u8; 8]) -> Result<Deth, DropReason> {
        let [k0, k1, k2, k3, resv, s0, s1, s2] = *b;
        if resv != 0 {
            return Err(DropReason::ReservedBits);
        }
        Ok(Deth {
            qkey: u32::from_be_bytes([k0, k1, k2, k3]),
            src_qp: be24([s0, s1, s2]),
        })
    }

    pub fn encode(&self, out: &mut [u8; 8]) -> Result<(), BuildError> {
        check_width("deth.src_qp", self.src_qp, QPN_MASK)?;
        let [k0, k1, k2, k3] = self.qkey.to_be_bytes();
        let mut qp = [0; 3];
        put24(&mut qp, self.src_qp);
        let [s0, s1, s2] = qp;
        *out = [k0, k1, k2, k3, 0, s0, s1, s2];
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bth() -> Bth {
        Bth {
            opcode: Opcode::RcSendOnly,
            solicited: true,
            migreq: false,
            pad: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: true,
            dest_qp: 0x12_34_56,
            ack_req: true,
            psn: Psn(0xab_cd_ef),
        }
    }

    #[test]
    fn bth_bit_positions_match_rxe() {
        let mut out = [0; 12];
        bth().encode(3, &mut out).expect("encode");
        assert_eq!(
            out,
            [
                0x04,
                0x80 | 0x30,
                0xff,
                0xff,
                0x40,
                0x12,
                0x34,
                0x56,
                0x80,
                0xab,
                0xcd,
                0xef
            ]
        );
        let back = Bth::decode(&out).expect("decode");
        assert_eq!(back, Bth { pad: 3, ..bth() });
    }

    #[test]
    fn bth_refuses_version_and_reserved_bits() {
        let mut out = [0; 12];
        bth().encode(0, &mut out).expect("encode");
        for tver in 1..16u8 {
            let mut b = out;
            b[1] |= tver;
            assert_eq!(Bth::decode(&b), Err(DropReason::BadVersion));
        }
        for bit in 0..6 {
            let mut b = out;
            b[4] |= 1 << bit;
            assert_eq!(Bth::decode(&b), Err(DropReason::ReservedBits));
        }
        for bit in 0..7 {
            let mut b = out;
            b[8] |= 1 << bit;
            assert_eq!(Bth::decode(&b), Err(DropReason::ReservedBits));
        }
        let mut b = out;
        b[0] = 0x15;
        assert_eq!(Bth::decode(&b), Err(DropReason::UnknownOpcode(0x15)));
    }

    #[test]
    fn bth_encode_refuses_wide_fields() {
        let mut out = [0; 12];
        let wide_qp = Bth {
            dest_qp: 1 << 24,
            ..bth()
        };
        assert!(matches!(
            wide_qp.encode(0, &mut out),
            Err(BuildError::OutOfRange {
                field: "bth.dest_qp",
                ..
            })
        ));
        let wide_psn = Bth {
            psn: Psn(1 << 24),
            ..bth()
        };
        assert!(wide_psn.encode(0, &mut out).is_err());
    }

    #[test]
    fn aeth_syndromes_match_rxe() {
        let cases = [
            (
                Aeth::Ack {
                    credits: 0x1f,
                    msn: 0x010203,
                },
                [0x1f, 1, 2, 3],
            ),
            (
                Aeth::Ack {
                    credits: 0,
                    msn: 0xffffff,
                },
                [0x00, 0xff, 0xff, 0xff],
            ),
            (
                Aeth::RnrNak {
                    timer: 0x0e,
                    msn: 7,
                },
                [0x2e, 0, 0, 7],
            ),
            (
                Aeth::Nak {
                    code: NakCode::PsnSequenceError,
                    msn: 1,
                },
                [0x60, 0, 0, 1],
            ),
            (
                Aeth::Nak {
                    code: NakCode::RemoteAccessError,
                    msn: 1,
                },
                [0x62, 0, 0, 1],
            ),
            (
                Aeth::Nak {
                    code: NakCode::InvalidRdRequest,
                    msn: 1,
                },
                [0x64, 0, 0, 1],
            ),
        ];
        for (aeth, wire) in cases {
            let mut out = [0; 4];
            aeth.encode(&mut out).expect("encode");
            assert_eq!(out, wire, "{aeth:?}");
            assert_eq!(Aeth::decode(&wire), Ok(aeth));
        }
        for syn in [0x40, 0x5f, 0x65, 0x7f, 0x80, 0xe0] {
            assert_eq!(
                Aeth::decode(&[syn, 0, 0, 0]),
                Err(DropReason::BadAeth),
                "{syn:#x}"
            );
        }
        let mut out = [0; 4];
        assert!(Aeth::Ack {
            credits: 32,
            msn: 0
        }
        .encode(&mut out)
        .is_err());
        assert!(Aeth::RnrNak { timer: 32, msn: 0 }.encode(&mut out).is_err());
        assert!(Aeth::Ack {
            credits: 0,
            msn: 1 << 24
        }
        .encode(&mut out)
        .is_err());
    }

    #[test]
    fn extension_headers_round_trip_big_endian() {
        let reth = Reth {
            va: 0x0102_0304_0506_0708,
            rkey: 0x0a0b_0c0d,
            dma_len: 0x1000,
        };
        let mut r = [0; 16];
        reth.encode(&mut r);
        assert_eq!(
            r,
            [1, 2, 3, 4, 5, 6, 7, 8, 0xa, 0xb, 0xc, 0xd, 0, 0, 0x10, 0]
        );
        assert_eq!(Reth::decode(&r), reth);

        let atomic = AtomicEth {
            va: 0x1122_3344_5566_7788,
            rkey: 0x99aa_bbcc,
            swap_add: 0x0102_0304_0506_0708,
            compare: 0xf0e0_d0c0_b0a0_9080,
        };
        let mut a = [0; 28];
        atomic.encode(&mut a);
        assert_eq!(&a[..4], &[0x11, 0x22, 0x33, 0x44]);
        assert_eq!(&a[8..12], &[0x99, 0xaa, 0xbb, 0xcc]);
        assert_eq!(&a[12..14], &[0x01, 0x02]);
        assert_eq!(&a[20..22], &[0xf0, 0xe0]);
        assert_eq!(AtomicEth::decode(&a), atomic);

        let ack = AtomicAckEth {
            orig: 0x0102_0304_0506_0708,
        };
        let mut k = [0; 8];
        ack.encode(&mut k);
        assert_eq!(k, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(AtomicAckEth::decode(&k), ack);

        let deth = Deth {
            qkey: 0x8001_0000,
            src_qp: 0x00ab_cdef,
        };
        let mut d = [0; 8];
        deth.encode(&mut d).expect("encode");
        assert_eq!(d, [0x80, 1, 0, 0, 0, 0xab, 0xcd, 0xef]);
        assert_eq!(Deth::decode(&d), Ok(deth));
        d[4] = 1;
        assert_eq!(Deth::decode(&d), Err(DropReason::ReservedBits));
    }
}
