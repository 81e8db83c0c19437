//! Per-tenant accounting: what each tenant did (operations and bytes by
//! kind, errors by completion status, quota rejections by quota) and what
//! it holds now (devices, physical queues, registered memory, MRs, QPs).
//!
//! Counters are kept per tenant name, summed over its devices, and survive
//! device reconnects for as long as hostd runs. [`Accounts`] lives inside
//! the datapath's core, under the same lock as the NIC, so a memory-quota
//! check and the registration it allows are one atomic step even when two
//! devices of a tenant register at once. [`Stats`] is the snapshot the
//! admin socket returns; [`render_prometheus`] turns it into the Prometheus
//! text exposition format.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use vrdma_spec::ring::Cqe;
use vrdma_spec::verbs::WcStatus;
use vrdma_tenant_policy::{PriorityClass, TenantPolicy};

use crate::engine::DeviceId;
use crate::ids::IdMap;

pub use crate::engine::{CompletionCounts, KINDS};

/// Usage resources, in the order of [`Usage::entries`].
pub const USAGE: [&str; 5] = ["devices", "physical_queues", "mr_bytes", "mrs", "qps"];

/// `ibv_wc_status` names, as labels: `IBV_WC_REM_ACCESS_ERR` → `rem_access_err`.
pub fn status_name(status: u8) -> &'static str {
    let Ok(status) = WcStatus::try_from(status) else {
        return "unknown";
    };
    match status {
        WcStatus::Success => "success",
        WcStatus::LocLenErr => "loc_len_err",
        WcStatus::LocQpOpErr => "loc_qp_op_err",
        WcStatus::LocEecOpErr => "loc_eec_op_err",
        WcStatus::LocProtErr => "loc_prot_err",
        WcStatus::WrFlushErr => "wr_flush_err",
        WcStatus::MwBindErr => "mw_bind_err",
        WcStatus::BadRespErr => "bad_resp_err",
        WcStatus::LocAccessErr => "loc_access_err",
        WcStatus::RemInvReqErr => "rem_inv_req_err",
        WcStatus::RemAccessErr => "rem_access_err",
        WcStatus::RemOpErr => "rem_op_err",
        WcStatus::RetryExcErr => "retry_exc_err",
        WcStatus::RnrRetryExcErr => "rnr_retry_exc_err",
        WcStatus::LocRddViolErr => "loc_rdd_viol_err",
        WcStatus::RemInvRdReqErr => "rem_inv_rd_req_err",
        WcStatus::RemAbortErr => "rem_abort_err",
        WcStatus::InvEecnErr => "inv_eecn_err",
        WcStatus::InvEecStateErr => "inv_eec_state_err",
        WcStatus::FatalErr => "fatal_err",
        WcStatus::RespTimeoutErr => "resp_timeout_err",
        WcStatus::GeneralErr => "general_err",
    }
}

/// What a tenant did since hostd started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Successful completions by [`KINDS`].
    pub ops: [u64; 5],
    /// Bytes of successful completions by [`KINDS`].
    pub bytes: [u64; 5],
    /// Error completions by status name.
    pub errors: BTreeMap<&'static str, u64>,
    /// Refusals by quota key (vdev's reports and hostd's own).
    pub quota_rejections: BTreeMap<String, u64>,
    /// UD and UC messages dropped on their way to the tenant's QPs
    /// ([`crate::engine::ud::DropCounts`]).
    pub dropped: crate::engine::ud::DropCounts,
    /// CM MADs its devices' QP1s carried.
    pub gsi: crate::engine::gsi::GsiCounts,
}

impl Counters {
    /// Counts one completion.
    pub fn completion(&mut self, cqe: &Cqe) {
        let mut counts = CompletionCounts::default();
        counts.count(cqe);
        self.add_counts(&counts);
    }

    /// Adds what a device's completions counted.
    pub fn add_counts(&mut self, counts: &CompletionCounts) {
        for k in 0..KINDS.len() {
            self.ops[k] += counts.ops[k];
            self.bytes[k] += counts.bytes[k];
        }
        for (status, &n) in (0u8..).zip(&counts.errors) {
            if n > 0 {
                *self.errors.entry(status_name(status)).or_insert(0) += n;
            }
        }
        self.dropped.add(&counts.dropped);
        self.add_gsi(&counts.gsi);
    }

