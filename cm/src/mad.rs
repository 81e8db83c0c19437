//! The 256-byte CM MAD: its 24-byte common header, the message it carries,
//! and the errors of decoding one from the wire or encoding one for it.
//!
//! Every CM message fills a whole MAD (IBA 12.6, Linux `ib_mad.h` and
//! `ibta_vol1_c12.h`); fields are big-endian and bit fields MSB-first in
//! their byte. [`Mad::decode`] reads hostile bytes: it never panics, reads
//! only at the fixed offsets of the layouts, and refuses what Linux's MAD
//! layer and CM would not take (wrong base version, class, class version
//! or method; an attribute the CM does not handle on RoCE; a reserved
//! code). Reserved bits are ignored, as Linux ignores them (ECE was carved
//! out of reserved bits; a newer peer may carve more), so an accepted MAD
//! re-encodes to its bytes with its reserved bits cleared.
//! [`Mad::encode`] refuses a field wider than its wire width instead of
//! truncating it, so that `decode(encode(m)) == m` for every message it
//! accepts.

use std::fmt;

use crate::messages::{Drep, Dreq, Mra, Rej, Rep, Req, Rtu, SidrRep, SidrReq};

/// Bytes in a MAD (`IB_MGMT_MAD_SIZE`).
pub const MAD_SIZE: usize = 256;
/// Bytes in the MAD common header; message bodies start here.
pub const MAD_HEADER_LEN: usize = 24;
/// `BaseVersion` of every MAD.
pub const MAD_BASE_VERSION: u8 = 1;
/// `MgmtClass` of the Communication Manager.
pub const CM_MGMT_CLASS: u8 = 0x07;
/// `ClassVersion` Linux's CM registers for (`IB_CM_CLASS_VERSION`, IBA 1.2).
pub const CM_CLASS_VERSION: u8 = 2;
/// The only method CM messages use.
pub const METHOD_SEND: u8 = 0x03;
/// Attribute IDs of LAP and APR, which Linux refuses on RoCE.
pub const ATTR_LAP: u16 = 0x0019;
pub const ATTR_APR: u16 = 0x001a;

/// The CM messages this codec carries, by attribute ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MessageKind {
    Req,
    Mra,
    Rej,
    Rep,
    Rtu,
    Dreq,
    Drep,
    SidrReq,
    SidrRep,
}

impl MessageKind {
    /// How many kinds there are (the size of a counter array indexed by
    /// [`MessageKind::index`]).
    pub const COUNT: usize = 9;
    pub const ALL: [MessageKind; MessageKind::COUNT] = [
        MessageKind::Req,
        MessageKind::Mra,
        MessageKind::Rej,
        MessageKind::Rep,
        MessageKind::Rtu,
        MessageKind::Dreq,
        MessageKind::Drep,
        MessageKind::SidrReq,
        MessageKind::SidrRep,
    ];

    /// The MAD attribute ID (IBA table 103).
    pub fn attr_id(self) -> u16 {
        0x0010 + self.index() as u16
    }

    pub fn from_attr_id(attr: u16) -> Option<MessageKind> {
        let index = usize::from(attr.checked_sub(0x0010)?);
        MessageKind::ALL.get(index).copied()
    }

    /// 0..COUNT, in attribute order.
    pub fn index(self) -> usize {
        self as usize
    }

    /// A stable label for counters.
    pub fn name(self) -> &'static str {
        match self {
            MessageKind::Req => "req",
            MessageKind::Mra => "mra",
            MessageKind::Rej => "rej",
            MessageKind::Rep => "rep",
            MessageKind::Rtu => "rtu",
            MessageKind::Dreq => "dreq",
            MessageKind::Drep => "drep",
            MessageKind::SidrReq => "sidr_req",
            MessageKind::SidrRep => "sidr_rep",
        }
    }
}

