//! Daemons started the way an installation starts them — under a wrapper
//! (`setpriv` with a unit's limits, `chroot` into an installed system)
//! rather than through the supervisor's `Launch` — with their log in a
//! file, waited for by the socket they create, and checked for having
//! dropped every privilege.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `cmd` (info logs, stderr into `log`).
pub fn spawn_logged(mut cmd: Command, log: &Path) -> Child {
    cmd.env("VRDMA_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .unwrap_or_else(|e| panic!("start {cmd:?}: {e}"))
}

/// Waits (20 s at most) for `path` to appear; fails with `child`'s log
/// if it exits first.
pub fn wait_for_path(path: &Path, what: &str, child: &mut Child, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{what} exited {status}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "{what}: no {}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The line where the daemon of `log` says it dropped its privileges;
/// fails unless it kept no capability and emptied its bounding set.
pub fn dropped_everything(log: &Path, name: &str) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = text
        .lines()
        .find(|l| l.contains("Privileges dropped: no capabilities"))
        .unwrap_or_else(|| panic!("{name} dropped nothing:\n{text}"))
        .to_owned();
    assert!(line.contains("bounding_set_left=0"), "{name}: {line}");
    line
}
