//! Where the threads run. On a host with cores to spare an operator
//! dedicates some to hostd's datapath, as to a NIC's packet cores
//! (`hostd --datapath-cpus`); the tenants' threads run on the others.
//! That is the bench's default layout (`--layout dedicated`): hostd's one
//! datapath thread on the last CPU, the tenants' threads on the rest.
//! `--layout shared` lets the kernel place every thread.
//!
//! Each baseline runs in whichever layout suits it best: TCP and the
//! direct shared-memory ping-pong on every CPU, the relayed ping-pong in
//! both layouts, its best reported.

use std::sync::OnceLock;

use clap::ValueEnum;
use vrdma_isolation::cpus;
use vrdma_tenant_policy::PriorityClass;

use crate::BenchError;

/// The layout `--layout` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Layout {
    /// hostd's datapath on a core of its own, the tenants on the others.
    Dedicated,
    /// Every thread wherever the kernel puts it.
    Shared,
}

/// The layout in force, with its CPUs.
#[derive(Debug, Clone)]
struct Cores {
    /// Every CPU the bench may use.
    all: Vec<usize>,
    /// hostd's datapath CPU, when dedicated.
    datapath: Option<usize>,
    /// See [`yield_every`].
    yield_every: u32,
}

static CORES: OnceLock<Cores> = OnceLock::new();

/// Chooses the layout, once, before any thread or daemon starts: a
/// dedicated core needs at least two CPUs (one left for the tenants).
pub fn choose(layout: Layout) -> std::io::Result<()> {
    let all = cpus::allowed()?;
    let datapath = match layout {
        Layout::Dedicated if all.len() >= 2 => all.last().copied(),
        _ => None,
    };
    let tenants = all.len() - usize::from(datapath.is_some());
    let yield_every = if tenants <= 1 { 1 } else { SHARED_YIELD_EVERY };
    let _ = CORES.set(Cores {
        all,
        datapath,
        yield_every,
    });
    enter_tenant_cores()
}

fn cores() -> Option<&'static Cores> {
    CORES.get()
}

/// The datapath's dedicated CPU, if any.
pub fn datapath_cpu() -> Option<usize> {
    cores().and_then(|c| c.datapath)
}

/// hostd's arguments for the layout.
pub fn hostd_args() -> Vec<String> {
    datapath_cpu()
        .map(|cpu| vec!["--datapath-cpus".into(), cpu.to_string()])
        .unwrap_or_default()
}

/// The tenants' CPUs: every CPU but the datapath's.
fn tenant_cpus() -> Vec<usize> {
    cores().map_or_else(Vec::new, |c| {
        c.all
            .iter()
            .copied()
            .filter(|&cpu| Some(cpu) != c.datapath)
            .collect()
    })
}

/// Moves the calling thread (and the threads and processes it starts
/// later) onto the tenants' CPUs.
pub fn enter_tenant_cores() -> std::io::Result<()> {
    match tenant_cpus() {
        cpus if cpus.is_empty() => Ok(()),
        cpus => cpus::pin_current_thread(&cpus),
    }
}

/// Runs `f` with the calling thread (and what it starts) allowed on every
/// CPU: daemons that pin their own threads, and baselines at their best.
pub fn on_every_cpu<T>(f: impl FnOnce() -> T) -> std::io::Result<T> {
    if let Some(c) = cores() {
        cpus::pin_current_thread(&c.all)?;
    }
    let out = f();
    enter_tenant_cores()?;
    Ok(out)
}

/// Runs `f` with the calling thread (and what it starts: a daemon and all
/// its threads) on the datapath's CPU if one is dedicated, else on every
/// CPU. For hostds that share that core (one per host of the cross-host
/// test): pinned from outside, each still yields its core on every idle
/// turn as an unpinned hostd does, where `--datapath-cpus` would make
/// each believe it has the core to itself.
pub fn on_datapath_cpu<T>(f: impl FnOnce() -> T) -> std::io::Result<T> {
    let Some(c) = cores() else {
        return Ok(f());
    };
    match c.datapath {
        Some(cpu) => cpus::pin_current_thread(&[cpu])?,
        None => cpus::pin_current_thread(&c.all)?,
    }
    let out = f();
    enter_tenant_cores()?;
    Ok(out)
}

/// The host's side of a control-plane measurement: while it lives, every
/// thread of the processes it was given (hostds, vdevs) runs on the
/// datapath's CPU, as a cloud host's daemons run on the host's cores and
/// never on the vCPUs of the tenants they serve; the tenants' programs
/// stay on the other CPUs. Each thread gets its CPUs back on drop. Without
/// a dedicated CPU it does nothing.
pub struct HostSide {
    before: Vec<(libc::pid_t, Vec<usize>)>,
}

impl HostSide {
    /// Moves every thread of `pids` onto the datapath's CPU.
    pub fn enter(pids: &[u32]) -> std::io::Result<HostSide> {
        let mut side = HostSide { before: Vec::new() };
        let Some(cpu) = datapath_cpu() else {
            return Ok(side);
        };
        for &pid in pids {
            for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
                let Some(tid) = (entry?.file_name().to_str()).and_then(|t| t.parse().ok()) else {
                    continue;
                };
                let before = cpus::allowed_of(tid)?;
                cpus::pin_thread(tid, &[cpu])?;
                side.before.push((tid, before));
            }
        }
        Ok(side)
    }
}

impl Drop for HostSide {
    fn drop(&mut self) {
        for (tid, cpus) in &self.before {
            // A thread gone meanwhile has nothing to get back.
            let _ = cpus::pin_thread(*tid, cpus);
        }
    }
}

/// Spinning turns between two yields of a thread that waits, on cores
/// it shares with the thread it waits for (more spinners than cores).
pub const SHARED_YIELD_EVERY: u32 = 64;

/// Spinning turns between two yields of a waiting tenant thread: every
/// turn when the tenants have one core (the thread a waiter waits for is
/// then the one it keeps off that core), else now and then.
pub fn yield_every() -> u32 {
    cores().map_or(SHARED_YIELD_EVERY, |c| c.yield_every)
}

/// Gives the calling thread (and the threads it starts) the CPU priority
/// of a tenant of `class`: its threads stand for the tenant's vCPUs, which
/// an operator weights by class as hostd does the tenant's traffic
/// (realtime niceness 0, priority 5, normal 10). A realtime tenant's
/// latency then depends on hostd's scheduling, not on whether a flooding
/// tenant's thread holds the one core the tenants share here.
pub fn run_as(class: PriorityClass) -> Result<(), BenchError> {
    let nice = match class {
        PriorityClass::Realtime => 0,
        PriorityClass::Priority => 5,
        PriorityClass::Normal => 10,
    };
    // SAFETY: setpriority takes plain integers; who 0 is the calling
    // thread (Linux niceness is per thread).
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
        return Err(BenchError::Cores(std::io::Error::last_os_error()));
    }
    Ok(())
}
