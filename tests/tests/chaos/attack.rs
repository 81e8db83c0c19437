//! The chaos test itself: the victim's traffic and the attacker's moves at
//! once, the canary and hostd checked all along, and everything given
//! back when both tenants go.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vrdma_guest_driver::WorkCompletion;
use vrdma_tests::daemon::Hostd;
use vrdma_tests::tenant::Tenant;

use crate::attacker::{Attacker, MOVES};
use crate::victim::{victim_traffic, Victim};
use crate::*;

/// The victim (alpha) is realtime and the attacker (beta) normal, so the
/// attacker's long messages also run in the NIC's segments, between which
/// the victim's work goes first (and the attacker deregisters).
const CHAOS_POLICY: &str = r#"
[[tenant]]
name = "alpha"
network = "demo"
priority = { class = "realtime" }

[[tenant]]
name = "beta"
network = "demo"
"#;

#[test]
fn an_attacker_never_reaches_the_victim_and_hostd_stays_up() {
    let _serial = serial();
    let settings = Settings::from_env();
    println!(
        "chaos: seed {} for {:?} (replay with VRDMA_CHAOS_SEED={})",
        settings.seed, settings.duration, settings.seed
    );
    let client_before = ProcUsage::of("self");
    let mut hostd = Hostd::start(Some(CHAOS_POLICY));
    let hostd_pid = hostd.pid().to_string();
    // hostd's baseline once it served a device: its first one starts
    // threads (and their cached stacks) that stay.
    drop(Tenant::start(&hostd, "beta"));
    assert_usage(&hostd, "beta", &[("devices", 0.0)]);
    let hostd_before = ProcUsage::of(&hostd_pid);
    let victim = Victim::start(&hostd, settings.seed);
    let attacker = Attacker::new(&hostd, &victim, settings.seed);
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let deadline = started + settings.duration;
    let mut checks = (0u64, 0u64);
    let (report, (tally, rounds, beta_log)) = std::thread::scope(|scope| {
        let traffic = scope.spawn(|| victim_traffic(&victim, settings.seed, &stop));
        let attack = scope.spawn(|| attacker.run(deadline, &stop));
        let mut last_stats = Instant::now();
        while !attack.is_finished() && !traffic.is_finished() {
            victim.assert_canary_intact();
            checks.0 += 1;
            if last_stats.elapsed() > Duration::from_secs(1) {
                assert_hostd_up(&mut hostd);
                checks.1 += 1;
                last_stats = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, Ordering::Relaxed);
        let report = traffic
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        let tally = attack
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        (report, tally)
    });
    let elapsed = started.elapsed();
    println!(
        "chaos: {rounds} rounds in {elapsed:?}; victim {report:?}; \
         {} canary and {} hostd checks",
        checks.0, checks.1
    );
    for (m, outcomes) in &tally {
        println!("chaos:   {m:?}: {outcomes:?}");
    }

    victim.assert_canary_intact();
    assert_hostd_up(&mut hostd);
    assert!(
        report.writes > 0 && report.reads > 0 && report.sends > 0,
        "the victim's traffic ran: {report:?}"
    );
    let mut batch = [WorkCompletion::default(); 4];
    assert_eq!(
        victim.exposed_cq.poll(&mut batch).expect("poll"),
        0,
        "the exposed QP never completes anything: {batch:?}"
    );
    for m in MOVES {
        assert!(tally.contains_key(&m), "move {m:?} never ran: {tally:?}");
    }
    std::fs::write("/tmp/chaos-hostd.log", hostd.log()).ok();
    std::fs::write("/tmp/chaos-alpha.log", victim.t.vdev.log()).ok();
    std::fs::write("/tmp/chaos-beta.log", &beta_log).ok();
    for (who, log) in [
        ("hostd", hostd.log()),
        ("vdev alpha", victim.t.vdev.log()),
        ("vdev beta", beta_log),
    ] {
        assert!(!log.contains("panicked"), "{who} panicked:\n{log}");
    }

    // Everything of both tenants goes back to zero when they go.
    drop(victim);
    for tenant in ["alpha", "beta"] {
        assert_usage(
            &hostd,
            tenant,
            &[
                ("devices", 0.0),
                ("physical_queues", 0.0),
                ("mrs", 0.0),
                ("mr_bytes", 0.0),
                ("qps", 0.0),
            ],
        );
    }
    // Every device that came and went (killed, restarted, compromised)
    // gave back its descriptors and mappings.
    // (hostd closes a connection's descriptors a moment after its usage
    // drops to zero.)
    let deadline = Instant::now() + Duration::from_secs(2);
    while ProcUsage::of(&hostd_pid).fds > hostd_before.fds && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let hostd_after = ProcUsage::of(&hostd_pid);
    println!("chaos: hostd {hostd_before:?} → {hostd_after:?}");
    assert!(
        hostd_after.fds <= hostd_before.fds,
        "hostd's descriptors once both tenants are gone: {hostd_before:?} → {hostd_after:?}: {:?}",
        fd_targets(&hostd_pid)
    );
    // glibc keeps up to 40 MiB of exited threads' stacks for reuse (5 of
    // 8 MiB: 10 mappings with guards) and makes up to 8 malloc arenas a
    // core (16 here: 32 mappings), however many devices came and went; a
    // mapping leaked per device would be about a hundred (three devices
    // of beta each round).
    assert!(
        hostd_after.maps <= hostd_before.maps + 42,
        "hostd's mappings once both tenants are gone: {hostd_before:?} → {hostd_after:?}"
    );
    drop(hostd);
    let client_after = ProcUsage::of("self");
    assert_eq!(
        client_after.fds, client_before.fds,
        "this process's file descriptors: {client_before:?} → {client_after:?}"
    );
}
