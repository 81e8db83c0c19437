//! Physical addresses of this process's pages, from `/proc/self/pagemap`.
//!
//! In VM mode the device reaches guest-physical memory, so the driver must
//! know the physical address of every byte it hands over. Linux reports
//! each virtual page's frame in `/proc/self/pagemap`: one little-endian
//! `u64` per page, bit 63 "present", bits 0–54 the page frame number. The
//! frame number reads as 0 without `CAP_SYS_ADMIN`, which this module
//! reports as its own error rather than as address 0.
//!
//! A translation is only meaningful while the page stays where it is: the
//! callers pin what they translate (hugetlb pages for arenas, `mlock` for
//! application memory).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Bytes of a base page, the unit pagemap counts in.
const PAGE: u64 = 4096;
const PRESENT: u64 = 1 << 63;
const PFN_MASK: u64 = (1 << 55) - 1;

/// Why a virtual address cannot be translated.
#[derive(Debug, thiserror::Error)]
pub enum PagemapError {
    #[error("Cannot open /proc/self/pagemap")]
    Open(#[source] io::Error),
    #[error("Cannot read the pagemap entry of {va:#x}")]
    Read {
        va: u64,
        #[source]
        source: io::Error,
    },
    #[error("Page at {0:#x} is not present in memory")]
    NotPresent(u64),
    #[error(
        "Pagemap hides physical frame numbers: the driver needs CAP_SYS_ADMIN \
         (run it as root) to learn the physical addresses of its memory"
    )]
    NoFrameNumbers,
    #[error("Range of {len} bytes at {va:#x} wraps around")]
    Wraps { va: u64, len: u64 },
}

/// An open `/proc/self/pagemap`.
#[derive(Debug)]
pub struct Pagemap {
    file: File,
}

impl Pagemap {
    /// Opens this process's pagemap.
    pub fn open() -> Result<Self, PagemapError> {
        File::open("/proc/self/pagemap")
            .map(|file| Self { file })
            .map_err(PagemapError::Open)
    }

    /// Physical address of the byte at virtual address `va`; its page must
    /// be present (touched or locked).
    pub fn phys_addr(&self, va: u64) -> Result<u64, PagemapError> {
        let mut entry = [0u8; 8];
        self.file
            .read_exact_at(&mut entry, (va / PAGE) * 8)
            .map_err(|source| PagemapError::Read { va, source })?;
        decode(u64::from_le_bytes(entry), va)
    }

    /// The physical segments `[va, va + len)` is made of, in virtual order,
    /// with physically adjacent pages merged: `(phys_addr, len)` pairs whose
    /// lengths add up to `len`.
    pub fn segments(&self, va: u64, len: u64) -> Result<Vec<(u64, u64)>, PagemapError> {
        let end = va.checked_add(len).ok_or(PagemapError::Wraps { va, len })?;
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut cur = va;
        while cur < end {
            let page_end = (cur / PAGE + 1).saturating_mul(PAGE).min(end);
            let pa = self.phys_addr(cur)?;
            let n = page_end - cur;
            match out.last_mut() {
                Some((last_pa, last_len)) if *last_pa + *last_len == pa => *last_len += n,
                _ => out.push((pa, n)),
            }
            cur = page_end;
        }
        Ok(out)
    }
}

/// The physical address of `va` given its pagemap entry.
fn decode(entry: u64, va: u64) -> Result<u64, PagemapError> {
    if entry & PRESENT == 0 {
        return Err(PagemapError::NotPresent(va));
    }
    let pfn = entry & PFN_MASK;
    if pfn == 0 {
        return Err(PagemapError::NoFrameNumbers);
    }
    Ok(pfn * PAGE + va % PAGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_decode_to_addresses_or_clear_errors() {
        assert_eq!(decode(PRESENT | 0x1234, 0x7000_0abc).unwrap(), 0x0123_4abc);
        assert!(matches!(
            decode(0x1234, 0x1000),
            Err(PagemapError::NotPresent(0x1000))
        ));
        assert!(matches!(
            decode(PRESENT, 0x1000),
            Err(PagemapError::NoFrameNumbers)
        ));
        // Flag bits above the frame number are not part of it.
        assert_eq!(decode(PRESENT | (1 << 62) | 7, 0).unwrap(), 7 * PAGE);
    }

    /// Needs root (CAP_SYS_ADMIN), as the driver does in a VM.
    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn locked_pages_translate_and_merge() {
        if !is_root() {
            eprintln!("skipped: pagemap frame numbers need root");
            return;
        }
        let pm = Pagemap::open().expect("pagemap");
        let len = 4 * PAGE as usize;
        // SAFETY: a fresh anonymous mapping, locked (and so populated).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_LOCKED | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let va = p as u64;
        let segs = pm.segments(va + 100, 3 * PAGE).expect("translated");
        assert_eq!(segs.iter().map(|s| s.1).sum::<u64>(), 3 * PAGE);
        assert_eq!(segs[0].0 % PAGE, 100, "offset within the first page");
        for (i, w) in segs.windows(2).enumerate() {
            assert_ne!(
                w[0].0 + w[0].1,
                w[1].0,
                "segments {i} and {} not merged",
                i + 1
            );
        }
        // Each page's own translation agrees with the segments.
        let mut off = 0;
        for (pa, n) in &segs {
            assert_eq!(pm.phys_addr(va + 100 + off).expect("page"), *pa);
            off += n;
        }
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(p, len) };
        assert!(matches!(
            pm.segments(u64::MAX - 10, 20),
            Err(PagemapError::Wraps { .. })
        ));
    }
}
