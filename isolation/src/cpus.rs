//! CPU affinity: which CPUs a thread runs on. An operator dedicates cores
//! to hostd's datapath threads as to a NIC's packet cores (`datapath_cpus`),
//! and the benchmark keeps its tenants' threads off them.

use std::io;

/// CPUs a `cpu_set_t` can name.
pub const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;

/// The CPUs the calling thread may run on, ascending.
pub fn allowed() -> io::Result<Vec<usize>> {
    allowed_of(0)
}

/// The CPUs thread `tid` (0: the calling thread) may run on, ascending.
pub fn allowed_of(tid: libc::pid_t) -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain bits; all zeros is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed; a
    // thread id the kernel checks (0: the calling thread).
    let rc = unsafe { libc::sched_getaffinity(tid, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET reads one bit of a valid set; `cpu` < CPU_SETSIZE.
    Ok((0..MAX_CPUS)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Restricts the calling thread to `cpus` (each below [`MAX_CPUS`]).
pub fn pin_current_thread(cpus: &[usize]) -> io::Result<()> {
    pin_thread(0, cpus)
}

/// Restricts thread `tid` (0: the calling thread) to `cpus` (each below
/// [`MAX_CPUS`]).
pub fn pin_thread(tid: libc::pid_t, cpus: &[usize]) -> io::Result<()> {
    // SAFETY: as in `allowed`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= MAX_CPUS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("CPU {cpu} is beyond the {MAX_CPUS} a CPU set names"),
            ));
        }
        // SAFETY: `cpu` < CPU_SETSIZE (checked above); `set` is valid.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; a thread id
    // the kernel checks (0: the calling thread); the kernel only reads it.
    let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_pinned_to_one_allowed_cpu_runs_only_there() {
        let all = allowed().expect("sched_getaffinity");
        assert!(!all.is_empty());
        let last = *all.last().expect("one CPU");
        std::thread::spawn(move || {
            pin_current_thread(&[last]).expect("pin");
            assert_eq!(allowed().expect("affinity"), [last]);
            // SAFETY: sched_getcpu takes nothing and only returns.
            assert_eq!(unsafe { libc::sched_getcpu() }, last as i32);
        })
        .join()
        .expect("pinned thread");
        assert_eq!(
            allowed().expect("affinity"),
            all,
            "other threads keep theirs"
        );
        let err = pin_current_thread(&[MAX_CPUS]).expect_err("beyond the set");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
