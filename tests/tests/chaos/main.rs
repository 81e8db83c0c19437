//! Chaos between two tenants on one host: hostd, two vdevs and two
//! process-mode tenants as separate processes. The victim (alpha) runs
//! verified traffic and owns a canary region nobody may write; the attacker
//! (beta) runs a seeded random mix of valid and invalid operations, and
//! its vdev is killed and restarted. A second test counts file descriptors
//! and memory of vdev, hostd and this process across create/destroy cycles.
//!
//! `VRDMA_CHAOS_SEED` replays a seed (printed by every run; thread timing
//! still varies), `VRDMA_CHAOS_SECS` sets the attack's duration and
//! `VRDMA_CHAOS_CYCLES` the leak check's cycles (docs/robustness.md).

mod attack;
mod attacker;
mod devices;
mod leaks;
mod victim;

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vrdma_guest_driver::{CompletionQueue, ProtectionDomain, QueuePair, WorkCompletion};
use vrdma_spec::control::QpAttr;
use vrdma_spec::verbs::{access, QpState};
use vrdma_tests::daemon::Hostd;
use vrdma_tests::rng::{env_number, seed_from_env};
use vrdma_tests::tenant::default_caps;

const RW: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
const KIB: usize = 1024;
/// Size of the canary and of each traffic buffer.
const REGION: usize = 64 * KIB;

/// Both tests count this process's file descriptors, so they must not run
/// at the same time (the test harness runs a file's tests in parallel).
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Run parameters, from the environment.
#[derive(Debug, Clone, Copy)]
struct Settings {
    seed: u64,
    duration: Duration,
    cycles: usize,
}

impl Settings {
    fn from_env() -> Self {
        Settings {
            seed: seed_from_env(),
            duration: Duration::from_secs(env_number("VRDMA_CHAOS_SECS").unwrap_or(20)),
            cycles: env_number("VRDMA_CHAOS_CYCLES").unwrap_or(1000) as usize,
        }
    }
}

/// An RC QP on `pd` whose work completes on `cq`.
fn rc_qp(pd: &ProtectionDomain, cq: &CompletionQueue) -> QueuePair {
    vrdma_tests::tenant::rc_qp(pd, cq, default_caps()).expect("create_qp")
}

/// Polls `cq` until `want` completions arrived or `within` passed.
fn collect(cq: &CompletionQueue, want: usize, within: Duration) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    let mut batch = [WorkCompletion::default(); 16];
    while out.len() < want && Instant::now() < deadline {
        let got = cq.poll(&mut batch).expect("poll_cq");
        out.extend_from_slice(&batch[..got]);
        if got == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    out
}

fn to_state(state: QpState) -> QpAttr {
    QpAttr {
        qp_state: state.into(),
        ..QpAttr::default()
    }
}

fn qp_state(qp: &QueuePair) -> u8 {
    qp.query(0).expect("query_qp").attr.qp_state
}

/// What `/proc` says about a process. Its resident memory is split:
/// private memory (heap, stacks) is what a leak grows; shared memory is the
/// tenant's guest memory mapped by vdev and hostd, which grows as the
/// tenant's allocations touch more of it, up to its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcUsage {
    fds: usize,
    rss_kib: u64,
    anon_kib: u64,
    shmem_kib: u64,
    maps: usize,
}

impl ProcUsage {
    /// `pid` is `"self"` or a number.
    fn of(pid: &str) -> Self {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("list /proc/PID/fd")
            .count();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let kib = |field: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
        };
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .expect("maps")
            .lines()
            .count();
        ProcUsage {
            fds,
            rss_kib: kib("VmRSS"),
            anon_kib: kib("RssAnon"),
            shmem_kib: kib("RssShmem"),
            maps,
        }
    }
}

/// What each of `pid`'s descriptors is (for failure messages).
fn fd_targets(pid: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut out: Vec<String> = dir
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    out.sort();
    out
}

/// hostd's usage gauge of `tenant` for `resource` (`vrdmactl metrics`).
fn usage(hostd: &Hostd, tenant: &str, resource: &str) -> Option<f64> {
    hostd.metric(&format!(
        "vrdma_tenant_usage{{tenant=\"{tenant}\",resource=\"{resource}\"}}"
    ))
}

/// Waits (up to 5 s: hostd tears a closed device down asynchronously)
/// until `tenant` holds exactly `expected` of each resource.
fn assert_usage(hostd: &Hostd, tenant: &str, expected: &[(&str, f64)]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now: Vec<_> = expected
            .iter()
            .map(|(resource, _)| usage(hostd, tenant, resource))
            .collect();
        let want: Vec<_> = expected.iter().map(|(_, v)| Some(*v)).collect();
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{tenant}'s usage {expected:?} is {now:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// hostd is up: its process runs and its admin socket answers `vrdmactl stats`.
fn assert_hostd_up(hostd: &mut Hostd) {
    assert!(hostd.is_running(), "hostd died:\n{}", hostd.log());
    let (code, out, err) = hostd.ctl(&["stats"]);
    assert_eq!(code, 0, "vrdmactl stats: {err}");
    assert!(out.contains("alpha"), "vrdmactl stats: {out}");
}
