//! The server's side of a handover ([`crate::handover`]): the running
//! hostd stopping and handing over, and the new one giving each context
//! that comes back what was handed over of it.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_hostd_protocol::channel::{Channel, ChannelError};
use vrdma_hostd_protocol::messages::Notification;

use super::registry::Session;
use super::{refuse, Refusal, Server};
use crate::admin::{send_response, AdminRequest, AdminResponse};
use crate::engine::handover::QpTransport;
use crate::engine::{DeviceId, Engine};
use crate::gids::Gid;
use crate::handover::{Blob, HandedContext, Handover, Sockets, BLOB_VERSION, TOKEN_LIFETIME};

/// How long the running hostd waits, stopped, for the new one to say it
/// took everything; then it carries on.
const TAKE_WAIT: Duration = Duration::from_secs(5);

/// Descriptors of the sockets a hostd hands over (taken before its
/// sandbox: they are what the next hostd gets).
#[derive(Debug)]
pub struct HandoverSockets {
    pub listener: OwnedFd,
    pub admin: OwnedFd,
    pub udp: Option<OwnedFd>,
    pub metrics: Option<OwnedFd>,
}

/// What a new hostd took over and its vdevs have not claimed yet.
#[derive(Debug, Default)]
pub(super) struct Handed {
    contexts: HashMap<String, HandedContext>,
    until: Option<Instant>,
}

impl Server {
    /// The sockets to hand over should a new hostd ask; set once, before
    /// serving.
    pub fn set_handover_sockets(&self, sockets: HandoverSockets) {
        if self.handover_sockets.set(sockets).is_err() {
            tracing::error!("The sockets to hand over were set twice: the first stay");
        }
    }

    /// This hostd took over `handover` from a previous one: each context
    /// it names may claim its state for [`TOKEN_LIFETIME`].
    pub fn set_handed(&self, handover: Handover) {
        let until = Instant::now() + TOKEN_LIFETIME;
        let contexts = handover.contexts.len();
        let qps: usize = handover.contexts.values().map(|c| c.qps.len()).sum();
        tracing::info!(
            contexts,
            qps,
            "Took over from the previous hostd; waiting for its vdevs"
        );
        if contexts > 0 {
            self.datapath.lock().set_resuming(Some(until));
        }
        *self.handed() = Handed {
            contexts: handover.contexts,
            until: Some(until),
        };
    }

