//! The connection manager's side of one context: its CM channels (each a
//! [`CmOwner`] of the device's [`CmService`]), the `CM_*` control commands
//! mapped onto them (docs/device-spec.md §5.6), and the delivery of their
//! events into the buffers the driver posts on the CM event queue (§4).
//!
//! The request was copied out of guest memory once by `control.rs`; here
//! only that copy is decoded, and every field is checked before the
//! service sees it. A channel number names a channel of this context
//! only: another context's channel, or an ID of another channel, is
//! unknown (EINVAL), exactly as one that never existed.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use virtio_queue::{QueueOwnedT, Writer};
use vm_memory::GuestMemoryMmap;
use vrdma_spec::cm::{
    cm_flags, id_state, CmAddr, CmBindReq, CmChannelHandle, CmConnReq, CmCreateIdReq,
    CmEventRecord, CmIdInfo, CmIdReq, CmInitQpAttrReq, CmListenReq, CmQpAttrResp, CmRejectReq,
    CmResolveAddrReq, CM_EVENT_SIZE, CM_MAX_PRIVATE_DATA,
};
use vrdma_spec::control::{self, Opcode};
use vrdma_spec::verbs::{QpState, QpType};
use vrdma_spec::zerocopy::{FromZeros, IntoBytes};

use super::{decode, expect_empty, VerbError, VerbResult};
use crate::cm::{self, CmEvent, CmOwner, CmService, ConnParam, IdNum, IdState, PortSpace};

/// Channels one context may have open at once.
pub const MAX_CHANNELS: usize = 64;

/// The CM event queue's index on a device with `comp_vectors` completion
/// vectors, if the device can have one: the queue joins the vhost-user
/// worker's 64-bit queue mask, so it must be below 64 (up to 61 vectors).
pub fn cm_queue_index(comp_vectors: u16) -> Option<u16> {
    let index = vrdma_spec::cm_queue(comp_vectors);
    (u32::from(index) < u64::BITS).then_some(index)
}

/// Where the contexts of a device find its connection manager: set while
/// one runs (vdev starts it when the device registers with hostd).
#[derive(Debug, Clone, Default)]
pub struct CmSlot(Arc<Mutex<Option<Arc<CmService>>>>);

impl CmSlot {
    /// The running service, if any.
    pub fn get(&self) -> Option<Arc<CmService>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Publishes (or, with `None`, withdraws) the device's service.
    pub fn set(&self, service: Option<Arc<CmService>>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = service;
    }
}

/// Who watches the channels' eventfds for the context (the vhost-user
/// worker's epoll set): told when one opens and when it closes.
pub trait CmEventWatch: Send + Sync + std::fmt::Debug {
    fn watch(&self, fd: RawFd) -> std::io::Result<()>;
    fn unwatch(&self, fd: RawFd);
}

/// The CM side of one context.
#[derive(Debug)]
pub struct ContextCm {
    tenant: Arc<str>,
    slot: Option<CmSlot>,
    watch: Option<Arc<dyn CmEventWatch>>,
    channels: BTreeMap<u32, CmOwner>,
    next_channel: u32,
    /// Event buffers returned unused because they could not hold a record.
    bad_buffers: u64,
}

/// What one delivery pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    pub events: usize,
    pub bad_buffers: usize,
}

impl ContextCm {
    /// A context without channels; `slot` is `None` on a device without a
    /// connection manager (every CM command: ENODEV).
    pub fn new(tenant: Arc<str>, slot: Option<CmSlot>) -> ContextCm {
        ContextCm {
            tenant,
            slot,
            watch: None,
            channels: BTreeMap::new(),
            next_channel: 1,
            bad_buffers: 0,
        }
    }

    /// Whether the device has a connection manager (and a CM queue).
    pub fn enabled(&self) -> bool {
        self.slot.is_some()
    }

