//! The device's connection manager (rdma_cm) from the driver's side: CM
//! channels ([`CmChannel`], an `rdma_event_channel` with its CM IDs) over
//! the `CM_*` control commands, and the CM event queue (virtqueue
//! `DeviceAttr::cm_queue`) whose buffers the device fills with one event
//! record each (docs/device-spec.md §4, §5.6).
//!
//! The driver keeps the queue's buffers posted. Whoever asks a channel for
//! an event first takes what the device returned (acknowledging the
//! queue's interrupt before reading it), decodes a copy of each record,
//! hands it to its channel's queue and posts the buffer again. A channel's
//! [`CmChannel::event_fd`] is an epoll descriptor over the channel's own
//! eventfd (signalled while events wait in its queue) and the CM queue's
//! interrupt, so it is readable while the channel has events or the device
//! may have new ones.

use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
pub use vrdma_spec::cm::move_flags;
use vrdma_spec::cm::{
    cm_flags, CmAddr, CmBindReq, CmChannelHandle, CmConnReq, CmCreateIdReq, CmEventRecord,
    CmIdInfo, CmIdReq, CmInitQpAttrReq, CmListenReq, CmMoveQpReq, CmQpAttrResp, CmRejectReq,
    CmResolveAddrReq, CM_EVENT_SIZE, CM_MAX_PRIVATE_DATA, MOVE_KEEP,
};
use vrdma_spec::control::{AhAttr, Opcode, QpAttr};
use vrdma_spec::verbs::{QpState, QpType};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

pub use vrdma_spec::cm::{event_kind, port_space};

use crate::device::Device;
use crate::dma::DmaBuf;
use crate::error::{Error, Result};
use crate::virtqueue::SplitQueue;

/// Buffers the driver keeps posted on the CM event queue (at most).
pub(crate) const CM_QUEUE_SIZE: u16 = 32;

/// Events a channel keeps for its reader; more are dropped (logged).
pub const MAX_CHANNEL_EVENTS: usize = 4096;

/// A CM ID of a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CmId(pub u32);

/// [`CmChannel::move_qp`]'s replacements for the CM's attributes (`None`:
/// the CM's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoveOverrides {
    /// RTR's `max_dest_rd_atomic`.
    pub max_dest_rd_atomic: Option<u8>,
    /// RTS's `max_rd_atomic`.
    pub max_rd_atomic: Option<u8>,
    /// RTS's `timeout`.
    pub timeout: Option<u8>,
}

pub use vrdma_spec::cm::ConnParam;

/// One CM event, decoded from a copy of its record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmEvent {
    /// An [`event_kind`] value (`enum rdma_cm_event_type`).
    pub kind: u32,
    pub status: i32,
    pub id: CmId,
    /// CONNECT_REQUEST: the listener.
    pub listen_id: Option<CmId>,
    /// `param.conn` (the receiver's view) or `param.ud`'s QPN and Q_Key.
    pub qp_num: u32,
    pub qkey: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    /// `param.ud.ah_attr`, for UD events.
    pub ah_attr: Option<AhAttr>,
    /// As Linux reports it: the message's whole private-data field.
    pub private_data: Vec<u8>,
}

