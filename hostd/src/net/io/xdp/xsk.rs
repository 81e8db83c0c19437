//! One AF_XDP socket (XSK) bound to one receive queue of an interface,
//! with its own UMEM and its four rings.
//!
//! The UMEM's frames are split once: the first half lives on the fill
//! and receive rings (the kernel writes received frames into them, hostd
//! gives each back to the fill ring once it has read it), the second half
//! on the transmit side (a free list, the transmit ring, the completion
//! ring). Ring indices are free-running u32s shared with the kernel: the
//! side that produces writes entries, then publishes its index with a
//! release store; the side that consumes reads the other's index with an
//! acquire load before reading entries.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};

use super::prog::XdpMode;

/// `AF_XDP`, `SOL_XDP` and the socket options and mmap offsets of
/// `linux/if_xdp.h`.
const AF_XDP: libc::c_int = 44;
const SOL_XDP: libc::c_int = 283;
const XDP_MMAP_OFFSETS: libc::c_int = 1;
const XDP_RX_RING: libc::c_int = 2;
const XDP_TX_RING: libc::c_int = 3;
const XDP_UMEM_REG: libc::c_int = 4;
const XDP_UMEM_FILL_RING: libc::c_int = 5;
const XDP_UMEM_COMPLETION_RING: libc::c_int = 6;
const XDP_STATISTICS: libc::c_int = 7;
const XDP_PGOFF_RX_RING: libc::off_t = 0;
const XDP_PGOFF_TX_RING: libc::off_t = 0x8000_0000;
const XDP_UMEM_PGOFF_FILL_RING: libc::off_t = 0x1_0000_0000;
const XDP_UMEM_PGOFF_COMPLETION_RING: libc::off_t = 0x1_8000_0000;
/// Bind flags.
const XDP_COPY: u16 = 1 << 1;
const XDP_ZEROCOPY: u16 = 1 << 2;
const XDP_USE_NEED_WAKEUP: u16 = 1 << 3;
/// A ring's flag: the kernel sleeps until told (`sendto`, `poll`).
const XDP_RING_NEED_WAKEUP: u32 = 1;

/// Bytes per UMEM frame (a page: the largest aligned chunk).
pub const FRAME_SIZE: u32 = 4096;
/// What the kernel leaves before a received frame (`XDP_PACKET_HEADROOM`).
const RX_HEADROOM: u32 = 256;
/// The longest frame an XSK receives: the rest of a UMEM frame.
pub const MAX_FRAME: u32 = FRAME_SIZE - RX_HEADROOM;
/// UMEM frames per socket (32 MiB): half for receiving, half for
/// sending. The receive half is what absorbs a burst while the datapath
/// thread is busy (the UDP path's socket buffer is 8 MiB).
const FRAMES: u32 = 8192;
/// Entries of each ring (each holds at most its half of the frames).
const RING: u32 = FRAMES / 2;

/// `struct xdp_desc`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Desc {
    addr: u64,
    len: u32,
    options: u32,
}

/// `struct xdp_statistics`: what the kernel dropped on a socket.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XskStats {
    /// Frames dropped for other reasons (too long for a frame, …).
    pub rx_dropped: u64,
    pub rx_invalid_descs: u64,
    pub tx_invalid_descs: u64,
    /// Frames dropped because the receive ring was full: hostd did not
    /// keep up.
    pub rx_ring_full: u64,
    /// Frames dropped for want of a fill frame.
    pub rx_fill_ring_empty_descs: u64,
    pub tx_ring_empty_descs: u64,
}

/// `struct xdp_ring_offset`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RingOffset {
    producer: u64,
    consumer: u64,
    desc: u64,
    flags: u64,
}

/// `struct xdp_mmap_offsets`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MmapOffsets {
    rx: RingOffset,
    tx: RingOffset,
    fr: RingOffset,
    cr: RingOffset,
}

/// `struct xdp_umem_reg`.
#[repr(C)]
struct UmemReg {
    addr: u64,
    len: u64,
    chunk_size: u32,
    headroom: u32,
    flags: u32,
    tx_metadata_len: u32,
}

/// `struct sockaddr_xdp`.
#[repr(C)]
struct SockaddrXdp {
    family: u16,
    flags: u16,
    ifindex: u32,
    queue_id: u32,
    shared_umem_fd: u32,
}

/// An anonymous or ring mapping, unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a mapping is plain memory owned by this value; the XSK that
// holds it is used by one thread at a time (`&mut self`).
unsafe impl Send for Mapping {}

