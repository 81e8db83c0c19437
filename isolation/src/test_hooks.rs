//! Test-only hooks (cargo feature `test-hooks`, never a default feature of
//! any crate): they let the sandbox tests make a daemon (vdev, hostd)
//! misbehave from inside its sandbox, as a compromised daemon would, and
//! act on a kernel without landlock.
//!
//! - `VRDMA_TEST_FORBIDDEN=execve|open-passwd|inet-socket`: right after
//!   the sandbox is up, a thread attempts that operation and logs
//!   `test hook: <op>: ...` with the outcome; the daemon goes on serving (if it
//!   survives the attempt).
//! - `VRDMA_TEST_LANDLOCK=absent`: the landlock step acts as on a kernel
//!   without landlock (nothing restricted), to exercise the refusal and
//!   `--allow-no-landlock`.

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
            if fd < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                // SAFETY: closes the descriptor just created.
                unsafe { libc::close(fd) };
                Ok(())
            }
        }
        other => return format!("unknown operation {other:?}"),
    };
    match result {
        Ok(()) => "succeeded".into(),
        Err(e) => format!("failed: errno {}", e.raw_os_error().unwrap_or(0)),
    }
}