    /// Who is told of the channels' eventfds from now on.
    pub fn set_watch(&mut self, watch: Arc<dyn CmEventWatch>) {
        for owner in self.channels.values() {
            if let Err(e) = watch.watch(owner.event_fd()) {
                tracing::warn!(tenant = %self.tenant, error = %e, "Cannot watch a CM channel");
            }
        }
        self.watch = Some(watch);
    }

    /// Open channels.
    pub fn channels(&self) -> usize {
        self.channels.len()
    }

    /// Closes every channel (the context's reset or end): their IDs are
    /// destroyed (DREQ or REJ to peers), their waiting events dropped.
    pub fn close_all(&mut self) {
        let n = self.channels.len();
        for (_, owner) in std::mem::take(&mut self.channels) {
            self.close_owner(owner);
        }
        if n > 0 {
            tracing::info!(tenant = %self.tenant, channels = n, "CM channels closed");
        }
    }

    fn close_owner(&self, owner: CmOwner) {
        if let Some(w) = &self.watch {
            w.unwatch(owner.event_fd());
        }
        owner.close();
    }

    fn owner(&self, channel: u32) -> VerbResult<&CmOwner> {
        self.channels.get(&channel).ok_or(VerbError::NoObject {
            kind: "CM channel",
            handle: channel,
        })
    }

    /// What CM_INIT_QP_ATTR answers: the attributes and mask that move
    /// ID `id` of channel `channel`'s QP to `state` (INIT, RTR or RTS).
    pub fn qp_attr(&self, channel: u32, id: u32, state: QpState) -> VerbResult<CmQpAttrResp> {
        if self.slot.is_none() {
            return Err(VerbError::NoDevice("this device has no connection manager"));
        }
        if !matches!(state, QpState::Init | QpState::Rtr | QpState::Rts) {
            return Err(VerbError::Invalid(format!(
                "init_qp_attr for QP state {}",
                u8::from(state)
            )));
        }
        let attr = (self.owner(channel)?)
            .init_qp_attr(IdNum(id), state)
            .map_err(VerbError::Cm)?;
        Ok(qp_attr_resp(&attr))
    }

