//! Making memory the application already owns reachable by the device.
//!
//! vhost-user can only share memory that is backed by a file descriptor, so
//! `reg_mr` on ordinary (anonymous, malloc'd) memory moves it onto a memfd in
//! place: the whole pages covering the range are copied into a new memfd,
//! which is then mapped `MAP_SHARED` over the very same virtual range. The
//! application's pointer keeps working, now backed by shared memory, and the
//! pages are announced to vdev as a new memory region with
//! `guest_phys_addr == userspace_addr ==` their address.
//!
//! Regions are reference-counted per page range: overlapping registrations
//! share the regions they overlap (new regions are created only for pages not
//! yet covered). The last deregistration removes a region from vdev and
//! moves its pages back onto private anonymous memory, as they were: the
//! application still owns that memory and keeps using it.
//!
//! Both moves hold the other threads' writes to those pages from the copy
//! until the new pages are in place (`write_freeze`): a write in between
//! would land on the old pages and be lost, and a `free` on another thread
//! is such a write (malloc keeps its lists in the chunks). While a region
//! is shared, a forked child gets a private copy of it (`fork_copy`).
//!
//! Caveats (documented on `reg_mr`): whole pages become shared, including
//! bytes outside the registered range that share a page with it; where
//! userfaultfd is unavailable the writes are not held (said once in the
//! log); the pages become readable and writable; memory that is already
//! file-backed shared memory (or hugetlb) is remapped like any other. A
//! page-aligned buffer (posix_memalign, mmap) is the expected case.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;

use crate::dma::{map_shared, sealed_memfd, DmaRegion, PAGE_SIZE};
use crate::error::{Error, Result};
use crate::fork_copy;
use crate::raw_mm;
use crate::transport::Transport;
use crate::write_freeze::replace_pages;

/// Says once per process that application memory is moved without holding
/// the other threads' writes, and why.
fn warn_unfrozen_once(why: &io::Error) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            error = %why,
            "Application memory is moved without holding other threads' writes (userfaultfd \
             write protection is unavailable): a write another thread makes to a page while \
             ibv_reg_mr or ibv_dereg_mr moves it may be lost"
        );
    });
}

/// Which of the process's open devices (a `DeviceMemory`, one per
/// context) holds a region.
pub(crate) type Holder = u64;

/// One memfd that replaced a page range of the application's memory.
#[derive(Debug)]
struct UserRegion {
    len: u64,
    file: File,
    /// The contexts holding the region, with their count of MRs over it;
    /// each announced the memfd to its device.
    holders: Vec<(Holder, u32)>,
}

impl UserRegion {
    /// One more MR of `holder` over the region; the first of a context
    /// announces the memfd to its device.
    fn hold(&mut self, holder: Holder, transport: &dyn Transport, start: u64) -> Result<()> {
        if let Some(h) = self.holders.iter_mut().find(|h| h.0 == holder) {
            h.1 += 1;
            return Ok(());
        }
        transport.add_memory(&self.dma_region(start))?;
        self.holders.push((holder, 1));
        Ok(())
    }

