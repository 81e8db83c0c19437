//! `rdma_get_cm_event` and `rdma_ack_cm_event`: a device event becomes a
//! `struct rdma_cm_event`, with what rdma-core's library does on the way
//! (addresses and routes read into the ID; on the active side with a QP,
//! CONNECT_RESPONSE moves the QP to RTS, sends the RTU and is reported as
//! ESTABLISHED; a REJECTED moves the QP to ERR).

use std::ffi::c_char;

use vrdma_guest_driver::cm::{event_kind, CmEvent};

use super::channel::{lock, pump, Channel, Pending};
use super::cm_call;
use super::id::Id;
use crate::abi::{
    ibv_ah_attr, rdma_cm_event, rdma_conn_param, rdma_event_channel, rdma_ud_param, IBV_QPT_UD,
};
use crate::ffi::{non_null, VResult};

/// The event the application holds, with room for its private data; the
/// ID whose count its acknowledgement completes.
#[repr(C)]
struct Reported {
    event: rdma_cm_event,
    private_data: [u8; 256],
    counted: *mut Id,
}

/// Takes the next event of `channel` into `out`, waiting for one unless
/// the channel's descriptor is non-blocking (EAGAIN).
pub(crate) fn get_event(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_event,
) -> VResult<()> {
    non_null(out)?;
    // SAFETY: the caller passes a live channel.
    let ch = unsafe { Channel::from_raw(channel)? };
    loop {
        pump();
        if let Some(p) = ch.pop() {
            if let Some(e) = deliver(p) {
                // SAFETY: the caller's writable pointer.
                unsafe { out.write(e) };
                return Ok(());
            }
            continue;
        }
        if ch.nonblocking() {
            return Err(libc::EAGAIN);
        }
        ch.wait()?;
    }
}

/// `rdma_get_cm_event`.
///
/// # Safety
///
/// `channel` is live; `event` writable.
pub unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> i32 {
    cm_call("rdma_get_cm_event", || get_event(channel, event))
}

/// `rdma_ack_cm_event`.
///
/// # Safety
///
/// `event` is an event this library reported, not yet acknowledged.
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> i32 {
    cm_call("rdma_ack_cm_event", || {
        non_null(event)?;
        // SAFETY: made by `deliver` (Box::into_raw of a Reported, whose
        // first field is the event).
        let r = unsafe { Box::from_raw(event.cast::<Reported>()) };
        // SAFETY: an ID stays alive until its events are acknowledged.
        let id = unsafe { &*r.counted };
        lock(&id.counts).acked += 1;
        id.acked.notify_all();
        Ok(())
    })
}