    /// Executes one `CM_*` command on its request payload (already of the
    /// opcode's exact length).
    pub fn execute(&mut self, opcode: Opcode, payload: &[u8]) -> VerbResult<Vec<u8>> {
        let Some(slot) = &self.slot else {
            return Err(VerbError::NoDevice("this device has no connection manager"));
        };
        match opcode {
            Opcode::CmOpenChannel => {
                expect_empty(payload)?;
                let service = slot.get().ok_or(VerbError::NoDevice(
                    "the connection manager is not running (no hostd)",
                ))?;
                if self.channels.len() >= MAX_CHANNELS {
                    // ENOMEM, as the service's own limits (not a tenant
                    // quota: nothing to report to hostd).
                    return Err(VerbError::Cm(cm::CmError::TooMany(
                        "CM channels of this context",
                    )));
                }
                let owner = service.open_owner().map_err(VerbError::Cm)?;
                if let Some(w) = &self.watch {
                    if let Err(e) = w.watch(owner.event_fd()) {
                        owner.close();
                        return Err(VerbError::Io(e));
                    }
                }
                let channel = self.next_channel;
                self.next_channel = self.next_channel.checked_add(1).unwrap_or(1);
                self.channels.insert(channel, owner);
                tracing::debug!(tenant = %self.tenant, channel, "CM channel opened");
                Ok(CmChannelHandle {
                    channel: channel.into(),
                    reserved: [0; 4],
                }
                .as_bytes()
                .to_vec())
            }
            Opcode::CmCloseChannel => {
                let req: CmChannelHandle = decode(payload)?;
                let channel = req.channel.get();
                let owner = self.channels.remove(&channel).ok_or(VerbError::NoObject {
                    kind: "CM channel",
                    handle: channel,
                })?;
                self.close_owner(owner);
                tracing::debug!(tenant = %self.tenant, channel, "CM channel closed");
                Ok(Vec::new())
            }
            Opcode::CmCreateId => {
                let req: CmCreateIdReq = decode(payload)?;
                let channel = req.channel.get();
                let owner = self.owner(channel)?;
                let ps = u16::try_from(req.port_space.get())
                    .ok()
                    .and_then(PortSpace::from_u16)
                    .ok_or_else(|| {
                        VerbError::Invalid(format!("port space {:#x}", req.port_space.get()))
                    })?;
                let qp_type = match req.qp_type {
                    0 => None,
                    t => match QpType::try_from(t) {
                        Ok(t @ (QpType::Rc | QpType::Ud)) => Some(t),
                        _ => return Err(VerbError::Invalid(format!("CM QP type {t}"))),
                    },
                };
                let id = owner.create_id(ps, qp_type).map_err(VerbError::Cm)?;
                Ok(CmIdReq {
                    channel: channel.into(),
                    id: id.0.into(),
                }
                .as_bytes()
                .to_vec())
            }
            Opcode::CmBindAddr => {
                let req: CmBindReq = decode(payload)?;
                let owner = self.owner(req.channel.get())?;
                let bound = owner
                    .bind_addr(IdNum(req.id.get()), socket(&req.addr))
                    .map_err(VerbError::Cm)?;
                Ok(cm_addr(bound).as_bytes().to_vec())
            }
            Opcode::CmListen => {
                let req: CmListenReq = decode(payload)?;
                let owner = self.owner(req.channel.get())?;
                owner
                    .listen(IdNum(req.id.get()), req.backlog.get())
                    .map_err(VerbError::Cm)?;
                Ok(Vec::new())
            }
            Opcode::CmResolveAddr => {
                let req: CmResolveAddrReq = decode(payload)?;
                let owner = self.owner(req.channel.get())?;
                let flags = req.flags.get();
                if flags & !cm_flags::SRC_VALID != 0 {
                    return Err(VerbError::Invalid(format!("resolve flags {flags:#x}")));
                }
                let src = (flags & cm_flags::SRC_VALID != 0).then(|| socket(&req.src));
                owner
                    .resolve_addr(IdNum(req.id.get()), src, socket(&req.dst))
                    .map_err(VerbError::Cm)?;
                Ok(Vec::new())
            }
            Opcode::CmConnect | Opcode::CmAccept => {
                let req: CmConnReq = decode(payload)?;
                let owner = self.owner(req.channel.get())?;
                let param = conn_param(&req)?;
                let id = IdNum(req.id.get());
                if opcode == Opcode::CmConnect {
                    owner.connect(id, &param)
                } else {
                    owner.accept(id, &param)
                }
                .map_err(VerbError::Cm)?;
                Ok(Vec::new())
            }
            Opcode::CmReject => {
                let req: CmRejectReq = decode(payload)?;
                let owner = self.owner(req.channel.get())?;
                let data = private_data(&req.private_data, req.private_data_len.get())?;
                owner
                    .reject(IdNum(req.id.get()), data)
                    .map_err(VerbError::Cm)?;
                Ok(Vec::new())
            }
            Opcode::CmInitQpAttr => {
                let req: CmInitQpAttrReq = decode(payload)?;
                let state = match u8::try_from(req.qp_state.get()).map(QpState::try_from) {
                    Ok(Ok(s)) => s,
                    _ => {
                        return Err(VerbError::Invalid(format!(
                            "init_qp_attr for QP state {}",
                            req.qp_state.get()
                        )))
                    }
                };
                let attr = self.qp_attr(req.channel.get(), req.id.get(), state)?;
                Ok(attr.as_bytes().to_vec())
            }
            Opcode::CmResolveRoute
            | Opcode::CmEstablish
            | Opcode::CmDisconnect
            | Opcode::CmDestroyId
            | Opcode::CmQueryId => {
                let req: CmIdReq = decode(payload)?;
                let owner = self.owner(req.channel.get())?;
                let id = IdNum(req.id.get());
                let done = match opcode {
                    Opcode::CmResolveRoute => owner.resolve_route(id),
                    Opcode::CmEstablish => owner.establish(id),
                    Opcode::CmDisconnect => owner.disconnect(id),
                    Opcode::CmDestroyId => owner.destroy_id(id),
                    _ => {
                        let info = owner.query(id).map_err(VerbError::Cm)?;
                        return Ok(id_info(&info).as_bytes().to_vec());
                    }
                };
                done.map_err(VerbError::Cm)?;
                Ok(Vec::new())
            }
            other => Err(VerbError::Invalid(format!("{other:?} is no CM command"))),
        }
    }

