//! hostd's Prometheus endpoint (`--metrics-listen`): a real hostd in its
//! sandbox (seccomp in kill mode: a call the metrics thread's role does
//! not allow would kill hostd), scraped over TCP after real traffic; the
//! text is `vrdmactl metrics`'s, and every request that is not a scrape
//! gets its HTTP status without wedging the endpoint.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use vrdma_spec::verbs::{SendOpcode, WcStatus};
use vrdma_tests::daemon::{metric_value, Hostd};
use vrdma_tests::tenant::{qp_pair, Connection, Pair, Tenant};

/// Sends `request` as is and returns (status code, headers, body).
fn exchange(addr: SocketAddr, request: &[u8]) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(request).expect("send the request");
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).expect("read the answer");
    let end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end: {:?}", String::from_utf8_lossy(&answer)));
    let head = String::from_utf8_lossy(&answer[..end]).into_owned();
    let body = answer[end + 4..].to_vec();
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status: {head}"));
    (code, head, body)
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

/// Tenants alpha and beta of `hostd`, a connected QP pair, and a 64 B
/// WRITE from alpha into beta's memory that must succeed.
struct Writing {
    pair: Pair,
    src: vrdma_guest_driver::MemoryRegion,
    dst: vrdma_guest_driver::MemoryRegion,
}

impl Writing {
    fn on(hostd: Hostd) -> Self {
        let a = Tenant::start(&hostd, "alpha");
        let b = Tenant::start(&hostd, "beta");
        let (qa, qb) = qp_pair(&a, &b, Connection::default());
        let pair = Pair {
            qa,
            qb,
            a,
            b,
            hostd,
        };
        let (src, dst) = pair.mrs(4096);
        Writing { pair, src, dst }
    }

    fn write(&self) {
        let (src, dst) = (&self.src, &self.dst);
        let st = (self.pair).rdma(
            SendOpcode::RdmaWrite,
            &[src.sge(0, 64)],
            dst.iova(),
            dst.rkey(),
        );
        assert_eq!(st, WcStatus::Success);
    }
}

#[test]
fn hostd_serves_its_metrics_over_http_and_answers_anything_else_with_its_status() {
    let hostd = Hostd::start_with(None, &["--metrics-listen", "127.0.0.1:0"]);
    let addr = hostd.metrics_addr();
    let w = Writing::on(hostd);
    let pair = &w.pair;
    for _ in 0..10 {
        w.write();
    }

    // A scrape: 200, the exposition format, its length, alpha's writes.
    let (code, head, body) = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(code, 200, "{head}");
    assert_eq!(
        header(&head, "Content-Type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    assert_eq!(
        header(&head, "Content-Length"),
        Some(&*body.len().to_string())
    );
    let text = String::from_utf8(body).expect("UTF-8 metrics");
    let writes = metric_value(
        &text,
        "vrdma_tenant_ops_total{tenant=\"alpha\",kind=\"write\"}",
    );
    assert_eq!(writes, Some(10.0), "{text}");
    // The same text vrdmactl gets on the admin socket (nothing ran since).
    let (status, ctl, err) = pair.hostd.ctl(&["metrics"]);
    assert_eq!(status, 0, "{err}");
    assert_eq!(text, ctl);
    // Prometheus's naming rules: counters end in _total, every family is
    // typed and helped before its samples, names are vrdma_-prefixed.
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let mut words = line.split(' ').skip(2);
        let (name, kind) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        assert!(name.starts_with("vrdma_"), "{line}");
        assert!(matches!(kind, "counter" | "gauge"), "{line}");
        if kind == "counter" {
            assert!(name.ends_with("_total"), "{line}");
        }
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has no HELP"
        );
    }

    // The example dashboard (docs/) asks only for series hostd serves
    // (its per-tenant ones here; the per-peer ones come with [fabric]).
    let dashboard = include_str!("../../docs/grafana-vrdma-hostd.json");
    let asked: std::collections::BTreeSet<&str> = dashboard
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("vrdma_tenant_"))
        .collect();
    assert!(asked.len() >= 6, "{asked:?}");
    for name in asked {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "the dashboard asks for {name}, which hostd does not serve"
        );
    }

    // HEAD: the same headers, no body.
    let (code, head, body) = exchange(addr, b"HEAD /metrics HTTP/1.0\r\n\r\n");
    assert_eq!(code, 200);
    assert!(body.is_empty(), "HEAD has no body");
    assert_eq!(
        header(&head, "Content-Length"),
        Some(&*text.len().to_string())
    );

    // Everything else gets its status.
    let cases: [(&[u8], u16); 5] = [
        (b"GET / HTTP/1.1\r\n\r\n", 404),
        (b"GET /metricsx HTTP/1.1\r\n\r\n", 404),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
    ];
    for (request, want) in cases {
        let (code, head, _) = exchange(addr, request);
        assert_eq!(code, want, "{:?}: {head}", String::from_utf8_lossy(request));
        if want == 405 {
            assert_eq!(header(&head, "Allow"), Some("GET, HEAD"));
        }
    }
    let mut long = b"GET /metrics HTTP/1.1\r\n".to_vec();
    for i in 0..400 {
        long.extend_from_slice(format!("X-Padding-{i}: {}\r\n", "a".repeat(20)).as_bytes());
    }
    long.extend_from_slice(b"\r\n");
    assert_eq!(exchange(addr, &long).0, 431, "a head over 8 KiB");

    // A client that connects and says nothing holds the endpoint for its
    // timeout only; a client that vanishes mid-request changes nothing.
    let silent = TcpStream::connect(addr).expect("connect");
    let mut half = TcpStream::connect(addr).expect("connect");
    half.write_all(b"GET /met").expect("half a request");
    drop(half);
    let started = Instant::now();
    let (code, _, _) = exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(code, 200, "served after the silent client's timeout");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "the silent client held the endpoint {:?}",
        started.elapsed()
    );
    drop(silent);
    // hostd is alive (its seccomp filters kill it on a forbidden call) and
    // still serving its tenants.
    w.write();
}

