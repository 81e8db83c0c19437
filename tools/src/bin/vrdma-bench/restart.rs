//! What an application sees when its device's vdev dies and comes back:
//! the longest gap between two of its completions while 64-byte RDMA
//! WRITEs run back to back (one in flight), with the vdev SIGKILLed and
//! restarted in the middle, against the longest gap of the same traffic
//! in a window of the same length without a restart, measured in the same
//! run. Then the first control verb after the restart (it waits for the
//! new vdev and its takeover of the context): how long it took.

use std::time::{Duration, Instant};

use vrdma_guest_driver::WorkCompletion;

use crate::host::{poll_ok, Host, Link, BENCH_POLICY};
use crate::report::{us, Bound, Targets};
use crate::{verbs, BenchError, Result};

/// Each window's length; the restart comes this far into its window.
const WINDOW: Duration = Duration::from_millis(1500);
const KILL_AT: Duration = Duration::from_millis(300);
/// The longest gap an application may see across a vdev restart.
const TARGET_GAP: Duration = Duration::from_millis(100);

/// Back-to-back WRITEs of 64 bytes from `link.a` for `window`: the longest
/// gap between two completions, and how many completed.
fn longest_gap(link: &Link<'_>, window: Duration) -> Result<(Duration, u64)> {
    let mut wcs = [WorkCompletion::default(); 4];
    let (start, mut last, mut longest, mut done) =
        (Instant::now(), Instant::now(), Duration::ZERO, 0u64);
    while start.elapsed() < window {
        crate::latency::write(&link.qa, &link.ma, 0, &link.mb, 0, 64, true)?;
        loop {
            if poll_ok(&link.a.cq, &mut wcs)? > 0 {
                break;
            }
        }
        let now = Instant::now();
        longest = longest.max(now - last);
        last = now;
        done += 1;
    }
    Ok((longest, done))
}

pub fn run(targets: &mut Targets) -> Result<()> {
    let host = Host::start(Some(BENCH_POLICY), &[])?;
    let a = host.tenant("alpha")?;
    let b = host.tenant("beta")?;
    let link = Link::new(&a, &b, 64, 16)?;
    // Warm: the first WRITEs pay for page faults and caches.
    longest_gap(&link, Duration::from_millis(300))?;
    let (quiet, quiet_n) = longest_gap(&link, WINDOW)?;
    let (gap, n, restart) = std::thread::scope(|s| -> Result<(Duration, u64, Duration)> {
        let killer = s.spawn(|| -> Result<Duration> {
            std::thread::sleep(KILL_AT);
            let started = Instant::now();
            a.restart_vdev()?;
            Ok(started.elapsed())
        });
        let (gap, n) = longest_gap(&link, WINDOW)?;
        let restart = killer.join().map_err(|_| BenchError::Panicked)??;
        Ok((gap, n, restart))
    })?;
    // The application's first verb that needs vdev after its restart.
    let started = Instant::now();
    let mr =
        a.pd.alloc_mr(4096, 0)
            .map_err(verbs("register after the restart"))?;
    let verb = started.elapsed();
    drop(mr);
    println!(
        "vdev restart: 64 B WRITEs back to back, {:.1} s windows; longest gap between completions {} without a restart ({quiet_n} completions), {} with alpha's vdev SIGKILLed and restarted {} ms in ({n} completions; the new vdev listened {} after the kill); the first control verb after it (REG_MR) took {}",
        WINDOW.as_secs_f64(),
        us(quiet),
        us(gap),
        KILL_AT.as_millis(),
        us(restart),
        us(verb),
    );
    targets.check(
        "vdev SIGKILL + restart: longest completion gap",
        gap.as_secs_f64() * 1e3,
        " ms",
        Bound::AtMost(TARGET_GAP.as_secs_f64() * 1e3),
    );
    Ok(())
}