impl CmEvent {
    /// Decodes a record the device wrote (`len` bytes of it).
    fn decode(bytes: &[u8]) -> Result<(u32, CmEvent)> {
        if bytes.len() != CM_EVENT_SIZE {
            return Err(Error::Protocol("CM event record of the wrong length"));
        }
        let r = CmEventRecord::read_from_bytes(bytes)
            .map_err(|_| Error::Protocol("CM event record"))?;
        let n = usize::from(r.private_data_len.get());
        if n > CM_MAX_PRIVATE_DATA {
            return Err(Error::Protocol("CM event private data length"));
        }
        let id = r.id.get();
        if id == 0 {
            return Err(Error::Protocol("CM event without an ID"));
        }
        let listen = r.listen_id.get();
        let event = CmEvent {
            kind: r.kind.get(),
            status: r.status.get(),
            id: CmId(id),
            listen_id: (listen != 0).then_some(CmId(listen)),
            qp_num: r.qp_num.get(),
            qkey: r.qkey.get(),
            responder_resources: r.responder_resources,
            initiator_depth: r.initiator_depth,
            flow_control: r.flow_control,
            retry_count: r.retry_count,
            rnr_retry_count: r.rnr_retry_count,
            srq: r.srq,
            ah_attr: (r.ah_attr.is_global != 0).then_some(r.ah_attr),
            private_data: r.private_data[..n].to_vec(),
        };
        Ok((r.channel.get(), event))
    }
}

/// The events waiting for one channel, and its eventfd.
#[derive(Debug)]
struct ChannelQueue {
    events: VecDeque<CmEvent>,
    notify: Arc<EventFd>,
    dropped: u64,
}

/// The CM event queue: its virtqueue, buffers, and the channels' queues.
#[derive(Debug)]
pub(crate) struct CmQueue {
    pub(crate) index: u16,
    vq: SplitQueue,
    /// The event buffers.
    bufs: Vec<DmaBuf>,
    /// Which buffer each posted descriptor head holds.
    posted: Vec<Option<usize>>,
    channels: HashMap<u32, ChannelQueue>,
    /// The device broke the queue's protocol: it is not read again.
    broken: bool,
}

impl CmQueue {
    /// The CM event queue `index` over `vq` with a buffer for each of its
    /// descriptors (the buffers are posted by [`CmQueue::post_all`]).
    pub(crate) fn new(index: u16, vq: SplitQueue, bufs: Vec<DmaBuf>) -> CmQueue {
        let posted = vec![None; usize::from(vq.size())];
        CmQueue {
            index,
            vq,
            bufs,
            posted,
            channels: HashMap::new(),
            broken: false,
        }
    }

    /// Posts every buffer (at open).
    pub(crate) fn post_all(&mut self) -> Result<()> {
        for i in 0..self.bufs.len() {
            self.post(i)?;
        }
        self.vq.enable_interrupts();
        Ok(())
    }