#[test]
fn vrdmactl_top_shows_each_tenants_rates_and_holdings() {
    let w = Writing::on(Hostd::start(None));
    let pair = &w.pair;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (frames, writes) = std::thread::scope(|scope| {
        // alpha writes all along; beta does nothing.
        let writer = scope.spawn(|| {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                w.write();
                n += 1;
            }
            n
        });
        let args = ["top", "--json", "--count", "2", "--interval", "0.5"];
        let (code, out, err) = pair.hostd.ctl(&args);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(code, 0, "{err}");
        (out, writer.join().expect("writer"))
    });
    let lines: Vec<serde_json::Value> = frames
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON frame per line"))
        .collect();
    assert_eq!(lines.len(), 2, "{frames}");
    let tenant = |f: &serde_json::Value, name: &str| {
        f["tenants"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["tenant"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("{name} in {f}"))
    };
    let (alpha, beta) = (tenant(&lines[1], "alpha"), tenant(&lines[1], "beta"));
    let rate = alpha["ops_per_s_by_kind"]["write"].as_f64().unwrap_or(0.0);
    // The writer ran through both intervals (~1 s in all): the rate of the
    // second is its share of those writes, give or take the edges.
    assert!(rate > 0.0, "{alpha}");
    assert!(rate <= writes as f64 / 0.4, "{rate}/s from {writes} writes");
    // 64 bytes per write (JSON's floats round-trip to within an ulp).
    let bytes = alpha["bytes_per_s"].as_f64().unwrap_or(0.0);
    assert!((bytes - rate * 64.0).abs() <= 1e-9 * bytes, "{alpha}");
    assert_eq!(beta["ops_per_s"].as_f64(), Some(0.0), "{beta}");
    for t in [&alpha, &beta] {
        assert_eq!(
            (t["devices"].as_u64(), t["qps"].as_u64()),
            (Some(1), Some(1)),
            "{t}"
        );
        assert_eq!(t["class"], "normal", "{t}");
    }

    // The screen: a header and a row per tenant.
    let (code, screen, err) = pair
        .hostd
        .ctl(&["top", "--count", "1", "--interval", "0.2"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        screen.contains("TENANT") && screen.contains("OPS/s"),
        "{screen}"
    );
    for name in ["alpha", "beta"] {
        assert!(screen.lines().any(|l| l.starts_with(name)), "{screen}");
    }
    // --json on the other commands, and a refused interval.
    let (code, reload, _) = pair.hostd.ctl(&["--json", "reload"]);
    assert_eq!(code, 1, "the built-in policy cannot be reloaded");
    let v: serde_json::Value = serde_json::from_str(&reload).expect("JSON error");
    assert!(v["error"].is_string(), "{reload}");
    let (code, metrics, _) = pair.hostd.ctl(&["metrics", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&metrics).expect("JSON metrics");
    assert!(v["text"]
        .as_str()
        .is_some_and(|t| t.contains("vrdma_tenant_ops_total")));
    let (code, _, err) = pair.hostd.ctl(&["top", "--interval", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--interval"), "{err}");
}
