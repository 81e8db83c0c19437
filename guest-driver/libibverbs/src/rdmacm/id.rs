//! CM IDs (`struct rdma_cm_id`) and the calls on them.
//!
//! An ID is created without a device (as with rdma-core); it is placed on
//! one when an address names it: `rdma_bind_addr` to the device's address
//! (a wildcard: the first device with a connection manager),
//! `rdma_resolve_addr` from the source address (or that default device),
//! `rdma_listen` unbound (that device). Then it has a CM ID on the
//! device's CM channel, and `id->verbs`, `id->pd` and `id->port_num`.
//!
//! An ID created without a channel (`rdma_create_id(NULL, ...)`,
//! `rdma_create_ep`) is synchronous: it has a channel of its own and each
//! call returns once its event has come (rdma-core's `ucma_complete`).

use std::cell::UnsafeCell;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use vrdma_guest_driver::cm::{move_flags, CmChannel, CmId, ConnParam, MoveOverrides};
use vrdma_guest_driver::vrdma_spec::verbs::{QpState, QpType};

use super::channel::{lock, pump, Channel, ROUTES};
use super::cm_call;
use super::devices::{self, CmDevice};
use super::event;
use super::qp;
use crate::abi::{
    ibv_qp_attr, ibv_qp_init_attr, ibv_sa_path_rec, rdma_cm_event, rdma_cm_id, rdma_conn_param,
    rdma_event_channel, rdma_port_space, sockaddr, sockaddr_in, IBV_EVENT_COMM_EST, IBV_QPS_ERR,
    IBV_QPT_RC, IBV_QPT_UD, RDMA_CM_EVENT_REJECTED, RDMA_MAX_INIT_DEPTH, RDMA_MAX_RESP_RES,
    RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, RDMA_OPTION_ID_AFONLY, RDMA_OPTION_ID_REUSEADDR,
    RDMA_OPTION_ID_TOS, RDMA_PS_IB, RDMA_PS_IPOIB, RDMA_PS_TCP, RDMA_PS_UDP,
};
use crate::control;
use crate::ffi::{non_null, VResult};

/// What the library keeps of an ID beside the application's view.
#[derive(Default)]
pub(crate) struct IdState {
    /// The device (index of [`devices::all`]) and the device's CM ID.
    pub(crate) placed: Option<(usize, CmId)>,
    /// A listener on the wildcard address listens on every device, as
    /// Linux's rdma_cm does (`cma_listen_on_all`): its CM IDs on the
    /// devices other than the one it is placed on.
    pub(crate) also_listening: Vec<(usize, CmId)>,
    pub(crate) sync: bool,
    /// `rdma_connect` was called: the active side.
    pub(crate) active: bool,
    /// The device reports ESTABLISHED on the active side after an
    /// establish; rdma_cm does not (the library already reported it, or
    /// the application called `rdma_establish` itself): dropped once.
    pub(crate) drop_established: bool,
    /// A CONNECT_RESPONSE could not move the QP: what the peer says next
    /// is not reported (as rdma-core).
    pub(crate) connect_error: bool,
    pub(crate) responder_resources: u8,
    pub(crate) initiator_depth: u8,
    /// `rdma_create_ep` on a passive ID: the QP each request gets.
    pub(crate) qp_init_attr: Option<ibv_qp_init_attr>,
    /// `rdma_addrinfo.ai_connect`: sent before the caller's private data.
    pub(crate) connect_data: Vec<u8>,
    pub(crate) path_rec: Option<Box<ibv_sa_path_rec>>,
    /// `RDMA_OPTION_ID_TOS`: the traffic class of the paths this ID
    /// connects (the route's report shows it too).
    pub(crate) tos: Option<u8>,
    /// `RDMA_OPTION_ID_ACK_TIMEOUT`: the QP's `timeout` at RTS.
    pub(crate) ack_timeout: Option<u8>,
}

/// Events reported and acknowledged (`rdma_destroy_id` waits for these to
/// match).
#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) reported: u64,
    pub(crate) acked: u64,
}

/// An ID: the application's `struct rdma_cm_id` first.
#[repr(C)]
pub(crate) struct Id {
    pub(crate) cm: UnsafeCell<rdma_cm_id>,
    pub(crate) st: Mutex<IdState>,
    pub(crate) counts: Mutex<Counts>,
    pub(crate) acked: Condvar,
}

fn qp_type_of(ps: rdma_port_space) -> u32 {
    if ps == RDMA_PS_UDP || ps == RDMA_PS_IPOIB {
        IBV_QPT_UD
    } else {
        IBV_QPT_RC
    }
}

impl Id {
    /// The application's view of the ID.
    pub(crate) fn cm(&self) -> &rdma_cm_id {
        // SAFETY: the cell is this live ID's; writers (`cm_mut`) hold no
        // reference across this call.
        unsafe { &*self.cm.get() }
    }

