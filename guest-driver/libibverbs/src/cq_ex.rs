//! Extended CQs (`ibv_create_cq_ex`) and polling through `struct
//! ibv_cq_ex`: `ibv_start_poll` / `ibv_next_poll` / `ibv_end_poll` step
//! through completions one at a time and the `ibv_wc_read_*` accessors
//! read the current one.
//!
//! Every CQ of this library is an extended one underneath (its box starts
//! with `struct ibv_cq_ex`, whose first fields are `struct ibv_cq`'s), so
//! `ibv_poll_cq` works on a CQ from `ibv_create_cq_ex` and the poll
//! functions below on both. A completion is taken from the device by the
//! same `CompletionQueue::poll` and translated by the same
//! `datapath::fill_wc` as `ibv_poll_cq`'s; the accessors read fields of
//! that `struct ibv_wc`.
//!
//! `wc_flags` may ask for the standard fields (`IBV_WC_STANDARD_FLAGS`:
//! byte length, immediate data, QP number, source QP, SLID, SL, DLID path
//! bits); timestamps, CVLAN, flow tags and tag matching are refused with
//! `EOPNOTSUPP`, as mlx5 refuses what it cannot report.

use std::ffi::{c_int, c_uint};
use std::sync::atomic::Ordering;

use vrdma_guest_driver::WorkCompletion;

use crate::abi::{
    __be32, ibv_context, ibv_cq, ibv_cq_ex, ibv_cq_init_attr_ex, ibv_poll_cq_attr, ibv_wc,
    ibv_wc_opcode, IBV_CQ_INIT_ATTR_MASK_FLAGS, IBV_CQ_INIT_ATTR_MASK_PD,
    IBV_CREATE_CQ_ATTR_SINGLE_THREADED, IBV_WC_STANDARD_FLAGS,
};
use crate::control::create_cq;
use crate::datapath::{completion_path, empty_poll, fill_wc, qp_path};
use crate::ffi::{errno_of, guard, non_null, ptr_verb, unsupported, VResult};
use crate::objects::{Cq, Wrapper};

/// `ibv_cq_ex` with the poll functions of this module.
pub(crate) fn with_poll_ops(cq: ibv_cq_ex) -> ibv_cq_ex {
    ibv_cq_ex {
        start_poll: Some(start_poll),
        next_poll: Some(next_poll),
        end_poll: Some(end_poll),
        read_opcode: Some(read_opcode),
        read_vendor_err: Some(read_vendor_err),
        read_byte_len: Some(read_byte_len),
        read_imm_data: Some(read_imm_data),
        read_qp_num: Some(read_qp_num),
        read_src_qp: Some(read_src_qp),
        read_wc_flags: Some(read_wc_flags),
        read_slid: Some(read_slid),
        read_sl: Some(read_sl),
        read_dlid_path_bits: Some(read_dlid_path_bits),
        ..cq
    }
}

/// Checks what `ibv_create_cq_ex` asks beyond a plain CQ.
fn check_attr(a: &ibv_cq_init_attr_ex) -> VResult<()> {
    let known = IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD;
    if a.comp_mask & !known != 0 {
        return Err(libc::EINVAL);
    }
    if a.wc_flags & !u64::from(IBV_WC_STANDARD_FLAGS) != 0 {
        return Err(unsupported(
            "completion timestamps, CVLAN, flow tags, tag matching (ibv_create_cq_ex wc_flags)",
        ));
    }
    // A single-threaded CQ is a hint (the poll functions take no lock);
    // ignoring overruns is not something the device does.
    if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS != 0
        && a.flags & !IBV_CREATE_CQ_ATTR_SINGLE_THREADED != 0
    {
        return Err(unsupported("CQ flags other than SINGLE_THREADED"));
    }
    // The PD of a CQ must be a parent domain, which vrdma does not have.
    if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_PD != 0 {
        return Err(libc::EINVAL);
    }
    Ok(())
}

