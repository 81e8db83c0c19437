//! Devices and their contexts as hostd knows them: the registry (LIDs,
//! GIDs, physical queues, who is connected), the greeting that registers a
//! device or opens another context of it, and the teardown when a
//! context's connection closes (the device goes with its last context).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use vrdma_hostd_protocol::channel::Channel;
use vrdma_hostd_protocol::messages::{ContextKey, PortLinkLayer, Welcome, PROTOCOL_VERSION};
use vrdma_tenant_policy::{Policy, TenantPolicy};

use super::journal::{ContextJournal, Orphan};
use super::{refuse, set_nonblocking, Refusal, Server, MAX_CONTEXTS_PER_DEVICE};
use crate::config::MAX_QUEUES_PER_DEVICE;
use crate::engine::{Address, DeviceId};
use crate::gids::{self, Gid, Peer};
use crate::lids::LidTable;

/// A connected device as the registry knows it: one or more contexts
/// (registrations of the same vdev process), which share its LID, GID
/// and physical queues.
#[derive(Debug)]
pub(super) struct Connected {
    pub(super) tenant: String,
    pub(super) device: String,
    /// The vdev process (from the socket's credentials): only it may add
    /// contexts.
    pub(super) pid: Option<i32>,
    pub(super) gid: Gid,
    pub(super) pqps: Vec<u32>,
    /// Each context's datapath device and hostd's end of its notification
    /// channel (non-blocking).
    pub(super) contexts: Vec<(DeviceId, Arc<Channel>)>,
    /// Contexts whose vdev died, running on for its successor.
    pub(super) orphans: Vec<Orphan>,
    /// The bytes its contexts' journals hold together.
    pub(super) journal_bytes: Arc<std::sync::atomic::AtomicUsize>,
}

/// Host-wide bookkeeping of devices, and the policy in force.
#[derive(Debug)]
pub(super) struct Registry {
    /// LIDs by (tenant, device), bounded per tenant.
    pub(super) lids: LidTable,
    /// Connected devices by LID.
    pub(super) connected: HashMap<u16, Connected>,
    /// The LIDs of connected devices by GID.
    pub(super) by_gid: HashMap<Gid, u16>,
    pub(super) free_pqps: BTreeSet<u32>,
    pub(super) next_device: DeviceId,
    /// The policy in force: who may connect, with what.
    pub(super) policy: Arc<Policy>,
    /// The last policy of every tenant ever in force: the current one's,
    /// and a removed tenant's last (its connected devices keep it).
    pub(super) known: HashMap<String, TenantPolicy>,
}

impl Registry {
    /// What a connection towards `dgid` reaches: a device of this host,
    /// one of another host, or nothing known.
    pub(super) fn resolve_peer(&self, dgid: &Gid) -> Peer<&Connected> {
        match self
            .by_gid
            .get(dgid)
            .and_then(|lid| self.connected.get(lid))
        {
            Some(device) => Peer::Local(device),
            None => Peer::Unknown,
        }
    }

    /// The GID of the device connected with LID `lid`.
    pub(super) fn gid_of_lid(&self, lid: u16) -> Option<Gid> {
        self.connected.get(&lid).map(|c| c.gid)
    }

    /// Devices of `tenant` connected now.
    pub(super) fn devices_of(&self, tenant: &str) -> usize {
        self.connected
            .values()
            .filter(|c| c.tenant == tenant)
            .count()
    }

    /// Physical QPs kept free for the devices other tenants of the policy
    /// may still connect, so that whatever one tenant (or a compromised
    /// vdev of it) registers, the others get what the policy promises:
    /// - when every tenant's `max_devices` × `physical_queues` fit in the
    ///   NIC's `physical_qps`, all the devices each other tenant may still
    ///   connect;
    /// - else, when every tenant's first device fits, the first device of
    ///   each other tenant that has none connected;
    /// - else (an over-committed policy) nothing: first come, first served.
    pub(super) fn reserved_for_others(&self, tenant: &str, physical_qps: u32) -> usize {
        let queues = |t: &TenantPolicy| t.physical_queues.min(MAX_QUEUES_PER_DEVICE) as usize;
        let physical_qps = physical_qps as usize;
        let others = || self.policy.tenants.iter().filter(|t| t.name != tenant);
        let all_devices: usize = (self.policy.tenants.iter())
            .map(|t| t.max_devices as usize * queues(t))
            .sum();
        if all_devices <= physical_qps {
            return others()
                .map(|t| {
                    (t.max_devices as usize).saturating_sub(self.devices_of(&t.name)) * queues(t)
                })
                .sum();
        }
        let first_devices: usize = self.policy.tenants.iter().map(queues).sum();
        if first_devices <= physical_qps {
            return others()
                .filter(|t| self.devices_of(&t.name) == 0)
                .map(queues)
                .sum();
        }
        0
    }
}

