//! Queries: device, port, GID and P_Key (`ibv_query_device(_ex)`,
//! `ibv_query_port`, `ibv_query_gid(_ex)`, `ibv_query_gid_type`,
//! `ibv_query_pkey`, `ibv_get_pkey_index`), translated from the device's
//! `DeviceAttr`/`PortAttr` (docs/device-spec.md §3).

use std::ffi::{c_int, c_uint, c_void};

use vrdma_guest_driver::vrdma_spec::config::{DeviceAttr, PortAttr};

use crate::abi::{
    __be16, _compat_ibv_port_attr, ibv_context, ibv_device_attr, ibv_device_attr_ex, ibv_gid,
    ibv_gid_entry, ibv_port_attr, ibv_query_device_ex_input,
};
use crate::context::Ctx;
use crate::ffi::{errno_of, guard, int_verb, minus_one_verb, non_null, write_c_str, VResult};
use crate::objects::c_int_of;

/// The only P_Key: the default, full membership.
const DEFAULT_PKEY: u16 = 0xffff;
/// Size of the IBVERBS_1.1 `struct ibv_port_attr` (`_compat_ibv_port_attr`).
const COMPAT_PORT_ATTR_SIZE: usize = 48;

/// `struct ibv_device_attr` from the device's attributes.
pub(crate) fn device_attr(d: &DeviceAttr) -> ibv_device_attr {
    let fw = d.fw_ver.get();
    let mut out = ibv_device_attr {
        // libibverbs keeps GUIDs in network byte order.
        node_guid: d.node_guid.get().to_be(),
        sys_image_guid: d.sys_image_guid.get().to_be(),
        max_mr_size: d.max_mr_size.get(),
        page_size_cap: d.page_size_cap.get(),
        vendor_id: d.vendor_id.get(),
        vendor_part_id: d.vendor_part_id.get(),
        hw_ver: d.hw_ver.get(),
        max_qp: c_int_of(d.max_qp.get()),
        max_qp_wr: c_int_of(d.max_qp_wr.get()),
        device_cap_flags: d.device_cap_flags.get(),
        max_sge: c_int_of(d.max_sge.get()),
        max_sge_rd: c_int_of(d.max_sge.get()),
        max_cq: c_int_of(d.max_cq.get()),
        max_cqe: c_int_of(d.max_cqe.get()),
        max_mr: c_int_of(d.max_mr.get()),
        max_pd: c_int_of(d.max_pd.get()),
        max_qp_rd_atom: c_int_of(d.max_qp_rd_atom.get()),
        max_res_rd_atom: c_int_of(d.max_qp_rd_atom.get().saturating_mul(d.max_qp.get())),
        max_qp_init_rd_atom: c_int_of(d.max_qp_init_rd_atom.get()),
        atomic_cap: d.atomic_cap.get(),
        max_ah: c_int_of(d.max_ah.get()),
        max_srq: c_int_of(d.max_srq.get()),
        max_srq_wr: c_int_of(d.max_srq_wr.get()),
        max_srq_sge: c_int_of(d.max_srq_sge.get()),
        max_pkeys: d.max_pkeys.get(),
        phys_port_cnt: d.phys_port_cnt,
        ..Default::default()
    };
    write_c_str(
        &mut out.fw_ver,
        &format!("{}.{}", fw >> 32, fw & 0xffff_ffff),
    );
    out
}

/// `struct ibv_port_attr` from the device's port attributes.
pub(crate) fn port_attr(p: &PortAttr) -> ibv_port_attr {
    ibv_port_attr {
        state: u32::from(p.state),
        max_mtu: u32::from(p.max_mtu),
        active_mtu: u32::from(p.active_mtu),
        gid_tbl_len: c_int_of(p.gid_tbl_len.get()),
        port_cap_flags: p.port_cap_flags.get(),
        max_msg_sz: p.max_msg_sz.get(),
        pkey_tbl_len: p.pkey_tbl_len.get(),
        lid: p.lid.get(),
        sm_lid: p.sm_lid.get(),
        lmc: p.lmc,
        max_vl_num: p.max_vl_num,
        sm_sl: p.sm_sl,
        active_width: p.active_width,
        active_speed: p.active_speed,
        phys_state: p.phys_state,
        link_layer: p.link_layer,
        ..Default::default()
    }
}

