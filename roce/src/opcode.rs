//! BTH opcodes and the per-opcode table of what follows the BTH (IBA 9.2,
//! Linux rxe's `rxe_opcode.c`).

use crate::{DropReason, RETH_LEN};
use crate::{AETH_LEN, ATOMIC_ACK_ETH_LEN, ATOMIC_ETH_LEN, BTH_LEN, DETH_LEN, IETH_LEN, IMM_LEN};

/// The BTH opcodes vrdma speaks: RC (0x00..=0x17 without 0x15), UC
/// (0x20..=0x2b) and UD SEND ONLY (0x64, 0x65). The top three bits are the
/// transport, the low five the operation. Not spoken: RD (0x40..), CNP
/// (0x81), RC FLUSH and ATOMIC WRITE (0x1c, 0x1d): parsing them gives
/// [`DropReason::UnknownOpcode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Opcode {
    RcSendFirst = 0x00,
    RcSendMiddle = 0x01,
    RcSendLast = 0x02,
    RcSendLastImm = 0x03,
    RcSendOnly = 0x04,
    RcSendOnlyImm = 0x05,
    RcWriteFirst = 0x06,
    RcWriteMiddle = 0x07,
    RcWriteLast = 0x08,
    RcWriteLastImm = 0x09,
    RcWriteOnly = 0x0a,
    RcWriteOnlyImm = 0x0b,
    RcReadRequest = 0x0c,
    RcReadResponseFirst = 0x0d,
    RcReadResponseMiddle = 0x0e,
    RcReadResponseLast = 0x0f,
    RcReadResponseOnly = 0x10,
    RcAck = 0x11,
    RcAtomicAck = 0x12,
    RcCompareSwap = 0x13,
    RcFetchAdd = 0x14,
    RcSendLastInv = 0x16,
    RcSendOnlyInv = 0x17,
    UcSendFirst = 0x20,
    UcSendMiddle = 0x21,
    UcSendLast = 0x22,
    UcSendLastImm = 0x23,
    UcSendOnly = 0x24,
    UcSendOnlyImm = 0x25,
    UcWriteFirst = 0x26,
    UcWriteMiddle = 0x27,
    UcWriteLast = 0x28,
    UcWriteLastImm = 0x29,
    UcWriteOnly = 0x2a,
    UcWriteOnlyImm = 0x2b,
    UdSendOnly = 0x64,
    UdSendOnlyImm = 0x65,
}

/// The transport service an opcode belongs to (its top three bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    Rc,
    Uc,
    Ud,
}

/// The operation a packet is part of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    Send,
    Write,
    ReadReq,
    ReadResp,
    Ack,
    AtomicAck,
    CmpSwap,
    FetchAdd,
}

/// Where a packet sits in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    First,
    Middle,
    Last,
    Only,
}

/// What an opcode's packet holds after the BTH, in wire order: DETH, RETH,
/// AETH, AtomicETH, AtomicAckETH, ImmDt, IETH (at most the pairs
/// RETH+ImmDt, DETH+ImmDt and AETH+AtomicAckETH occur together).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpcodeInfo {
    pub opcode: Opcode,
    pub transport: Transport,
    pub operation: Operation,
    pub position: Position,
    pub deth: bool,
    pub reth: bool,
    pub aeth: bool,
    pub atomic_eth: bool,
    pub atomic_ack_eth: bool,
    pub imm: bool,
    pub ieth: bool,
    /// Whether the packet carries payload (possibly 0 bytes of it).
    pub payload: bool,
    /// BTH and every extension header: the offset of the payload.
    pub header_len: usize,
}

/// Which extension headers an opcode has, as a bit set (private: the
/// table's source form).
const DETH: u8 = 1;
const RETH: u8 = 2;
const AETH: u8 = 4;
const ATOMIC: u8 = 8;
const ATOMIC_ACK: u8 = 16;
const IMM: u8 = 32;
const IETH: u8 = 64;
const PAYLOAD: u8 = 128;