    /// The application's view, to write: the library writes it only in
    /// calls on the ID and in the event processing of its channel, as
    /// rdma-core's library does, and keeps no reference past a statement.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn cm_mut(&self) -> &mut rdma_cm_id {
        // SAFETY: as above; the cell makes writes through `&self` legal.
        unsafe { &mut *self.cm.get() }
    }

    fn alloc(
        channel: *mut rdma_event_channel,
        context: *mut libc::c_void,
        ps: rdma_port_space,
        qp_type: u32,
    ) -> VResult<*mut Id> {
        if ![RDMA_PS_TCP, RDMA_PS_UDP, RDMA_PS_IPOIB, RDMA_PS_IB].contains(&ps) {
            return Err(libc::EINVAL);
        }
        let (channel, sync) = if channel.is_null() {
            (Channel::create()?.cast::<rdma_event_channel>(), true)
        } else {
            (channel, false)
        };
        let cm = rdma_cm_id {
            channel,
            context,
            ps,
            qp_type,
            ..Default::default()
        };
        Ok(Box::into_raw(Box::new(Id {
            cm: UnsafeCell::new(cm),
            st: Mutex::new(IdState {
                sync,
                ..IdState::default()
            }),
            counts: Mutex::new(Counts::default()),
            acked: Condvar::new(),
        })))
    }

    /// # Safety
    ///
    /// `p` is an ID this library made and has not freed.
    pub(crate) unsafe fn from_raw<'a>(p: *mut rdma_cm_id) -> VResult<&'a Id> {
        non_null(p)?;
        // SAFETY: the caller's promise; `cm` is the first field.
        Ok(unsafe { &*p.cast::<Id>() })
    }

    /// The ID a connect request to `listener` made (device CM ID `child`):
    /// the listener's context, port space and QP type; its own channel
    /// when the listener is synchronous.
    ///
    /// # Safety
    ///
    /// `listener` is live.
    pub(crate) unsafe fn child_of(listener: *mut Id, dev: usize, child: CmId) -> VResult<*mut Id> {
        // SAFETY: the caller's promise.
        let l = unsafe { &*listener };
        let sync = lock(&l.st).sync;
        let channel = if sync {
            std::ptr::null_mut()
        } else {
            l.cm().channel
        };
        let id = Id::alloc(channel, l.cm().context, l.cm().ps, l.cm().qp_type)?;
        // SAFETY: just made.
        let new = unsafe { &mut *id };
        // The device the request came to: a wildcard listener listens on
        // every device, and the connection is that device's.
        let d = devices::get(dev)?;
        new.cm_mut().verbs = d.verbs;
        new.cm_mut().pd = d.pd;
        new.cm_mut().port_num = 1;
        lock(&new.st).placed = Some((dev, child));
        Ok(id)
    }

    pub(crate) fn placed(&self) -> VResult<(&'static CmDevice, &'static CmChannel, CmId)> {
        let (dev, id) = lock(&self.st).placed.ok_or(libc::EINVAL)?;
        let d = devices::get(dev)?;
        Ok((d, d.cm.as_ref().ok_or(libc::ENODEV)?, id))
    }

    /// A wildcard listener on port `port` also listens on every other
    /// device with a connection manager: a request to any of the
    /// process's addresses reaches it, and its new ID is placed on the
    /// device the request came to. A device that cannot listen there (the
    /// port taken) fails the listen, as in Linux; what was set up is
    /// undone.
    fn listen_on_other_devices(&self, port: u16, backlog: u32) -> VResult<()> {
        let Some((home, _)) = lock(&self.st).placed else {
            return Err(libc::EINVAL);
        };
        let qp_type = self.device_qp_type();
        let me = std::ptr::from_ref(self).cast_mut();
        for (dev, d) in devices::all().iter().enumerate() {
            let Some(cm) = d.cm.as_ref().filter(|_| dev != home) else {
                continue;
            };
            let listening = cm.create_id(self.cm().ps, qp_type).and_then(|cm_id| {
                lock(&self.st).also_listening.push((dev, cm_id));
                lock(&ROUTES).0.insert((dev, cm_id.0), me);
                cm.bind_addr(cm_id, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port))?;
                cm.listen(cm_id, backlog)
            });
            if let Err(e) = listening {
                for (dev, cm_id) in std::mem::take(&mut lock(&self.st).also_listening) {
                    unroute_and_destroy(dev, cm_id);
                }
                return Err(crate::ffi::errno_of(&e));
            }
        }
        Ok(())
    }

    /// The QP type a device CM ID of this ID's port space is created
    /// with: only `RDMA_PS_IB` IDs say.
    fn device_qp_type(&self) -> Option<QpType> {
        (self.cm().ps == RDMA_PS_IB).then(|| {
            if self.cm().qp_type == IBV_QPT_UD {
                QpType::Ud
            } else {
                QpType::Rc
            }
        })
    }

    /// Places the ID on device `dev` (a no-op if it is there already;
    /// EINVAL if it is on another).
    fn place(&self, dev: usize) -> VResult<()> {
        if let Some((on, _)) = lock(&self.st).placed {
            return if on == dev { Ok(()) } else { Err(libc::EINVAL) };
        }
        let d = devices::get(dev)?;
        let cm = d.cm.as_ref().ok_or(libc::ENODEV)?;
        let cm_id = cm
            .create_id(self.cm().ps, self.device_qp_type())
            .map_err(|e| crate::ffi::errno_of(&e))?;
        lock(&self.st).placed = Some((dev, cm_id));
        let me = std::ptr::from_ref(self).cast_mut();
        lock(&ROUTES).0.insert((dev, cm_id.0), me);
        // SAFETY: the application's view of this live ID; the library
        // writes it only in calls on the ID, as rdma-core.
        unsafe {
            (*me).cm_mut().verbs = d.verbs;
            (*me).cm_mut().pd = d.pd;
            (*me).cm_mut().port_num = 1;
        }
        Ok(())
    }

    /// Fills the application's view from the device's: addresses, GIDs,
    /// P_Key and (once resolved) the path.
    pub(crate) fn refresh(&self) -> VResult<()> {
        let (_, cm, id) = self.placed()?;
        let info = cm.query(id).map_err(|e| crate::ffi::errno_of(&e))?;
        let me = std::ptr::from_ref(self).cast_mut();
        let src = SocketAddrV4::new(Ipv4Addr::from(info.src.ip), info.src.port.get());
        let dst = SocketAddrV4::new(Ipv4Addr::from(info.dst.ip), info.dst.port.get());
        // SAFETY: as in `place`.
        unsafe {
            let addr = &mut (*me).cm_mut().route.addr;
            addr.__bindgen_anon_1.src_sin = sockaddr_in_of(src);
            if !dst.ip().is_unspecified() || dst.port() != 0 {
                addr.__bindgen_anon_2.dst_sin = sockaddr_in_of(dst);
            }
            let ib = &mut addr.addr.ibaddr;
            ib.sgid.raw = if info.route_valid != 0 {
                info.sgid
            } else {
                vrdma_guest_driver::vrdma_spec::gid::ipv4_mapped(src.ip().octets())
            };
            if info.route_valid != 0 {
                ib.dgid.raw = info.dgid;
            }
            ib.pkey = info.pkey.get().to_be();
        }
        if info.route_valid != 0 {
            let mut st = lock(&self.st);
            let tos = st.tos;
            let rec = st.path_rec.get_or_insert_with(Box::default);
            rec.dgid.raw = info.dgid;
            rec.sgid.raw = info.sgid;
            rec.pkey = info.pkey.get().to_be();
            rec.mtu = info.mtu;
            rec.traffic_class = tos.unwrap_or(info.traffic_class);
            rec.hop_limit = info.hop_limit;
            rec.sl = info.sl;
            rec.flow_label = info.flow_label.get().to_be();
            rec.packet_life_time = info.packet_life_time;
            rec.reversible = 1;
            rec.numb_path = 1;
            let p: *mut ibv_sa_path_rec = &mut **rec;
            // SAFETY: as above; the record lives in the ID's state.
            unsafe {
                (*me).cm_mut().route.path_rec = p;
                (*me).cm_mut().route.num_paths = 1;
            }
        }
        Ok(())
    }

    /// Acknowledges the event a synchronous call left in `id->event` (the
    /// last one it waited for), as rdma-core's library does before the
    /// ID's next call and when the ID is destroyed.
    pub(crate) fn ack_held_event(&self) {
        let held = std::mem::replace(&mut self.cm_mut().event, std::ptr::null_mut());
        if !held.is_null() {
            // SAFETY: an event this library reported for the ID.
            unsafe { event::rdma_ack_cm_event(held) };
        }
    }

    /// For a synchronous ID: waits for the event the call just started
    /// (rdma-core's `ucma_complete`), keeping it in `id->event`.
    pub(crate) fn complete(&self) -> VResult<()> {
        if !lock(&self.st).sync {
            return Ok(());
        }
        self.ack_held_event();
        let mut out: *mut rdma_cm_event = std::ptr::null_mut();
        event::get_event(self.cm().channel, &mut out)?;
        self.cm_mut().event = out;
        // SAFETY: an event just reported.
        let e = unsafe { &*out };
        match e.status {
            0 => Ok(()),
            _ if e.event == RDMA_CM_EVENT_REJECTED => Err(libc::ECONNREFUSED),
            s if s < 0 => Err(-s),
            s => Err(s),
        }
    }

    /// Moves the ID's QP (if any) with the device's attributes for
    /// `state`, `adjust` changing them first.
    pub(crate) fn move_qp(
        &self,
        state: QpState,
        adjust: impl FnOnce(&mut ibv_qp_attr),
    ) -> VResult<()> {
        if self.cm().qp.is_null() {
            return Ok(());
        }
        let (mut attr, mask) = self.qp_attr(state)?;
        adjust(&mut attr);
        // SAFETY: the ID's live QP.
        match unsafe { control::ibv_modify_qp(self.cm().qp, &mut attr, mask as i32) } {
            0 => Ok(()),
            e => Err(e),
        }
    }

    /// Moves the ID's QP (if any) through each state up to `state` (from
    /// INIT with [`move_flags::FROM_INIT`]) with the device's attributes,
    /// `over` replacing some: one CM_MOVE_QP where the QP is of the ID's
    /// own context (as `rdma_create_qp` makes it), else a CM_INIT_QP_ATTR
    /// and a MODIFY_QP per state, as rdma-core does. A connection setup
    /// takes three commands fewer on each side (each a round trip to the
    /// device, and most of them one to hostd).
    pub(crate) fn move_qp_through(
        &self,
        state: QpState,
        flags: u8,
        over: MoveOverrides,
    ) -> VResult<()> {
        let qp = self.cm().qp;
        if qp.is_null() {
            return Ok(());
        }
        let (d, cm, id) = self.placed()?;
        // SAFETY: the ID's live QP.
        let (context, qpn) = unsafe { ((*qp).context, (*qp).qp_num) };
        if context != d.verbs {
            let mut steps = Vec::new();
            if flags & move_flags::FROM_INIT != 0 {
                steps.push(QpState::Init);
            }
            match state {
                QpState::Rtr => steps.push(QpState::Rtr),
                QpState::Rts => steps.extend([QpState::Rtr, QpState::Rts]),
                _ => {}
            }
            for step in steps {
                self.move_qp(step, |a| match step {
                    QpState::Rtr => {
                        a.max_dest_rd_atomic =
                            over.max_dest_rd_atomic.unwrap_or(a.max_dest_rd_atomic)
                    }
                    QpState::Rts => {
                        a.max_rd_atomic = over.max_rd_atomic.unwrap_or(a.max_rd_atomic);
                        if flags & move_flags::SQ_PSN_ZERO != 0 {
                            a.sq_psn = 0;
                        }
                    }
                    _ => {}
                })?;
            }
            return Ok(());
        }
        let over = MoveOverrides {
            // RDMA_OPTION_ID_ACK_TIMEOUT, as Linux's rdma_init_qp_attr
            // applies it: the timeout of an RTS that sets one.
            timeout: lock(&self.st).ack_timeout,
            ..over
        };
        let (wire, mask) = cm
            .move_qp(id, qpn, state, flags, over)
            .map_err(|e| crate::ffi::errno_of(&e))?;
        let attr = control::qp_attr_from_wire(&wire);
        let av = (mask & crate::abi::IBV_QP_AV != 0).then_some(&attr.ah_attr);
        // SAFETY: the ID's live QP.
        unsafe { control::note_modified(qp, Some(u32::from(u8::from(state))), av) }
    }

    pub(crate) fn qp_attr(&self, state: QpState) -> VResult<(ibv_qp_attr, u32)> {
        let (_, cm, id) = self.placed()?;
        let (wire, mask) = cm
            .init_qp_attr(id, state)
            .map_err(|e| crate::ffi::errno_of(&e))?;
        let mut attr = control::qp_attr_from_wire(&wire);
        // RDMA_OPTION_ID_ACK_TIMEOUT, as Linux's rdma_init_qp_attr applies
        // it: the timeout of an RTS that sets one.
        if let Some(timeout) = lock(&self.st).ack_timeout {
            if mask & crate::abi::IBV_QP_TIMEOUT != 0 {
                attr.timeout = timeout;
            }
        }
        Ok((attr, mask))
    }

    /// Moves the QP to ERR (rejected, disconnected, failed).
    pub(crate) fn qp_to_err(&self) {
        if self.cm().qp.is_null() {
            return;
        }
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        // SAFETY: the ID's live QP.
        let _ = unsafe {
            control::ibv_modify_qp(self.cm().qp, &mut attr, crate::abi::IBV_QP_STATE as i32)
        };
    }

    /// The active side after CONNECT_RESPONSE: QP to RTR and RTS, then the
    /// RTU (rdma-core's `ucma_process_conn_resp`).
    pub(crate) fn conn_resp(&self) -> VResult<()> {
        let r = self
            .move_qp_through(
                QpState::Rts,
                move_flags::FROM_INIT,
                MoveOverrides::default(),
            )
            .and_then(|()| self.establish());
        if r.is_err() {
            self.qp_to_err();
        }
        r
    }

    fn establish(&self) -> VResult<()> {
        let (_, cm, id) = self.placed()?;
        // Set before the command: another thread may take the device's
        // ESTABLISHED as soon as it is sent.
        let active = {
            let mut st = lock(&self.st);
            st.drop_established = st.active;
            st.active
        };
        cm.establish(id).map_err(|e| {
            if active {
                lock(&self.st).drop_established = false;
            }
            crate::ffi::errno_of(&e)
        })
    }

    fn conn_param(&self, p: Option<&rdma_conn_param>, qp_num: u32, srq: bool) -> ConnParam {
        let st = lock(&self.st);
        let mut private_data = st.connect_data.clone();
        let (flow_control, retry_count, rnr_retry_count) = match p {
            Some(p) => {
                if !p.private_data.is_null() && p.private_data_len > 0 {
                    // SAFETY: the caller's buffer of that length.
                    private_data.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(
                            p.private_data.cast::<u8>(),
                            usize::from(p.private_data_len),
                        )
                    });
                }
                (p.flow_control != 0, p.retry_count, p.rnr_retry_count)
            }
            None => (false, 7, 7),
        };
        ConnParam {
            private_data,
            responder_resources: st.responder_resources,
            initiator_depth: st.initiator_depth,
            flow_control,
            retry_count,
            rnr_retry_count,
            srq,
            qp_num,
            starting_psn: None,
            qkey: 0,
            traffic_class: st.tos,
        }
    }

    /// rdma-core's `ucma_valid_param`.
    fn valid_param(&self, p: Option<&rdma_conn_param>, d: &CmDevice) -> VResult<()> {
        if self.cm().ps != RDMA_PS_TCP {
            return Ok(());
        }
        let Some(p) = p else {
            return if self.cm().qp.is_null() {
                Err(libc::EINVAL)
            } else {
                Ok(())
            };
        };
        let rr = u32::from(p.responder_resources);
        let id = u32::from(p.initiator_depth);
        if (rr != RDMA_MAX_RESP_RES && p.responder_resources > d.max_responder_resources)
            || (id != RDMA_MAX_INIT_DEPTH && p.initiator_depth > d.max_initiator_depth)
        {
            return Err(libc::EINVAL);
        }
        Ok(())
    }

    fn qp_num_srq(&self, p: Option<&rdma_conn_param>) -> VResult<(u32, bool)> {
        if self.cm().qp.is_null() {
            let p = p.ok_or(libc::EINVAL)?;
            Ok((p.qp_num, p.srq != 0))
        } else {
            // SAFETY: the ID's live QP.
            let qp = unsafe { &*self.cm().qp };
            Ok((qp.qp_num, !qp.srq.is_null()))
        }
    }
}

