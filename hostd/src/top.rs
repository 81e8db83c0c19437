//! `vrdmactl top`: what the host is doing now, from two samples of
//! hostd's stats taken an interval apart — per tenant its class, what it
//! holds, and its rates of work, bytes, errors and drops; per peer host the
//! RoCEv2 transport's packet, byte, retransmission and drop rates.
//!
//! Counters only grow while hostd runs; one that went down (hostd
//! restarted between the samples) gives a rate of 0, not a negative or a
//! huge one, and a tenant or peer that was not in the first sample shows
//! no rates yet.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::engine::wire::PeerStats;
use crate::stats::{Stats, TenantStats};

/// One screen of `top`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Frame {
    /// Seconds between the two samples the rates are over.
    pub interval_s: f64,
    pub tenants: Vec<TenantRates>,
    pub peers: Vec<PeerRates>,
}

/// One tenant: what it holds now and its rates over the interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantRates {
    pub tenant: String,
    /// Its priority class and weight (`realtime`, `priority`, `normal`).
    pub class: String,
    pub weight: u32,
    pub devices: u64,
    pub qps: u64,
    pub mrs: u64,
    pub mr_bytes: u64,
    /// Successful work requests per second, all kinds, and by kind.
    pub ops_per_s: f64,
    pub ops_per_s_by_kind: BTreeMap<String, f64>,
    pub bytes_per_s: f64,
    /// Completions in error, refused verbs and dropped UD/UC messages per
    /// second.
    pub errors_per_s: f64,
    pub quota_rejections_per_s: f64,
    pub dropped_per_s: f64,
    /// Share of the interval its work waited for rate-limit tokens.
    pub throttled_share: f64,
}

/// One peer host's transport rates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerRates {
    pub host: String,
    pub tx_packets_per_s: f64,
    pub tx_bytes_per_s: f64,
    pub rx_packets_per_s: f64,
    pub rx_bytes_per_s: f64,
    pub retransmissions_per_s: f64,
    pub drops_per_s: f64,
    /// Smoothed round-trip time now, µs.
    pub rtt_us: f64,
}

/// The rates between samples `before` and `after`, `elapsed` apart.
pub fn frame(before: &Stats, after: &Stats, elapsed: Duration) -> Frame {
    let secs = elapsed.as_secs_f64().max(1e-3);
    let tenants = (after.tenants.iter())
        .map(|t| {
            let old = before.tenants.iter().find(|o| o.tenant == t.tenant);
            tenant_rates(old, t, secs)
        })
        .collect();
    let peers = (after.peers.iter())
        .filter(|p| !p.host.is_empty())
        .map(|p| {
            let old = before.peers.iter().find(|o| o.host == p.host);
            peer_rates(old, p, secs)
        })
        .collect();
    Frame {
        interval_s: secs,
        tenants,
        peers,
    }
}

/// `after - before` per second; 0 without a `before` or if it went down.
fn rate(before: Option<u64>, after: u64, secs: f64) -> f64 {
    match before {
        Some(b) if after >= b => (after - b) as f64 / secs,
        _ => 0.0,
    }
}

fn sum(map: &BTreeMap<String, u64>) -> u64 {
    map.values().fold(0u64, |a, &v| a.saturating_add(v))
}

fn tenant_rates(old: Option<&TenantStats>, t: &TenantStats, secs: f64) -> TenantRates {
    let total = |pick: fn(&TenantStats) -> &BTreeMap<String, u64>| {
        rate(old.map(|o| sum(pick(o))), sum(pick(t)), secs)
    };
    let ops_per_s_by_kind = (t.ops.iter())
        .map(|(kind, &n)| {
            let before = old.map(|o| o.ops.get(kind).copied().unwrap_or(0));
            (kind.clone(), rate(before, n, secs))
        })
        .collect();
    let throttled = |s: &TenantStats| s.throttled_seconds.values().sum::<f64>();
    let throttled_share = match old {
        Some(o) => ((throttled(t) - throttled(o)) / secs).clamp(0.0, 1.0),
        None => 0.0,
    };
    let usage = |key: &str| t.usage.get(key).copied().unwrap_or(0);
    TenantRates {
        tenant: t.tenant.clone(),
        class: t.class.name().to_owned(),
        weight: t.weight,
        devices: usage("devices"),
        qps: usage("qps"),
        mrs: usage("mrs"),
        mr_bytes: usage("mr_bytes"),
        ops_per_s: total(|s| &s.ops),
        ops_per_s_by_kind,
        bytes_per_s: total(|s| &s.bytes),
        errors_per_s: total(|s| &s.errors),
        quota_rejections_per_s: total(|s| &s.quota_rejections),
        dropped_per_s: total(|s| &s.dropped),
        throttled_share,
    }
}

