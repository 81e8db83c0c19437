//! LIDs of devices: stable per (tenant, device name), so that a restarted
//! vdev gets its LID back — and a restarted hostd gives each device the
//! LID, and with it the GID, it had before: a fresh LID is derived from
//! the tenant and device name (the first free one from a hash of them),
//! not from the order devices connect in — and bounded per tenant, so that a vdev cycling
//! through device names (a compromised one, or a VMM naming sockets after
//! each boot) cannot use up the host's LIDs and lock every other tenant's
//! new devices out.
//!
//! Each tenant keeps up to [`REMEMBERED_PER_TENANT`] names. A new name
//! beyond that takes over the LID of the tenant's least recently connected
//! name that is not connected now; a LID therefore only ever passes between
//! devices of one tenant, never to another tenant, whose QPs the old
//! device's peers would then accept work from. Only when every name of the
//! tenant is connected does a new name take a fresh LID.

use std::collections::HashMap;

/// Device names remembered per tenant once disconnected.
pub const REMEMBERED_PER_TENANT: usize = 64;
/// Largest LID (unicast range 0x0001–0xbfff).
pub const MAX_LID: u16 = vrdma_spec::verbs::lid::MAX_UNICAST;

/// A remembered device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Remembered {
    lid: u16,
    /// When the device last connected (a counter).
    seen: u64,
}

/// The LID a device gets, before [`LidTable::commit`] makes it so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    tenant: String,
    device: String,
    pub lid: u16,
    /// The name whose LID this one takes over (forgotten at commit).
    replaces: Option<String>,
    /// Whether the LID is a fresh one.
    fresh: bool,
}

/// No LID left for a new device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("No LID left on this host")]
pub struct Exhausted;

/// LIDs by (tenant, device name).
#[derive(Debug)]
pub struct LidTable {
    by_device: HashMap<(String, String), Remembered>,
    /// The lowest LID a device may get.
    first: u16,
    clock: u64,
}

/// Where the search for `device` of `tenant`'s fresh LID starts, in
/// `first..=MAX_LID`: a hash of the two (FNV-1a: stable across runs,
/// builds and Rust versions), so the device finds the same LID after hostd
/// restarted unless another name took it first.
fn home_lid(tenant: &str, device: &str, first: u16) -> u16 {
    let hash = (tenant.bytes().chain([0]).chain(device.bytes()))
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    first + (hash % u64::from(MAX_LID - first + 1)) as u16
}

impl Default for LidTable {
    fn default() -> Self {
        LidTable::starting_at(1)
    }
}

impl LidTable {
    /// A table whose fresh LIDs start at `first` (the ones below are
    /// taken: on an InfiniBand host, LID 1 is hostd's, the subnet
    /// manager's).
    pub fn starting_at(first: u16) -> Self {
        LidTable {
            by_device: HashMap::new(),
            first: first.clamp(1, MAX_LID),
            clock: 0,
        }
    }

    /// The LID `device` of `tenant` gets: its own if it is remembered,
    /// else one of the tenant's forgotten devices' (see the module doc) or
    /// a fresh one. `connected` says whether a LID is in use now. Nothing
    /// changes until [`LidTable::commit`].
    pub fn assign(
        &self,
        tenant: &str,
        device: &str,
        connected: impl Fn(u16) -> bool,
    ) -> Result<Assignment, Exhausted> {
        let assignment = |lid, replaces, fresh| Assignment {
            tenant: tenant.to_owned(),
            device: device.to_owned(),
            lid,
            replaces,
            fresh,
        };
        if let Some(r) = self.by_device.get(&(tenant.to_owned(), device.to_owned())) {
            return Ok(assignment(r.lid, None, false));
        }
        let mine = || self.by_device.iter().filter(|((t, _), _)| t == tenant);
        if mine().count() >= REMEMBERED_PER_TENANT {
            let oldest = mine()
                .filter(|(_, r)| !connected(r.lid))
                .min_by_key(|(_, r)| r.seen);
            if let Some(((_, name), r)) = oldest {
                return Ok(assignment(r.lid, Some(name.clone()), false));
            }
        }
        let used: std::collections::HashSet<u16> = self.by_device.values().map(|r| r.lid).collect();
        let first = self.first;
        let span = MAX_LID - first + 1;
        let home = home_lid(tenant, device, first);
        let fresh = (0..span)
            .map(|i| first + (home - first + i) % span)
            .find(|&lid| !used.contains(&lid) && !connected(lid))
            .ok_or(Exhausted)?;
        Ok(assignment(fresh, None, true))
    }

    /// Records that the device of `a` connected with `a.lid`.
    pub fn commit(&mut self, a: Assignment) {
        if let Some(name) = a.replaces {
            self.by_device.remove(&(a.tenant.clone(), name));
        }
        self.clock += 1;
        self.by_device.insert(
            (a.tenant, a.device),
            Remembered {
                lid: a.lid,
                seen: self.clock,
            },
        );
    }

