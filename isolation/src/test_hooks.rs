//! Test-only hooks (cargo feature `test-hooks`, never a default feature of
//! any crate): they let the sandbox tests make a daemon (vdev, hostd)
//! misbehave from inside its sandbox, as a compromised daemon would, and
//! act on a kernel without landlock.
//!
//! - `VRDMA_TEST_FORBIDDEN=<op>`: right after the sandbox is up, a thread
//!   started by the main thread (so under the main thread's filter)
//!   attempts that operation and logs `test hook: <op>: ...` with the
//!   outcome; the daemon goes on serving (if it survives the attempt).
//!   The operations: `execve`, `open-passwd`, `inet-socket`,
//!   `unix-socket` (an `AF_UNIX` seqpacket socket), `unix-socketpair` (a
//!   connected pair of them) and `memfd` (a sealable memfd).
//! - `VRDMA_TEST_FORBIDDEN_IN=<role>` with it: the operation is attempted
//!   instead by the first thread of that role, right after the thread has
//!   installed its role's filter, and logged as
//!   `test hook (<role>): <op>: ...`.
//! - `VRDMA_TEST_LANDLOCK=absent`: the landlock step acts as on a kernel
//!   without landlock (nothing restricted), to exercise the refusal and
//!   `--allow-no-landlock`.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether the landlock step should act as on a kernel without landlock.
pub fn landlock_absent() -> bool {
    std::env::var("VRDMA_TEST_LANDLOCK").is_ok_and(|v| v == "absent")
}

/// Starts the forbidden operation `VRDMA_TEST_FORBIDDEN` names, if any,
/// on a new thread.
pub fn after_sandbox() {
    let Ok(op) = std::env::var("VRDMA_TEST_FORBIDDEN") else {
        return;
    };
    if std::env::var_os("VRDMA_TEST_FORBIDDEN_IN").is_some() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("test-hook".into())
        .spawn(move || {
            let outcome = attempt(&op);
            tracing::warn!("test hook: {op}: {outcome}");
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "test hook: cannot start its thread");
    }
}

/// In a thread of `role` that has just installed its filter: attempts the
/// operation `VRDMA_TEST_FORBIDDEN` names if `VRDMA_TEST_FORBIDDEN_IN`
/// names `role` (once per process).
pub fn in_role(role: &str) {
    static DONE: AtomicBool = AtomicBool::new(false);
    let (Ok(op), Ok(wanted)) = (
        std::env::var("VRDMA_TEST_FORBIDDEN"),
        std::env::var("VRDMA_TEST_FORBIDDEN_IN"),
    ) else {
        return;
    };
    if wanted != role || DONE.swap(true, Ordering::SeqCst) {
        return;
    }
    let outcome = attempt(&op);
    tracing::warn!("test hook ({role}): {op}: {outcome}");
}

fn attempt(op: &str) -> String {
    let result = match op {
        "execve" => {
            let path = c"/bin/true";
            let argv = [path.as_ptr(), std::ptr::null()];
            let envp = [std::ptr::null()];
            // SAFETY: NUL-terminated path, argv and envp arrays ending in
            // null; on success this process image is replaced.
            unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
            Err(std::io::Error::last_os_error())
        }
        "open-passwd" => std::fs::File::open("/etc/passwd").map(drop),
        "inet-socket" => {
            // SAFETY: socket takes integers; the result is checked.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
            close_fd(fd)
        }
        "unix-socket" => {
            // SAFETY: socket takes integers; the result is checked.
            let fd = unsafe {
                libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0)
            };
            close_fd(fd)
        }
        "unix-socketpair" => {
            let mut fds = [-1; 2];
            let kind = libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC;
            // SAFETY: `fds` has room for the two descriptors socketpair
            // writes; the result is checked.
            let rc = unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) };
            if rc == 0 {
                // SAFETY: closes the second descriptor just created.
                unsafe { libc::close(fds[1]) };
            }
            close_fd(if rc == 0 { fds[0] } else { -1 })
        }
        "memfd" => {
            let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
            // SAFETY: a NUL-terminated name and integer flags.
            let fd = unsafe { libc::memfd_create(c"test-hook".as_ptr(), flags) };
            close_fd(fd)
        }
        other => return format!("unknown operation {other:?}"),
    };
    match result {
        Ok(()) => "succeeded".into(),
        Err(e) => format!("failed: errno {}", e.raw_os_error().unwrap_or(0)),
    }
}

/// The outcome of a call that returned descriptor `fd` (or -1), which is
/// closed again.
fn close_fd(fd: libc::c_int) -> std::io::Result<()> {
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: closes the descriptor just created, which nothing else owns.
    unsafe { libc::close(fd) };
    Ok(())
}