const fn entry(
    opcode: Opcode,
    transport: Transport,
    operation: Operation,
    position: Position,
    hdrs: u8,
) -> OpcodeInfo {
    OpcodeInfo {
        opcode,
        transport,
        operation,
        position,
        deth: hdrs & DETH != 0,
        reth: hdrs & RETH != 0,
        aeth: hdrs & AETH != 0,
        atomic_eth: hdrs & ATOMIC != 0,
        atomic_ack_eth: hdrs & ATOMIC_ACK != 0,
        imm: hdrs & IMM != 0,
        ieth: hdrs & IETH != 0,
        payload: hdrs & PAYLOAD != 0,
        header_len: BTH_LEN
            + len_if(hdrs, DETH, DETH_LEN)
            + len_if(hdrs, RETH, RETH_LEN)
            + len_if(hdrs, AETH, AETH_LEN)
            + len_if(hdrs, ATOMIC, ATOMIC_ETH_LEN)
            + len_if(hdrs, ATOMIC_ACK, ATOMIC_ACK_ETH_LEN)
            + len_if(hdrs, IMM, IMM_LEN)
            + len_if(hdrs, IETH, IETH_LEN),
    }
}

const fn len_if(hdrs: u8, bit: u8, len: usize) -> usize {
    if hdrs & bit != 0 {
        len
    } else {
        0
    }
}

use Operation as Op;
use Position as Pos;
use Transport as T;

