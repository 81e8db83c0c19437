//! The driver's memory as the device sees it, per [`MemoryModel`].
//!
//! Two jobs differ between the models: where DMA arenas come from, and how
//! application memory given to `reg_mr` becomes reachable.
//!
//! | | [`MemoryModel::SharedFiles`] (process) | [`MemoryModel::GuestPhysical`] (VM) |
//! |---|---|---|
//! | arena | memfd, announced with `add_memory`, device addr = VA | 2 MiB hugepages, device addr = physical addr (pagemap) |
//! | `reg_mr` on app memory | pages moved onto memfds in place, announced; one range at addr = VA | pages locked (`mlock`), translated page by page, merged into physical segments |
//! | registration | `REG_MR` | `REG_MR` for one segment, `REG_MR_SG` for several |

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::dma::{DmaArena, DmaError, HUGE_PAGE_SIZE, PAGE_SIZE};
use crate::error::{Error, Result};
use crate::pagemap::Pagemap;
use crate::transport::{MemoryModel, Transport};
use crate::user_mem::{self, page_span, Holder};

/// Where application memory registered with `reg_mr` is, for the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Placement {
    /// One range of device addresses starting here.
    Contiguous(u64),
    /// Several `(device_addr, len)` segments, in the region's byte order.
    Segments(Vec<(u64, u64)>),
}

/// What keeps application memory reachable until its MR is gone.
#[derive(Debug)]
pub(crate) enum Hold {
    /// User regions (memfds) by start address.
    Shared(Vec<u64>),
    /// Locked pages `[start, end)`.
    Pinned { start: u64, end: u64 },
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded state is consistent between calls.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The driver's memory, in the transport's model.
///
/// What application memory `reg_mr` takes is process-wide (the moved pages
/// of `user_mem::regions`, the locked pages of [`pinned`]): several
/// contexts may register the same pages.
#[derive(Debug)]
pub(crate) enum DeviceMemory {
    SharedFiles {
        /// This context, among the holders of user regions.
        holder: Holder,
    },
    GuestPhysical {
        pagemap: Pagemap,
    },
}

/// The process's locked application pages.
fn pinned() -> MutexGuard<'static, PinnedPages> {
    static PINNED: Mutex<PinnedPages> = Mutex::new(PinnedPages {
        refs: BTreeMap::new(),
    });
    lock(&PINNED)
}

impl DeviceMemory {
    /// The memory of a device reached through a transport with `model`.
    pub(crate) fn new(model: MemoryModel) -> Result<Self> {
        Ok(match model {
            MemoryModel::SharedFiles => {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                Self::SharedFiles {
                    holder: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                }
            }
            MemoryModel::GuestPhysical => Self::GuestPhysical {
                pagemap: Pagemap::open().map_err(|e| Error::Dma(DmaError::Pagemap(e)))?,
            },
        })
    }

    /// A new arena of at least `size` bytes that the device can reach
    /// (announced to it when the model needs that). Hugepage arenas are 2
    /// MiB unless an allocation needs more: every extra hugepage must be
    /// physically adjacent to the one before.
    pub(crate) fn new_arena(
        &self,
        transport: &dyn Transport,
        size: usize,
    ) -> Result<Arc<DmaArena>> {
        match self {
            Self::SharedFiles { .. } => {
                let arena = DmaArena::new(size)?;
                if let Some(region) = arena.region() {
                    transport.add_memory(&region)?;
                }
                Ok(arena)
            }
            Self::GuestPhysical { pagemap, .. } => Ok(DmaArena::hugepages(size, pagemap)?),
        }
    }

    /// Size of the next arena for an allocation of `needed` bytes, when the
    /// configured arena size is `configured`.
    pub(crate) fn arena_size(&self, needed: usize, configured: usize) -> usize {
        match self {
            Self::SharedFiles { .. } => needed.max(configured),
            Self::GuestPhysical { .. } => needed.max(HUGE_PAGE_SIZE),
        }
    }

    /// Makes `[va, va + len)` of application memory reachable by the device.
    ///
    /// # Safety
    ///
    /// The range must be mapped memory of this process that stays mapped
    /// until [`DeviceMemory::release`]; in the shared-files model its pages
    /// may be replaced in place (see `user_mem`).
    pub(crate) unsafe fn acquire(
        &self,
        transport: &dyn Transport,
        va: u64,
        len: u64,
    ) -> Result<(Placement, Hold)> {
        let (start, end) =
            page_span(va, len).ok_or(Error::InvalidArgument("range wraps around"))?;
        match self {
            Self::SharedFiles { holder } => {
                // SAFETY: the caller's contract covers every page of the range.
                let held = unsafe { user_mem::regions().acquire(*holder, transport, start, end)? };
                // User regions are announced with device address == VA.
                Ok((Placement::Contiguous(va), Hold::Shared(held)))
            }
            Self::GuestPhysical { pagemap } => {
                pinned().pin(start, end)?;
                let hold = Hold::Pinned { start, end };
                match pagemap.segments(va, len) {
                    Ok(segments) if segments.len() == 1 => {
                        Ok((Placement::Contiguous(segments[0].0), hold))
                    }
                    Ok(segments) => Ok((Placement::Segments(segments), hold)),
                    Err(e) => {
                        self.release(transport, &hold);
                        Err(Error::Dma(DmaError::Pagemap(e)))
                    }
                }
            }
        }
    }

