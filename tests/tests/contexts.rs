//! Contexts of one device (issue 14): an RDMA program opens a device
//! several times, and several processes of a tenant open it at once, each
//! with its own objects; the device's quotas count them all; a process
//! that dies loses only its own objects, which are freed.
//!
//! The programs are `tests/c/contexts.c`, compiled against Debian's
//! <infiniband/verbs.h> and libibverbs and run on the drop-in library, on
//! tenant alpha's device (a vdev on hostd) in process mode.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use vrdma_tests::c_program::build_c_program;
use vrdma_tests::daemon::{wait_output, Hostd, IbverbsShim, TempDir, Vdev};
use vrdma_tests::tenant::policy;

/// The device's QP quota: what 8 contexts of 2 QPs each fill exactly.
const MAX_QP: u64 = 16;
/// Processes at once.
const PROCESSES: usize = 8;

struct Setup {
    // Dropped in declaration order: the vdev before hostd.
    vdev: Vdev,
    hostd: Hostd,
    shim: IbverbsShim,
    exe: PathBuf,
    _dir: TempDir,
}

impl Setup {
    fn start() -> Self {
        let dir = TempDir::new("contexts");
        let exe = build_c_program(&dir, "contexts", include_str!("../c/contexts.c"));
        let policy = policy(&[(
            "alpha",
            &format!("quotas = {{ max_qp = {MAX_QP}, max_pd = 64, max_cq = 64, max_mr = 64 }}"),
        )]);
        let hostd = Hostd::start(Some(&policy));
        let vdev = Vdev::on_hostd(&hostd, "alpha", &[]);
        Setup {
            vdev,
            hostd,
            shim: IbverbsShim::new(),
            exe,
            _dir: dir,
        }
    }

    /// The program with `args`, on alpha's device, output piped.
    fn spawn(&self, args: &[&str]) -> Child {
        self.shim
            .command(self.exe.to_str().expect("UTF-8 path"), &self.vdev.socket)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run the contexts program")
    }

    /// Runs the program to its end (60 s at most): exit code and output.
    fn run(&self, args: &[&str]) -> (Option<i32>, String) {
        let (out, late) = wait_output(self.spawn(args), Duration::from_secs(60));
        assert!(!late, "{args:?} was killed: too slow\n{}", self.logs());
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    }

    /// QPs hostd holds for alpha now.
    fn qps(&self) -> u64 {
        self.hostd.usage("alpha")["qps"]
            .as_u64()
            .unwrap_or(u64::MAX)
    }

