//! The device's rdma_cm port spaces: which (port space, port) pairs are
//! bound, by which CM ID. A device has one IPv4 address, so binding its
//! address and binding "any" claim the same port; the spaces are the
//! device's own (another device, another tenant, never sees them).

use std::collections::HashMap;

use vrdma_cm::PortSpace;

use super::IdNum;

/// The ports [`PortTable::bind`] picks from when asked for port 0 (Linux's
/// default `ip_local_port_range`).
pub const EPHEMERAL: std::ops::RangeInclusive<u16> = 32768..=60999;

/// Why a port cannot be bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    #[error("Port {port} of port space {ps:?} is already bound")]
    InUse { ps: PortSpace, port: u16 },
    #[error("No free port in port space {0:?}")]
    Exhausted(PortSpace),
}

/// Bound ports of every port space of one device.
#[derive(Debug, Default)]
pub struct PortTable {
    bound: HashMap<(PortSpace, u16), IdNum>,
    /// Where the next search for a free ephemeral port starts.
    next: u16,
}

impl PortTable {
    pub fn new(start: u16) -> PortTable {
        PortTable {
            bound: HashMap::new(),
            next: start,
        }
    }

    /// Binds `port` (0: a free ephemeral one) of `ps` to `id`; the port.
    pub fn bind(&mut self, ps: PortSpace, port: u16, id: IdNum) -> Result<u16, PortError> {
        if port != 0 {
            if self.bound.contains_key(&(ps, port)) {
                return Err(PortError::InUse { ps, port });
            }
            self.bound.insert((ps, port), id);
            return Ok(port);
        }
        let (lo, hi) = (*EPHEMERAL.start(), *EPHEMERAL.end());
        let span = u32::from(hi - lo) + 1;
        let first = u32::from(self.next.clamp(lo, hi) - lo);
        for step in 0..span {
            let offset = (first + step) % span;
            // offset < span ≤ 2^16, so this fits.
            let candidate = lo + offset as u16;
            if let std::collections::hash_map::Entry::Vacant(e) = self.bound.entry((ps, candidate))
            {
                e.insert(id);
                self.next = if candidate == hi { lo } else { candidate + 1 };
                return Ok(candidate);
            }
        }
        Err(PortError::Exhausted(ps))
    }

    /// Releases `port` of `ps` if `id` holds it.
    pub fn release(&mut self, ps: PortSpace, port: u16, id: IdNum) {
        if self.bound.get(&(ps, port)) == Some(&id) {
            self.bound.remove(&(ps, port));
        }
    }

    /// Who holds `port` of `ps`.
    pub fn holder(&self, ps: PortSpace, port: u16) -> Option<IdNum> {
        self.bound.get(&(ps, port)).copied()
    }

    /// Ports bound over all spaces.
    pub fn len(&self) -> usize {
        self.bound.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bound.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_bound_once_per_space() {
        let mut t = PortTable::new(40000);
        assert_eq!(t.bind(PortSpace::Tcp, 7471, IdNum(1)), Ok(7471));
        assert_eq!(
            t.bind(PortSpace::Tcp, 7471, IdNum(2)),
            Err(PortError::InUse {
                ps: PortSpace::Tcp,
                port: 7471
            })
        );
        // Another port space is another table.
        assert_eq!(t.bind(PortSpace::Udp, 7471, IdNum(2)), Ok(7471));
        // Only the holder releases it.
        t.release(PortSpace::Tcp, 7471, IdNum(2));
        assert_eq!(t.holder(PortSpace::Tcp, 7471), Some(IdNum(1)));
        t.release(PortSpace::Tcp, 7471, IdNum(1));
        assert_eq!(t.bind(PortSpace::Tcp, 7471, IdNum(3)), Ok(7471));
    }

    #[test]
    fn port_zero_picks_free_ephemeral_ports_and_wraps() {
        let hi = *EPHEMERAL.end();
        let mut t = PortTable::new(hi);
        assert_eq!(t.bind(PortSpace::Tcp, 0, IdNum(1)), Ok(hi));
        // Wrapped to the start of the range, skipping a taken port.
        let lo = *EPHEMERAL.start();
        assert_eq!(t.bind(PortSpace::Tcp, lo, IdNum(2)), Ok(lo));
        assert_eq!(t.bind(PortSpace::Tcp, 0, IdNum(3)), Ok(lo + 1));
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn an_exhausted_space_says_so() {
        let mut t = PortTable::new(0);
        for p in EPHEMERAL {
            t.bind(PortSpace::Udp, p, IdNum(u32::from(p))).unwrap();
        }
        assert_eq!(
            t.bind(PortSpace::Udp, 0, IdNum(1)),
            Err(PortError::Exhausted(PortSpace::Udp))
        );
        assert!(t.bind(PortSpace::Tcp, 0, IdNum(1)).is_ok());
    }
}
