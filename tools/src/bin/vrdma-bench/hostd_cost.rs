//! What the hostds' CPUs paid per message: the CPU time of both hostd
//! processes (`/proc/<pid>/stat`, user + system, every thread) over the
//! operations one tenant's device made (hostd's own counters, `vrdmactl
//! stats --json`). Across hosts both hostds share one CPU, so the message
//! rate is about 1 / this: the figure that says where a rate difference
//! comes from, less moved by the machine's speed than the rate itself.

use crate::host::Host;

/// CPU seconds of process `pid` so far (user + system).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which is in parentheses and may
    // hold spaces: state is field 3, utime and stime fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3)?.parse::<u64>().ok();
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|&h| h > 0)?;
    Some((ticks(14)? + ticks(15)?) as f64 / hz as f64)
}

/// Both hostds' CPU seconds and the `kind` operations of `tenant` on the
/// first host so far.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    cpu: f64,
    ops: u64,
}

impl Sample {
    pub fn take(hosts: &[Host; 2], tenant: &str, kind: &str) -> Option<Sample> {
        let cpu = cpu_seconds(hosts[0].hostd_pid())? + cpu_seconds(hosts[1].hostd_pid())?;
        let stats = hosts[0].ctl_json("stats")?;
        let ops = (stats["tenants"].as_array()?.iter())
            .find(|t| t["tenant"] == tenant)
            .and_then(|t| t["ops"][kind].as_u64())?;
        Some(Sample { cpu, ops })
    }

    /// Microseconds of both hostds' CPU per operation from `self` to
    /// `later`.
    pub fn per_op_until(&self, later: &Sample) -> Option<f64> {
        let ops = later.ops.checked_sub(self.ops).filter(|&n| n > 0)?;
        Some((later.cpu - self.cpu) * 1e6 / ops as f64)
    }
}

/// `per_op` as text ("0.62 µs", or why there is none).
pub fn show(per_op: Option<f64>) -> String {
    per_op.map_or_else(|| "(not measured)".to_owned(), |us| format!("{us:.2} µs"))
}
