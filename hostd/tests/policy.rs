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
use vrdma_hostd_protocol::entries::PhysCqe;
use vrdma_hostd_protocol::messages::{Notification, Request};
use vrdma_hostd_protocol::shm::{Ring, SharedMapping};
use vrdma_spec::verbs::{SendOpcode, WcStatus};
use vrdma_tenant_policy::{Policy, TenantPolicy};

const MIB: u64 = 1 << 20;
const IOVA: u64 = 0x10_0000;

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

fn errno(r: Result<(), (i32, String)>) -> Result<(), i32> {
    r.map_err(|e| e.0)
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

/// Retries `f` until it holds (teardown and reload are asynchronous).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn welcome_carries_the_tenants_policy() {
    let text = quota_policy(MIB);
    let hostd = Hostd::start_with("welcome", &config(64), &text);
    let alpha = Client::hello(&hostd.socket, "alpha", "vm0").expect("alpha");
    assert_eq!(alpha.policy, tenant_policy(&text, "alpha"));
    assert_eq!(alpha.grants.len(), 3, "physical_queues of the policy");
    let beta = Client::hello(&hostd.socket, "beta", "vm0").expect("beta");
    assert_eq!(beta.policy, tenant_policy(&text, "beta"));
    assert_eq!(beta.grants.len(), 2, "the default");
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
    let _m0 = vm0.add_memory(0, 2 * MIB);
    let _m1 = vm1.add_memory(0, 2 * MIB);
    let reg = |c: &Client, key: u32, offset: u64, len: u64| {
        errno(c.register(key, key + 1, ALL_ACCESS, IOVA + offset, 0, offset, len))
    };
    assert_eq!(reg(&vm0, 0x100, 0, MIB), Ok(()));
    // One MR above max_mr_bytes.
    assert_eq!(reg(&vm1, 0x200, 0, MIB + 1), Err(libc::ENOMEM));
    // 1 MiB + 256 KiB, then +512 KiB would cross 1.5 MiB over both devices.
    assert_eq!(reg(&vm1, 0x210, 0, MIB / 4), Ok(()));
    assert_eq!(reg(&vm1, 0x220, MIB / 4, MIB / 2), Err(libc::ENOMEM));
    assert_eq!(
        reg(&vm1, 0x230, MIB / 4, MIB / 4),
        Ok(()),
        "exactly the quota"
    );
    assert_eq!(reg(&vm1, 0x240, MIB / 2, 4096), Err(libc::ENOMEM));
    // Another tenant has its own quota.
    let beta = Client::hello(&hostd.socket, "beta", "vm0").expect("beta");
    let _mb = beta.add_memory(0, 2 * MIB);
    assert_eq!(reg(&beta, 0x300, 0, 2 * MIB), Ok(()));
    // Deregistering on one device makes room on the other.
    vm0.call(&Request::DeregisterMr { lkey: 0x100 })
        .expect("dereg");
    assert_eq!(reg(&vm1, 0x220, MIB / 2, MIB / 2), Ok(()));
    // max_mr is per device: vm1 holds 3, may have one more.
    assert_eq!(reg(&vm1, 0x250, MIB + MIB / 2, 4096), Ok(()));
    assert_eq!(
        reg(&vm1, 0x260, MIB + MIB / 2 + 4096, 4096),
        Err(libc::ENOMEM)
    );
    assert_eq!(reg(&vm0, 0x270, 0, 4096), Ok(()));
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
    let _mem = alpha.add_memory(0, 2 * MIB);
    assert_eq!(
        errno(alpha.register(1, 2, ALL_ACCESS, IOVA, 0, 0, MIB + 1)),
        Err(libc::ENOMEM)
    );
}

