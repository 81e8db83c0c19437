//! Tenant policy in hostd, through the real binary, the test client and
//! `vrdmactl`: the Welcome carries the tenant's policy, memory quotas span
//! a tenant's devices, reloads (by `vrdmactl reload` and SIGHUP) push new
//! policies to connected vdevs and keep the old one when the file is bad,
//! counters reach `vrdmactl metrics`, and a rate-limited tenant holds its
//! rate beside an unlimited one.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use vrdma_hostd::admin::{self, AdminRequest, AdminResponse};
use vrdma_hostd::stats::{Stats, TenantStats};
use vrdma_hostd_protocol::messages::{Notification, Request};
use vrdma_spec::verbs::{SendOpcode, WcStatus};
use vrdma_tenant_policy::{Policy, TenantPolicy};

const MIB: u64 = 1 << 20;

/// alpha with tight memory quotas and 3 queues, beta plain, both in "demo".
fn quota_policy(max_mr_bytes: u64) -> String {
    format!(
        r#"
[[tenant]]
name = "alpha"
network = "demo"
physical_queues = 3
priority = {{ class = "priority", weight = 5 }}
quotas = {{ max_mr = 4, max_mr_bytes = {max_mr_bytes}, max_total_mr_bytes = 1572864, max_qp = 64 }}
rate.read = {{ ops_per_sec = 100000 }}

[[tenant]]
name = "beta"
network = "demo"
"#
    )
}

fn tenant_policy(text: &str, name: &str) -> TenantPolicy {
    Policy::parse(text, Path::new("test"))
        .expect("valid policy")
        .tenant(name)
        .expect("tenant")
        .clone()
}

/// Registers `len` bytes at `offset` of `c`'s slot 0 (at the same offset
/// of the IOVA space): the lkey or the errno.
fn mr(c: &Client, offset: u64, len: u64) -> Result<u32, i32> {
    errno(c.register(ALL, IOVA + offset, 0, offset, len)).map(|keys| keys.0)
}

fn stats(hostd: &Hostd) -> Stats {
    match admin::call(&hostd.admin, AdminRequest::Stats).expect("admin call") {
        AdminResponse::Stats(stats) => stats,
        other => panic!("unexpected {other:?}"),
    }
}

fn tenant_stats(hostd: &Hostd, name: &str) -> TenantStats {
    stats(hostd)
        .tenants
        .into_iter()
        .find(|t| t.tenant == name)
        .expect("tenant in stats")
}

