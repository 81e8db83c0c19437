//! Shared memory as the protocol passes it: guest memory goes from vdev to
//! hostd as memfds sealed against shrinking and growing, so that no access
//! through a mapping of one can fault whatever the peer does later. This
//! module makes such memfds (tests and tools playing the guest) and checks
//! them (hostd, before it maps one: `vrdma_hostd::engine::guest`).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};

/// Why shared memory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("Cannot create shared memory")]
    Create(#[source] io::Error),
    #[error("Cannot map shared memory")]
    Map(#[source] io::Error),
    #[error("Shared memory of {actual} bytes is smaller than the {needed} bytes it must hold")]
    TooSmall { needed: u64, actual: u64 },
    #[error("Shared memory is not sealed against shrinking (F_SEAL_SHRINK), so the peer could make accesses fault")]
    NotSealed,
}

/// Whether `file` is sealed against shrinking (the seal that keeps a
/// mapping of it from faulting).
pub fn require_shrink_seal(file: &File) -> Result<(), ShmError> {
    // SAFETY: F_GET_SEALS only reads the seals of an open descriptor.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(ShmError::NotSealed);
    }
    Ok(())
}

/// A new memfd of `size` bytes, sealed so that it can never shrink or grow
/// (which makes it safe for a peer to map).
pub fn sealed_memfd(name: &str, size: u64) -> Result<File, ShmError> {
    let cname = std::ffi::CString::new(name).map_err(|e| ShmError::Create(io::Error::other(e)))?;
    // SAFETY: valid NUL-terminated name; the result is checked.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(ShmError::Create(io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(ShmError::Create)?;
    seal(&file)?;
    Ok(file)
}

/// Seals a memfd against shrinking and growing.
pub fn seal(file: &File) -> Result<(), ShmError> {
    // SAFETY: F_ADD_SEALS on an open descriptor; the result is checked.
    let rc = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    if rc != 0 {
        return Err(ShmError::Create(io::Error::last_os_error()));
    }
    Ok(())
}