    /// Waits (10 s at most) until hostd holds `n` QPs of alpha.
    fn wait_qps(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.qps() != n {
            assert!(
                Instant::now() < deadline,
                "alpha holds {} QPs, not {n}\n{}",
                self.qps(),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn logs(&self) -> String {
        format!(
            "--- hostd log:\n{}\n--- vdev log:\n{}",
            self.hostd.log(),
            self.vdev.log()
        )
    }
}

/// Reads `child`'s stdout until a line equal to `line` (within 30 s).
fn wait_line(child: &mut Child, line: &str) -> BufReader<std::process::ChildStdout> {
    let out = child.stdout.take().expect("piped stdout");
    let mut reader = BufReader::new(out);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = String::new();
    loop {
        got.clear();
        let n = reader
            .read_line(&mut got)
            .expect("read the program's output");
        assert!(n > 0, "the program ended before printing {line:?}");
        if got.trim_end() == line {
            return reader;
        }
        assert!(Instant::now() < deadline, "no {line:?} within 30 s");
    }
}

#[test]
fn one_process_opens_the_device_eight_times_and_writes_between_its_contexts() {
    let s = Setup::start();
    // 8 contexts × 2 QPs: the device's whole QP quota, over all contexts.
    let (code, text) = s.run(&["many", "8"]);
    assert_eq!(code, Some(0), "{text}\n{}", s.logs());
    assert!(text.contains("8 contexts OK"), "{text}");
    // Closed, they gave everything back: the quota is whole again.
    s.wait_qps(0);
    let (code, text) = s.run(&["many", "8"]);
    assert_eq!(code, Some(0), "again: {text}\n{}", s.logs());
    // One context more than the quota holds: refused, not overcommitted.
    let (code, text) = s.run(&["many", "9"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("ibv_create_qp"), "{text}");
}

#[test]
fn eight_processes_share_the_device_and_one_killed_loses_only_its_own() {
    let s = Setup::start();
    let mut running: Vec<(Child, BufReader<_>)> = (0..PROCESSES)
        .map(|id| {
            let mut child = s.spawn(&["alone", &id.to_string(), "8"]);
            let reader = wait_line(&mut child, "running");
            (child, reader)
        })
        .collect();
    s.wait_qps(MAX_QP);
    // The device's quota is full: a ninth process is refused its QPs (the
    // errno vdev gives for a quota).
    let (code, text) = s.run(&["alone", "99", "1"]);
    assert_eq!(code, Some(3), "{text}");
    assert!(
        text.contains(&format!("quota errno {}", libc::ENOMEM)),
        "{text}"
    );
    // One process dies mid-traffic, without cleaning up.
    let (mut victim, _) = running.remove(3);
    victim.kill().expect("kill");
    let _ = victim.wait();
    // Its two QPs are freed in hostd and in vdev's quota...
    s.wait_qps(MAX_QP - 2);
    // ...so a newcomer gets them, while the others still run.
    let (code, text) = s.run(&["alone", "100", "1"]);
    assert_eq!(code, Some(0), "{text}\n{}", s.logs());
    assert!(text.contains("100 OK"), "{text}");
    // Every other process ran on to its end, every WRITE checked.
    for (i, (child, mut reader)) in running.into_iter().enumerate() {
        let (out, late) = wait_output(child, Duration::from_secs(60));
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut reader, &mut rest);
        assert!(
            out.status.success() && !late && rest.contains("OK rounds="),
            "process {i}: {:?}\n{rest}{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            s.logs()
        );
    }
    s.wait_qps(0);
}

/// Raises this process's soft limit of open descriptors to its hard limit:
/// 64 open devices hold some 800.
fn more_descriptors() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one rlimit structure we own.
    let ok = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0
        }
    };
    assert!(ok, "RLIMIT_NOFILE: {}", std::io::Error::last_os_error());
}

/// A device serves 64 contexts at once (vdev's `MAX_CONTEXTS`, hostd's
/// `MAX_CONTEXTS_PER_DEVICE`), each working; a 65th waits for one to
/// close, and one that will not wait gets EBUSY.
#[test]
fn a_device_serves_sixty_four_contexts_and_the_next_waits_for_one_to_close() {
    use vrdma_guest_driver::{Context, Error, VhostUserTransport};
    more_descriptors();
    let hostd = Hostd::start(None);
    let vdev = Vdev::on_hostd(&hostd, "alpha", &[]);
    let mut open: Vec<Context> = (0..64)
        .map(|i| {
            Context::open_vhost_user(&vdev.socket)
                .unwrap_or_else(|e| panic!("context {i}: {e}\n{}", vdev.log()))
        })
        .collect();
    // Each is a device of its own objects: a PD in every one.
    for (i, ctx) in open.iter().enumerate() {
        let pd = ctx
            .alloc_pd()
            .unwrap_or_else(|e| panic!("PD of context {i}: {e}"));
        assert_eq!(pd.pdn(), 1, "context {i} numbers its own objects");
    }
    let impatient = VhostUserTransport::connect_within(&vdev.socket, Duration::from_millis(300))
        .map(|_| ())
        .map_err(Error::from);
    match impatient {
        Err(e) => assert_eq!(e.errno(), libc::EBUSY, "{e:?}"),
        Ok(()) => panic!("a 65th context was served:\n{}", vdev.log()),
    }
    drop(open.remove(0));
    let next = Context::open_vhost_user(&vdev.socket)
        .unwrap_or_else(|e| panic!("a context once one closed: {e}\n{}", vdev.log()));
    let pd = next.alloc_pd().expect("its PD");
    assert_eq!(pd.pdn(), 1);
    drop(pd);
    drop((next, open));
    let mut vdev = vdev;
    assert!(vdev.is_running(), "vdev serves on:\n{}", vdev.log());
}