    /// Posts buffer `i`, device-writable.
    fn post(&mut self, i: usize) -> Result<()> {
        let addr = self.bufs[i].device_addr();
        let head = self.vq.add_chain(&[], &[(addr, CM_EVENT_SIZE as u32)])?;
        self.posted[usize::from(head)] = Some(i);
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Device {
    /// Takes the records the device returned on the CM event queue into
    /// their channels' queues and posts the buffers again. The interrupt
    /// is acknowledged before the used ring is read, so that a record
    /// written after this read raises a new one.
    fn pump_cm(&self, cm: &mut CmQueue) -> Result<()> {
        if cm.broken {
            return Err(Error::Protocol("CM event queue"));
        }
        self.transport().acknowledge(cm.index)?;
        let mut reposted = false;
        loop {
            while let Some((head, len)) = cm.vq.pop_used()? {
                let Some(i) = cm.posted.get_mut(usize::from(head)).and_then(Option::take) else {
                    cm.broken = true;
                    return Err(Error::Protocol("CM event queue returned an unknown buffer"));
                };
                let buf = &cm.bufs[i];
                let mut copy = [0u8; CM_EVENT_SIZE];
                buf.read_at(0, &mut copy);
                let decoded = match len as usize {
                    // Returned unused (the device found it unfit): no event.
                    0 => None,
                    CM_EVENT_SIZE => match CmEvent::decode(&copy) {
                        Ok(e) => Some(e),
                        Err(e) => {
                            tracing::warn!(error = %e, "Malformed CM event record dropped");
                            None
                        }
                    },
                    other => {
                        tracing::warn!(len = other, "CM event record of the wrong length dropped");
                        None
                    }
                };
                if let Some((channel, event)) = decoded {
                    match cm.channels.get_mut(&channel) {
                        Some(q) if q.events.len() < MAX_CHANNEL_EVENTS => {
                            q.events.push_back(event);
                            let _ = q.notify.write(1);
                        }
                        Some(q) => {
                            q.dropped += 1;
                            tracing::warn!(
                                channel,
                                dropped = q.dropped,
                                "CM channel's event queue is full: event dropped"
                            );
                        }
                        None => tracing::debug!(channel, "CM event for a closed channel dropped"),
                    }
                }
                // Zeroed again so a short write cannot pass old bytes on.
                buf.write_at(0, &[0u8; CM_EVENT_SIZE]);
                cm.post(i)?;
                reposted = true;
            }
            if !cm.vq.enable_interrupts() {
                break;
            }
        }
        if reposted && cm.vq.should_notify() {
            self.transport().notify(cm.index)?;
        }
        Ok(())
    }

    fn cm_queue(&self) -> Result<&Mutex<CmQueue>> {
        // A device without a CM: ENODEV, as the device answers CM commands.
        self.cm().ok_or(Error::Device(libc::ENODEV))
    }
}

/// An `rdma_event_channel` of the device: its CM IDs and their events.
/// Dropping it closes the channel (the device destroys its IDs).
#[derive(Debug)]
pub struct CmChannel {
    dev: Arc<Device>,
    channel: u32,
    notify: Arc<EventFd>,
    epoll: OwnedFd,
}

impl CmChannel {
    /// Opens a channel (`rdma_create_event_channel`). ENODEV: the device
    /// has no connection manager (or it does not run).
    pub(crate) fn open(dev: Arc<Device>) -> Result<CmChannel> {
        let cm = dev.cm_queue()?;
        let notify = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|source| Error::Os {
            what: "create a CM channel's eventfd",
            source,
        })?);
        let epoll = new_epoll(&[
            Some(notify.as_raw_fd()),
            dev.transport()
                .interrupt_fd(lock(cm).index)
                .map(|fd| fd.as_raw_fd()),
        ])?;
        let handle: CmChannelHandle = dev.command(Opcode::CmOpenChannel, &[])?;
        let channel = handle.channel.get();
        lock(cm).channels.insert(
            channel,
            ChannelQueue {
                events: VecDeque::new(),
                notify: notify.clone(),
                dropped: 0,
            },
        );
        Ok(CmChannel {
            dev,
            channel,
            notify,
            epoll,
        })
    }

    /// The device's number of this channel.
    pub fn channel(&self) -> u32 {
        self.channel
    }

    /// `rdma_create_id`: `ps` a [`port_space`] value; `qp_type` only for
    /// the IB port space (else `None`).
    pub fn create_id(&self, ps: u32, qp_type: Option<QpType>) -> Result<CmId> {
        let req = CmCreateIdReq {
            channel: self.channel.into(),
            port_space: ps.into(),
            qp_type: qp_type.map_or(0, u8::from),
            reserved: [0; 7],
        };
        let resp: CmIdReq = self.dev.command(Opcode::CmCreateId, req.as_bytes())?;
        Ok(CmId(resp.id.get()))
    }

    /// `rdma_bind_addr`; returns the address bound (a port allocated for
    /// port 0).
    pub fn bind_addr(&self, id: CmId, addr: SocketAddrV4) -> Result<SocketAddrV4> {
        let req = CmBindReq {
            channel: self.channel.into(),
            id: id.0.into(),
            addr: cm_addr(addr),
        };
        let bound: CmAddr = self.dev.command(Opcode::CmBindAddr, req.as_bytes())?;
        Ok(socket(&bound))
    }

    /// `rdma_listen`.
    pub fn listen(&self, id: CmId, backlog: u32) -> Result<()> {
        let req = CmListenReq {
            channel: self.channel.into(),
            id: id.0.into(),
            backlog: backlog.into(),
            reserved: [0; 4],
        };
        self.dev.command_no_reply(Opcode::CmListen, req.as_bytes())
    }

