//! What an application sees when its device's vdev dies and comes back,
//! and when hostd is upgraded by handover: the longest gap between two of
//! its completions while 64-byte RDMA WRITEs run back to back (one in
//! flight), with the vdev SIGKILLed and restarted in the middle (then
//! hostd handed over in the middle), against the longest gap of the same
//! traffic in a window of the same length without either, measured in the
//! same run. Then the first control verb after the restart (it waits for
//! the new vdev and its takeover of the context): how long it took.

use std::time::{Duration, Instant};

use vrdma_guest_driver::WorkCompletion;

use crate::host::{poll_ok, Host, Link, BENCH_POLICY};
use crate::report::{us, Bound, Targets};
use crate::{verbs, BenchError, Result};

/// Each window's length; the restart comes this far into its window.
pub const WINDOW: Duration = Duration::from_millis(1500);
const KILL_AT: Duration = Duration::from_millis(300);
/// The longest gap an application may see across a vdev restart.
const TARGET_GAP: Duration = Duration::from_millis(100);
/// The longest gap an application may see across a hostd handover.
pub const TARGET_HANDOVER_GAP: Duration = Duration::from_millis(250);
/// A WRITE not completed by then counts as lost (the run fails).
const STALL: Duration = Duration::from_secs(10);

/// Back-to-back WRITEs of 64 bytes from `link.a` for `window`: the longest
/// gap between two completions, and how many completed.
pub fn longest_gap(link: &Link<'_>, window: Duration) -> Result<(Duration, u64)> {
    let mut wcs = [WorkCompletion::default(); 4];
    let (start, mut last, mut longest, mut done) =
        (Instant::now(), Instant::now(), Duration::ZERO, 0u64);
    while start.elapsed() < window {
        crate::latency::write(&link.qa, &link.ma, 0, &link.mb, 0, 64, true)?;
        let posted = Instant::now();
        while poll_ok(&link.a.cq, &mut wcs)? == 0 {
            if posted.elapsed() > STALL {
                return Err(BenchError::Setup {
                    what: "complete a WRITE".into(),
                    detail: format!("none completed in {} s", STALL.as_secs()),
                });
            }
        }
        let now = Instant::now();
        longest = longest.max(now - last);
        last = now;
        done += 1;
    }
    Ok((longest, done))
}

/// Like [`longest_gap`] across a crash and restart of hostd, which fails
/// the application's connected QPs: a failed completion, or none within
/// a second, makes the application do what RDMA applications do — drop
/// its QPs and connect new ones, trying until hostd takes them. The gap
/// runs from the last good completion to the next.
fn longest_gap_reconnecting(link: &mut Link<'_>, window: Duration) -> Result<(Duration, u32)> {
    let (a, b) = (link.a, link.b);
    let mut wcs = [WorkCompletion::default(); 16];
    let (start, mut last, mut longest, mut reconnects) =
        (Instant::now(), Instant::now(), Duration::ZERO, 0u32);
    while start.elapsed() < window {
        let posted = Instant::now();
        let ok =
            crate::latency::write(&link.qa, &link.ma, 0, &link.mb, 0, 64, true).and_then(|()| {
                loop {
                    if poll_ok(&link.a.cq, &mut wcs[..1])? > 0 {
                        return Ok(true);
                    }
                    if posted.elapsed() > Duration::from_secs(1) {
                        return Ok(false);
                    }
                }
            });
        if matches!(ok, Ok(true)) {
            let now = Instant::now();
            longest = longest.max(now - last);
            last = now;
            continue;
        }
        // Connect anew; while hostd is away every verb fails (EIO).
        let deadline = Instant::now() + Duration::from_secs(30);
        *link = loop {
            match Link::new(a, b, 64, 16) {
                Ok(fresh) => break fresh,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => return Err(e),
            }
        };
        reconnects += 1;
        // The old QPs' flushed work lands in the same CQs.
        let settle = Instant::now();
        while settle.elapsed() < Duration::from_millis(5) {
            let _ = a.cq.poll(&mut wcs);
            let _ = b.cq.poll(&mut wcs);
        }
    }
    Ok((longest, reconnects))
}

/// [`longest_gap`] over a [`WINDOW`] in which `host`'s hostd is handed
/// over [`KILL_AT`] in (after a warm-up): the gap, the completions, and
/// how long the new hostd took from its start to the previous one's exit.
pub fn across_a_handover(link: &Link<'_>, host: &Host) -> Result<(Duration, u64, Duration)> {
    longest_gap(link, Duration::from_millis(300))?;
    std::thread::scope(|s| -> Result<(Duration, u64, Duration)> {
        let upgrader = s.spawn(|| -> Result<Duration> {
            std::thread::sleep(KILL_AT);
            host.hand_over_hostd()
        });
        let (gap, n) = longest_gap(link, WINDOW)?;
        let took = upgrader.join().map_err(|_| BenchError::Panicked)??;
        Ok((gap, n, took))
    })
}

pub fn run(targets: &mut Targets) -> Result<()> {
    let host = Host::start(Some(BENCH_POLICY), &[])?;
    let a = host.tenant("alpha")?;
    let b = host.tenant("beta")?;
    let mut link = Link::new(&a, &b, 64, 16)?;
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
    // hostd upgraded by handover under the same traffic: the application
    // does nothing about it.
    let (handover_gap, handover_n, handover) = across_a_handover(&link, &host)?;
    println!(
        "hostd handover: the same WRITEs, {:.1} s window, hostd handed over to a new hostd (--take-over) {} ms in: longest gap between completions {} ({handover_n} completions, every one successful; the new hostd started and the previous one exited within {})",
        WINDOW.as_secs_f64(),
        KILL_AT.as_millis(),
        us(handover_gap),
        us(handover),
    );
    // For comparison: hostd SIGKILLed and restarted under the same traffic.
    let (hostd_gap, reconnects) = std::thread::scope(|s| -> Result<(Duration, u32)> {
        let killer = s.spawn(|| -> Result<()> {
            std::thread::sleep(KILL_AT);
            host.restart_hostd()
        });
        let measured = longest_gap_reconnecting(&mut link, Duration::from_secs(3))?;
        killer.join().map_err(|_| BenchError::Panicked)??;
        Ok(measured)
    })?;
    println!(
        "hostd restart, for comparison: the same WRITEs for 3 s with hostd SIGKILLed and restarted {} ms in, the application connecting new QPs when its work fails: longest gap between good completions {} ({reconnects} reconnection(s))",
        KILL_AT.as_millis(),
        us(hostd_gap)
    );
    targets.check(
        "vdev SIGKILL + restart: longest completion gap",
        gap.as_secs_f64() * 1e3,
        " ms",
        Bound::AtMost(TARGET_GAP.as_secs_f64() * 1e3),
    );
    targets.check(
        "hostd handover: longest completion gap",
        handover_gap.as_secs_f64() * 1e3,
        " ms",
        Bound::AtMost(TARGET_HANDOVER_GAP.as_secs_f64() * 1e3),
    );
    Ok(())
}