    /// Resets the channels' eventfds (level-triggered in the worker's
    /// epoll set): what is queued stays queued, and an event queued after
    /// this makes them readable again. Called before every look at the
    /// queue, also when the driver has not set it up, so that waiting
    /// events never keep the worker spinning.
    pub fn clear_signals(&self) {
        for owner in self.channels.values() {
            clear_eventfd(owner.event_fd());
        }
    }

    /// Moves waiting events into the buffers the driver posted on the CM
    /// event queue, one record per buffer, channel by channel in turn;
    /// events stay in their channel's queue while no buffer is posted. A
    /// buffer too small for a record (or with device-readable parts
    /// only) is returned with used length 0 and no event taken. Clears
    /// the channels' eventfds first, so that an event queued after this
    /// pass makes them readable again.
    pub fn deliver<Q: QueueOwnedT>(&mut self, mem: &GuestMemoryMmap, queue: &mut Q) -> Delivered {
        let mut done = Delivered::default();
        self.clear_signals();
        let mut progress = true;
        while progress {
            progress = false;
            for (&channel, owner) in &self.channels {
                let Some(chain) = queue.pop_descriptor_chain(mem) else {
                    return done;
                };
                let head = chain.head_index();
                if head >= queue.size() {
                    // No used entry can name it: skipped.
                    self.bad_buffers += 1;
                    done.bad_buffers += 1;
                    tracing::warn!(tenant = %self.tenant, head, "CM event queue entry names a descriptor beyond the queue; skipped");
                    progress = true;
                    continue;
                }
                let mut writer = match Writer::new(mem, chain) {
                    Ok(w) if w.available_bytes() >= CM_EVENT_SIZE => w,
                    _ => {
                        self.bad_buffers += 1;
                        done.bad_buffers += 1;
                        tracing::warn!(tenant = %self.tenant, head, bad = self.bad_buffers,
                            "CM event buffer refused: fewer than {CM_EVENT_SIZE} writable bytes in guest memory");
                        if let Err(e) = queue.add_used(mem, head, 0) {
                            tracing::warn!(tenant = %self.tenant, error = %e, "Cannot return a CM event buffer");
                        }
                        progress = true;
                        continue;
                    }
                };
                let event = match owner.get_event() {
                    Ok(Some(event)) => event,
                    Ok(None) | Err(_) => {
                        // No event for this channel: the buffer is the
                        // next one's.
                        queue.go_to_previous_position();
                        continue;
                    }
                };
                let record = event_record(channel, &event);
                let len = match std::io::Write::write_all(&mut writer, record.as_bytes()) {
                    Ok(()) => CM_EVENT_SIZE as u32,
                    Err(e) => {
                        tracing::warn!(tenant = %self.tenant, error = %e, channel,
                            "CM event lost: its buffer left guest memory");
                        writer.bytes_written() as u32
                    }
                };
                if let Err(e) = queue.add_used(mem, head, len) {
                    tracing::warn!(tenant = %self.tenant, error = %e, "Cannot return a CM event buffer");
                }
                tracing::debug!(tenant = %self.tenant, channel, kind = ?event.kind, id = event.id.0,
                    "CM event delivered");
                done.events += 1;
                progress = true;
            }
        }
        done
    }
}

impl Drop for ContextCm {
    fn drop(&mut self) {
        self.close_all();
    }
}

