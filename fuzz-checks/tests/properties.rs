//! The fuzz targets' invariants as property tests (bounded, run in CI),
//! replay of the committed fuzz corpus, and regression inputs of findings.

use std::path::PathBuf;

use proptest::prelude::*;
use vrdma_fuzz_checks::{
    cm, control, handover, hostd, hostd_session, journal, memory, policy, rings, roce, wire, wqe,
    TARGETS,
};

fn config() -> ProptestConfig {
    cases(256)
}

/// `n` cases: fewer for the checks whose every case builds a lot (an
/// engine with three devices; a device attached to hostd), so that the
/// whole file stays a few seconds in a debug build.
fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: n,
        // Shrinking a failure is worth its time; a pass stays fast.
        max_shrink_iters: 2048,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn wqe_reader(data in proptest::collection::vec(any::<u8>(), 0..4200)) {
        wqe::check(&data);
    }

    #[test]
    fn hostd_requests(data in proptest::collection::vec(any::<u8>(), 0..1024)) {
        hostd::check(&data);
    }

    #[test]
    fn hostd_sessions(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        hostd_session::check(&data);
    }

    #[test]
    fn hostd_request_json(text in r#"\{"[a-z_]{3,14}":(\{("[a-z_]{1,8}":(-?[0-9]{1,20}|"[a-z]{0,4}"|\[\]|\{\})),?\}|\[\]|null|"x")\}"#) {
        hostd::check_request(text.as_bytes());
    }

    #[test]
    fn policy_files(text in policy_text()) {
        policy::check(text.as_bytes());
    }

    #[test]
    fn handover_blobs(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        handover::check(&data);
    }

    #[test]
    fn journals(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        journal::check(&data);
    }

    #[test]
    fn memory_changes(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        memory::check(&data);
    }

    #[test]
    fn roce_packets(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        roce::check(&data);
    }

    /// Each of the modes with its ICRC made valid or built from fields,
    /// so that the header checks are reached (random bytes alone stop at
    /// the ICRC).
    #[test]
    fn roce_packets_sealed(mode in prop_oneof![Just(1u8), Just(3), 4u8..8], rest in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut data = vec![mode];
        data.extend_from_slice(&rest);
        roce::check(&data);
    }

    #[test]
    fn cm_mads(data in proptest::collection::vec(any::<u8>(), 0..300)) {
        cm::check(&data);
    }

    /// A valid CM header on random bodies (mode 1), and agent sessions
    /// (modes 2 and 3): random bytes alone stop at the MAD header.
    #[test]
    fn cm_mads_sealed(mode in 1u8..4, rest in proptest::collection::vec(any::<u8>(), 0..1024)) {
        let mut data = vec![mode];
        data.extend_from_slice(&rest);
        cm::check(&data);
    }
}

proptest! {
    // Half the cases attach the device to a real hostd.
    #![proptest_config(cases(128))]

    #[test]
    fn control_commands(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        control::check(&data);
    }
}

proptest! {
    // Each case builds an engine with three devices of 1 MiB each (about
    // 5 ms a case in a debug build).
    #![proptest_config(cases(128))]

    #[test]
    fn hostile_rings(data in proptest::collection::vec(any::<u8>(), 0..1024)) {
        rings::check(&data);
    }
}

proptest! {
    // Each case builds an engine with two small devices on a wire (about
    // 1 ms a case in a debug build).
    #![proptest_config(cases(96))]

    #[test]
    fn wire_packets(data in proptest::collection::vec(any::<u8>(), 0..1024)) {
        wire::check(&data);
    }

    /// Batches of packets built from fields (the first byte of each step
    /// a batch, of each packet a structured one): random bytes alone make
    /// every other step something else and half the packets raw.
    #[test]
    fn wire_packets_structured(steps in proptest::collection::vec(wire_batch(), 1..6)) {
        wire::check(&steps.concat());
    }
}

/// One step of the `wire` check's input that is a batch of structured
/// packets: the step's opcode (0-3), the count, then each packet's kind
/// (0-1) and its fields.
fn wire_batch() -> impl Strategy<Value = Vec<u8>> {
    let packet = (0u8..2, proptest::collection::vec(any::<u8>(), wire::FIELDS))
        .prop_map(|(kind, fields)| [vec![kind], fields].concat());
    (0u8..4, proptest::collection::vec(packet, 1..5)).prop_map(|(step, packets)| {
        let mut v = vec![step, packets.len() as u8 - 1];
        for p in packets {
            v.extend(p);
        }
        v
    })
}

/// Policy-shaped TOML: tenant tables with known and unknown keys.
fn policy_text() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        Just("name"),
        Just("network"),
        Just("reachable"),
        Just("uid"),
        Just("physical_queues"),
        Just("max_devices"),
        Just("quotas.max_pd"),
        Just("quotas.max_mr_bytes"),
        Just("quotas.max_total_mr_bytes"),
        Just("priority.class"),
        Just("priority.weight"),
        Just("rate.send.ops_per_sec"),
        Just("bogus"),
    ];
    let value = prop_oneof![
        "[a-z]{1,6}".prop_map(|s| format!("\"{s}\"")),
        any::<u64>().prop_map(|v| v.to_string()),
        (0u32..70).prop_map(|v| v.to_string()),
        Just("[\"a\", \"b\"]".to_owned()),
        Just("-1".to_owned()),
        Just("\"gold\"".to_owned()),
        Just("\"\"".to_owned()),
    ];
    let table = proptest::collection::vec((key, value), 0..6).prop_map(|kvs| {
        let mut t = String::from("[[tenant]]\n");
        for (k, v) in kvs {
            t.push_str(&format!("{k} = {v}\n"));
        }
        t
    });
    proptest::collection::vec(table, 0..4).prop_map(|ts| ts.concat())
}

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

/// Every committed corpus input of every target passes its check. The
/// targets replay side by side (the corpora hold thousands of inputs).
#[test]
fn corpus_replay() {
    std::thread::scope(|scope| {
        let replays: Vec<_> = TARGETS
            .iter()
            .map(|&(target, check)| (target, scope.spawn(move || replay(target, check))))
            .collect();
        for (target, replay) in replays {
            let n = replay.join().expect("replay thread");
            assert!(n > 0, "empty corpus for {target}");
        }
    });
}

/// Runs every corpus input of `target` through `check`; returns how many.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = corpus_dir(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        panic!("no corpus for target {target} at {}", dir.display())
    };
    let started = std::time::Instant::now();
    let mut n = 0;
    for entry in entries {
        let path = entry.expect("corpus entry").path();
        let data = std::fs::read(&path).expect("corpus file");
        let outcome = std::panic::catch_unwind(|| check(&data));
        assert!(outcome.is_ok(), "{target}: {} fails", path.display());
        n += 1;
    }
    eprintln!("{target}: {n} inputs in {:?}", started.elapsed());
    n
}

/// Inputs that once crashed a target or broke an invariant
/// (fuzz/regressions/<target>/), kept as tests.
#[test]
fn regressions() {
    for (target, check) in TARGETS {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/regressions")
            .join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("regression entry").path();
            let data = std::fs::read(&path).expect("regression file");
            let outcome = std::panic::catch_unwind(|| check(&data));
            assert!(
                outcome.is_ok(),
                "{target}: regression {} fails again",
                path.display()
            );
        }
    }
}