/// What a vdev holds once greeted.
#[derive(Debug)]
pub(super) struct Session {
    pub(super) id: DeviceId,
    pub(super) lid: u16,
    pub(super) gid: Gid,
    pub(super) tenant: String,
    pub(super) device: String,
    pub(super) pqps: Vec<u32>,
    /// What the next vdev needs should this one die.
    pub(super) journal: ContextJournal,
    /// vdev ended the context on purpose ([`Request::Release`]).
    ///
    /// [`Request::Release`]: vrdma_hostd_protocol::messages::Request::Release
    pub(super) released: bool,
    /// An object was created on this context: it can no longer adopt
    /// another.
    pub(super) created: bool,
    /// The transport of its QPs a previous hostd handed over, by QP
    /// number, until each is back in its state.
    pub(super) handed: HashMap<u32, crate::engine::handover::QpTransport>,
    /// hostd's end of the context's notification channel, on which vdev
    /// also sends its journal (read before each request and at the end).
    pub(super) notify: Arc<Channel>,
}

impl Server {
    /// Context `s`'s vdev is gone without releasing it: if it can be taken
    /// over, it is kept running for the grace period; else torn down.
    pub(super) fn context_lost(&self, s: Session) {
        let grace = self.config.orphan_grace;
        let key = match s.journal.adoptable() {
            Ok(key) if !s.released && !grace.is_zero() => key,
            Ok(_) => return self.teardown(&s),
            Err(why) => {
                if !s.released {
                    tracing::info!(tenant = %s.tenant, device = %s.device, lid = s.lid,
                        "vdev gone; its context is not kept for a successor: {why}");
                }
                return self.teardown(&s);
            }
        };
        let records = s.journal.len();
        let mut reg = self.registry();
        let Some(device) = reg.connected.get_mut(&s.lid) else {
            drop(reg);
            return self.teardown(&s);
        };
        device.contexts.retain(|(id, _)| *id != s.id);
        // The same key twice (a frontend that re-created its control
        // queue where the old one was): the newer context is the one.
        let stale: Vec<Orphan> = device.orphans.extract_if(.., |o| o.key == key).collect();
        let id = s.id;
        tracing::info!(tenant = %s.tenant, device = %s.device, lid = s.lid, context = id,
            records, grace_ms = grace.as_millis() as u64,
            "vdev gone; its context runs on, kept for the next vdev of the device");
        device.orphans.push(Orphan {
            session: s,
            key,
            until: std::time::Instant::now() + grace,
        });
        drop(reg);
        for o in stale {
            self.teardown(&o.session);
        }
        self.orphans_changed.notify_all();
    }

    /// Tears down the orphans whose grace period ended.
    pub(super) fn expire_orphans(&self) {
        let now = std::time::Instant::now();
        let mut expired = Vec::new();
        {
            let mut reg = self.registry();
            for device in reg.connected.values_mut() {
                expired.extend(device.orphans.extract_if(.., |o| o.until <= now));
            }
        }
        for o in expired {
            tracing::info!(tenant = %o.session.tenant, device = %o.session.device,
                lid = o.session.lid, context = o.session.id,
                "No vdev took the context over in its grace period; released");
            // Its entry is gone from the registry already: teardown
            // detaches it and frees the device with its last context.
            self.teardown(&o.session);
        }
    }

