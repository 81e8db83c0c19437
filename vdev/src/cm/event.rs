//! rdma_cm events as fixed-size records, and the queue of each owner (an
//! event channel of a context) with the eventfd that says events wait.

use std::collections::VecDeque;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::IdNum;

/// `enum rdma_cm_event_type`, with librdmacm's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum CmEventKind {
    AddrResolved = 0,
    AddrError = 1,
    RouteResolved = 2,
    RouteError = 3,
    ConnectRequest = 4,
    ConnectResponse = 5,
    ConnectError = 6,
    Unreachable = 7,
    Rejected = 8,
    Established = 9,
    Disconnected = 10,
    DeviceRemoval = 11,
    TimewaitExit = 15,
}

/// Largest private data an event carries (a REP's 196 bytes).
pub const EVENT_PRIVATE_DATA: usize = 196;

/// An address vector as `struct ibv_ah_attr` has it for RoCE (always a
/// GRH): what a UD event names its peer by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub sl: u8,
    pub port_num: u8,
}

/// One rdma_cm event, fixed in size as `struct rdma_cm_event` is: the
/// IDs, the kind, the status, and the union of `param.conn` and
/// `param.ud` flattened (fields of the other kind are zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmEvent {
    /// The CM ID the event is about (a new one for CONNECT_REQUEST).
    pub id: IdNum,
    /// For CONNECT_REQUEST: the listener it came through; else 0.
    pub listen_id: IdNum,
    pub kind: CmEventKind,
    /// 0, a REJ reason (REJECTED), a negative errno (UNREACHABLE:
    /// −ETIMEDOUT; ADDR_ERROR: −EHOSTUNREACH) or a SIDR status.
    pub status: i32,
    pub private_data: [u8; EVENT_PRIVATE_DATA],
    /// Bytes of `private_data` that belong to the message (the whole
    /// field of the message, as Linux reports it: 56, 196, 148, 180, 136).
    pub private_data_len: u8,
    /// `param.conn`, the receiver's view (resources swapped as rdma_cm
    /// swaps them).
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    /// `param.conn.qp_num` or `param.ud.qp_num`: the peer's QP.
    pub qp_num: u32,
    /// `param.ud.qkey`.
    pub qkey: u32,
    /// `param.ud.ah_attr`.
    pub ah_attr: AhAttr,
}

impl CmEvent {
    /// An event with no parameters.
    pub fn bare(id: IdNum, kind: CmEventKind, status: i32) -> CmEvent {
        CmEvent {
            id,
            listen_id: IdNum(0),
            kind,
            status,
            private_data: [0; EVENT_PRIVATE_DATA],
            private_data_len: 0,
            responder_resources: 0,
            initiator_depth: 0,
            flow_control: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            srq: 0,
            qp_num: 0,
            qkey: 0,
            ah_attr: AhAttr::default(),
        }
    }

    /// Sets the private data (cut to [`EVENT_PRIVATE_DATA`]).
    pub fn with_private_data(mut self, data: &[u8]) -> CmEvent {
        let n = data.len().min(EVENT_PRIVATE_DATA);
        if let (Some(dst), Some(src)) = (self.private_data.get_mut(..n), data.get(..n)) {
            dst.copy_from_slice(src);
        }
        // n ≤ 196.
        self.private_data_len = n as u8;
        self
    }

    /// The private data the message carried.
    pub fn private_data(&self) -> &[u8] {
        self.private_data
            .get(..usize::from(self.private_data_len))
            .unwrap_or(&[])
    }
}

/// Events an owner may have waiting; further ones are dropped (counted).
pub const MAX_QUEUED_EVENTS: usize = 1024;

/// The events of one owner and the eventfd signalled when one is queued.
#[derive(Debug)]
pub struct EventQueue {
    events: VecDeque<CmEvent>,
    notify: EventFd,
}

impl EventQueue {
    pub fn new() -> std::io::Result<EventQueue> {
        Ok(EventQueue {
            events: VecDeque::new(),
            notify: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// Queues `event` and signals the eventfd; false if the queue is full.
    pub fn push(&mut self, event: CmEvent) -> bool {
        if self.events.len() >= MAX_QUEUED_EVENTS {
            return false;
        }
        self.events.push_back(event);
        // A counter at its maximum already wakes the reader.
        let _ = self.notify.write(1);
        true
    }

    /// The oldest event, if any.
    pub fn pop(&mut self) -> Option<CmEvent> {
        self.events.pop_front()
    }

    /// Drops the waiting events about `id`.
    pub fn forget(&mut self, id: IdNum) {
        self.events.retain(|e| e.id != id);
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub fn notify(&self) -> &EventFd {
        &self.notify
    }
}
