//! hostd's XDP program and the few `bpf(2)` calls that load and attach it.
//!
//! The program is small enough to be written here as eBPF instructions
//! (no clang, no object file, no loader library at build or run time —
//! see docs/architecture.md, "AF_XDP"): it hands a frame to hostd's XSK
//! of the frame's receive queue when it is an unfragmented IPv4 packet
//! without options, UDP to the RoCEv2 port, and short enough for one UMEM
//! frame; everything else — ARP, other traffic, fragments, GSO
//! aggregates, jumbo frames — goes on to the kernel (`XDP_PASS`), where
//! hostd's packet socket still receives the RoCEv2 packets among it.
//! Without an XSK on the queue (hostd gone, or between two of its
//! sockets) `bpf_redirect_map` falls back to `XDP_PASS` too.
//!
//! Attached through a bpf_link (`BPF_LINK_CREATE`): the attachment lives
//! as long as the link's descriptor, so a hostd that exits or is killed
//! leaves nothing on the interface (netlink attachment would stay).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `bpf(2)` commands (`linux/bpf.h`).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;

/// `BPF_MAP_TYPE_XSKMAP`, `BPF_PROG_TYPE_XDP`, `BPF_XDP` (`linux/bpf.h`).
const MAP_TYPE_XSKMAP: u32 = 17;
const PROG_TYPE_XDP: u32 = 6;
const ATTACH_XDP: u32 = 37;

/// `XDP_FLAGS_SKB_MODE`, `XDP_FLAGS_DRV_MODE` (`linux/if_link.h`).
const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// The helper `bpf_redirect_map` and the action `XDP_PASS`.
const HELPER_REDIRECT_MAP: i32 = 51;
const XDP_PASS: i32 = 2;

/// Where the XDP program runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpMode {
    /// In the driver (native XDP).
    Driver,
    /// On the kernel's socket buffers (generic XDP): any interface; on
    /// veth and tap faster than native (`../shared/af-xdp-notes.md`).
    Generic,
}

impl XdpMode {
    fn flags(self) -> u32 {
        match self {
            XdpMode::Driver => XDP_FLAGS_DRV_MODE,
            XdpMode::Generic => XDP_FLAGS_SKB_MODE,
        }
    }

    /// How the log and the counters name it.
    pub fn name(self) -> &'static str {
        match self {
            XdpMode::Driver => "native",
            XdpMode::Generic => "generic",
        }
    }
}

/// One eBPF instruction (`struct bpf_insn`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Insn {
    code: u8,
    /// dst register in the low nibble, src in the high one.
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | dst,
        off,
        imm,
    }
}

// Opcodes (class | operation | source), `linux/bpf_common.h` and `bpf.h`.
const MOV64_REG: u8 = 0x07 | 0xb0 | 0x08;
const MOV64_IMM: u8 = 0x07 | 0xb0;
const ADD64_IMM: u8 = 0x07;
const ADD64_REG: u8 = 0x07 | 0x08;
/// Byte swap to big endian (`BPF_ALU | BPF_END | BPF_TO_BE`; a no-op on
/// a big-endian machine), of the width in `imm`.
const TO_BE: u8 = 0x04 | 0xd0 | 0x08;
const AND64_IMM: u8 = 0x07 | 0x50;
const LDX_W: u8 = 0x61;
const LDX_H: u8 = 0x69;
const LDX_B: u8 = 0x71;
const JGT_REG: u8 = 0x05 | 0x20 | 0x08;
const JNE_IMM: u8 = 0x05 | 0x50;
const LD_IMM64: u8 = 0x18;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
/// `src_reg` of a 64-bit immediate load that names a map by descriptor.
const PSEUDO_MAP_FD: u8 = 1;

/// Registers.
const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R5: u8 = 5;
const R6: u8 = 6;