/// Why bytes from the wire are not a CM MAD this codec accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("MAD is {0} bytes, not 256")]
    BadLength(usize),
    #[error("MAD base version {0} is not 1")]
    BadBaseVersion(u8),
    #[error("Management class {0:#04x} is not the CM's (0x07)")]
    BadClass(u8),
    #[error("CM class version {0} is not 2")]
    BadClassVersion(u8),
    #[error("Method {0:#04x} is not SEND (0x03)")]
    BadMethod(u8),
    /// LAP and APR: alternate paths, which Linux refuses on RoCE
    /// (`cm_lap_handler`, `cm_apr_handler`).
    #[error("Attribute {0:#06x} (LAP/APR) is not supported on RoCE")]
    UnsupportedAttribute(u16),
    #[error("Attribute {0:#06x} is not a CM message")]
    UnknownAttribute(u16),
    /// A code field holding a value the IBA reserves (Linux drops such a
    /// message: `cm_acquire_mraed_id` finds no connection for it).
    #[error("{field} holds the reserved value {value}")]
    ReservedValue { field: &'static str, value: u8 },
    /// A length field longer than the field it measures (REJ ARI, SIDR_REP
    /// additional information: 72 bytes at most).
    #[error("{field} says {len} bytes, more than the 72 it has")]
    LengthTooLong { field: &'static str, len: u8 },
}

/// Why a message cannot be put on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("{field} is {value:#x}, wider than its {bits}-bit field")]
    TooWide {
        field: &'static str,
        value: u64,
        bits: u32,
    },
    #[error("{len} bytes do not fit the {max}-byte {field}")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
}

/// The fixed-size private data field of a CM message. The wire carries the
/// whole field, never the sender's length (Linux reports the whole field to
/// its consumers: applications carry their own length inside).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrivateData<const N: usize>([u8; N]);

impl<const N: usize> PrivateData<N> {
    /// The field's size on the wire.
    pub const LEN: usize = N;

    /// `data` zero-padded to the field; refused when longer.
    pub fn new(data: &[u8]) -> Result<Self, EncodeError> {
        let mut field = [0u8; N];
        field
            .get_mut(..data.len())
            .ok_or(EncodeError::TooLong {
                field: "private data",
                len: data.len(),
                max: N,
            })?
            .copy_from_slice(data);
        Ok(PrivateData(field))
    }

    pub fn from_array(field: [u8; N]) -> Self {
        PrivateData(field)
    }

    pub fn as_bytes(&self) -> &[u8; N] {
        &self.0
    }

    /// The field up to its last non-zero byte (for logs and tests; the
    /// peer's real length is not on the wire).
    pub fn trimmed(&self) -> &[u8] {
        let end = self.0.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        self.0.get(..end).unwrap_or(&[])
    }
}

impl<const N: usize> Default for PrivateData<N> {
    fn default() -> Self {
        PrivateData([0; N])
    }
}

impl<const N: usize> fmt::Debug for PrivateData<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PrivateData<{N}>[")?;
        for b in self.trimmed() {
            write!(f, "{b:02x}")?;
        }
        write!(f, "]")
    }
}

/// The MAD common header fields a CM message does not fix (IBA 13.4.2).
/// BaseVersion, MgmtClass, ClassVersion, Method and AttributeID are implied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MadHeader {
    /// 0 in every CM message Linux sends; carried, not checked.
    pub status: u16,
    pub class_specific: u16,
    /// TransactionID: the sender's for a request (REQ, DREQ, SIDR_REQ), the
    /// request's for its replies.
    pub tid: u64,
    /// ECE options in a REQ/REP from kernels with ECE support; else 0.
    pub attr_mod: u32,
}

/// One CM message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmMessage {
    Req(Req),
    Mra(Mra),
    Rej(Rej),
    Rep(Rep),
    Rtu(Rtu),
    Dreq(Dreq),
    Drep(Drep),
    SidrReq(SidrReq),
    SidrRep(SidrRep),
}

impl CmMessage {
    pub fn kind(&self) -> MessageKind {
        match self {
            CmMessage::Req(_) => MessageKind::Req,
            CmMessage::Mra(_) => MessageKind::Mra,
            CmMessage::Rej(_) => MessageKind::Rej,
            CmMessage::Rep(_) => MessageKind::Rep,
            CmMessage::Rtu(_) => MessageKind::Rtu,
            CmMessage::Dreq(_) => MessageKind::Dreq,
            CmMessage::Drep(_) => MessageKind::Drep,
            CmMessage::SidrReq(_) => MessageKind::SidrReq,
            CmMessage::SidrRep(_) => MessageKind::SidrRep,
        }
    }
}

