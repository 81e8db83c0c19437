//! UCX (`ucx-utils`, `libucx0`) and Open MPI over UCX on vrdma: the
//! device node UCX looks for, the environment that restricts UCX to
//! vrdma's transports, and what UCX's log says it chose.
//!
//! UCX lists an RDMA device only if `/dev/infiniband/<dev_name>` is a
//! character device the user may read and write (its
//! `uct_ib_device_is_accessible`); a kernel RDMA driver's uverbs node is
//! that file. vrdma has no kernel driver, so an installation creates the
//! node (docs/compat.md, "UCX and Open MPI"): [`install_device_node`] does
//! what that step does.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::need;

/// Where UCX looks for RDMA device nodes.
pub const NODE_DIR: &str = "/dev/infiniband";

/// The name vrdma's library gives its `index`-th device (`ibv_get_device_name`
/// and UCX's device name).
pub fn device_name(index: usize) -> String {
    format!("vrdma{index}")
}

/// The device node of vrdma's `index`-th device: the library's
/// `ibv_device.dev_name` under [`NODE_DIR`].
pub fn device_node(index: usize) -> PathBuf {
    Path::new(NODE_DIR).join(format!("vrdma-uverbs{index}"))
}

/// Installs the device node of vrdma's `index`-th device as an operator's
/// installation does (docs/compat.md): a character device with the numbers
/// of `/dev/null` (1:3; there is no kernel driver behind it, the library
/// never opens it), mode 0666. An existing node is left as it is, and the
/// node stays: it is the machine's installation, not the test's.
pub fn install_device_node(index: usize) -> PathBuf {
    let node = device_node(index);
    if let Ok(meta) = std::fs::metadata(&node) {
        assert!(
            meta.file_type().is_char_device(),
            "{} exists and is not a character device",
            node.display()
        );
        return node;
    }
    need::root(&format!("creating the device node {}", node.display()));
    std::fs::create_dir_all(NODE_DIR).expect("create /dev/infiniband");
    let path = std::ffi::CString::new(node.as_os_str().as_encoded_bytes()).expect("node path");
    // SAFETY: `path` is a NUL-terminated path; mknod reads it only.
    let made = unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    let err = std::io::Error::last_os_error();
    assert!(
        made == 0 || err.kind() == std::io::ErrorKind::AlreadyExists,
        "mknod {}: {err}",
        node.display()
    );
    // mknod's mode passes through the umask.
    std::fs::set_permissions(&node, std::os::unix::fs::PermissionsExt::from_mode(0o666))
        .expect("chmod the device node");
    node
}

/// Sets `cmd`'s UCX environment: transports `tls` (`UCX_TLS`) on vrdma's
/// first device only (`UCX_NET_DEVICES=vrdma0:1`), with UCX's `info` log,
/// which names the transports each endpoint configuration uses.
pub fn ucx_env(cmd: &mut Command, tls: &str) {
    cmd.env("UCX_TLS", tls)
        .env("UCX_NET_DEVICES", format!("{}:1", device_name(0)))
        .env("UCX_LOG_LEVEL", "info");
}

/// The transports UCX's log says each process chose: from its lines
/// `[<time>] [<host>:<pid>:<thread>] ... ep_cfg[<n>]: tag(rc_verbs/vrdma0:1) ...`
/// (UCX 1.13) or `... intra-node cfg#<n> tag(rc_verbs/vrdma0:1) ...`
/// (UCX 1.18), every `transport/device` per process (`<host>:<pid>`:
/// processes in PID namespaces of their own may share a pid), but those
/// of a process's endpoint to itself.
pub fn chosen_transports(log: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut chosen: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in log.lines() {
        let lanes = if let Some((_, rest)) = line.split_once("ep_cfg[") {
            rest.split_once("]:").map(|(_, lanes)| lanes)
        } else if let Some((_, rest)) = line.split_once(" cfg#") {
            rest.split_once(' ').map(|(_, lanes)| lanes)
        } else {
            None
        };
        let (Some(lanes), Some(process)) = (lanes, log_process(line)) else {
            continue;
        };
        // A process's endpoint to itself (`self/memory0`, with what UCX
        // adds for its RMA, e.g. `cma/memory`) connects no two processes.
        if lanes.contains("self/") {
            chosen.entry(process).or_default();
            continue;
        }
        let used = chosen.entry(process).or_default();
        // Each group is `feature(tl/dev tl/dev ...)`.
        for group in lanes.split(')') {
            if let Some((_, inside)) = group.split_once('(') {
                used.extend(
                    inside
                        .split([' ', ',', ';'])
                        .filter(|t| t.contains('/'))
                        .map(str::to_owned),
                );
            }
        }
    }
    chosen
}