/// The program, for the XSKMAP `map_fd` and the longest frame an XSK
/// takes (`max_frame`: longer ones go to the kernel).
///
/// Multi-byte fields are loaded as the little-endian machine reads them,
/// so network-order constants appear byte-swapped: `0x0008` is EtherType
/// 0x0800, `0xb712` is port 4791 (0x12b7), `0xff3f` masks the MF flag and
/// the fragment offset (0x3fff).
fn instructions(map_fd: i32, max_frame: u32) -> [Insn; 37] {
    // Jump offsets count instructions after the jump; every test that
    // fails jumps to `pass`, the last two instructions.
    const PASS: i16 = 35;
    let pass = |at: i16| PASS - (at + 1);
    [
        /* 0 */ insn(MOV64_REG, R6, R1, 0, 0), // r6 = ctx
        /* 1 */ insn(LDX_W, R2, R1, 0, 0), // r2 = ctx->data
        /* 2 */ insn(LDX_W, R3, R1, 4, 0), // r3 = ctx->data_end
        /* 3 */ insn(MOV64_REG, R4, R2, 0, 0),
        /* 4 */ insn(ADD64_IMM, R4, 0, 0, 42), // Ethernet 14 + IPv4 20 + UDP 8
        /* 5 */ insn(JGT_REG, R4, R3, pass(5), 0),
        /* 6 */ insn(LDX_H, R5, R2, 12, 0), // EtherType
        /* 7 */ insn(JNE_IMM, R5, 0, pass(7), 0x0008),
        /* 8 */ insn(LDX_B, R5, R2, 14, 0), // version and IHL
        /* 9 */ insn(JNE_IMM, R5, 0, pass(9), 0x45),
        /* 10 */ insn(LDX_B, R5, R2, 23, 0), // protocol
        /* 11 */ insn(JNE_IMM, R5, 0, pass(11), libc::IPPROTO_UDP),
        /* 12 */ insn(LDX_H, R5, R2, 20, 0), // flags and fragment offset
        /* 13 */ insn(AND64_IMM, R5, 0, 0, 0xff3f),
        /* 14 */ insn(JNE_IMM, R5, 0, pass(14), 0),
        /* 15 */ insn(LDX_H, R5, R2, 36, 0), // UDP destination port
        /* 16 */ insn(JNE_IMM, R5, 0, pass(16), 0xb712),
        // A datagram with a UDP checksum comes from a kernel's UDP stack
        // (a peer on vrdma's UDP path): maybe a GSO aggregate, which on a
        // virtual link arrives whole and looks like one long datagram —
        // the kernel keeps those and hostd's packet socket cuts them.
        // RoCE NICs, Linux rxe and hostd's own AF_XDP path send none (the
        // ICRC protects the packet); a kernel never sends 0 (a computed
        // 0 goes as 0xffff, a partial sum is never 0).
        /* 17 */
        insn(LDX_H, R5, R2, 40, 0), // UDP checksum
        /* 18 */ insn(JNE_IMM, R5, 0, pass(18), 0),
        // A frame shorter than its IPv4 total length says (a truncated
        // view: generic XDP may show a program only the head of a long
        // socket buffer) goes to the kernel, which has the rest.
        /* 19 */
        insn(LDX_H, R5, R2, 16, 0), // total length
        /* 20 */ insn(TO_BE, R5, 0, 0, 16), // to host order
        /* 21 */ insn(AND64_IMM, R5, 0, 0, 0xffff),
        /* 22 */ insn(MOV64_REG, R4, R2, 0, 0),
        /* 23 */ insn(ADD64_IMM, R4, 0, 0, 14),
        /* 24 */ insn(ADD64_REG, R4, R5, 0, 0),
        /* 25 */ insn(JGT_REG, R4, R3, pass(25), 0),
        // A frame longer than `max_frame` (data_end > data + max_frame)
        // goes to the kernel: it would not fit a UMEM frame.
        /* 26 */
        insn(MOV64_REG, R4, R2, 0, 0),
        /* 27 */ insn(ADD64_IMM, R4, 0, 0, max_frame as i32),
        /* 28 */ insn(JGT_REG, R3, R4, pass(28), 0),
        /* 29 */ insn(LDX_W, R2, R6, 16, 0), // key: ctx->rx_queue_index
        // r1 = the XSKMAP (a 64-bit load: two instruction slots).
        /* 30 */
        insn(LD_IMM64, R1, PSEUDO_MAP_FD, 0, map_fd),
        /* 31 */ insn(0, 0, 0, 0, 0),
        // Without a socket on the queue the redirect returns its flags'
        // action: XDP_PASS.
        /* 32 */
        insn(MOV64_IMM, R3, 0, 0, XDP_PASS),
        /* 33 */ insn(CALL, 0, 0, 0, HELPER_REDIRECT_MAP),
        /* 34 */ insn(EXIT, 0, 0, 0, 0),
        /* 35: pass */ insn(MOV64_IMM, R0, 0, 0, XDP_PASS),
        /* 36 */ insn(EXIT, 0, 0, 0, 0),
    ]
}

