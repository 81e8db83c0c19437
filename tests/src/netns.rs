//! A small cluster on one machine with real kernel networking, for the
//! multi-host tests: N hosts, each a network namespace (`vr<pid>c<n>h<i>`)
//! with `lo` and one veth, `eth0`, holding underlay address
//! `10.200.0.<i>/16`, whose peer end sits in the switch's namespace
//! (`vr<pid>c<n>sw`, as port `h<i>`). The switch is either a kernel bridge
//! ([`Cluster::bridged`]) or the hostile relay, `vrdma-relay`, forwarding
//! between the unbridged ports ([`Cluster::relayed`]).
//!
//! Tenant GIDs are extra addresses of a host's `eth0`
//! ([`Cluster::add_address`]), in the same /16 so that ARP resolves them
//! with no routing. Namespaces have no route but their /16: test traffic
//! goes to loopback or to addresses in namespaces the test made, nowhere
//! else. Code runs inside a host's namespace as a thread that joined it
//! ([`Host::run`], [`Host::spawn`]: sockets it opens are the host's) or as
//! a process ([`Host::command`], and `vrdma_tools::supervisor::Launch::netns`
//! for daemons). IPv6 is off in every namespace, so the only frames on the
//! wire are those the test causes (and ARP).
//!
//! Everything is removed on drop (processes still running inside keep
//! their namespace alive: drop daemons before their cluster). Namespaces
//! left by an earlier test process that was killed (its pid no longer
//! runs, or it is this process's pid reused) are removed when a cluster is
//! made.

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vrdma_tools::relay::{Faults, Stats};
use vrdma_tools::supervisor::{self, Scratch};

use crate::daemon::{binary, must};
use crate::need;

/// The interface of every host.
pub const HOST_IFACE: &str = "eth0";
/// How long the relay may take to open its sockets.
const RELAY_START: Duration = Duration::from_secs(10);

/// One host of a [`Cluster`]: a network namespace.
#[derive(Debug, Clone)]
pub struct Host {
    /// `h1`, `h2`, ... (also its port's name in the switch's namespace).
    pub name: String,
    /// The namespace's name (`ip netns`).
    pub netns: String,
    /// Its underlay address, `10.200.0.<i>`, on [`HOST_IFACE`].
    pub underlay: Ipv4Addr,
}

impl Host {
    /// The namespace's file (what `Launch::netns` and `setns` take).
    pub fn netns_path(&self) -> PathBuf {
        supervisor::netns_path(Path::new(&self.netns))
    }