    fn handed(&self) -> std::sync::MutexGuard<'_, Handed> {
        self.handed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The GID device `device` of `tenant` had before a handover (if its
    /// contexts are still coming back), and the GIDs the others coming
    /// back had.
    pub(super) fn handed_gids(
        &self,
        tenant: &str,
        device: &str,
    ) -> (Option<Gid>, std::collections::HashSet<Gid>) {
        let handed = self.handed();
        if handed.until.is_none_or(|t| t <= Instant::now()) {
            return (None, Default::default());
        }
        let mut own = None;
        let mut others = std::collections::HashSet::new();
        for c in handed.contexts.values() {
            if c.tenant == tenant && c.device == device {
                own = Some(c.gid);
            } else {
                others.insert(c.gid);
            }
        }
        (own, others)
    }

    /// Context `s` registered again after a handover and presents `token`:
    /// its QPs get their transport back as vdev brings each to its state.
    /// Refused for another device's token (`EACCES`: nothing of it is
    /// given, and it stays for its own context) and for an unknown or
    /// expired one (`ENOENT`).
    pub(super) fn resume_handover(
        &self,
        channel: &Channel,
        s: &mut Session,
        token: &str,
    ) -> Result<usize, Refusal> {
        let pid = channel.peer_cred().ok().map(|c| c.pid);
        let mut handed = self.handed();
        if handed.until.is_some_and(|t| t <= Instant::now()) {
            handed.contexts.clear();
        }
        let Some(c) = handed.contexts.get(token) else {
            return Err(refuse(
                libc::ENOENT,
                "No context was handed over under this token (or it expired)",
            ));
        };
        let same_vdev = c.pid.is_none() || pid.is_none() || c.pid == pid;
        if c.tenant != s.tenant || c.device != s.device || !same_vdev {
            tracing::warn!(tenant = %s.tenant, device = %s.device,
                "A vdev presented another device's handover token; refused");
            return Err(refuse(
                libc::EACCES,
                "The handover token is another device's",
            ));
        }
        let Some(c) = handed.contexts.remove(token) else {
            return Err(refuse(libc::ENOENT, "The handover token went meanwhile"));
        };
        if handed.contexts.is_empty() {
            // Every context is back: a missing local peer is gone for good.
            self.datapath.lock().set_resuming(None);
        }
        drop(handed);
        let qps = c.qps.len();
        s.handed = c.qps.into_iter().map(|q| (q.vqpn, q)).collect();
        tracing::info!(tenant = %s.tenant, device = %s.device, qps,
            "Context back after the handover");
        Ok(qps)
    }

    /// After QP `vqpn` of context `s` moved to `state`: if that is the
    /// state it was handed over in, it gets its transport back now (its
    /// vdev brings it there through the states before). A transport that
    /// does not fit puts the QP in ERR: a connection numbered afresh would
    /// corrupt what the peer receives.
    pub(super) fn resume_qp(
        engine: &mut Engine,
        id: DeviceId,
        handed: &mut HashMap<u32, QpTransport>,
        vqpn: u32,
        state: u8,
    ) {
        let err = u8::from(vrdma_spec::verbs::QpState::Err);
        match handed.get(&vqpn) {
            // It had gone to ERR on the datapath (vdev's view was older):
            // it goes there again rather than run.
            Some(t) if t.state == err && state != err => {}
            Some(t) if t.state == state => {}
            _ => return,
        }
        let Some(t) = handed.remove(&vqpn) else {
            return;
        };
        let failed = if t.state == err && state != err {
            Err(crate::engine::EngineError::Invalid(
                "the QP was in ERR when it was handed over",
            ))
        } else {
            engine.resume_transport(id, &t)
        };
        if failed.is_ok() {
            tracing::debug!(
                device = id,
                vqpn,
                state,
                "The QP carries on after the handover"
            );
        }
        if let Err(e) = failed {
            tracing::warn!(
                device = id,
                vqpn,
                "The QP cannot carry on after the handover: {e}"
            );
            let err = vrdma_hostd_protocol::messages::QpModify {
                vqpn,
                state: vrdma_spec::verbs::QpState::Err.into(),
                connection: None,
                access: None,
                qkey: None,
            };
            let _ = engine.modify_qp(id, &err);
        }
    }

    /// A new hostd asked on `chan` to take over: the datapath stops (this
    /// thread holds its lock, and the registry's, from here on), the
    /// sockets and the blob go to the new hostd, and once it says it took
    /// them each context gets its token and the process exits. Returns only
    /// when the handover did not happen (why): then everything carries on.
    pub(crate) fn hand_over(&self, chan: &Channel) -> String {
        let Some(sockets) = self.handover_sockets.get() else {
            return "this hostd kept no sockets to hand over".into();
        };
        let reg = self.registry();
        let engine = self.datapath.lock();
        let started = Instant::now();
        let mut contexts = Vec::new();
        let mut notices: Vec<(Arc<Channel>, String, String)> = Vec::new();
        let mut orphans = 0;
        for device in reg.connected.values() {
            orphans += device.orphans.len();
            for (id, notify) in &device.contexts {
                let token = match random_token() {
                    Ok(t) => t,
                    Err(e) => return format!("no random token: {e}"),
                };
                contexts.push(HandedContext {
                    token: token.clone(),
                    tenant: device.tenant.clone(),
                    device: device.device.clone(),
                    gid: device.gid,
                    pid: device.pid,
                    qps: engine.handover_qps(*id),
                });
                notices.push((Arc::clone(notify), token, device.tenant.clone()));
            }
        }
        let blob = match serde_json::to_string(&Blob {
            version: BLOB_VERSION,
            contexts,
        }) {
            Ok(b) => b,
            Err(e) => return format!("cannot encode the blob: {e}"),
        };
        let mut fds = vec![sockets.listener.as_raw_fd(), sockets.admin.as_raw_fd()];
        fds.extend(sockets.udp.as_ref().map(AsRawFd::as_raw_fd));
        fds.extend(sockets.metrics.as_ref().map(AsRawFd::as_raw_fd));
        let listed = Sockets {
            udp: sockets.udp.is_some(),
            metrics: sockets.metrics.is_some(),
        };
        if let Err(e) = chan.send(&listed, &fds) {
            return format!("cannot send the sockets: {e}");
        }
        if let Err(e) = send_response(chan, &AdminResponse::Handover { blob }) {
            return format!("cannot send the blob: {e}");
        }
        if let Err(why) = wait_taken(chan) {
            return why;
        }
        for (notify, token, tenant) in notices {
            if let Err(e) = notify.send(&Notification::Handover { token }, &[]) {
                // Its vdev sees hostd go as after a crash.
                tracing::warn!(%tenant, "A context cannot be told of the handover: {e}");
            }
        }
        tracing::info!(
            contexts = reg
                .connected
                .values()
                .map(|d| d.contexts.len())
                .sum::<usize>(),
            orphans_released = orphans,
            stopped_us = started.elapsed().as_micros() as u64,
            "Handed over to the new hostd; exiting"
        );
        // Exits holding both locks (exit runs no destructor): no datapath
        // round runs after the state was handed over — one would send
        // packets and take acknowledgements the new hostd knows nothing
        // of, and the peers' and the new hostd's PSNs would part.
        let _held = (engine, reg);
        std::process::exit(0)
    }
}

/// Waits (at most [`TAKE_WAIT`]) for the new hostd to say it took what was
/// handed over; polling a non-blocking socket, which the admin thread's
/// filter allows (no `poll`).
fn wait_taken(chan: &Channel) -> Result<(), String> {
    if let Err(e) = super::set_nonblocking(chan) {
        return Err(format!("cannot wait for the new hostd: {e}"));
    }
    let deadline = Instant::now() + TAKE_WAIT;
    loop {
        match chan.recv::<AdminRequest>() {
            Ok((AdminRequest::HandoverTaken, _)) => return Ok(()),
            Ok((other, _)) => return Err(format!("the new hostd answered {other:?}")),
            Err(ChannelError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "the new hostd did not take over within {} s",
                        TAKE_WAIT.as_secs()
                    ));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => return Err(format!("the new hostd went: {e}")),
        }
    }
}

/// 128 random bits as 32 hex digits.
fn random_token() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    crate::ids::os_random(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
