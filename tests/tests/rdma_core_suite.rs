//! rdma-core's own test suite on vrdma (issue 14): the Python tests that
//! ship with rdma-core 44 (Debian 12's `python3-pyverbs` installs them,
//! some gzipped, under /usr/share/doc/rdma-core/tests), unmodified, run by
//! their own runner (`run_tests.py --dev vrdma0 -v`) with Debian's
//! `python3` and `pyverbs` on the drop-in `libibverbs.so.1`, against tenant
//! alpha's device (a vdev on hostd) in process mode.
//!
//! Every module runs (about 280 tests, under 10 s here). The test reads
//! each test's outcome from the runner's report and fails on: a hang (the
//! runner killed after [`TIMEOUT`]), any failure or error (none is the
//! suite's own assumption today: [`KNOWN_FAILURES`] is empty), a skip whose
//! reason is not one of [`EXPECTED_SKIPS`] (so a feature that stops
//! working cannot hide as a skip), fewer passes in a class than
//! [`PASSED`] lists (docs/compat.md's table), or vdev or hostd not
//! surviving the run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use vrdma_tests::c_program::build_c_program;
use vrdma_tests::daemon::{wait_output, Hostd, IbverbsShim, TempDir, Vdev};
use vrdma_tests::need;
use vrdma_tests::pyunit::{self, Outcome, TestResult};

/// Where `python3-pyverbs` puts rdma-core's tests and runner.
const SUITE: &str = "/usr/share/doc/rdma-core/tests";
/// Debian's interpreter, whose `dist-packages` hold pyverbs (a `python3`
/// earlier on `PATH`, e.g. pyenv's, would not find it).
const PYTHON: &str = "/usr/bin/python3";
const PYVERBS: &str = "/usr/lib/python3/dist-packages/pyverbs/__init__.py";
/// The whole suite takes under 10 s; this is a hang.
const TIMEOUT: Duration = Duration::from_secs(150);

/// Skip reasons the suite prints (a part of the reason) and why each
/// is right on vrdma. Every skip must match one.
const EXPECTED_SKIPS: &[(&str, &str)] = &[
    (
        "Can not run the test over non MLX5 device",
        "mlx5 direct verbs: vrdma is not an mlx5 device",
    ),
    (
        "Could not open mlx5 context",
        "mlx5 direct verbs: vrdma is not an mlx5 device",
    ),
    (
        "Can not run the test over non EFA device",
        "EFA direct verbs: vrdma is not an EFA device",
    ),
    (
        "PCI device must be passed by the user",
        "mlx5 VFIO: needs an mlx5 PCI function (--pci-dev)",
    ),
    (
        "cuda-python 12.0+ must be installed",
        "GPU memory: no CUDA on the host",
    ),
    (
        "Allocating dmabuf is not supported by",
        "dma-buf MRs: no GPU render node for the exporter (vrdma refuses ibv_reg_dmabuf_mr)",
    ),
    (
        "Device /dev/dri/renderD",
        "dma-buf MRs: no GPU render node for the exporter (vrdma refuses ibv_reg_dmabuf_mr)",
    ),
    (
        "Lack of permission to access /dev/dri/renderD",
        "dma-buf MRs: no GPU render node for the exporter (vrdma refuses ibv_reg_dmabuf_mr)",
    ),
    (
        "Reg dma-buf MR is not supported by the RDMA driver",
        "dma-buf MRs: vrdma refuses ibv_reg_dmabuf_mr (EOPNOTSUPP)",
    ),
    (
        "Device memory is not supported",
        "device memory: ibv_alloc_dm is refused (EOPNOTSUPP)",
    ),
    (
        "ODP is not supported",
        "on-demand paging: ibv_query_device_ex reports no ODP capabilities",
    ),
    (
        "There are no huge pages of size 2M allocated",
        "host setting (vm.nr_hugepages 0); the tests need ODP or parent domains too",
    ),
    (
        "Huge pages of size 2M is not supported",
        "host setting; the tests need ODP or parent domains too",
    ),
    (
        "doesn't have net interface",
        "rdma_cm: vrdma has no netdev and no librdmacm provider",
    ),
    (
        "Create XRCD is not supported",
        "XRC: ibv_open_xrcd is refused (EOPNOTSUPP)",
    ),
    (
        "Create QP type 8 is not supported",
        "raw packet QPs (and the flows and RSS built on them) are refused",
    ),
    (
        "Create Raw Packet QP",
        "raw packet QPs are refused (EOPNOTSUPP)",
    ),
    (
        "Reg MR with MW access is not supported",
        "memory windows are refused",
    ),
    ("Create memory window of type", "memory windows are refused"),
    (
        "Create custom mr with additional access flags",
        "memory windows: IBV_ACCESS_MW_BIND is refused",
    ),
    (
        "Parent Domain is not supported",
        "parent domains are refused (EOPNOTSUPP)",
    ),
    (
        "Create Extended CQ is not supported",
        "completion timestamps are refused (EOPNOTSUPP)",
    ),
    (
        "Query device real time is not supported",
        "ibv_query_rt_values_ex is refused (EOPNOTSUPP)",
    ),
    (
        "Extended CQ is not supported",
        "tag matching (IBV_WC_EX_WITH_TM_INFO) is refused (EOPNOTSUPP)",
    ),
    (
        "Extended QP is not supported on this device",
        "ATOMIC_WRITE in send_ops_flags is refused (EOPNOTSUPP)",
    ),
    (
        "Rereg MR is not supported",
        "ibv_rereg_mr is refused (EOPNOTSUPP)",
    ),
    (
        "Resize CQ is not supported",
        "ibv_resize_cq is refused (EOPNOTSUPP)",
    ),
    (
        "Importing a device is not supported",
        "ibv_import_device is refused (EOPNOTSUPP): contexts are not shared between processes",
    ),
    (
        "All gid indices populated, cannot check bad flow",
        "the port has one GID and it is valid: no empty index to query",
    ),
];

