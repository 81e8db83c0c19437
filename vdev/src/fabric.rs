//! vdev's link to hostd, the host's NIC: registration, then the device's
//! memory, keys, doorbell, event rings, CQs and QPs over the control
//! channel (hostd protocol 3). hostd reads the guest's rings itself; vdev
//! only tells it where they are and hands it the eventfds the driver
//! notifies and is interrupted through.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Weak};

use vrdma_hostd_protocol::channel::{Channel, ChannelError};
use vrdma_hostd_protocol::messages::{
    AhSetup, ContextKey, Journal, MadIn, MadOut, MrRegistration, Notification, PortLinkLayer,
    QpModify, QpSetup, Record, Request, Response, SrqSetup, TenantPolicy, Welcome,
    PROTOCOL_VERSION,
};

use crate::seccomp::{Role, Threads};

/// Why talking to hostd failed.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    #[error("Cannot reach hostd at {path}")]
    Connect {
        path: String,
        #[source]
        source: ChannelError,
    },
    #[error("hostd channel failed")]
    Channel(#[from] ChannelError),
    #[error("hostd refused: {reason}")]
    Refused { errno: i32, reason: String },
    #[error("hostd answered {0:?} where another answer was expected")]
    Unexpected(Box<Response>),
    #[error("hostd sent {got} descriptors, {want} expected")]
    Descriptors { got: usize, want: usize },
    #[error("hostd assigned keys {lkey:#x}/{rkey:#x}, which are 0, equal or in use")]
    Keys { lkey: u32, rkey: u32 },
    #[error("The context's registration was ended")]
    Closed,
    #[error("hostd handed over to a new hostd while the request was under way")]
    HandedOver,
}

impl FabricError {
    /// The errno to hand a verb's caller.
    pub fn errno(&self) -> i32 {
        match self {
            FabricError::Refused { errno, .. } => *errno,
            _ => libc::EIO,
        }
    }
}

/// Answers hostd may owe on the main channel at most before a posted
/// request waits for them ([`Fabric::post_mad`]).
const MAX_OWED: u32 = 64;

/// The main channel, and how many answers hostd still owes on it for
/// requests sent without waiting ([`Fabric::post_mad`]): whoever sends the
/// next request reads them first, so every answer meets its request.
#[derive(Debug)]
struct MainChannel {
    channel: Channel,
    owed: u32,
}

/// A registered vdev on hostd.
#[derive(Debug)]
pub struct Fabric {
    channel: Mutex<MainChannel>,
    /// Posted MADs hostd refused (their answers came later).
    mads_refused: std::sync::atomic::AtomicU64,
    /// hostd's socket, the tenant and the device name, to register again
    /// with a restarted hostd ([`Fabric::reconnect`]).
    path: PathBuf,
    tenant: String,
    device: String,
    /// The LID hostd assigned this device (it names the device; on an
    /// InfiniBand port it is the port's LID).
    pub lid: u16,
    /// The link layer of the device's port, as hostd's host has it.
    pub link_layer: PortLinkLayer,
    /// The GID hostd assigned this device: its port's GID 0, what peers
    /// connect to.
    pub gid: [u8; 16],
    /// Its port's active MTU in bytes, as hostd's network allows: a hostd
    /// that comes back with another `ip_mtu` may change it.
    active_mtu: std::sync::atomic::AtomicU32,
    /// Physical QPs of hostd's NIC the device's virtual QPs share.
    pub physical_queues: u32,
    /// The tenant's policy as hostd sent it at registration.
    pub policy: TenantPolicy,
    /// hostd's notifications (policy reloads); taken by the listener thread.
    notifications: Mutex<Option<Channel>>,
    /// This end of the notification channel again, for the journal: hostd
    /// reads what comes on it before the context's next request and when
    /// the context ends, so a journal message wakes no thread of hostd's
    /// (a connection's setup journals six commands).
    journal_out: Mutex<Option<Channel>>,
    /// vdev ended the registration ([`Fabric::close`]): the notification
    /// channel's end is then expected, not hostd going away.
    closed: AtomicBool,
    /// A handover under way, and how many times the context registered
    /// again; `moved` is signalled when either changes.
    link: Mutex<LinkState>,
    moved: std::sync::Condvar,
}