/// Copies the first `len` bytes of `src` to `dst` and zeroes the rest of
/// `dst_len` (extended structures of another size).
///
/// # Safety
///
/// `dst` has room for `dst_len` bytes.
unsafe fn copy_sized<T>(src: &T, dst: *mut c_void, dst_len: usize) {
    let n = dst_len.min(std::mem::size_of::<T>());
    // SAFETY: `n` bytes of `src` are readable; `dst` has `dst_len >= n`
    // writable bytes (the caller's promise).
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::from_ref(src).cast::<u8>(), dst.cast::<u8>(), n);
        std::ptr::write_bytes(dst.cast::<u8>().add(n), 0, dst_len - n);
    }
}

fn ctx_of<'a>(context: *mut ibv_context) -> VResult<&'a Ctx> {
    // SAFETY: every caller passes the application's context pointer, which
    // the verbs contract says is an open context.
    unsafe { Ctx::from_ibv(context) }
}

fn query_device_attr(ctx: &Ctx) -> VResult<ibv_device_attr> {
    let d = ctx.shared.dev.query_device().map_err(|e| errno_of(&e))?;
    Ok(device_attr(&d))
}

/// `ibv_query_device`.
///
/// # Safety
///
/// `context` is an open context; `device_attr` is writable.
pub unsafe extern "C" fn ibv_query_device(
    context: *mut ibv_context,
    device_attr: *mut ibv_device_attr,
) -> c_int {
    int_verb("ibv_query_device", || {
        non_null(device_attr)?;
        let attr = query_device_attr(ctx_of(context)?)?;
        // SAFETY: the caller passes a writable attribute structure.
        unsafe { *device_attr = attr };
        Ok(())
    })
}

/// `verbs_context.query_device_ex`, called by the inline
/// `ibv_query_device_ex` with the size of the caller's structure.
///
/// # Safety
///
/// `attr` has room for `attr_size` bytes.
pub(crate) unsafe extern "C" fn query_device_ex(
    context: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    int_verb("ibv_query_device_ex", || {
        // SAFETY: a non-null input is readable (the verbs contract).
        if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
            return Err(libc::EINVAL);
        }
        if attr.is_null() || attr_size < std::mem::size_of::<ibv_device_attr>() {
            return Err(libc::EINVAL);
        }
        let orig_attr = query_device_attr(ctx_of(context)?)?;
        // A RoCE RC device without ODP, TSO, RSS, packet pacing, tag
        // matching, CQ moderation or device memory: those capabilities
        // stay zero, as a provider reports what it lacks.
        let ex = ibv_device_attr_ex {
            device_cap_flags_ex: u64::from(orig_attr.device_cap_flags),
            phys_port_cnt_ex: u32::from(orig_attr.phys_port_cnt),
            orig_attr,
            ..Default::default()
        };
        // SAFETY: the caller provides `attr_size` bytes.
        unsafe { copy_sized(&ex, attr.cast(), attr_size) };
        Ok(())
    })
}

fn query_port_attr(context: *mut ibv_context, port_num: u8) -> VResult<ibv_port_attr> {
    let ctx = ctx_of(context)?;
    let p = ctx
        .shared
        .dev
        .query_port(port_num)
        .map_err(|e| errno_of(&e))?;
    Ok(port_attr(&p))
}

/// `verbs_context.query_port`, called by the inline `ibv_query_port` with
/// the size of the caller's `struct ibv_port_attr`.
///
/// # Safety
///
/// `port_attr` has room for `port_attr_len` bytes.
pub(crate) unsafe extern "C" fn query_port_ex(
    context: *mut ibv_context,
    port_num: u8,
    port_attr: *mut ibv_port_attr,
    port_attr_len: usize,
) -> c_int {
    int_verb("ibv_query_port", || {
        non_null(port_attr)?;
        let attr = query_port_attr(context, port_num)?;
        // SAFETY: the caller provides `port_attr_len` bytes.
        unsafe { copy_sized(&attr, port_attr.cast(), port_attr_len) };
        Ok(())
    })
}