fn peer_rates(old: Option<&PeerStats>, p: &PeerStats, secs: f64) -> PeerRates {
    let r = |pick: fn(&PeerStats) -> u64| rate(old.map(pick), pick(p), secs);
    PeerRates {
        host: p.host.clone(),
        tx_packets_per_s: r(|s| s.tx_packets),
        tx_bytes_per_s: r(|s| s.tx_bytes),
        rx_packets_per_s: r(|s| s.rx_packets),
        rx_bytes_per_s: r(|s| s.rx_bytes),
        retransmissions_per_s: r(|s| s.retransmissions),
        drops_per_s: r(|s| sum(&s.drops)),
        rtt_us: p.rtt_ns as f64 / 1e3,
    }
}

/// A rate with a unit prefix: `12.3k`, `4.56M`.
fn si(v: f64) -> String {
    let (v, prefix) = match v {
        v if v >= 1e9 => (v / 1e9, "G"),
        v if v >= 1e6 => (v / 1e6, "M"),
        v if v >= 1e3 => (v / 1e3, "k"),
        v => (v, ""),
    };
    if prefix.is_empty() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}{prefix}")
    }
}

/// The frame as one screen of text.
pub fn render(f: &Frame) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "vrdma hostd — {} tenants, rates over {:.1} s",
        f.tenants.len(),
        f.interval_s
    );
    let _ = writeln!(
        out,
        "\n{:<16} {:<9} {:>3} {:>4} {:>5} {:>5} {:>9} {:>9} {:>8} {:>7} {:>7} {:>7} {:>6}",
        "TENANT",
        "CLASS",
        "WGT",
        "DEVS",
        "QPS",
        "MRS",
        "OPS/s",
        "BYTES/s",
        "MR",
        "ERR/s",
        "QUOTA/s",
        "DROP/s",
        "THROT"
    );
    for t in &f.tenants {
        let _ = writeln!(
            out,
            "{:<16} {:<9} {:>3} {:>4} {:>5} {:>5} {:>9} {:>9} {:>8} {:>7} {:>7} {:>7} {:>5.0}%",
            t.tenant,
            t.class,
            t.weight,
            t.devices,
            t.qps,
            t.mrs,
            si(t.ops_per_s),
            si(t.bytes_per_s),
            si(t.mr_bytes as f64),
            si(t.errors_per_s),
            si(t.quota_rejections_per_s),
            si(t.dropped_per_s),
            t.throttled_share * 100.0
        );
    }
    if !f.peers.is_empty() {
        let _ = writeln!(
            out,
            "\n{:<16} {:>9} {:>9} {:>9} {:>9} {:>8} {:>7} {:>9}",
            "PEER HOST", "TX pkt/s", "TX B/s", "RX pkt/s", "RX B/s", "RETX/s", "DROP/s", "RTT µs"
        );
        for p in &f.peers {
            let _ = writeln!(
                out,
                "{:<16} {:>9} {:>9} {:>9} {:>9} {:>8} {:>7} {:>9.1}",
                p.host,
                si(p.tx_packets_per_s),
                si(p.tx_bytes_per_s),
                si(p.rx_packets_per_s),
                si(p.rx_bytes_per_s),
                si(p.retransmissions_per_s),
                si(p.drops_per_s),
                p.rtt_us
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str, writes: u64, bytes: u64) -> TenantStats {
        let json = serde_json::json!({
            "tenant": name, "in_policy": true, "class": "normal", "weight": 3,
            "ops": {"write": writes, "read": 0}, "bytes": {"write": bytes},
            "errors": {}, "quota_rejections": {}, "dropped": {}, "gsi": {},
            "throttled_seconds": {"send": 0.25}, "usage": {"devices": 1, "qps": 2},
            "quota": {}
        });
        serde_json::from_value(json).expect("tenant stats")
    }

    fn stats(tenants: Vec<TenantStats>) -> Stats {
        Stats {
            tenants,
            peers: Vec::new(),
            packet_io: None,
        }
    }

    #[test]
    fn rates_are_the_difference_per_second_and_never_negative() {
        let before = stats(vec![tenant("a", 100, 6400), tenant("b", 50, 0)]);
        let mut late_b = tenant("b", 10, 0); // b's counters went down: restarted
        late_b.throttled_seconds.insert("send".into(), 0.75);
        let after = stats(vec![tenant("a", 300, 19_200), late_b, tenant("c", 9, 9)]);
        let f = frame(&before, &after, Duration::from_secs(2));
        let a = &f.tenants[0];
        assert_eq!((a.ops_per_s, a.bytes_per_s), (100.0, 6400.0));
        assert_eq!(a.ops_per_s_by_kind.get("write"), Some(&100.0));
        assert_eq!((a.class.as_str(), a.weight, a.qps), ("normal", 3, 2));
        assert_eq!(f.tenants[1].ops_per_s, 0.0, "a counter that went down");
        assert_eq!(f.tenants[1].throttled_share, 0.25, "0.5 s of 2 s");
        assert_eq!(f.tenants[2].ops_per_s, 0.0, "new: no rate yet");
        let screen = render(&f);
        assert!(screen.contains("TENANT"), "{screen}");
        assert!(
            screen
                .lines()
                .any(|l| l.starts_with('a') && l.contains(" 100 ")),
            "{screen}"
        );
    }
}