    fn add_gsi(&mut self, gsi: &crate::engine::gsi::GsiCounts) {
        self.gsi.sent += gsi.sent;
        self.gsi.received += gsi.received;
        self.gsi.queue_full += gsi.queue_full;
    }

    /// Adds `other` to these counters.
    pub fn add(&mut self, other: &Counters) {
        for k in 0..KINDS.len() {
            self.ops[k] += other.ops[k];
            self.bytes[k] += other.bytes[k];
        }
        for (status, n) in &other.errors {
            *self.errors.entry(status).or_insert(0) += n;
        }
        for (quota, n) in &other.quota_rejections {
            *self.quota_rejections.entry(quota.clone()).or_insert(0) += n;
        }
        self.dropped.add(&other.dropped);
        self.add_gsi(&other.gsi);
    }
}

/// What a tenant holds now, summed over its connected devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub devices: u64,
    pub physical_queues: u64,
    pub mr_bytes: u64,
    pub mrs: u64,
    pub qps: u64,
}

impl Usage {
    /// `(resource, value)` in [`USAGE`] order.
    pub fn entries(&self) -> [(&'static str, u64); 5] {
        [
            ("devices", self.devices),
            ("physical_queues", self.physical_queues),
            ("mr_bytes", self.mr_bytes),
            ("mrs", self.mrs),
            ("qps", self.qps),
        ]
    }
}

/// Counters and usage of one tenant.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantAccount {
    pub counters: Counters,
    pub usage: Usage,
}

/// What one connected device holds.
#[derive(Debug, Clone, Default)]
struct DeviceAccount {
    tenant: String,
    /// Completions of this device not yet folded into its tenant's
    /// counters.
    counters: Counters,
    /// The device's physical queues, on the one context of it that
    /// counts the device (0 on its other contexts).
    pqps: u64,
    /// Whether this context counts the device in its tenant's usage.
    counted: bool,
    /// Registered MRs: lkey → bytes.
    mrs: HashMap<u32, u64>,
    qps: HashSet<u32>,
}

/// A memory registration hostd refuses: the quota and its numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaExceeded {
    /// The quota key (`max_mr_bytes`, `max_total_mr_bytes`, `max_mr`).
    pub quota: &'static str,
    pub limit: u64,
    /// What is in use (for `max_mr_bytes`: the requested size).
    pub used: u64,
}

/// Every tenant's account, and the devices that feed them.
#[derive(Debug, Default)]
pub struct Accounts {
    tenants: BTreeMap<String, TenantAccount>,
    devices: IdMap<DeviceId, DeviceAccount>,
}

impl Accounts {
    /// The account of `tenant`, created empty on first use.
    pub fn tenant_mut(&mut self, tenant: &str) -> &mut TenantAccount {
        self.tenants.entry(tenant.to_owned()).or_default()
    }

    /// Every tenant's account, by name, with its connected devices'
    /// counters folded in.
    pub fn snapshot(&self) -> BTreeMap<String, TenantAccount> {
        self.snapshot_with(std::iter::empty())
    }

    /// The same, with also the counters the datapath keeps for `live`
    /// devices (it counts in its own device records: no lookup per
    /// completion).
    pub fn snapshot_with<'a>(
        &self,
        live: impl IntoIterator<Item = (DeviceId, &'a CompletionCounts)>,
    ) -> BTreeMap<String, TenantAccount> {
        let mut out = self.tenants.clone();
        for dev in self.devices.values() {
            out.entry(dev.tenant.clone())
                .or_default()
                .counters
                .add(&dev.counters);
        }
        for (device, counters) in live {
            if let Some(dev) = self.devices.get(&device) {
                out.entry(dev.tenant.clone())
                    .or_default()
                    .counters
                    .add_counts(counters);
            }
        }
        out
    }

