//! What one tenant's devices cannot take from another: LIDs, physical
//! queues.

use vrdma_tests::daemon::Hostd;
use vrdma_tests::rogue::RogueVdev;

use crate::*;

/// Found by the chaos test's compromised vdev: every new device name took
/// a fresh LID for good, so one tenant's vdev cycling names (or a VMM
/// naming sockets per boot) used up the host's 49151 LIDs, after which no
/// tenant's new device could register. hostd now remembers 64 names per
/// tenant and recycles a tenant's own LIDs only (`hostd/src/lids.rs`).
#[test]
fn a_tenant_cycling_device_names_cannot_use_up_the_hosts_lids() {
    const NAMES: usize = 200;
    const REMEMBERED_PER_TENANT: usize = 64;
    let _serial = serial();
    let hostd = Hostd::start(None);
    let alpha = RogueVdev::hello(&hostd.socket, "alpha", "alpha-vm").expect("alpha registers");
    let alpha_lid = alpha.lid();
    drop(alpha);
    let mut lids = std::collections::BTreeSet::new();
    for i in 0..NAMES {
        let beta = hello_within_quota(&hostd, "beta", &format!("cycling-{i}"));
        lids.insert(beta.lid());
    }
    assert!(
        lids.len() <= REMEMBERED_PER_TENANT + 4,
        "{} LIDs for {NAMES} names of one tenant",
        lids.len()
    );
    assert!(
        !lids.contains(&alpha_lid),
        "a LID never passes to another tenant"
    );
    let alpha = RogueVdev::hello(&hostd.socket, "alpha", "alpha-vm").expect("alpha comes back");
    assert_eq!(alpha.lid(), alpha_lid, "alpha's device keeps its LID");
}

/// Registers a device, waiting while devices this test dropped still
/// count against the tenant's `max_devices` (hostd sees a close
/// asynchronously).
fn hello_within_quota(hostd: &Hostd, tenant: &str, device: &str) -> RogueVdev {
    RogueVdev::hello_retrying(&hostd.socket, tenant, device, &[libc::EDQUOT])
        .unwrap_or_else(|errno| panic!("{tenant}'s device {device} refused with errno {errno}"))
}

/// Registers devices of `tenant` until hostd refuses one; returns those
/// it accepted and the refusal's errno.
fn register_until_refused(hostd: &Hostd, tenant: &str) -> (Vec<RogueVdev>, i32) {
    let mut held = Vec::new();
    loop {
        match RogueVdev::hello(&hostd.socket, tenant, &format!("hog-{}", held.len())) {
            Ok(rogue) if held.len() < 1000 => held.push(rogue),
            Ok(_) => panic!("no limit on {tenant}'s devices"),
            Err(errno) => return (held, errno),
        }
    }
}

/// Found with the chaos test's compromised vdev: one tenant could register
/// devices until every physical queue of the NIC was taken, and then no
/// other tenant's device could register at all. A tenant now has at most
/// `max_devices` devices (EDQUOT beyond), and hostd keeps free the
/// physical queues of every device the other tenants may still connect.
#[test]
fn one_tenant_cannot_take_the_physical_queues_of_another() {
    let _serial = serial();
    // The default policy fits: 2 tenants x 4 devices x 2 queues <= 64.
    let hostd = Hostd::start(None);
    let (held, errno) = register_until_refused(&hostd, "beta");
    assert_eq!((held.len(), errno), (4, libc::EDQUOT), "beta's max_devices");
    let alpha: Vec<RogueVdev> = (0..4)
        .map(|i| {
            RogueVdev::hello(&hostd.socket, "alpha", &format!("vm{i}"))
                .unwrap_or_else(|errno| panic!("alpha's device {i} refused with errno {errno}"))
        })
        .collect();
    assert!(alpha.iter().all(|a| a.welcome.physical_queues == 2));
    let beta = hostd.tenant_stats("beta");
    assert_eq!(beta["quota_rejections"]["max_devices"], 1);
    assert_eq!(beta["usage"]["devices"], 4);
    assert_eq!(beta["quota"]["max_devices"], 4);
    // Freeing one of beta's devices lets a new one in.
    let mut held = held;
    drop(held.pop());
    held.push(hello_within_quota(&hostd, "beta", "hog-next"));
    drop((held, alpha));

    // An over-committed policy (40 x 2 queues for beta alone): beta runs
    // the NIC out of physical queues, but alpha's first device still fits.
    let hostd = Hostd::start(Some(
        "[[tenant]]\nname = \"alpha\"\n\
         [[tenant]]\nname = \"beta\"\nmax_devices = 40\n",
    ));
    let (mut held, errno) = register_until_refused(&hostd, "beta");
    assert_eq!(
        errno,
        libc::ENOSPC,
        "beta's device {} is refused",
        held.len()
    );
    assert_eq!(
        held.len(),
        31,
        "64 physical QPs, 2 kept for alpha's first device"
    );
    let alpha = RogueVdev::hello(&hostd.socket, "alpha", "vm")
        .unwrap_or_else(|errno| panic!("alpha's first device refused with errno {errno}"));
    assert!(alpha.lid() > 0);
    // Once beta lets one go, it may take that one again (no reservation
    // for itself), and alpha's second device competes with it.
    drop(held.pop());
    let again = RogueVdev::hello_retrying(&hostd.socket, "beta", "hog-again", &[libc::ENOSPC])
        .unwrap_or_else(|errno| panic!("beta's device refused with errno {errno}"));
    assert!(again.lid() > 0);
}