/// Reads (and so resets) a non-blocking eventfd; nothing to read is fine.
fn clear_eventfd(fd: RawFd) {
    let mut value = 0u64;
    // SAFETY: `fd` is the open, non-blocking eventfd of a channel this
    // context holds (it lives as long as its owner, which outlives this
    // call); the read writes at most 8 bytes into `value`.
    let _ = unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
}

fn socket(a: &CmAddr) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(a.ip), a.port.get())
}

fn cm_addr(a: SocketAddrV4) -> CmAddr {
    CmAddr {
        ip: a.ip().octets(),
        port: a.port().into(),
        reserved: [0; 2],
    }
}

/// The first `len` bytes of `field`; more than the field holds: EINVAL.
fn private_data(field: &[u8; CM_MAX_PRIVATE_DATA], len: u16) -> VerbResult<&[u8]> {
    field.get(..usize::from(len)).ok_or_else(|| {
        VerbError::Invalid(format!("private_data_len {len} > {CM_MAX_PRIVATE_DATA}"))
    })
}

fn conn_param(req: &CmConnReq) -> VerbResult<ConnParam> {
    let flags = req.flags.get();
    let tclass_bits = 0xff << cm_flags::TRAFFIC_CLASS_SHIFT;
    let known = cm_flags::PSN_VALID | cm_flags::TRAFFIC_CLASS_VALID | tclass_bits;
    if flags & !known != 0
        || (flags & cm_flags::TRAFFIC_CLASS_VALID == 0 && flags & tclass_bits != 0)
    {
        return Err(VerbError::Invalid(format!("connect flags {flags:#x}")));
    }
    let qp_num = req.qp_num.get();
    if qp_num > 0xff_ffff {
        return Err(VerbError::Invalid(format!("QP number {qp_num:#x}")));
    }
    let psn = req.starting_psn.get();
    if flags & cm_flags::PSN_VALID != 0 && psn > 0xff_ffff {
        return Err(VerbError::Invalid(format!("starting PSN {psn:#x}")));
    }
    Ok(ConnParam {
        private_data: private_data(&req.private_data, req.private_data_len.get())?.to_vec(),
        responder_resources: req.responder_resources,
        initiator_depth: req.initiator_depth,
        flow_control: req.flow_control != 0,
        retry_count: req.retry_count,
        rnr_retry_count: req.rnr_retry_count,
        srq: req.srq != 0,
        qp_num,
        starting_psn: (flags & cm_flags::PSN_VALID != 0).then_some(psn),
        qkey: req.qkey.get(),
        traffic_class: (flags & cm_flags::TRAFFIC_CLASS_VALID != 0)
            .then_some((flags >> cm_flags::TRAFFIC_CLASS_SHIFT) as u8),
    })
}

fn ah_attr(a: &cm::AhAttr) -> control::AhAttr {
    control::AhAttr {
        dgid: a.dgid,
        flow_label: a.flow_label.into(),
        sgid_index: a.sgid_index,
        hop_limit: a.hop_limit,
        traffic_class: a.traffic_class,
        is_global: 1,
        sl: a.sl,
        port_num: a.port_num,
        ..control::AhAttr::default()
    }
}

fn qp_attr_resp(a: &cm::QpAttr) -> CmQpAttrResp {
    let attr = control::QpAttr {
        qp_state: a.qp_state.into(),
        path_mtu: a.path_mtu,
        qkey: a.qkey.into(),
        rq_psn: a.rq_psn.into(),
        sq_psn: a.sq_psn.into(),
        dest_qp_num: a.dest_qp_num.into(),
        qp_access_flags: a.qp_access_flags.into(),
        ah_attr: ah_attr(&a.ah_attr),
        pkey_index: a.pkey_index.into(),
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        ..control::QpAttr::default()
    };
    CmQpAttrResp {
        reserved: 0.into(),
        attr_mask: a.mask.into(),
        attr,
    }
}

