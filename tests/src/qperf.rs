//! What Debian's qperf (0.4.11) runs and prints: its RDMA tests and the
//! figures of its report, for the tests that run it on vrdma
//! (tests/tests/qperf.rs on InfiniBand ports, tests/tests/rdmacm.rs
//! through rdma_cm on RoCE ports).

use std::collections::BTreeMap;

/// Every RC, UC and UD test of qperf 0.4.11 (`qperf --help tests`: RDMA
/// send/receive, RDMA, InfiniBand atomics and their verification). The
/// XRC tests are left out: Debian's qperf is built without XRC
/// (`xrc_bw: bad test`), and vrdma has no XRC.
pub const TESTS: [&str; 21] = [
    "rc_bi_bw",
    "rc_bw",
    "rc_compare_swap_mr",
    "rc_fetch_add_mr",
    "rc_lat",
    "rc_rdma_read_bw",
    "rc_rdma_read_lat",
    "rc_rdma_write_bw",
    "rc_rdma_write_lat",
    "rc_rdma_write_poll_lat",
    "uc_bi_bw",
    "uc_bw",
    "uc_lat",
    "uc_rdma_write_bw",
    "uc_rdma_write_lat",
    "uc_rdma_write_poll_lat",
    "ud_bi_bw",
    "ud_bw",
    "ud_lat",
    "ver_rc_compare_swap",
    "ver_rc_fetch_add",
];

/// Its RC tests (and their verifications): the ones it runs through
/// rdma_cm with `-cm1`; it addresses UC and UD peers by LID only.
pub fn rc_tests() -> impl Iterator<Item = &'static str> {
    TESTS
        .into_iter()
        .filter(|t| t.starts_with("rc_") || t.starts_with("ver_rc_"))
}

/// The figures qperf reported, by test: `name:` lines, each followed by
/// `    key  =  value unit` lines. Any other line (an error) fails the test.
pub fn results(text: &str) -> BTreeMap<String, Vec<(String, f64)>> {
    let mut results: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    let mut current = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(test) = line.strip_suffix(':').filter(|t| !t.contains(' ')) {
            results.entry(test.to_owned()).or_default();
            current = Some(test.to_owned());
            continue;
        }
        let figure = line.split_once('=').and_then(|(key, value)| {
            // qperf groups thousands with commas: `1,000 MB/sec`.
            let number = value.split_whitespace().next()?.replace(',', "");
            Some((key.trim().to_owned(), number.parse::<f64>().ok()?))
        });
        match (figure, &current) {
            (Some(figure), Some(test)) if line.starts_with("    ") => {
                results.entry(test.clone()).or_default().push(figure);
            }
            _ => panic!("qperf printed {line:?}, which is no result:\n{text}"),
        }
    }
    results
}

/// The figures a qperf test reports: a bandwidth (RC: `bw`; UC and UD,
/// whose receiver may lose messages: `send_bw` and `recv_bw`), a latency
/// or a message rate.
pub fn expected_figures(test: &str) -> &'static [&'static str] {
    if test.ends_with("_lat") {
        &["latency"]
    } else if test.ends_with("_mr") || test.starts_with("ver_") {
        &["msg_rate"]
    } else if test.starts_with("rc_") {
        &["bw"]
    } else {
        &["send_bw", "recv_bw"]
    }
}

/// Fails unless `text` (a qperf client's report) holds every one of
/// `tests` once, each with its expected figures all above zero, and
/// nothing else but `quit`'s empty entry.
#[track_caller]
pub fn assert_every_figure<'a>(text: &str, tests: impl IntoIterator<Item = &'a str>) {
    let mut results = results(text);
    // `quit` (the server's end) reports nothing.
    assert_eq!(results.remove("quit"), Some(vec![]), "{text}");
    let ran: Vec<_> = results.keys().map(String::as_str).collect();
    let mut wanted: Vec<_> = tests.into_iter().collect();
    wanted.sort_unstable();
    assert_eq!(ran, wanted, "every test reported once:\n{text}");
    for (test, figures) in &results {
        for key in expected_figures(test) {
            let value = figures
                .iter()
                .find(|(k, _)| k == key)
                .map(|&(_, v)| v)
                .unwrap_or_else(|| panic!("{test}: no {key}:\n{text}"));
            assert!(value > 0.0, "{test}: {key} = {value}:\n{text}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_read_with_qperf_s_thousands_separators() {
        let text = "ud_bw:\n    send_bw  =  1,016 MB/sec\n    recv_bw  =  1,000 MB/sec\nrc_lat:\n    latency  =  34.8 us\n";
        let r = results(text);
        assert_eq!(
            r["ud_bw"],
            vec![
                ("send_bw".to_owned(), 1016.0),
                ("recv_bw".to_owned(), 1000.0)
            ]
        );
        assert_eq!(r["rc_lat"], vec![("latency".to_owned(), 34.8)]);
    }
}
