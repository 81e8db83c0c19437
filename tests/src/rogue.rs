//! A compromised vdev: it speaks hostd's protocol directly (control
//! messages, shared memory, its physical queues' rings), sending whatever
//! it likes, the way a vdev taken over by its guest could. hostd must treat
//! it like any hostile peer.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::channel::Channel;
use vrdma_hostd_protocol::entries::{PhysCqe, PhysWqe};
use vrdma_hostd_protocol::messages::{Request, Response, Welcome, PROTOCOL_VERSION};
use vrdma_hostd_protocol::shm::{QueueLayout, Ring, SharedMapping};

/// A device registered with hostd by hand.
#[derive(Debug)]
pub struct RogueVdev {
    channel: Channel,
    pub welcome: Welcome,
    pub layout: QueueLayout,
    /// The granted physical queues' shared memory, in grant order.
    pub queues: Vec<SharedMapping>,
    doorbell: EventFd,
    /// Kept open: closing it is no message to hostd.
    _completions: File,
    _notifications: File,
}

/// How hostd answered a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Ok,
    Refused(i32),
    /// hostd closed the connection (or it broke).
    Gone,
}

impl RogueVdev {
    /// [`RogueVdev::hello`], tried again every 2 ms for up to 5 s while
    /// hostd refuses with one of `transient` (errnos that go away once it
    /// has seen devices close, which it does asynchronously).
    pub fn hello_retrying(
        socket: &Path,
        tenant: &str,
        device: &str,
        transient: &[i32],
    ) -> Result<Self, i32> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match Self::hello(socket, tenant, device) {
                Err(errno) if transient.contains(&errno) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                result => return result,
            }
        }
    }

    /// Connects to hostd at `socket` and says Hello as `device` of
    /// `tenant`; `Err(errno)` when hostd refuses.
    pub fn hello(socket: &Path, tenant: &str, device: &str) -> Result<Self, i32> {
        let channel = Channel::connect(socket).expect("connect to hostd");
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            tenant: tenant.into(),
            device: device.into(),
        };
        let (response, mut files): (Response, Vec<File>) =
            channel.call(&hello, &[]).expect("hostd answers Hello");
        let welcome = match response {
            Response::Welcome(w) => *w,
            Response::Refused { errno, .. } => return Err(errno),
            Response::Ok => panic!("hostd answered Ok to Hello"),
        };
        assert_eq!(
            files.len(),
            welcome.queues.len() + 3,
            "Welcome carries a memfd per queue and three more descriptors"
        );
        let notifications = files.pop().expect("notification channel");
        let completions = files.pop().expect("completion eventfd");
        let doorbell = files.pop().expect("doorbell eventfd");
        let grant = welcome.queues.first().expect("a granted queue");
        let layout = QueueLayout::new(grant.sq_depth, grant.cq_depth);
        let queues = files
            .into_iter()
            .map(|f| SharedMapping::map(f, 0, layout.bytes() as u64).expect("map a queue"))
            .collect();
        // SAFETY: hostd sent this descriptor as its doorbell eventfd; it is
        // ours now and EventFd takes ownership.
        let doorbell = unsafe { EventFd::from_raw_fd(doorbell.into_raw_fd()) };
        Ok(RogueVdev {
            channel,
            welcome,
            layout,
            queues,
            doorbell,
            _completions: completions,
            _notifications: notifications,
        })
    }

    /// The LID hostd assigned.
    pub fn lid(&self) -> u16 {
        self.welcome.lid
    }

    /// The physical QP number of granted queue `q`.
    pub fn pqp(&self, q: usize) -> u32 {
        self.welcome.queues[q].pqp
    }

    /// Sends `request` with `fds` and returns hostd's answer.
    pub fn call(&self, request: &Request, fds: &[RawFd]) -> Answer {
        match self.channel.call::<_, Response>(request, fds) {
            Ok((Response::Ok, _)) => Answer::Ok,
            Ok((Response::Refused { errno, .. }, _)) => Answer::Refused(errno),
            Ok((Response::Welcome(_), _)) => panic!("hostd answered Welcome to {request:?}"),
            // Closed, or reset while hostd shut a failed device down.
            Err(_) => Answer::Gone,
        }
    }

    /// Adds `file` as memory slot `slot` (`len` bytes from its start).
    pub fn add_memory(&self, slot: u32, file: &File, len: u64) -> Answer {
        self.call(
            &Request::AddMemory {
                slot,
                gpa: 0x1000_0000 * u64::from(slot + 1),
                len,
                file_offset: 0,
            },
            &[file.as_raw_fd()],
        )
    }

    /// Writes `wqe` into queue `q`'s submission ring and rings the doorbell.
    pub fn post(&self, q: usize, wqe: &PhysWqe) {
        let ring =
            Ring::<PhysWqe>::new(&self.queues[q], self.layout.sq).expect("submission ring fits");
        assert!(ring.push(wqe).expect("ring intact"), "submission ring full");
        let _ = self.doorbell.write(1);
    }

    /// The next completion of queue `q`, waiting up to `within`.
    pub fn completion(&self, q: usize, within: Duration) -> Option<PhysCqe> {
        let ring =
            Ring::<PhysCqe>::new(&self.queues[q], self.layout.cq).expect("completion ring fits");
        let deadline = Instant::now() + within;
        loop {
            if let Some(cqe) = ring.pop().expect("completion ring intact") {
                return Some(cqe);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Overwrites the producer index of queue `q`'s submission ring.
    pub fn corrupt_submission_ring(&self, q: usize, producer: u32) {
        self.queues[q].write(self.layout.sq.offset, &producer.to_le_bytes());
        let _ = self.doorbell.write(1);
    }
}
