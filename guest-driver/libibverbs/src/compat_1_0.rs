//! The IBVERBS_1.0 ABI: the versions of the verbs that binaries linked
//! against libibverbs 1.0 (before 1.1, 2007) bind to, exported as
//! `ibv_alloc_pd@IBVERBS_1.0` and so on beside the current
//! `ibv_alloc_pd@@IBVERBS_1.1` (see `exports.rs`).
//!
//! rdma-core serves that ABI by wrapping every object in a second,
//! 1.0-shaped structure (`compat-1_0.c`). vrdma does not: its 1.0 device
//! list is empty (NULL, `errno = EOPNOTSUPP`), so a 1.0 binary sees no
//! device and can obtain no object, and every other 1.0 entry point, which
//! could only be called with such an object, refuses (NULL, `EOPNOTSUPP`
//! or -1 with `errno = EOPNOTSUPP`) or, for the `void` ones, does nothing.
//! None of them reads its arguments, which the x86_64 C calling convention
//! allows.

use std::ffi::{c_int, c_void};

use crate::ffi::set_errno;

fn refused(name: &'static str) {
    tracing::warn!(name, "An IBVERBS_1.0 verb was called; vrdma has no 1.0 ABI");
    set_errno(libc::EOPNOTSUPP);
}

/// Defines 1.0 entry points that log, set `errno = EOPNOTSUPP` and return
/// `$value` (described by `$doc`).
macro_rules! refuse {
    ($ret:ty = $value:expr, $doc:literal: $($name:ident),+ $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "@IBVERBS_1.0`: ", $doc, ".")]
        pub extern "C" fn $name() -> $ret {
            refused(stringify!($name));
            $value
        }
    )+};
}

refuse!(*mut c_void = std::ptr::null_mut(), "NULL, `errno = EOPNOTSUPP`":
    ibv_alloc_pd,
    ibv_create_ah,
    ibv_create_cq,
    ibv_create_qp,
    ibv_create_srq,
    ibv_get_device_list,
    ibv_get_device_name,
    ibv_open_device,
    ibv_reg_mr,
);

// These verbs return an errno.
refuse!(c_int = libc::EOPNOTSUPP, "`EOPNOTSUPP`":
    ibv_attach_mcast,
    ibv_close_device,
    ibv_dealloc_pd,
    ibv_dereg_mr,
    ibv_destroy_ah,
    ibv_destroy_cq,
    ibv_destroy_qp,
    ibv_destroy_srq,
    ibv_detach_mcast,
    ibv_modify_qp,
    ibv_modify_srq,
    ibv_query_device,
    ibv_query_port,
    ibv_query_qp,
    ibv_query_srq,
    ibv_resize_cq,
);

// These verbs report errors as -1 and `errno`.
refuse!(c_int = -1, "-1, `errno = EOPNOTSUPP`":
    ibv_get_async_event,
    ibv_get_cq_event,
    ibv_query_gid,
    ibv_query_pkey,
);

// Nothing to act on: no 1.0 object exists.
refuse!(() = (), "does nothing": ibv_ack_async_event, ibv_ack_cq_events, ibv_free_device_list);

refuse!(u64 = 0, "GUID 0 (no 1.0 device exists)": ibv_get_device_guid);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_1_0_abi_lists_no_device_and_refuses_the_rest() {
        assert!(ibv_get_device_list().is_null());
        // SAFETY: reading this thread's errno slot.
        assert_eq!(unsafe { *libc::__errno_location() }, libc::EOPNOTSUPP);
        assert!(ibv_open_device().is_null());
        assert_eq!(ibv_modify_qp(), libc::EOPNOTSUPP);
        assert_eq!(ibv_query_gid(), -1);
        assert_eq!(ibv_get_device_guid(), 0);
    }
}