/// What [`Fabric`] knows of its registration's moves between hostds.
#[derive(Debug, Default)]
struct LinkState {
    /// The token the hostd that hands over gave this context
    /// ([`Notification::Handover`]), until the context registers with the
    /// new one.
    token: Option<String>,
    /// Registrations since the first ([`Fabric::reconnect`]).
    generation: u64,
}

/// How long a request whose channel failed waits for hostd's word that it
/// hands over (which arrives on the notification channel, read by another
/// thread) before the failure counts as hostd gone.
const HANDOVER_WORD: std::time::Duration = std::time::Duration::from_millis(100);

impl Fabric {
    /// Connects to hostd and opens a context of this device (its first
    /// registers it).
    pub fn connect(path: &Path, tenant: &str, device: &str) -> Result<Self, FabricError> {
        let (channel, welcome, notifications) = open_context(path, tenant, device)?;
        Ok(Fabric {
            channel: Mutex::new(MainChannel { channel, owed: 0 }),
            mads_refused: std::sync::atomic::AtomicU64::new(0),
            path: path.to_owned(),
            tenant: tenant.into(),
            device: device.into(),
            lid: welcome.lid,
            link_layer: welcome.link_layer,
            gid: welcome.gid,
            active_mtu: welcome.active_mtu.into(),
            physical_queues: welcome.physical_queues,
            policy: welcome.policy,
            journal_out: Mutex::new(notifications.try_clone().ok()),
            notifications: Mutex::new(Some(notifications)),
            closed: AtomicBool::new(false),
            link: Mutex::new(LinkState::default()),
            moved: std::sync::Condvar::new(),
        })
    }

    /// Registers this context again, with a hostd that came back after
    /// the previous one went away (the port is down until then): a new
    /// connection and a new notification channel, under the same tenant
    /// and device name, so hostd gives the device its LID and GID again.
    /// Nothing of the context's objects is on the new hostd yet
    /// ([`crate::verbs::RdmaDevice::restore`] brings them). Not after
    /// [`Fabric::close`]: the context is ending.
    pub fn reconnect(&self) -> Result<Welcome, FabricError> {
        if self.closed() {
            return Err(FabricError::Closed);
        }
        let (channel, welcome, notifications) =
            open_context(&self.path, &self.tenant, &self.device)?;
        // What the old hostd owed is gone with it.
        *self.channel.lock().unwrap_or_else(|p| p.into_inner()) = MainChannel { channel, owed: 0 };
        *self.journal_out.lock().unwrap_or_else(|p| p.into_inner()) =
            notifications.try_clone().ok();
        *self.notifications.lock().unwrap_or_else(|p| p.into_inner()) = Some(notifications);
        self.active_mtu
            .store(welcome.active_mtu, std::sync::atomic::Ordering::Relaxed);
        self.link().generation += 1;
        self.moved.notify_all();
        Ok(welcome)
    }

    fn link(&self) -> std::sync::MutexGuard<'_, LinkState> {
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The hostd serving this context hands over and gave it `token`
    /// ([`Notification::Handover`]).
    pub fn set_handover(&self, token: String) {
        self.link().token = Some(token);
        self.moved.notify_all();
    }

    /// Whether a handover is under way and the context is not on the new
    /// hostd yet.
    pub fn handover_pending(&self) -> bool {
        self.link().token.is_some()
    }

    /// The handover's token, for the new hostd (once).
    pub fn take_handover(&self) -> Option<String> {
        self.link().token.take()
    }

    /// How many times the context registered again so far.
    pub fn generation(&self) -> u64 {
        self.link().generation
    }

    /// Waits (at most `timeout`) until the context registered again since
    /// `generation`; returns whether it did.
    pub fn wait_registered(&self, generation: u64, timeout: std::time::Duration) -> bool {
        let link = self.link();
        let (link, _) = self
            .moved
            .wait_timeout_while(link, timeout, |l| l.generation == generation)
            .unwrap_or_else(|p| p.into_inner());
        link.generation != generation
    }