/// Fails unless UCX's log `text` shows each of `processes` processes
/// choosing transports, all of them `transport` (e.g. `rc_verbs`) on port 1
/// of vrdma's first device: nothing fell back to shared memory or TCP.
#[track_caller]
pub fn assert_chose_only(text: &str, processes: usize, transport: &str) {
    assert_chose_among(text, processes, &[transport]);
}

/// Fails unless UCX's log `text` shows each of `processes` processes
/// choosing transports, each one of `transports` on port 1 of vrdma's
/// first device (UCX's default choice may use several of them), or one
/// named with its device (`self/memory0`: a process's endpoint to itself).
#[track_caller]
pub fn assert_chose_among(text: &str, processes: usize, transports: &[&str]) {
    let expected: BTreeSet<String> = (transports.iter())
        .map(|t| match t.contains('/') {
            true => (*t).to_owned(),
            false => format!("{t}/{}:1", device_name(0)),
        })
        .collect();
    let chosen = chosen_transports(text);
    assert_eq!(
        chosen.len(),
        processes,
        "UCX logged the transports of {} processes, not {processes}:\n{text}",
        chosen.len()
    );
    for (process, used) in &chosen {
        assert!(
            !used.is_empty() && used.is_subset(&expected),
            "process {process} chose {used:?}, not only {expected:?}:\n{text}"
        );
    }
}

/// The process of a UCX log line, `<host>:<pid>` from its second
/// bracket, `[<host>:<pid> :<thread>]`.
fn log_process(line: &str) -> Option<String> {
    let rest = line.split_once("] [")?.1;
    let mut fields = rest.split(':');
    let host = fields.next()?.trim();
    let pid: u32 = fields.next()?.trim().parse().ok()?;
    Some(format!("{host}:{pid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transports_of_each_process_are_read_from_ucx_log() {
        let log = "\
[1796176571.137105] [vm:9924 :0]          parser.c:1916 UCX  INFO  UCX_* env variables: UCX_TLS=rc_verbs\n\
[1796176571.485839] [vm:9929 :0]      ucp_worker.c:1763 UCX  INFO    ep_cfg[0]: tag(rc_verbs/vrdma0:1)\n\
[1796176571.486413] [vm:10001:0]      ucp_worker.c:1763 UCX  INFO    ep_cfg[1]: tag(rc_verbs/vrdma0:1 ud_verbs/vrdma0:1) rma(posix/memory)\n\
[1796184189.193960] [vrdma-guest:295  :0]      ucp_worker.c:1903 UCX  INFO    perftest intra-node cfg#0 rma(rc_verbs/vrdma0:1)\n\
[1796184189.194000] [h1-0:1    :0]      ucp_worker.c:1763 UCX  INFO    ep_cfg[0]: tag(self/memory0 cma/memory rc_verbs/vrdma0:1)\n\
[1796184189.194100] [h1-0:1    :0]      ucp_worker.c:1763 UCX  INFO    ep_cfg[1]: tag(rc_verbs/vrdma0:1)\n\
rank 1 of 4 partner 3 OK\n";
        let chosen = chosen_transports(log);
        assert_eq!(chosen.len(), 4);
        assert_eq!(
            chosen["h1-0:1"].iter().collect::<Vec<_>>(),
            ["rc_verbs/vrdma0:1"]
        );
        assert_eq!(
            chosen["vrdma-guest:295"].iter().collect::<Vec<_>>(),
            ["rc_verbs/vrdma0:1"]
        );
        assert_eq!(
            chosen["vm:9929"].iter().collect::<Vec<_>>(),
            ["rc_verbs/vrdma0:1"]
        );
        assert_eq!(
            chosen["vm:10001"].iter().collect::<Vec<_>>(),
            ["posix/memory", "rc_verbs/vrdma0:1", "ud_verbs/vrdma0:1"]
        );
    }
}