/// A whole CM MAD: header and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mad {
    pub header: MadHeader,
    pub msg: CmMessage,
}

impl Mad {
    pub fn new(tid: u64, msg: CmMessage) -> Mad {
        Mad {
            header: MadHeader {
                tid,
                ..MadHeader::default()
            },
            msg,
        }
    }

    /// Decodes a MAD received on QP1.
    pub fn decode(bytes: &[u8]) -> Result<Mad, DecodeError> {
        let buf: &[u8; MAD_SIZE] = bytes
            .try_into()
            .map_err(|_| DecodeError::BadLength(bytes.len()))?;
        let r = Reader(buf);
        if r.u8(0) != MAD_BASE_VERSION {
            return Err(DecodeError::BadBaseVersion(r.u8(0)));
        }
        if r.u8(1) != CM_MGMT_CLASS {
            return Err(DecodeError::BadClass(r.u8(1)));
        }
        if r.u8(2) != CM_CLASS_VERSION {
            return Err(DecodeError::BadClassVersion(r.u8(2)));
        }
        if r.u8(3) != METHOD_SEND {
            return Err(DecodeError::BadMethod(r.u8(3)));
        }
        let attr = r.u16(16);
        let header = MadHeader {
            status: r.u16(4),
            class_specific: r.u16(6),
            tid: r.u64(8),
            attr_mod: r.u32(20),
        };
        let kind = MessageKind::from_attr_id(attr).ok_or(match attr {
            ATTR_LAP | ATTR_APR => DecodeError::UnsupportedAttribute(attr),
            _ => DecodeError::UnknownAttribute(attr),
        })?;
        let msg = match kind {
            MessageKind::Req => CmMessage::Req(Req::decode(&r)),
            MessageKind::Mra => CmMessage::Mra(Mra::decode(&r)?),
            MessageKind::Rej => CmMessage::Rej(Rej::decode(&r)?),
            MessageKind::Rep => CmMessage::Rep(Rep::decode(&r)),
            MessageKind::Rtu => CmMessage::Rtu(Rtu::decode(&r)),
            MessageKind::Dreq => CmMessage::Dreq(Dreq::decode(&r)),
            MessageKind::Drep => CmMessage::Drep(Drep::decode(&r)),
            MessageKind::SidrReq => CmMessage::SidrReq(SidrReq::decode(&r)),
            MessageKind::SidrRep => CmMessage::SidrRep(SidrRep::decode(&r)?),
        };
        Ok(Mad { header, msg })
    }

    /// The 256 bytes of this MAD; reserved bits are zero.
    pub fn encode(&self) -> Result<[u8; MAD_SIZE], EncodeError> {
        let mut w = Writer([0; MAD_SIZE]);
        w.u8(0, MAD_BASE_VERSION);
        w.u8(1, CM_MGMT_CLASS);
        w.u8(2, CM_CLASS_VERSION);
        w.u8(3, METHOD_SEND);
        w.u16(4, self.header.status);
        w.u16(6, self.header.class_specific);
        w.u64(8, self.header.tid);
        w.u16(16, self.msg.kind().attr_id());
        w.u32(20, self.header.attr_mod);
        match &self.msg {
            CmMessage::Req(m) => m.encode(&mut w)?,
            CmMessage::Mra(m) => m.encode(&mut w)?,
            CmMessage::Rej(m) => m.encode(&mut w)?,
            CmMessage::Rep(m) => m.encode(&mut w)?,
            CmMessage::Rtu(m) => m.encode(&mut w),
            CmMessage::Dreq(m) => m.encode(&mut w)?,
            CmMessage::Drep(m) => m.encode(&mut w),
            CmMessage::SidrReq(m) => m.encode(&mut w),
            CmMessage::SidrRep(m) => m.encode(&mut w)?,
        }
        Ok(w.0)
    }
}

/// The absolute offset of a message body offset (the layouts' tables give
/// body offsets, counted after the MAD header).
pub(crate) const fn at(body: usize) -> usize {
    MAD_HEADER_LEN + body
}

/// Reads big-endian fields of a MAD. Every offset is a constant of a
/// layout, below 256 by construction, never a value from the input.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8; MAD_SIZE]);