pub(crate) fn sockaddr_in_of(a: SocketAddrV4) -> sockaddr_in {
    sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: a.port().to_be(),
        sin_addr: crate::abi::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        ..Default::default()
    }
}

/// An IPv4 socket address from the caller (EAFNOSUPPORT for others:
/// vrdma's devices have IPv4 addresses only).
///
/// # Safety
///
/// `a` is NULL or a readable sockaddr of its family's size.
pub(crate) unsafe fn ipv4_of(a: *const sockaddr) -> VResult<Option<SocketAddrV4>> {
    if a.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's promise.
    let family = i32::from(unsafe { (*a).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let s = unsafe { &*a.cast::<sockaddr_in>() };
            Ok(Some(SocketAddrV4::new(
                Ipv4Addr::from(s.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_UNSPEC => Ok(None),
        _ => Err(libc::EAFNOSUPPORT),
    }
}

fn with_id(verb: &'static str, id: *mut rdma_cm_id, f: impl FnOnce(&Id) -> VResult<()>) -> i32 {
    cm_call(verb, || {
        // SAFETY: the application passes a live ID.
        let id = unsafe { Id::from_raw(id)? };
        f(id)
    })
}

/// `rdma_create_id`.
///
/// # Safety
///
/// `id` is writable; `channel` NULL or live.
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut libc::c_void,
    ps: rdma_port_space,
) -> i32 {
    cm_call("rdma_create_id", || {
        non_null(id)?;
        devices::default_index()?;
        let new = Id::alloc(channel, context, ps, qp_type_of(ps))?;
        // SAFETY: the caller's writable pointer.
        unsafe { id.write(new.cast()) };
        Ok(())
    })
}

/// Creates a synchronous ID of `ps` and `qp_type` (`rdma_create_ep`).
pub(crate) fn create_sync(ps: rdma_port_space, qp_type: u32) -> VResult<*mut Id> {
    devices::default_index()?;
    Id::alloc(std::ptr::null_mut(), std::ptr::null_mut(), ps, qp_type)
}

/// `rdma_destroy_id`: waits until every event reported for the ID has
/// been acknowledged.
///
/// # Safety
///
/// `id` is live; it is freed.
pub unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> i32 {
    cm_call("rdma_destroy_id", || destroy(id))
}

/// Stops routing the events of device `dev`'s CM ID `cm_id` and
/// destroys it there.
fn unroute_and_destroy(dev: usize, cm_id: CmId) {
    lock(&ROUTES).0.remove(&(dev, cm_id.0));
    if let Some(cm) = devices::get(dev).ok().and_then(|d| d.cm.as_ref()) {
        if let Err(e) = cm.destroy_id(cm_id) {
            tracing::debug!(error = %e, "the device's CM ID was gone already");
        }
    }
}

pub(crate) fn destroy(id: *mut rdma_cm_id) -> VResult<()> {
    // SAFETY: the caller passes a live ID.
    let our = unsafe { Id::from_raw(id)? };
    let (placed, also) = {
        let mut st = lock(&our.st);
        (st.placed, std::mem::take(&mut st.also_listening))
    };
    for (dev, cm_id) in placed.into_iter().chain(also) {
        unroute_and_destroy(dev, cm_id);
    }
    // Events routed but not taken are not reported now; connect requests
    // to this listener take their new IDs with them.
    // SAFETY: an ID's channel is live while the ID is.
    if let Ok(ch) = unsafe { Channel::from_raw(our.cm().channel) } {
        for p in ch.take_events_of(id.cast()) {
            if p.listener == id.cast::<Id>() && p.id != id.cast::<Id>() {
                let _ = destroy(p.id.cast());
            }
        }
    }
    our.ack_held_event();
    {
        let mut c = lock(&our.counts);
        while c.acked < c.reported {
            c = our.acked.wait(c).unwrap_or_else(|e| e.into_inner());
        }
    }
    let sync = lock(&our.st).sync;
    // SAFETY: made by Box::into_raw; nothing refers to it any more.
    let boxed = unsafe { Box::from_raw(id.cast::<Id>()) };
    if sync {
        // SAFETY: the ID's own channel.
        unsafe { super::channel::rdma_destroy_event_channel(boxed.cm().channel) };
    }
    Ok(())
}

/// `rdma_bind_addr`.
///
/// # Safety
///
/// `id` is live; `addr` a readable socket address.
pub unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> i32 {
    with_id("rdma_bind_addr", id, |id| {
        // SAFETY: the caller's address.
        let a = unsafe { ipv4_of(addr)? }.ok_or(libc::EINVAL)?;
        let mut a = a;
        let dev = if a.ip().is_unspecified() {
            match lock(&id.st).placed {
                Some((d, _)) => d,
                None => devices::default_index()?,
            }
        } else {
            match devices::by_ip(*a.ip()) {
                Ok(d) => d,
                // A loopback address no device has binds to the first
                // device, as Linux's rdma_cm binds it (cma_bind_loopback):
                // libfabric's verbs provider probes with 127.0.0.1. The ID
                // takes that device's own address.
                Err(_) if a.ip().is_loopback() => {
                    let d = devices::default_index()?;
                    let ip = devices::all()[d].ip.ok_or(libc::EADDRNOTAVAIL)?;
                    a = SocketAddrV4::new(ip, a.port());
                    d
                }
                Err(e) => return Err(e),
            }
        };
        id.place(dev)?;
        let (_, cm, cm_id) = id.placed()?;
        cm.bind_addr(cm_id, a)
            .map_err(|e| crate::ffi::errno_of(&e))?;
        id.refresh()
    })
}

/// `rdma_resolve_addr`.
///
/// # Safety
///
/// `id` is live; the addresses NULL (source) or readable.
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src_addr: *mut sockaddr,
    dst_addr: *mut sockaddr,
    timeout_ms: i32,
) -> i32 {
    with_id("rdma_resolve_addr", id, |id| {
        // SAFETY: the caller's addresses.
        let dst = unsafe { ipv4_of(dst_addr)? }.ok_or(libc::EINVAL)?;
        // SAFETY: as above.
        let src = unsafe { ipv4_of(src_addr)? };
        let dev = match (lock(&id.st).placed, src) {
            (Some((d, _)), _) => d,
            (None, Some(s)) if !s.ip().is_unspecified() => devices::by_ip(*s.ip())?,
            (None, _) => devices::default_index()?,
        };
        id.place(dev)?;
        let (_, cm, cm_id) = id.placed()?;
        let timeout = Duration::from_millis(u64::try_from(timeout_ms.max(1)).unwrap_or(2000));
        let src = src.filter(|s| !s.ip().is_unspecified() || s.port() != 0);
        cm.resolve_addr(cm_id, src, dst, timeout)
            .map_err(|e| crate::ffi::errno_of(&e))?;
        id.cm_mut().route.addr.__bindgen_anon_2.dst_sin = sockaddr_in_of(dst);
        id.complete()
    })
}

/// `rdma_resolve_route`.
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: i32) -> i32 {
    with_id("rdma_resolve_route", id, |id| {
        let (_, cm, cm_id) = id.placed()?;
        cm.resolve_route(cm_id)
            .map_err(|e| crate::ffi::errno_of(&e))?;
        id.complete()
    })
}

/// `rdma_listen`.
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, backlog: i32) -> i32 {
    with_id("rdma_listen", id, |id| {
        if lock(&id.st).placed.is_none() {
            id.place(devices::default_index()?)?;
        }
        let backlog = u32::try_from(backlog.max(0)).unwrap_or(0);
        let (_, cm, cm_id) = id.placed()?;
        cm.listen(cm_id, backlog)
            .map_err(|e| crate::ffi::errno_of(&e))?;
        id.refresh()?;
        // SAFETY: `refresh` just wrote the bound address, an IPv4 one,
        // into the union (vrdma's devices have IPv4 addresses only).
        let bound = unsafe { id.cm().route.addr.__bindgen_anon_1.src_sin };
        if bound.sin_addr.s_addr == 0 {
            id.listen_on_other_devices(u16::from_be(bound.sin_port), backlog)?;
        }
        Ok(())
    })
}

/// A depth of `rdma_conn_param` (`initiator_depth`,
/// `responder_resources`): the application's, unless it is absent or
/// rdma_cm's "as much as the device allows" (`max_marker`, e.g.
/// `RDMA_MAX_INIT_DEPTH`); then `otherwise`.
fn depth(asked: Option<u8>, max_marker: u32, otherwise: u8) -> u8 {
    match asked {
        Some(v) if u32::from(v) != max_marker => v,
        _ => otherwise,
    }
}

/// `rdma_connect`.
///
/// # Safety
///
/// `id` is live; `conn_param` NULL or readable.
pub unsafe extern "C" fn rdma_connect(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> i32 {
    with_id("rdma_connect", id, |id| {
        // SAFETY: the caller's parameters.
        let p = unsafe { conn_param.as_ref() };
        let (d, cm, cm_id) = id.placed()?;
        id.valid_param(p, d)?;
        {
            let mut st = lock(&id.st);
            st.initiator_depth = depth(
                p.map(|p| p.initiator_depth),
                RDMA_MAX_INIT_DEPTH,
                d.max_initiator_depth,
            );
            st.responder_resources = depth(
                p.map(|p| p.responder_resources),
                RDMA_MAX_RESP_RES,
                d.max_responder_resources,
            );
            st.active = true;
        }
        let (qp_num, srq) = if id.cm().qp.is_null() {
            p.map_or((0, false), |p| (p.qp_num, p.srq != 0))
        } else {
            id.qp_num_srq(p)?
        };
        let param = id.conn_param(p, qp_num, srq);
        cm.connect(cm_id, &param)
            .map_err(|e| crate::ffi::errno_of(&e))?;
        lock(&id.st).connect_data.clear();
        id.complete()
    })
}

/// `rdma_accept`.
///
/// # Safety
///
/// `id` is live; `conn_param` NULL or readable.
pub unsafe extern "C" fn rdma_accept(id: *mut rdma_cm_id, conn_param: *mut rdma_conn_param) -> i32 {
    with_id("rdma_accept", id, |id| {
        // SAFETY: the caller's parameters.
        let p = unsafe { conn_param.as_ref() };
        let (d, cm, cm_id) = id.placed()?;
        id.valid_param(p, d)?;
        let (qp_num, srq) = id.qp_num_srq(p)?;
        let (rr, depth) = {
            let mut st = lock(&id.st);
            // Unless the application says: what the request asked, within
            // the device's limits.
            st.initiator_depth = depth(
                p.map(|p| p.initiator_depth),
                RDMA_MAX_INIT_DEPTH,
                st.initiator_depth.min(d.max_initiator_depth),
            );
            st.responder_resources = depth(
                p.map(|p| p.responder_resources),
                RDMA_MAX_RESP_RES,
                st.responder_resources.min(d.max_responder_resources),
            );
            (st.responder_resources, st.initiator_depth)
        };
        let ud = id.cm().qp_type == IBV_QPT_UD;
        if !ud {
            let over = MoveOverrides {
                max_dest_rd_atomic: Some(rr),
                max_rd_atomic: Some(depth),
                timeout: None,
            };
            id.move_qp_through(QpState::Rts, move_flags::FROM_INIT, over)?;
        }
        let param = id.conn_param(p, qp_num, srq);
        if let Err(e) = cm.accept(cm_id, &param) {
            id.qp_to_err();
            return Err(crate::ffi::errno_of(&e));
        }
        if ud {
            if lock(&id.st).sync {
                id.ack_held_event();
            }
            return Ok(());
        }
        id.complete()
    })
}

/// `rdma_reject`.
///
/// # Safety
///
/// `id` is live; `private_data` NULL or `len` readable bytes.
pub unsafe extern "C" fn rdma_reject(
    id: *mut rdma_cm_id,
    private_data: *const libc::c_void,
    private_data_len: u8,
) -> i32 {
    with_id("rdma_reject", id, |id| {
        let (_, cm, cm_id) = id.placed()?;
        let data = if private_data.is_null() {
            &[][..]
        } else {
            // SAFETY: the caller's buffer.
            unsafe {
                std::slice::from_raw_parts(private_data.cast::<u8>(), usize::from(private_data_len))
            }
        };
        cm.reject(cm_id, data).map_err(|e| crate::ffi::errno_of(&e))
    })
}

/// `rdma_reject_ece`: a reject (vrdma negotiates no ECE options).
///
/// # Safety
///
/// As `rdma_reject`.
pub unsafe extern "C" fn rdma_reject_ece(
    id: *mut rdma_cm_id,
    private_data: *const libc::c_void,
    private_data_len: u8,
) -> i32 {
    // SAFETY: forwarded.
    unsafe { rdma_reject(id, private_data, private_data_len) }
}

/// `rdma_establish`: the RTU of an active side without a QP.
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_establish(id: *mut rdma_cm_id) -> i32 {
    with_id("rdma_establish", id, |id| {
        if !id.cm().qp.is_null() {
            return Err(libc::EINVAL);
        }
        id.establish()
    })
}

/// `rdma_notify`: IBV_EVENT_COMM_EST establishes a passive side whose RTU
/// has not come; other events are EINVAL, as the kernel answers.
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_notify(id: *mut rdma_cm_id, event: u32) -> i32 {
    with_id("rdma_notify", id, |id| {
        if event != IBV_EVENT_COMM_EST {
            return Err(libc::EINVAL);
        }
        let (_, cm, cm_id) = id.placed()?;
        cm.establish(cm_id).map_err(|e| crate::ffi::errno_of(&e))
    })
}

/// `rdma_disconnect`: the QP to ERR, then the DREQ (or DREP).
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> i32 {
    with_id("rdma_disconnect", id, |id| {
        id.qp_to_err();
        let (_, cm, cm_id) = id.placed()?;
        cm.disconnect(cm_id).map_err(|e| crate::ffi::errno_of(&e))?;
        id.complete()
    })
}

/// `rdma_init_qp_attr`.
///
/// # Safety
///
/// `id` is live; `qp_attr` and `qp_attr_mask` writable.
pub unsafe extern "C" fn rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    qp_attr: *mut ibv_qp_attr,
    qp_attr_mask: *mut i32,
) -> i32 {
    with_id("rdma_init_qp_attr", id, |id| {
        non_null(qp_attr)?;
        non_null(qp_attr_mask)?;
        // SAFETY: the caller's writable structures.
        let (attr, mask) = unsafe { (&mut *qp_attr, &mut *qp_attr_mask) };
        let state = u8::try_from(attr.qp_state)
            .ok()
            .and_then(|s| QpState::try_from(s).ok())
            .ok_or(libc::EINVAL)?;
        let (a, m) = id.qp_attr(state)?;
        *attr = a;
        *mask = m as i32;
        Ok(())
    })
}

/// `rdma_set_option`: REUSEADDR and AFONLY hold as asked (vrdma's ports
/// have no TIME_WAIT to reuse, and its addresses are IPv4); TOS (a `u8`)
/// is the traffic class of the paths the ID connects — the IPv4 TOS byte
/// of both sides' packets, as the REQ carries it — and the ACK timeout (a
/// `u8`, RC IDs only) its QP's `timeout` at RTS, as Linux applies them;
/// IB paths are refused (ENOSYS) rather than ignored.
///
/// # Safety
///
/// `id` is live; `optval` holds `optlen` bytes.
pub unsafe extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    level: i32,
    optname: i32,
    optval: *mut libc::c_void,
    optlen: usize,
) -> i32 {
    with_id("rdma_set_option", id, |id| {
        non_null(optval)?;
        if level == RDMA_OPTION_ID as i32
            && (optname == RDMA_OPTION_ID_REUSEADDR as i32
                || optname == RDMA_OPTION_ID_AFONLY as i32)
        {
            return if optlen == size_of::<i32>() {
                Ok(())
            } else {
                Err(libc::EINVAL)
            };
        }
        let is = |name: u32| level == RDMA_OPTION_ID as i32 && optname == name as i32;
        if is(RDMA_OPTION_ID_TOS) || is(RDMA_OPTION_ID_ACK_TIMEOUT) {
            if optlen != size_of::<u8>() {
                return Err(libc::EINVAL);
            }
            // SAFETY: the caller's `optlen` (1) bytes at `optval`.
            let value = unsafe { optval.cast::<u8>().read() };
            let mut st = lock(&id.st);
            if is(RDMA_OPTION_ID_TOS) {
                st.tos = Some(value);
            } else {
                // Linux: RC (and XRC) IDs only; a 5-bit IB timeout.
                if id.cm().qp_type != IBV_QPT_RC || value > 31 {
                    return Err(libc::EINVAL);
                }
                st.ack_timeout = Some(value);
            }
            return Ok(());
        }
        tracing::warn!(level, optname, "rdma_set_option: not supported by vrdma");
        Err(libc::ENOSYS)
    })
}

