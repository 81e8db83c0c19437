//! hostd's walls around the contexts a dead vdev leaves behind (orphans,
//! docs/architecture.md "A context outlives its vdev"), driven by a vdev
//! that speaks the protocol by hand: an orphan goes only to a successor of
//! its own tenant and device, with its records as they were journaled;
//! a context whose vdev released it, died in the middle of a command or
//! never ran its control queue is not kept; an orphan nobody takes is
//! released when its grace period ends.

use std::time::{Duration, Instant};

use vrdma_hostd_protocol::messages::{ContextKey, Journal, Record, Request};
use vrdma_tests::daemon::Hostd;
use vrdma_tests::rogue::{Answer, RogueVdev};

const POLICY: &str = "\
[[tenant]]
name = \"alpha\"
network = \"n\"

[[tenant]]
name = \"beta\"
network = \"n\"
";

fn key(n: u64) -> ContextKey {
    ContextKey {
        dev: 1,
        ino: 1000 + n,
        offset: 4096,
    }
}

fn record(kind: u8, id: u32, data: &str) -> Record {
    Record {
        kind,
        id,
        data: Some(data.into()),
    }
}

/// A context of `device` (tenant alpha) that ran its control queue
/// (`key`) and journaled `records`; dropped without a release, as a vdev
/// that died.
fn dies_with(hostd: &Hostd, device: &str, key: ContextKey, records: Vec<Record>) {
    let vdev =
        RogueVdev::hello_retrying(&hostd.socket, "alpha", device, &[libc::EBUSY]).expect("hello");
    vdev.journal(Journal {
        key: Some(key),
        records,
    });
    // The journal is not answered: a request that is makes sure hostd read
    // it before the connection closes.
    assert_eq!(
        vdev.call(&Request::ResolveGid { gid: vdev.gid() }, &[]),
        Answer::Ok
    );
}

/// hostd's log has `needle` `n` times within 5 s.
fn logged(hostd: &Hostd, needle: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while hostd.log().matches(needle).count() < n {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} ×{n}:\n{}",
            hostd.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_orphan_goes_whole_to_a_successor_of_its_own_device_only() {
    let hostd = Hostd::start_with(Some(POLICY), &["--orphan-grace-ms", "20000"]);
    let records = vec![record(1, 1, "{}"), record(10, 0, r#"{"next":2}"#)];
    dies_with(&hostd, "dev0", key(1), records.clone());
    logged(&hostd, "its context runs on, kept for the next vdev", 1);
    assert_eq!(hostd.usage("alpha")["devices"], 1, "the device lives on");
    assert_eq!(hostd.usage("alpha")["orphaned_contexts"], 1);

    // Another tenant, and another device of the same tenant, reach only
    // their own devices: no orphan there.
    let beta = RogueVdev::hello(&hostd.socket, "beta", "dev0").expect("beta");
    assert_eq!(
        beta.call(&Request::Adopt { key: key(1) }, &[]),
        Answer::Refused(libc::ENOENT)
    );
    let other = RogueVdev::hello(&hostd.socket, "alpha", "dev1").expect("alpha dev1");
    assert_eq!(
        other.call(&Request::Adopt { key: key(1) }, &[]),
        Answer::Refused(libc::ENOENT)
    );

    // The successor: the same tenant and device.
    let next = RogueVdev::hello(&hostd.socket, "alpha", "dev0").expect("the successor");
    assert_eq!(
        next.call(&Request::Adopt { key: key(2) }, &[]),
        Answer::Refused(libc::ENOENT),
        "another context's key"
    );
    assert_eq!(
        next.call(&Request::Adopt { key: key(1) }, &[]),
        Answer::Adopted(2)
    );
    assert_eq!(
        next.call(&Request::TakeRecords { from: 0 }, &[]),
        Answer::Records(records, false)
    );
    // Taken: no one else gets it.
    assert_eq!(
        next.call(&Request::Adopt { key: key(1) }, &[]),
        Answer::Refused(libc::ENOENT)
    );
    logged(&hostd, "A new vdev took over an orphaned context", 1);
    assert_eq!(hostd.usage("alpha")["orphaned_contexts"], 0);
}

#[test]
fn released_half_done_and_unstarted_contexts_are_not_kept_and_orphans_expire() {
    let hostd = Hostd::start_with(Some(POLICY), &["--orphan-grace-ms", "300"]);
    // Released on purpose (its frontend left).
    let released = RogueVdev::hello(&hostd.socket, "alpha", "dev0").expect("hello");
    released.journal(Journal {
        key: Some(key(1)),
        records: vec![],
    });
    assert_eq!(released.call(&Request::Release, &[]), Answer::Ok);
    drop(released);
    // Dead after a state-changing request it never journaled.
    let half =
        RogueVdev::hello_retrying(&hostd.socket, "alpha", "dev0", &[libc::EBUSY]).expect("hello");
    half.journal(Journal {
        key: Some(key(2)),
        records: vec![],
    });
    assert!(matches!(
        half.call(&Request::DestroyCq { cqn: 1 }, &[]),
        Answer::Refused(_)
    ));
    drop(half);
    logged(&hostd, "died in the middle of a control command", 1);
    // Dead before its control queue ran (no key).
    let unstarted =
        RogueVdev::hello_retrying(&hostd.socket, "alpha", "dev0", &[libc::EBUSY]).expect("hello");
    drop(unstarted);
    logged(&hostd, "its control queue never ran", 1);
    // Kept, but nobody comes: released after its grace period, and the
    // device with it.
    dies_with(&hostd, "dev0", key(3), vec![]);
    logged(&hostd, "kept for the next vdev", 1);
    logged(
        &hostd,
        "No vdev took the context over in its grace period",
        1,
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while hostd.usage("alpha")["devices"] != 0 {
        assert!(Instant::now() < deadline, "{}", hostd.usage("alpha"));
        std::thread::sleep(Duration::from_millis(20));
    }
    let next =
        RogueVdev::hello_retrying(&hostd.socket, "alpha", "dev0", &[libc::EBUSY]).expect("hello");
    for k in 1..=3 {
        assert_eq!(
            next.call(&Request::Adopt { key: key(k) }, &[]),
            Answer::Refused(libc::ENOENT),
            "context {k}"
        );
    }
}
