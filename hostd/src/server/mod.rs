//! The control socket: vdevs connect, say `Hello`, and then ask for memory,
//! memory regions, their doorbell and event rings, CQs and QPs, one request
//! at a time, each answered with exactly one response.
//!
//! This is where tenant policy is enforced on the control path: the tenant
//! must be in the policy, the peer's kernel-reported uid must match the
//! tenant's, its devices get the tenant's `physical_queues`, its memory
//! registrations stay within its memory quotas (over all its devices), and
//! a QP may only be connected to a GID whose device's tenant's network
//! this tenant reaches. Every request is validated before the NIC sees it and
//! refused with a real errno. A vdev that breaks the protocol (undecodable
//! message) is disconnected; on any disconnect everything it had — QPs,
//! keys, memory, pQPs — is torn down while other vdevs keep running.
//!
//! The policy can be replaced while hostd runs ([`Server::reload`]): the
//! new one applies to new devices and objects at once, to the scheduler at
//! once, and each connected vdev whose tenant's policy changed is sent
//! [`Notification::Policy`] on its notification channel. The same reload
//! re-reads the cluster file of the directory (`[fabric]`), if any.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::channel::{Channel, ChannelError, Listener};
use vrdma_hostd_protocol::messages::{
    Notification, PortLinkLayer, QpModify, Request, Response, MAX_MODIFIES, SM_LID,
};
use vrdma_hostd_protocol::shm::ShmError;
use vrdma_tenant_policy::{Limits, Policy, TenantPolicy};

use crate::accept::{serve_connections, Connections};
use crate::config::Config;
use crate::datapath::Datapath;
use crate::engine::gsi::{self, Mad, GSI_QPN, MAD_LEN};
use crate::engine::guest::SharedMapping;
use crate::engine::wire::PeerStats;
use crate::engine::EngineError;
use crate::engine::Start;
use crate::gids::{self, Gid, Peer};
use crate::lids::LidTable;
use crate::net::directory::Directory;
use crate::seccomp::{Role, Threads};
use crate::stats::{Stats, TenantStats};

pub mod handover;
mod journal;
mod registry;

use registry::{Registry, Session};

/// Concurrent vdev connections (each costs a thread).
const MAX_CONNECTIONS: usize = 1024;

/// Contexts one device may have open at once (processes and opens of the
/// device in its tenant; each is a datapath device of its own here).
pub const MAX_CONTEXTS_PER_DEVICE: usize = 64;

/// A refusal: the errno vdev gets and why.
#[derive(Debug)]
struct Refusal {
    errno: i32,
    reason: String,
}

fn refuse(errno: i32, reason: impl Into<String>) -> Refusal {
    Refusal {
        errno,
        reason: reason.into(),
    }
}

impl From<EngineError> for Refusal {
    fn from(e: EngineError) -> Self {
        refuse(e.errno(), e.to_string())
    }
}

fn shm_refusal(e: ShmError) -> Refusal {
    let errno = match &e {
        ShmError::NotSealed | ShmError::TooSmall { .. } => libc::EINVAL,
        ShmError::Map(io) | ShmError::Create(io) => io.raw_os_error().unwrap_or(libc::ENOMEM),
    };
    refuse(errno, vrdma_errors::error_chain(&e))
}

/// The one eventfd a request carries.
fn one_eventfd(mut files: Vec<File>, what: &str) -> Result<EventFd, Refusal> {
    use std::os::fd::{FromRawFd, IntoRawFd};
    if files.len() != 1 {
        return Err(refuse(
            libc::EINVAL,
            format!("{what} needs exactly one fd, got {}", files.len()),
        ));
    }
    let file = files.remove(0);
    // Anything else would make the datapath read or write a file it was
    // not meant to.
    if !is_eventfd(&file) {
        return Err(refuse(libc::EINVAL, format!("{what} needs an eventfd")));
    }
    // SAFETY: the descriptor is an eventfd (checked above) that we own;
    // EventFd takes ownership of it.
    Ok(unsafe { EventFd::from_raw_fd(file.into_raw_fd()) })
}

/// Whether `file` is an eventfd, by its behaviour (hostd's sandbox reads
/// no /proc): of the files without a type (anonymous inodes), an eventfd
/// is the one that takes an 8-byte write of 0 — which adds nothing to its
/// counter.
fn is_eventfd(file: &File) -> bool {
    use std::io::Write;
    let Ok(meta) = file.metadata() else {
        return false;
    };
    if meta.len() != 0 || meta.is_file() || meta.is_dir() {
        return false;
    }
    // Writing 0 adds nothing to an eventfd's counter; a pipe or socket
    // would take the bytes (and its peer read garbage), so refuse those by
    // their file type first.
    use std::os::unix::fs::FileTypeExt;
    let ft = meta.file_type();
    if ft.is_fifo() || ft.is_socket() || ft.is_block_device() || ft.is_char_device() {
        return false;
    }
    (&*file).write(&0u64.to_ne_bytes()).is_ok_and(|n| n == 8)
}

/// What a successful reload changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// The policy file.
    pub file: PathBuf,
    /// One line per change (see [`crate::policy::diff`]).
    pub changes: Vec<String>,
}

