//! Python `unittest`'s verbose report (`-v`, on stderr), read back into
//! per-test outcomes: what rdma-core's test runner (`run_tests.py`)
//! prints for each test, and its summary.
//!
//! A test's line is `name (module.Class.name)`, on Python 3.11 followed by
//! the first line of its docstring on the next line when it has one, then
//! ` ... ` and the outcome: `ok`, `FAIL`, `ERROR`, `skipped 'reason'`
//! (the reason's `repr`), `expected failure` or `unexpected success`.
//! Whatever the code under test writes to stderr lands between the ` ... `
//! and the outcome; such lines are passed over.

use std::collections::BTreeMap;

/// One test's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    /// Skipped, with the reason the test gave.
    Skipped(String),
    Failed,
    Error,
    ExpectedFailure,
    UnexpectedSuccess,
}

impl Outcome {
    /// The outcome text unittest prints after ` ... `, if `text` is one.
    fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        Some(match text {
            "ok" => Outcome::Passed,
            "FAIL" => Outcome::Failed,
            "ERROR" => Outcome::Error,
            "expected failure" => Outcome::ExpectedFailure,
            "unexpected success" => Outcome::UnexpectedSuccess,
            _ => Outcome::Skipped(unquote(text.strip_prefix("skipped ")?)?.to_owned()),
        })
    }
}

/// A Python string `repr` (`'...'`, or `"..."` when it holds a `'`)
/// without its quotes.
fn unquote(repr: &str) -> Option<&str> {
    ['\'', '"']
        .iter()
        .find_map(|&q| repr.strip_prefix(q)?.strip_suffix(q))
}

/// A test and its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestResult {
    /// `module.Class.method` as unittest names it
    /// (`tests.test_qp.QPTest.test_create_rc_qp`).
    pub id: String,
    pub outcome: Outcome,
}

impl TestResult {
    /// `test_module.Class`: the id without its package and method.
    pub fn class(&self) -> &str {
        let without_method = self.id.rsplit_once('.').map_or(&*self.id, |(c, _)| c);
        without_method
            .split_once('.')
            .map_or(without_method, |(_, rest)| rest)
    }
}

/// The whole report.
#[derive(Debug, Default)]
pub struct Report {
    /// Every test with an outcome, in the order they ran.
    pub results: Vec<TestResult>,
    /// `Ran N tests`.
    pub ran: Option<usize>,
    /// The last line: `OK (...)` or `FAILED (...)`.
    pub verdict: Option<String>,
    /// The traceback unittest prints for each failed or erroneous test,
    /// by test id.
    pub tracebacks: BTreeMap<String, String>,
}

/// `name (id)` at the start of `line`: the id and the rest of the line.
fn test_start(line: &str) -> Option<(&str, &str)> {
    let (name, rest) = line.split_once(" (")?;
    let (id, rest) = rest.split_once(')')?;
    let plausible =
        !name.contains(' ') && id.ends_with(name) && id.contains('.') && !id.contains(' ');
    plausible.then_some((id, rest))
}

/// Reads unittest's verbose output `text`.
pub fn parse(text: &str) -> Report {
    let mut report = Report::default();
    let mut lines = text.lines();
    // The test waiting for its outcome, and whether its ` ... ` was seen.
    let mut pending: Option<(&str, bool)> = None;
    while let Some(line) = lines.next() {
        if line.starts_with("======") || line.starts_with("Ran ") {
            read_summary(line, &mut lines, &mut report);
            break;
        }
        let candidate = match (test_start(line), pending) {
            (Some((id, rest)), _) => {
                pending = Some((id, false));
                rest
            }
            (None, Some(_)) => line,
            (None, None) => continue,
        };
        let Some((id, dots)) = pending.as_mut() else {
            continue;
        };
        let outcome = if *dots {
            Outcome::parse(candidate)
        } else if let Some((_, after)) = candidate.split_once(" ... ") {
            *dots = true;
            Outcome::parse(after)
        } else {
            None
        };
        if let Some(outcome) = outcome {
            report.results.push(TestResult {
                id: (*id).to_owned(),
                outcome,
            });
            pending = None;
        }
    }
    report
}