impl Reader<'_> {
    pub(crate) fn u8(&self, off: usize) -> u8 {
        self.0[off]
    }

    pub(crate) fn u16(&self, off: usize) -> u16 {
        u16::from_be_bytes(self.bytes(off))
    }

    /// The top 24 bits of the 32-bit word at `off` (QPNs, PSNs, EECNs).
    pub(crate) fn u24(&self, off: usize) -> u32 {
        let [a, b, c] = self.bytes(off);
        u32::from_be_bytes([0, a, b, c])
    }

    pub(crate) fn u32(&self, off: usize) -> u32 {
        u32::from_be_bytes(self.bytes(off))
    }

    pub(crate) fn u64(&self, off: usize) -> u64 {
        u64::from_be_bytes(self.bytes(off))
    }

    pub(crate) fn bytes<const N: usize>(&self, off: usize) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.0[off..off + N]);
        out
    }
}

/// Writes big-endian fields of a MAD into a zeroed buffer (so bit fields
/// are OR-ed in). Offsets as for [`Reader`].
pub(crate) struct Writer(pub(crate) [u8; MAD_SIZE]);

impl Writer {
    pub(crate) fn u8(&mut self, off: usize, v: u8) {
        self.0[off] = v;
    }

    /// ORs `v` (already checked to fit) into a byte shared by bit fields.
    pub(crate) fn or_u8(&mut self, off: usize, v: u8) {
        self.0[off] |= v;
    }

    pub(crate) fn u16(&mut self, off: usize, v: u16) {
        self.bytes(off, &v.to_be_bytes());
    }

    /// `v` (checked to fit 24 bits) into the top 24 bits at `off`.
    pub(crate) fn u24(&mut self, off: usize, v: u32) {
        let [_, a, b, c] = v.to_be_bytes();
        self.bytes(off, &[a, b, c]);
    }

    pub(crate) fn u32(&mut self, off: usize, v: u32) {
        self.bytes(off, &v.to_be_bytes());
    }

    pub(crate) fn u64(&mut self, off: usize, v: u64) {
        self.bytes(off, &v.to_be_bytes());
    }

    pub(crate) fn bytes(&mut self, off: usize, v: &[u8]) {
        self.0[off..off + v.len()].copy_from_slice(v);
    }
}

/// `value` if it fits `bits` bits; else the error naming the field.
pub(crate) fn fit(field: &'static str, value: u32, bits: u32) -> Result<u32, EncodeError> {
    if u64::from(value) >> bits == 0 {
        Ok(value)
    } else {
        Err(EncodeError::TooWide {
            field,
            value: value.into(),
            bits,
        })
    }
}

/// [`fit`] for the small fields that share a byte.
pub(crate) fn fit8(field: &'static str, value: u8, bits: u32) -> Result<u8, EncodeError> {
    fit(field, value.into(), bits).map(|_| value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_ids() {
        for kind in MessageKind::ALL {
            assert_eq!(MessageKind::from_attr_id(kind.attr_id()), Some(kind));
        }
        assert_eq!(MessageKind::Req.attr_id(), 0x0010);
        assert_eq!(MessageKind::SidrRep.attr_id(), 0x0018);
        assert_eq!(MessageKind::from_attr_id(0x0019), None);
        assert_eq!(MessageKind::from_attr_id(0x000f), None);
        assert_eq!(MessageKind::from_attr_id(0), None);
    }

    #[test]
    fn private_data_is_padded_and_bounded() {
        let pd = PrivateData::<4>::new(&[1, 2]).unwrap();
        assert_eq!(pd.as_bytes(), &[1, 2, 0, 0]);
        assert_eq!(pd.trimmed(), &[1, 2]);
        assert_eq!(
            PrivateData::<4>::new(&[0; 5]),
            Err(EncodeError::TooLong {
                field: "private data",
                len: 5,
                max: 4
            })
        );
        assert_eq!(format!("{pd:?}"), "PrivateData<4>[0102]");
    }

    #[test]
    fn width_checks() {
        assert_eq!(fit("x", 0xff_ffff, 24), Ok(0xff_ffff));
        assert!(fit("x", 0x100_0000, 24).is_err());
        assert_eq!(fit8("x", 31, 5), Ok(31));
        assert!(fit8("x", 32, 5).is_err());
    }
}