    fn dma_region(&self, start: u64) -> DmaRegion<'_> {
        DmaRegion {
            fd: self.file.as_fd(),
            size: self.len,
            host_addr: start,
            device_addr: start,
        }
    }

    /// Moves the region's pages back onto private anonymous memory with the
    /// same contents (the device no longer reaches them). Pages the
    /// application unmapped meanwhile — against `reg_mr`'s contract — are
    /// left alone: something else may be mapped there now.
    fn restore(self, start: u64) {
        if !self.still_mapped_at(start) {
            tracing::warn!(
                start = format_args!("{start:#x}"),
                len = self.len,
                "Registered memory was unmapped before its MR was deregistered"
            );
            return;
        }
        let size = self.len as usize;
        let moved = raw_mm::map_anonymous(size).and_then(|private| {
            populate(private, size);
            // SAFETY: the range is this region's shared mapping (checked
            // above), which the application lets the library replace with
            // the same contents; `private` is the fresh mapping.
            unsafe { replace_pages(start, self.len, private) }
        });
        match moved {
            Ok(None) => {}
            Ok(Some(e)) => warn_unfrozen_once(&e),
            // The pages stay shared, and reachable by no device: only a
            // forked child would share them (the fork copy goes with the
            // region).
            Err(e) => tracing::warn!(
                error = %e,
                start = format_args!("{start:#x}"),
                "Cannot give deregistered memory back as private memory; it stays shared"
            ),
        }
    }

    /// Whether every page of the region is still a mapping of its memfd:
    /// the mappings over the range are all of the memfd's inode and cover
    /// it whole. Asked of `/proc/self/maps` with `PROCMAP_QUERY` (Linux
    /// 6.11), which finds each mapping directly; older kernels' text is
    /// read whole (it costs ~150 µs in a process with many mappings).
    fn still_mapped_at(&self, start: u64) -> bool {
        let Ok(inode) = self.file.metadata().map(|m| m.ino()) else {
            return false;
        };
        let Ok(maps) = File::open("/proc/self/maps") else {
            return false;
        };
        let end = start + self.len;
        match covered_by_inode_query(&maps, start, end, inode) {
            Ok(covered) => covered,
            Err(_) => std::io::read_to_string(maps)
                .is_ok_and(|text| covered_by_inode(&text, start, end, inode)),
        }
    }
}

/// The regions made from application memory, by start address.
///
/// One set per process ([`regions`]), not per context: a page can be moved
/// onto a memfd only once. A second context registering memory over the
/// same pages — the same buffer registered on two devices, or twice on one
/// device opened twice — announces the same memfd to its own device; had
/// it moved the pages again, the first device would go on reaching the
/// memfd the application no longer sees.
#[derive(Debug, Default)]
pub(crate) struct UserRegions {
    regions: BTreeMap<u64, UserRegion>,
}

/// The process's user regions.
pub(crate) fn regions() -> std::sync::MutexGuard<'static, UserRegions> {
    static REGIONS: std::sync::Mutex<UserRegions> = std::sync::Mutex::new(UserRegions {
        regions: BTreeMap::new(),
    });
    // The guarded state is consistent between calls.
    REGIONS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whole pages covering `[addr, addr + len)`.
pub(crate) fn page_span(addr: u64, len: u64) -> Option<(u64, u64)> {
    let page = PAGE_SIZE as u64;
    let start = addr & !(page - 1);
    let end = addr.checked_add(len)?.checked_next_multiple_of(page)?;
    Some((start, end))
}

impl UserRegions {
    /// Makes `[start, end)` (page-aligned) reachable by `holder`'s device,
    /// through `transport`, creating regions for pages not yet covered;
    /// returns the starts of every region it holds a reference on, for
    /// [`UserRegions::release`].
    ///
    /// # Safety
    ///
    /// `[start, end)` must be mapped, readable memory of this process that
    /// may be replaced in place by a shared mapping with the same contents
    /// (see the module documentation).
    pub(crate) unsafe fn acquire(
        &mut self,
        holder: Holder,
        transport: &dyn Transport,
        start: u64,
        end: u64,
    ) -> Result<Vec<u64>> {
        let mut held = Vec::new();
        let mut cur = start;
        while cur < end {
            let covering = self
                .regions
                .range_mut(..=cur)
                .next_back()
                .filter(|(&s, r)| s + r.len > cur);
            let step = match covering {
                Some((&s, region)) => region
                    .hold(holder, transport, s)
                    .map(|()| (s, s + region.len)),
                None => {
                    let gap_end = self
                        .regions
                        .range(cur..)
                        .next()
                        .map_or(end, |(&s, _)| s.min(end));
                    // SAFETY: `[cur, gap_end)` is inside the caller's range.
                    unsafe { Self::create(holder, transport, cur, gap_end - cur) }.map(|region| {
                        self.regions.insert(cur, region);
                        (cur, gap_end)
                    })
                }
            };
            match step {
                Ok((s, next)) => {
                    held.push(s);
                    cur = next;
                }
                Err(e) => {
                    self.release(holder, transport, &held);
                    return Err(e);
                }
            }
        }
        Ok(held)
    }