/// Reloads the changed policy with `trigger`, and checks the connected
/// alpha is told, beta (unchanged) is not, and the new quota applies.
fn reload_pushes_policy(name: &str, trigger: impl Fn(&Hostd)) {
    let before = quota_policy(MIB);
    let hostd = Hostd::start_with(name, &config(64), &before);
    let alpha = Client::hello(&hostd.socket, "alpha", "vm0").expect("alpha");
    let beta = Client::hello(&hostd.socket, "beta", "vm0").expect("beta");
    let mem = alpha.add_memory(0, 4 * MIB);
    assert_eq!(
        errno(alpha.register(1, 2, ALL_ACCESS, IOVA, 0, 0, MIB + MIB / 4)),
        Err(libc::ENOMEM)
    );
    // Raise max_mr_bytes (the total still caps at 1.5 MiB).
    let raised = quota_policy(MIB + MIB / 2);
    rewrite(&hostd, &raised);
    trigger(&hostd);
    let note = alpha
        .notification(Duration::from_secs(10))
        .expect("alpha is told");
    assert_eq!(note, Notification::Policy(tenant_policy(&raised, "alpha")));
    assert!(beta.notification(Duration::from_millis(100)).is_none());
    assert_eq!(
        errno(alpha.register(1, 2, ALL_ACCESS, IOVA, 0, 0, MIB + MIB / 4)),
        Ok(()),
        "the raised quota applies to new MRs"
    );
    // Lower it: the existing MR stays (and works), new ones are refused.
    rewrite(&hostd, &quota_policy(MIB / 2));
    trigger(&hostd);
    let note = alpha
        .notification(Duration::from_secs(10))
        .expect("alpha is told again");
    let Notification::Policy(p) = note;
    assert_eq!(p.quotas.max_mr_bytes, MIB / 2);
    assert_eq!(
        errno(alpha.register(3, 4, ALL_ACCESS, IOVA + 2 * MIB, 0, 2 * MIB, MIB)),
        Err(libc::ENOMEM)
    );
    alpha.create_qp(1, 0);
    alpha.create_qp(2, 0);
    alpha.connect_qp(1, alpha.lid, 2).expect("connect");
    alpha.connect_qp(2, alpha.lid, 1).expect("connect");
    assert!(mem.write(0, b"still here"));
    alpha.post(0, &write_wqe(7, 1, sge(IOVA, 10, 1), IOVA + MIB, 2));
    assert_eq!(alpha.poll(0, 1)[0].status, u8::from(WcStatus::Success));
    assert_eq!(read(&mem, MIB as usize, 10), b"still here");
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
    let vm0 = Client::hello(&hostd.socket, "beta", "vm0").expect("first");
    let vm1 = Client::hello(&hostd.socket, "beta", "vm1").expect("second");
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
    for (dev, vm) in [&vm0, &vm1].into_iter().enumerate() {
        // Keys are unique on the host: 0x10/0x11 for vm0, 0x20/0x21 for vm1.
        let (lkey, rkey) = (0x10 * (dev as u32 + 1), 0x10 * (dev as u32 + 1) + 1);
        let mem = vm.add_memory(0, MIB);
        vm.register(lkey, rkey, ALL_ACCESS, IOVA, 0, 0, MIB)
            .expect("mr");
        vm.create_qp(1, 0);
        vm.create_qp(2, 0);
        vm.connect_qp(1, vm.lid, 2).expect("connect");
        vm.connect_qp(2, vm.lid, 1).expect("connect");
        assert!(mem.write(0, &[dev as u8; 4]));
        vm.post(0, &write_wqe(1, 1, sge(IOVA, 4, lkey), IOVA + 64, rkey));
        assert_eq!(vm.poll(0, 1)[0].status, u8::from(WcStatus::Success));
        let mut landed = [0u8; 4];
        assert!(mem.read(64, &mut landed));
        assert_eq!(landed, [dev as u8; 4]);
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
    let beta = Client::hello(&hostd.socket, "beta", "vm0").expect("beta");
    let mem = beta.add_memory(0, MIB);
    beta.register(1, 2, ALL_ACCESS, IOVA, 0, 0, MIB)
        .expect("mr");
    let only_alpha = text[..text.find("[[tenant]]\nname = \"beta\"").expect("beta")].to_owned();
    rewrite(&hostd, &only_alpha);
    let out = hostd.vrdmactl_ok(&["reload"]);
    assert!(out.contains("tenant beta removed"), "{out}");
    assert!(beta.notification(Duration::from_millis(100)).is_none());
    // Its device still works.
    beta.create_qp(1, 0);
    beta.create_qp(2, 0);
    beta.connect_qp(1, beta.lid, 2).expect("connect");
    beta.connect_qp(2, beta.lid, 1).expect("connect");
    assert!(mem.write(0, b"kept"));
    beta.post(0, &write_wqe(1, 1, sge(IOVA, 4, 1), IOVA + 64, 2));
    assert_eq!(beta.poll(0, 1)[0].status, u8::from(WcStatus::Success));
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
    let alpha = Client::hello(&hostd.socket, "alpha", "vm0").expect("alpha");
    let beta = Client::hello(&hostd.socket, "beta", "vm0").expect("beta");
    let _mem_a = alpha.add_memory(0, MIB);
    let _mem_b = beta.add_memory(0, MIB);
    alpha
        .register(0xa1, 0xa2, ALL_ACCESS, IOVA, 0, 0, MIB)
        .expect("mr");
    beta.register(0xb1, 0xb2, ALL_ACCESS, IOVA, 0, 0, MIB)
        .expect("mr");
    alpha.create_qp(1, 0);
    beta.create_qp(2, 0);
    alpha.connect_qp(1, beta.lid, 2).expect("connect");
    beta.connect_qp(2, alpha.lid, 1).expect("connect");
    // 10 writes of 64 bytes, 3 sends of 100 bytes beta receives, 2 reads
    // of 32 bytes, one atomic, then a write with a bad rkey.
    for i in 0..10 {
        alpha.post(0, &write_wqe(i, 1, sge(IOVA, 64, 0xa1), IOVA, 0xb2));
    }
    for i in 0..3 {
        beta.post(0, &recv_wqe(100 + i, 2, &[sge(IOVA, 4096, 0xb1)]));
        alpha.post(
            0,
            &send_wqe(20 + i, 1, SendOpcode::Send, &[sge(IOVA, 100, 0xa1)]),
        );
    }
    for i in 0..2 {
        let mut rd = send_wqe(30 + i, 1, SendOpcode::RdmaRead, &[sge(IOVA, 32, 0xa1)]);
        rd.remote_addr = IOVA.into();
        rd.rkey = 0xb2.into();
        alpha.post(0, &rd);
    }
    let mut faa = send_wqe(40, 1, SendOpcode::AtomicFetchAndAdd, &[sge(IOVA, 8, 0xa1)]);
    faa.remote_addr = (IOVA + 8).into();
    faa.rkey = 0xb2.into();
    alpha.post(0, &faa);
    let cqes = alpha.poll(0, 16);
    assert!(cqes.iter().all(|c| c.status == u8::from(WcStatus::Success)));
    beta.poll(0, 3);
    alpha.post(0, &write_wqe(50, 1, sge(IOVA, 8, 0xa1), IOVA, 0xdead));
    assert_eq!(alpha.poll(0, 1)[0].status, u8::from(WcStatus::RemAccessErr));
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
        r#"vrdma_tenant_usage{tenant="alpha",resource="mr_bytes"} 1048576"#,
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

/// Keeps queue 0 of `client` full of 64-byte loopback writes (QP 1 → 2,
/// keys `key` and `key + 1`) until `end`; returns the completion times.
fn pump(client: &Client, key: u32, end: Instant) -> Vec<Instant> {
    pump_sized(client, key, 64, end)
}

/// [`pump`] with writes of `size` bytes.
fn pump_sized(client: &Client, key: u32, size: u32, end: Instant) -> Vec<Instant> {
    let cq: Ring<'_, PhysCqe> = Ring::new(&client.queues[0], client.layout.cq).expect("cq");
    let mut done = Vec::new();
    let mut token = 0u64;
    while Instant::now() < end {
        while client.try_post(
            0,
            &write_wqe(
                token,
                1,
                sge(IOVA, size, key),
                IOVA + u64::from(size),
                key + 1,
            ),
        ) {
            token += 1;
        }
        let mut got = false;
        while let Some(cqe) = cq.pop().expect("cq") {
            assert_eq!(cqe.status, u8::from(WcStatus::Success));
            done.push(Instant::now());
            got = true;
        }
        if !got {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    done
}

fn loopback(hostd: &Hostd, tenant: &str, key: u32) -> (Client, SharedMapping) {
    loopback_sized(hostd, tenant, key, MIB)
}

/// A tenant's device with `size` bytes of memory registered under `key`
/// and a QP pair (1 ↔ 2) connected to itself.
fn loopback_sized(hostd: &Hostd, tenant: &str, key: u32, size: u64) -> (Client, SharedMapping) {
    let c = Client::hello(&hostd.socket, tenant, "vm0").expect("hello");
    let mem = c.add_memory(0, size);
    c.register(key, key + 1, ALL_ACCESS, IOVA, 0, 0, size)
        .expect("mr");
    c.create_qp(1, 0);
    c.create_qp(2, 0);
    c.connect_qp(1, c.lid, 2).expect("connect");
    c.connect_qp(2, c.lid, 1).expect("connect");
    (c, mem)
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
    let (slow, _slow_mem) = loopback(&hostd, "slow", 0x10);
    let (fast, _fast_mem) = loopback(&hostd, "fast", 0x20);
    let start = Instant::now();
    let end = start + Duration::from_millis(3000);
    let fast_thread = std::thread::spawn(move || (pump(&fast, 0x20, end), fast));
    let slow_done = pump(&slow, 0x10, end);
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
    // 1 MiB writes: a full submission ring is ~10 ms of the NIC's work, so
    // the clients keep hostd backlogged even on a loaded machine.
    let (light, _light_mem) = loopback_sized(&hostd, "light", 0x10, 4 * MIB);
    let (heavy, _heavy_mem) = loopback_sized(&hostd, "heavy", 0x20, 4 * MIB);
    let size = MIB as u32;
    let start = Instant::now();
    let end = start + Duration::from_millis(2500);
    let heavy_thread = std::thread::spawn(move || (pump_sized(&heavy, 0x20, size, end), heavy));
    let light_done = pump_sized(&light, 0x10, size, end);
    let (heavy_done, _heavy) = heavy_thread.join().expect("heavy");
    let from = start + Duration::from_millis(500);
    let count = |done: &[Instant]| done.iter().filter(|&&t| t >= from).count() as f64;
    let (l, h) = (count(&light_done), count(&heavy_done));
    eprintln!("light {l} heavy {h} ratio {:.2}", h / l);
    assert!(l > 50.0, "light barely ran: {l}");
    assert!(
        (h / l - 3.0).abs() < 0.3,
        "heavy/light = {:.2} ({h}/{l})",
        h / l
    );
}
