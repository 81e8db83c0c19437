//! Completion channels and asynchronous events.
//!
//! The device writes events into its event rings (one per completion
//! vector) and raises the vector's interrupt: a COMPLETION names an armed
//! CQ, the others are asynchronous (CQ overrun, QP fatal, port active).
//! Each open context runs one event thread that sleeps on the vectors'
//! interrupt fds (and a stop eventfd) and routes every event: a completion
//! to the channel of its CQ, the rest (CQ error, QP fatal, SRQ limit, last
//! WQE of an SRQ's QP, port active) to the context's asynchronous queue.
//!
//! A channel's `fd` (and the context's `async_fd`) is an eventfd in
//! semaphore mode whose count is at least the number of queued events, so
//! the application can `poll()` it like rdma-core's kernel fd, make it
//! non-blocking, and `ibv_get_cq_event` blocks in `read()` exactly as
//! rdma-core's does.

use std::collections::VecDeque;
use std::ffi::{c_int, c_uint, c_void};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use vrdma_guest_driver::DeviceEvent;

use crate::abi::{
    ibv_async_event, ibv_comp_channel, ibv_context, ibv_cq, ibv_event_type, ibv_qp, ibv_srq,
    IBV_EVENT_CQ_ERR, IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR, IBV_EVENT_QP_FATAL,
    IBV_EVENT_QP_LAST_WQE_REACHED, IBV_EVENT_SRQ_LIMIT_REACHED,
};
use crate::context::{Ctx, Shared};
use crate::ffi::{guard, minus_one_verb, non_null, ptr_verb, VResult};
use crate::objects::{lock, Channel, Cq, Wrapper};

/// A new eventfd (close-on-exec) with extra `flags`.
pub(crate) fn eventfd(flags: c_int) -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor this function owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds 1 to an eventfd's counter.
pub(crate) fn signal(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we own.
    let n = unsafe { libc::write(fd.as_raw_fd(), std::ptr::from_ref(&one).cast(), 8) };
    if n != 8 {
        tracing::error!(error = %io::Error::last_os_error(), "Cannot signal an eventfd");
    }
}

/// Reads an eventfd (blocking unless it is non-blocking): Ok(()) when a
/// count was taken, the OS error otherwise (EAGAIN, EINTR, ...).
fn take(fd: c_int) -> io::Result<()> {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a valid u64.
    let n = unsafe { libc::read(fd, std::ptr::from_mut(&mut v).cast(), 8) };
    if n == 8 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A queue of events with a semaphore eventfd counting them.
struct EventQueue<T> {
    fd: OwnedFd,
    queue: std::sync::Mutex<VecDeque<T>>,
}

impl<T: Copy> EventQueue<T> {
    fn new() -> io::Result<Self> {
        Ok(Self {
            fd: eventfd(libc::EFD_SEMAPHORE)?,
            queue: std::sync::Mutex::default(),
        })
    }

    fn push(&self, item: T) {
        lock(&self.queue).push_back(item);
        signal(&self.fd);
    }

    /// Waits (unless the fd is non-blocking) for the next event, the way
    /// rdma-core reads its event fd.
    fn pop(&self) -> io::Result<T> {
        loop {
            take(self.fd.as_raw_fd())?;
            // A count without an event belongs to an event taken back
            // (its CQ was destroyed): read again.
            if let Some(item) = lock(&self.queue).pop_front() {
                return Ok(item);
            }
        }
    }
}

/// The state of one completion channel.
pub(crate) struct ChannelState {
    events: EventQueue<usize>,
}

impl ChannelState {
    fn new() -> io::Result<Self> {
        Ok(Self {
            events: EventQueue::new()?,
        })
    }

    pub(crate) fn fd(&self) -> c_int {
        self.events.fd.as_raw_fd()
    }

    /// Queues a completion event of `cq` (an application `ibv_cq *`).
    fn push(&self, cq: usize) {
        self.events.push(cq);
    }

    /// Drops the queued events of a CQ being destroyed.
    pub(crate) fn purge(&self, cq: usize) {
        lock(&self.events.queue).retain(|&c| c != cq);
    }
}

/// The context's asynchronous events: (event type, element).
pub(crate) struct AsyncQueue {
    events: EventQueue<(ibv_event_type, usize)>,
}

impl AsyncQueue {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self {
            events: EventQueue::new()?,
        })
    }

    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.events.fd
    }
}