    /// A device of `tenant` with `pqps` physical queues connected.
    pub fn attach(&mut self, device: DeviceId, tenant: &str, pqps: usize) {
        let pqps = pqps as u64;
        let usage = &mut self.tenant_mut(tenant).usage;
        usage.devices += 1;
        usage.physical_queues += pqps;
        self.devices.insert(
            device,
            DeviceAccount {
                tenant: tenant.to_owned(),
                pqps,
                counted: true,
                ..DeviceAccount::default()
            },
        );
    }

    /// Another context of a device of `tenant` connected: its objects are
    /// the tenant's, the device and its queues are counted once.
    pub fn attach_context(&mut self, device: DeviceId, tenant: &str) {
        self.tenant_mut(tenant);
        self.devices.insert(
            device,
            DeviceAccount {
                tenant: tenant.to_owned(),
                ..DeviceAccount::default()
            },
        );
    }

    /// Context `from` of a device is going while `to` stays: `to` counts
    /// the device from now on.
    pub fn hand_over(&mut self, from: DeviceId, to: DeviceId) {
        let Some(dev) = self.devices.get_mut(&from) else {
            return;
        };
        let (pqps, counted) = (
            std::mem::take(&mut dev.pqps),
            std::mem::take(&mut dev.counted),
        );
        if let Some(other) = self.devices.get_mut(&to) {
            other.pqps += pqps;
            other.counted |= counted;
        }
    }

    /// The device is gone with everything it held.
    pub fn detach(&mut self, device: DeviceId) {
        let Some(dev) = self.devices.remove(&device) else {
            return;
        };
        let account = self.tenant_mut(&dev.tenant);
        account.counters.add(&dev.counters);
        let usage = &mut account.usage;
        if dev.counted {
            usage.devices = usage.devices.saturating_sub(1);
        }
        usage.physical_queues = usage.physical_queues.saturating_sub(dev.pqps);
        usage.mrs = usage.mrs.saturating_sub(dev.mrs.len() as u64);
        usage.mr_bytes = usage.mr_bytes.saturating_sub(dev.mrs.values().sum());
        usage.qps = usage.qps.saturating_sub(dev.qps.len() as u64);
    }

    /// What `tenant` holds now (nothing if hostd never accounted for it).
    pub fn usage(&self, tenant: &str) -> Usage {
        self.tenants
            .get(tenant)
            .map(|account| account.usage)
            .unwrap_or_default()
    }

    /// The tenant of a connected device.
    pub fn tenant_of(&self, device: DeviceId) -> Option<&str> {
        self.devices.get(&device).map(|d| d.tenant.as_str())
    }

    /// Whether `device` may register an MR of `len` bytes under `policy`:
    /// the MR within `max_mr_bytes`, the device within `max_mr` MRs, and
    /// the tenant's registered bytes over all its devices within
    /// `max_total_mr_bytes`.
    pub fn check_mr(
        &self,
        device: DeviceId,
        len: u64,
        policy: &TenantPolicy,
    ) -> Result<(), QuotaExceeded> {
        let quotas = &policy.quotas;
        if len > quotas.max_mr_bytes {
            return Err(QuotaExceeded {
                quota: "max_mr_bytes",
                limit: quotas.max_mr_bytes,
                used: len,
            });
        }
        let Some(dev) = self.devices.get(&device) else {
            return Ok(());
        };
        if dev.mrs.len() as u64 >= u64::from(quotas.max_mr) {
            return Err(QuotaExceeded {
                quota: "max_mr",
                limit: quotas.max_mr.into(),
                used: dev.mrs.len() as u64,
            });
        }
        let used = self
            .tenants
            .get(&dev.tenant)
            .map_or(0, |t| t.usage.mr_bytes);
        if used.saturating_add(len) > quotas.max_total_mr_bytes {
            return Err(QuotaExceeded {
                quota: "max_total_mr_bytes",
                limit: quotas.max_total_mr_bytes,
                used,
            });
        }
        Ok(())
    }

    /// An MR of `len` bytes was registered under `lkey`.
    pub fn mr_registered(&mut self, device: DeviceId, lkey: u32, len: u64) {
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let before = dev.mrs.insert(lkey, len);
        let tenant = dev.tenant.clone();
        let usage = &mut self.tenant_mut(&tenant).usage;
        if let Some(old) = before {
            usage.mr_bytes = usage.mr_bytes.saturating_sub(old);
            usage.mrs = usage.mrs.saturating_sub(1);
        }
        usage.mr_bytes += len;
        usage.mrs += 1;
    }