/// `ibv_query_port@IBVERBS_1.1`: the 48-byte structure of binaries built
/// before `port_cap_flags2` existed (current headers call
/// `verbs_context.query_port` instead).
///
/// # Safety
///
/// `port_attr` has room for the 48-byte compat structure.
pub unsafe extern "C" fn ibv_query_port(
    context: *mut ibv_context,
    port_num: u8,
    port_attr: *mut _compat_ibv_port_attr,
) -> c_int {
    // SAFETY: the caller provides the 48 bytes of the compat structure,
    // which are the first 48 of the current one.
    unsafe { query_port_ex(context, port_num, port_attr.cast(), COMPAT_PORT_ATTR_SIZE) }
}

/// (GID, GID type) of a port's GID table entry.
fn query_gid_entry(
    context: *mut ibv_context,
    port_num: u8,
    index: u32,
) -> VResult<([u8; 16], u32)> {
    let ctx = ctx_of(context)?;
    let r = ctx
        .shared
        .dev
        .query_gid(port_num, index)
        .map_err(|e| errno_of(&e))?;
    Ok((r.gid, r.gid_type.get()))
}

/// `ibv_query_gid`: 0, or -1 with `errno` set.
///
/// # Safety
///
/// `context` is an open context; `gid` is writable.
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut ibv_context,
    port_num: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    minus_one_verb("ibv_query_gid", || {
        let index = u32::try_from(index).map_err(|_| libc::EINVAL)?;
        non_null(gid)?;
        let (raw, _) = query_gid_entry(context, port_num, index)?;
        // SAFETY: the caller passes a writable GID.
        unsafe { *gid = ibv_gid { raw } };
        Ok(())
    })
}

/// A port's GID table entry as `struct ibv_gid_entry`; `ENODATA` for an
/// empty (zero) entry, as rdma-core reports one.
fn gid_entry(context: *mut ibv_context, port_num: u32, gid_index: u32) -> VResult<ibv_gid_entry> {
    let port = u8::try_from(port_num).map_err(|_| libc::EINVAL)?;
    let (raw, gid_type) = query_gid_entry(context, port, gid_index)?;
    if raw == [0; 16] {
        return Err(libc::ENODATA);
    }
    Ok(ibv_gid_entry {
        gid: ibv_gid { raw },
        gid_index,
        port_num,
        // The device reports libibverbs' enum ibv_gid_type values.
        gid_type,
        // No netdev in the guest carries vrdma's address.
        ndev_ifindex: 0,
    })
}

/// Checks the `flags` and `entry_size` of the GID-entry queries: no flags
/// are defined (`EOPNOTSUPP`, as rdma-core answers without kernel
/// support), and the entry must hold a whole `struct ibv_gid_entry`.
fn check_gid_query(flags: u32, entry_size: usize) -> VResult<()> {
    if flags != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if entry_size < std::mem::size_of::<ibv_gid_entry>() {
        return Err(libc::EINVAL);
    }
    Ok(())
}

/// `_ibv_query_gid_ex` (behind the inline `ibv_query_gid_ex`).
///
/// # Safety
///
/// `entry` has room for `entry_size` bytes.
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    int_verb("ibv_query_gid_ex", || {
        check_gid_query(flags, entry_size)?;
        non_null(entry)?;
        let out = gid_entry(context, port_num, gid_index)?;
        // SAFETY: the caller provides `entry_size` bytes.
        unsafe { copy_sized(&out, entry.cast(), entry_size) };
        Ok(())
    })
}