    /// Context `s` (created nothing yet) takes over its device's orphan
    /// keyed `key`: `s` serves the orphan's datapath device from now on,
    /// with its journal, and its own empty one goes.
    pub(super) fn adopt(&self, s: &mut Session, key: ContextKey) -> Result<usize, Refusal> {
        if s.created {
            return Err(refuse(
                libc::EBUSY,
                "Adopt comes before the context creates anything",
            ));
        }
        let orphan = {
            let mut reg = self.registry();
            let device = reg
                .connected
                .get_mut(&s.lid)
                .filter(|d| d.tenant == s.tenant && d.device == s.device);
            let Some(device) = device else {
                return Err(refuse(libc::ENOENT, "The device has no orphaned context"));
            };
            let Some(at) = device.orphans.iter().position(|o| o.key == key) else {
                return Err(refuse(
                    libc::ENOENT,
                    "No orphaned context of the device has this key",
                ));
            };
            let orphan = device.orphans.swap_remove(at);
            for entry in device.contexts.iter_mut().filter(|(id, _)| *id == s.id) {
                entry.0 = orphan.session.id;
            }
            orphan
        };
        let fresh = std::mem::replace(&mut s.id, orphan.session.id);
        self.datapath.lock().detach_device(fresh);
        self.datapath.wake();
        s.journal = orphan.session.journal;
        let records = s.journal.len();
        tracing::info!(tenant = %s.tenant, device = %s.device, lid = s.lid, context = s.id,
            records, "A new vdev took over an orphaned context");
        Ok(records)
    }

    /// Context `s` runs a fresh driver on the control queue keyed `key`:
    /// an orphan of the device under that key is history (its driver was
    /// reset, e.g. a VM rebooted while no vdev ran) and goes now.
    pub(super) fn supersede(&self, s: &Session, key: ContextKey) {
        let stale: Vec<Orphan> = {
            let mut reg = self.registry();
            let Some(device) = reg.connected.get_mut(&s.lid) else {
                return;
            };
            device.orphans.extract_if(.., |o| o.key == key).collect()
        };
        for o in stale {
            tracing::info!(tenant = %s.tenant, device = %s.device, context = o.session.id,
                "A fresh driver took the place of an orphaned context; released");
            self.teardown(&o.session);
        }
    }

    pub(super) fn teardown(&self, s: &Session) {
        // The datapath lets go of the rings first; only then are the pQPs
        // free for another vdev.
        self.datapath.lock().detach_device(s.id);
        self.datapath.wake();
        let mut reg = self.registry();
        let Some(device) = reg.connected.get_mut(&s.lid) else {
            return;
        };
        device.contexts.retain(|(id, _)| *id != s.id);
        device.orphans.retain(|o| o.session.id != s.id);
        if !device.contexts.is_empty() || !device.orphans.is_empty() {
            tracing::info!(
                tenant = %s.tenant,
                device = %s.device,
                lid = s.lid,
                contexts = device.contexts.len(),
                "Device context closed; the device's other contexts go on"
            );
            return;
        }
        reg.connected.remove(&s.lid);
        reg.by_gid.remove(&s.gid);
        drop(reg);
        if let (Some(directory), Some(ip)) = (self.directory(), vrdma_spec::gid::ipv4_of(&s.gid)) {
            if let Err(e) = directory.withdraw(ip.into()) {
                tracing::warn!(
                    tenant = %s.tenant,
                    device = %s.device,
                    "The directory did not take the GID back: {}",
                    vrdma_errors::error_chain(&e)
                );
            }
        }
        let mut reg = self.registry();
        reg.free_pqps.extend(s.pqps.iter().copied());
        tracing::info!(
            tenant = %s.tenant,
            device = %s.device,
            lid = s.lid,
            gid = %gids::show(&s.gid),
            "vdev disconnected"
        );
    }