    /// The MR under `lkey` was deregistered.
    pub fn mr_deregistered(&mut self, device: DeviceId, lkey: u32) {
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let Some(len) = dev.mrs.remove(&lkey) else {
            return;
        };
        let tenant = dev.tenant.clone();
        let usage = &mut self.tenant_mut(&tenant).usage;
        usage.mr_bytes = usage.mr_bytes.saturating_sub(len);
        usage.mrs = usage.mrs.saturating_sub(1);
    }

    /// A QP was created (`true`) or destroyed (`false`).
    pub fn qp(&mut self, device: DeviceId, vqpn: u32, exists: bool) {
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let changed = if exists {
            dev.qps.insert(vqpn)
        } else {
            dev.qps.remove(&vqpn)
        };
        if !changed {
            return;
        }
        let tenant = dev.tenant.clone();
        let usage = &mut self.tenant_mut(&tenant).usage;
        if exists {
            usage.qps += 1;
        } else {
            usage.qps = usage.qps.saturating_sub(1);
        }
    }

    /// A completion the datapath produced for `device` (written to the
    /// guest or not: unsignaled work counts too).
    pub fn completion(&mut self, device: DeviceId, cqe: &Cqe) {
        if let Some(dev) = self.devices.get_mut(&device) {
            dev.counters.completion(cqe);
        }
    }

    /// Folds the counters the datapath kept for `device` into its
    /// account (when it goes).
    pub fn add_device_counters(&mut self, device: DeviceId, counters: &CompletionCounts) {
        if let Some(dev) = self.devices.get_mut(&device) {
            dev.counters.add_counts(counters);
        }
    }

    /// A verb of `tenant` was refused for `quota`.
    pub fn quota_rejected(&mut self, tenant: &str, quota: &str) {
        *self
            .tenant_mut(tenant)
            .counters
            .quota_rejections
            .entry(quota.to_owned())
            .or_insert(0) += 1;
    }
}

/// The admin socket's `Stats` answer: every tenant of the policy in force
/// and every tenant that was ever active, by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stats {
    pub tenants: Vec<TenantStats>,
    /// The RoCEv2 transport's counters per peer host (none without a
    /// fabric); the first entry counts what no known host sent.
    #[serde(default)]
    pub peers: Vec<crate::engine::wire::PeerStats>,
    /// The packet queues' counters (none without a fabric).
    #[serde(default)]
    pub packet_io: Option<crate::net::io::IoCounters>,
}

/// One tenant's counters, usage and quotas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantStats {
    pub tenant: String,
    /// Whether the policy in force names it (a removed tenant's devices
    /// keep running on its last policy).
    pub in_policy: bool,
    pub class: PriorityClass,
    pub weight: u32,
    /// Successful work requests by kind (send, write, read, atomic, recv).
    pub ops: BTreeMap<String, u64>,
    /// Bytes of successful work requests by kind.
    pub bytes: BTreeMap<String, u64>,
    /// Error completions by status (`rem_access_err`, ...).
    pub errors: BTreeMap<String, u64>,
    /// Refused verbs by quota key.
    pub quota_rejections: BTreeMap<String, u64>,
    /// UD and UC messages dropped on their way to its QPs, by reason
    /// (`qkey`, `no_receive`, `no_qp`, `invalid`).
    pub dropped: BTreeMap<String, u64>,
    /// Connection-manager MADs its devices' QP1s carried: `sent`,
    /// `received`, `queue_full` (arrived while 256 waited: dropped).
    #[serde(default)]
    pub gsi: BTreeMap<String, u64>,
    /// Seconds its work waited for rate-limit tokens, by kind (send, read).
    pub throttled_seconds: BTreeMap<String, f64>,
    /// What it holds now over all its devices ([`USAGE`]).
    pub usage: BTreeMap<String, u64>,
    /// Its quotas: `max_devices` and `max_total_mr_bytes` (over all its
    /// devices, enforced by hostd), `max_mr_bytes` (one MR), and per device
    /// `max_mr`, `max_qp` and `physical_queues`.
    pub quota: BTreeMap<String, u64>,
}

