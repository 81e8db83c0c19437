//! Memory as an application owns it: a private anonymous mapping (page
//! aligned, not file backed), the kind of buffer `reg_mr` must take in
//! place in process mode and pin and translate in a VM.

use std::io;

use vm_memory::mmap::MmapRegion;
use vm_memory::{VolatileMemory, VolatileSlice};

/// A private anonymous mapping of `len` bytes, unmapped on drop. Drop the
/// memory regions registered over it first.
#[derive(Debug)]
pub struct AppMemory(MmapRegion);

impl AppMemory {
    /// Maps `len` (> 0) zeroed bytes.
    pub fn new(len: usize) -> io::Result<Self> {
        MmapRegion::new(len).map(Self).map_err(io::Error::other)
    }

    /// Its first byte, for `reg_mr`.
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.as_ptr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.size()
    }

    /// Whether it is empty (never: `new` maps at least one page).
    pub fn is_empty(&self) -> bool {
        self.0.size() == 0
    }

    /// All of it, accessed with volatile copies: a device may write it at
    /// any time.
    fn slice(&self) -> VolatileSlice<'_> {
        self.0.as_volatile_slice()
    }

    /// Copies `data` to its start.
    pub fn write(&self, data: &[u8]) {
        self.slice().copy_from(data);
    }

    /// Copies all of it out.
    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len()];
        self.slice().copy_to(&mut out);
        out
    }
}
