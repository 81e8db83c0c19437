//! What Linux's rdma_cm (`cma.c`) layers over the IB CM for IP-addressed
//! connections: the service ID that encodes a port space and port, and the
//! 36-byte header at the start of REQ and SIDR_REQ private data that
//! carries the IP addresses and the active side's source port.
//!
//! Linux refuses a REQ whose header has a version other than 0 or an IP
//! version other than 4 or 6 (with REJ 28, indistinguishable from an
//! application's reject). The header only travels in REQ and SIDR_REQ;
//! accepts, rejects and SIDR_REPs carry the consumer's bytes alone.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::mad::PrivateData;

/// Bytes of the CMA header (`struct cma_hdr`).
pub const CMA_HEADER_LEN: usize = 36;
/// `CMA_VERSION`.
pub const CMA_VERSION: u8 = 0x00;

/// rdma_cm port spaces (`enum rdma_ucm_port_space`). The value is what the
/// service ID carries in bits 31:16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortSpace {
    Ipoib = 0x0002,
    Tcp = 0x0106,
    Udp = 0x0111,
    Ib = 0x013f,
}

impl PortSpace {
    pub fn from_u16(v: u16) -> Option<PortSpace> {
        Some(match v {
            0x0002 => PortSpace::Ipoib,
            0x0106 => PortSpace::Tcp,
            0x0111 => PortSpace::Udp,
            0x013f => PortSpace::Ib,
            _ => return None,
        })
    }
}

/// The IB service ID rdma_cm uses for a port: `(ps << 16) + port`, e.g. TCP
/// port 7174 → 0x0000_0000_0106_1C06 (`rdma_get_service_id`).
pub fn service_id(ps: PortSpace, port: u16) -> u64 {
    (ps as u64) << 16 | u64::from(port)
}

/// The port space and port of an rdma_cm service ID; `None` for any other
/// service ID (bits 63:32 set, or an unknown port space).
pub fn split_service_id(sid: u64) -> Option<(PortSpace, u16)> {
    if sid >> 32 != 0 {
        return None;
    }
    let ps = PortSpace::from_u16((sid >> 16) as u16)?;
    Some((ps, sid as u16))
}

/// The source and destination addresses of the CMA header, one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmaAddrs {
    V4 { src: Ipv4Addr, dst: Ipv4Addr },
    V6 { src: Ipv6Addr, dst: Ipv6Addr },
}

impl CmaAddrs {
    pub fn src(&self) -> IpAddr {
        match *self {
            CmaAddrs::V4 { src, .. } => src.into(),
            CmaAddrs::V6 { src, .. } => src.into(),
        }
    }

    pub fn dst(&self) -> IpAddr {
        match *self {
            CmaAddrs::V4 { dst, .. } => dst.into(),
            CmaAddrs::V6 { dst, .. } => dst.into(),
        }
    }
}

/// Why private data does not start with a CMA header Linux would accept,
/// or cannot be given one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CmaError {
    #[error("{0} bytes are too short for a 36-byte CMA header")]
    Truncated(usize),
    #[error("CMA header version {0} is not 0")]
    BadVersion(u8),
    #[error("CMA header IP version {0} is neither 4 nor 6")]
    BadIpVersion(u8),
    #[error("{len} bytes of user data do not fit the {max} left after the CMA header")]
    UserDataTooLong { len: usize, max: usize },
}

/// `struct cma_hdr`: what rdma_cm prepends to REQ and SIDR_REQ private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmaHeader {
    /// The active side's source port (the destination port is in the
    /// service ID; the header has no field for it).
    pub src_port: u16,
    pub addrs: CmaAddrs,
}

