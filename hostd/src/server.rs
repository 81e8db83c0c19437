//! The control socket: vdevs connect, say `Hello`, and then ask for memory,
//! memory regions and QPs, one request at a time, each answered with exactly
//! one response.
//!
//! This is where tenant policy lives: the tenant must be configured, the
//! peer's kernel-reported uid must match the tenant's, and a QP may only be
//! connected to a device whose tenant's network this tenant reaches. Every
//! request is validated before the NIC sees it and refused with a real
//! errno. A vdev that breaks the protocol (undecodable message) or corrupts
//! a ring is disconnected; on any disconnect everything it had — QPs, keys,
//! memory, pQPs — is torn down while other vdevs keep running.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use vrdma_hostd_protocol::channel::{Channel, ChannelError, Listener};
use vrdma_hostd_protocol::messages::{QueueGrant, Request, Response, Welcome, PROTOCOL_VERSION};
use vrdma_hostd_protocol::shm::{sealed_memfd, QueueLayout, SharedMapping, ShmError};

use crate::config::{Config, Tenant};
use crate::datapath::{Datapath, DeviceQueues, QueueMem};
use crate::nic::{DeviceId, NicError};

/// Largest LID (unicast range 0x0001–0xbfff).
const MAX_LID: u16 = 0xbfff;
/// Concurrent vdev connections (each costs a thread).
const MAX_CONNECTIONS: usize = 1024;

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

impl From<NicError> for Refusal {
    fn from(e: NicError) -> Self {
        refuse(e.errno(), e.to_string())
    }
}

fn shm_refusal(e: ShmError) -> Refusal {
    let errno = match &e {
        ShmError::NotSealed | ShmError::TooSmall { .. } => libc::EINVAL,
        ShmError::Map(io) | ShmError::Create(io) => io.raw_os_error().unwrap_or(libc::ENOMEM),
        ShmError::Corrupt { .. } => libc::EPROTO,
    };
    refuse(errno, crate::error_chain(&e))
}

/// Host-wide bookkeeping of devices.
#[derive(Debug, Default)]
struct Registry {
    /// LIDs ever assigned, stable per (tenant, device) while hostd runs.
    lids: HashMap<(String, String), u16>,
    next_lid: u16,
    /// Connected devices by LID: their tenant's name.
    connected: HashMap<u16, String>,
    free_pqps: BTreeSet<u32>,
    next_device: DeviceId,
}

/// What a vdev holds once greeted.
#[derive(Debug)]
struct Session {
    id: DeviceId,
    lid: u16,
    tenant: Tenant,
    device: String,
    pqps: Vec<u32>,
}

/// The control server.
pub struct Server {
    config: Config,
    datapath: Arc<Datapath>,
    registry: Mutex<Registry>,
    connections: AtomicUsize,
}