    /// `rdma_resolve_addr` (ADDR_RESOLVED or ADDR_ERROR follows).
    pub fn resolve_addr(
        &self,
        id: CmId,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
        timeout: Duration,
    ) -> Result<()> {
        let req = CmResolveAddrReq {
            channel: self.channel.into(),
            id: id.0.into(),
            src: src.map(cm_addr).unwrap_or_default(),
            dst: cm_addr(dst),
            timeout_ms: u32::try_from(timeout.as_millis())
                .unwrap_or(u32::MAX)
                .into(),
            flags: if src.is_some() {
                cm_flags::SRC_VALID
            } else {
                0
            }
            .into(),
        };
        self.dev
            .command_no_reply(Opcode::CmResolveAddr, req.as_bytes())
    }

    /// `rdma_resolve_route` (ROUTE_RESOLVED follows).
    pub fn resolve_route(&self, id: CmId) -> Result<()> {
        self.id_command(Opcode::CmResolveRoute, id)
    }

    /// `rdma_connect`.
    pub fn connect(&self, id: CmId, param: &ConnParam) -> Result<()> {
        let req = self.conn_req(id, param)?;
        self.dev.command_no_reply(Opcode::CmConnect, req.as_bytes())
    }

    /// `rdma_accept`.
    pub fn accept(&self, id: CmId, param: &ConnParam) -> Result<()> {
        let req = self.conn_req(id, param)?;
        self.dev.command_no_reply(Opcode::CmAccept, req.as_bytes())
    }

    /// `rdma_reject`.
    pub fn reject(&self, id: CmId, private_data: &[u8]) -> Result<()> {
        if private_data.len() > CM_MAX_PRIVATE_DATA {
            return Err(Error::InvalidArgument("private data longer than 256 bytes"));
        }
        let mut req = CmRejectReq::new_zeroed();
        req.channel = self.channel.into();
        req.id = id.0.into();
        // At most 256.
        req.private_data_len = (private_data.len() as u16).into();
        req.private_data[..private_data.len()].copy_from_slice(private_data);
        self.dev.command_no_reply(Opcode::CmReject, req.as_bytes())
    }

    /// `rdma_establish`.
    pub fn establish(&self, id: CmId) -> Result<()> {
        self.id_command(Opcode::CmEstablish, id)
    }

    /// `rdma_disconnect`.
    pub fn disconnect(&self, id: CmId) -> Result<()> {
        self.id_command(Opcode::CmDisconnect, id)
    }

    /// `rdma_destroy_id`.
    pub fn destroy_id(&self, id: CmId) -> Result<()> {
        self.id_command(Opcode::CmDestroyId, id)
    }

    /// `rdma_init_qp_attr`: the attributes and the `ibv_qp_attr_mask` that
    /// move the ID's QP to `state` (INIT, RTR or RTS), for
    /// [`crate::QueuePair::modify`].
    pub fn init_qp_attr(&self, id: CmId, state: QpState) -> Result<(QpAttr, u32)> {
        let req = CmInitQpAttrReq {
            channel: self.channel.into(),
            id: id.0.into(),
            qp_state: u32::from(u8::from(state)).into(),
            reserved: [0; 4],
        };
        let resp: CmQpAttrResp = self.dev.command(Opcode::CmInitQpAttr, req.as_bytes())?;
        Ok((resp.attr, resp.attr_mask.get()))
    }