    /// Gives up what [`DeviceMemory::acquire`] took.
    pub(crate) fn release(&self, transport: &dyn Transport, hold: &Hold) {
        match (self, hold) {
            (Self::SharedFiles { holder }, Hold::Shared(starts)) => {
                user_mem::regions().release(*holder, transport, starts);
            }
            (Self::GuestPhysical { .. }, Hold::Pinned { start, end }) => {
                pinned().unpin(*start, *end);
            }
            _ => tracing::error!(?hold, "Releasing memory of another memory model"),
        }
    }
}

/// Reference counts of locked application pages: `mlock` does not nest, so
/// a page is unlocked only when the last MR over it goes — of any context
/// of the process ([`pinned`]).
///
/// A pinned page is also kept out of children (`MADV_DONTFORK`, as
/// rdma-core's fork support does): after a `fork`, the first write to a
/// shared copy-on-write page would give the writing parent a new physical
/// page, while the device kept writing to the old one, now the child's.
#[derive(Debug, Default)]
pub(crate) struct PinnedPages {
    refs: BTreeMap<u64, u32>,
}

impl PinnedPages {
    /// Locks the pages of `[start, end)` (page-aligned) not locked yet.
    pub(crate) fn pin(&mut self, start: u64, end: u64) -> Result<()> {
        let fresh: Vec<u64> = pages(start, end)
            .filter(|p| !self.refs.contains_key(p))
            .collect();
        for (run_start, run_end) in runs(&fresh) {
            if let Err(e) = pin_run(run_start, run_end) {
                // Undo the runs pinned so far.
                for (s, e) in runs(&fresh).take_while(|&(s, _)| s < run_start) {
                    unpin_run(s, e);
                }
                return Err(e);
            }
        }
        for p in pages(start, end) {
            *self.refs.entry(p).or_insert(0) += 1;
        }
        Ok(())
    }

    /// Drops one reference on each page of `[start, end)`; unlocks the
    /// pages no MR holds any more.
    pub(crate) fn unpin(&mut self, start: u64, end: u64) {
        let mut gone = Vec::new();
        for p in pages(start, end) {
            match self.refs.get_mut(&p) {
                Some(1) => {
                    self.refs.remove(&p);
                    gone.push(p);
                }
                Some(n) => *n -= 1,
                None => tracing::error!(page = p, "Unpinning a page that is not pinned"),
            }
        }
        for (s, e) in runs(&gone) {
            unpin_run(s, e);
        }
    }

    /// Number of pinned pages.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.refs.len()
    }
}

