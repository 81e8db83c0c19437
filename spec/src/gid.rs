//! GIDs on vrdma's RoCEv2 port.
//!
//! The port's link layer is Ethernet and its one GID (index 0, type
//! RoCEv2) is an IPv4 address in IPv4-mapped form (`::ffff:a.b.c.d`), as
//! Linux puts an interface's IPv4 address in a RoCE GID table: packets
//! between devices carry these addresses as their IP source and
//! destination. IPv6 GIDs are not supported.

/// The first 12 bytes of an IPv4-mapped GID (`::ffff:0:0/96`).
pub const IPV4_MAPPED_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// The IPv4-mapped GID of the IPv4 address `octets`.
pub const fn ipv4_mapped(octets: [u8; 4]) -> [u8; 16] {
    let mut gid = [0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12] = octets[0];
    gid[13] = octets[1];
    gid[14] = octets[2];
    gid[15] = octets[3];
    gid
}

/// The IPv4 address of an IPv4-mapped GID; `None` for any other GID.
pub fn ipv4_of(gid: &[u8; 16]) -> Option<[u8; 4]> {
    if gid[..12] != IPV4_MAPPED_PREFIX {
        return None;
    }
    Some([gid[12], gid[13], gid[14], gid[15]])
}

/// The GID of a device on a host without a fabric: `::ffff:127.100.x.y`
/// with `x.y` the device's LID. Such an address never goes on a wire
/// (every peer is on the same host); it only names the device uniquely on
/// its host, as its LID does.
pub const fn loopback_gid(lid: u16) -> [u8; 16] {
    ipv4_mapped([127, 100, (lid >> 8) as u8, (lid & 0xff) as u8])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_mapped_gids_round_trip() {
        let gid = ipv4_mapped([10, 200, 1, 7]);
        assert_eq!(
            gid,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 200, 1, 7]
        );
        assert_eq!(ipv4_of(&gid), Some([10, 200, 1, 7]));
        let mut ipv6 = gid;
        ipv6[0] = 0xfe;
        assert_eq!(ipv4_of(&ipv6), None);
    }

    #[test]
    fn loopback_gids_spell_the_lid() {
        assert_eq!(ipv4_of(&loopback_gid(1)), Some([127, 100, 0, 1]));
        assert_eq!(ipv4_of(&loopback_gid(0x1234)), Some([127, 100, 0x12, 0x34]));
    }
}