impl TenantStats {
    /// The stats of one tenant from its account, policy and throttled time.
    pub fn new(
        account: &TenantAccount,
        policy: &TenantPolicy,
        in_policy: bool,
        throttled: [std::time::Duration; 2],
    ) -> Self {
        let c = &account.counters;
        let by_kind = |values: &[u64; 5]| -> BTreeMap<String, u64> {
            KINDS
                .iter()
                .zip(values)
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect()
        };
        let q = &policy.quotas;
        TenantStats {
            tenant: policy.name.clone(),
            in_policy,
            class: policy.priority.class,
            weight: policy.priority.weight,
            ops: by_kind(&c.ops),
            bytes: by_kind(&c.bytes),
            errors: c
                .errors
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect(),
            quota_rejections: c.quota_rejections.clone(),
            dropped: c.dropped.by_reason(),
            gsi: [
                ("sent", c.gsi.sent),
                ("received", c.gsi.received),
                ("queue_full", c.gsi.queue_full),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
            throttled_seconds: [("send", throttled[0]), ("read", throttled[1])]
                .into_iter()
                .map(|(k, d)| (k.to_owned(), d.as_secs_f64()))
                .collect(),
            usage: account
                .usage
                .entries()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            quota: [
                ("max_total_mr_bytes", q.max_total_mr_bytes),
                ("max_mr_bytes", q.max_mr_bytes),
                ("max_mr", q.max_mr.into()),
                ("max_qp", q.max_qp.into()),
                ("physical_queues", policy.physical_queues.into()),
                ("max_devices", policy.max_devices.into()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        }
    }
}

/// A label value, escaped for the exposition format.
fn label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// One metric family: HELP, TYPE and a sample per (tenant, label value).
fn family<V: std::fmt::Display>(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    label_name: &str,
    samples: impl Iterator<Item = (String, String, V)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (tenant, value_label, value) in samples {
        let _ = writeln!(
            out,
            "{name}{{tenant=\"{}\",{label_name}=\"{}\"}} {value}",
            label(&tenant),
            label(&value_label)
        );
    }
}

/// The stats in the Prometheus text exposition format (version 0.0.4).
pub fn render_prometheus(stats: &Stats) -> String {
    let mut out = String::new();
    let each = |pick: fn(&TenantStats) -> &BTreeMap<String, u64>| {
        stats.tenants.iter().flat_map(move |t| {
            pick(t)
                .iter()
                .map(move |(k, v)| (t.tenant.clone(), k.clone(), *v))
        })
    };
    family(
        &mut out,
        "vrdma_tenant_ops_total",
        "counter",
        "Work requests completed successfully, by kind.",
        "kind",
        each(|t| &t.ops),
    );
    family(
        &mut out,
        "vrdma_tenant_bytes_total",
        "counter",
        "Bytes of work requests completed successfully, by kind.",
        "kind",
        each(|t| &t.bytes),
    );
    family(
        &mut out,
        "vrdma_tenant_errors_total",
        "counter",
        "Work completions with an error status, by status.",
        "status",
        each(|t| &t.errors),
    );
    family(
        &mut out,
        "vrdma_tenant_quota_rejections_total",
        "counter",
        "Verbs refused because of a quota, by quota key.",
        "quota",
        each(|t| &t.quota_rejections),
    );
    family(
        &mut out,
        "vrdma_tenant_dropped_total",
        "counter",
        "UD and UC messages dropped on their way to the tenant's QPs, by reason.",
        "reason",
        each(|t| &t.dropped),
    );
    family(
        &mut out,
        "vrdma_tenant_gsi_mads_total",
        "counter",
        "Connection-manager MADs the tenant's QP1s carried (sent, received, queue_full).",
        "what",
        each(|t| &t.gsi),
    );
    family(
        &mut out,
        "vrdma_tenant_throttled_seconds_total",
        "counter",
        "Seconds the tenant's work waited for rate-limit tokens, by kind.",
        "kind",
        stats.tenants.iter().flat_map(|t| {
            t.throttled_seconds
                .iter()
                .map(move |(k, v)| (t.tenant.clone(), k.clone(), *v))
        }),
    );
    family(
        &mut out,
        "vrdma_tenant_usage",
        "gauge",
        "Resources the tenant holds now, summed over its devices.",
        "resource",
        each(|t| &t.usage),
    );
    family(
        &mut out,
        "vrdma_tenant_quota",
        "gauge",
        "The tenant's quotas (max_devices and max_total_mr_bytes over all its devices; max_mr, max_qp, physical_queues per device; max_mr_bytes per MR).",
        "resource",
        each(|t| &t.quota),
    );
    render_peers(&mut out, &stats.peers);
    if let Some(io) = &stats.packet_io {
        // `queues`: the packet queues' kind (the kernel's UDP stack).
        for (name, v) in io.named() {
            let _ = writeln!(
                out,
                "# HELP vrdma_packet_io_{name}_total The packet queues' {name} (docs/operations.md)."
            );
            let _ = writeln!(out, "# TYPE vrdma_packet_io_{name}_total counter");
            let _ = writeln!(out, "vrdma_packet_io_{name}_total{{queues=\"udp\"}} {v}");
        }
    }
    out
}

/// The per peer host families: `vrdma_peer_*{host="..."}`.
fn render_peers(out: &mut String, peers: &[crate::engine::wire::PeerStats]) {
    use crate::engine::wire::PeerStats;
    if peers.is_empty() {
        return;
    }
    let host = |p: &PeerStats| {
        label(if p.host.is_empty() {
            "(unknown)"
        } else {
            &p.host
        })
    };
    type Scalar = (
        &'static str,
        &'static str,
        &'static str,
        fn(&PeerStats) -> u64,
    );
    type Counters = fn(&PeerStats) -> &BTreeMap<String, u64>;
    let scalars: [Scalar; 8] = [
        (
            "vrdma_peer_tx_packets_total",
            "counter",
            "RoCEv2 packets sent to the host.",
            |p| p.tx_packets,
        ),
        (
            "vrdma_peer_tx_bytes_total",
            "counter",
            "Bytes (UDP payload) sent to the host.",
            |p| p.tx_bytes,
        ),
        (
            "vrdma_peer_rx_packets_total",
            "counter",
            "RoCEv2 packets received from the host.",
            |p| p.rx_packets,
        ),
        (
            "vrdma_peer_rx_bytes_total",
            "counter",
            "Bytes received from the host.",
            |p| p.rx_bytes,
        ),
        (
            "vrdma_peer_retransmissions_total",
            "counter",
            "Go-back-N retransmissions towards the host.",
            |p| p.retransmissions,
        ),
        (
            "vrdma_peer_timeouts_total",
            "counter",
            "ACK timeouts that expired towards the host.",
            |p| p.timeouts,
        ),
        (
            "vrdma_peer_duplicates_total",
            "counter",
            "Duplicate requests from the host answered again.",
            |p| p.duplicates,
        ),
        (
            "vrdma_peer_rtt_seconds",
            "gauge",
            "Smoothed round-trip time to the host.",
            |p| p.rtt_ns,
        ),
    ];
    for (name, kind, help, pick) in scalars {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for p in peers {
            let v = pick(p);
            if name == "vrdma_peer_rtt_seconds" {
                let _ = writeln!(out, "{name}{{host=\"{}\"}} {}", host(p), v as f64 / 1e9);
            } else {
                let _ = writeln!(out, "{name}{{host=\"{}\"}} {v}", host(p));
            }
        }
    }
    let maps: [(&str, &str, &str, Counters); 3] = [
        (
            "vrdma_peer_naks_sent_total",
            "kind",
            "NAKs sent to the host, by kind.",
            |p| &p.naks_sent,
        ),
        (
            "vrdma_peer_naks_received_total",
            "kind",
            "NAKs received from the host, by kind.",
            |p| &p.naks_received,
        ),
        (
            "vrdma_peer_drops_total",
            "reason",
            "Packets from the host dropped, by reason.",
            |p| &p.drops,
        ),
    ];
    for (name, label_name, help, pick) in maps {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        for p in peers {
            for (k, v) in pick(p) {
                let _ = writeln!(
                    out,
                    "{name}{{host=\"{}\",{label_name}=\"{}\"}} {v}",
                    host(p),
                    label(k)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use vrdma_spec::verbs::WcOpcode;
    use vrdma_tenant_policy::Policy;

    fn cqe(status: WcStatus, opcode: WcOpcode, byte_len: u32) -> Cqe {
        Cqe {
            status: status.into(),
            opcode: opcode.into(),
            byte_len: byte_len.into(),
            ..Cqe::default()
        }
    }

    fn alpha() -> TenantPolicy {
        let mut p = Policy::default_policy().tenants[0].clone();
        p.quotas.max_mr_bytes = 1000;
        p.quotas.max_total_mr_bytes = 1500;
        p.quotas.max_mr = 3;
        p
    }

    #[test]
    fn completions_count_by_kind_and_status() {
        let mut acc = Accounts::default();
        acc.attach(1, "alpha", 2);
        for (status, opcode, len) in [
            (WcStatus::Success, WcOpcode::Send, 10),
            (WcStatus::Success, WcOpcode::RdmaWrite, 100),
            (WcStatus::Success, WcOpcode::RdmaWrite, 50),
            (WcStatus::Success, WcOpcode::RdmaRead, 7),
            (WcStatus::Success, WcOpcode::FetchAdd, 8),
            (WcStatus::Success, WcOpcode::CompSwap, 8),
            (WcStatus::Success, WcOpcode::Recv, 10),
            (WcStatus::Success, WcOpcode::RecvRdmaWithImm, 3),
            (WcStatus::RemAccessErr, WcOpcode::RdmaWrite, 0),
            (WcStatus::WrFlushErr, WcOpcode::Send, 0),
            (WcStatus::WrFlushErr, WcOpcode::Recv, 0),
        ] {
            acc.completion(1, &cqe(status, opcode, len));
        }
        acc.completion(99, &cqe(WcStatus::Success, WcOpcode::Send, 1));
        let c = &acc.snapshot()["alpha"].counters;
        assert_eq!(c.ops, [1, 2, 1, 2, 2]);
        assert_eq!(c.bytes, [10, 150, 7, 16, 13]);
        assert_eq!(
            c.errors.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            vec![("rem_access_err", 1), ("wr_flush_err", 2)]
        );
    }

    #[test]
    fn memory_quota_spans_the_tenants_devices() {
        let policy = alpha();
        let mut acc = Accounts::default();
        acc.attach(1, "alpha", 2);
        acc.attach(2, "alpha", 2);
        assert_eq!(
            acc.check_mr(1, 1001, &policy).map_err(|e| e.quota),
            Err("max_mr_bytes")
        );
        acc.check_mr(1, 1000, &policy).expect("fits");
        acc.mr_registered(1, 0x10, 1000);
        acc.check_mr(2, 500, &policy).expect("exactly the total");
        let err = acc.check_mr(2, 501, &policy).expect_err("crosses");
        assert_eq!(
            err,
            QuotaExceeded {
                quota: "max_total_mr_bytes",
                limit: 1500,
                used: 1000
            }
        );
        acc.mr_registered(2, 0x20, 100);
        acc.mr_registered(2, 0x21, 100);
        acc.mr_registered(2, 0x22, 100);
        assert_eq!(
            acc.check_mr(2, 1, &policy).map_err(|e| e.quota),
            Err("max_mr"),
            "max_mr is per device"
        );
        acc.check_mr(1, 100, &policy).expect("device 1 has one MR");
        acc.mr_deregistered(1, 0x10);
        acc.mr_deregistered(1, 0x10);
        assert_eq!(acc.snapshot()["alpha"].usage.mr_bytes, 300);
        acc.qp(2, 5, true);
        acc.qp(2, 5, true);
        acc.qp(2, 6, true);
        acc.qp(2, 6, false);
        let usage = acc.snapshot()["alpha"].usage;
        assert_eq!(
            usage,
            Usage {
                devices: 2,
                physical_queues: 4,
                mr_bytes: 300,
                mrs: 3,
                qps: 1
            }
        );
        acc.detach(2);
        acc.detach(2);
        assert_eq!(
            acc.snapshot()["alpha"].usage,
            Usage {
                devices: 1,
                physical_queues: 2,
                ..Usage::default()
            }
        );
    }

    #[test]
    fn counters_survive_reconnects() {
        let mut acc = Accounts::default();
        acc.attach(1, "alpha", 2);
        acc.completion(1, &cqe(WcStatus::Success, WcOpcode::Send, 5));
        acc.quota_rejected("alpha", "max_qp");
        acc.detach(1);
        acc.attach(2, "alpha", 2);
        acc.completion(2, &cqe(WcStatus::Success, WcOpcode::Send, 5));
        let c = &acc.snapshot()["alpha"].counters;
        assert_eq!((c.ops[0], c.bytes[0]), (2, 10));
        assert_eq!(c.quota_rejections["max_qp"], 1);
    }

    #[test]
    fn prometheus_text_has_every_family_and_real_values() {
        let mut acc = Accounts::default();
        acc.attach(1, "alpha", 2);
        acc.mr_registered(1, 1, 4096);
        acc.completion(1, &cqe(WcStatus::Success, WcOpcode::RdmaWrite, 64));
        acc.completion(1, &cqe(WcStatus::RemAccessErr, WcOpcode::RdmaWrite, 0));
        acc.quota_rejected("alpha", "max_total_mr_bytes");
        let mut policy = alpha();
        policy.name = "al\"pha".into();
        let stats = Stats {
            tenants: vec![TenantStats::new(
                &acc.snapshot()["alpha"],
                &policy,
                true,
                [Duration::from_millis(1500), Duration::ZERO],
            )],
            peers: Vec::new(),
            packet_io: Some(crate::net::io::IoCounters {
                received_gso_messages: 7,
                ..Default::default()
            }),
        };
        let text = render_prometheus(&stats);
        for line in [
            "# HELP vrdma_tenant_ops_total Work requests completed successfully, by kind.",
            "# TYPE vrdma_tenant_ops_total counter",
            r#"vrdma_tenant_ops_total{tenant="al\"pha",kind="write"} 1"#,
            r#"vrdma_tenant_ops_total{tenant="al\"pha",kind="send"} 0"#,
            r#"vrdma_tenant_bytes_total{tenant="al\"pha",kind="write"} 64"#,
            "# TYPE vrdma_tenant_errors_total counter",
            r#"vrdma_tenant_errors_total{tenant="al\"pha",status="rem_access_err"} 1"#,
            r#"vrdma_tenant_quota_rejections_total{tenant="al\"pha",quota="max_total_mr_bytes"} 1"#,
            r#"vrdma_tenant_throttled_seconds_total{tenant="al\"pha",kind="send"} 1.5"#,
            r#"vrdma_tenant_throttled_seconds_total{tenant="al\"pha",kind="read"} 0"#,
            "# TYPE vrdma_tenant_usage gauge",
            r#"vrdma_tenant_usage{tenant="al\"pha",resource="mr_bytes"} 4096"#,
            r#"vrdma_tenant_usage{tenant="al\"pha",resource="devices"} 1"#,
            "# TYPE vrdma_tenant_quota gauge",
            r#"vrdma_tenant_quota{tenant="al\"pha",resource="max_total_mr_bytes"} 1500"#,
            r#"vrdma_tenant_quota{tenant="al\"pha",resource="physical_queues"} 2"#,
            "# TYPE vrdma_packet_io_received_gso_messages_total counter",
            r#"vrdma_packet_io_received_gso_messages_total{queues="udp"} 7"#,
            r#"vrdma_packet_io_sent_packets_total{queues="udp"} 0"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // Every sample line is `name{labels} value`, every family typed.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, rest) = l.split_once('{').expect("labels");
            assert!(text.contains(&format!("# TYPE {name} ")), "{name}");
            let value = rest.rsplit_once("} ").expect("value").1;
            value.parse::<f64>().expect("numeric value");
        }
        // Stats survive JSON (the admin socket).
        let json = serde_json::to_string(&stats).expect("encode");
        assert_eq!(serde_json::from_str::<Stats>(&json).expect("decode"), stats);
    }
}
