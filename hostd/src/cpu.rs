//! Hints to the CPU that the datapath gives on its hot paths.

/// Asks the CPU to bring the cache line holding `at` close, to be read
/// soon: a hint, which never faults (whatever `at` is) and changes nothing
/// a reader sees.
#[inline]
pub fn prefetch(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch does not access memory architecturally: it
        // cannot fault, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}