fn id_info(i: &cm::IdInfo) -> CmIdInfo {
    let state = match i.state {
        IdState::Idle => id_state::IDLE,
        IdState::AddrBound => id_state::ADDR_BOUND,
        IdState::AddrResolved => id_state::ADDR_RESOLVED,
        IdState::RouteResolved => id_state::ROUTE_RESOLVED,
        IdState::Listen => id_state::LISTEN,
        IdState::Connect => id_state::CONNECT,
        IdState::Established => id_state::ESTABLISHED,
        IdState::Disconnect => id_state::DISCONNECT,
    };
    let mut out = CmIdInfo {
        id: i.id.0.into(),
        port_space: u32::from(i.ps as u16).into(),
        qp_type: i.qp_type.into(),
        state,
        listen_id: i.listener.map_or(0, |l| l.0).into(),
        src: cm_addr(i.src),
        dst: cm_addr(i.dst),
        remote_qpn: i.remote_qpn.into(),
        remote_qkey: i.remote_qkey.into(),
        ..CmIdInfo::default()
    };
    if let Some(r) = &i.route {
        out.route_valid = 1;
        out.sgid = r.sgid;
        out.dgid = r.dgid;
        out.pkey = r.pkey.into();
        out.mtu = r.mtu;
        out.traffic_class = r.traffic_class;
        out.hop_limit = r.hop_limit;
        out.sl = r.sl;
        out.packet_life_time = r.packet_life_time;
        out.flow_label = r.flow_label.into();
    }
    out
}