/// `verbs_context.create_cq_ex`, called by the inline `ibv_create_cq_ex`.
///
/// # Safety
///
/// `context` is an open context; `attr` a valid attribute structure whose
/// channel is NULL or live.
pub(crate) unsafe extern "C" fn create_cq_ex(
    context: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    ptr_verb("ibv_create_cq_ex", || {
        non_null(attr)?;
        // SAFETY: the caller passes a valid attribute structure.
        let a = unsafe { &*attr };
        check_attr(a)?;
        let cqe = i32::try_from(a.cqe).map_err(|_| libc::EINVAL)?;
        let vector = i32::try_from(a.comp_vector).map_err(|_| libc::EINVAL)?;
        // SAFETY: the caller's promises are create_cq's.
        let cq = unsafe { create_cq(context, cqe, a.cq_context, a.channel, vector)? };
        Ok(cq.cast())
    })
}

/// The CQ box behind an extended CQ pointer.
///
/// # Safety
///
/// `cq` is a live CQ of this library.
unsafe fn cq_of<'a>(cq: *mut ibv_cq_ex) -> VResult<&'a Cq> {
    // SAFETY: the caller's promise; ibv_cq_ex starts with ibv_cq.
    unsafe { Cq::from_raw(cq.cast::<ibv_cq>()) }
}

/// Takes the next completion into `cq.current` (and `wr_id`/`status` of
/// the application's structure): 0, `ENOENT` when there is none, or the
/// device's errno.
///
/// # Safety
///
/// `cq` is a live CQ polled by this thread only until `end_poll`.
unsafe fn step(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: the caller's promise.
    let ours =
        match unsafe { cq_of(cq) }.and_then(|c| Ok((c, c.inner.as_ref().ok_or(libc::EINVAL)?))) {
            Ok(c) => c,
            Err(errno) => return errno,
        };
    let (cq_box, inner) = ours;
    let mut one = [WorkCompletion::default()];
    match inner.poll(&mut one) {
        Ok(0) => {
            empty_poll(cq_box);
            libc::ENOENT
        }
        Ok(_) => {
            cq_box.empty_polls.store(0, Ordering::Relaxed);
            // The path (slid/sl) is looked up only if read_slid/read_sl ask.
            // The device's slid is kept for `path`, which completes it.
            let wc = fill_wc(&one[0], (one[0].slid, 0));
            cq_box.current.set(wc);
            // SAFETY: the application's live CQ: these two fields are the
            // inline accessors' (`cq->wr_id`, `cq->status`).
            unsafe {
                (*cq).wr_id = wc.wr_id;
                (*cq).status = wc.status;
            }
            0
        }
        Err(e) => errno_of(&e),
    }
}

/// `ibv_start_poll`: the first completion, or `ENOENT`.
///
/// # Safety
///
/// `cq` is a live CQ; `attr` NULL or readable.
unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    guard("ibv_start_poll", libc::EIO, || {
        // SAFETY: a non-null attr is readable (the verbs contract).
        if !attr.is_null() && unsafe { (*attr).comp_mask } != 0 {
            return libc::EINVAL;
        }
        // SAFETY: the caller's promise.
        unsafe { step(cq) }
    })
}

/// `ibv_next_poll`: the next completion, or `ENOENT`.
///
/// # Safety
///
/// `cq` is a live CQ after a successful `start_poll`.
unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: the caller's promise.
    guard("ibv_next_poll", libc::EIO, || unsafe { step(cq) })
}

/// `ibv_end_poll`: nothing is held between polls.
unsafe extern "C" fn end_poll(_cq: *mut ibv_cq_ex) {}

/// The current completion (a zeroed one if the CQ is not ours: the
/// accessors have no error path).
///
/// # Safety
///
/// `cq` is a live CQ.
unsafe fn current(cq: *mut ibv_cq_ex) -> ibv_wc {
    // SAFETY: the caller's promise.
    unsafe { cq_of(cq) }
        .map(|c| c.current.get())
        .unwrap_or_default()
}

/// Defines `read_*` accessors returning one field of the current completion.
macro_rules! readers {
    ($($name:ident -> $ty:ty = |$wc:ident| $value:expr;)+) => {$(
        #[doc = concat!("`ibv_wc_", stringify!($name), "` of the current completion.")]
        ///
        /// # Safety
        ///
        /// `cq` is a live CQ after a successful poll.
        unsafe extern "C" fn $name(cq: *mut ibv_cq_ex) -> $ty {
            // SAFETY: the caller's promise.
            let $wc = unsafe { current(cq) };
            $value
        }
    )+};
}