/// The event thread of a context: routes device events until `stop`.
pub(crate) fn dispatch(shared: &Shared) {
    let vectors = shared.dev.num_comp_vectors();
    loop {
        // Drain first: an event written after the drain raises its
        // vector's interrupt, which the poll below sees. Interrupts are
        // acknowledged before the next drain, so none is lost.
        for v in 0..vectors {
            loop {
                match shared.dev.get_event(v, Some(Duration::ZERO)) {
                    Ok(Some(event)) => route(shared, event),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::error!(error = %e, vector = v, "Cannot read the event ring");
                        // The device is unusable: wait for the stop only.
                        wait_readable(&[shared.stop.as_raw_fd()], -1);
                        return;
                    }
                }
            }
        }
        let interrupts: Vec<(u16, c_int)> = (0..vectors)
            .filter_map(|v| shared.dev.event_fd(v).map(|fd| (v, fd.as_raw_fd())))
            .collect();
        let mut fds = vec![shared.stop.as_raw_fd()];
        fds.extend(interrupts.iter().map(|&(_, fd)| fd));
        // A transport without an interrupt fd for some vector (none in
        // vrdma's two transports) is drained every few milliseconds.
        let timeout_ms = if interrupts.len() == usize::from(vectors) {
            -1
        } else {
            EVENT_POLL_MS
        };
        let ready = wait_readable(&fds, timeout_ms);
        if ready.first() == Some(&true) {
            return;
        }
        for (&(vector, _), _) in interrupts.iter().zip(&ready[1..]).filter(|(_, &r)| r) {
            // Reset the interrupt; the drain above reads the events.
            if let Err(e) = shared.dev.acknowledge_event(vector) {
                tracing::warn!(error = %e, vector, "Cannot acknowledge an interrupt");
            }
        }
    }
}

/// How often event rings without an interrupt fd are drained.
const EVENT_POLL_MS: c_int = 5;

/// Waits until one of `fds` is readable, or `timeout_ms` passed (-1:
/// forever); returns which are.
fn wait_readable(fds: &[c_int], timeout_ms: c_int) -> Vec<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `pfds` is a valid array of `pfds.len()` pollfds.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
        if n > 0 || (n == 0 && timeout_ms >= 0) {
            return pfds.iter().map(|p| p.revents != 0).collect();
        }
        let e = io::Error::last_os_error();
        if n < 0 && e.kind() != io::ErrorKind::Interrupted {
            tracing::error!(error = %e, "poll failed in the event thread");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn route(shared: &Shared, event: DeviceEvent) {
    tracing::trace!(?event, "Device event");
    match event {
        DeviceEvent::Completion { cqn } => {
            let cqs = lock(&shared.cqs);
            match cqs.get(&cqn) {
                Some(route) => match &route.channel {
                    Some(channel) => channel.push(route.cq),
                    None => tracing::debug!(cqn, "Completion event of a CQ without a channel"),
                },
                None => tracing::debug!(cqn, "Completion event of an unknown CQ"),
            }
        }
        DeviceEvent::CqError { cqn } => {
            if let Some(route) = lock(&shared.cqs).get(&cqn) {
                shared
                    .async_events
                    .events
                    .push((IBV_EVENT_CQ_ERR, route.cq));
            }
        }
        DeviceEvent::QpFatal { qpn } => {
            let qps = shared.qps.read().unwrap_or_else(|e| e.into_inner());
            if let Some(route) = qps.get(&qpn) {
                shared
                    .async_events
                    .events
                    .push((IBV_EVENT_QP_FATAL, route.qp));
            }
        }
        DeviceEvent::LastWqeReached { qpn } => {
            let qps = shared.qps.read().unwrap_or_else(|e| e.into_inner());
            if let Some(route) = qps.get(&qpn) {
                shared
                    .async_events
                    .events
                    .push((IBV_EVENT_QP_LAST_WQE_REACHED, route.qp));
            }
        }
        DeviceEvent::SrqLimit { srqn } => {
            if let Some(&srq) = lock(&shared.srqs).get(&srqn) {
                shared
                    .async_events
                    .events
                    .push((IBV_EVENT_SRQ_LIMIT_REACHED, srq));
            }
        }
        DeviceEvent::PortActive | DeviceEvent::PortError => {
            if let Some(event_type) = port_event(event) {
                // The device's one port.
                shared.async_events.events.push((event_type, 1));
            }
        }
        DeviceEvent::Unknown { kind, object } => {
            tracing::warn!(kind, object, "Unknown device event dropped");
        }
    }
}

/// The `ibv_get_async_event` type of a port event of the device.
fn port_event(event: DeviceEvent) -> Option<ibv_event_type> {
    match event {
        DeviceEvent::PortActive => Some(IBV_EVENT_PORT_ACTIVE),
        DeviceEvent::PortError => Some(IBV_EVENT_PORT_ERR),
        _ => None,
    }
}

/// `ibv_create_comp_channel`.
///
/// # Safety
///
/// `context` is an open context.
pub unsafe extern "C" fn ibv_create_comp_channel(
    context: *mut ibv_context,
) -> *mut ibv_comp_channel {
    ptr_verb("ibv_create_comp_channel", || {
        // SAFETY: the caller passes an open context.
        unsafe { Ctx::from_ibv(context)? };
        let state =
            Arc::new(ChannelState::new().map_err(|e| e.raw_os_error().unwrap_or(libc::EMFILE))?);
        let channel = Box::new(Channel {
            ibv: ibv_comp_channel {
                context,
                fd: state.fd(),
                refcnt: 0,
            },
            state,
        });
        Ok(channel.into_raw())
    })
}

/// `ibv_destroy_comp_channel`: `EBUSY` while CQs use the channel.
///
/// # Safety
///
/// `channel` is a live channel from [`ibv_create_comp_channel`].
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    crate::ffi::int_verb("ibv_destroy_comp_channel", || {
        // SAFETY: the caller passes a live channel.
        let ch = unsafe { Channel::from_raw(channel)? };
        // The channel's CQs hold its state.
        if Arc::strong_count(&ch.state) > 1 {
            return Err(libc::EBUSY);
        }
        // SAFETY: a live channel box, no longer used by any CQ.
        unsafe { Channel::free(channel) };
        Ok(())
    })
}