    /// CM_MOVE_QP: QP `qpn` moved with the ID's attributes through each
    /// state up to `state` (from INIT with [`move_flags::FROM_INIT`], else
    /// from RTR), `over` replacing the CM's RTR `max_dest_rd_atomic`, RTS
    /// `max_rd_atomic` and RTS `timeout` where given; one command for what
    /// takes rdma_cm's library two per state. Answers the RTR step's
    /// attributes and mask (else the last step's).
    pub fn move_qp(
        &self,
        id: CmId,
        qpn: u32,
        state: QpState,
        flags: u8,
        over: MoveOverrides,
    ) -> Result<(QpAttr, u32)> {
        let keep = |v: Option<u8>| v.unwrap_or(MOVE_KEEP);
        let req = CmMoveQpReq {
            qpn: qpn.into(),
            channel: self.channel.into(),
            id: id.0.into(),
            qp_state: u8::from(state),
            flags,
            max_dest_rd_atomic: keep(over.max_dest_rd_atomic),
            max_rd_atomic: keep(over.max_rd_atomic),
            timeout: keep(over.timeout),
            reserved: [0; 7],
        };
        let resp: CmQpAttrResp = self.dev.command(Opcode::CmMoveQp, req.as_bytes())?;
        Ok((resp.attr, resp.attr_mask.get()))
    }

    /// The ID's port space, state, addresses and route.
    pub fn query(&self, id: CmId) -> Result<CmIdInfo> {
        let req = CmIdReq {
            channel: self.channel.into(),
            id: id.0.into(),
        };
        self.dev.command(Opcode::CmQueryId, req.as_bytes())
    }

    /// `rdma_get_cm_event` without blocking: the next event, if any.
    pub fn get_event(&self) -> Result<Option<CmEvent>> {
        let cm = self.dev.cm_queue()?;
        let mut cm = lock(cm);
        self.dev.pump_cm(&mut cm)?;
        let Some(q) = cm.channels.get_mut(&self.channel) else {
            return Ok(None);
        };
        let event = q.events.pop_front();
        if q.events.is_empty() {
            // Nothing waits: the eventfd is not readable any more (a
            // counter already read is fine).
            let _ = self.notify.read();
        }
        Ok(event)
    }

    /// `rdma_get_cm_event`, waiting up to `timeout` for an event.
    pub fn wait_event(&self, timeout: Duration) -> Result<Option<CmEvent>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.get_event()? {
                return Ok(Some(e));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            poll_in(self.epoll.as_fd(), left)?;
        }
    }

    /// A descriptor readable while this channel has events waiting or the
    /// device may have returned new ones (`rdma_event_channel.fd`): poll
    /// it, then call [`CmChannel::get_event`] until it returns `None`.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }

    fn id_command(&self, opcode: Opcode, id: CmId) -> Result<()> {
        let req = CmIdReq {
            channel: self.channel.into(),
            id: id.0.into(),
        };
        self.dev.command_no_reply(opcode, req.as_bytes())
    }

    fn conn_req(&self, id: CmId, p: &ConnParam) -> Result<CmConnReq> {
        if p.private_data.len() > CM_MAX_PRIVATE_DATA {
            return Err(Error::InvalidArgument("private data longer than 256 bytes"));
        }
        let mut req = CmConnReq::new_zeroed();
        req.channel = self.channel.into();
        req.id = id.0.into();
        req.qp_num = p.qp_num.into();
        req.starting_psn = p.starting_psn.unwrap_or(0).into();
        req.qkey = p.qkey.into();
        req.responder_resources = p.responder_resources;
        req.initiator_depth = p.initiator_depth;
        req.flow_control = u8::from(p.flow_control);
        req.retry_count = p.retry_count;
        req.rnr_retry_count = p.rnr_retry_count;
        req.srq = u8::from(p.srq);
        // At most 256.
        req.private_data_len = (p.private_data.len() as u16).into();
        let psn = if p.starting_psn.is_some() {
            cm_flags::PSN_VALID
        } else {
            0
        };
        let tclass = p.traffic_class.map_or(0, |tc| {
            cm_flags::TRAFFIC_CLASS_VALID | u32::from(tc) << cm_flags::TRAFFIC_CLASS_SHIFT
        });
        req.flags = (psn | tclass).into();
        req.private_data[..p.private_data.len()].copy_from_slice(&p.private_data);
        Ok(req)
    }
}

