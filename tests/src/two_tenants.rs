//! Unmodified programs between two process-mode tenants of one hostd:
//! [`Fabric`] starts hostd with its two default tenants' vdevs (alpha and
//! beta), and [`run_pair`] runs a client/server program (perftest,
//! ibverbs-utils, ucx_perftest) through the drop-in `libibverbs.so.1`,
//! the server on alpha's device and the client on beta's; they meet over
//! TCP on 127.0.0.1.

use std::path::Path;
use std::process::{Child, Command, Output};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::daemon::{tcp_listening, track, wait_output, Hostd, IbverbsShim, Vdev};

/// The tests share two cores with the daemons: one program pair (or one
/// job) at a time within a test binary.
static SERIAL: Mutex<()> = Mutex::new(());

/// Holds the test binary's one-at-a-time lock (a failed test does not
/// poison it for the others).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A TCP port for one run's QP exchange (distinct within this process).
pub fn next_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20000 + (std::process::id() % 20000) as u16;
    base + NEXT.fetch_add(1, Ordering::Relaxed)
}

/// hostd with its two default tenants' vdevs.
pub struct Fabric {
    // Dropped in declaration order: the vdevs before hostd.
    pub alpha: Vdev,
    pub beta: Vdev,
    pub hostd: Hostd,
}

impl Fabric {
    pub fn start() -> Self {
        Self::start_with_hostd_args(&[])
    }

    /// [`Fabric::start`] with more arguments for hostd.
    pub fn start_with_hostd_args(args: &[&str]) -> Self {
        let hostd = Hostd::start_with(None, args);
        let alpha = Vdev::on_hostd(&hostd, "alpha", &[]);
        let beta = Vdev::on_hostd(&hostd, "beta", &[]);
        Fabric { alpha, beta, hostd }
    }

    /// The three daemons' logs, for a failure's message.
    pub fn logs(&self) -> String {
        format!(
            "--- hostd log:\n{}\n--- vdev alpha log:\n{}\n--- vdev beta log:\n{}",
            self.hostd.log(),
            self.alpha.log(),
            self.beta.log()
        )
    }
}

/// What the two sides of a [`run_pair`] printed.
pub struct Run {
    pub server: Output,
    pub client: Output,
}

impl Run {
    /// A program's stdout and stderr, one after the other.
    pub fn text(o: &Output) -> String {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    pub fn server_text(&self) -> String {
        Self::text(&self.server)
    }

    pub fn client_text(&self) -> String {
        Self::text(&self.client)
    }
}

/// Runs `program args` alone on `device` (a vdev socket); it must exit 0
/// within `timeout`. Returns its output (stdout, then stderr).
pub fn run_one(
    shim: &IbverbsShim,
    program: &str,
    device: &Path,
    args: &[&str],
    timeout: Duration,
) -> String {
    let child = shim
        .command(program, device)
        .args(args)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    finish(child, &format!("{program} {args:?}"), timeout, String::new)
}

/// Waits for `child` (`what`, for messages): it must exit 0 within
/// `timeout`, or the test fails with its output and `context()` (e.g.
/// the daemons' logs). Returns its output (stdout, then stderr).
pub fn finish(
    child: Child,
    what: &str,
    timeout: Duration,
    context: impl FnOnce() -> String,
) -> String {
    let (out, late) = wait_output(child, timeout);
    let text = Run::text(&out);
    assert!(
        out.status.success() && !late,
        "{what}: {:?}{}\n{text}\n{}",
        out.status,
        if late { " (killed: too slow)" } else { "" },
        context()
    );
    text
}

/// Runs `program args` as the server on alpha and `program args localhost`
/// as the client on beta (both with `-p port`); both must exit 0.
pub fn run_pair(shim: &IbverbsShim, fabric: &Fabric, program: &str, args: &[&str]) -> Run {
    run_pair_with(shim, fabric, program, args, |_| {})
}

/// [`run_pair`] with `setup` applied to both sides' commands (e.g. their
/// environment) before they start.
pub fn run_pair_with(
    shim: &IbverbsShim,
    fabric: &Fabric,
    program: &str,
    args: &[&str],
    setup: impl Fn(&mut Command),
) -> Run {
    let (server, client) = spawn_pair(shim, fabric, program, args, setup);
    finish_pair(fabric, &format!("{program} {args:?}"), server, client)
}

/// Starts `program args` as the server on alpha and its client on beta
/// (`setup` adjusts both commands).
pub fn spawn_pair(
    shim: &IbverbsShim,
    fabric: &Fabric,
    program: &str,
    args: &[&str],
    setup: impl Fn(&mut Command),
) -> (Child, Child) {
    spawn_pair_on(
        shim,
        (&fabric.alpha.socket, &fabric.beta.socket),
        program,
        args,
        setup,
    )
}

/// Starts `program -p PORT args` as a server on the device at `server`
/// and, once it listens on its TCP port, as its client on `client`,
/// connecting to 127.0.0.1 (the programs' out-of-band exchange stays in
/// the test's network namespace, wherever the devices' hosts are).
pub fn spawn_pair_on(
    shim: &IbverbsShim,
    (server, client): (&Path, &Path),
    program: &str,
    args: &[&str],
    setup: impl Fn(&mut Command),
) -> (Child, Child) {
    let port = next_port().to_string();
    let mut s = shim.command(program, server);
    s.args(["-p", &port]).args(args);
    setup(&mut s);
    let s = s.spawn().unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    track(&s);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tcp_listening(port.parse().expect("port")) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = shim.command(program, client);
    c.args(["-p", &port]).args(args).arg("127.0.0.1");
    setup(&mut c);
    let c = c.spawn().unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    track(&c);
    (s, c)
}

/// Waits for both sides of a pair (`what`, for messages): the client up to
/// 120 s, then the server up to 20 s; each must exit 0.
pub fn finish_pair(fabric: &Fabric, what: &str, server: Child, client: Child) -> Run {
    finish_pair_logged(what, (server, Duration::from_secs(20)), client, || {
        fabric.logs()
    })
}

/// Waits for both sides of a pair (`what`, for messages): the client up to
/// 120 s, then the server up to its wait; each must exit 0, else the
/// failure shows both outputs and `logs()`.
pub fn finish_pair_logged(
    what: &str,
    (server, server_wait): (Child, Duration),
    client: Child,
    logs: impl Fn() -> String,
) -> Run {
    let (client, client_late) = wait_output(client, Duration::from_secs(120));
    let (server, server_late) = wait_output(server, server_wait);
    let run = Run { server, client };
    let ok = run.server.status.success() && run.client.status.success();
    let late = |late: bool| if late { " (killed: too slow)" } else { "" };
    assert!(
        ok && !client_late && !server_late,
        "{what}: server {:?}{}, client {:?}{}\n--- server:\n{}\n--- client:\n{}\n{}",
        run.server.status,
        late(server_late),
        run.client.status,
        late(client_late),
        run.server_text(),
        run.client_text(),
        logs()
    );
    run
}
