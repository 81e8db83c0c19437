//! GIDs of devices: the address each device is known by on the fabric
//! (RoCEv2: an IPv4-mapped address, entry 0 of its port's GID table), and
//! what a connection's destination GID leads to.
//!
//! [`assign`] is the one place a device's GID comes from. Without a
//! fabric every peer is on this host, and the GID only has to name the
//! device uniquely here: it is `::ffff:127.100.x.y`, `x.y` its LID
//! ([`vrdma_spec::gid::loopback_gid`]), so it is as stable as the LID
//! (per tenant and device name) and never on a wire. With a fabric it
//! will be the next free address of the tenant's pool on this host.

use std::net::Ipv6Addr;

/// A GID as it travels: 16 bytes, network order.
pub type Gid = [u8; 16];

/// The GID device `device` of `tenant`, holding LID `lid` on this host,
/// gets at registration.
pub fn assign(tenant: &str, device: &str, lid: u16) -> Gid {
    tracing::trace!(tenant, device, lid, "GID from the LID (no fabric)");
    vrdma_spec::gid::loopback_gid(lid)
}

/// What a connection's destination GID leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer<L> {
    /// A device of this host.
    Local(L),
    /// A device of another host (from the directory).
    Remote,
    /// No device this host knows of.
    Unknown,
}

/// A GID for messages and logs (`::ffff:10.0.0.1` for an IPv4-mapped one).
pub fn show(gid: &Gid) -> String {
    Ipv6Addr::from(*gid).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_fabric_the_gid_spells_the_lid() {
        let gid = assign("alpha", "vm", 0x0102);
        assert_eq!(show(&gid), "::ffff:127.100.1.2");
        assert_eq!(vrdma_spec::gid::ipv4_of(&gid), Some([127, 100, 1, 2]));
        assert_ne!(assign("alpha", "vm", 1), assign("alpha", "vm", 2));
    }
}