/// One entry per [`Opcode`], in opcode order.
pub const OPCODES: [OpcodeInfo; 37] = [
    entry(Opcode::RcSendFirst, T::Rc, Op::Send, Pos::First, PAYLOAD),
    entry(Opcode::RcSendMiddle, T::Rc, Op::Send, Pos::Middle, PAYLOAD),
    entry(Opcode::RcSendLast, T::Rc, Op::Send, Pos::Last, PAYLOAD),
    entry(
        Opcode::RcSendLastImm,
        T::Rc,
        Op::Send,
        Pos::Last,
        IMM | PAYLOAD,
    ),
    entry(Opcode::RcSendOnly, T::Rc, Op::Send, Pos::Only, PAYLOAD),
    entry(
        Opcode::RcSendOnlyImm,
        T::Rc,
        Op::Send,
        Pos::Only,
        IMM | PAYLOAD,
    ),
    entry(
        Opcode::RcWriteFirst,
        T::Rc,
        Op::Write,
        Pos::First,
        RETH | PAYLOAD,
    ),
    entry(
        Opcode::RcWriteMiddle,
        T::Rc,
        Op::Write,
        Pos::Middle,
        PAYLOAD,
    ),
    entry(Opcode::RcWriteLast, T::Rc, Op::Write, Pos::Last, PAYLOAD),
    entry(
        Opcode::RcWriteLastImm,
        T::Rc,
        Op::Write,
        Pos::Last,
        IMM | PAYLOAD,
    ),
    entry(
        Opcode::RcWriteOnly,
        T::Rc,
        Op::Write,
        Pos::Only,
        RETH | PAYLOAD,
    ),
    entry(
        Opcode::RcWriteOnlyImm,
        T::Rc,
        Op::Write,
        Pos::Only,
        RETH | IMM | PAYLOAD,
    ),
    entry(Opcode::RcReadRequest, T::Rc, Op::ReadReq, Pos::Only, RETH),
    entry(
        Opcode::RcReadResponseFirst,
        T::Rc,
        Op::ReadResp,
        Pos::First,
        AETH | PAYLOAD,
    ),
    entry(
        Opcode::RcReadResponseMiddle,
        T::Rc,
        Op::ReadResp,
        Pos::Middle,
        PAYLOAD,
    ),
    entry(
        Opcode::RcReadResponseLast,
        T::Rc,
        Op::ReadResp,
        Pos::Last,
        AETH | PAYLOAD,
    ),
    entry(
        Opcode::RcReadResponseOnly,
        T::Rc,
        Op::ReadResp,
        Pos::Only,
        AETH | PAYLOAD,
    ),
    entry(Opcode::RcAck, T::Rc, Op::Ack, Pos::Only, AETH),
    entry(
        Opcode::RcAtomicAck,
        T::Rc,
        Op::AtomicAck,
        Pos::Only,
        AETH | ATOMIC_ACK,
    ),
    entry(Opcode::RcCompareSwap, T::Rc, Op::CmpSwap, Pos::Only, ATOMIC),
    entry(Opcode::RcFetchAdd, T::Rc, Op::FetchAdd, Pos::Only, ATOMIC),
    entry(
        Opcode::RcSendLastInv,
        T::Rc,
        Op::Send,
        Pos::Last,
        IETH | PAYLOAD,
    ),
    entry(
        Opcode::RcSendOnlyInv,
        T::Rc,
        Op::Send,
        Pos::Only,
        IETH | PAYLOAD,
    ),
    entry(Opcode::UcSendFirst, T::Uc, Op::Send, Pos::First, PAYLOAD),
    entry(Opcode::UcSendMiddle, T::Uc, Op::Send, Pos::Middle, PAYLOAD),
    entry(Opcode::UcSendLast, T::Uc, Op::Send, Pos::Last, PAYLOAD),
    entry(
        Opcode::UcSendLastImm,
        T::Uc,
        Op::Send,
        Pos::Last,
        IMM | PAYLOAD,
    ),
    entry(Opcode::UcSendOnly, T::Uc, Op::Send, Pos::Only, PAYLOAD),
    entry(
        Opcode::UcSendOnlyImm,
        T::Uc,
        Op::Send,
        Pos::Only,
        IMM | PAYLOAD,
    ),
    entry(
        Opcode::UcWriteFirst,
        T::Uc,
        Op::Write,
        Pos::First,
        RETH | PAYLOAD,
    ),
    entry(
        Opcode::UcWriteMiddle,
        T::Uc,
        Op::Write,
        Pos::Middle,
        PAYLOAD,
    ),
    entry(Opcode::UcWriteLast, T::Uc, Op::Write, Pos::Last, PAYLOAD),
    entry(
        Opcode::UcWriteLastImm,
        T::Uc,
        Op::Write,
        Pos::Last,
        IMM | PAYLOAD,
    ),
    entry(
        Opcode::UcWriteOnly,
        T::Uc,
        Op::Write,
        Pos::Only,
        RETH | PAYLOAD,
    ),
    entry(
        Opcode::UcWriteOnlyImm,
        T::Uc,
        Op::Write,
        Pos::Only,
        RETH | IMM | PAYLOAD,
    ),
    entry(
        Opcode::UdSendOnly,
        T::Ud,
        Op::Send,
        Pos::Only,
        DETH | PAYLOAD,
    ),
    entry(
        Opcode::UdSendOnlyImm,
        T::Ud,
        Op::Send,
        Pos::Only,
        DETH | IMM | PAYLOAD,
    ),
];

/// The index into [`OPCODES`] of every byte value, `NONE` where the byte is
/// not an opcode vrdma speaks: decoding is one table load.
const NONE: u8 = u8::MAX;
const INDEX: [u8; 256] = {
    let mut index = [NONE; 256];
    let mut i = 0;
    while i < OPCODES.len() {
        index[OPCODES[i].opcode as usize] = i as u8;
        i += 1;
    }
    index
};

impl Opcode {
    /// Every opcode, in order.
    pub const ALL: [Opcode; 37] = {
        let mut all = [Opcode::RcSendFirst; 37];
        let mut i = 0;
        while i < OPCODES.len() {
            all[i] = OPCODES[i].opcode;
            i += 1;
        }
        all
    };