/// The program, loaded and attached, and its XSKMAP: dropping it detaches
/// the program and frees both.
#[derive(Debug)]
pub struct Attached {
    map: OwnedFd,
    _prog: OwnedFd,
    _link: OwnedFd,
    mode: XdpMode,
}

impl Attached {
    /// Loads the program (frames up to `max_frame` bytes to the XSKs) with
    /// an XSKMAP of `queues` entries and attaches it to interface
    /// `ifindex` in `mode`. Needs `CAP_BPF` (or `CAP_SYS_ADMIN`) and
    /// `CAP_NET_ADMIN`; before the sandbox.
    pub fn load(ifindex: u32, queues: u32, max_frame: u32, mode: XdpMode) -> io::Result<Attached> {
        let map = create_xskmap(queues)?;
        let prog = load_program(&instructions(map.as_raw_fd(), max_frame))?;
        let link = link_create(&prog, ifindex, mode.flags())?;
        Ok(Attached {
            map,
            _prog: prog,
            _link: link,
            mode,
        })
    }

    /// Puts XSK `xsk` in the map for receive queue `queue`.
    pub fn set_socket(&self, queue: u32, xsk: &impl AsRawFd) -> io::Result<()> {
        let key = queue;
        let value = xsk.as_raw_fd() as u32;
        let attr = MapUpdateAttr {
            map_fd: self.map.as_raw_fd() as u32,
            _pad: 0,
            key: (&key as *const u32) as u64,
            value: (&value as *const u32) as u64,
            flags: 0,
        };
        // SAFETY: the attribute is the kernel's `bpf_attr` for this command
        // and its key and value point at live u32s the kernel only reads.
        unsafe { bpf(BPF_MAP_UPDATE_ELEM, &attr) }.map(drop)
    }

    /// Where the program runs.
    pub fn mode(&self) -> XdpMode {
        self.mode
    }
}

#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

#[repr(C)]
struct MapUpdateAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

/// A name for `bpftool` and the kernel's listings.
fn name(s: &str) -> [u8; 16] {
    let mut n = [0u8; 16];
    for (d, b) in n.iter_mut().zip(s.bytes().take(15)) {
        *d = b;
    }
    n
}