readers! {
    read_opcode -> ibv_wc_opcode = |wc| wc.opcode;
    read_vendor_err -> u32 = |wc| wc.vendor_err;
    read_byte_len -> u32 = |wc| wc.byte_len;
    // SAFETY: both members of the union are plain u32.
    read_imm_data -> __be32 = |wc| unsafe { wc.__bindgen_anon_1.imm_data };
    read_qp_num -> u32 = |wc| wc.qp_num;
    read_src_qp -> u32 = |wc| wc.src_qp;
    read_wc_flags -> c_uint = |wc| wc.wc_flags;
    read_dlid_path_bits -> u8 = |wc| wc.dlid_path_bits;
}

/// The current completion's (slid, sl): a receive's comes from its QP's
/// path, as `ibv_poll_cq` fills them.
///
/// # Safety
///
/// `cq` is a live CQ after a successful poll.
unsafe fn path(cq: *mut ibv_cq_ex) -> (u16, u8) {
    // SAFETY: the caller's promise.
    let wc = unsafe { current(cq) };
    let receive = wc.opcode & crate::abi::IBV_WC_RECV != 0;
    let grh = wc.wc_flags & crate::abi::IBV_WC_GRH != 0;
    // SAFETY: a live CQ.
    completion_path(receive, grh, wc.slid, || unsafe {
        qp_path(cq.cast(), wc.qp_num)
    })
}

/// `ibv_wc_read_slid`.
///
/// # Safety
///
/// `cq` is a live CQ after a successful poll.
unsafe extern "C" fn read_slid(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the caller's promise.
    u32::from(unsafe { path(cq) }.0)
}

/// `ibv_wc_read_sl`.
///
/// # Safety
///
/// `cq` is a live CQ after a successful poll.
unsafe extern "C" fn read_sl(cq: *mut ibv_cq_ex) -> u8 {
    // SAFETY: the caller's promise.
    unsafe { path(cq) }.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    /// `struct ibv_cq` is the start of `struct ibv_cq_ex`
    /// (`ibv_cq_ex_to_cq` is a cast), which makes every CQ both.
    #[test]
    fn an_extended_cq_starts_with_a_cq() {
        assert_eq!(offset_of!(ibv_cq, context), offset_of!(ibv_cq_ex, context));
        assert_eq!(offset_of!(ibv_cq, channel), offset_of!(ibv_cq_ex, channel));
        assert_eq!(
            offset_of!(ibv_cq, cq_context),
            offset_of!(ibv_cq_ex, cq_context)
        );
        assert_eq!(offset_of!(ibv_cq, handle), offset_of!(ibv_cq_ex, handle));
        assert_eq!(offset_of!(ibv_cq, cqe), offset_of!(ibv_cq_ex, cqe));
        assert_eq!(offset_of!(ibv_cq, mutex), offset_of!(ibv_cq_ex, mutex));
        assert_eq!(offset_of!(ibv_cq, cond), offset_of!(ibv_cq_ex, cond));
        assert_eq!(
            offset_of!(ibv_cq, async_events_completed),
            offset_of!(ibv_cq_ex, async_events_completed)
        );
        assert_eq!(
            std::mem::size_of::<ibv_cq>(),
            offset_of!(ibv_cq_ex, comp_mask)
        );
    }

    #[test]
    fn only_the_standard_completion_fields_are_accepted() {
        let mut a = ibv_cq_init_attr_ex {
            cqe: 16,
            wc_flags: u64::from(IBV_WC_STANDARD_FLAGS),
            ..Default::default()
        };
        assert_eq!(check_attr(&a), Ok(()));
        a.wc_flags |= u64::from(crate::abi::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP);
        assert_eq!(check_attr(&a), Err(libc::EOPNOTSUPP));
        a.wc_flags = 0;
        a.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
        a.flags = IBV_CREATE_CQ_ATTR_SINGLE_THREADED;
        assert_eq!(check_attr(&a), Ok(()));
        a.flags = crate::abi::IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN;
        assert_eq!(check_attr(&a), Err(libc::EOPNOTSUPP));
        a.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
        a.flags = 0;
        assert_eq!(check_attr(&a), Err(libc::EINVAL));
        a.comp_mask = 1 << 7;
        assert_eq!(check_attr(&a), Err(libc::EINVAL));
    }
}