/// Locks `[start, end)` and keeps it out of children; all or nothing.
fn pin_run(start: u64, end: u64) -> Result<()> {
    let (addr, len) = (start as *mut libc::c_void, (end - start) as usize);
    // SAFETY: mlock only changes residency of our own mapped pages (it
    // faults them in for writing); unmapped ranges give ENOMEM.
    if unsafe { libc::mlock(addr, len) } != 0 {
        return Err(Error::Os {
            what: "lock application memory (mlock; raise RLIMIT_MEMLOCK)",
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: MADV_DONTFORK only changes what a future fork copies of
    // these pages of ours, which the line above found mapped.
    if unsafe { libc::madvise(addr, len, libc::MADV_DONTFORK) } != 0 {
        let source = io::Error::last_os_error();
        // SAFETY: unlocking the pages locked above.
        unsafe { libc::munlock(addr, len) };
        return Err(Error::Os {
            what: "keep registered memory out of forked children (madvise MADV_DONTFORK)",
            source,
        });
    }
    Ok(())
}

/// Undoes [`pin_run`].
fn unpin_run(start: u64, end: u64) {
    let (addr, len) = (start as *mut libc::c_void, (end - start) as usize);
    // SAFETY: these pages were pinned by `pin_run`: forks copy them again,
    // and they are unlocked; neither touches their contents.
    unsafe {
        libc::madvise(addr, len, libc::MADV_DOFORK);
        libc::munlock(addr, len);
    }
}

fn pages(start: u64, end: u64) -> impl Iterator<Item = u64> {
    (start..end).step_by(PAGE_SIZE)
}

/// Sorted page addresses merged into `[start, end)` runs.
fn runs(pages: &[u64]) -> impl Iterator<Item = (u64, u64)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let start = *pages.get(i)?;
        let mut end = start + PAGE_SIZE as u64;
        i += 1;
        while pages.get(i) == Some(&end) {
            end += PAGE_SIZE as u64;
            i += 1;
        }
        Some((start, end))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::StubTransport;
    use vm_memory::{Bytes, GuestAddress};

    const P: u64 = PAGE_SIZE as u64;

    /// The byte at `addr` as a device reached through `t` sees it.
    fn device_byte(t: &StubTransport, addr: u64) -> u8 {
        t.memory().read_obj(GuestAddress(addr)).unwrap()
    }

    /// The same pages registered by two contexts (two devices, or one
    /// opened twice) are moved once: both devices reach the memory the
    /// application sees, until the last of them lets go.
    #[test]
    fn two_contexts_registering_the_same_pages_share_one_memfd() {
        let (t1, t2) = (StubTransport::default(), StubTransport::default());
        let m1 = DeviceMemory::new(MemoryModel::SharedFiles).unwrap();
        let m2 = DeviceMemory::new(MemoryModel::SharedFiles).unwrap();
        let p = crate::raw_mm::map_anonymous(2 * PAGE_SIZE).unwrap();
        let base = p as u64;
        // SAFETY: the test's own mapping, registered whole, then its first
        // page.
        let (_, h1) = unsafe { m1.acquire(&t1, base, 2 * P) }.unwrap();
        // SAFETY: as above.
        let (_, h2) = unsafe { m2.acquire(&t2, base + 100, 10) }.unwrap();
        assert_eq!(*t2.added.lock().unwrap(), vec![(base, 2 * P)]);
        // SAFETY: inside the mapping.
        unsafe { p.add(200).write_volatile(0x3c) };
        assert_eq!(device_byte(&t1, base + 200), 0x3c);
        assert_eq!(device_byte(&t2, base + 200), 0x3c);
        m1.release(&t1, &h1);
        assert_eq!(*t1.removed.lock().unwrap(), vec![(base, 2 * P)]);
        // The pages stay shared for the second context.
        // SAFETY: inside the mapping.
        unsafe { p.add(P as usize + 300).write_volatile(0x4d) };
        assert_eq!(device_byte(&t2, base + P + 300), 0x4d);
        m2.release(&t2, &h2);
        assert_eq!(*t2.removed.lock().unwrap(), vec![(base, 2 * P)]);
        // SAFETY: the mapping stays, private again, with its bytes.
        unsafe {
            assert_eq!(p.add(200).read_volatile(), 0x3c);
            assert_eq!(p.add(P as usize + 300).read_volatile(), 0x4d);
        }
    }

    #[test]
    fn runs_merge_adjacent_pages() {
        let got: Vec<_> = runs(&[0, P, 2 * P, 5 * P, 7 * P, 8 * P]).collect();
        assert_eq!(got, vec![(0, 3 * P), (5 * P, 6 * P), (7 * P, 9 * P)]);
        assert_eq!(runs(&[]).count(), 0);
    }

    /// Whether each of the 4 pages from `base` is marked "do not copy on
    /// fork" (`dc` among its mapping's VmFlags in /proc/self/smaps).
    fn not_forked(base: u64) -> [bool; 4] {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut vmas = Vec::new();
        let mut range = None;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((s, e)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                range = u64::from_str_radix(s, 16)
                    .ok()
                    .zip(u64::from_str_radix(e, 16).ok());
            } else if let (Some(flags), Some(r)) = (line.strip_prefix("VmFlags:"), range) {
                vmas.push((r, flags.split_whitespace().any(|f| f == "dc")));
            }
        }
        std::array::from_fn(|i| {
            let page = base + i as u64 * P;
            vmas.iter()
                .find(|((s, e), _)| (*s..*e).contains(&page))
                .is_some_and(|(_, dc)| *dc)
        })
    }

    #[test]
    fn overlapping_pins_keep_pages_locked_until_the_last() {
        let len = 4 * PAGE_SIZE;
        // SAFETY: a fresh anonymous mapping owned by the test.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let base = p as u64;
        let mut pinned = PinnedPages::default();
        pinned.pin(base, base + 3 * P).expect("pin a");
        pinned.pin(base + 2 * P, base + 4 * P).expect("pin b");
        assert_eq!(pinned.len(), 4);
        assert_eq!(not_forked(base), [true; 4]);
        pinned.unpin(base, base + 3 * P);
        assert_eq!(pinned.len(), 2, "pages of b stay");
        assert_eq!(not_forked(base), [false, false, true, true]);
        pinned.unpin(base + 2 * P, base + 4 * P);
        assert_eq!(pinned.len(), 0);
        assert_eq!(not_forked(base), [false; 4]);
        // Locking unmapped memory fails and leaves nothing behind.
        // SAFETY: unmapping the test's own mapping.
        unsafe { libc::munmap(p, len) };
        assert!(pinned.pin(base, base + P).is_err());
        assert_eq!(pinned.len(), 0);
    }
}