impl CmaHeader {
    /// The header as Linux writes it (`cma_format_hdr`): an IPv4 address in
    /// the last 4 bytes of its 16 with bytes before it zero (the union's
    /// padding, not `::ffff:`).
    pub fn encode(&self) -> [u8; CMA_HEADER_LEN] {
        let mut out = [0u8; CMA_HEADER_LEN];
        out[0] = CMA_VERSION;
        out[2..4].copy_from_slice(&self.src_port.to_be_bytes());
        match self.addrs {
            CmaAddrs::V4 { src, dst } => {
                out[1] = 4 << 4;
                out[16..20].copy_from_slice(&src.octets());
                out[32..36].copy_from_slice(&dst.octets());
            }
            CmaAddrs::V6 { src, dst } => {
                out[1] = 6 << 4;
                out[4..20].copy_from_slice(&src.octets());
                out[20..36].copy_from_slice(&dst.octets());
            }
        }
        out
    }

    /// Reads the header at the start of `data`, as Linux does: only the top
    /// nibble of the IP version byte counts, and an IPv4 address is the
    /// last 4 bytes of its field whatever precedes them.
    pub fn decode(data: &[u8]) -> Result<CmaHeader, CmaError> {
        let hdr: &[u8; CMA_HEADER_LEN] = data
            .get(..CMA_HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(CmaError::Truncated(data.len()))?;
        if hdr[0] != CMA_VERSION {
            return Err(CmaError::BadVersion(hdr[0]));
        }
        let src_port = u16::from_be_bytes([hdr[2], hdr[3]]);
        let addr16 = |off: usize| -> [u8; 16] {
            let mut a = [0u8; 16];
            a.copy_from_slice(&hdr[off..off + 16]);
            a
        };
        let addrs = match hdr[1] >> 4 {
            4 => CmaAddrs::V4 {
                src: Ipv4Addr::new(hdr[16], hdr[17], hdr[18], hdr[19]),
                dst: Ipv4Addr::new(hdr[32], hdr[33], hdr[34], hdr[35]),
            },
            6 => CmaAddrs::V6 {
                src: Ipv6Addr::from(addr16(4)),
                dst: Ipv6Addr::from(addr16(20)),
            },
            v => return Err(CmaError::BadIpVersion(v)),
        };
        Ok(CmaHeader { src_port, addrs })
    }

    /// A private data field of `N` bytes: this header, then `user`.
    /// `N` is 92 for a REQ (56 user bytes) and 216 for a SIDR_REQ (180).
    pub fn private_data<const N: usize>(&self, user: &[u8]) -> Result<PrivateData<N>, CmaError> {
        let max = N.saturating_sub(CMA_HEADER_LEN);
        if user.len() > max {
            return Err(CmaError::UserDataTooLong {
                len: user.len(),
                max,
            });
        }
        let mut field = [0u8; N];
        if let Some(h) = field.get_mut(..CMA_HEADER_LEN) {
            h.copy_from_slice(&self.encode());
        }
        if let Some(u) = field.get_mut(CMA_HEADER_LEN..CMA_HEADER_LEN + user.len()) {
            u.copy_from_slice(user);
        }
        Ok(PrivateData::from_array(field))
    }

    /// Splits private data into its header and the user's bytes after it
    /// (all of them: the wire has no length).
    pub fn split(data: &[u8]) -> Result<(CmaHeader, &[u8]), CmaError> {
        let hdr = CmaHeader::decode(data)?;
        Ok((hdr, data.get(CMA_HEADER_LEN..).unwrap_or(&[])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{REQ_PRIVATE_DATA_SIZE, SIDR_REQ_PRIVATE_DATA_SIZE};

    #[test]
    fn service_ids() {
        assert_eq!(service_id(PortSpace::Tcp, 7174), 0x0000_0000_0106_1c06);
        assert_eq!(service_id(PortSpace::Udp, 1), 0x0000_0000_0111_0001);
        assert_eq!(service_id(PortSpace::Ib, 0xffff), 0x0000_0000_013f_ffff);
        assert_eq!(split_service_id(0x0106_1c06), Some((PortSpace::Tcp, 7174)));
        assert_eq!(split_service_id(0x0107_1c06), None);
        assert_eq!(split_service_id(0x1_0106_1c06), None);
        for ps in [
            PortSpace::Ipoib,
            PortSpace::Tcp,
            PortSpace::Udp,
            PortSpace::Ib,
        ] {
            for port in [0, 1, 4791, u16::MAX] {
                assert_eq!(split_service_id(service_id(ps, port)), Some((ps, port)));
            }
        }
    }

    #[test]
    fn ipv4_header_layout() {
        let hdr = CmaHeader {
            src_port: 0xabcd,
            addrs: CmaAddrs::V4 {
                src: Ipv4Addr::new(10, 0, 0, 1),
                dst: Ipv4Addr::new(10, 0, 0, 2),
            },
        };
        let b = hdr.encode();
        let mut want = [0u8; 36];
        want[1] = 0x40;
        want[2] = 0xab;
        want[3] = 0xcd;
        want[16..20].copy_from_slice(&[10, 0, 0, 1]);
        want[32..36].copy_from_slice(&[10, 0, 0, 2]);
        assert_eq!(b, want);
        assert_eq!(CmaHeader::decode(&b), Ok(hdr));
        // An IPv4-mapped form (::ffff:) in the padding is read the same.
        let mut mapped = b;
        mapped[14] = 0xff;
        mapped[15] = 0xff;
        mapped[30] = 0xff;
        mapped[31] = 0xff;
        assert_eq!(CmaHeader::decode(&mapped), Ok(hdr));
    }

    #[test]
    fn ipv6_header_layout() {
        let src: Ipv6Addr = "fd00::1".parse().unwrap();
        let dst: Ipv6Addr = "fd00::2".parse().unwrap();
        let hdr = CmaHeader {
            src_port: 1,
            addrs: CmaAddrs::V6 { src, dst },
        };
        let b = hdr.encode();
        assert_eq!(b[1], 0x60);
        assert_eq!(&b[4..20], &src.octets());
        assert_eq!(&b[20..36], &dst.octets());
        assert_eq!(CmaHeader::decode(&b), Ok(hdr));
    }

    #[test]
    fn refusals() {
        let hdr = CmaHeader {
            src_port: 1,
            addrs: CmaAddrs::V4 {
                src: Ipv4Addr::LOCALHOST,
                dst: Ipv4Addr::LOCALHOST,
            },
        };
        let mut b = hdr.encode();
        assert_eq!(CmaHeader::decode(&b[..35]), Err(CmaError::Truncated(35)));
        b[1] = 0x4f; // the low nibble is not looked at
        assert!(CmaHeader::decode(&b).is_ok());
        b[1] = 0x50;
        assert_eq!(CmaHeader::decode(&b), Err(CmaError::BadIpVersion(5)));
        b[0] = 1;
        assert_eq!(CmaHeader::decode(&b), Err(CmaError::BadVersion(1)));
    }

    #[test]
    fn private_data_room() {
        let hdr = CmaHeader {
            src_port: 9,
            addrs: CmaAddrs::V4 {
                src: Ipv4Addr::new(1, 2, 3, 4),
                dst: Ipv4Addr::new(5, 6, 7, 8),
            },
        };
        let pd = hdr.private_data::<REQ_PRIVATE_DATA_SIZE>(&[7; 56]).unwrap();
        let (back, user) = CmaHeader::split(pd.as_bytes()).unwrap();
        assert_eq!(back, hdr);
        assert_eq!(user, &[7; 56]);
        assert_eq!(
            hdr.private_data::<REQ_PRIVATE_DATA_SIZE>(&[7; 57]),
            Err(CmaError::UserDataTooLong { len: 57, max: 56 })
        );
        assert!(hdr
            .private_data::<SIDR_REQ_PRIVATE_DATA_SIZE>(&[1; 180])
            .is_ok());
        assert!(hdr
            .private_data::<SIDR_REQ_PRIVATE_DATA_SIZE>(&[1; 181])
            .is_err());
    }
}
