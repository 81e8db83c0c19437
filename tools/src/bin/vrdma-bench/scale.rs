//! How hostd scales with tenants: many tenants (one vdev process each),
//! each running traffic on many QPs, against two tenants doing the same;
//! and what the daemons cost when nothing moves.
//!
//! Tenants are paired; each QP of a pair's first tenant is connected to a
//! QP of the second, and both ends stream 64-byte WRITEs into the other's
//! buffer. One thread drives every QP (as few spinners as possible on a
//! small host: hostd's datapath thread needs the other core), posting
//! lists of [`BATCH`] whenever a QP has room and polling every CQ.

use std::time::{Duration, Instant};

use vrdma_guest_driver::{QueuePair, SendPayload, SendWr, Sge, WorkCompletion};
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::SendOpcode;

use crate::baselines::pause;
use crate::host::{connect, policy, poll_ok, Buffer, Host, Tenant};
use crate::report::{Bound, Targets};
use crate::{throughput, verbs, BenchError, Result};

/// Work requests in flight per QP.
const WINDOW: usize = 32;
/// Work requests per post, the last signaled.
const BATCH: usize = 8;
/// Message size.
const SIZE: usize = 64;
/// Each tenant's CQ: room for every signaled request of its QPs (16 × 4),
/// and no more — as an application sizes it. A far larger ring would
/// spread each tenant's completions over far more memory than they need,
/// and 64 of them would measure the caches, not hostd.
const CQ_DEPTH: u32 = 256;
/// Trials of each fleet, alternating.
const TRIALS: usize = 5;
/// How long the idle daemons are watched.
const IDLE_FOR: Duration = Duration::from_secs(5);

/// Tenants, their QPs, and hostd, ready for traffic.
struct Fleet {
    /// One sending QP per entry: (its tenant's index, the QP, the peer's
    /// buffer offset it writes to), and the buffers, one per tenant.
    qps: Vec<(usize, QueuePair, u64)>,
    buffers: Vec<Buffer>,
    tenants: Vec<Tenant>,
    host: Host,
}

impl Fleet {
    fn new(tenants: usize, qps: usize) -> Result<Self> {
        let names: Vec<String> = (0..tenants).map(|i| format!("t{i:02}")).collect();
        let policy = policy(names.iter().map(|n| (n.as_str(), "normal", 1)));
        // Two physical queues per device by default: enough for all.
        let physical = (2 * tenants).max(64).to_string();
        let host = Host::start(Some(&policy), &["--physical-qps", &physical])?;
        let tenants = names
            .iter()
            .map(|name| host.tenant_with_cq(name, CQ_DEPTH))
            .collect::<Result<Vec<_>>>()?;
        let buffers = tenants
            .iter()
            .map(|t| t.buffer(qps * SIZE))
            .collect::<Result<Vec<_>>>()?;
        let mut all = Vec::with_capacity(tenants.len() * qps);
        for pair in (0..tenants.len())
            .step_by(2)
            .filter(|&p| p + 1 < tenants.len())
        {
            let (a, b) = (&tenants[pair], &tenants[pair + 1]);
            for j in 0..qps {
                let (qa, qb) = (a.qp(WINDOW as u32)?, b.qp(WINDOW as u32)?);
                connect(a, &qa, b, &qb)?;
                let at = (j * SIZE) as u64;
                all.push((pair, qa, at));
                all.push((pair + 1, qb, at));
            }
        }
        Ok(Fleet {
            qps: all,
            buffers,
            tenants,
            host,
        })
    }

    /// Streams on every QP for `duration` (after a tenth as long of
    /// warm-up); operations per second.
    fn drive(&self, duration: Duration) -> Result<f64> {
        // Each QP writes its own 64 bytes of its peer's buffer in lists
        // whose last request is signaled and names the QP.
        let sges: Vec<[Sge; 1]> = self
            .qps
            .iter()
            .map(|&(tenant, _, at)| [self.buffers[tenant].sge(at, SIZE as u32)])
            .collect();
        let lists: Vec<Vec<SendWr<'_>>> = self
            .qps
            .iter()
            .zip(&sges)
            .enumerate()
            .map(|(i, ((tenant, _, at), sge))| {
                let dst = &self.buffers[tenant ^ 1];
                let mut wr = SendWr::new(i as u64, SendOpcode::RdmaWrite, SendPayload::Sges(sge));
                wr.remote_addr = dst.iova() + at;
                wr.rkey = dst.rkey();
                let mut list = vec![wr; BATCH];
                if let Some(last) = list.last_mut() {
                    last.flags = SIGNALED;
                }
                list
            })
            .collect();
        // Every window full, then completion-driven: each completion frees
        // a list's slots on its QP, which posts the list again at once (no
        // scan of every QP per turn: the load generator's cost per
        // operation must not grow with the QPs, or it, not hostd, would
        // be what the comparison measures).
        let mut in_flight = vec![0usize; self.qps.len()];
        let qps = self.qps.iter().map(|(_, qp, _)| qp);
        throughput::fill_windows(qps, &lists, &mut in_flight, WINDOW)?;
        let mut wcs = [WorkCompletion::default(); 64];
        let (mut done, mut spins) = (0usize, 0u32);
        let mut meter = throughput::Meter::new(duration);
        let rate = loop {
            if let Some(rate) = meter.tick(Instant::now(), done) {
                break rate;
            }
            let mut polled = 0;
            for tenant in &self.tenants {
                let n = poll_ok(&tenant.cq, &mut wcs)?;
                for wc in &wcs[..n] {
                    let i = wc.wr_id as usize;
                    let (Some((_, qp, _)), Some(list)) = (self.qps.get(i), lists.get(i)) else {
                        return Err(BenchError::Panicked);
                    };
                    qp.post_send(list).map_err(BenchError::Post)?;
                }
                polled += n;
            }
            done += polled * BATCH;
            if polled == 0 {
                spins = spins.wrapping_add(1);
                pause(spins);
            }
        };
        // Let what is in flight complete before the QPs go.
        let deadline = Instant::now() + Duration::from_secs(5);
        while in_flight.iter().any(|&f| f > 0) && Instant::now() < deadline {
            for tenant in &self.tenants {
                let n = tenant.cq.poll(&mut wcs).map_err(verbs("poll a CQ"))?;
                for wc in &wcs[..n] {
                    if let Some(flight) = in_flight.get_mut(wc.wr_id as usize) {
                        *flight = flight.saturating_sub(BATCH);
                    }
                }
            }
        }
        Ok(rate)
    }