#[test]
fn welcome_carries_the_tenants_policy() {
    let text = quota_policy(MIB);
    let hostd = Hostd::start_with("welcome", &config(64), &text);
    let alpha = Client::hello(&hostd.socket, "alpha", "vm0").expect("alpha");
    assert_eq!(alpha.policy, tenant_policy(&text, "alpha"));
    assert_eq!(alpha.physical_queues, 3, "physical_queues of the policy");
    let beta = Client::hello(&hostd.socket, "beta", "vm0").expect("beta");
    assert_eq!(beta.policy, tenant_policy(&text, "beta"));
    assert_eq!(beta.physical_queues, 2, "the default");
    let refused = Client::hello(&hostd.socket, "gamma", "vm0").map(|_| ());
    assert_eq!(refused.map_err(|e| e.0), Err(libc::EACCES));
    // The admin socket is the operator's only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&hostd.admin)
        .expect("admin socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn memory_quota_spans_a_tenants_devices() {
    let hostd = Hostd::start_with("memcap", &config(64), &quota_policy(MIB));
    let vm0 = Client::hello(&hostd.socket, "alpha", "vm0").expect("vm0");
    let vm1 = Client::hello(&hostd.socket, "alpha", "vm1").expect("vm1");
    let _m0 = vm0.add_memory(0, 0, 2 * MIB);
    let _m1 = vm1.add_memory(0, 0, 2 * MIB);
    let first = mr(&vm0, 0, MIB).expect("within the quota");
    // One MR above max_mr_bytes.
    assert_eq!(mr(&vm1, 0, MIB + 1), Err(libc::ENOMEM));
    // 1 MiB + 256 KiB, then +512 KiB would cross 1.5 MiB over both devices.
    assert!(mr(&vm1, 0, MIB / 4).is_ok());
    assert_eq!(mr(&vm1, MIB / 4, MIB / 2), Err(libc::ENOMEM));
    assert!(mr(&vm1, MIB / 4, MIB / 4).is_ok(), "exactly the quota");
    assert_eq!(mr(&vm1, MIB / 2, 4096), Err(libc::ENOMEM));
    // Another tenant has its own quota.
    let beta = Client::hello(&hostd.socket, "beta", "vm0").expect("beta");
    let _mb = beta.add_memory(0, 0, 2 * MIB);
    assert!(mr(&beta, 0, 2 * MIB).is_ok());
    // Deregistering on one device makes room on the other.
    vm0.call(&Request::DeregisterMr { lkey: first })
        .expect("dereg");
    assert!(mr(&vm1, MIB / 2, MIB / 2).is_ok());
    // max_mr is per device: vm1 holds 3, may have one more.
    assert!(mr(&vm1, MIB + MIB / 2, 4096).is_ok());
    assert_eq!(mr(&vm1, MIB + MIB / 2 + 4096, 4096), Err(libc::ENOMEM));
    assert!(mr(&vm0, 0, 4096).is_ok());
    let alpha = tenant_stats(&hostd, "alpha");
    assert_eq!(alpha.quota_rejections["max_mr_bytes"], 1);
    assert_eq!(alpha.quota_rejections["max_total_mr_bytes"], 2);
    assert_eq!(alpha.quota_rejections["max_mr"], 1);
    assert_eq!(alpha.usage["devices"], 2);
    assert_eq!(alpha.usage["physical_queues"], 6);
    assert_eq!(alpha.usage["mrs"], 5);
    assert_eq!(alpha.usage["mr_bytes"], MIB + 8192);
    assert_eq!(alpha.quota["max_total_mr_bytes"], 1572864);
    // A departed device gives its memory back; counters stay.
    drop(vm1);
    eventually("vm1's usage is gone", || {
        tenant_stats(&hostd, "alpha").usage["mr_bytes"] == 4096
    });
    let alpha = tenant_stats(&hostd, "alpha");
    assert_eq!((alpha.usage["devices"], alpha.usage["mrs"]), (1, 1));
    assert_eq!(alpha.quota_rejections["max_total_mr_bytes"], 2);
}

/// Writes `text` as the policy file.
fn rewrite(hostd: &Hostd, text: &str) {
    std::fs::write(&hostd.policy, text).expect("rewrite policy");
}

#[test]
fn a_broken_policy_is_refused_and_the_old_one_stays() {
    let good = quota_policy(MIB);
    let hostd = Hostd::start_with("broken", &config(64), &good);
    let alpha = Client::hello(&hostd.socket, "alpha", "vm0").expect("alpha");
    // Line 9 (in alpha's table; line 1 is empty) gets an unknown key.
    let broken = good.replacen(
        "rate.read = { ops_per_sec = 100000 }",
        "rate.read = { ops_per_sec = 100000 }\nbogus_key = 1",
        1,
    );
    assert_eq!(broken.lines().position(|l| l == "bogus_key = 1"), Some(8));
    rewrite(&hostd, &broken);
    let out = hostd.vrdmactl(&["reload"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let file = hostd.policy.display().to_string();
    assert!(
        stderr.contains(&format!("{file}:9:")) && stderr.contains("bogus_key"),
        "{stderr}"
    );
    // A value out of range names its key path.
    rewrite(&hostd, &good.replace("weight = 5", "weight = 0"));
    let out = hostd.vrdmactl(&["reload"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{file}:6:")) && stderr.contains("tenant[0].priority.weight"),
        "{stderr}"
    );
    // Nothing changed: stats show the old quota and weight, nobody was told.
    let stats_text = hostd.vrdmactl_ok(&["stats", "--json"]);
    let stats: Stats = serde_json::from_str(&stats_text).expect("stats json");
    let a = stats
        .tenants
        .iter()
        .find(|t| t.tenant == "alpha")
        .expect("alpha");
    assert_eq!((a.quota["max_mr_bytes"], a.weight), (MIB, 5));
    assert!(alpha.notification(Duration::from_millis(100)).is_none());
    // A missing file is refused too.
    std::fs::remove_file(&hostd.policy).expect("rm");
    let out = hostd.vrdmactl(&["reload"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Cannot read policy file"));
    // The old policy is still enforced.
    let _mem = alpha.add_memory(0, 0, 2 * MIB);
    assert_eq!(mr(&alpha, 0, MIB + 1), Err(libc::ENOMEM));
}

/// Reloads the changed policy with `trigger`, and checks the connected
/// alpha is told, beta (unchanged) is not, and the new quota applies.
fn reload_pushes_policy(name: &str, trigger: impl Fn(&Hostd)) {
    let before = quota_policy(MIB);
    let hostd = Hostd::start_with(name, &config(64), &before);
    let mut alpha = Client::hello(&hostd.socket, "alpha", "vm0").expect("alpha");
    let beta = Client::hello(&hostd.socket, "beta", "vm0").expect("beta");
    // 4 MiB of memory and the rings, but no data region yet.
    alpha.attach_memory(4 * MIB);
    alpha.rings();
    let data = |offset| DATA + offset;
    let region =
        |c: &Client, offset, len| errno(c.register(ALL, IOVA + offset, 0, data(offset), len));
    assert_eq!(region(&alpha, 0, MIB + MIB / 4), Err(libc::ENOMEM));
    // Raise max_mr_bytes (the total still caps at 1.5 MiB).
    let raised = quota_policy(MIB + MIB / 2);
    rewrite(&hostd, &raised);
    trigger(&hostd);
    let note = alpha
        .notification(Duration::from_secs(10))
        .expect("alpha is told");
    assert_eq!(
        note,
        Notification::Policy(Box::new(tenant_policy(&raised, "alpha")))
    );
    assert!(beta.notification(Duration::from_millis(100)).is_none());
    let (lkey, rkey) =
        region(&alpha, 0, MIB + MIB / 4).expect("the raised quota applies to new MRs");
    // Lower it: the existing MR stays (and works), new ones are refused.
    rewrite(&hostd, &quota_policy(MIB / 2));
    trigger(&hostd);
    let note = alpha
        .notification(Duration::from_secs(10))
        .expect("alpha is told again");
    let Notification::Policy(p) = note else {
        panic!("expected the new policy, got {note:?}");
    };
    assert_eq!(p.quotas.max_mr_bytes, MIB / 2);
    assert_eq!(region(&alpha, 2 * MIB, MIB), Err(libc::ENOMEM));
    let qp = alpha.loopback(1, 2);
    alpha.driver().fill(0, b"still here");
    let wqe = remote(send(7, SendOpcode::RdmaWrite), IOVA + MIB, rkey);
    alpha.post_sges(qp, &wqe, &[sge(IOVA, 10, lkey)]);
    assert_eq!(alpha.poll_one(), WcStatus::Success);
    assert_eq!(alpha.driver().bytes(MIB, 10), b"still here");
}

#[test]
fn vrdmactl_reload_pushes_the_new_policy() {
    reload_pushes_policy("reload", |hostd| {
        let out = hostd.vrdmactl_ok(&["reload"]);
        assert!(
            out.contains("tenant alpha: quotas.max_mr_bytes"),
            "reload output: {out}"
        );
    });
}

#[test]
fn sighup_pushes_the_new_policy() {
    reload_pushes_policy("sighup", Hostd::hangup);
}

/// `max_devices`: the (N+1)th device connected at once is refused with
/// EDQUOT and counted; a reload that lowers it keeps the devices that are
/// connected (they keep working) and refuses new ones until the tenant is
/// under the new quota.
#[test]
fn max_devices_refuses_the_next_device_and_a_lower_quota_keeps_the_connected() {
    let policy = |max: u32| format!("{}max_devices = {max}\n", quota_policy(MIB));
    let hostd = Hostd::start_with("devices", &config(64), &policy(2));
    let mut vm0 = Client::hello(&hostd.socket, "beta", "vm0").expect("first");
    let mut vm1 = Client::hello(&hostd.socket, "beta", "vm1").expect("second");
    let third = Client::hello(&hostd.socket, "beta", "vm2").map(|_| ());
    assert_eq!(third.map_err(|e| e.0), Err(libc::EDQUOT));
    assert!(
        Client::hello(&hostd.socket, "alpha", "vm0").is_ok(),
        "alpha has its own"
    );
    let beta = tenant_stats(&hostd, "beta");
    assert_eq!(beta.quota_rejections["max_devices"], 1);
    assert_eq!((beta.usage["devices"], beta.quota["max_devices"]), (2, 2));

    rewrite(&hostd, &policy(1));
    assert!(hostd.vrdmactl_ok(&["reload"]).contains("beta"));
    // Both devices stay and work.
    for (dev, vm) in [&mut vm0, &mut vm1].into_iter().enumerate() {
        vm.setup();
        vm.loopback_works(dev as u64 + 1);
    }
    // One leaving does not bring beta under 1.
    drop(vm1);
    eventually("vm1 is gone", || {
        tenant_stats(&hostd, "beta").usage["devices"] == 1
    });
    let again = Client::hello(&hostd.socket, "beta", "vm2").map(|_| ());
    assert_eq!(again.map_err(|e| e.0), Err(libc::EDQUOT));
    drop(vm0);
    eventually("vm0 is gone", || {
        tenant_stats(&hostd, "beta").usage["devices"] == 0
    });
    assert!(
        Client::hello(&hostd.socket, "beta", "vm2").is_ok(),
        "under the quota again"
    );
    assert_eq!(
        tenant_stats(&hostd, "beta").quota_rejections["max_devices"],
        2
    );
}

#[test]
fn a_removed_tenant_keeps_its_devices_but_gets_no_new_ones() {
    let text = quota_policy(MIB);
    let hostd = Hostd::start_with("removed", &config(64), &text);
    let mut beta = Client::ready(&hostd.socket, "beta", "vm0");
    let only_alpha = text[..text.find("[[tenant]]\nname = \"beta\"").expect("beta")].to_owned();
    rewrite(&hostd, &only_alpha);
    let out = hostd.vrdmactl_ok(&["reload"]);
    assert!(out.contains("tenant beta removed"), "{out}");
    assert!(beta.notification(Duration::from_millis(100)).is_none());
    // Its device still works.
    beta.loopback_works(1);
    // A new device is refused; stats still list the tenant, marked removed.
    let refused = Client::hello(&hostd.socket, "beta", "vm1").map(|_| ());
    assert_eq!(refused.map_err(|e| e.0), Err(libc::EACCES));
    let b = tenant_stats(&hostd, "beta");
    assert!(!b.in_policy);
    assert_eq!(b.ops["write"], 1);
}

#[test]
fn metrics_show_real_counters() {
    let hostd = Hostd::start("metrics", &config(64));
    let (mut alpha, mut beta) = pair(&hostd.socket);
    let (lkey_a, lkey_b, rkey_b) = (alpha.lkey(), beta.lkey(), beta.rkey());
    // 10 writes of 64 bytes, 3 sends of 100 bytes beta receives, 2 reads
    // of 32 bytes, one atomic, then a write with a key no region has.
    alpha.write_many(0, 10, 0, 64, IOVA, rkey_b);
    for i in 0..3 {
        beta.post_recv(0, 100 + i, &[sge(IOVA, 4096, lkey_b)]);
        alpha.post_sges(
            0,
            &send(20 + i, SendOpcode::Send),
            &[sge(IOVA, 100, lkey_a)],
        );
    }
    for i in 0..2 {
        let rd = remote(send(30 + i, SendOpcode::RdmaRead), IOVA, rkey_b);
        alpha.post_sges(0, &rd, &[sge(IOVA, 32, lkey_a)]);
    }
    let faa = remote(send(40, SendOpcode::AtomicFetchAndAdd), IOVA + 8, rkey_b);
    alpha.post_sges(0, &faa, &[sge(IOVA, 8, lkey_a)]);
    let cqes = alpha.poll(16);
    assert!(
        cqes.iter().all(|c| status(c) == WcStatus::Success),
        "{cqes:?}"
    );
    beta.poll(3);
    alpha.write(0, 50, 0, 8, IOVA, 0x00ff_ff5a);
    assert_eq!(alpha.poll_one(), WcStatus::RemAccessErr);
    // vdev reports its own quota refusals; unknown quota keys are refused.
    alpha
        .call(&Request::QuotaRejected {
            quota: "max_qp".into(),
        })
        .expect("counted");
    assert_eq!(
        errno(alpha.call(&Request::QuotaRejected {
            quota: "max_bananas".into()
        })),
        Err(libc::EINVAL)
    );
    let text = hostd.vrdmactl_ok(&["metrics"]);
    for line in [
        "# HELP vrdma_tenant_ops_total Work requests completed successfully, by kind.",
        "# TYPE vrdma_tenant_ops_total counter",
        r#"vrdma_tenant_ops_total{tenant="alpha",kind="write"} 10"#,
        r#"vrdma_tenant_bytes_total{tenant="alpha",kind="write"} 640"#,
        r#"vrdma_tenant_ops_total{tenant="alpha",kind="send"} 3"#,
        r#"vrdma_tenant_bytes_total{tenant="alpha",kind="send"} 300"#,
        r#"vrdma_tenant_ops_total{tenant="alpha",kind="read"} 2"#,
        r#"vrdma_tenant_bytes_total{tenant="alpha",kind="read"} 64"#,
        r#"vrdma_tenant_ops_total{tenant="alpha",kind="atomic"} 1"#,
        r#"vrdma_tenant_ops_total{tenant="beta",kind="recv"} 3"#,
        r#"vrdma_tenant_bytes_total{tenant="beta",kind="recv"} 300"#,
        "# TYPE vrdma_tenant_errors_total counter",
        r#"vrdma_tenant_errors_total{tenant="alpha",status="rem_access_err"} 1"#,
        "# TYPE vrdma_tenant_quota_rejections_total counter",
        r#"vrdma_tenant_quota_rejections_total{tenant="alpha",quota="max_qp"} 1"#,
        "# TYPE vrdma_tenant_throttled_seconds_total counter",
        r#"vrdma_tenant_throttled_seconds_total{tenant="alpha",kind="send"} 0"#,
        "# TYPE vrdma_tenant_usage gauge",
        r#"vrdma_tenant_usage{tenant="alpha",resource="devices"} 1"#,
        r#"vrdma_tenant_usage{tenant="alpha",resource="physical_queues"} 2"#,
        &format!(r#"vrdma_tenant_usage{{tenant="alpha",resource="mr_bytes"}} {DATA_LEN}"#),
        r#"vrdma_tenant_usage{tenant="alpha",resource="mrs"} 1"#,
        r#"vrdma_tenant_usage{tenant="alpha",resource="qps"} 1"#,
        "# TYPE vrdma_tenant_quota gauge",
        r#"vrdma_tenant_quota{tenant="alpha",resource="max_total_mr_bytes"} 17179869184"#,
        r#"vrdma_tenant_quota{tenant="alpha",resource="physical_queues"} 2"#,
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    // The table for people has them too.
    let table = hostd.vrdmactl_ok(&["stats"]);
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["alpha", "write", "10", "640"]),
        "{table}"
    );
    // An unchanged file reloads with no changes.
    assert!(hostd.vrdmactl_ok(&["reload"]).contains("no changes"));
}

/// Keeps QP 1 of `client` (a loopback pair, [`loopback`]) busy with
/// 64-byte writes until `end`: its send ring full; returns the completion
/// times.
fn pump(client: &mut Client, end: Instant) -> Vec<Instant> {
    pump_sized(client, 64, end)
}

/// [`pump`] with writes of `size` bytes.
fn pump_sized(client: &mut Client, size: u32, end: Instant) -> Vec<Instant> {
    let (lkey, rkey) = (client.lkey(), client.rkey());
    let mut done = Vec::new();
    let mut token = 0u64;
    while Instant::now() < end {
        let write = |token| {
            remote(
                send(token, SendOpcode::RdmaWrite),
                IOVA + u64::from(size),
                rkey,
            )
        };
        while client.try_post_sges(0, &write(token), &[sge(IOVA, size, lkey)]) {
            token += 1;
        }
        let mut got = false;
        for cqe in client.driver_mut().poll() {
            assert_eq!(status(&cqe), WcStatus::Success);
            done.push(Instant::now());
            got = true;
        }
        if !got {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    done
}

fn loopback(hostd: &Hostd, tenant: &str) -> Client {
    loopback_sized(hostd, tenant, MEM)
}

/// A tenant's device with `mem` bytes of memory (its data region all but
/// the rings' part) and a QP pair (1 ↔ 2) connected to itself.
fn loopback_sized(hostd: &Hostd, tenant: &str, mem: u64) -> Client {
    let mut c = Client::hello(&hostd.socket, tenant, "vm0").expect("hello");
    c.setup_sized(mem);
    assert_eq!(c.loopback(1, 2), 0);
    c
}

#[test]
fn a_rate_limited_tenant_holds_its_rate_beside_an_unlimited_one() {
    const RATE: f64 = 2000.0;
    let policy = r#"
[[tenant]]
name = "slow"
network = "demo"
rate.send = { ops_per_sec = 2000 }

[[tenant]]
name = "fast"
network = "demo"
"#;
    let hostd = Hostd::start_with("rate", &config(64), policy);
    let mut slow = loopback(&hostd, "slow");
    let mut fast = loopback(&hostd, "fast");
    let start = Instant::now();
    let end = start + Duration::from_millis(3000);
    let fast_thread = std::thread::spawn(move || (pump(&mut fast, end), fast));
    let slow_done = pump(&mut slow, end);
    let (fast_done, _fast) = fast_thread.join().expect("fast");
    // Measure after the burst (a tenth of a second's worth) is spent.
    let from = start + Duration::from_millis(500);
    let window = end - from;
    let count = |done: &[Instant]| done.iter().filter(|&&t| t >= from).count() as f64;
    let slow_rate = count(&slow_done) / window.as_secs_f64();
    let fast_rate = count(&fast_done) / window.as_secs_f64();
    eprintln!("slow {slow_rate:.0}/s, fast {fast_rate:.0}/s");
    assert!(
        (slow_rate - RATE).abs() / RATE < 0.1,
        "slow ran at {slow_rate:.0}/s (fast {fast_rate:.0}/s)"
    );
    assert!(fast_rate > 2.0 * RATE, "fast ran at {fast_rate:.0}/s only");
    let s = tenant_stats(&hostd, "slow");
    assert!(
        s.throttled_seconds["send"] > 0.5,
        "{:?}",
        s.throttled_seconds
    );
    assert!(s.ops["write"] >= slow_done.len() as u64, "{:?}", s.ops);
    assert_eq!(tenant_stats(&hostd, "fast").throttled_seconds["send"], 0.0);
}

#[test]
fn weights_share_the_nic_between_backlogged_tenants() {
    let policy = r#"
[[tenant]]
name = "light"
network = "demo"
priority = { class = "normal", weight = 1 }

[[tenant]]
name = "heavy"
network = "demo"
priority = { class = "normal", weight = 3 }
"#;
    let hostd = Hostd::start_with("weights", &config(64), policy);
    // 2 MiB writes (from the first half of the data region to the second):
    // a full send ring is ~25 ms of the NIC's work, so the clients keep
    // hostd backlogged even on a loaded machine.
    let size = 2 * MIB;
    let mut light = loopback_sized(&hostd, "light", DATA + 2 * size);
    let mut heavy = loopback_sized(&hostd, "heavy", DATA + 2 * size);
    let size = size as u32;
    let start = Instant::now();
    let end = start + Duration::from_millis(2500);
    let heavy_thread = std::thread::spawn(move || (pump_sized(&mut heavy, size, end), heavy));
    let light_done = pump_sized(&mut light, size, end);
    let (heavy_done, _heavy) = heavy_thread.join().expect("heavy");
    let from = start + Duration::from_millis(500);
    let count = |done: &[Instant]| done.iter().filter(|&&t| t >= from).count() as f64;
    let (l, h) = (count(&light_done), count(&heavy_done));
    eprintln!("light {l} heavy {h} ratio {:.2}", h / l);
    // Enough writes that one more or less moves the ratio by at most 5 %
    // (the tests of this file run side by side on a small host).
    assert!(l >= 20.0, "light barely ran: {l}");
    assert!(
        (h / l - 3.0).abs() < 0.3,
        "heavy/light = {:.2} ({h}/{l})",
        h / l
    );
}
