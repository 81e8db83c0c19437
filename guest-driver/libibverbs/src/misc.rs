//! Helpers of the libibverbs API that need no device: strings for enums,
//! rate conversions, the sysfs helpers and the fork-protection calls.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::io::Read;

use crate::abi::{
    ibv_event_type, ibv_fork_status, ibv_node_type, ibv_port_state, ibv_rate, ibv_wc_status,
    IBV_FORK_UNNEEDED,
};
use crate::device::{entries, ibdev_path};
use crate::ffi::{guard, set_errno};

/// Picks `table[i]`, or "unknown".
fn pick(table: &'static [&'static CStr], i: u32) -> *const c_char {
    table
        .get(i as usize)
        .copied()
        .unwrap_or(c"unknown")
        .as_ptr()
}

/// `ibv_wc_status_str`: rdma-core's text for each `enum ibv_wc_status`.
pub extern "C" fn ibv_wc_status_str(status: ibv_wc_status) -> *const c_char {
    const TABLE: &[&CStr] = &[
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
        c"TM error",
        c"TM software rendezvous",
    ];
    pick(TABLE, status)
}

/// `ibv_node_type_str`.
pub extern "C" fn ibv_node_type_str(node_type: ibv_node_type) -> *const c_char {
    // Indexed by value + 1 (IBV_NODE_UNKNOWN is -1).
    const TABLE: &[&CStr] = &[
        c"unknown",
        c"unspecified",
        c"channel adapter",
        c"switch",
        c"router",
        c"RDMA NIC",
        c"usNIC",
        c"usNIC UDP",
        c"unspecified",
    ];
    pick(TABLE, node_type.wrapping_add(1) as u32)
}

/// `ibv_port_state_str`.
pub extern "C" fn ibv_port_state_str(port_state: ibv_port_state) -> *const c_char {
    const TABLE: &[&CStr] = &[
        c"no state change (NOP)",
        c"down",
        c"init",
        c"armed",
        c"active",
        c"active defer",
    ];
    pick(TABLE, port_state)
}

/// `ibv_event_type_str`.
pub extern "C" fn ibv_event_type_str(event: ibv_event_type) -> *const c_char {
    const TABLE: &[&CStr] = &[
        c"CQ error",
        c"local work queue catastrophic error",
        c"invalid request local work queue error",
        c"local access violation work queue error",
        c"communication established",
        c"send queue drained",
        c"path migrated",
        c"path migration request error",
        c"local catastrophic error",
        c"port active",
        c"port error",
        c"LID change",
        c"P_Key change",
        c"SM change",
        c"SRQ catastrophic error",
        c"SRQ limit reached",
        c"last WQE reached",
        c"client reregistration",
        c"GID table change",
        c"WQ fatal",
    ];
    pick(TABLE, event)
}

/// (enum ibv_rate, multiple of 2.5 Gb/s, Mb/s).
const RATES: &[(ibv_rate, c_int, c_int)] = &[
    (2, 1, 2500),
    (5, 2, 5000),
    (3, 4, 10000),
    (6, 8, 20000),
    (4, 12, 30000),
    (7, 16, 40000),
    (8, 24, 60000),
    (9, 32, 80000),
    (10, 48, 120000),
    (11, -1, 14062),
    (12, -1, 56250),
    (13, -1, 112500),
    (14, -1, 168750),
    (15, -1, 25781),
    (16, -1, 103125),
    (17, -1, 206250),
    (18, -1, 309375),
    (19, -1, 28125),
    (20, -1, 53125),
    (21, -1, 425000),
    (22, -1, 637500),
];

/// `ibv_rate_to_mult`.
pub extern "C" fn ibv_rate_to_mult(rate: ibv_rate) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

/// `mult_to_ibv_rate`.
pub extern "C" fn mult_to_ibv_rate(mult: c_int) -> ibv_rate {
    RATES
        .iter()
        .find(|r| r.1 == mult && mult > 0)
        .map_or(0, |r| r.0)
}

/// `ibv_rate_to_mbps`.
pub extern "C" fn ibv_rate_to_mbps(rate: ibv_rate) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

/// `mbps_to_ibv_rate`.
pub extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> ibv_rate {
    RATES.iter().find(|r| r.2 == mbps).map_or(0, |r| r.0)
}

/// `ibv_get_sysfs_path`.
pub extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// The virtual sysfs files of a vrdma device (its `ibdev_path` is not in
/// sysfs: the device lives behind a socket).
fn virtual_file(dir: &str, file: &str) -> Option<Option<&'static str>> {
    entries().find(|d| ibdev_path(&d.spec.name) == dir)?;
    Some(match file {
        "board_id" => Some("VRDMA_VIRTUAL"),
        "node_type" => Some("1: CA"),
        _ => None,
    })
}