/// The summary after the per-test lines: each failure's traceback
/// (`ERROR: name (id)`, a line of dashes, the traceback, up to the next
/// line of `=` or dashes), `Ran N tests` and the verdict.
fn read_summary<'a>(
    first: &'a str,
    lines: &mut impl Iterator<Item = &'a str>,
    report: &mut Report,
) {
    let mut current: Option<String> = None;
    for line in std::iter::once(first).chain(lines) {
        if let Some(count) = line.strip_prefix("Ran ") {
            report.ran = count.split(' ').next().and_then(|n| n.parse().ok());
            current = None;
        } else if line.starts_with("OK") || line.starts_with("FAILED") {
            report.verdict = Some(line.to_owned());
        } else if line.starts_with("======") {
            current = None;
        } else if let Some(id) = ["ERROR: ", "FAIL: "]
            .iter()
            .find_map(|p| test_start(line.strip_prefix(p)?))
            .map(|(id, _)| id.to_owned())
        {
            report.tracebacks.insert(id.clone(), String::new());
            current = Some(id);
        } else if let Some(id) = &current {
            if let Some(text) = report.tracebacks.get_mut(id) {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shaped like Python 3.11's output for rdma-core 44's tests, with a
    /// library's message on stderr between ` ... ` and an outcome.
    const OUTPUT: &str = "\
test_create_ah (tests.test_addr.AHTest.test_create_ah)
Test ibv_create_ah. ... ok
test_dm (tests.test_device.DMTest.test_dm) ... skipped 'Device memory is not supported'
test_rdmacm_sync_traffic (tests.test_rdmacm.CMTestCase.test_rdmacm_sync_traffic) ... skipped \"Device vrdma0 doesn't have net interface\"
test_rss_traffic (tests.test_rss_traffic.RSSTrafficTest.test_rss_traffic) ... libibverbs (vrdma): cannot open device vrdma0
ERROR
test_bad (tests.test_qpex.QpExTestCase.test_bad) ... FAIL

======================================================================
ERROR: test_rss_traffic (tests.test_rss_traffic.RSSTrafficTest.test_rss_traffic)
----------------------------------------------------------------------
Traceback (most recent call last):
OSError: [Errno 9] Bad file descriptor

======================================================================
FAIL: test_bad (tests.test_qpex.QpExTestCase.test_bad)
----------------------------------------------------------------------
AssertionError: PyverbsRDMAError not raised

----------------------------------------------------------------------
Ran 5 tests in 6.398s

FAILED (failures=1, errors=1, skipped=2)
";

    #[test]
    fn every_outcome_is_read_with_its_test() {
        let report = parse(OUTPUT);
        let got: Vec<(&str, &Outcome)> = report
            .results
            .iter()
            .map(|r| (r.class(), &r.outcome))
            .collect();
        let skipped = |s: &str| Outcome::Skipped(s.to_owned());
        assert_eq!(
            got,
            [
                ("test_addr.AHTest", &Outcome::Passed),
                (
                    "test_device.DMTest",
                    &skipped("Device memory is not supported")
                ),
                (
                    "test_rdmacm.CMTestCase",
                    &skipped("Device vrdma0 doesn't have net interface")
                ),
                ("test_rss_traffic.RSSTrafficTest", &Outcome::Error),
                ("test_qpex.QpExTestCase", &Outcome::Failed),
            ]
        );
        assert_eq!(report.ran, Some(5));
        assert_eq!(
            report.verdict.as_deref(),
            Some("FAILED (failures=1, errors=1, skipped=2)")
        );
        let rss = &report.tracebacks["tests.test_rss_traffic.RSSTrafficTest.test_rss_traffic"];
        assert!(rss.contains("Bad file descriptor"), "{rss}");
        let bad = &report.tracebacks["tests.test_qpex.QpExTestCase.test_bad"];
        assert!(
            bad.contains("not raised") && !bad.contains("Ran 5"),
            "{bad}"
        );
    }

    #[test]
    fn text_that_is_no_outcome_is_passed_over() {
        assert_eq!(Outcome::parse("libibverbs (vrdma): cannot open"), None);
        assert_eq!(Outcome::parse("skipped without quotes"), None);
        assert_eq!(test_start("Test ibv_create_ah. ... ok"), None);
    }
}