    /// Checks a Hello, assigns the LID and GID, grants pQPs and starts serving
    /// the device's rings. Returns the session, the Welcome and the vdev's
    /// end of the notification channel to send. `shared` (an OpenContext):
    /// if the device is connected, this is another context of it, which
    /// gets its LID, GID and pQPs.
    pub(super) fn hello(
        &self,
        channel: &Arc<Channel>,
        version: u32,
        tenant: &str,
        device: &str,
        shared: bool,
    ) -> Result<(Session, Welcome, Channel), Refusal> {
        if version != PROTOCOL_VERSION {
            return Err(refuse(
                libc::EPROTO,
                format!("Protocol version {version} is not {PROTOCOL_VERSION}"),
            ));
        }
        // The same rule as tenant names: a device name is part of labels
        // and (in vdev) of paths.
        if !vrdma_tenant_policy::is_valid_name(device) {
            return Err(refuse(
                libc::EINVAL,
                "Device name must be 1-64 characters of [A-Za-z0-9_.-], the first not . or -",
            ));
        }
        let cred = channel.peer_cred();
        let (ours, theirs) =
            Channel::pair().map_err(|e| refuse(libc::ENOMEM, vrdma_errors::error_chain(&e)))?;
        set_nonblocking(&ours).map_err(|e| refuse(libc::ENOMEM, e.to_string()))?;
        let ours = Arc::new(ours);
        let (id, lid, gid, pqps, policy, first, journal_bytes) = {
            let mut reg = self.registry();
            // Read under the registry lock: a reload either happened before
            // (this device gets the new policy) or notifies it afterwards.
            let Some(policy) = reg.policy.tenant(tenant).cloned() else {
                return Err(refuse(
                    libc::EACCES,
                    format!("Tenant {tenant:?} is not in the policy"),
                ));
            };
            if let Some(uid) = policy.uid {
                match &cred {
                    Ok(c) if c.uid == uid => {}
                    Ok(_) => {
                        return Err(refuse(
                            libc::EPERM,
                            format!("Tenant {tenant} must connect as uid {uid}"),
                        ));
                    }
                    Err(e) => return Err(refuse(libc::EPERM, vrdma_errors::error_chain(e))),
                }
            }
            let assignment = reg
                .lids
                .assign(tenant, device, |lid| reg.connected.contains_key(&lid))
                .map_err(|e| refuse(libc::ENOSPC, e.to_string()))?;
            let lid = assignment.lid;
            let pid = cred.as_ref().ok().map(|c| c.pid);
            if let Some(open) = reg.connected.get(&lid) {
                // Another context of a device its own vdev serves: the
                // device's LID, GID and physical queues, a datapath device
                // of its own (its memory, rings and objects).
                let taken_over = open.contexts.is_empty();
                if taken_over {
                    // Only orphans: the vdev that served them died, and
                    // this is its successor (same tenant, device and, by
                    // the policy, uid).
                    tracing::info!(
                        tenant,
                        device,
                        lid,
                        orphans = open.orphans.len(),
                        "A new vdev serves the device of one that died"
                    );
                } else if !shared {
                    return Err(refuse(
                        libc::EBUSY,
                        format!("Device {device} of tenant {tenant} is already connected"),
                    ));
                }
                if !taken_over && (pid.is_none() || open.pid != pid) {
                    return Err(refuse(
                        libc::EBUSY,
                        format!(
                            "Device {device} of tenant {tenant} is served by another \
                             process; only it may open contexts of it"
                        ),
                    ));
                }
                if open.contexts.len() + open.orphans.len() >= MAX_CONTEXTS_PER_DEVICE {
                    // Busy, not out of space: a context whose connection
                    // just closed is still being torn down (vdev retries).
                    return Err(refuse(
                        libc::EBUSY,
                        format!(
                            "Device {device} of tenant {tenant} has {MAX_CONTEXTS_PER_DEVICE} \
                             contexts open, the most a device has"
                        ),
                    ));
                }
                let (gid, pqps) = (open.gid, open.pqps.clone());
                let journal_bytes = open.journal_bytes.clone();
                let id = reg.next_device;
                reg.next_device += 1;
                if let Some(open) = reg.connected.get_mut(&lid) {
                    open.contexts.push((id, Arc::clone(&ours)));
                    open.pid = pid;
                }
                (id, lid, gid, pqps, policy, false, journal_bytes)
            } else {
                // After a handover each device gets the GID it had (its
                // peers' connections name it), and no other device takes
                // one of those while they come back.
                let (handed_gid, kept) = self.handed_gids(tenant, device);
                let gid = match &self.config.fabric {
                    Some(fabric) => (fabric.cluster.gids.iter())
                        .filter(|e| e.host == fabric.host && e.tenant == tenant)
                        .map(|e| vrdma_spec::gid::ipv4_mapped(e.gid.octets()))
                        .filter(|g| !reg.by_gid.contains_key(g))
                        .filter(|g| handed_gid.is_none_or(|h| h == *g))
                        .find(|g| handed_gid == Some(*g) || !kept.contains(g))
                        .ok_or_else(|| {
                            refuse(
                                libc::ENOSPC,
                                format!(
                                    "No address of tenant {tenant} is left on host {} \
                                     (the cluster file's pool)",
                                    fabric.host
                                ),
                            )
                        })?,
                    None => gids::assign(tenant, device, lid),
                };
                if reg.by_gid.get(&gid).is_some_and(|other| *other != lid) {
                    return Err(refuse(
                        libc::EBUSY,
                        format!("GID {} is taken by another device", gids::show(&gid)),
                    ));
                }
                let devices = reg.devices_of(tenant);
                if devices >= policy.max_devices as usize {
                    drop(reg);
                    self.datapath
                        .lock()
                        .accounts_mut()
                        .quota_rejected(tenant, "max_devices");
                    return Err(refuse(
                        libc::EDQUOT,
                        format!(
                            "Tenant {tenant} has {devices} devices connected, its quota \
                         max_devices is {}",
                            policy.max_devices
                        ),
                    ));
                }
                let wanted = policy.physical_queues.min(MAX_QUEUES_PER_DEVICE) as usize;
                let reserved = reg.reserved_for_others(tenant, self.config.physical_qps);
                if reg.free_pqps.len() < wanted + reserved {
                    return Err(refuse(
                        libc::ENOSPC,
                        format!(
                            "{} physical QPs are free, {wanted} needed, {reserved} kept for \
                         other tenants' devices",
                            reg.free_pqps.len()
                        ),
                    ));
                }
                let pqps: Vec<u32> = reg.free_pqps.iter().take(wanted).copied().collect();
                for pqp in &pqps {
                    reg.free_pqps.remove(pqp);
                }
                reg.lids.commit(assignment);
                reg.by_gid.insert(gid, lid);
                let id = reg.next_device;
                reg.next_device += 1;
                let journal_bytes: Arc<std::sync::atomic::AtomicUsize> = Default::default();
                reg.connected.insert(
                    lid,
                    Connected {
                        tenant: tenant.to_owned(),
                        device: device.to_owned(),
                        pid,
                        gid,
                        pqps: pqps.clone(),
                        contexts: vec![(id, Arc::clone(&ours))],
                        orphans: Vec::new(),
                        journal_bytes: journal_bytes.clone(),
                    },
                );
                (id, lid, gid, pqps, policy, true, journal_bytes)
            }
        };
        let session = Session {
            id,
            lid,
            gid,
            tenant: tenant.to_owned(),
            device: device.to_owned(),
            pqps,
            journal: ContextJournal::of_device(journal_bytes),
            released: false,
            created: false,
            handed: HashMap::new(),
            notify: ours,
        };
        match self.start_device(&session, policy, first) {
            Ok(welcome) => {
                tracing::info!(
                    tenant,
                    device,
                    lid,
                    gid = %gids::show(&gid),
                    pqps = ?session.pqps,
                    "vdev connected"
                );
                Ok((session, welcome, theirs))
            }
            Err(refusal) => {
                self.teardown(&session);
                Err(refusal)
            }
        }
    }