impl Drop for CmChannel {
    fn drop(&mut self) {
        if let Ok(cm) = self.dev.cm_queue() {
            lock(cm).channels.remove(&self.channel);
        }
        let req = CmChannelHandle {
            channel: self.channel.into(),
            reserved: [0; 4],
        };
        if let Err(e) = self
            .dev
            .command_no_reply(Opcode::CmCloseChannel, req.as_bytes())
        {
            tracing::warn!(channel = self.channel, error = %e, "Cannot close a CM channel");
        }
    }
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

/// An epoll descriptor watching `fds` for input.
fn new_epoll(fds: &[Option<i32>]) -> Result<OwnedFd> {
    let os = |what| move |source| Error::Os { what, source };
    // SAFETY: epoll_create1 takes no pointers; the result is checked.
    let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if raw < 0 {
        return Err(os("create an epoll descriptor")(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `raw` is the new descriptor epoll_create1 returned; nothing
    // else owns it.
    let epoll = unsafe { OwnedFd::from_raw_fd(raw) };
    for fd in fds.iter().flatten() {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 0,
        };
        // SAFETY: `epoll` and `fd` are open descriptors; `ev` is a valid
        // epoll_event the call only reads.
        let rc = unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, *fd, &mut ev) };
        if rc != 0 {
            return Err(os("watch a descriptor")(std::io::Error::last_os_error()));
        }
    }
    Ok(epoll)
}

/// Waits until `fd` is readable or `timeout` passes; EINTR is a wake-up.
fn poll_in(fd: BorrowedFd<'_>, timeout: Duration) -> Result<()> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // Round up so a sub-millisecond rest does not spin.
    let ms = i32::try_from(timeout.as_millis().saturating_add(1)).unwrap_or(i32::MAX);
    // SAFETY: `pfd` is one valid pollfd that outlives the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Os {
                what: "wait for a CM event",
                source: e,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: u32, id: u32, data: &[u8]) -> CmEventRecord {
        let mut r = CmEventRecord::new_zeroed();
        r.kind = kind.into();
        r.status = (-110).into();
        r.channel = 3.into();
        r.id = id.into();
        r.listen_id = 9.into();
        r.qp_num = 0x123.into();
        r.private_data_len = (data.len() as u16).into();
        r.private_data[..data.len()].copy_from_slice(data);
        r
    }

    #[test]
    fn a_record_decodes_into_its_channel_and_event() {
        let r = record(event_kind::CONNECT_REQUEST, 7, b"hello");
        let (channel, e) = CmEvent::decode(r.as_bytes()).expect("decodes");
        assert_eq!(channel, 3);
        assert_eq!(e.kind, event_kind::CONNECT_REQUEST);
        assert_eq!((e.id, e.listen_id), (CmId(7), Some(CmId(9))));
        assert_eq!((e.status, e.qp_num), (-110, 0x123));
        assert_eq!(e.private_data, b"hello");
        assert_eq!(e.ah_attr, None, "no GRH: no UD address");
    }

    #[test]
    fn malformed_records_are_refused() {
        let good = record(event_kind::ESTABLISHED, 7, &[]);
        let bytes = good.as_bytes();
        assert!(matches!(
            CmEvent::decode(&bytes[..CM_EVENT_SIZE - 1]),
            Err(Error::Protocol(_))
        ));
        let mut long = good;
        long.private_data_len = 257.into();
        assert!(matches!(
            CmEvent::decode(long.as_bytes()),
            Err(Error::Protocol(_))
        ));
        let nobody = record(event_kind::ESTABLISHED, 0, &[]);
        assert!(matches!(
            CmEvent::decode(nobody.as_bytes()),
            Err(Error::Protocol(_))
        ));
    }
}