/// The record of `event` of channel `channel`.
pub fn event_record(channel: u32, e: &CmEvent) -> CmEventRecord {
    let mut r = CmEventRecord::new_zeroed();
    r.kind = (e.kind as u32).into();
    r.status = e.status.into();
    r.channel = channel.into();
    r.id = e.id.0.into();
    r.listen_id = e.listen_id.0.into();
    r.qp_num = e.qp_num.into();
    r.qkey = e.qkey.into();
    r.responder_resources = e.responder_resources;
    r.initiator_depth = e.initiator_depth;
    r.flow_control = e.flow_control;
    r.retry_count = e.retry_count;
    r.rnr_retry_count = e.rnr_retry_count;
    r.srq = e.srq;
    let data = e.private_data();
    let n = data.len().min(CM_MAX_PRIVATE_DATA);
    r.private_data[..n].copy_from_slice(&data[..n]);
    // n ≤ 256.
    r.private_data_len = (n as u16).into();
    if e.ah_attr != cm::AhAttr::default() {
        r.ah_attr = ah_attr(&e.ah_attr);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno(cm: &mut ContextCm, op: Opcode, payload: &[u8]) -> i32 {
        cm.execute(op, payload)
            .map(|_| 0)
            .unwrap_or_else(|e| e.errno())
    }

    #[test]
    fn the_cm_queue_follows_the_event_queues_within_the_worker_mask() {
        assert_eq!(cm_queue_index(1), Some(3));
        assert_eq!(cm_queue_index(61), Some(63));
        assert_eq!(cm_queue_index(62), None);
        assert_eq!(cm_queue_index(64), None);
    }

    #[test]
    fn a_device_without_a_cm_answers_enodev() {
        let mut cm = ContextCm::new(Arc::from("t1"), None);
        assert!(!cm.enabled());
        assert_eq!(errno(&mut cm, Opcode::CmOpenChannel, &[]), libc::ENODEV);
        let req = CmIdReq::default();
        assert_eq!(
            errno(&mut cm, Opcode::CmQueryId, req.as_bytes()),
            libc::ENODEV
        );
    }

    #[test]
    fn a_cm_that_does_not_run_has_no_channels_and_no_ids() {
        let mut cm = ContextCm::new(Arc::from("t1"), Some(CmSlot::default()));
        assert!(cm.enabled());
        assert_eq!(errno(&mut cm, Opcode::CmOpenChannel, &[]), libc::ENODEV);
        let req = CmIdReq {
            channel: 1.into(),
            id: 1.into(),
        };
        for op in [Opcode::CmQueryId, Opcode::CmDestroyId, Opcode::CmEstablish] {
            assert_eq!(errno(&mut cm, op, req.as_bytes()), libc::EINVAL, "{op:?}");
        }
        let close = CmChannelHandle {
            channel: 1.into(),
            reserved: [0; 4],
        };
        assert_eq!(
            errno(&mut cm, Opcode::CmCloseChannel, close.as_bytes()),
            libc::EINVAL
        );
        // A payload of the wrong size never reaches a decoder's success.
        assert_eq!(errno(&mut cm, Opcode::CmQueryId, &[0; 3]), libc::EINVAL);
    }

    #[test]
    fn connection_parameters_are_checked() {
        let mut req = CmConnReq::new_zeroed();
        req.qp_num = 0x12_3456.into();
        req.private_data_len = 3.into();
        req.private_data[..3].copy_from_slice(b"abc");
        let p = conn_param(&req).expect("valid");
        assert_eq!(
            (p.qp_num, p.private_data.as_slice()),
            (0x12_3456, &b"abc"[..])
        );
        assert_eq!(p.starting_psn, None);
        req.flags = cm_flags::PSN_VALID.into();
        req.starting_psn = 0xff_ffff.into();
        assert_eq!(
            conn_param(&req).expect("valid").starting_psn,
            Some(0xff_ffff)
        );
        let refused = |f: &dyn Fn(&mut CmConnReq)| {
            let mut r = req;
            f(&mut r);
            conn_param(&r).map(|_| ()).map_err(|e| e.errno())
        };
        assert_eq!(
            refused(&|r| r.private_data_len = 257.into()),
            Err(libc::EINVAL)
        );
        assert_eq!(
            refused(&|r| r.qp_num = 0x100_0000.into()),
            Err(libc::EINVAL)
        );
        assert_eq!(
            refused(&|r| r.starting_psn = 0x100_0000.into()),
            Err(libc::EINVAL)
        );
        assert_eq!(refused(&|r| r.flags = 0x4.into()), Err(libc::EINVAL));
        // A traffic class only with its flag.
        assert_eq!(refused(&|r| r.flags = 0x2000.into()), Err(libc::EINVAL));
        req.flags = (cm_flags::TRAFFIC_CLASS_VALID | 0x20 << cm_flags::TRAFFIC_CLASS_SHIFT).into();
        assert_eq!(conn_param(&req).expect("valid").traffic_class, Some(0x20));
        req.flags = 0.into();
        assert_eq!(conn_param(&req).expect("valid").traffic_class, None);
    }

    #[test]
    fn an_event_becomes_its_record() {
        let mut e =
            CmEvent::bare(IdNum(5), cm::CmEventKind::ConnectRequest, 0).with_private_data(&[7; 56]);
        e.listen_id = IdNum(2);
        e.qp_num = 0x77;
        e.responder_resources = 4;
        e.initiator_depth = 2;
        let r = event_record(9, &e);
        assert_eq!(r.kind.get(), vrdma_spec::cm::event_kind::CONNECT_REQUEST);
        assert_eq!((r.channel.get(), r.id.get(), r.listen_id.get()), (9, 5, 2));
        assert_eq!(
            (r.qp_num.get(), r.responder_resources, r.initiator_depth),
            (0x77, 4, 2)
        );
        assert_eq!(r.private_data(), &[7; 56]);
        assert_eq!(r.ah_attr.is_global, 0, "no UD address");
        let ud = CmEvent {
            ah_attr: cm::AhAttr {
                dgid: [1; 16],
                hop_limit: 64,
                port_num: 1,
                ..cm::AhAttr::default()
            },
            ..CmEvent::bare(IdNum(6), cm::CmEventKind::Established, 0)
        };
        let r = event_record(1, &ud);
        assert_eq!((r.ah_attr.is_global, r.ah_attr.dgid), (1, [1; 16]));
        assert_eq!(r.status.get(), 0);
    }
}
