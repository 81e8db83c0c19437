//! What vrdma's connection manager does not offer, refused with the errno
//! a program expects rather than pretended: rsockets (the socket API over
//! RDMA, which needs its own protocol engine), multicast (the device has
//! no multicast groups), and ECE (vendor connection options).

use std::ffi::c_void;

use crate::abi::{ibv_ece, rdma_cm_id, sockaddr};
use crate::ffi::set_errno;

fn refuse(what: &'static str, errno: i32) -> i32 {
    tracing::warn!(what, "not supported by vrdma's librdmacm");
    set_errno(errno);
    -1
}

/// `rdma_join_multicast`: ENOSYS.
pub extern "C" fn rdma_join_multicast(
    _id: *mut rdma_cm_id,
    _addr: *mut sockaddr,
    _context: *mut c_void,
) -> i32 {
    refuse("rdma_join_multicast", libc::ENOSYS)
}

/// `rdma_join_multicast_ex`: ENOSYS.
pub extern "C" fn rdma_join_multicast_ex(
    _id: *mut rdma_cm_id,
    _attr: *mut c_void,
    _context: *mut c_void,
) -> i32 {
    refuse("rdma_join_multicast_ex", libc::ENOSYS)
}

/// `rdma_leave_multicast`: ENOSYS.
pub extern "C" fn rdma_leave_multicast(_id: *mut rdma_cm_id, _addr: *mut sockaddr) -> i32 {
    refuse("rdma_leave_multicast", libc::ENOSYS)
}

/// `rdma_set_local_ece`: EOPNOTSUPP (the device negotiates no ECE).
pub extern "C" fn rdma_set_local_ece(_id: *mut rdma_cm_id, _ece: *mut ibv_ece) -> i32 {
    refuse("rdma_set_local_ece", libc::EOPNOTSUPP)
}

/// `rdma_get_remote_ece`: no options from the peer (vendor 0), as
/// rdma-core reports when the peer sent none.
///
/// # Safety
///
/// `ece` is NULL or writable.
pub unsafe extern "C" fn rdma_get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> i32 {
    if id.is_null() || ece.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's writable structure.
    unsafe { ece.write(ibv_ece::default()) };
    0
}

/// An rsockets function: -1 with ENOSYS.
macro_rules! rsockets {
    ($($name:ident($($arg:ty),*) -> $ret:ty;)*) => {$(
        #[doc = concat!("`", stringify!($name), "` (rsockets): -1, ENOSYS.")]
        pub extern "C" fn $name($(_: $arg),*) -> $ret {
            refuse(stringify!($name), libc::ENOSYS) as $ret
        }
    )*};
}

rsockets! {
    rsocket(i32, i32, i32) -> i32;
    rbind(i32, *const c_void, u32) -> i32;
    rlisten(i32, i32) -> i32;
    raccept(i32, *mut c_void, *mut u32) -> i32;
    rconnect(i32, *const c_void, u32) -> i32;
    rshutdown(i32, i32) -> i32;
    rclose(i32) -> i32;
    rrecv(i32, *mut c_void, usize, i32) -> isize;
    rrecvfrom(i32, *mut c_void, usize, i32, *mut c_void, *mut u32) -> isize;
    rrecvmsg(i32, *mut c_void, i32) -> isize;
    rsend(i32, *const c_void, usize, i32) -> isize;
    rsendto(i32, *const c_void, usize, i32, *const c_void, u32) -> isize;
    rsendmsg(i32, *const c_void, i32) -> isize;
    rread(i32, *mut c_void, usize) -> isize;
    rreadv(i32, *const c_void, i32) -> isize;
    rwrite(i32, *const c_void, usize) -> isize;
    rwritev(i32, *const c_void, i32) -> isize;
    rpoll(*mut c_void, u64, i32) -> i32;
    rselect(i32, *mut c_void, *mut c_void, *mut c_void, *mut c_void) -> i32;
    rgetpeername(i32, *mut c_void, *mut u32) -> i32;
    rgetsockname(i32, *mut c_void, *mut u32) -> i32;
    rsetsockopt(i32, i32, i32, *const c_void, u32) -> i32;
    rgetsockopt(i32, i32, i32, *mut c_void, *mut u32) -> i32;
    rfcntl(i32, i32, u64) -> i32;
    riomap(i32, *mut c_void, usize, i32, i32, i64) -> i64;
    riounmap(i32, *mut c_void, usize) -> i32;
    riowrite(i32, *const c_void, usize, i64, i32) -> usize;
}