/// Tests that fail on vrdma because the suite assumes something a real
/// device would fail as well (test id, why): none.
const KNOWN_FAILURES: &[(&str, &str)] = &[];

/// Tests each class passes at least (docs/compat.md's table).
const PASSED: &[(&str, usize)] = &[
    ("test_addr.AHTest", 3),
    ("test_atomic.AtomicTest", 7),
    ("test_cq.CQAPITest", 3),
    ("test_cq_events.CqEventsTestCase", 2),
    ("test_cqex.CQEXAPITest", 2),
    ("test_cqex.CqExTestCase", 2),
    ("test_device.DeviceTest", 12),
    ("test_fork.ForkAPITest", 1),
    ("test_mr.MRTest", 1),
    ("test_pd.PDTest", 4),
    ("test_qp.QPTest", 21),
    ("test_qpex.QpExTestCase", 16),
    ("test_relaxed_ordering.RoTestCase", 2),
];

/// A copy of the suite in `dir`, its gzipped files unpacked (the runner
/// imports every `test_*.py`); the path of its runner.
fn unpack_suite(dir: &Path) -> std::path::PathBuf {
    let suite = dir.join("tests");
    std::fs::create_dir(&suite).expect("create the suite's directory");
    let mut gzipped = Vec::new();
    for entry in std::fs::read_dir(SUITE).expect("list the suite") {
        let from = entry.expect("read the suite's directory").path();
        let to = suite.join(from.file_name().expect("a file name"));
        std::fs::copy(&from, &to).expect("copy a file of the suite");
        if to.extension().is_some_and(|e| e == "gz") {
            gzipped.push(to);
        }
    }
    let status = Command::new("gzip")
        .arg("-d")
        .args(&gzipped)
        .status()
        .expect("run gzip");
    assert!(status.success(), "gzip -d failed on the suite's files");
    suite.join("run_tests.py")
}

/// The markdown table of docs/compat.md: per class, passed, skipped with
/// the reasons, failed or erroneous.
fn table(results: &[TestResult]) -> String {
    #[derive(Default)]
    struct Row {
        passed: usize,
        skipped: BTreeMap<String, usize>,
        failed: Vec<String>,
    }
    let mut rows: BTreeMap<&str, Row> = BTreeMap::new();
    for r in results {
        let row = rows.entry(r.class()).or_default();
        match &r.outcome {
            Outcome::Passed | Outcome::ExpectedFailure => row.passed += 1,
            Outcome::Skipped(reason) => *row.skipped.entry(reason.clone()).or_default() += 1,
            other => row.failed.push(format!("{} ({other:?})", r.id)),
        }
    }
    let mut out =
        String::from("| module.Class | passed | skipped (reason) | failed |\n|---|---|---|---|\n");
    for (class, row) in rows {
        let skipped: Vec<String> = row
            .skipped
            .iter()
            .map(|(reason, n)| format!("{n} ({reason})"))
            .collect();
        let _ = writeln!(
            out,
            "| `{class}` | {} | {} | {} |",
            row.passed,
            if skipped.is_empty() {
                "0".into()
            } else {
                skipped.join("; ")
            },
            if row.failed.is_empty() {
                "0".into()
            } else {
                row.failed.join("; ")
            },
        );
    }
    out
}

