//! `rdma_getaddrinfo` (plain IP resolution, IPv4: vrdma's devices have
//! IPv4 addresses) and the endpoints made from its result
//! (`rdma_create_ep`, `rdma_destroy_ep`).

use std::ffi::{c_char, CStr};
use std::net::{Ipv4Addr, SocketAddrV4, ToSocketAddrs};

use super::channel::lock;
use super::cm_call;
use super::id::{self, sockaddr_in_of, Id};
use super::qp;
use crate::abi::{
    ibv_pd, ibv_qp_init_attr, rdma_addrinfo, rdma_cm_id, sockaddr, sockaddr_in, IBV_QPT_RC,
    IBV_QPT_UD, RAI_NUMERICHOST, RAI_PASSIVE, RDMA_PS_TCP, RDMA_PS_UDP,
};
use crate::ffi::{non_null, VResult};

fn str_of<'a>(p: *const c_char) -> VResult<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's NUL-terminated string.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map(Some)
        .map_err(|_| libc::EINVAL)
}

fn boxed_sockaddr(a: SocketAddrV4) -> *mut sockaddr {
    Box::into_raw(Box::new(sockaddr_in_of(a))).cast()
}

/// `rdma_getaddrinfo`: 0, or a `getaddrinfo` error code (EAI_*), as
/// rdma-core returns.
///
/// # Safety
///
/// `node`, `service` NULL or strings; `hints` NULL or readable; `res`
/// writable.
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> i32 {
    crate::ffi::guard("rdma_getaddrinfo", libc::EAI_SYSTEM, || {
        match getaddrinfo(node, service, hints, res) {
            Ok(()) => 0,
            Err(code) => code,
        }
    })
}

fn getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> Result<(), i32> {
    if res.is_null() {
        return Err(libc::EAI_NONAME);
    }
    // SAFETY: the caller's hints.
    let hints = unsafe { hints.as_ref() };
    // The hints' own addresses, which stand for node and service when
    // both are NULL (libfabric's verbs provider resolves its endpoints'
    // addresses that way).
    // SAFETY: the caller's addresses in its hints, NULL or readable.
    let hinted = |a: *mut sockaddr| unsafe { id::ipv4_of(a) }.ok().flatten();
    let hint_src = hints.and_then(|h| hinted(h.ai_src_addr));
    let hint_dst = hints.and_then(|h| hinted(h.ai_dst_addr));
    if node.is_null() && service.is_null() && hint_src.is_none() && hint_dst.is_none() {
        return Err(libc::EAI_NONAME);
    }
    if let Some(h) = hints {
        if h.ai_family != libc::AF_UNSPEC && h.ai_family != libc::AF_INET {
            return Err(libc::EAI_FAMILY);
        }
    }
    let flags = hints.map_or(0, |h| h.ai_flags as u32);
    let passive = flags & RAI_PASSIVE != 0;
    let node = str_of(node).map_err(|_| libc::EAI_NONAME)?;
    let port: u16 = match str_of(service).map_err(|_| libc::EAI_SERVICE)? {
        None => 0,
        Some(s) => s.parse().map_err(|_| libc::EAI_SERVICE)?,
    };
    let ip = match node {
        None => {
            if passive {
                Ipv4Addr::UNSPECIFIED
            } else {
                Ipv4Addr::LOCALHOST
            }
        }
        Some(n) => match n.parse::<Ipv4Addr>() {
            Ok(ip) => ip,
            Err(_) if flags & RAI_NUMERICHOST != 0 => return Err(libc::EAI_NONAME),
            Err(_) => (n, port)
                .to_socket_addrs()
                .map_err(|_| libc::EAI_NONAME)?
                .find_map(|a| match a {
                    std::net::SocketAddr::V4(v4) => Some(*v4.ip()),
                    std::net::SocketAddr::V6(_) => None,
                })
                .ok_or(libc::EAI_NONAME)?,
        },
    };
    let addr = SocketAddrV4::new(ip, port);
    let len = size_of::<sockaddr_in>() as u32;
    let mut rai = rdma_addrinfo {
        ai_family: libc::AF_INET,
        ai_qp_type: hints.map_or(IBV_QPT_RC as i32, |h| h.ai_qp_type),
        ai_port_space: hints
            .map(|h| h.ai_port_space)
            .filter(|&ps| ps != 0)
            .unwrap_or(RDMA_PS_TCP as i32),
        ..Default::default()
    };
    if rai.ai_qp_type == 0 {
        rai.ai_qp_type = if rai.ai_port_space == RDMA_PS_UDP as i32 {
            IBV_QPT_UD as i32
        } else {
            IBV_QPT_RC as i32
        };
    }
    if passive {
        rai.ai_flags = RAI_PASSIVE as i32;
    }
    let (src, dst) = if node.is_none() && service.is_null() {
        (hint_src, hint_dst)
    } else if passive {
        (Some(addr), None)
    } else {
        (hint_src, Some(addr))
    };
    if let Some(src) = src {
        rai.ai_src_addr = boxed_sockaddr(src);
        rai.ai_src_len = len;
    }
    if let Some(dst) = dst {
        rai.ai_dst_addr = boxed_sockaddr(dst);
        rai.ai_dst_len = len;
    }
    // SAFETY: the caller's writable pointer.
    unsafe { res.write(Box::into_raw(Box::new(rai))) };
    Ok(())
}