    /// Attaches context `s` to the datapath; `first`: the device's first
    /// context, whose GID the directory learns.
    pub(super) fn start_device(
        &self,
        s: &Session,
        policy: TenantPolicy,
        first: bool,
    ) -> Result<Welcome, Refusal> {
        if first {
            self.publish(s, &policy)?;
        }
        // The port's LID: an Ethernet port has none.
        let port_lid = match self.config.link_layer {
            PortLinkLayer::Ethernet => 0,
            PortLinkLayer::Infiniband => s.lid,
        };
        self.datapath.lock().attach_device(
            s.id,
            &s.tenant,
            Address {
                gid: s.gid,
                lid: port_lid,
            },
            &s.pqps,
            &policy,
        )?;
        self.datapath.wake();
        let active_mtu = self.config.fabric.as_ref().map_or(4096, |f| f.active_mtu());
        Ok(Welcome {
            active_mtu,
            lid: s.lid,
            link_layer: self.config.link_layer,
            gid: s.gid,
            physical_queues: s.pqps.len() as u32,
            policy,
        })
    }

    /// Tells the directory that this host serves `s`'s GID (in a cluster).
    pub(super) fn publish(&self, s: &Session, policy: &TenantPolicy) -> Result<(), Refusal> {
        let (Some(directory), Some(fabric)) = (self.directory(), &self.config.fabric) else {
            return Ok(());
        };
        let Some(ip) = vrdma_spec::gid::ipv4_of(&s.gid).map(std::net::Ipv4Addr::from) else {
            return Ok(());
        };
        let network = (fabric.cluster.gids.iter())
            .find(|g| g.gid == ip)
            .and_then(|g| g.network.clone())
            .unwrap_or_else(|| policy.network().to_owned());
        let entry = crate::net::directory::GidEntry {
            gid: ip,
            host: fabric.host.clone(),
            tenant: s.tenant.clone(),
            network,
        };
        directory.publish(&entry).map_err(|e| {
            refuse(
                libc::EADDRINUSE,
                format!(
                    "The directory refused GID {ip}: {}",
                    vrdma_errors::error_chain(&e)
                ),
            )
        })
    }
}