/// The application's event for `p`, or `None` when rdma_cm would not
/// report it.
fn deliver(p: Pending) -> Option<*mut rdma_cm_event> {
    // SAFETY: routed IDs are alive until destroyed, which first takes
    // their waiting events out of the channel.
    let id = unsafe { &*p.id };
    let e = &p.event;
    let mut kind = e.kind;
    let mut status = e.status;
    match kind {
        event_kind::ADDR_RESOLVED | event_kind::ROUTE_RESOLVED => {
            if let Err(errno) = id.refresh() {
                status = -errno;
                kind = if kind == event_kind::ADDR_RESOLVED {
                    event_kind::ADDR_ERROR
                } else {
                    event_kind::ROUTE_ERROR
                };
            }
        }
        event_kind::CONNECT_REQUEST => {
            if let Err(errno) = id.refresh() {
                tracing::warn!(errno, "a connect request's ID cannot be read: rejected");
                let _ = super::id::destroy(p.id.cast());
                return None;
            }
            let mut st = lock(&id.st);
            st.responder_resources = e.responder_resources;
            st.initiator_depth = e.initiator_depth;
        }
        event_kind::CONNECT_RESPONSE if !id.cm().qp.is_null() => match id.conn_resp() {
            Ok(()) => kind = event_kind::ESTABLISHED,
            Err(errno) => {
                kind = event_kind::CONNECT_ERROR;
                status = -errno;
                lock(&id.st).connect_error = true;
            }
        },
        event_kind::ESTABLISHED => {
            let mut st = lock(&id.st);
            if st.drop_established {
                st.drop_established = false;
                return None;
            }
        }
        event_kind::REJECTED => {
            if lock(&id.st).connect_error {
                return None;
            }
            id.qp_to_err();
        }
        event_kind::DISCONNECTED if lock(&id.st).connect_error => return None,
        _ => {}
    }
    let counted = if p.listener.is_null() {
        p.id
    } else {
        p.listener
    };
    let mut r = Box::new(Reported {
        event: rdma_cm_event {
            id: p.id.cast(),
            listen_id: p.listener.cast(),
            event: kind,
            status,
            ..Default::default()
        },
        private_data: [0; 256],
        counted,
    });
    let n = e.private_data.len().min(256);
    r.private_data[..n].copy_from_slice(&e.private_data[..n]);
    let data = r.private_data.as_ptr().cast::<libc::c_void>();
    // The device reports Linux's lengths (the message's whole field, at
    // most 196 bytes), which fit the u8 of the structure.
    let len = u8::try_from(n).unwrap_or(u8::MAX);
    if id.cm().qp_type == IBV_QPT_UD {
        r.event.param.ud = ud_param(e, data, len);
    } else {
        r.event.param.conn = rdma_conn_param {
            private_data: data,
            private_data_len: len,
            responder_resources: e.responder_resources,
            initiator_depth: e.initiator_depth,
            flow_control: e.flow_control,
            retry_count: e.retry_count,
            rnr_retry_count: e.rnr_retry_count,
            srq: e.srq,
            qp_num: e.qp_num,
        };
    }
    // SAFETY: as above.
    lock(&unsafe { &*counted }.counts).reported += 1;
    Some(Box::into_raw(r).cast())
}

fn ud_param(e: &CmEvent, data: *const libc::c_void, len: u8) -> rdma_ud_param {
    let ah_attr = e.ah_attr.as_ref().map_or_else(ibv_ah_attr::default, |a| {
        let mut ah = crate::control::ah_from_wire(a);
        ah.port_num = 1;
        ah.is_global = 1;
        ah
    });
    rdma_ud_param {
        private_data: data,
        private_data_len: len,
        ah_attr,
        qp_num: e.qp_num,
        qkey: e.qkey,
    }
}

/// `rdma_event_str`.
pub extern "C" fn rdma_event_str(event: u32) -> *const c_char {
    let s: &'static [u8] = match event {
        0 => b"RDMA_CM_EVENT_ADDR_RESOLVED\0",
        1 => b"RDMA_CM_EVENT_ADDR_ERROR\0",
        2 => b"RDMA_CM_EVENT_ROUTE_RESOLVED\0",
        3 => b"RDMA_CM_EVENT_ROUTE_ERROR\0",
        4 => b"RDMA_CM_EVENT_CONNECT_REQUEST\0",
        5 => b"RDMA_CM_EVENT_CONNECT_RESPONSE\0",
        6 => b"RDMA_CM_EVENT_CONNECT_ERROR\0",
        7 => b"RDMA_CM_EVENT_UNREACHABLE\0",
        8 => b"RDMA_CM_EVENT_REJECTED\0",
        9 => b"RDMA_CM_EVENT_ESTABLISHED\0",
        10 => b"RDMA_CM_EVENT_DISCONNECTED\0",
        11 => b"RDMA_CM_EVENT_DEVICE_REMOVAL\0",
        12 => b"RDMA_CM_EVENT_MULTICAST_JOIN\0",
        13 => b"RDMA_CM_EVENT_MULTICAST_ERROR\0",
        14 => b"RDMA_CM_EVENT_ADDR_CHANGE\0",
        15 => b"RDMA_CM_EVENT_TIMEWAIT_EXIT\0",
        _ => b"UNKNOWN EVENT\0",
    };
    s.as_ptr().cast()
}