    /// What the opcode's packets hold.
    pub fn info(self) -> &'static OpcodeInfo {
        // Every opcode has its entry (checked by a test); the fallback
        // only keeps this free of a panic path.
        let i = INDEX[self as usize];
        OPCODES.get(usize::from(i)).unwrap_or(&OPCODES[0])
    }

    /// The opcode of a BTH byte, if vrdma speaks it.
    pub fn from_u8(b: u8) -> Option<Opcode> {
        OPCODES
            .get(usize::from(INDEX[usize::from(b)]))
            .map(|e| e.opcode)
    }
}

impl TryFrom<u8> for Opcode {
    type Error = DropReason;

    fn try_from(b: u8) -> Result<Opcode, DropReason> {
        Opcode::from_u8(b).ok_or(DropReason::UnknownOpcode(b))
    }
}

impl From<Opcode> for u8 {
    fn from(op: Opcode) -> u8 {
        op as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_decodes_to_its_own_entry_or_nothing() {
        let mut n = 0;
        for b in 0..=255u8 {
            match Opcode::try_from(b) {
                Ok(op) => {
                    n += 1;
                    assert_eq!(op as u8, b);
                    assert_eq!(op.info().opcode, op);
                }
                Err(e) => assert_eq!(e, DropReason::UnknownOpcode(b)),
            }
        }
        assert_eq!(n, OPCODES.len());
        // Not spoken: RC reserved/FLUSH/ATOMIC WRITE, RD, CNP, UD others.
        for b in [0x15, 0x18, 0x1c, 0x1d, 0x2c, 0x40, 0x60, 0x66, 0x81] {
            assert!(Opcode::from_u8(b).is_none(), "{b:#x}");
        }
    }

    #[test]
    fn table_matches_rxe_lengths() {
        // Header lengths (BTH + extension headers) as rxe_opcode.c has them.
        let expect: &[(Opcode, usize)] = &[
            (Opcode::RcSendOnly, 12),
            (Opcode::RcSendOnlyImm, 16),
            (Opcode::RcWriteFirst, 28),
            (Opcode::RcWriteOnlyImm, 32),
            (Opcode::RcReadRequest, 28),
            (Opcode::RcReadResponseMiddle, 12),
            (Opcode::RcReadResponseOnly, 16),
            (Opcode::RcAck, 16),
            (Opcode::RcAtomicAck, 24),
            (Opcode::RcCompareSwap, 40),
            (Opcode::RcFetchAdd, 40),
            (Opcode::RcSendOnlyInv, 16),
            (Opcode::UcWriteOnlyImm, 32),
            (Opcode::UdSendOnly, 20),
            (Opcode::UdSendOnlyImm, 24),
        ];
        for &(op, len) in expect {
            assert_eq!(op.info().header_len, len, "{op:?}");
        }
        for info in &OPCODES {
            let op = info.opcode as u8;
            let transport = match op >> 5 {
                0 => Transport::Rc,
                1 => Transport::Uc,
                _ => Transport::Ud,
            };
            assert_eq!(info.transport, transport, "{:?}", info.opcode);
            // Only requests that are no data carry no payload.
            let no_payload = matches!(
                info.operation,
                Operation::ReadReq
                    | Operation::Ack
                    | Operation::AtomicAck
                    | Operation::CmpSwap
                    | Operation::FetchAdd
            );
            assert_eq!(info.payload, !no_payload, "{:?}", info.opcode);
            // UC mirrors RC's SEND and WRITE opcodes.
            if info.transport == Transport::Uc {
                let rc = Opcode::from_u8(op & 0x1f).map(Opcode::info);
                let rc = rc.map(|r| (r.operation, r.position, r.reth, r.imm, r.header_len));
                assert_eq!(
                    rc,
                    Some((
                        info.operation,
                        info.position,
                        info.reth,
                        info.imm,
                        info.header_len
                    ))
                );
            }
        }
        assert_eq!(Opcode::ALL.len(), OPCODES.len());
    }
}