/// `rdma_migrate_id`: the ID's events go to `channel` from now on (NULL:
/// a channel of its own, synchronous).
///
/// # Safety
///
/// `id` is live; `channel` NULL or live.
pub unsafe extern "C" fn rdma_migrate_id(
    id: *mut rdma_cm_id,
    channel: *mut rdma_event_channel,
) -> i32 {
    with_id("rdma_migrate_id", id, |our| {
        let was_sync = lock(&our.st).sync;
        if was_sync && channel.is_null() {
            return Err(libc::EINVAL);
        }
        let (new, sync) = if channel.is_null() {
            (Channel::create()?.cast::<rdma_event_channel>(), true)
        } else {
            (channel, false)
        };
        pump();
        let me = std::ptr::from_ref(our).cast_mut();
        {
            let _routes = lock(&ROUTES);
            // SAFETY: the ID's channel and the new one are live.
            let (old_ch, new_ch) = unsafe {
                (
                    Channel::from_raw(our.cm().channel)?,
                    Channel::from_raw(new)?,
                )
            };
            for p in old_ch.take_events_of(me) {
                new_ch.push(p);
            }
            if was_sync {
                our.ack_held_event();
            }
            let old = our.cm().channel;
            // SAFETY: as in `Id::place`.
            unsafe { (*me).cm_mut().channel = new };
            lock(&our.st).sync = sync;
            if was_sync {
                // SAFETY: the ID's own old channel, now unused.
                unsafe { super::channel::rdma_destroy_event_channel(old) };
            }
        }
        let mut c = lock(&our.counts);
        while c.acked < c.reported {
            c = our.acked.wait(c).unwrap_or_else(|e| e.into_inner());
        }
        Ok(())
    })
}

