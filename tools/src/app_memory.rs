//! Memory as an application owns it: a private anonymous mapping (page
//! aligned, not file backed), the kind of buffer `reg_mr` must take in
//! place in process mode and pin and translate in a VM.

use std::io;

use vm_memory::VolatileSlice;

/// A private anonymous mapping of `len` bytes, unmapped on drop. Drop the
/// memory regions registered over it first.
#[derive(Debug)]
pub struct AppMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; every access
// goes through volatile copies, which any thread may make.
unsafe impl Send for AppMemory {}
// SAFETY: as above; `&AppMemory` only allows volatile copies.
unsafe impl Sync for AppMemory {}

impl AppMemory {
    /// Maps `len` (> 0) zeroed bytes.
    pub fn new(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh private anonymous mapping at an address the kernel
        // picks; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(AppMemory {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Its first byte, for `reg_mr`.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: `new` maps at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn slice(&self) -> VolatileSlice<'_> {
        // SAFETY: the whole mapping, alive as long as `self`; volatile
        // because a device may write it concurrently.
        unsafe { VolatileSlice::new(self.ptr, self.len) }
    }

    /// Copies `data` to its start.
    pub fn write(&self, data: &[u8]) {
        self.slice().copy_from(data);
    }

    /// Copies all of it out.
    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        self.slice().copy_to(&mut out);
        out
    }
}

impl Drop for AppMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, not used after this.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