    /// The channel to hostd failed (`e`): if hostd is handing over — its
    /// word may still be on its way on the notification channel — the
    /// request met the move to the new hostd, not hostd's end.
    fn failed(&self, e: ChannelError) -> FabricError {
        let link = self.link();
        let (link, _) = self
            .moved
            .wait_timeout_while(link, HANDOVER_WORD, |l| l.token.is_none())
            .unwrap_or_else(|p| p.into_inner());
        if link.token.is_some() {
            FabricError::HandedOver
        } else {
            e.into()
        }
    }

    /// Presents the token a hostd that handed over gave this context
    /// ([`Request::ResumeHandover`]): the new hostd gives its QPs their
    /// transport back as they come back.
    pub fn resume_handover(&self, token: String) -> Result<(), FabricError> {
        self.call(&Request::ResumeHandover { token }, &[])
    }

    /// The port's active MTU, as hostd last said.
    pub fn active_mtu(&self) -> vrdma_spec::verbs::Mtu {
        let bytes = self.active_mtu.load(std::sync::atomic::Ordering::Relaxed);
        // A hostd that says less than 256 gets the smallest MTU.
        vrdma_spec::verbs::Mtu::at_most(bytes).unwrap_or(vrdma_spec::verbs::Mtu::Mtu256)
    }

    /// Sends a request (with `fds`) and returns hostd's answer; a refusal
    /// is an error.
    fn request(&self, request: &Request, fds: &[RawFd]) -> Result<Response, FabricError> {
        self.request_files(request, fds)
            .map(|(response, _)| response)
    }

    /// [`Self::request`], with the descriptors the answer carries.
    fn request_files(
        &self,
        request: &Request,
        fds: &[RawFd],
    ) -> Result<(Response, Vec<File>), FabricError> {
        let mut main = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        self.settle(&mut main)?;
        let (response, files): (Response, Vec<File>) = match main.channel.call(request, fds) {
            Ok(answer) => answer,
            Err(e @ (ChannelError::Closed | ChannelError::Io(_))) => return Err(self.failed(e)),
            Err(e) => return Err(e.into()),
        };
        match response {
            Response::Refused { errno, reason } => Err(FabricError::Refused { errno, reason }),
            other => Ok((other, files)),
        }
    }