    /// Drops one of `holder`'s references on each region in `starts`;
    /// removes from its device the regions it no longer holds, and gives
    /// the pages no context holds any more back to the application as
    /// private memory.
    pub(crate) fn release(&mut self, holder: Holder, transport: &dyn Transport, starts: &[u64]) {
        for start in starts {
            let Some(region) = self.regions.get_mut(start) else {
                tracing::error!(start, "Releasing an unknown user memory region");
                continue;
            };
            let Some(i) = region.holders.iter().position(|h| h.0 == holder) else {
                tracing::error!(
                    start,
                    holder,
                    "Releasing a user memory region the context does not hold"
                );
                continue;
            };
            region.holders[i].1 -= 1;
            if region.holders[i].1 > 0 {
                continue;
            }
            region.holders.swap_remove(i);
            if let Err(e) = transport.remove_memory(&region.dma_region(*start)) {
                tracing::warn!(error = %e, start, "Cannot remove a user memory region");
            }
            if region.holders.is_empty() {
                if let Some(region) = self.regions.remove(start) {
                    region.restore(*start);
                }
            }
        }
    }

    /// Every region: where it is and the memfd holding it.
    pub(crate) fn moved(&self) -> impl Iterator<Item = fork_copy::Moved> + '_ {
        self.regions.iter().map(|(&start, r)| fork_copy::Moved {
            start,
            len: r.len,
            fd: r.file.as_raw_fd(),
        })
    }

    /// Drops every region without touching the pages or any device: in a
    /// forked child, which owns none of them (its copies are private).
    pub(crate) fn forget_all(&mut self) {
        self.regions.clear();
    }

    /// Number of regions.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.regions.len()
    }

    /// Moves `[start, start + len)` onto a new memfd and announces it.
    ///
    /// # Safety
    ///
    /// As for [`UserRegions::acquire`].
    unsafe fn create(
        holder: Holder,
        transport: &dyn Transport,
        start: u64,
        len: u64,
    ) -> Result<UserRegion> {
        let size = usize::try_from(len).map_err(|_| Error::InvalidArgument("region too large"))?;
        let file = sealed_memfd(c"vrdma-user-mr", size)?;
        let os = |what| move |source| Error::Os { what, source };
        let shared = map_shared(file.as_fd(), size).map_err(os("map a memfd"))?;
        populate(shared, size);
        // SAFETY: the range may be replaced (caller's contract); `shared` is
        // the fresh `size`-byte mapping of the memfd.
        let unfrozen = unsafe { replace_pages(start, len, shared) }
            .map_err(os("map a memfd over application memory"))?;
        if let Some(e) = unfrozen {
            warn_unfrozen_once(&e);
        }
        let region = UserRegion {
            len,
            file,
            holders: vec![(holder, 1)],
        };
        fork_copy::install();
        if let Err(e) = transport.add_memory(&region.dma_region(start)) {
            region.restore(start);
            return Err(e.into());
        }
        tracing::debug!(
            start = format_args!("{start:#x}"),
            len,
            "Shared application memory"
        );
        Ok(region)
    }
}

/// `struct procmap_query` of `<linux/fs.h>`.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = 0xc068_6611;

/// [`covered_by_inode`] through `PROCMAP_QUERY` on an open
/// `/proc/self/maps`; an error when the kernel lacks the query.
fn covered_by_inode_query(maps: &File, start: u64, end: u64, inode: u64) -> io::Result<bool> {
    let mut next = start;
    while next < end {
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_addr: next,
            ..ProcmapQuery::default()
        };
        // SAFETY: the query structure is alive and sized for the call; the
        // kernel writes only into it (no name or build id is asked for).
        let r = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &mut q) };
        if r < 0 {
            let e = io::Error::last_os_error();
            // No mapping covers `next`: a hole.
            return if e.raw_os_error() == Some(libc::ENOENT) {
                Ok(false)
            } else {
                Err(e)
            };
        }
        if q.inode != inode || q.vma_end <= next {
            return Ok(false);
        }
        next = q.vma_end;
    }
    Ok(true)
}

/// Faults in the pages of a fresh mapping the move will fill, before the
/// move holds the other threads' writes: a page fault costs more than the
/// copy of its page (here, 16 MiB: 19 ms to fault in a memfd's pages,
/// 11 ms an anonymous mapping's, against 7–9 ms for the held copy).
/// Best effort (older kernels lack `MADV_POPULATE_WRITE`).
fn populate(mapping: *mut u8, len: usize) {
    // SAFETY: a mapping the caller just made.
    let _ = unsafe { raw_mm::populate_write(mapping, len) };
}