/// `rdma_get_request`: the next connect request of a synchronous listener,
/// with a QP when the listener was made by `rdma_create_ep` with one.
///
/// # Safety
///
/// `listen` is live; `id` writable.
pub unsafe extern "C" fn rdma_get_request(
    listen: *mut rdma_cm_id,
    id: *mut *mut rdma_cm_id,
) -> i32 {
    with_id("rdma_get_request", listen, |l| {
        non_null(id)?;
        if !lock(&l.st).sync {
            return Err(libc::EINVAL);
        }
        let me = std::ptr::from_ref(l).cast_mut();
        l.ack_held_event();
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        event::get_event(l.cm().channel, &mut ev)?;
        // SAFETY: an event just reported.
        let e = unsafe { &*ev };
        let fail = |errno| {
            // SAFETY: as above.
            unsafe { (*me).cm_mut().event = ev };
            Err(errno)
        };
        if e.event == RDMA_CM_EVENT_REJECTED {
            return fail(libc::ECONNREFUSED);
        }
        if e.status != 0 {
            return fail(e.status.abs());
        }
        if e.event != crate::abi::RDMA_CM_EVENT_CONNECT_REQUEST {
            return fail(libc::EINVAL);
        }
        let init = lock(&l.st).qp_init_attr;
        if let Some(mut attr) = init {
            if let Err(errno) = qp::create_qp(e.id, l.cm().pd, &mut attr) {
                return fail(errno);
            }
        }
        // SAFETY: the new ID is live; the caller's writable pointer.
        unsafe {
            (*e.id).event = ev;
            id.write(e.id);
        }
        Ok(())
    })
}

/// `rdma_get_src_port` (network order).
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    if id.is_null() {
        return 0;
    }
    // SAFETY: the caller's live ID; an IPv4 address (or zeros).
    unsafe { (*id).route.addr.__bindgen_anon_1.src_sin.sin_port }
}

/// `rdma_get_dst_port` (network order).
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    if id.is_null() {
        return 0;
    }
    // SAFETY: as above.
    unsafe { (*id).route.addr.__bindgen_anon_2.dst_sin.sin_port }
}