/// `_ibv_query_gid_table` (behind the inline `ibv_query_gid_table`): every
/// non-empty GID of every port, `entry_size` bytes apart; the number
/// written, or a negative errno (`EINVAL` when they do not fit in
/// `max_entries`).
///
/// # Safety
///
/// `entries` has room for `max_entries` entries of `entry_size` bytes.
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    guard("ibv_query_gid_table", -(libc::EIO as isize), || {
        let table = || -> VResult<usize> {
            check_gid_query(flags, entry_size)?;
            let ports = query_device_attr(ctx_of(context)?)?.phys_port_cnt;
            let mut n = 0usize;
            for port in 1..=ports {
                let len = u32::try_from(query_port_attr(context, port)?.gid_tbl_len)
                    .map_err(|_| libc::EIO)?;
                for index in 0..len {
                    let e = match gid_entry(context, u32::from(port), index) {
                        Ok(e) => e,
                        Err(libc::ENODATA) => continue,
                        Err(errno) => return Err(errno),
                    };
                    if n >= max_entries || entries.is_null() {
                        return Err(libc::EINVAL);
                    }
                    // SAFETY: entry `n` is inside the caller's array
                    // (`n < max_entries`), `entry_size` bytes long.
                    unsafe {
                        let at = entries.cast::<u8>().add(n * entry_size);
                        copy_sized(&e, at.cast(), entry_size);
                    }
                    n += 1;
                }
            }
            Ok(n)
        };
        match table() {
            Ok(n) => isize::try_from(n).unwrap_or(isize::MAX),
            Err(errno) => -(errno as isize),
        }
    })
}

/// `ibv_query_gid_type` (IBVERBS_PRIVATE_34): writes `enum
/// ibv_gid_type_sysfs` (IB/RoCE v1 0, RoCE v2 1).
///
/// # Safety
///
/// `context` is an open context; `gid_type` is a writable `int`-sized enum.
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut ibv_context,
    port_num: u8,
    index: c_uint,
    gid_type: *mut c_uint,
) -> c_int {
    minus_one_verb("ibv_query_gid_type", || {
        non_null(gid_type)?;
        let (_, t) = query_gid_entry(context, port_num, index)?;
        // IBV_GID_TYPE_ROCE_V2 (2) is sysfs type 1; IB and RoCE v1 are 0.
        let sysfs = u32::from(t == crate::abi::IBV_GID_TYPE_ROCE_V2);
        // SAFETY: the caller passes a writable enum.
        unsafe { *gid_type = sysfs };
        Ok(())
    })
}