/// The quota keys vdev may report in `QuotaRejected`: the keys of
/// [`Limits`] (anything else would let a vdev grow hostd's tables).
fn quota_keys() -> Vec<String> {
    match serde_json::to_value(Limits::default()) {
        Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// The control server.
pub struct Server {
    config: Config,
    datapath: Arc<Datapath>,
    registry: Mutex<Registry>,
    /// Reloads run one at a time.
    reloading: Mutex<()>,
    quota_keys: Vec<String>,
    /// The directory of the cluster (`[fabric]`), once set.
    directory: OnceLock<Arc<dyn Directory>>,
    /// Signalled (with the registry's lock) when a context is orphaned:
    /// the thread that releases expired orphans looks at its deadlines.
    orphans_changed: std::sync::Condvar,
    /// No thread expires orphans: none are kept.
    no_orphans: std::sync::atomic::AtomicBool,
    /// The sockets a new hostd gets should this one hand over.
    handover_sockets: OnceLock<handover::HandoverSockets>,
    /// What this hostd took over from a previous one and its vdevs have
    /// not claimed yet.
    handed: Mutex<handover::Handed>,
}

impl Server {
    /// A server for `config` over `datapath`, enforcing `config.policy`.
    pub fn new(config: Config, datapath: Arc<Datapath>) -> Arc<Self> {
        let policy = Arc::new(config.policy.clone());
        datapath
            .lock()
            .configure_tenants(&policy.tenants, Instant::now());
        // On an InfiniBand port hostd is the subnet manager, with its LID.
        let first_lid = match config.link_layer {
            PortLinkLayer::Ethernet => 1,
            PortLinkLayer::Infiniband => SM_LID + 1,
        };
        let registry = Registry {
            lids: LidTable::starting_at(first_lid),
            connected: HashMap::new(),
            by_gid: HashMap::new(),
            free_pqps: (0..config.physical_qps).collect(),
            next_device: 1,
            known: policy
                .tenants
                .iter()
                .map(|t| (t.name.clone(), t.clone()))
                .collect(),
            policy,
        };
        Arc::new(Server {
            config,
            datapath,
            registry: Mutex::new(registry),
            reloading: Mutex::new(()),
            quota_keys: quota_keys(),
            directory: OnceLock::new(),
            orphans_changed: std::sync::Condvar::new(),
            no_orphans: std::sync::atomic::AtomicBool::new(false),
            handover_sockets: OnceLock::new(),
            handed: Mutex::new(handover::Handed::default()),
        })
    }

    /// Puts hostd in a cluster: `directory` says where remote GIDs live,
    /// and is reloaded with the policy. Set once, before serving.
    pub fn set_directory(&self, directory: Arc<dyn Directory>) {
        if self.directory.set(directory).is_err() {
            tracing::error!("The directory was set twice: the first one stays");
        }
    }

    /// The directory of the cluster, if hostd is in one.
    pub fn directory(&self) -> Option<&Arc<dyn Directory>> {
        self.directory.get()
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The policy of `tenant` that applies to its devices: the one in
    /// force, or its last one if it was removed.
    fn tenant_policy(&self, tenant: &str) -> Result<TenantPolicy, Refusal> {
        self.registry()
            .known
            .get(tenant)
            .cloned()
            .ok_or_else(|| refuse(libc::EACCES, format!("Unknown tenant {tenant:?}")))
    }

    /// The policy in force.
    pub fn policy(&self) -> Arc<Policy> {
        Arc::clone(&self.registry().policy)
    }

    /// Accepts vdevs forever, one thread each (started through `threads`,
    /// under the connection role's filter).
    pub fn serve(self: &Arc<Self>, listener: &Listener, threads: &Threads) {
        let server = Arc::clone(self);
        let vdevs = Connections {
            peer: "vdev",
            role: Role::Connection,
            thread: "vdev-conn",
            max: MAX_CONNECTIONS,
        };
        let reaper = Arc::clone(self);
        if let Err(e) = threads.spawn(Role::Connection, "orphans", move || reaper.reap_orphans()) {
            // Orphans would never expire: keep none.
            tracing::error!(
                "Cannot start the orphans' thread; contexts of dead vdevs are released at once: {e}"
            );
            self.no_orphans
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        serve_connections(listener, threads, vdevs, move |channel| {
            server.connection(Arc::new(channel))
        });
    }

    /// Releases orphaned contexts whose grace period ended, for ever.
    fn reap_orphans(&self) {
        loop {
            self.expire_orphans();
            let reg = self.registry();
            // Under the lock: an orphan added since `expire_orphans` is
            // either seen here or signals the wait below.
            let next = (reg.connected.values())
                .flat_map(|d| d.orphans.iter().map(|o| o.until))
                .min();
            let _reg = match next {
                None => self
                    .orphans_changed
                    .wait(reg)
                    .unwrap_or_else(|e| e.into_inner()),
                Some(until) => {
                    let wait = until.saturating_duration_since(Instant::now());
                    self.orphans_changed
                        .wait_timeout(reg, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Serves one vdev until it disconnects or breaks the protocol, then
    /// tears down everything it had.
    pub fn connection(&self, channel: Arc<Channel>) {
        let mut session: Option<Session> = None;
        let mut notify_peer: Option<Channel> = None;
        loop {
            let received = channel.recv::<Request>();
            // What vdev journaled on the notification channel comes first.
            if let Some(s) = session.as_mut() {
                self.take_journal(s);
            }
            let (request, files) = match received {
                Ok((Request::Journal(journal), files)) if files.is_empty() => {
                    // Not answered: vdev does not wait for it.
                    if let Some(s) = session.as_mut() {
                        self.journal(s, journal);
                    }
                    continue;
                }
                Ok(received) => received,
                Err(ChannelError::Message(e)) => {
                    // Undecodable: answer once, then hang up, since nothing
                    // after it can be trusted to be framed as intended.
                    let why = vrdma_errors::error_chain(&e);
                    tracing::warn!(
                        device = session.as_ref().map(|s| s.id),
                        "Protocol violation: {why}"
                    );
                    let _ = channel.send(
                        &Response::Refused {
                            errno: libc::EPROTO,
                            reason: why,
                        },
                        &[],
                    );
                    break;
                }
                Err(_) => break,
            };
            let response =
                match self.handle(&channel, &mut session, request, files, &mut notify_peer) {
                    Ok(response) => response,
                    Err(refusal) => {
                        tracing::debug!(
                            device = session.as_ref().map(|s| s.id),
                            errno = refusal.errno,
                            "Refused: {}",
                            refusal.reason
                        );
                        Response::Refused {
                            errno: refusal.errno,
                            reason: refusal.reason,
                        }
                    }
                };
            let mut fds: Vec<RawFd> = Vec::new();
            let peer = notify_peer.take();
            if let (Response::Welcome(_) | Response::MadPush, Some(peer)) = (&response, &peer) {
                fds.push(peer.as_raw_fd());
            }
            // The vdev has its end now; ours lives in the registry (the
            // notification channel) or the engine (QP1's push socket).
            let sent = channel.send(&response, &fds);
            drop(peer);
            if sent.is_err() {
                break;
            }
        }
        if let Some(mut s) = session {
            // The last of its journal, which the vdev sent before it went.
            self.take_journal(&mut s);
            if self.no_orphans.load(std::sync::atomic::Ordering::Relaxed) {
                self.teardown(&s);
            } else {
                self.context_lost(s);
            }
        }
    }

    /// Applies journal message `journal` of context `s`.
    fn journal(&self, s: &mut Session, journal: vrdma_hostd_protocol::messages::Journal) {
        if let Some(key) = journal.key {
            // A fresh driver where an orphan's was (a VM rebooted while no
            // vdev ran): the orphan's QPs must not write into its memory.
            self.supersede(s, key);
        }
        if let Some(why) = s.journal.apply(journal) {
            tracing::warn!(tenant = %s.tenant, device = %s.device,
                "Context not kept should its vdev die: {why}");
        }
    }

    /// Applies the journal messages context `s`'s vdev sent on the
    /// notification channel (non-blocking: what is there now). Anything
    /// else on it is a protocol violation, logged and dropped.
    fn take_journal(&self, s: &mut Session) {
        loop {
            match s.notify.recv::<Request>() {
                Ok((Request::Journal(journal), files)) if files.is_empty() => {
                    self.journal(s, journal);
                }
                Ok(_) => {
                    tracing::warn!(tenant = %s.tenant, device = %s.device,
                        "Not a journal on the notification channel: dropped");
                }
                Err(ChannelError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(ChannelError::Message(e)) => {
                    tracing::warn!(tenant = %s.tenant, device = %s.device,
                        "Undecodable message on the notification channel: {}",
                        vrdma_errors::error_chain(&e));
                }
                // Closed (the vdev gone) or broken: nothing more to read.
                Err(_) => return,
            }
        }
    }

    fn handle(
        &self,
        channel: &Arc<Channel>,
        session: &mut Option<Session>,
        request: Request,
        files: Vec<File>,
        notify_peer: &mut Option<Channel>,
    ) -> Result<Response, Refusal> {
        let takes_fd = matches!(
            request,
            Request::AddMemory { .. }
                | Request::RenewNotifiers { .. }
                | Request::GsiNotify
                | Request::SetDoorbell { .. }
                | Request::CreateEq { .. }
                | Request::ResumeEq { .. }
        );
        if !takes_fd && !files.is_empty() {
            return Err(refuse(
                libc::EINVAL,
                "This request carries no file descriptors",
            ));
        }
        if let Request::Hello {
            version,
            ref tenant,
            ref device,
        }
        | Request::OpenContext {
            version,
            ref tenant,
            ref device,
        } = request
        {
            if session.is_some() {
                return Err(refuse(libc::EPROTO, "Hello was already received"));
            }
            let shared = matches!(request, Request::OpenContext { .. });
            let (new, welcome, peer) = self.hello(channel, version, tenant, device, shared)?;
            *session = Some(new);
            *notify_peer = Some(peer);
            return Ok(Response::Welcome(Box::new(welcome)));
        }
        let Some(s) = session.as_mut() else {
            return Err(refuse(libc::EPROTO, "The first request must be Hello"));
        };
        match request {
            Request::Adopt { key } => {
                let records = self.adopt(s, key)?;
                return Ok(Response::Adopted {
                    records: records as u32,
                });
            }
            Request::TakeRecords { from } => {
                let (records, more) = s.journal.page(from as usize);
                return Ok(Response::Records { records, more });
            }
            Request::Release => {
                s.released = true;
                return Ok(Response::Ok);
            }
            Request::ResumeHandover { token } => {
                self.resume_handover(channel, s, &token)?;
                return Ok(Response::Ok);
            }
            Request::Journal(_) => {
                return Err(refuse(libc::EPROTO, "A journal carries no descriptors"));
            }
            Request::GsiPush => {
                // hostd makes the socket: a vdev's own descriptor could be
                // anything (a socket towards the network, from hostd's
                // namespace).
                let (ours, theirs) = Channel::pair()
                    .map_err(|e| refuse(libc::ENOMEM, vrdma_errors::error_chain(&e)))?;
                self.datapath.lock().set_gsi_push(s.id, ours)?;
                *notify_peer = Some(theirs);
                return Ok(Response::MadPush);
            }
            Request::RenewNotifiers { doorbell, vectors } => {
                if files.len() != usize::from(doorbell) + vectors.len() {
                    return Err(refuse(
                        libc::EINVAL,
                        format!(
                            "RenewNotifiers names {} eventfds, carries {}",
                            usize::from(doorbell) + vectors.len(),
                            files.len()
                        ),
                    ));
                }
                let mut fds = files
                    .into_iter()
                    .map(|f| one_eventfd(vec![f], "RenewNotifiers"));
                let kick = if doorbell {
                    fds.next().transpose()?
                } else {
                    None
                };
                let irqs = (vectors.into_iter())
                    .zip(fds)
                    .map(|(v, fd)| fd.map(|fd| (v, fd)))
                    .collect::<Result<Vec<_>, _>>()?;
                self.datapath.lock().renew_notifiers(s.id, kick, irqs)?;
                self.datapath.wake();
                return Ok(Response::Ok);
            }
            _ => {}
        }
        // What the journal must follow, and what makes a context too old
        // to adopt another.
        let (changes, creates) = match &request {
            Request::AddMemory { .. } | Request::RemoveMemory { .. } | Request::ResetDevice => {
                (true, false)
            }
            Request::RegisterMr(_)
            | Request::RestoreMr { .. }
            | Request::DeregisterMr { .. }
            | Request::SetDoorbell { .. }
            | Request::CreateEq { .. }
            | Request::ResumeEq { .. }
            | Request::CreateCq { .. }
            | Request::ResumeCq { .. }
            | Request::DestroyCq { .. }
            | Request::CreateQp(_)
            | Request::ResumeQp(_)
            | Request::ModifyQp(_)
            | Request::ModifyQps(_)
            | Request::DestroyQp { .. }
            | Request::CreateSrq(_)
            | Request::ResumeSrq(_)
            | Request::ModifySrq { .. }
            | Request::DestroySrq { .. }
            | Request::CreateAh(_)
            | Request::DestroyAh { .. } => (true, true),
            _ => (false, false),
        };
        if changes {
            s.journal.changed();
        }
        s.created |= creates;
        // A QP handed over by a previous hostd, on its way back.
        let mut handed = match &request {
            Request::ModifyQp(m) if s.handed.contains_key(&m.vqpn) => {
                Some(std::mem::take(&mut s.handed))
            }
            Request::ModifyQps(ms) if ms.iter().any(|m| s.handed.contains_key(&m.vqpn)) => {
                Some(std::mem::take(&mut s.handed))
            }
            _ => None,
        };
        let start = start_of(&request);
        let result = self.apply(s, request, files, start, handed.as_mut());
        if let Some(h) = handed {
            s.handed = h;
        }
        result
    }

    /// One transition of a virtual QP of context `s` (its connection's
    /// peer checked as RTR's); whether the datapath has work from it.
    fn modify_one(
        &self,
        s: &Session,
        mut modify: QpModify,
        handed: Option<&mut HashMap<u32, crate::engine::handover::QpTransport>>,
    ) -> Result<bool, Refusal> {
        if let Some(conn) = &mut modify.connection {
            conn.dgid = self.reachable_destination(s, conn.dgid, conn.dlid)?;
        }
        let resumed = handed.is_some();
        let mut engine = self.datapath.lock();
        engine.modify_qp(s.id, &modify)?;
        if let Some(handed) = handed {
            Self::resume_qp(&mut engine, s.id, handed, modify.vqpn, modify.state);
        }
        Ok(resumed || engine.wants_round())
    }

    /// Runs a request that changes or asks the datapath, for context `s`.
    fn apply(
        &self,
        s: &Session,
        request: Request,
        mut files: Vec<File>,
        start: Start,
        handed: Option<&mut HashMap<u32, crate::engine::handover::QpTransport>>,
    ) -> Result<Response, Refusal> {
        let id = s.id;
        match request {
            Request::Hello { .. } | Request::OpenContext { .. } => {
                Err(refuse(libc::EPROTO, "Hello was already received"))
            }
            Request::AddMemory {
                slot,
                gpa,
                len,
                file_offset,
            } => {
                if files.len() != 1 {
                    return Err(refuse(
                        libc::EINVAL,
                        format!("AddMemory needs exactly one fd, got {}", files.len()),
                    ));
                }
                let file = files.remove(0);
                let limit =
                    crate::engine::guest::slot_limit(self.tenant_policy(&s.tenant)?.quotas.max_mr);
                let mem = SharedMapping::map(file, file_offset, len).map_err(shm_refusal)?;
                self.datapath.lock().add_memory(id, slot, gpa, mem, limit)?;
                tracing::debug!(tenant = %s.tenant, device = id, slot, gpa, len, "Memory slot added");
                Ok(Response::Ok)
            }
            Request::RemoveMemory { slot } => {
                self.datapath.lock().remove_memory(id, slot)?;
                // QPs whose rings were there failed: let the datapath see.
                self.datapath.wake();
                Ok(Response::Ok)
            }
            Request::RegisterMr(mr) => {
                let mut engine = self.datapath.lock();
                self.check_mr_quota(&mut engine, s, &mr)?;
                let (lkey, rkey) = engine.register_mr(id, &mr)?;
                Ok(Response::MrKeys { lkey, rkey })
            }
            Request::RestoreMr { lkey, rkey, mr } => {
                let mut engine = self.datapath.lock();
                self.check_mr_quota(&mut engine, s, &mr)?;
                engine.restore_mr(id, &mr, (lkey, rkey))?;
                Ok(Response::Ok)
            }
            Request::DeregisterMr { lkey } => {
                self.datapath.lock().deregister_mr(id, lkey)?;
                Ok(Response::Ok)
            }
            Request::SetDoorbell { gpa } => {
                let kick = one_eventfd(files, "SetDoorbell")?;
                self.datapath.lock().set_doorbell(id, gpa, kick)?;
                self.datapath.wake();
                Ok(Response::Ok)
            }
            Request::CreateEq { vector, gpa, depth } | Request::ResumeEq { vector, gpa, depth } => {
                let irq = one_eventfd(files, "CreateEq")?;
                self.datapath
                    .lock()
                    .open_eq(id, vector, (gpa, depth), irq, start)?;
                Ok(Response::Ok)
            }
            Request::CreateCq {
                cqn,
                gpa,
                depth,
                vector,
            }
            | Request::ResumeCq {
                cqn,
                gpa,
                depth,
                vector,
            } => {
                self.datapath
                    .lock()
                    .open_cq(id, cqn, (gpa, depth), vector, start)?;
                Ok(Response::Ok)
            }
            Request::DestroyCq { cqn } => {
                self.datapath.lock().destroy_cq(id, cqn)?;
                Ok(Response::Ok)
            }
            Request::CreateQp(setup) | Request::ResumeQp(setup) => {
                self.datapath.lock().open_qp(id, &setup, start)?;
                Ok(Response::Ok)
            }
            Request::ModifyQp(modify) => {
                let wake = self.modify_one(s, modify, handed)?;
                // Work posted before RTS, or to flush at ERR: let the
                // datapath see it now. Most transitions leave it nothing
                // (a connection's setup makes eight).
                if wake {
                    self.datapath.wake();
                }
                Ok(Response::Ok)
            }
            Request::ModifyQps(modifies) => {
                if modifies.len() > MAX_MODIFIES {
                    return Err(refuse(libc::EINVAL, "too many transitions in one request"));
                }
                if modifies.windows(2).any(|w| w[0].vqpn != w[1].vqpn) {
                    return Err(refuse(libc::EINVAL, "transitions of more than one QP"));
                }
                let mut handed = handed;
                let mut wake = false;
                let mut result = Ok(Response::Ok);
                for modify in modifies {
                    match self.modify_one(s, modify, handed.as_deref_mut()) {
                        Ok(w) => wake |= w,
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
                if wake {
                    self.datapath.wake();
                }
                result
            }
            Request::QueryQp { vqpn } => {
                let state = self.datapath.lock().query_qp(id, vqpn)?;
                Ok(Response::QpState {
                    state: state.into(),
                })
            }
            Request::DestroyQp { vqpn } => {
                self.datapath.lock().destroy_qp(id, vqpn)?;
                Ok(Response::Ok)
            }
            Request::CreateSrq(setup) | Request::ResumeSrq(setup) => {
                self.datapath.lock().open_srq(id, &setup, start)?;
                Ok(Response::Ok)
            }
            Request::ModifySrq { srqn, limit } => {
                self.datapath.lock().modify_srq(id, srqn, limit)?;
                Ok(Response::Ok)
            }
            Request::QuerySrq { srqn } => {
                let limit = self.datapath.lock().query_srq(id, srqn)?;
                Ok(Response::SrqLimit { limit })
            }
            Request::DestroySrq { srqn } => {
                self.datapath.lock().destroy_srq(id, srqn)?;
                Ok(Response::Ok)
            }
            Request::CreateAh(mut setup) => {
                // A UD destination is checked as a connection is at RTR.
                setup.dgid = self.reachable_destination(s, setup.dgid, setup.dlid)?;
                self.datapath.lock().create_ah(id, &setup)?;
                Ok(Response::Ok)
            }
            Request::DestroyAh { ahn } => {
                self.datapath.lock().destroy_ah(id, ahn)?;
                Ok(Response::Ok)
            }
            Request::GsiNotify => {
                let notify = one_eventfd(files, "GsiNotify")?;
                self.datapath.lock().set_gsi_notify(id, notify)?;
                Ok(Response::Ok)
            }
            Request::SendMad(out) => {
                // QP1 reaches what the tenant's QPs may reach.
                let peer = self.reachable_destination(s, out.peer, None)?;
                let bytes = <[u8; MAD_LEN]>::try_from(out.mad.as_slice())
                    .map_err(|_| refuse(libc::EINVAL, "A MAD is 256 bytes"))?;
                let mad = Mad {
                    peer,
                    peer_qpn: GSI_QPN,
                    traffic_class: out.traffic_class,
                    bytes: Box::new(bytes),
                };
                let wake = {
                    let mut engine = self.datapath.lock();
                    engine.gsi_send(id, &mad)?;
                    // A MAD for a device of this host is delivered already.
                    engine.wants_round()
                };
                if wake {
                    self.datapath.wake();
                }
                Ok(Response::Ok)
            }
            Request::TakeMads { max } => {
                let max = usize::try_from(max).unwrap_or(usize::MAX);
                let mads = self.datapath.lock().take_gsi(id, max)?;
                Ok(Response::Mads(mads.iter().map(gsi::mad_in).collect()))
            }
            Request::ResolveGid { gid } => {
                // The check a connection gets at RTR, with nothing created.
                self.check_reachable(s, &gid)?;
                Ok(Response::Ok)
            }
            Request::ResetDevice => {
                self.datapath.lock().reset_device(id);
                self.datapath.wake();
                tracing::info!(tenant = %s.tenant, device = %s.device, "Device reset by its driver");
                Ok(Response::Ok)
            }
            Request::Adopt { .. }
            | Request::TakeRecords { .. }
            | Request::ResumeHandover { .. }
            | Request::Release
            | Request::RenewNotifiers { .. }
            | Request::GsiPush
            | Request::Journal(_) => Err(refuse(libc::EPROTO, "Handled above")),
            Request::QuotaRejected { quota } => {
                if !self.quota_keys.contains(&quota) {
                    return Err(refuse(
                        libc::EINVAL,
                        "QuotaRejected names no quota key of the policy",
                    ));
                }
                tracing::debug!(tenant = %s.tenant, device = %s.device, quota, "vdev refused a verb by quota");
                self.datapath
                    .lock()
                    .accounts_mut()
                    .quota_rejected(&s.tenant, &quota);
                Ok(Response::Ok)
            }
        }
    }

    /// Refuses a region of `mr.len` bytes beyond the memory quota of the
    /// session's tenant (over all its devices), counting the refusal.
    fn check_mr_quota(
        &self,
        engine: &mut crate::engine::Engine,
        s: &Session,
        mr: &vrdma_hostd_protocol::messages::MrRegistration,
    ) -> Result<(), Refusal> {
        let policy = self.tenant_policy(&s.tenant)?;
        let Err(q) = engine.accounts().check_mr(s.id, mr.len, &policy) else {
            return Ok(());
        };
        engine.accounts_mut().quota_rejected(&s.tenant, q.quota);
        tracing::warn!(
            tenant = %s.tenant,
            device = %s.device,
            quota = q.quota,
            limit = q.limit,
            used = q.used,
            requested = mr.len,
            "Memory registration refused by the tenant's quota"
        );
        Err(refuse(
            libc::ENOMEM,
            format!(
                "Registering {} bytes exceeds quota {} = {} of tenant {} ({} in use)",
                mr.len, q.quota, q.limit, s.tenant, q.used
            ),
        ))
    }

    /// The GID an address vector names ([`Server::destination`]), refused
    /// unless the session's tenant may reach it ([`Server::check_reachable`]):
    /// one check for a connection at RTR and a UD address handle alike.
    fn reachable_destination(
        &self,
        s: &Session,
        dgid: Gid,
        dlid: Option<u16>,
    ) -> Result<Gid, Refusal> {
        let dgid = self.destination(dgid, dlid)?;
        self.check_reachable(s, &dgid)?;
        Ok(dgid)
    }

    /// The GID an address vector names: its GRH's `dgid`, or — on an
    /// InfiniBand port, without a GRH — the GID of the device whose port
    /// has LID `dlid` (`ENOENT` if none has; `EINVAL` on an Ethernet port,
    /// which has no LIDs). The engine only ever sees GIDs.
    fn destination(&self, dgid: Gid, dlid: Option<u16>) -> Result<Gid, Refusal> {
        let Some(lid) = dlid else {
            return Ok(dgid);
        };
        if self.config.link_layer != PortLinkLayer::Infiniband {
            return Err(refuse(
                libc::EINVAL,
                format!(
                    "LID {lid:#x} names no port: the ports' link layer is Ethernet, an \
                     address vector needs a GRH"
                ),
            ));
        }
        self.registry().gid_of_lid(lid).ok_or_else(|| {
            refuse(
                libc::ENOENT,
                format!("No device with LID {lid:#x} is connected here"),
            )
        })
    }

    /// Refuses a connection towards a GID whose device is outside the
    /// networks the session's tenant may reach (`EACCES`), or towards a GID
    /// no device of this host has (`ENOENT`).
    fn check_reachable(&self, s: &Session, dgid: &Gid) -> Result<(), Refusal> {
        let (mine, theirs) = {
            let reg = self.registry();
            let theirs = match reg.resolve_peer(dgid) {
                Peer::Local(dest) => reg.known.get(&dest.tenant).map(|t| t.network().to_owned()),
                Peer::Remote | Peer::Unknown => {
                    // Another host's device, if the directory knows it.
                    let entry = (self.directory())
                        .zip(vrdma_spec::gid::ipv4_of(dgid))
                        .and_then(|(d, ip)| d.lookup_fresh(ip.into()))
                        .filter(|e| {
                            self.config
                                .fabric
                                .as_ref()
                                .is_some_and(|f| e.host != f.host)
                        });
                    match entry {
                        Some(e) => Some(e.network),
                        None => {
                            return Err(refuse(
                                libc::ENOENT,
                                format!(
                                    "No device with GID {} is connected here or known to the \
                                     directory",
                                    gids::show(dgid)
                                ),
                            ))
                        }
                    }
                }
            };
            (reg.known.get(&s.tenant).cloned(), theirs)
        };
        let reaches = match (&mine, &theirs) {
            (Some(mine), Some(theirs)) => mine.may_reach(theirs),
            _ => false,
        };
        if !reaches {
            return Err(refuse(
                libc::EACCES,
                format!(
                    "GID {} is outside the networks tenant {} may reach",
                    gids::show(dgid),
                    s.tenant
                ),
            ));
        }
        Ok(())
    }

    /// Re-reads and validates the policy file and, if it is valid, puts it
    /// in force: new Hellos, memory registrations and connections follow it
    /// at once, the scheduler applies its classes, weights and rates at
    /// once, and every connected vdev whose tenant's policy changed gets
    /// [`Notification::Policy`]. Nothing that exists is torn down; a
    /// removed tenant's devices keep running on its last policy. If the
    /// file is invalid, the policy in force stays and the error (file,
    /// line, key) is returned.
    ///
    /// Then the directory's cluster file is re-read too (if hostd is in a
    /// cluster), with GIDs without a network resolved through the policy
    /// now in force; its changes follow the policy's, each line starting
    /// with `directory:`. A bad cluster file keeps the directory's view
    /// and fails the reload (the policy, if valid, is in force).
    pub fn reload(&self) -> Result<Reloaded, String> {
        let _one_at_a_time = self.reloading.lock().unwrap_or_else(|e| e.into_inner());
        let directory = self.directory.get();
        let policy = match &self.config.policy_file {
            Some(file) => Some(self.reload_policy(file.clone())),
            None if directory.is_some() => None,
            None => {
                let why = "hostd runs the built-in default policy (no policy file configured): \
                           nothing to reload";
                tracing::error!("Policy reload refused: {why}");
                return Err(why.to_owned());
            }
        };
        let Some(directory) = directory else {
            return policy.unwrap_or_else(|| Err("nothing to reload".to_owned()));
        };
        let cluster_file = directory.cluster_file();
        let in_force = self.policy();
        let dir = directory.reload(&in_force).map_err(|e| {
            let why = vrdma_errors::error_chain(&e);
            tracing::error!("Directory reload failed, the directory's view stays: {why}");
            why
        });
        if let Ok(changes) = &dir {
            tracing::info!(
                file = %cluster_file.display(),
                changes = changes.len(),
                "Directory reloaded"
            );
            for change in changes {
                tracing::info!("Directory change: {change}");
            }
        }
        match (policy, dir) {
            (Some(Err(p)), Err(d)) => Err(format!("{p}; {d}")),
            (Some(Err(why)), Ok(_)) | (_, Err(why)) => Err(why),
            (Some(Ok(mut r)), Ok(changes)) => {
                r.changes
                    .extend(changes.into_iter().map(|c| format!("directory: {c}")));
                Ok(r)
            }
            (None, Ok(changes)) => Ok(Reloaded {
                file: cluster_file,
                changes: changes
                    .into_iter()
                    .map(|c| format!("directory: {c}"))
                    .collect(),
            }),
        }
    }

    /// The policy half of [`Server::reload`].
    fn reload_policy(&self, file: PathBuf) -> Result<Reloaded, String> {
        let new = match crate::policy::load(&file, self.config.physical_qps) {
            Ok(policy) => Arc::new(policy),
            Err(e) => {
                let why = crate::policy::describe(&e);
                tracing::error!("Policy reload failed, the policy in force stays: {why}");
                return Err(why);
            }
        };
        let (old, notify, orphans) = {
            let mut reg = self.registry();
            let old = std::mem::replace(&mut reg.policy, Arc::clone(&new));
            for t in &new.tenants {
                reg.known.insert(t.name.clone(), t.clone());
            }
            let mut notify = Vec::new();
            let mut orphans = Vec::new();
            for c in reg.connected.values() {
                match new.tenant(&c.tenant) {
                    Some(t) if old.tenant(&c.tenant) != Some(t) => {
                        notify.extend(c.contexts.iter().map(|(_, chan)| {
                            (
                                c.tenant.clone(),
                                c.device.clone(),
                                Arc::clone(chan),
                                t.clone(),
                            )
                        }))
                    }
                    Some(_) => {}
                    None if old.tenant(&c.tenant).is_some() => {
                        orphans.push((c.tenant.clone(), c.device.clone()));
                    }
                    None => {}
                }
            }
            (old, notify, orphans)
        };
        self.datapath
            .lock()
            .configure_tenants(&new.tenants, Instant::now());
        for (tenant, device, chan, policy) in notify {
            match chan.send(&Notification::Policy(Box::new(policy)), &[]) {
                Ok(()) => {
                    tracing::info!(tenant, device, "Sent the tenant's new policy to its vdev")
                }
                Err(e) => tracing::warn!(
                    tenant,
                    device,
                    "Cannot send the new policy to the vdev: {}",
                    vrdma_errors::error_chain(&e)
                ),
            }
        }
        for (tenant, device) in orphans {
            tracing::warn!(
                tenant,
                device,
                "Tenant removed from the policy: its connected device keeps running, new devices are refused"
            );
        }
        let changes = crate::policy::diff(&old, &new);
        tracing::info!(
            file = %file.display(),
            changes = changes.len(),
            "Policy reloaded"
        );
        for change in &changes {
            tracing::info!("Policy change: {change}");
        }
        Ok(Reloaded { file, changes })
    }

    /// Every tenant's counters, usage and quotas: the tenants of the
    /// policy in force and every tenant hostd has accounted for.
    pub fn stats(&self) -> Stats {
        let (policy, known, orphans) = {
            let reg = self.registry();
            let mut orphans: HashMap<String, u64> = HashMap::new();
            for device in reg.connected.values() {
                *orphans.entry(device.tenant.clone()).or_default() += device.orphans.len() as u64;
            }
            (Arc::clone(&reg.policy), reg.known.clone(), orphans)
        };
        let now = Instant::now();
        let (accounts, throttled, peers) = {
            let engine = self.datapath.lock();
            let accounts = engine.accounts_snapshot();
            let throttled: HashMap<String, [std::time::Duration; 2]> = known
                .keys()
                .map(|name| (name.clone(), engine.scheduler().throttled(name, now)))
                .collect();
            let peers = engine.wire().map(|w| (w.peers.snapshot(), w.io_counters()));
            (accounts, throttled, peers)
        };
        let (peers, packet_io) = match peers {
            Some((peers, io)) => (self.every_peer_host(peers), Some(io)),
            None => (Vec::new(), None),
        };
        let names: BTreeSet<&str> = policy
            .tenants
            .iter()
            .map(|t| t.name.as_str())
            .chain(accounts.keys().map(String::as_str))
            .collect();
        let tenants = names
            .into_iter()
            .filter_map(|name| {
                let tp = known.get(name)?;
                let account = accounts.get(name).cloned().unwrap_or_default();
                let mut stats = TenantStats::new(
                    &account,
                    tp,
                    policy.tenant(name).is_some(),
                    throttled.get(name).copied().unwrap_or_default(),
                );
                // Contexts of dead vdevs, running on for a successor.
                stats.usage.insert(
                    "orphaned_contexts".into(),
                    orphans.get(name).copied().unwrap_or_default(),
                );
                Some(stats)
            })
            .collect();
        Stats {
            tenants,
            peers,
            packet_io,
        }
    }
}

impl Server {
    /// `peers` (the wire's counters) with a row for every other host of
    /// the cluster, traffic or not, and the row of packets from unknown
    /// sources only when there were such packets.
    fn every_peer_host(&self, mut peers: Vec<PeerStats>) -> Vec<PeerStats> {
        let me = self.config.fabric.as_ref().map(|f| f.host.as_str());
        if let Some(directory) = self.directory() {
            for host in directory.hosts() {
                if Some(host.name.as_str()) != me && !peers.iter().any(|p| p.host == host.name) {
                    peers.push(PeerStats {
                        host: host.name,
                        ..PeerStats::default()
                    });
                }
            }
        }
        peers.retain(|p| !p.host.is_empty() || *p != PeerStats::default());
        peers
    }
}

/// Whether `request` names an object a previous hostd served, which
/// continues from its rings.
fn start_of(request: &Request) -> Start {
    match request {
        Request::ResumeEq { .. }
        | Request::ResumeCq { .. }
        | Request::ResumeQp(_)
        | Request::ResumeSrq(_) => Start::Resumed,
        _ => Start::Fresh,
    }
}

/// Makes hostd's end of a notification channel non-blocking: a vdev that
/// does not read it must not stall a reload.
fn set_nonblocking(chan: &Channel) -> std::io::Result<()> {
    let fd = chan.as_raw_fd();
    // SAFETY: F_GETFL on an fd we own has no memory effects.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: F_SETFL with valid flags on an fd we own.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