/// Whether the mappings listed in `maps` (`/proc/<pid>/maps` format) cover
/// `[start, end)` without a hole, all of them mapping `inode`.
fn covered_by_inode(maps: &str, start: u64, end: u64, inode: u64) -> bool {
    let mut next = start;
    for line in maps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some(ino)) = (fields.next(), fields.nth(3)) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= next || lo >= end {
            continue;
        }
        if lo > next || ino.parse::<u64>() != Ok(inode) {
            return false;
        }
        next = hi;
        if next >= end {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::StubTransport as Recorder;

    /// Anonymous private pages, as malloc would give.
    fn anon(pages: usize) -> *mut u8 {
        crate::raw_mm::map_anonymous(pages * PAGE_SIZE).expect("an anonymous mapping")
    }

    #[test]
    fn page_span_rounds_out() {
        assert_eq!(page_span(0x1001, 1), Some((0x1000, 0x2000)));
        assert_eq!(page_span(0x1000, 0x1000), Some((0x1000, 0x2000)));
        assert_eq!(page_span(0x1fff, 2), Some((0x1000, 0x3000)));
        assert_eq!(page_span(u64::MAX, 2), None);
    }

    #[test]
    fn contents_survive_and_become_shared() {
        let t = Recorder::default();
        let mut regions = UserRegions::default();
        let p = anon(2);
        // SAFETY: `p` is our 2-page mapping.
        unsafe { std::ptr::copy_nonoverlapping(b"before".as_ptr(), p.add(100), 6) };
        let start = p as u64;
        // SAFETY: the test owns the pages.
        let held = unsafe { regions.acquire(1, &t, start, start + 2 * PAGE_SIZE as u64) }.unwrap();
        assert_eq!(held, vec![start]);
        assert_eq!(
            *t.added.lock().unwrap(),
            vec![(start, 2 * PAGE_SIZE as u64)]
        );
        let mut got = [0u8; 6];
        // SAFETY: still mapped, now shared.
        unsafe { std::ptr::copy_nonoverlapping(p.add(100), got.as_mut_ptr(), 6) };
        assert_eq!(&got, b"before");
        // The device's view (the memfd) sees the application's writes.
        // SAFETY: within the mapping.
        unsafe { p.add(PAGE_SIZE + 8).write_volatile(0x5a) };
        let region = regions.regions.get(&start).unwrap();
        let mut byte = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&region.file, &mut byte, PAGE_SIZE as u64 + 8)
            .unwrap();
        assert_eq!(byte[0], 0x5a);
        regions.release(1, &t, &held);
        assert_eq!(
            *t.removed.lock().unwrap(),
            vec![(start, 2 * PAGE_SIZE as u64)]
        );
        assert_eq!(regions.len(), 0);
        // The pages are private anonymous memory again, with the bytes
        // written while they were shared.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(covered_by_inode(
            &maps,
            start,
            start + 2 * PAGE_SIZE as u64,
            0
        ));
        // SAFETY: the mapping stays in place after release.
        unsafe {
            assert_eq!(p.add(PAGE_SIZE + 8).read_volatile(), 0x5a);
            p.add(100).write_volatile(1);
        }
    }

    /// Memory the application unmapped before deregistering is not mapped
    /// again by the release (something else may live there by then).
    #[test]
    fn a_release_after_munmap_maps_nothing() {
        let t = Recorder::default();
        let mut regions = UserRegions::default();
        let start = anon(3) as u64 + PAGE_SIZE as u64;
        // SAFETY: the test owns the pages.
        let held = unsafe { regions.acquire(1, &t, start, start + PAGE_SIZE as u64) }.unwrap();
        // SAFETY: unmapping the test's page (the region's).
        let r = unsafe { libc::munmap(start as *mut libc::c_void, PAGE_SIZE) };
        assert_eq!(r, 0);
        regions.release(1, &t, &held);
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mapped = maps.lines().any(|l| {
            let (lo, hi) = l.split_once(' ').unwrap().0.split_once('-').unwrap();
            let (lo, hi) = (
                u64::from_str_radix(lo, 16).unwrap(),
                u64::from_str_radix(hi, 16).unwrap(),
            );
            lo <= start && start < hi
        });
        assert!(!mapped, "the release mapped the unmapped page again");
    }

    /// The query and the text give the same answers on this process.
    #[test]
    fn maps_coverage_by_query_matches_the_text() {
        let t = Recorder::default();
        let mut regions = UserRegions::default();
        let start = anon(4) as u64 + PAGE_SIZE as u64;
        let page = PAGE_SIZE as u64;
        // SAFETY: the test owns the pages.
        let held = unsafe { regions.acquire(1, &t, start, start + 2 * page) }.unwrap();
        let region = regions.regions.get(&start).unwrap();
        let inode = region.file.metadata().unwrap().ino();
        let maps = File::open("/proc/self/maps").unwrap();
        let text = std::fs::read_to_string("/proc/self/maps").unwrap();
        for (lo, hi, want) in [
            (start, start + 2 * page, true),
            (start + page, start + 2 * page, true),
            (start - page, start + 2 * page, false),
            (start, start + 3 * page, false),
        ] {
            match covered_by_inode_query(&maps, lo, hi, inode) {
                Ok(got) => assert_eq!(got, want, "query [{lo:#x}, {hi:#x})"),
                Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOTTY), "{e}"),
            }
            assert_eq!(covered_by_inode(&text, lo, hi, inode), want, "text");
        }
        assert!(region.still_mapped_at(start));
        regions.release(1, &t, &held);
    }

    #[test]
    fn maps_coverage_is_read_exactly() {
        let maps = "1000-3000 rw-s 00000000 00:01 77 /memfd:x (deleted)\n\
                    3000-4000 rw-s 00002000 00:01 77 /memfd:x (deleted)\n\
                    5000-6000 rw-p 00000000 00:00 0\n";
        assert!(covered_by_inode(maps, 0x1000, 0x4000, 77));
        assert!(covered_by_inode(maps, 0x2000, 0x3000, 77));
        assert!(
            !covered_by_inode(maps, 0x1000, 0x5000, 77),
            "a hole at the end"
        );
        assert!(
            !covered_by_inode(maps, 0x0, 0x2000, 77),
            "a hole at the start"
        );
        assert!(!covered_by_inode(maps, 0x3000, 0x6000, 77));
        assert!(covered_by_inode(maps, 0x5000, 0x6000, 0));
        assert!(!covered_by_inode(maps, 0x5000, 0x6000, 77), "another inode");
    }

    /// Another thread of the application keeps writing to the pages while
    /// they move onto the memfd: none of its writes may be lost (malloc's
    /// own bookkeeping in a neighbouring chunk is such a writer).
    #[test]
    fn writes_of_other_threads_during_the_move_are_kept() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        const PAGES: usize = 64;
        let t = Recorder::default();
        let mut regions = UserRegions::default();
        for round in 0..20 {
            let p = anon(PAGES) as usize;
            let stop = Arc::new(AtomicBool::new(false));
            let started = Arc::new(AtomicBool::new(false));
            let (s, st) = (Arc::clone(&stop), Arc::clone(&started));
            // Increments a counter in the first and in the last page with
            // plain read-modify-write: a write lost to the move shows as a
            // counter behind the number of increments.
            let writer = std::thread::spawn(move || {
                let counters = [p as *mut u64, (p + (PAGES - 1) * PAGE_SIZE + 8) as *mut u64];
                let mut n = 0u64;
                while !s.load(Ordering::Relaxed) {
                    for c in counters {
                        // SAFETY: inside the test's mapping, which stays
                        // mapped (its pages move, the addresses stay).
                        unsafe { c.write_volatile(c.read_volatile() + 1) };
                    }
                    n += 1;
                    st.store(true, Ordering::Relaxed);
                }
                n
            });
            while !started.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
            let start = p as u64;
            // Moved onto the memfd and back, the writer running throughout.
            // SAFETY: the test owns the pages.
            let held = unsafe { regions.acquire(1, &t, start, start + (PAGES * PAGE_SIZE) as u64) }
                .unwrap();
            regions.release(1, &t, &held);
            stop.store(true, Ordering::Relaxed);
            let n = writer.join().unwrap();
            // SAFETY: the counters are inside the (now shared) mapping.
            let got = unsafe {
                [
                    (p as *const u64).read_volatile(),
                    ((p + (PAGES - 1) * PAGE_SIZE + 8) as *const u64).read_volatile(),
                ]
            };
            assert_eq!(got, [n, n], "round {round}: writes were lost");
        }
    }

    /// A forked child gets its own copy of the moved pages, as it would of
    /// ordinary memory: its writes (malloc's, in a heap page) must not
    /// reach the parent, nor the parent's reach it.
    #[test]
    fn a_forked_child_writes_to_its_own_copy() {
        // The process's regions, as a context's registration makes them
        // (the fork handlers copy those); the lock is not held across the
        // fork.
        const HOLDER: Holder = u64::MAX;
        let t = Recorder::default();
        let p = anon(2);
        let start = p as u64;
        // SAFETY: the test owns the pages.
        let held =
            unsafe { regions().acquire(HOLDER, &t, start, start + 2 * PAGE_SIZE as u64) }.unwrap();
        // SAFETY: inside the mapping.
        unsafe { p.add(PAGE_SIZE).write_volatile(1) };
        let mut pipe = [0; 2];
        // SAFETY: a valid array of two fds.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child only reads and writes memory, makes system
        // calls and calls _exit (async-signal-safe).
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            // SAFETY: in the child's copy of the mapping; the pipe's fds.
            unsafe {
                p.add(PAGE_SIZE).write_volatile(2);
                let mut seen = 0u8;
                // Waits for the parent's write, then reports what it sees.
                libc::read(pipe[0], std::ptr::from_mut(&mut seen).cast(), 1);
                let got = p.add(PAGE_SIZE).read_volatile();
                // The child holds none of the parent's regions.
                let inherited = regions().len();
                libc::_exit(match (got, inherited) {
                    (2, 0) => 0,
                    (2, _) => 9,
                    _ => 10 + i32::from(got),
                });
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        // SAFETY: inside the mapping.
        unsafe { p.add(PAGE_SIZE).write_volatile(3) };
        // SAFETY: writes one byte to the pipe.
        assert_eq!(unsafe { libc::write(pipe[1], [0u8].as_ptr().cast(), 1) }, 1);
        let mut status = 0;
        // SAFETY: waits for our child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child saw the parent's write (10 + value) or kept its regions (9)"
        );
        // SAFETY: inside the mapping.
        let now = unsafe { p.add(PAGE_SIZE).read_volatile() };
        assert_eq!(now, 3, "the child's write reached the parent");
        // The parent's mapping is still the device's.
        let mut byte = [0u8; 1];
        let file = regions()
            .regions
            .get(&start)
            .unwrap()
            .file
            .try_clone()
            .unwrap();
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut byte, PAGE_SIZE as u64).unwrap();
        assert_eq!(byte[0], 3);
        regions().release(HOLDER, &t, &held);
        // SAFETY: our fds.
        unsafe {
            libc::close(pipe[0]);
            libc::close(pipe[1]);
        }
    }

    #[test]
    fn overlapping_registrations_share_and_fill_gaps() {
        let t = Recorder::default();
        let mut regions = UserRegions::default();
        let p = anon(4) as u64;
        let page = PAGE_SIZE as u64;
        // SAFETY: the test owns the 4 pages.
        let a = unsafe { regions.acquire(1, &t, p + page, p + 2 * page) }.unwrap();
        // Covers pages 0..4: a new region before, the shared one, one after.
        // SAFETY: as above.
        let b = unsafe { regions.acquire(1, &t, p, p + 4 * page) }.unwrap();
        assert_eq!(b, vec![p, p + page, p + 2 * page]);
        assert_eq!(
            *t.added.lock().unwrap(),
            vec![(p + page, page), (p, page), (p + 2 * page, 2 * page)]
        );
        regions.release(1, &t, &a);
        assert!(t.removed.lock().unwrap().is_empty(), "still used by b");
        regions.release(1, &t, &b);
        assert_eq!(t.removed.lock().unwrap().len(), 3);
        assert_eq!(regions.len(), 0);
    }
}