/// `ibv_query_pkey`: the table holds the default P_Key only.
///
/// # Safety
///
/// `context` is an open context; `pkey` is writable.
pub unsafe extern "C" fn ibv_query_pkey(
    context: *mut ibv_context,
    port_num: u8,
    index: c_int,
    pkey: *mut __be16,
) -> c_int {
    minus_one_verb("ibv_query_pkey", || {
        let attr = query_port_attr(context, port_num)?;
        if pkey.is_null() || !(0..c_int::from(attr.pkey_tbl_len)).contains(&index) {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller passes a writable P_Key.
        unsafe { *pkey = DEFAULT_PKEY.to_be() };
        Ok(())
    })
}

/// `ibv_get_pkey_index`: the index of a P_Key (network byte order), or a
/// negative errno.
///
/// # Safety
///
/// `context` is an open context.
pub unsafe extern "C" fn ibv_get_pkey_index(
    context: *mut ibv_context,
    port_num: u8,
    pkey: __be16,
) -> c_int {
    crate::ffi::guard("ibv_get_pkey_index", -libc::EIO, || {
        match query_port_attr(context, port_num) {
            // Full and limited membership of the default partition.
            Ok(_) if u16::from_be(pkey) | 0x8000 == DEFAULT_PKEY => 0,
            Ok(_) => -libc::ENOENT,
            Err(errno) => -errno,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};
    use vrdma_guest_driver::vrdma_spec::config::{DeviceAttr, PortAttr};
    use zerocopy::FromZeros;

    /// The measured facts of `ibverbs-abi.md` for the query structures.
    #[test]
    fn query_layouts_match_rdma_core() {
        assert_eq!(size_of::<ibv_port_attr>(), 52);
        assert_eq!(offset_of!(ibv_port_attr, state), 0);
        assert_eq!(offset_of!(ibv_port_attr, active_mtu), 8);
        assert_eq!(offset_of!(ibv_port_attr, gid_tbl_len), 12);
        assert_eq!(offset_of!(ibv_port_attr, max_msg_sz), 20);
        assert_eq!(offset_of!(ibv_port_attr, lid), 34);
        assert_eq!(offset_of!(ibv_port_attr, link_layer), 46);
        assert!(COMPAT_PORT_ATTR_SIZE > offset_of!(ibv_port_attr, link_layer));
        assert_eq!(size_of::<ibv_device_attr>(), 232);
        assert_eq!(offset_of!(ibv_device_attr, vendor_id), 96);
        assert_eq!(offset_of!(ibv_device_attr, vendor_part_id), 100);
        assert_eq!(offset_of!(ibv_device_attr, max_qp_rd_atom), 144);
        assert_eq!(offset_of!(ibv_device_attr, phys_port_cnt), 227);
        assert_eq!(size_of::<ibv_device_attr_ex>(), 400);
        assert_eq!(size_of::<ibv_gid_entry>(), 32);
    }

    #[test]
    fn device_attributes_translate() {
        let mut d = DeviceAttr::new_zeroed();
        d.fw_ver = 0x1_0000_0002.into();
        d.node_guid = 0x7672_0000_0000_0011.into();
        d.sys_image_guid = 0x7672_0000_0000_0011.into();
        d.vendor_id = 0x1af4.into();
        d.vendor_part_id = 0x106a.into();
        d.max_qp = 256.into();
        d.max_qp_rd_atom = 16.into();
        d.max_qp_init_rd_atom = 16.into();
        d.max_sge = 16.into();
        d.atomic_cap = 1.into();
        d.max_pkeys = 1.into();
        d.phys_port_cnt = 1;
        let a = device_attr(&d);
        assert_eq!(crate::ffi::read_c_str(&a.fw_ver), "1.2");
        assert_eq!(u64::from_be(a.node_guid), 0x7672_0000_0000_0011);
        assert_eq!((a.vendor_id, a.vendor_part_id), (0x1af4, 0x106a));
        assert_eq!((a.max_qp_rd_atom, a.max_res_rd_atom), (16, 16 * 256));
        assert_eq!((a.max_sge, a.max_sge_rd), (16, 16));
        assert_eq!((a.max_srq, a.max_mw), (0, 0));
        assert_eq!(a.phys_port_cnt, 1);
    }

    #[test]
    fn port_attributes_translate_and_copy_by_size() {
        let mut p = PortAttr::new_zeroed();
        p.state = 4;
        p.max_mtu = 5;
        p.active_mtu = 5;
        p.link_layer = 2;
        p.gid_tbl_len = 1.into();
        p.max_msg_sz = (1 << 31).into();
        p.pkey_tbl_len = 1.into();
        p.lid = 17.into();
        let a = port_attr(&p);
        assert_eq!(
            (a.state, a.active_mtu, a.lid, a.link_layer, a.gid_tbl_len),
            (4, 5, 17, 2, 1)
        );
        let mut small = [0xaau8; 60];
        // SAFETY: the buffer has 60 bytes.
        unsafe { copy_sized(&a, small.as_mut_ptr().cast(), 60) };
        assert_eq!(small[34..36], 17u16.to_ne_bytes());
        assert!(small[52..].iter().all(|&b| b == 0), "tail zeroed");
        let mut compat = [0xaau8; 50];
        // SAFETY: 48 of the 50 bytes are written.
        unsafe { copy_sized(&a, compat.as_mut_ptr().cast(), COMPAT_PORT_ATTR_SIZE) };
        assert_eq!(compat[46], 2, "link layer Ethernet");
        assert_eq!(compat[48..], [0xaa, 0xaa], "nothing past 48 bytes");
    }
}