impl Mapping {
    fn new(len: usize, fd: Option<(RawFd, libc::off_t)>) -> io::Result<Mapping> {
        let (flags, fd, off) = match fd {
            Some((fd, off)) => (libc::MAP_SHARED | libc::MAP_POPULATE, fd, off),
            None => (
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            ),
        };
        // SAFETY: a fresh mapping the kernel places; nothing aliases it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no reference
        // into it outlives its owner.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One ring shared with the kernel: entries of `T`, `RING` of them.
#[derive(Debug)]
struct Ring<T> {
    /// Kept for its lifetime: the pointers below point into it.
    _map: Mapping,
    producer: *const AtomicU32,
    consumer: *const AtomicU32,
    flags: *const AtomicU32,
    descs: *mut T,
    /// This side's own index (producer or consumer), and its last view of
    /// the other side's.
    local: u32,
    other: u32,
}

// SAFETY: see `Mapping`; the pointers point into `map`.
unsafe impl<T> Send for Ring<T> {}

impl<T: Copy> Ring<T> {
    fn map(
        fd: RawFd,
        off: &RingOffset,
        pgoff: libc::off_t,
        producer_side: bool,
    ) -> io::Result<Self> {
        let len = off.desc as usize + RING as usize * std::mem::size_of::<T>();
        let map = Mapping::new(len, Some((fd, pgoff)))?;
        let at = |o: u64| map.ptr.wrapping_add(o as usize);
        let (producer, consumer) = (
            at(off.producer).cast::<AtomicU32>(),
            at(off.consumer).cast::<AtomicU32>(),
        );
        // SAFETY: the kernel's offsets point at u32 indices inside the
        // mapping, aligned and live as long as it is.
        let (p, c) = unsafe {
            (
                (*producer).load(Ordering::Acquire),
                (*consumer).load(Ordering::Acquire),
            )
        };
        Ok(Ring {
            producer,
            consumer,
            flags: at(off.flags).cast(),
            descs: at(off.desc).cast(),
            local: if producer_side { p } else { c },
            other: if producer_side { c } else { p },
            _map: map,
        })
    }

    fn index(&self, i: u32) -> *mut T {
        self.descs.wrapping_add((i & (RING - 1)) as usize)
    }

    fn needs_wakeup(&self) -> bool {
        // SAFETY: as in `map`.
        unsafe { (*self.flags).load(Ordering::Relaxed) & XDP_RING_NEED_WAKEUP != 0 }
    }

    // Producer side.

    /// Free entries (reading the kernel's consumer index when the last
    /// view says fewer than `want`).
    fn free(&mut self, want: u32) -> u32 {
        let free = RING - self.local.wrapping_sub(self.other);
        if free >= want {
            return free;
        }
        // SAFETY: as in `map`.
        self.other = unsafe { (*self.consumer).load(Ordering::Acquire) };
        RING - self.local.wrapping_sub(self.other)
    }

    fn push(&mut self, v: T) {
        // SAFETY: the slot is in the ring and free (callers checked
        // `free`), so the kernel is not reading it.
        unsafe { self.index(self.local).write_volatile(v) };
        self.local = self.local.wrapping_add(1);
    }

    fn publish(&self) {
        // SAFETY: as in `map`; the release orders the entries written
        // before the index that makes them the kernel's.
        unsafe { (*self.producer).store(self.local, Ordering::Release) };
    }

    /// Whether the kernel has not taken everything published yet.
    fn kernel_behind(&self) -> bool {
        // SAFETY: as in `map`.
        unsafe { (*self.consumer).load(Ordering::Acquire) != self.local }
    }

    // Consumer side.

    /// Entries waiting (reading the kernel's producer index when the
    /// last view is used up).
    fn ready(&mut self) -> u32 {
        if self.other == self.local {
            // SAFETY: as in `map`.
            self.other = unsafe { (*self.producer).load(Ordering::Acquire) };
        }
        self.other.wrapping_sub(self.local)
    }

    fn pop(&mut self) -> T {
        // SAFETY: the slot is one the kernel published (callers checked
        // `ready`) and does not write again until it is released.
        let v = unsafe { self.index(self.local).read_volatile() };
        self.local = self.local.wrapping_add(1);
        v
    }

    fn release(&self) {
        // SAFETY: as in `map`; the release orders the reads before it.
        unsafe { (*self.consumer).store(self.local, Ordering::Release) };
    }
}

/// An XSK and its UMEM.
#[derive(Debug)]
pub struct Xsk {
    // Declared (so dropped) first: the socket before the memory it uses.
    fd: OwnedFd,
    fill: Ring<u64>,
    completion: Ring<u64>,
    rx: Ring<Desc>,
    tx: Ring<Desc>,
    umem: Mapping,
    /// Transmit frames not in the kernel's hands.
    free: Vec<u64>,
    zero_copy: bool,
}

impl Xsk {
    /// Opens an XSK on queue `queue` of interface `ifindex`, where the
    /// XDP program runs in `mode` (zero copy tried with native XDP, copy
    /// mode otherwise). Needs `CAP_NET_RAW` (and `CAP_IPC_LOCK` for a
    /// UMEM above the memlock limit); before the sandbox.
    pub fn open(ifindex: u32, queue: u32, mode: XdpMode) -> io::Result<Xsk> {
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the descriptor just returned, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let umem = Mapping::new((FRAMES * FRAME_SIZE) as usize, None)?;
        let reg = UmemReg {
            addr: umem.ptr as u64,
            len: umem.len as u64,
            chunk_size: FRAME_SIZE,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        setsockopt(&fd, XDP_UMEM_REG, &reg)?;
        for opt in [
            XDP_UMEM_FILL_RING,
            XDP_UMEM_COMPLETION_RING,
            XDP_RX_RING,
            XDP_TX_RING,
        ] {
            setsockopt(&fd, opt, &(RING as libc::c_int))?;
        }
        let mut off = MmapOffsets::default();
        let mut len = std::mem::size_of::<MmapOffsets>() as libc::socklen_t;
        // SAFETY: the kernel writes at most `len` bytes of the offsets
        // struct, whose layout is `struct xdp_mmap_offsets`.
        if unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                SOL_XDP,
                XDP_MMAP_OFFSETS,
                (&mut off as *mut MmapOffsets).cast(),
                &mut len,
            )
        } < 0
        {
            return Err(io::Error::last_os_error());
        }
        let raw = fd.as_raw_fd();
        let mut xsk = Xsk {
            fill: Ring::map(raw, &off.fr, XDP_UMEM_PGOFF_FILL_RING, true)?,
            completion: Ring::map(raw, &off.cr, XDP_UMEM_PGOFF_COMPLETION_RING, false)?,
            rx: Ring::map(raw, &off.rx, XDP_PGOFF_RX_RING, false)?,
            tx: Ring::map(raw, &off.tx, XDP_PGOFF_TX_RING, true)?,
            fd,
            umem,
            free: (RING..FRAMES).map(|f| u64::from(f * FRAME_SIZE)).collect(),
            zero_copy: false,
        };
        // The receive half, given to the kernel before the first frame.
        for f in 0..RING {
            xsk.fill.push(u64::from(f * FRAME_SIZE));
        }
        xsk.fill.publish();
        let tries: &[u16] = match mode {
            XdpMode::Driver => &[XDP_ZEROCOPY, XDP_COPY],
            XdpMode::Generic => &[XDP_COPY],
        };
        let mut last = None;
        for &how in tries {
            match bind(&xsk.fd, ifindex, queue, how | XDP_USE_NEED_WAKEUP) {
                Ok(()) => {
                    xsk.zero_copy = how == XDP_ZEROCOPY;
                    return Ok(xsk);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no bind mode to try")))
    }

    /// Whether the socket runs in zero-copy mode.
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// Hands each received frame (at most `max`) to `take`, then gives
    /// the frames back to the kernel; returns how many.
    pub fn receive(&mut self, max: usize, mut take: impl FnMut(&[u8])) -> usize {
        let n = self.rx.ready().min(max as u32);
        if n == 0 {
            return 0;
        }
        for _ in 0..n {
            let d = self.rx.pop();
            if let Some(frame) = self.frame(d.addr, d.len) {
                take(frame);
            }
            // The fill ring has room for every receive frame: only they
            // circulate through it.
            self.fill.push(d.addr & !u64::from(FRAME_SIZE - 1));
        }
        self.rx.release();
        self.fill.publish();
        self.wake_fill();
        n as usize
    }

    /// Tells the kernel it has frames to fill again, when it asks to be
    /// told (with `need_wakeup`, a driver that ran out of fill frames
    /// waits for this; in copy mode the kernel fills on receive and never
    /// asks).
    fn wake_fill(&self) {
        if !self.fill.needs_wakeup() {
            return;
        }
        // SAFETY: recvfrom(2) with no buffer and no address: the kernel
        // only looks at the rings. Its errors are transient, as a kick's.
        unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
    }

    /// Queues up to `count` frames for sending, each written by
    /// `write(i, frame)` (returning its length, at most [`FRAME_SIZE`]),
    /// and tells the kernel; returns how many were queued (fewer when the
    /// frames or the ring run out: the kernel has not sent the earlier
    /// ones yet).
    pub fn send(
        &mut self,
        count: usize,
        mut write: impl FnMut(usize, &mut [u8]) -> usize,
    ) -> usize {
        self.reap();
        let n = (count as u32)
            .min(self.tx.free(count as u32))
            .min(self.free.len() as u32) as usize;
        for i in 0..n {
            let Some(addr) = self.free.pop() else { break };
            let len = match self.frame_mut(addr) {
                Some(frame) => write(i, frame).min(FRAME_SIZE as usize),
                None => 0,
            };
            self.tx.push(Desc {
                addr,
                len: len as u32,
                options: 0,
            });
        }
        if n > 0 {
            self.tx.publish();
            self.kick();
        }
        n
    }

    /// Takes back the frames the kernel has sent, and kicks the kernel
    /// again if frames published earlier still wait (a kick that met a
    /// busy queue leaves them there).
    pub fn reap(&mut self) {
        let n = self.completion.ready();
        if n > 0 {
            for _ in 0..n {
                let addr = self.completion.pop();
                self.free.push(addr & !u64::from(FRAME_SIZE - 1));
            }
            self.completion.release();
        }
        if self.tx.kernel_behind() {
            self.kick();
        }
    }

    /// Tells the kernel to send what the transmit ring holds, when it
    /// asks to be told (always, in copy mode).
    fn kick(&self) {
        if !self.tx.needs_wakeup() {
            return;
        }
        // SAFETY: sendto(2) with no data and no address: the kernel only
        // looks at the transmit ring. Its errors (EAGAIN, EBUSY, ENOBUFS,
        // ENETDOWN) are transient: the frames stay on the ring and the
        // next `reap` kicks again.
        unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                std::ptr::null(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            )
        };
    }

    /// What the kernel dropped on this socket so far (`None` if it could
    /// not say).
    pub fn statistics(&self) -> Option<XskStats> {
        let mut stats = XskStats::default();
        let mut len = std::mem::size_of::<XskStats>() as libc::socklen_t;
        // SAFETY: the kernel writes at most `len` bytes of `struct
        // xdp_statistics` into the live local `stats`.
        let r = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                SOL_XDP,
                XDP_STATISTICS,
                (&mut stats as *mut XskStats).cast(),
                &mut len,
            )
        };
        (r == 0).then_some(stats)
    }

    fn frame(&self, addr: u64, len: u32) -> Option<&[u8]> {
        let (addr, len) = (addr as usize, len as usize);
        if addr.checked_add(len)? > self.umem.len {
            return None;
        }
        // SAFETY: inside the UMEM (checked above), a frame the kernel
        // handed back to this side on the receive ring: it does not write
        // it until the fill ring gives it back.
        Some(unsafe { std::slice::from_raw_parts(self.umem.ptr.add(addr), len) })
    }

    fn frame_mut(&mut self, addr: u64) -> Option<&mut [u8]> {
        let addr = addr as usize;
        if addr + FRAME_SIZE as usize > self.umem.len {
            return None;
        }
        // SAFETY: inside the UMEM (checked above), a transmit frame off
        // the free list: the kernel is done with it.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.umem.ptr.add(addr), FRAME_SIZE as usize)
        })
    }
}

impl AsRawFd for Xsk {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

fn setsockopt<T>(fd: &OwnedFd, opt: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: `v` is live and of the size given, the layout the option
    // expects; the kernel only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            SOL_XDP,
            opt,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Binds, retrying for a while on EBUSY: a queue whose previous socket
/// was just closed (a hostd restarting) is torn down in the background.
fn bind(fd: &OwnedFd, ifindex: u32, queue: u32, flags: u16) -> io::Result<()> {
    let sa = SockaddrXdp {
        family: AF_XDP as u16,
        flags,
        ifindex,
        queue_id: queue,
        shared_umem_fd: 0,
    };
    let mut tries = 0;
    loop {
        // SAFETY: a `sockaddr_xdp` of the size given, only read.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sa as *const SockaddrXdp).cast(),
                std::mem::size_of::<SockaddrXdp>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        tries += 1;
        if e.raw_os_error() != Some(libc::EBUSY) || tries >= 100 {
            return Err(e);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