impl Server {
    /// A server for `config` over `datapath`.
    pub fn new(config: Config, datapath: Arc<Datapath>) -> Arc<Self> {
        let registry = Registry {
            next_lid: 1,
            next_device: 1,
            free_pqps: (0..config.physical_qps).collect(),
            ..Registry::default()
        };
        Arc::new(Server {
            config,
            datapath,
            registry: Mutex::new(registry),
            connections: AtomicUsize::new(0),
        })
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Accepts vdevs forever, one thread each.
    pub fn serve(self: &Arc<Self>, listener: &Listener) {
        loop {
            let channel = match listener.accept() {
                Ok(channel) => channel,
                Err(e) => {
                    tracing::warn!("Accept failed: {}", crate::error_chain(&e));
                    // EMFILE and friends: do not spin on them.
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
            };
            if self.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                self.connections.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("Too many vdev connections; closing a new one");
                continue;
            }
            let server = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name("vdev-conn".into())
                .spawn(move || {
                    server.connection(Arc::new(channel));
                    server.connections.fetch_sub(1, Ordering::SeqCst);
                });
            if let Err(e) = spawned {
                self.connections.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("Cannot start a connection thread: {e}");
            }
        }
    }

    /// Serves one vdev until it disconnects or breaks the protocol, then
    /// tears down everything it had.
    pub fn connection(&self, channel: Arc<Channel>) {
        let mut session: Option<Session> = None;
        loop {
            let (request, files) = match channel.recv::<Request>() {
                Ok(received) => received,
                Err(ChannelError::Message(e)) => {
                    // Undecodable: answer once, then hang up, since nothing
                    // after it can be trusted to be framed as intended.
                    let why = crate::error_chain(&e);
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
            let mut keep: Vec<File> = Vec::new();
            let response = match self.handle(&channel, &mut session, request, files, &mut keep) {
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
            let mut fds: Vec<RawFd> = keep.iter().map(|f| f.as_raw_fd()).collect();
            if let (Response::Welcome(_), Some(s)) = (&response, &session) {
                // Take the device out of the core first: the send below may
                // block on a vdev that does not read, and must not do so
                // while holding the datapath's lock.
                let dev = self.datapath.lock().device(s.id);
                if let Some(dev) = dev {
                    fds.push(dev.doorbell.as_raw_fd());
                    fds.push(dev.completion.as_raw_fd());
                    if channel.send(&response, &fds).is_err() {
                        break;
                    }
                    continue;
                }
            }
            if channel.send(&response, &fds).is_err() {
                break;
            }
        }
        if let Some(s) = session {
            self.teardown(&s);
        }
    }

    fn teardown(&self, s: &Session) {
        // The datapath lets go of the rings first; only then are the pQPs
        // free for another vdev.
        self.datapath.remove_device(s.id);
        let mut reg = self.registry();
        reg.connected.remove(&s.lid);
        reg.free_pqps.extend(s.pqps.iter().copied());
        tracing::info!(
            tenant = %s.tenant.name,
            device = %s.device,
            lid = s.lid,
            "vdev disconnected"
        );
    }

    fn handle(
        &self,
        channel: &Arc<Channel>,
        session: &mut Option<Session>,
        request: Request,
        mut files: Vec<File>,
        keep: &mut Vec<File>,
    ) -> Result<Response, Refusal> {
        let takes_fd = matches!(request, Request::AddMemory { .. });
        if !takes_fd && !files.is_empty() {
            return Err(refuse(
                libc::EINVAL,
                "This request carries no file descriptors",
            ));
        }
        if let Request::Hello {
            version,
            tenant,
            device,
        } = request
        {
            if session.is_some() {
                return Err(refuse(libc::EPROTO, "Hello was already received"));
            }
            let (new, welcome, memfds) = self.hello(channel, version, &tenant, &device)?;
            *session = Some(new);
            keep.extend(memfds);
            return Ok(Response::Welcome(welcome));
        }
        let Some(s) = session.as_ref() else {
            return Err(refuse(libc::EPROTO, "The first request must be Hello"));
        };
        let id = s.id;
        match request {
            Request::Hello { .. } => Err(refuse(libc::EPROTO, "Hello was already received")),
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
                let mem = SharedMapping::map(file, file_offset, len).map_err(shm_refusal)?;
                self.datapath.lock().nic().add_memory(id, slot, mem)?;
                tracing::debug!(device = id, slot, gpa, len, "Memory slot added");
                Ok(Response::Ok)
            }
            Request::RemoveMemory { slot } => {
                self.datapath.lock().nic().remove_memory(id, slot)?;
                Ok(Response::Ok)
            }
            Request::RegisterMr(mr) => {
                self.datapath.lock().nic().register_mr(id, &mr)?;
                Ok(Response::Ok)
            }
            Request::DeregisterMr { lkey } => {
                self.datapath.lock().nic().deregister_mr(id, lkey)?;
                Ok(Response::Ok)
            }
            Request::CreateQp { vqpn, pd, pqp } => {
                if !s.pqps.contains(&pqp) {
                    return Err(NicError::ForeignPqp(pqp).into());
                }
                self.datapath.lock().nic().create_qp(id, vqpn, pd, pqp)?;
                Ok(Response::Ok)
            }
            Request::ConnectQp(conn) => {
                let dest_tenant = self
                    .registry()
                    .connected
                    .get(&conn.dest_lid)
                    .cloned()
                    .ok_or_else(|| {
                        refuse(
                            libc::ENOENT,
                            format!("No device with LID {:#x} is connected", conn.dest_lid),
                        )
                    })?;
                let network = self
                    .config
                    .tenant(&dest_tenant)
                    .map(|t| t.network.as_str())
                    .unwrap_or_default();
                if !s.tenant.reaches(network) {
                    return Err(refuse(
                        libc::EACCES,
                        format!(
                            "LID {:#x} is outside the networks tenant {} may reach",
                            conn.dest_lid, s.tenant.name
                        ),
                    ));
                }
                self.datapath.lock().nic().connect_qp(id, &conn)?;
                Ok(Response::Ok)
            }
            Request::SetQpAccess { vqpn, access } => {
                self.datapath.lock().nic().set_qp_access(id, vqpn, access)?;
                Ok(Response::Ok)
            }
            Request::ErrorQp { vqpn } => {
                self.datapath.lock().nic().error_qp(id, vqpn)?;
                // Flush completions wait in the NIC: let the datapath move them.
                self.datapath.wake();
                Ok(Response::Ok)
            }
            Request::ResetQp { vqpn } => {
                self.datapath.lock().nic().reset_qp(id, vqpn)?;
                Ok(Response::Ok)
            }
            Request::DestroyQp { vqpn } => {
                self.datapath.lock().nic().destroy_qp(id, vqpn)?;
                Ok(Response::Ok)
            }
        }
    }

    /// Checks a Hello, assigns the LID, grants pQPs and starts serving
    /// the device's rings. Returns the session, the Welcome and the queue
    /// memfds to send.
    fn hello(
        &self,
        channel: &Arc<Channel>,
        version: u32,
        tenant: &str,
        device: &str,
    ) -> Result<(Session, Welcome, Vec<File>), Refusal> {
        if version != PROTOCOL_VERSION {
            return Err(refuse(
                libc::EPROTO,
                format!("Protocol version {version} is not {PROTOCOL_VERSION}"),
            ));
        }
        let Some(tenant) = self.config.tenant(tenant).cloned() else {
            return Err(refuse(libc::EACCES, format!("Unknown tenant {tenant:?}")));
        };
        let device_ok = (1..=64).contains(&device.len())
            && device
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !device_ok {
            return Err(refuse(
                libc::EINVAL,
                "Device name must be 1-64 characters of [A-Za-z0-9_.-]",
            ));
        }
        if let Some(uid) = tenant.uid {
            let cred = channel
                .peer_cred()
                .map_err(|e| refuse(libc::EPERM, crate::error_chain(&e)))?;
            if cred.uid != uid {
                return Err(refuse(
                    libc::EPERM,
                    format!("Tenant {} must connect as uid {uid}", tenant.name),
                ));
            }
        }
        let (id, lid, pqps) = {
            let mut reg = self.registry();
            let key = (tenant.name.clone(), device.to_owned());
            let lid = match reg.lids.get(&key) {
                Some(&lid) => lid,
                None if reg.next_lid > MAX_LID => {
                    return Err(refuse(libc::ENOSPC, "No LID left on this host"));
                }
                None => reg.next_lid,
            };
            if reg.connected.contains_key(&lid) {
                return Err(refuse(
                    libc::EBUSY,
                    format!(
                        "Device {device} of tenant {} is already connected",
                        tenant.name
                    ),
                ));
            }
            let wanted = self.config.queues_per_device as usize;
            if reg.free_pqps.len() < wanted {
                return Err(refuse(
                    libc::ENOSPC,
                    format!(
                        "{} physical QPs are free, {wanted} needed",
                        reg.free_pqps.len()
                    ),
                ));
            }
            let pqps: Vec<u32> = reg.free_pqps.iter().take(wanted).copied().collect();
            for pqp in &pqps {
                reg.free_pqps.remove(pqp);
            }
            if let std::collections::hash_map::Entry::Vacant(slot) = reg.lids.entry(key) {
                slot.insert(lid);
                reg.next_lid += 1;
            }
            reg.connected.insert(lid, tenant.name.clone());
            let id = reg.next_device;
            reg.next_device += 1;
            (id, lid, pqps)
        };
        let session = Session {
            id,
            lid,
            tenant,
            device: device.to_owned(),
            pqps,
        };
        match self.start_device(channel, &session) {
            Ok((welcome, memfds)) => {
                tracing::info!(
                    tenant = %session.tenant.name,
                    device,
                    lid,
                    pqps = ?session.pqps,
                    "vdev connected"
                );
                Ok((session, welcome, memfds))
            }
            Err(refusal) => {
                self.teardown(&session);
                Err(refusal)
            }
        }
    }

    fn start_device(
        &self,
        channel: &Arc<Channel>,
        s: &Session,
    ) -> Result<(Welcome, Vec<File>), Refusal> {
        let layout = QueueLayout::new(self.config.sq_depth, self.config.cq_depth);
        let mut queues = Vec::new();
        let mut memfds = Vec::new();
        for &pqp in &s.pqps {
            let file = sealed_memfd(&format!("vrdma-pqp-{pqp}"), layout.bytes() as u64)
                .map_err(shm_refusal)?;
            let dup = file
                .try_clone()
                .map_err(|e| refuse(e.raw_os_error().unwrap_or(libc::ENOMEM), e.to_string()))?;
            let mem = SharedMapping::map(dup, 0, layout.bytes() as u64).map_err(shm_refusal)?;
            queues.push(QueueMem { pqp, mem });
            memfds.push(file);
        }
        let dev = DeviceQueues::new(s.id, layout, queues, Arc::clone(channel))
            .map_err(|e| refuse(e.raw_os_error().unwrap_or(libc::ENOMEM), e.to_string()))?;
        self.datapath
            .lock()
            .nic()
            .attach_device(s.id, s.lid, &s.pqps)?;
        self.datapath.add_device(Arc::new(dev));
        let welcome = Welcome {
            lid: s.lid,
            queues: s
                .pqps
                .iter()
                .map(|&pqp| QueueGrant {
                    pqp,
                    sq_depth: self.config.sq_depth,
                    cq_depth: self.config.cq_depth,
                })
                .collect(),
        };
        Ok((welcome, memfds))
    }
}