#[test]
fn rdma_core_tests_pass_or_skip_for_a_stated_reason() {
    need::file(Path::new(PYTHON), "python3");
    need::file(Path::new(PYVERBS), "python3-pyverbs");
    need::file(&Path::new(SUITE).join("run_tests.py"), "python3-pyverbs");
    need::program("gzip", "gzip");

    let dir = TempDir::new("rdma-core-suite");
    let runner = unpack_suite(dir.path());
    let mut hostd = Hostd::start(None);
    let mut vdev = Vdev::on_hostd(&hostd, "alpha", &[]);
    let shim = IbverbsShim::new();

    let child = shim
        .command(PYTHON, &vdev.socket)
        .arg(&runner)
        .args(["--dev", "vrdma0", "-v"])
        .current_dir(dir.path())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .spawn()
        .expect("run rdma-core's run_tests.py");
    let (out, late) = wait_output(child, TIMEOUT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let logs = |vdev: &Vdev, hostd: &Hostd| {
        format!(
            "--- run_tests.py stdout:\n{}\n--- stderr:\n{stderr}\n--- vdev log (tail):\n{}\n--- hostd log (tail):\n{}",
            String::from_utf8_lossy(&out.stdout),
            vdev.log_tail(60),
            hostd.log_tail(60)
        )
    };
    assert!(
        !late,
        "rdma-core's tests hung ({TIMEOUT:?})\n{}",
        logs(&vdev, &hostd)
    );

    let report = pyunit::parse(&stderr);
    println!("{}", table(&report.results));
    assert!(
        report
            .ran
            .is_some_and(|n| n > 0 && n == report.results.len()),
        "the runner ran {:?} tests, {} outcomes were read\n{}",
        report.ran,
        report.results.len(),
        logs(&vdev, &hostd)
    );

    // Failures and errors: each is vrdma's unless listed.
    let failures: Vec<&TestResult> = report
        .results
        .iter()
        .filter(|r| {
            matches!(
                r.outcome,
                Outcome::Failed | Outcome::Error | Outcome::UnexpectedSuccess
            )
        })
        .collect();
    let unexplained: Vec<String> = failures
        .iter()
        .filter(|r| !KNOWN_FAILURES.iter().any(|(id, _)| *id == r.id))
        .map(|r| {
            let traceback = report.tracebacks.get(&r.id).map_or("", String::as_str);
            format!("{} {:?}\n{traceback}", r.id, r.outcome)
        })
        .collect();
    assert!(
        unexplained.is_empty(),
        "rdma-core's tests failed on vrdma:\n{}\n{}",
        unexplained.join("\n"),
        logs(&vdev, &hostd)
    );
    assert_eq!(
        out.status.success(),
        failures.is_empty(),
        "run_tests.py's exit status {:?} disagrees with its report ({:?})",
        out.status,
        report.verdict
    );

    // Skips: each for a reason the suite states and vrdma expects.
    let unexpected: Vec<String> = report
        .results
        .iter()
        .filter_map(|r| match &r.outcome {
            Outcome::Skipped(reason) if !EXPECTED_SKIPS.iter().any(|(p, _)| reason.contains(p)) => {
                Some(format!("{}: {reason}", r.id))
            }
            _ => None,
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "skipped for a reason vrdma does not expect:\n{}",
        unexpected.join("\n")
    );

    // Passes: at least what docs/compat.md reports, class by class.
    for (class, least) in PASSED {
        let passed = report
            .results
            .iter()
            .filter(|r| r.class() == *class && r.outcome == Outcome::Passed)
            .count();
        assert!(
            passed >= *least,
            "{class}: {passed} passed, docs/compat.md reports {least}\n{}",
            logs(&vdev, &hostd)
        );
    }

    // The device survived the suite (vdev was once killed by its own
    // seccomp filter in the middle of it) and serves on.
    let (vdev_alive, hostd_alive) = (vdev.is_running(), hostd.is_running());
    assert!(
        vdev_alive && hostd_alive,
        "vdev running: {vdev_alive}, hostd running: {hostd_alive}\n{}",
        logs(&vdev, &hostd)
    );
}

/// What the suite found, each on its own (`tests/c/suite_findings.c`, on
/// a vdev without hostd: control verbs and posting only): the context's
/// `cmd_fd` is a descriptor `dup()` takes (`ibv_import_device` then
/// refuses it with `EOPNOTSUPP`), and posting before INIT (receives) or
/// RTS (sends, `ibv_wr_complete`) fails with `EINVAL`.
#[test]
fn cmd_fd_is_a_descriptor_and_posting_waits_for_init_or_rts() {
    let dir = TempDir::new("suite-findings");
    let exe = build_c_program(
        &dir,
        "suite_findings",
        include_str!("../c/suite_findings.c"),
    );
    let vdev = Vdev::start("findings", &[]);
    let shim = IbverbsShim::new();
    let child = shim
        .command(exe.to_str().expect("UTF-8 path"), &vdev.socket)
        .spawn()
        .expect("run suite_findings");
    let (out, late) = wait_output(child, Duration::from_secs(60));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && !late && text.contains("suite findings OK"),
        "{:?} late={late}\n{text}\n--- vdev log:\n{}",
        out.status,
        vdev.log()
    );
}