/// Copies `data` into `buf` the way rdma-core's `ibv_read_sysfs_file`
/// does: a trailing newline becomes the NUL; data that fills the buffer
/// without room for a NUL fails (-1).
fn fill(buf: &mut [u8], data: &[u8]) -> c_int {
    let mut len = data.len().min(buf.len());
    buf[..len].copy_from_slice(&data[..len]);
    if len > 0 {
        if buf[len - 1] == b'\n' {
            len -= 1;
            buf[len] = 0;
        } else if len < buf.len() {
            buf[len] = 0;
        } else {
            return -1;
        }
    }
    c_int::try_from(len).unwrap_or(-1)
}

/// `ibv_read_sysfs_file`: reads `dir/file` into `buf` (at most `size`
/// bytes, NUL-terminated); returns the length or -1 with `errno` set.
/// A vrdma device's `ibdev_path` answers `board_id` and `node_type`.
///
/// # Safety
///
/// `dir` and `file` are C strings; `buf` has room for `size` bytes.
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard("ibv_read_sysfs_file", -1, || {
        if dir.is_null() || file.is_null() || buf.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: the caller passes C strings.
        let (dir, file) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
        let (dir, file) = (dir.to_string_lossy(), file.to_string_lossy());
        // SAFETY: the caller provides `size` bytes.
        let out = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), size) };
        if let Some(virt) = virtual_file(&dir, &file) {
            return match virt {
                Some(text) => fill(out, text.as_bytes()),
                None => {
                    set_errno(libc::ENOENT);
                    -1
                }
            };
        }
        let path = std::path::Path::new(&*dir).join(&*file);
        let mut data = Vec::with_capacity(size);
        match std::fs::File::open(&path).and_then(|f| f.take(size as u64).read_to_end(&mut data)) {
            Ok(_) => fill(out, &data),
            Err(e) => {
                set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                -1
            }
        }
    })
}

/// `ibv_fork_init`: nothing to do. In process mode registered memory is a
/// `MAP_SHARED` memfd mapping, which the parent keeps across `fork()` (its
/// registrations stay valid) while the child gets a private copy of it,
/// made before `fork()` returns in the child (the guest driver's
/// `fork_copy`), as a kernel copies DMA-pinned pages.
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// `ibv_dontfork_range`: see [`ibv_fork_init`]; succeeds.
pub extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_dofork_range`: see [`ibv_fork_init`]; succeeds.
pub extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_is_fork_initialized`: `IBV_FORK_UNNEEDED`, whether or not
/// `ibv_fork_init` was called: registrations survive `fork()` without it
/// (process mode: the child's copy, see [`ibv_fork_init`]; VM mode:
/// registered pages are always kept out of children, `MADV_DONTFORK`), as
/// on a kernel that copies DMA pages on fork.
pub extern "C" fn ibv_is_fork_initialized() -> ibv_fork_status {
    IBV_FORK_UNNEEDED
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(p: *const c_char) -> &'static str {
        // SAFETY: every table entry is a static C string.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap()
    }

    #[test]
    fn enum_strings() {
        assert_eq!(s(ibv_wc_status_str(0)), "success");
        assert_eq!(s(ibv_wc_status_str(5)), "Work Request Flushed Error");
        assert_eq!(s(ibv_wc_status_str(12)), "transport retry counter exceeded");
        assert_eq!(s(ibv_wc_status_str(999)), "unknown");
        assert_eq!(s(ibv_port_state_str(4)), "active");
        assert_eq!(s(ibv_node_type_str(1)), "channel adapter");
        assert_eq!(s(ibv_node_type_str(-1)), "unknown");
        assert_eq!(s(ibv_event_type_str(9)), "port active");
    }

    #[test]
    fn rates() {
        assert_eq!(ibv_rate_to_mult(3), 4);
        assert_eq!(mult_to_ibv_rate(4), 3);
        assert_eq!(ibv_rate_to_mbps(16), 103125);
        assert_eq!(mbps_to_ibv_rate(103125), 16);
        assert_eq!(ibv_rate_to_mult(99), -1);
        assert_eq!(mult_to_ibv_rate(-1), 0);
    }

    #[test]
    fn sysfs_reads_like_rdma_core() {
        let mut buf = [0x55u8; 8];
        assert_eq!(fill(&mut buf, b"abc\n"), 3);
        assert_eq!(&buf[..4], b"abc\0");
        assert_eq!(fill(&mut buf, b"abcdefg"), 7);
        assert_eq!(buf[7], 0);
        assert_eq!(fill(&mut buf, b"abcdefgh"), -1);

        let dir = std::env::temp_dir().join(format!("vrdma-ibv-sysfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("board_id"), "MT_000\n").unwrap();
        let cdir = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
        let mut out = [0 as c_char; 32];
        // SAFETY: C strings and a 32-byte buffer.
        let n = unsafe {
            ibv_read_sysfs_file(cdir.as_ptr(), c"board_id".as_ptr(), out.as_mut_ptr(), 32)
        };
        assert_eq!(n, 6);
        assert_eq!(crate::ffi::read_c_str(&out), "MT_000");
        // SAFETY: as above.
        let n = unsafe {
            ibv_read_sysfs_file(cdir.as_ptr(), c"missing".as_ptr(), out.as_mut_ptr(), 32)
        };
        assert_eq!(n, -1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
