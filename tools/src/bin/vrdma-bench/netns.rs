//! Two hosts on one machine for the cross-host measurements: two network
//! namespaces (`vb<pid>h1`, `vb<pid>h2`) joined by one veth pair (`eth0`
//! in each), with real kernel networking between them — what a RoCEv2
//! packet and a TCP segment cross is the same: a UDP or TCP socket, the
//! IPv4 stack, the veth and the peer's stack.
//!
//! Host `i` has underlay address `10.201.0.<i>/16` and one tenant GID,
//! `10.201.1.<i>/16`, on its `eth0` (the same /16: ARP resolves it with no
//! routing). The link's MTU is 9000: RoCE fabrics run jumbo frames, so that
//! a 4096-byte path MTU (what the bench's QPs use) fits in one frame; TCP
//! gets the same link. IPv6 is off. Everything is removed on drop;
//! namespaces of an earlier bench process that is gone are removed when a
//! pair is made.
//!
//! This is a small copy of what `vrdma-tests`' `netns::Cluster` does (the
//! tools cannot depend on the tests crate): a veth pair without a bridge,
//! the shortest path between two namespaces.

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{BenchError, Result};

/// Each host's interface.
const IFACE: &str = "eth0";
/// The link's MTU.
const MTU: &str = "9000";

/// One of the two hosts.
#[derive(Debug, Clone)]
pub struct NetHost {
    /// `h1` or `h2`.
    pub name: String,
    /// The namespace's name (`ip netns`).
    pub netns: String,
    /// `10.201.0.<i>`.
    pub underlay: Ipv4Addr,
    /// The GID of the one tenant device on it, `10.201.1.<i>`.
    pub gid: Ipv4Addr,
}

impl NetHost {
    /// The namespace's file (what `Launch::netns` and `setns` take).
    pub fn netns_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.netns)
    }

    /// Moves the calling thread into this host's network namespace: sockets
    /// it opens from now on are the host's. Meant for threads of their own.
    pub fn enter(&self) -> std::io::Result<()> {
        enter(&self.netns_path())
    }
}

/// Moves the calling thread into the network namespace of file `netns`
/// (`/run/netns/<name>`). Meant for threads of their own.
pub fn enter(netns: &Path) -> std::io::Result<()> {
    let file = File::open(netns)?;
    // SAFETY: setns(2) on a valid fd; it changes only this thread's
    // network namespace, no memory.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Two hosts joined by a veth pair; removed on drop.
#[derive(Debug)]
pub struct Pair {
    pub hosts: [NetHost; 2],
}

/// Runs `ip args`.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| BenchError::Setup {
            what: format!("run `ip {}`", args.join(" ")),
            detail: source.to_string(),
        })?;
    if !out.status.success() {
        return Err(BenchError::Setup {
            what: format!("run `ip {}`", args.join(" ")),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// The pid in a namespace name of ours (`vb<pid>h<i>`).
fn our_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("vb")?;
    let (pid, host) = rest.split_once('h')?;
    if host.is_empty() || !host.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Removes namespaces of bench processes that are gone (or of this pid,
/// reused).
fn remove_stale() {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = our_pid(&name) else {
            continue;
        };
        if pid == me || !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip")
                .args(["netns", "del", &name])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Writes `value` to the sysctl `key` (below `/proc/sys/`) of `host`'s
/// namespace, from a thread that joined it.
fn sysctl(host: &NetHost, key: &str, value: &str) -> Result<()> {
    let path = Path::new("/proc/sys").join(key);
    std::thread::scope(|s| {
        s.spawn(|| {
            host.enter()?;
            std::fs::write(&path, value)
        })
        .join()
        .map_err(|_| BenchError::Panicked)?
        .map_err(|source| BenchError::Setup {
            what: format!("write {} in {}", path.display(), host.netns),
            detail: source.to_string(),
        })
    })
}

impl Pair {
    /// The two namespaces, the veth pair and the addresses. Needs root.
    pub fn new() -> Result<Self> {
        remove_stale();
        let me = std::process::id();
        let host = |i: u8| NetHost {
            name: format!("h{i}"),
            netns: format!("vb{me}h{i}"),
            underlay: Ipv4Addr::new(10, 201, 0, i),
            gid: Ipv4Addr::new(10, 201, 1, i),
        };
        let pair = Pair {
            hosts: [host(1), host(2)],
        };
        let [h1, h2] = &pair.hosts;
        // Made one by one, so that drop removes what a failure left.
        for h in &pair.hosts {
            ip(&["netns", "add", &h.netns])?;
            for conf in ["all", "default"] {
                sysctl(h, &format!("net/ipv6/conf/{conf}/disable_ipv6"), "1")?;
            }
            ip(&["-n", &h.netns, "link", "set", "lo", "up"])?;
        }
        ip(&[
            "-n", &h1.netns, "link", "add", IFACE, "mtu", MTU, "type", "veth", "peer", "name",
            IFACE, "mtu", MTU, "netns", &h2.netns,
        ])?;
        for h in &pair.hosts {
            for address in [h.underlay, h.gid] {
                let address = format!("{address}/16");
                ip(&["-n", &h.netns, "addr", "add", &address, "dev", IFACE])?;
            }
            ip(&["-n", &h.netns, "link", "set", IFACE, "up"])?;
        }
        Ok(pair)
    }

    /// The static cluster file of the two hosts: tenant `tenants[i]`'s one
    /// GID on host `i + 1`.
    pub fn cluster_file(&self, tenants: [&str; 2]) -> String {
        let mut out = String::new();
        for h in &self.hosts {
            out += &format!(
                "[[host]]\nname = \"{}\"\naddress = \"{}\"\n\n",
                h.name, h.underlay
            );
        }
        for (h, tenant) in self.hosts.iter().zip(tenants) {
            out += &format!(
                "[[gid]]\naddress = \"{}\"\nhost = \"{}\"\ntenant = \"{tenant}\"\n\n",
                h.gid, h.name
            );
        }
        out
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // A namespace's veth end goes with it, and its peer with that.
        for h in &self.hosts {
            let _ = Command::new("ip")
                .args(["netns", "del", &h.netns])
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
        assert_eq!(our_pid("vb123h1"), Some(123));
        assert_eq!(our_pid("vb123h"), None);
        assert_eq!(our_pid("vbxh1"), None);
        assert_eq!(our_pid("vr123c0h1"), None);
        assert_eq!(our_pid("blue"), None);
    }

    #[test]
    fn the_cluster_file_names_both_hosts_and_each_tenant_gid() {
        let h = |i: u8| NetHost {
            name: format!("h{i}"),
            netns: format!("x{i}"),
            underlay: Ipv4Addr::new(10, 201, 0, i),
            gid: Ipv4Addr::new(10, 201, 1, i),
        };
        let pair = std::mem::ManuallyDrop::new(Pair {
            hosts: [h(1), h(2)],
        });
        let text = pair.cluster_file(["alpha", "beta"]);
        let value: toml::Table = text.parse().expect("TOML");
        let hosts = value["host"].as_array().expect("hosts");
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[1]["address"].as_str(), Some("10.201.0.2"));
        let gids = value["gid"].as_array().expect("gids");
        assert_eq!(gids[0]["tenant"].as_str(), Some("alpha"));
        assert_eq!(gids[0]["host"].as_str(), Some("h1"));
        assert_eq!(gids[1]["address"].as_str(), Some("10.201.1.2"));
        assert_eq!(gids[1]["tenant"].as_str(), Some("beta"));
    }
}