/// `bpf(cmd, attr, sizeof attr)`: the descriptor or value it returns.
///
/// # Safety
/// `attr` must be the `bpf_attr` layout of `cmd`, and every pointer in it
/// valid for what the command does with it.
unsafe fn bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<libc::c_long> {
    // SAFETY: the caller vouches for the attribute; its size is passed
    // with it (the kernel zero-extends what it knows beyond).
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            (attr as *const T).cast::<libc::c_void>(),
            std::mem::size_of::<T>(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Wraps a descriptor `bpf(2)` returned.
fn owned(fd: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel just returned this descriptor to us; nothing else
    // owns it.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

fn create_xskmap(queues: u32) -> io::Result<OwnedFd> {
    let attr = MapCreateAttr {
        map_type: MAP_TYPE_XSKMAP,
        key_size: 4,
        value_size: 4,
        max_entries: queues.max(1),
        map_flags: 0,
        inner_map_fd: 0,
        numa_node: 0,
        map_name: name("vrdma_xsks"),
    };
    // SAFETY: `BPF_MAP_CREATE`'s attribute, no pointers.
    unsafe { bpf(BPF_MAP_CREATE, &attr) }.map(owned)
}

fn load_program(insns: &[Insn]) -> io::Result<OwnedFd> {
    const LICENSE: &[u8] = b"GPL\0";
    let mut log = vec![0u8; 0];
    for attempt in 0..2 {
        if attempt == 1 {
            // Again with the verifier's log, to say why.
            log = vec![0u8; 64 * 1024];
        }
        let attr = ProgLoadAttr {
            prog_type: PROG_TYPE_XDP,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: LICENSE.as_ptr() as u64,
            log_level: u32::from(attempt == 1),
            log_size: log.len() as u32,
            log_buf: if log.is_empty() {
                0
            } else {
                log.as_mut_ptr() as u64
            },
            kern_version: 0,
            prog_flags: 0,
            prog_name: name("vrdma_rocev2"),
            prog_ifindex: 0,
            expected_attach_type: ATTACH_XDP,
        };
        // SAFETY: `BPF_PROG_LOAD`'s attribute; the instructions, the
        // license and the log buffer are live for the call, with the
        // lengths given (the kernel writes into the log only).
        match unsafe { bpf(BPF_PROG_LOAD, &attr) } {
            Ok(fd) => return Ok(owned(fd)),
            Err(e) if attempt == 1 || e.raw_os_error() == Some(libc::EPERM) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                let text = String::from_utf8_lossy(&log[..end]);
                let last = text.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
                return Err(if last.is_empty() {
                    e
                } else {
                    io::Error::new(e.kind(), format!("{e}; the verifier: {last}"))
                });
            }
            Err(_) => continue,
        }
    }
    Err(io::Error::other("BPF_PROG_LOAD failed twice"))
}

fn link_create(prog: &OwnedFd, ifindex: u32, flags: u32) -> io::Result<OwnedFd> {
    let attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_ifindex: ifindex,
        attach_type: ATTACH_XDP,
        flags,
    };
    // SAFETY: `BPF_LINK_CREATE`'s attribute for an XDP link, no pointers.
    unsafe { bpf(BPF_LINK_CREATE, &attr) }.map(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_jump_lands_on_the_pass_tail_and_the_redirect_ends_in_exit() {
        let v = instructions(7, 3000);
        let jumps = v
            .iter()
            .enumerate()
            .filter(|(_, i)| matches!(i.code, JGT_REG | JNE_IMM))
            .map(|(at, i)| at as i16 + 1 + i.off)
            .collect::<Vec<_>>();
        assert_eq!(jumps, vec![35; 9]);
        assert_eq!(
            (v[35].code, v[35].imm, v[36].code),
            (MOV64_IMM, XDP_PASS, EXIT)
        );
        assert_eq!(
            (v[30].code, v[30].regs >> 4, v[30].imm),
            (LD_IMM64, PSEUDO_MAP_FD, 7)
        );
        assert_eq!(
            (v[33].code, v[33].imm, v[34].code),
            (CALL, HELPER_REDIRECT_MAP, EXIT)
        );
        assert_eq!(v[27].imm, 3000);
    }

    #[test]
    fn network_order_constants_are_those_of_rocev2_over_ipv4() {
        let v = instructions(3, 3000);
        assert_eq!((v[7].imm as u16).to_le_bytes(), 0x0800u16.to_be_bytes());
        assert_eq!((v[16].imm as u16).to_le_bytes(), 4791u16.to_be_bytes());
        assert_eq!((v[13].imm as u16).to_le_bytes(), 0x3fffu16.to_be_bytes());
    }
}