    /// `program` to be run inside this host's namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new(program);
        must(supervisor::enter_netns(&mut command, &self.netns_path()));
        command
    }

    /// Runs `f` on a thread that joined this host's network namespace
    /// (sockets it opens are the host's), and returns what it returns.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let file = self.open_netns();
        std::thread::scope(|s| {
            s.spawn(move || {
                join_netns(&file);
                f()
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }

    /// Like [`Host::run`], on a thread of its own, running on.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> JoinHandle<T> {
        let file = self.open_netns();
        std::thread::spawn(move || {
            join_netns(&file);
            f()
        })
    }

    fn open_netns(&self) -> File {
        let path = self.netns_path();
        File::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
    }
}

/// Moves the calling thread into the network namespace of `file`.
fn join_netns(file: &File) {
    // SAFETY: setns(2) on a valid fd; it changes only this thread's network
    // namespace (sockets it opens from now on), no memory.
    let ret = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(ret, 0, "setns: {}", std::io::Error::last_os_error());
}

/// The relay process serving as a cluster's switch.
#[derive(Debug)]
struct Relay {
    child: Child,
    stats: PathBuf,
    log: PathBuf,
}

/// N hosts joined by a switch; removed on drop.
#[derive(Debug)]
pub struct Cluster {
    /// `vr<pid>c<n>`: the prefix of its namespaces.
    id: String,
    switch: String,
    hosts: Vec<Host>,
    relay: Option<Relay>,
    // Last: the relay's stats and log live in it.
    dir: Scratch,
}

/// Runs `ip args`; the test fails with its stderr if it fails.
#[track_caller]
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Writes `value` to the sysctl file `key` (below `/proc/sys/`) as seen
/// from `netns`: the network sysctls are the namespace's of the thread
/// that opens them.
fn sysctl(netns: &Path, key: &str, value: &str) {
    let file = File::open(netns).expect("open netns");
    let path = Path::new("/proc/sys").join(key);
    std::thread::scope(|s| {
        s.spawn(|| {
            join_netns(&file);
            std::fs::write(&path, value)
                .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e));
    });
}

/// Whether namespace `name` is of our making (`vr<pid>c<n>sw` or
/// `vr<pid>c<n>h<i>`): the pid of the process that made it and the
/// cluster's id (`vr<pid>c<n>`).
fn our_netns(name: &str) -> Option<(u32, &str)> {
    let rest = name.strip_prefix("vr")?;
    let (pid, rest) = rest.split_once('c')?;
    let (n, tail) = rest.split_at(rest.find(|c: char| !c.is_ascii_digit())?);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let tail_ok = tail == "sw" || tail.strip_prefix('h').is_some_and(digits);
    if !(digits(pid) && digits(n) && tail_ok) {
        return None;
    }
    Some((pid.parse().ok()?, &name[..name.len() - tail.len()]))
}

/// Removes namespaces a killed test process left behind: ours by name,
/// whose process is gone, or is this one (a pid reused; this process's own
/// live clusters have other names than the one being made).
fn remove_stale(making: &str) {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((pid, id)) = our_netns(&name) else {
            continue;
        };
        let stale = if pid == me {
            id == making
        } else {
            !Path::new(&format!("/proc/{pid}")).exists()
        };
        if stale {
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
    }
}

/// The relay's command-line arguments for `faults`.
fn relay_args(faults: &Faults) -> Vec<String> {
    let f = faults;
    [
        ("--drop", f.drop.to_string()),
        ("--dup", f.dup.to_string()),
        ("--reorder", f.reorder.to_string()),
        ("--reorder-gap", f.reorder_gap.to_string()),
        (
            "--reorder-timeout-us",
            f.reorder_timeout.as_micros().to_string(),
        ),
        ("--delay-us", f.delay.as_micros().to_string()),
        ("--delay-rate", f.delay_rate.to_string()),
        ("--truncate", f.truncate.to_string()),
        ("--corrupt", f.corrupt.to_string()),
        ("--fix-udp-checksum", f.fix_udp_checksum.to_string()),
        ("--seed", f.seed.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_owned(), v])
    .collect()
}

impl Cluster {
    /// `hosts` hosts on a kernel bridge.
    pub fn bridged(hosts: usize) -> Self {
        let cluster = Self::build(hosts);
        let sw = cluster.switch.clone();
        ip(&["-n", &sw, "link", "add", "name", "br0", "type", "bridge"]);
        // Forward at once: no spanning tree, no learning delay.
        ip(&[
            "-n",
            &sw,
            "link",
            "set",
            "br0",
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
        ]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        for host in &cluster.hosts {
            ip(&["-n", &sw, "link", "set", &host.name, "master", "br0"]);
        }
        cluster.up_ports();
        cluster
    }

    /// `hosts` hosts whose ports `vrdma-relay` forwards between, harming
    /// RoCE frames as `faults` say. The hosts' segmentation offloads are off
    /// (the relay forwards frames no larger than the MTU); their checksum
    /// offload stays on (UDP GSO needs it), the relay completes checksums.
    pub fn relayed(hosts: usize, faults: &Faults) -> Self {
        let ethtool = need::program("ethtool", "ethtool");
        let relay_bin = binary("vrdma-relay");
        let mut cluster = Self::build(hosts);
        for host in &cluster.hosts {
            let out = host
                .command(&ethtool)
                .args(["-K", HOST_IFACE, "tso", "off", "gso", "off"])
                .args(["tx-udp-segmentation", "off", "tx-gso-list", "off"])
                .output()
                .expect("run ethtool");
            assert!(
                out.status.success(),
                "ethtool -K in {}: {}",
                host.netns,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        cluster.up_ports();
        let stats = cluster.dir.path().join("relay.json");
        let log = cluster.dir.path().join("relay.log");
        let mut command = Command::new(relay_bin);
        must(supervisor::enter_netns(
            &mut command,
            &supervisor::netns_path(Path::new(&cluster.switch)),
        ));
        for host in &cluster.hosts {
            command.args(["--iface", &host.name]);
        }
        let child = command
            .args(relay_args(faults))
            .arg("--stats")
            .arg(&stats)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(&log).expect("relay log"))
            .spawn()
            .expect("start vrdma-relay");
        let mut relay = Relay { child, stats, log };
        // The stats file appears once the relay's sockets are open.
        let deadline = Instant::now() + RELAY_START;
        while !relay.stats.exists() {
            if let Ok(Some(status)) = relay.child.try_wait() {
                panic!(
                    "vrdma-relay exited with {status}: {}",
                    std::fs::read_to_string(&relay.log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "vrdma-relay did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
        cluster.relay = Some(relay);
        cluster
    }

    /// The namespaces, the veths and the addresses; links of the switch
    /// side still down.
    fn build(hosts: usize) -> Self {
        need::root("Building network namespaces");
        need::program("ip", "iproute2");
        assert!((1..=250).contains(&hosts), "1 to 250 hosts");
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "vr{}c{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        remove_stale(&id);
        let dir = must(Scratch::new(&id));
        let switch = format!("{id}sw");
        let mut cluster = Cluster {
            switch: switch.clone(),
            hosts: Vec::new(),
            relay: None,
            dir,
            id,
        };
        ip(&["netns", "add", &switch]);
        cluster.quiet(&switch);
        ip(&["-n", &switch, "link", "set", "lo", "up"]);
        for i in 1..=hosts {
            let host = Host {
                name: format!("h{i}"),
                netns: format!("{}h{i}", cluster.id),
                underlay: Ipv4Addr::new(10, 200, 0, i as u8),
            };
            ip(&["netns", "add", &host.netns]);
            // Pushed at once: dropped with the cluster if a step fails.
            cluster.hosts.push(host.clone());
            cluster.quiet(&host.netns);
            let ns = host.netns.as_str();
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            // The switch's end, `h<i>`, and the host's, `eth0`, moved into
            // the host's namespace as it is made.
            ip(&[
                "-n", &switch, "link", "add", "name", &host.name, "type", "veth", "peer", "name",
                HOST_IFACE, "netns", ns,
            ]);
            let address = format!("{}/16", host.underlay);
            ip(&["-n", ns, "addr", "add", &address, "dev", HOST_IFACE]);
            ip(&["-n", ns, "link", "set", HOST_IFACE, "up"]);
        }
        cluster
    }

    /// IPv6 off in namespace `netns` (for links made in it from now on too).
    fn quiet(&self, netns: &str) {
        let path = supervisor::netns_path(Path::new(netns));
        for conf in ["all", "default"] {
            sysctl(&path, &format!("net/ipv6/conf/{conf}/disable_ipv6"), "1");
        }
    }

    fn up_ports(&self) {
        for host in &self.hosts {
            ip(&["-n", &self.switch, "link", "set", &host.name, "up"]);
        }
    }

    /// Host `i` (1-based, as its name `h<i>`).
    #[track_caller]
    pub fn host(&self, i: usize) -> &Host {
        self.hosts
            .get(i.wrapping_sub(1))
            .unwrap_or_else(|| panic!("no host {i} of {}", self.hosts.len()))
    }

    /// Every host, h1 first.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// The switch's namespace.
    pub fn switch_netns(&self) -> &str {
        &self.switch
    }

    /// Adds `address`/16 to host `i`'s interface (a tenant's GID).
    pub fn add_address(&self, i: usize, address: Ipv4Addr) {
        let host = self.host(i);
        let address = format!("{address}/16");
        ip(&[
            "-n",
            &host.netns,
            "addr",
            "add",
            &address,
            "dev",
            HOST_IFACE,
        ]);
    }

    /// Removes `address` from host `i`'s interface.
    pub fn remove_address(&self, i: usize, address: Ipv4Addr) {
        let host = self.host(i);
        let address = format!("{address}/16");
        ip(&[
            "-n",
            &host.netns,
            "addr",
            "del",
            &address,
            "dev",
            HOST_IFACE,
        ]);
    }

    /// The relay's counters as it last wrote them (every second, or at its
    /// exit). The test fails if the cluster has no relay.
    pub fn relay_stats(&self) -> Stats {
        let relay = self.relay.as_ref().expect("a cluster with a relay");
        let text = std::fs::read_to_string(&relay.stats).expect("relay stats");
        serde_json::from_str(text.trim()).expect("relay stats JSON")
    }

    /// Stops the relay (SIGTERM) and returns its final counters, which it
    /// prints on stdout as it exits. The hosts are cut off from then on.
    pub fn stop_relay(&mut self) -> Stats {
        let relay = self.relay.take().expect("a cluster with a relay");
        let pid = libc::pid_t::try_from(relay.child.id()).expect("pid");
        // SAFETY: kill(2) on our own child, not yet reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let out = relay
            .child
            .wait_with_output()
            .expect("wait for vrdma-relay");
        let log = std::fs::read_to_string(&relay.log).unwrap_or_default();
        assert!(out.status.success(), "vrdma-relay: {}\n{log}", out.status);
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(text.trim())
            .unwrap_or_else(|e| panic!("vrdma-relay's stdout {text:?}: {e}\n{log}"))
    }

    /// The relay's log (stderr) so far; empty without a relay.
    pub fn relay_log(&self) -> String {
        self.relay
            .as_ref()
            .and_then(|r| std::fs::read_to_string(&r.log).ok())
            .unwrap_or_default()
    }

    /// The namespaces it made (`ip netns` names), switch first.
    pub fn namespaces(&self) -> Vec<String> {
        std::iter::once(self.switch.clone())
            .chain(self.hosts.iter().map(|h| h.netns.clone()))
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(mut relay) = self.relay.take() {
            let _ = relay.child.kill();
            let _ = relay.child.wait();
        }
        // A host's veth goes with its namespace, and its peer with it.
        for ns in self.namespaces().iter().rev() {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(Stdio::null())
                .status();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_namespace_names_are_ours() {
        assert_eq!(our_netns("vr123c0sw"), Some((123, "vr123c0")));
        assert_eq!(our_netns("vr123c14h12"), Some((123, "vr123c14")));
        assert_eq!(our_netns("vr123c4h"), None);
        assert_eq!(our_netns("vr123csw"), None);
        assert_eq!(our_netns("vrx1"), None);
        assert_eq!(our_netns("vr12c3hx"), None);
        assert_eq!(our_netns("blue"), None);
    }
}