/// `ibv_get_cq_event`: waits for the next completion event of a CQ bound
/// to `channel` (or fails with EAGAIN when the fd is non-blocking).
///
/// # Safety
///
/// `channel` is a live channel; `cq` and `cq_context` are writable.
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    minus_one_verb("ibv_get_cq_event", || {
        non_null(cq)?;
        non_null(cq_context)?;
        // SAFETY: the caller passes a live channel.
        let ch = unsafe { Channel::from_raw(channel)? };
        let got = ch
            .state
            .events
            .pop()
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        let ibv_cq = got as *mut ibv_cq;
        // SAFETY: routed CQs are live: a CQ leaves the route table and its
        // queued events are purged before it is freed.
        let our = unsafe { Cq::from_raw(ibv_cq)? };
        our.events.delivered();
        // SAFETY: the caller passes writable out-pointers.
        unsafe {
            *cq = ibv_cq;
            *cq_context = our.ibv.cq_context;
        }
        Ok(())
    })
}

/// `ibv_ack_cq_events`.
///
/// # Safety
///
/// `cq` is a live CQ.
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) {
    guard("ibv_ack_cq_events", (), || {
        // SAFETY: the caller passes a live CQ.
        if let Ok(our) = unsafe { Cq::from_raw(cq) } {
            let total = our.events.ack(u64::from(nevents));
            // SAFETY: a field of the live CQ the application reads
            // (rdma-core keeps the count there too).
            unsafe { (*cq).comp_events_completed = total as u32 };
        }
    });
}

/// Registers a new CQ for event routing.
pub(crate) fn add_cq(
    shared: &Shared,
    cqn: u32,
    cq: *mut ibv_cq,
    channel: Option<Arc<ChannelState>>,
) {
    lock(&shared.cqs).insert(
        cqn,
        crate::context::CqRoute {
            cq: cq as usize,
            channel,
        },
    );
}

/// Unregisters a destroyed CQ and drops its queued events.
pub(crate) fn remove_cq(shared: &Shared, cqn: u32, cq: *mut ibv_cq) {
    let route = lock(&shared.cqs).remove(&cqn);
    if let Some(channel) = route.and_then(|r| r.channel) {
        channel.purge(cq as usize);
    }
    // Asynchronous events naming it go too.
    lock(&shared.async_events.events.queue)
        .retain(|&(t, e)| !(t == IBV_EVENT_CQ_ERR && e == cq as usize));
}