/// `rdma_freeaddrinfo`.
///
/// # Safety
///
/// `res` is NULL or a list `rdma_getaddrinfo` returned.
pub unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut next = res;
    while !next.is_null() {
        // SAFETY: made by Box::into_raw in `getaddrinfo`, as its addresses.
        let rai = unsafe { Box::from_raw(next) };
        for a in [rai.ai_src_addr, rai.ai_dst_addr] {
            if !a.is_null() {
                // SAFETY: as above.
                drop(unsafe { Box::from_raw(a.cast::<sockaddr_in>()) });
            }
        }
        next = rai.ai_next;
    }
}

/// `rdma_create_ep`: a synchronous ID bound (passive) or resolved (active)
/// as `res` says, with a QP when `qp_init_attr` is given (for a passive
/// one: each request's, made by `rdma_get_request`).
///
/// # Safety
///
/// `id` writable; `res` readable; `pd` NULL or live; `qp_init_attr` NULL
/// or valid and writable.
pub unsafe extern "C" fn rdma_create_ep(
    id: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> i32 {
    cm_call("rdma_create_ep", || {
        non_null(id)?;
        non_null(res)?;
        // SAFETY: the caller's structure.
        let res = unsafe { &*res };
        let new =
            id::create_sync(res.ai_port_space as u32, res.ai_qp_type as u32)?.cast::<rdma_cm_id>();
        let made = ep(new, res, pd, qp_init_attr);
        if let Err(e) = made {
            // SAFETY: the ID just made.
            unsafe { rdma_destroy_ep(new) };
            return Err(e);
        }
        // SAFETY: the caller's writable pointer.
        unsafe { id.write(new) };
        Ok(())
    })
}

fn ep(
    new: *mut rdma_cm_id,
    res: &rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> VResult<()> {
    let errno = || super::channel::errno();
    if res.ai_flags as u32 & RAI_PASSIVE != 0 {
        // SAFETY: a live ID and the caller's address.
        if unsafe { id::rdma_bind_addr(new, res.ai_src_addr) } != 0 {
            return Err(errno());
        }
        // SAFETY: the live ID.
        let our = unsafe { Id::from_raw(new)? };
        if !pd.is_null() {
            // SAFETY: the ID's view, as in `Id::place`.
            unsafe { (*new).pd = pd };
        }
        // SAFETY: the caller's structure, if any.
        if let Some(init) = unsafe { qp_init_attr.as_ref() } {
            let mut init = *init;
            init.qp_type = res.ai_qp_type as u32;
            lock(&our.st).qp_init_attr = Some(init);
        }
        return Ok(());
    }
    // SAFETY: a live ID and the caller's addresses.
    if unsafe { id::rdma_resolve_addr(new, res.ai_src_addr, res.ai_dst_addr, 2000) } != 0 {
        return Err(errno());
    }
    // SAFETY: as above.
    if unsafe { id::rdma_resolve_route(new, 2000) } != 0 {
        return Err(errno());
    }
    // SAFETY: the caller's structure, if any.
    if let Some(init) = unsafe { qp_init_attr.as_mut() } {
        init.qp_type = res.ai_qp_type as u32;
        qp::create_qp(new, pd, init)?;
    }
    if res.ai_connect_len > 0 && !res.ai_connect.is_null() {
        // SAFETY: the caller's connect data of that length.
        let data =
            unsafe { std::slice::from_raw_parts(res.ai_connect.cast::<u8>(), res.ai_connect_len) };
        // SAFETY: the live ID.
        lock(&unsafe { Id::from_raw(new)? }.st).connect_data = data.to_vec();
    }
    Ok(())
}

/// `rdma_destroy_ep`: its QP, SRQ and the ID.
///
/// # Safety
///
/// `id` is live; it is freed.
pub unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    crate::ffi::guard("rdma_destroy_ep", (), || {
        if id.is_null() {
            return;
        }
        // SAFETY: the caller's live ID.
        unsafe {
            if !(*id).qp.is_null() {
                qp::rdma_destroy_qp(id);
            }
            if !(*id).srq.is_null() {
                qp::rdma_destroy_srq(id);
            }
        }
        let _ = id::destroy(id);
    });
}