    /// Reads the answers hostd owes for posted requests: a refusal is
    /// counted and logged (what a synchronous caller would have done with
    /// it), anything else taken as done.
    fn settle(&self, main: &mut MainChannel) -> Result<(), FabricError> {
        while main.owed > 0 {
            match main.channel.recv::<Response>() {
                Ok((Response::Refused { errno, reason }, _)) => {
                    main.owed -= 1;
                    self.mads_refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(tenant = %self.tenant, errno, "hostd refused a CM MAD: {reason}");
                }
                Ok(_) => main.owed -= 1,
                Err(e @ (ChannelError::Closed | ChannelError::Io(_))) => {
                    main.owed = 0;
                    return Err(self.failed(e));
                }
                Err(e) => {
                    main.owed -= 1;
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// Sends a request (with `fds`) and expects `Ok`.
    fn call(&self, request: &Request, fds: &[RawFd]) -> Result<(), FabricError> {
        match self.request(request, fds)? {
            Response::Ok => Ok(()),
            other => Err(FabricError::Unexpected(Box::new(other))),
        }
    }

    /// Ends the registration: hostd sees the channel close and tears the
    /// device down, and closes the notification channel, which ends the
    /// policy listener. Needed because the listener holds the device, and
    /// with it this fabric, until then: dropping references alone would
    /// never close the channel.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let mut main = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        // On purpose, so hostd does not keep the context for a successor
        // (hostd gone: nothing to tell).
        if self.settle(&mut main).is_ok() {
            if let Ok((response, _)) = main
                .channel
                .call::<Request, Response>(&Request::Release, &[])
            {
                if !matches!(response, Response::Ok) {
                    tracing::debug!(tenant = %self.tenant, ?response, "hostd did not take the release");
                }
            }
        }
        main.channel.shutdown();
    }

    /// Sends the context's journal (not answered: hostd keeps it for the
    /// next vdev should this one die). A failure is hostd gone, which the
    /// policy listener notices.
    pub fn journal(&self, journal: Journal) {
        let message = Request::Journal(journal);
        // On the notification channel while it takes it; hostd reads that
        // before the next request on the main one, which keeps the order
        // when one goes there (a full buffer: a burst of vdev-only
        // commands, such as PD allocations, with no request between).
        let lazily = (self.journal_out.lock().unwrap_or_else(|p| p.into_inner()))
            .as_ref()
            .map(|out| out.try_send(&message));
        if let Some(Ok(true)) = lazily {
            return;
        }
        let main = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = main.channel.send(&message, &[]) {
            tracing::debug!(tenant = %self.tenant, "Journal not sent: {}", vrdma_errors::error_chain(&e));
        }
    }

    /// The frontend of an adopted context came back with these eventfds:
    /// the doorbell queue's kick (if the context has a doorbell page) and
    /// each event ring's interrupt, by vector.
    pub fn renew_notifiers(
        &self,
        kick: Option<BorrowedFd<'_>>,
        calls: &[(u32, BorrowedFd<'_>)],
    ) -> Result<(), FabricError> {
        // A message carries at most MAX_FDS descriptors.
        let mut kick = kick;
        let per_message = vrdma_hostd_protocol::channel::MAX_FDS - 1;
        let mut chunks = calls.chunks(per_message).peekable();
        if chunks.peek().is_none() && kick.is_none() {
            return Ok(());
        }
        loop {
            let chunk = chunks.next().unwrap_or_default();
            let fds: Vec<RawFd> = (kick.iter().map(|k| k.as_raw_fd()))
                .chain(chunk.iter().map(|(_, fd)| fd.as_raw_fd()))
                .collect();
            let request = Request::RenewNotifiers {
                doorbell: kick.take().is_some(),
                vectors: chunk.iter().map(|(v, _)| *v).collect(),
            };
            self.call(&request, &fds)?;
            if chunks.peek().is_none() {
                return Ok(());
            }
        }
    }

    /// Takes over the orphaned context keyed `key` (this context created
    /// nothing yet) and returns its journal's records; refused `ENOENT`
    /// when there is none.
    pub fn adopt(&self, key: ContextKey) -> Result<Vec<Record>, FabricError> {
        let count = match self.request(&Request::Adopt { key }, &[])? {
            Response::Adopted { records } => records as usize,
            other => return Err(FabricError::Unexpected(Box::new(other))),
        };
        let mut records: Vec<Record> = Vec::with_capacity(count.min(1 << 16));
        loop {
            let from = u32::try_from(records.len()).unwrap_or(u32::MAX);
            match self.request(&Request::TakeRecords { from }, &[])? {
                Response::Records {
                    records: page,
                    more,
                } => {
                    let empty = page.is_empty();
                    records.extend(page);
                    if !more || empty {
                        break;
                    }
                }
                other => return Err(FabricError::Unexpected(Box::new(other))),
            }
        }
        Ok(records)
    }

    /// Whether vdev ended the registration ([`Fabric::close`]).
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Takes the notification channel (once), for the thread that listens.
    pub fn take_notifications(&self) -> Option<Channel> {
        self.notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Tells hostd a verb was refused for the tenant's quota `quota`.
    pub fn quota_rejected(&self, quota: &str) -> Result<(), FabricError> {
        self.call(
            &Request::QuotaRejected {
                quota: quota.into(),
            },
            &[],
        )
    }

    pub fn add_memory(
        &self,
        slot: u32,
        gpa: u64,
        len: u64,
        file: &File,
        file_offset: u64,
    ) -> Result<(), FabricError> {
        self.call(
            &Request::AddMemory {
                slot,
                gpa,
                len,
                file_offset,
            },
            &[file.as_raw_fd()],
        )
    }

    pub fn remove_memory(&self, slot: u32) -> Result<(), FabricError> {
        self.call(&Request::RemoveMemory { slot }, &[])
    }

    /// Registers a memory region; hostd assigns its keys: (lkey, rkey).
    pub fn register_mr(&self, reg: MrRegistration) -> Result<(u32, u32), FabricError> {
        match self.request(&Request::RegisterMr(reg), &[])? {
            Response::MrKeys { lkey, rkey } => Ok((lkey, rkey)),
            other => Err(FabricError::Unexpected(Box::new(other))),
        }
    }

    pub fn deregister_mr(&self, lkey: u32) -> Result<(), FabricError> {
        self.call(&Request::DeregisterMr { lkey }, &[])
    }

    /// The device's doorbell page at `gpa`, and `kick`, the eventfd the
    /// driver notifies the doorbell virtqueue with.
    pub fn set_doorbell(&self, gpa: u64, kick: BorrowedFd<'_>) -> Result<(), FabricError> {
        self.call(&Request::SetDoorbell { gpa }, &[kick.as_raw_fd()])
    }

    /// The event ring of completion vector `vector`, and `call`, the
    /// eventfd that interrupts the driver for it; `resumed`: a ring a
    /// previous hostd wrote, which continues from its header.
    pub fn create_eq(
        &self,
        vector: u32,
        (gpa, depth): (u64, u32),
        call: BorrowedFd<'_>,
        resumed: bool,
    ) -> Result<(), FabricError> {
        let request = match resumed {
            false => Request::CreateEq { vector, gpa, depth },
            true => Request::ResumeEq { vector, gpa, depth },
        };
        self.call(&request, &[call.as_raw_fd()])
    }

    /// A CQ; `resumed`: one a previous hostd wrote, which continues from
    /// its ring's header.
    pub fn create_cq(
        &self,
        cqn: u32,
        (gpa, depth): (u64, u32),
        vector: u32,
        resumed: bool,
    ) -> Result<(), FabricError> {
        let request = match resumed {
            false => Request::CreateCq {
                cqn,
                gpa,
                depth,
                vector,
            },
            true => Request::ResumeCq {
                cqn,
                gpa,
                depth,
                vector,
            },
        };
        self.call(&request, &[])
    }

    /// [`Fabric::create_qp`] for a QP a previous hostd ran.
    pub fn resume_qp(&self, setup: QpSetup) -> Result<(), FabricError> {
        self.call(&Request::ResumeQp(setup), &[])
    }

    /// [`Fabric::create_srq`] for an SRQ a previous hostd served.
    pub fn resume_srq(&self, setup: SrqSetup) -> Result<(), FabricError> {
        self.call(&Request::ResumeSrq(setup), &[])
    }

    /// Registers a region a previous hostd had registered, under its keys.
    pub fn restore_mr(&self, lkey: u32, rkey: u32, mr: MrRegistration) -> Result<(), FabricError> {
        self.call(&Request::RestoreMr { lkey, rkey, mr }, &[])
    }

    pub fn destroy_cq(&self, cqn: u32) -> Result<(), FabricError> {
        self.call(&Request::DestroyCq { cqn }, &[])
    }

    pub fn create_qp(&self, setup: QpSetup) -> Result<(), FabricError> {
        self.call(&Request::CreateQp(setup), &[])
    }

    pub fn modify_qp(&self, modify: QpModify) -> Result<(), FabricError> {
        self.call(&Request::ModifyQp(modify), &[])
    }

    /// A QP's transitions in order, in one request (hostd stops at the
    /// first it refuses, the ones before applied).
    pub fn modify_qps(&self, modifies: Vec<QpModify>) -> Result<(), FabricError> {
        self.call(&Request::ModifyQps(modifies), &[])
    }

    /// The QP's state as hostd's datapath sees it (a
    /// [`vrdma_spec::verbs::QpState`] value).
    pub fn query_qp(&self, vqpn: u32) -> Result<u8, FabricError> {
        match self.request(&Request::QueryQp { vqpn }, &[])? {
            Response::QpState { state } => Ok(state),
            other => Err(FabricError::Unexpected(Box::new(other))),
        }
    }

    pub fn destroy_qp(&self, vqpn: u32) -> Result<(), FabricError> {
        self.call(&Request::DestroyQp { vqpn }, &[])
    }

    pub fn create_srq(&self, setup: SrqSetup) -> Result<(), FabricError> {
        self.call(&Request::CreateSrq(setup), &[])
    }

    pub fn modify_srq(&self, srqn: u32, limit: u32) -> Result<(), FabricError> {
        self.call(&Request::ModifySrq { srqn, limit }, &[])
    }

    /// The SRQ's armed limit as the datapath sees it (0 once it fired).
    pub fn query_srq(&self, srqn: u32) -> Result<u32, FabricError> {
        match self.request(&Request::QuerySrq { srqn }, &[])? {
            Response::SrqLimit { limit } => Ok(limit),
            other => Err(FabricError::Unexpected(Box::new(other))),
        }
    }

    pub fn destroy_srq(&self, srqn: u32) -> Result<(), FabricError> {
        self.call(&Request::DestroySrq { srqn }, &[])
    }

    /// An address handle; hostd refuses a destination the tenant may not
    /// reach (`EACCES`), that is unknown (`ENOENT`) or on another host
    /// (`EOPNOTSUPP`).
    pub fn create_ah(&self, setup: AhSetup) -> Result<(), FabricError> {
        self.call(&Request::CreateAh(setup), &[])
    }

    pub fn destroy_ah(&self, ahn: u32) -> Result<(), FabricError> {
        self.call(&Request::DestroyAh { ahn }, &[])
    }

    /// From now on hostd signals `notify` (an eventfd) when MADs arrive
    /// for the device's QP1 and none was waiting: the connection manager
    /// then takes them with [`Fabric::take_mads`].
    pub fn gsi_notify(&self, notify: &vmm_sys_util::eventfd::EventFd) -> Result<(), FabricError> {
        self.call(&Request::GsiNotify, &[notify.as_raw_fd()])
    }

    /// From now on hostd pushes the MADs that arrive for the device's QP1
    /// on the socket whose end this returns, while none waits to be taken
    /// (those wait behind [`Fabric::gsi_notify`]'s eventfd, as before).
    pub fn gsi_push(&self) -> Result<Channel, FabricError> {
        match self.request_files(&Request::GsiPush, &[])? {
            (Response::MadPush, mut files) if files.len() == 1 => {
                Ok(Channel::from(std::os::fd::OwnedFd::from(files.remove(0))))
            }
            (other, _) => Err(FabricError::Unexpected(Box::new(other))),
        }
    }

    /// Sends a connection-manager MAD from the device's QP1 to QP1 of
    /// `mad.peer`, without waiting for hostd's answer, which the next
    /// request reads first: hostd refuses a peer the tenant may not reach
    /// (`EACCES`), an unknown one (`ENOENT`) and anything but a 256-byte
    /// CM MAD (`EINVAL`), and [`Fabric::mads_refused`] counts those. A MAD
    /// is a datagram, which the CM's timers retry whatever becomes of it,
    /// and a burst of them (a thousand connections' REQs) then costs hostd
    /// one wake-up, not one each.
    pub fn post_mad(&self, mad: MadOut) -> Result<(), FabricError> {
        let mut main = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        if main.owed >= MAX_OWED {
            self.settle(&mut main)?;
        }
        match main.channel.send(&Request::SendMad(mad), &[]) {
            Ok(()) => {
                main.owed += 1;
                Ok(())
            }
            Err(e @ (ChannelError::Closed | ChannelError::Io(_))) => Err(self.failed(e)),
            Err(e) => Err(e.into()),
        }
    }

    /// Posted MADs hostd refused ([`Fabric::post_mad`]), with the answers
    /// it still owes read first.
    pub fn mads_refused(&self) -> u64 {
        let mut main = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        // hostd gone: what it answered is what it refused.
        let _ = self.settle(&mut main);
        self.mads_refused.load(Ordering::Relaxed)
    }

    /// Up to `max` MADs that arrived for the device's QP1, oldest first.
    pub fn take_mads(&self, max: u32) -> Result<Vec<MadIn>, FabricError> {
        match self.request(&Request::TakeMads { max }, &[])? {
            Response::Mads(mads) => Ok(mads),
            other => Err(FabricError::Unexpected(Box::new(other))),
        }
    }

    /// Whether the device may reach GID `gid` (the check a connection gets
    /// at RTR): `Ok`, or refused with `EACCES` (not reachable) or `ENOENT`
    /// (unknown). Callers that answer a tenant treat both alike.
    pub fn resolve_gid(&self, gid: [u8; 16]) -> Result<(), FabricError> {
        self.call(&Request::ResolveGid { gid }, &[])
    }

    /// Everything of the device's driver goes: QPs, CQs, event rings, MRs
    /// and the doorbell (memory slots stay).
    pub fn reset_device(&self) -> Result<(), FabricError> {
        self.call(&Request::ResetDevice, &[])
    }
}

/// Connects to hostd at `path` and opens a context of `device` (the
/// device's first registers it): the control channel, hostd's Welcome and
/// the notification channel.
fn open_context(
    path: &Path,
    tenant: &str,
    device: &str,
) -> Result<(Channel, Welcome, Channel), FabricError> {
    let channel = Channel::connect(path).map_err(|source| FabricError::Connect {
        path: path.display().to_string(),
        source,
    })?;
    // Every frontend is a context of the device: the first opens it,
    // the others join it (hostd checks they come from this process).
    let hello = Request::OpenContext {
        version: PROTOCOL_VERSION,
        tenant: tenant.into(),
        device: device.into(),
    };
    let (response, mut files): (Response, Vec<File>) = channel.call(&hello, &[])?;
    let welcome = match response {
        Response::Welcome(w) => *w,
        Response::Refused { errno, reason } => return Err(FabricError::Refused { errno, reason }),
        other => return Err(FabricError::Unexpected(Box::new(other))),
    };
    // The one descriptor is the notification channel.
    let notifications = match (files.pop(), files.len()) {
        (Some(file), 0) => Channel::from(std::os::fd::OwnedFd::from(file)),
        (file, rest) => {
            return Err(FabricError::Descriptors {
                got: rest + usize::from(file.is_some()),
                want: 1,
            })
        }
    };
    Ok((channel, welcome, notifications))
}

/// Starts the thread that applies hostd's policy notifications to `device`
/// until hostd closes the channel (the device's registration ended), under
/// the policy listener's filter. A channel that closes while vdev still
/// holds the registration means hostd went away: the device's port is
/// down ([`crate::verbs::RdmaDevice::port_lost`]).
///
/// `lost` is called then, after the port went down, so that whoever
/// serves the device registers it again once hostd is back.
///
/// The thread holds the device and the registration weakly: hostd closes
/// the channel only after the registration's connection closes, which
/// happens when the last `Fabric` goes — a strong reference here would keep
/// it open, and hostd would refuse this device's next registration (the
/// next frontend's) as still connected.
pub fn listen_for_policy(
    tenant: std::sync::Arc<str>,
    channel: Channel,
    device: Weak<Mutex<crate::verbs::RdmaDevice>>,
    fabric: Weak<Fabric>,
    lost: Box<dyn FnOnce() + Send>,
    threads: &Threads,
) -> std::io::Result<()> {
    threads.spawn(Role::PolicyListener, "policy-listener", move || {
        loop {
            match channel.recv::<Notification>() {
                Ok((Notification::Policy(policy), _fds)) => {
                    let (Some(_fabric), Some(device)) = (fabric.upgrade(), device.upgrade())
                    else {
                        // The registration is being torn down.
                        return;
                    };
                    let mut device = device.lock().unwrap_or_else(|p| p.into_inner());
                    device.set_policy_quotas(policy.quotas);
                }
                Ok((Notification::Handover { token }, _fds)) => {
                    let Some(fabric) = fabric.upgrade() else {
                        return;
                    };
                    tracing::info!(%tenant, "hostd hands over to a new hostd: the port stays up");
                    fabric.set_handover(token);
                }
                Err(ChannelError::Closed) => {
                    let (Some(fabric), Some(device)) = (fabric.upgrade(), device.upgrade()) else {
                        return;
                    };
                    if fabric.closed() {
                        return;
                    }
                    tracing::debug!(%tenant, "hostd's notification channel closed");
                    device.lock().unwrap_or_else(|p| p.into_inner()).port_lost();
                    // The main thread registers the context again (a
                    // command that met a handover waits for that).
                    lost();
                    return;
                }
                Err(e) => {
                    tracing::warn!(%tenant, error = %e, "Bad notification from hostd; no longer listening");
                    return;
                }
            }
        }
    })?;
    Ok(())
}
