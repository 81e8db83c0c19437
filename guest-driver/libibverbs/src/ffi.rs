//! What every exported function shares: no panic crosses the C boundary,
//! errors become errno values, and C strings are written safely.

use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};

use vrdma_guest_driver::Error;

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(errno: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot,
    // valid for the thread's life.
    unsafe { *libc::__errno_location() = errno };
}

/// The errno a guest-driver error means to a verbs caller.
pub(crate) fn errno_of(e: &Error) -> c_int {
    e.errno()
}

/// A verbs error: the positive errno to return (or to put in `errno`).
pub(crate) type VResult<T> = Result<T, c_int>;

/// `EINVAL` for a NULL pointer argument.
pub(crate) fn non_null<T>(p: *const T) -> VResult<()> {
    if p.is_null() {
        Err(libc::EINVAL)
    } else {
        Ok(())
    }
}

/// Runs `f`, turning a panic (a bug: nothing in this library is meant to
/// panic) into `fallback` with `errno = EIO`, so that no unwinding reaches C.
pub(crate) fn guard<R>(verb: &'static str, fallback: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            eprintln!("libibverbs (vrdma): internal error in {verb}; the verb failed with EIO");
            set_errno(libc::EIO);
            fallback
        }
    }
}

/// An `int`-returning verb: 0, or the errno (also stored in `errno`).
pub(crate) fn int_verb(verb: &'static str, f: impl FnOnce() -> VResult<()>) -> c_int {
    guard(verb, libc::EIO, || match f() {
        Ok(()) => 0,
        Err(errno) => {
            set_errno(errno);
            errno
        }
    })
}

/// A verb that returns 0 or -1 with `errno` set (`ibv_query_gid` style).
pub(crate) fn minus_one_verb(verb: &'static str, f: impl FnOnce() -> VResult<()>) -> c_int {
    guard(verb, -1, || match f() {
        Ok(()) => 0,
        Err(errno) => {
            set_errno(errno);
            -1
        }
    })
}

/// A pointer-returning verb: the object, or NULL with `errno` set.
pub(crate) fn ptr_verb<T>(verb: &'static str, f: impl FnOnce() -> VResult<*mut T>) -> *mut T {
    guard(verb, std::ptr::null_mut(), || match f() {
        Ok(p) => p,
        Err(errno) => {
            set_errno(errno);
            std::ptr::null_mut()
        }
    })
}

/// Writes `s` NUL-terminated into `dst`, truncated to fit.
pub(crate) fn write_c_str(dst: &mut [c_char], s: &str) {
    let Some(room) = dst.len().checked_sub(1) else {
        return;
    };
    let n = s.len().min(room);
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as c_char;
    }
    dst[n..].fill(0);
}

/// Reads a NUL-terminated string out of a fixed C array (lossy).
#[cfg(test)]
pub(crate) fn read_c_str(src: &[c_char]) -> String {
    let bytes: Vec<u8> = src
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Logs (at warn level) and returns the errno of a refused request.
pub(crate) fn unsupported(what: &'static str) -> c_int {
    tracing::warn!(what, "vrdma does not support this verb");
    libc::EOPNOTSUPP
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_strings_round_trip_and_truncate() {
        let mut buf = [1 as c_char; 8];
        write_c_str(&mut buf, "vrdma0");
        assert_eq!(read_c_str(&buf), "vrdma0");
        assert_eq!(buf[6..], [0, 0]);
        write_c_str(&mut buf, "a-much-longer-name");
        assert_eq!(read_c_str(&buf), "a-much-");
        assert_eq!(buf[7], 0);
        write_c_str(&mut [], "x");
    }

    #[test]
    fn verbs_set_errno_and_catch_panics() {
        assert_eq!(int_verb("t", || Err(libc::EBUSY)), libc::EBUSY);
        // SAFETY: reading this thread's errno slot.
        assert_eq!(unsafe { *libc::__errno_location() }, libc::EBUSY);
        assert_eq!(minus_one_verb("t", || Err(libc::EINVAL)), -1);
        let p: *mut u8 = ptr_verb("t", || Err(libc::EOPNOTSUPP));
        assert!(p.is_null());
        // SAFETY: as above.
        assert_eq!(unsafe { *libc::__errno_location() }, libc::EOPNOTSUPP);
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let r = int_verb("t", || panic!("boom"));
        std::panic::set_hook(hook);
        assert_eq!(r, libc::EIO);
    }
}
