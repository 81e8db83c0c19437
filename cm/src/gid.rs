//! GIDs, and the pair of them a CM MAD travels between.
//!
//! On RoCEv2 a GID is an IP address: an IPv6 address as is, an IPv4 address
//! as `::ffff:a.b.c.d` (Linux's `rdma_ip2gid`). The agent never resolves
//! them; it only remembers which pair a connection's MADs use.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A 128-bit InfiniBand global identifier, in wire (big-endian) order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The RoCEv2 GID of an IP address: IPv4 as `::ffff:a.b.c.d`.
    pub fn from_ip(ip: IpAddr) -> Gid {
        match ip {
            IpAddr::V4(v4) => Gid(v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => Gid(v6.octets()),
        }
    }

    /// The IP address a RoCEv2 GID stands for (IPv4 when IPv4-mapped).
    pub fn to_ip(self) -> IpAddr {
        let v6 = Ipv6Addr::from(self.0);
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }
}

impl From<Ipv4Addr> for Gid {
    fn from(ip: Ipv4Addr) -> Gid {
        Gid::from_ip(IpAddr::V4(ip))
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({})", Ipv6Addr::from(self.0))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

/// Where a CM MAD goes or came from, seen from this agent: `local` is this
/// device's GID (the destination of a received MAD, the source of a sent
/// one) and `remote` the peer's. Replies go back on the path their request
/// came on, as Linux builds a reply's address from the received packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MadPath {
    pub local: Gid,
    pub remote: Gid,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_gids_are_v4_mapped() {
        let gid = Gid::from(Ipv4Addr::new(192, 0, 2, 7));
        assert_eq!(
            gid.0,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 7]
        );
        assert_eq!(gid.to_ip(), IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)));
        assert_eq!(gid.to_string(), "::ffff:192.0.2.7");
    }

    #[test]
    fn ipv6_gids_are_the_address() {
        let ip: IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(Gid::from_ip(ip).to_ip(), ip);
    }
}