    /// The CPU time hostd and every vdev take over [`IDLE_FOR`] with
    /// devices open and QPs connected but no traffic, as a fraction of one
    /// core.
    fn idle_share(&self) -> Result<f64> {
        let pids: Vec<u32> = std::iter::once(self.host.hostd_pid())
            .chain(self.tenants.iter().map(Tenant::vdev_pid))
            .collect();
        // Past the pollers' spin.
        std::thread::sleep(Duration::from_millis(500));
        let before = cpu_time(&pids)?;
        let start = Instant::now();
        std::thread::sleep(IDLE_FOR);
        let used = cpu_time(&pids)?.saturating_sub(before);
        Ok(used.as_secs_f64() / start.elapsed().as_secs_f64())
    }
}

/// The CPU time all threads of `pids` have used, from
/// `/proc/<pid>/task/<tid>/schedstat` (nanoseconds on a CPU).
fn cpu_time(pids: &[u32]) -> Result<Duration> {
    let mut total = 0u64;
    for &pid in pids {
        let read = |source| BenchError::Cpu { pid, source };
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).map_err(read)? {
            let mut path = task.map_err(read)?.path();
            path.push("schedstat");
            // A thread that ended meanwhile took its time with it.
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let ns = text
                .split_whitespace()
                .next()
                .and_then(|f| f.parse::<u64>().ok());
            total += ns.unwrap_or(0);
        }
    }
    Ok(Duration::from_nanos(total))
}

/// `tenants` tenants with `qps` QPs each against two tenants with as many,
/// in [`TRIALS`] alternating trials of `duration` each, the best of each
/// reported (both fleets stay up; the one not driven sleeps); then the
/// daemons' idle CPU with all of the many.
pub fn run(tenants: usize, qps: usize, duration: Duration, targets: &mut Targets) -> Result<()> {
    let two_fleet = Fleet::new(2, qps)?;
    let fleet = Fleet::new(tenants, qps)?;
    let (mut twos, mut manys) = (Vec::new(), Vec::new());
    for _ in 0..TRIALS {
        twos.push(two_fleet.drive(duration)? / 1e6);
        manys.push(fleet.drive(duration)? / 1e6);
    }
    drop(two_fleet);
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let (two, many) = (best(&twos), best(&manys));
    let ratio = many / two;
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "scale      {qps} QPs per tenant streaming 64 B WRITEs, best of {TRIALS}: 2 tenants {two:.3} Mop/s, {tenants} tenants {many:.3} Mop/s, ratio {ratio:.2} (trials: {} | {})",
        list(&twos),
        list(&manys),
    );
    let what = format!("{tenants} tenants x {qps} QPs / 2 tenants, op/s");
    targets.check(what, ratio, "", Bound::AtLeast(0.8));
    let idle = fleet.idle_share()?;
    println!(
        "idle       hostd + {tenants} vdevs, devices open and {} QPs connected, no traffic for {} s: {:.3} % of a core",
        fleet.qps.len(),
        IDLE_FOR.as_secs(),
        idle * 100.0
    );
    let what = format!("idle CPU of hostd + {tenants} vdevs, % of a core");
    targets.check(what, idle * 100.0, " %", Bound::AtMost(1.0));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The idle figure is only as good as the clock it reads: a thread of
    /// this process that spins for 100 ms must show up as about that.
    #[test]
    fn cpu_time_sees_a_spinning_thread() {
        let me = std::process::id();
        let before = cpu_time(&[me]).expect("own schedstat");
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(100) {
            std::hint::spin_loop();
        }
        let used = cpu_time(&[me]).expect("own schedstat") - before;
        assert!(used >= Duration::from_millis(30), "{used:?}");
        assert!(cpu_time(&[u32::MAX]).is_err(), "no such process");
    }
}