    /// Names remembered for `tenant`.
    pub fn remembered(&self, tenant: &str) -> usize {
        self.by_device.keys().filter(|(t, _)| t == tenant).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connect(table: &mut LidTable, tenant: &str, device: &str) -> u16 {
        let a = table.assign(tenant, device, |_| false).expect("a LID");
        let lid = a.lid;
        table.commit(a);
        lid
    }

    #[test]
    fn a_device_keeps_its_lid_and_names_get_distinct_ones() {
        let mut t = LidTable::default();
        let a = connect(&mut t, "alpha", "one");
        let b = connect(&mut t, "alpha", "two");
        let c = connect(&mut t, "beta", "one");
        assert!(a != b && b != c && a != c, "{a} {b} {c}");
        assert_eq!(a, home_lid("alpha", "one", 1), "from the names");
        assert_eq!(
            connect(&mut t, "alpha", "one"),
            a,
            "a restart keeps the LID"
        );
        assert_eq!(connect(&mut t, "beta", "one"), c, "names are per tenant");
    }

    #[test]
    fn lids_below_the_first_are_never_given() {
        let mut t = LidTable::starting_at(2);
        for i in 0..1000 {
            assert!(connect(&mut t, "alpha", &format!("d{i}")) >= 2);
        }
        // Every LID but the first's: the last fresh one is found by the
        // wrap-around, never below `first`.
        let mut t = LidTable::starting_at(MAX_LID - 1);
        let a = connect(&mut t, "alpha", "one");
        let b = connect(&mut t, "beta", "one");
        assert_eq!(
            std::collections::BTreeSet::from([a, b]),
            std::collections::BTreeSet::from([MAX_LID - 1, MAX_LID])
        );
        assert!(t.assign("gamma", "one", |_| false).is_err());
    }

    #[test]
    fn cycling_names_reuses_the_tenants_own_lids() {
        let mut t = LidTable::default();
        let alpha = connect(&mut t, "alpha", "vm");
        let mut beta = std::collections::BTreeSet::new();
        for i in 0..10 * REMEMBERED_PER_TENANT {
            beta.insert(connect(&mut t, "beta", &format!("name-{i}")));
        }
        assert_eq!(beta.len(), REMEMBERED_PER_TENANT, "beta's LIDs are bounded");
        assert!(!beta.contains(&alpha), "never another tenant's LID");
        assert_eq!(t.remembered("beta"), REMEMBERED_PER_TENANT);
        assert_eq!(connect(&mut t, "alpha", "vm"), alpha);
        // The most recent names are still remembered; the oldest are not.
        let last = format!("name-{}", 10 * REMEMBERED_PER_TENANT - 1);
        let lid = t.assign("beta", &last, |_| false).expect("LID");
        assert!(lid.replaces.is_none() && !lid.fresh, "{lid:?}");
    }

    #[test]
    fn connected_lids_are_never_taken_over() {
        let mut t = LidTable::default();
        for i in 0..REMEMBERED_PER_TENANT {
            connect(&mut t, "beta", &format!("name-{i}"));
        }
        // All connected: a new name gets a fresh LID.
        let a = t.assign("beta", "new", |lid| t_has(&t, lid)).expect("LID");
        assert!(a.fresh && !t_has(&t, a.lid), "{a:?}");
        // Only name-4's LID is free: the new name takes it over.
        let four = t.assign("beta", "name-4", |_| true).expect("LID").lid;
        let a = t.assign("beta", "new", |lid| lid != four).expect("LID");
        assert_eq!((a.lid, a.replaces.as_deref()), (four, Some("name-4")));
        t.commit(a);
        assert_eq!(t.remembered("beta"), REMEMBERED_PER_TENANT);
    }

    /// Whether the table remembers `lid` for some name.
    fn t_has(t: &LidTable, lid: u16) -> bool {
        t.by_device.values().any(|r| r.lid == lid)
    }

    #[test]
    fn fresh_lids_run_out_only_when_all_are_in_use() {
        let mut t = LidTable::default();
        let last = connect(&mut t, "alpha", "last");
        assert_eq!(
            t.assign("alpha", "more", |lid| lid != last).map(|a| a.lid),
            Err(Exhausted),
            "every other LID is connected"
        );
        assert_eq!(
            t.assign("alpha", "last", |_| true).map(|a| a.lid),
            Ok(last),
            "a known name still gets its LID"
        );
    }

    #[test]
    fn a_restarted_hostd_gives_each_device_its_lid_again() {
        let names = [("alpha", "vdev-1"), ("beta", "vdev-1"), ("alpha", "vdev-2")];
        let mut first = LidTable::default();
        let lids: Vec<u16> = names
            .iter()
            .map(|(t, d)| connect(&mut first, t, d))
            .collect();
        // After the restart the devices come back in another order.
        let mut second = LidTable::default();
        let again: Vec<u16> = (names.iter().rev())
            .map(|(t, d)| connect(&mut second, t, d))
            .collect();
        assert_eq!(again.into_iter().rev().collect::<Vec<_>>(), lids);
    }
}