/// Drops the queued asynchronous events of a destroyed QP.
pub(crate) fn remove_qp(shared: &Shared, qp: *mut ibv_qp) {
    lock(&shared.async_events.events.queue).retain(|&(t, e)| {
        !(matches!(t, IBV_EVENT_QP_FATAL | IBV_EVENT_QP_LAST_WQE_REACHED) && e == qp as usize)
    });
}

/// Registers a new SRQ for its limit event.
pub(crate) fn add_srq(shared: &Shared, srqn: u32, srq: *mut ibv_srq) {
    lock(&shared.srqs).insert(srqn, srq as usize);
}

/// Unregisters a destroyed SRQ and drops its queued events.
pub(crate) fn remove_srq(shared: &Shared, srqn: u32, srq: *mut ibv_srq) {
    lock(&shared.srqs).remove(&srqn);
    lock(&shared.async_events.events.queue)
        .retain(|&(t, e)| !(t == IBV_EVENT_SRQ_LIMIT_REACHED && e == srq as usize));
}

/// `ibv_get_async_event`: waits for the next asynchronous event (CQ error,
/// QP fatal, port active).
///
/// # Safety
///
/// `context` is an open context; `event` is writable.
pub unsafe extern "C" fn ibv_get_async_event(
    context: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    minus_one_verb("ibv_get_async_event", || {
        non_null(event)?;
        // SAFETY: the caller passes an open context.
        let ctx = unsafe { Ctx::from_ibv(context)? };
        let (event_type, element) = ctx
            .shared
            .async_events
            .events
            .pop()
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        let mut out = ibv_async_event {
            event_type,
            ..Default::default()
        };
        match event_type {
            IBV_EVENT_CQ_ERR => out.element.cq = element as *mut ibv_cq,
            IBV_EVENT_QP_FATAL | IBV_EVENT_QP_LAST_WQE_REACHED => {
                out.element.qp = element as *mut ibv_qp;
            }
            IBV_EVENT_SRQ_LIMIT_REACHED => out.element.srq = element as *mut ibv_srq,
            _ => out.element.port_num = c_int::try_from(element).unwrap_or(1),
        }
        // SAFETY: the caller passes a writable event.
        unsafe { *event = out };
        Ok(())
    })
}

/// `ibv_ack_async_event`: nothing to release (destroying an object does
/// not wait for its asynchronous events).
///
/// # Safety
///
/// `event` is NULL or an event from [`ibv_get_async_event`].
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    let _ = event;
}

/// Checks the arguments shared by verbs that take a channel: `VResult` of
/// the channel's state, if any.
///
/// # Safety
///
/// `channel` is NULL or a live channel.
pub(crate) unsafe fn channel_state(
    channel: *mut ibv_comp_channel,
) -> VResult<Option<Arc<ChannelState>>> {
    if channel.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded.
    let ch = unsafe { Channel::from_raw(channel)? };
    Ok(Some(Arc::clone(&ch.state)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_queue_counts_events_in_its_fd() {
        let q = EventQueue::<usize>::new().unwrap();
        q.push(7);
        q.push(8);
        assert_eq!(q.pop().unwrap(), 7);
        // Taking an event back leaves a count without an event: skipped.
        lock(&q.queue).clear();
        q.push(9);
        assert_eq!(q.pop().unwrap(), 9);
        // Nothing left: a non-blocking fd says EAGAIN.
        // SAFETY: fcntl on an fd the queue owns.
        unsafe {
            let fd = q.fd.as_raw_fd();
            libc::fcntl(
                fd,
                libc::F_SETFL,
                libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
            );
        }
        assert_eq!(q.pop().unwrap_err().raw_os_error(), Some(libc::EAGAIN));
    }

    #[test]
    fn port_events_map_to_their_ibverbs_types() {
        assert_eq!(
            port_event(DeviceEvent::PortActive),
            Some(IBV_EVENT_PORT_ACTIVE)
        );
        assert_eq!(port_event(DeviceEvent::PortError), Some(IBV_EVENT_PORT_ERR));
        assert_eq!(port_event(DeviceEvent::QpFatal { qpn: 1 }), None);
    }

    #[test]
    fn wait_readable_reports_which() {
        let a = eventfd(0).unwrap();
        let b = eventfd(0).unwrap();
        signal(&b);
        assert_eq!(
            wait_readable(&[a.as_raw_fd(), b.as_raw_fd()], -1),
            vec![false, true]
        );
    }
}
