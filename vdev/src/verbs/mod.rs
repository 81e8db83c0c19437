//! The verbs objects of one tenant's device and the control verbs on them.
//!
//! [`RdmaDevice`] owns the tenant's protection domains, memory regions
//! (with their shadows), completion queues, queue pairs, doorbell page and
//! event rings, enforces the tenant's [`Limits`] and the dependency rules
//! between objects (a PD with MRs or QPs cannot go, nor a CQ a QP uses),
//! and executes decoded control commands, mirroring each object to hostd.
//! It never touches a ring after creating it: hostd's datapath owns them.
//! It knows nothing of virtqueues: `control.rs` feeds it bytes, and the
//! eventfds hostd needs come through [`NotifyFds`].

mod ah;
pub mod cm;
mod cq;
mod error;
mod journal;
mod mr;
mod notify;
mod port;
mod qp;
mod share;
mod slots;
mod srq;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rand::Rng;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vrdma_hostd_protocol::messages::{PortLinkLayer, SM_LID};
use vrdma_spec::config::{DeviceAttr, DeviceConfig, PortAttr, CONFIG_MAGIC, CONFIG_SIZE};
use vrdma_spec::control::{
    self, AhHandle, CqHandle, MrHandle, Opcode, PdHandle, QpHandle, QueryQpReq, SrqHandle,
};
use vrdma_spec::ring::{self, RING_ALIGN};
use vrdma_spec::verbs::{atomic_cap, device_cap, LinkLayer, Mtu, PortState};
use vrdma_spec::zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};
use vrdma_tenant_policy::Limits;

use share::Counted;

pub use ah::AddressHandle;
pub use cq::CompletionQueue;
pub use error::{VerbError, VerbResult};
pub use journal::{kind as record_kind, AdoptError};
pub use mr::MemoryRegion;
pub use notify::{EventRing, FdError, NotifyFds};
pub use port::Restored;
pub use qp::QueuePair;
pub use share::{DeviceShare, Usage};
pub use srq::SharedReceiveQueue;

use crate::fabric::Fabric;
use crate::shadow::{MemorySlots, SlotId};

/// PCI vendor id reported by the device (Red Hat's virtio vendor id).
pub const VENDOR_ID: u32 = 0x1af4;
/// Vendor part id: 0x1040 + the virtio device id, as virtio-pci numbers it.
pub const VENDOR_PART_ID: u32 = 0x1040 + vrdma_spec::VIRTIO_ID_RDMA;
/// The port's MTU.
pub const PORT_MTU: Mtu = Mtu::Mtu4096;

/// Static identity of a device, from the vdev configuration (and hostd's
/// Welcome).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceIdentity {
    pub tenant: Arc<str>,
    /// Names the device (`vrdma_<lid>`, its GUID); the port reports it as
    /// its LID only when its link layer is InfiniBand.
    pub lid: u16,
    /// The port's link layer (hostd's; Ethernet without hostd).
    pub link_layer: PortLinkLayer,
    /// Its port's GID 0 (RoCEv2, IPv4-mapped: `vrdma_spec::gid`).
    pub gid: [u8; 16],
    pub comp_vectors: u16,
    pub max_queue_size: u16,
    /// Its port's active MTU (hostd's network decides; [`PORT_MTU`]
    /// without hostd).
    pub active_mtu: Mtu,
}

/// A protection domain.
#[derive(Debug, Default)]
struct ProtectionDomain {
    mrs: u32,
    qps: u32,
}

/// One tenant's RDMA device.
#[derive(Debug)]
pub struct RdmaDevice {
    identity: DeviceIdentity,
    /// The limits in force.
    limits: Limits,
    /// vdev's own configured limits (hostd's policy may only tighten them).
    local_limits: Limits,
    config: DeviceConfig,
    mem: Arc<GuestMemoryMmap>,
    pds: HashMap<u32, ProtectionDomain>,
    mrs: HashMap<u32, MemoryRegion>,
    /// MR handle by lkey, for key lookups.
    lkeys: HashMap<u32, u32>,
    cqs: HashMap<u32, CompletionQueue>,
    qps: HashMap<u32, QueuePair>,
    srqs: HashMap<u32, SharedReceiveQueue>,
    ahs: HashMap<u32, AddressHandle>,
    /// The doorbell page (`SET_DOORBELL`), once the driver gave it.
    doorbell: Option<u64>,
    /// Event rings by completion vector (`CREATE_EQ`).
    eqs: BTreeMap<u32, EventRing>,
    /// The live QPs' bits in the doorbell page.
    db_indexes: notify::DbIndexes,
    /// Bytes registered across this context's MRs.
    mr_bytes: u64,
    /// What this context shares with the device's others: quotas' usage
    /// and QP numbers.
    share: DeviceShare,
    next_handle: u32,
    /// hostd, when the device is attached to a fabric.
    fabric: Option<Arc<Fabric>>,
    /// The eventfds hostd is given (set with `fabric`).
    notify_fds: Option<Arc<dyn NotifyFds>>,
    /// hostd's numbers for the guest memory slots it was given.
    slots: slots::HostdSlots,
    /// This context's CM channels (none on a device without a CM).
    cm: cm::ContextCm,
    /// The context's journal in hostd, for a successor should vdev die.
    journal: journal::JournalState,
}

impl RdmaDevice {
    /// A device with no objects and no guest memory yet.
    pub fn new(identity: DeviceIdentity, limits: Limits) -> Self {
        let config = build_config(&identity, &limits);
        let identity_tenant = identity.tenant.clone();
        RdmaDevice {
            identity,
            limits,
            local_limits: limits,
            config,
            mem: Arc::new(GuestMemoryMmap::new()),
            pds: HashMap::new(),
            mrs: HashMap::new(),
            lkeys: HashMap::new(),
            cqs: HashMap::new(),
            qps: HashMap::new(),
            srqs: HashMap::new(),
            ahs: HashMap::new(),
            doorbell: None,
            eqs: BTreeMap::new(),
            db_indexes: notify::DbIndexes::default(),
            mr_bytes: 0,
            share: DeviceShare::default(),
            next_handle: 1,
            fabric: None,
            notify_fds: None,
            slots: slots::HostdSlots::default(),
            cm: cm::ContextCm::new(identity_tenant, None),
            journal: journal::JournalState::default(),
        }
    }

    /// This context as one of a device with a connection manager, which
    /// its contexts find in `slot`: config space advertises the CM event
    /// queue (`cm_queue`), and the `CM_*` commands are served.
    pub fn with_cm(mut self, slot: cm::CmSlot) -> Self {
        self.cm = cm::ContextCm::new(self.identity.tenant.clone(), Some(slot));
        self.config.device.cm_queue = self.cm_queue_index();
        self
    }

    /// The CM event queue's index, 0 without a CM.
    fn cm_queue_index(&self) -> u8 {
        if self.cm.enabled() {
            // At most 2 + 64.
            vrdma_spec::cm_queue(self.identity.comp_vectors) as u8
        } else {
            0
        }
    }

    /// This context's CM side.
    pub fn cm_mut(&mut self) -> &mut cm::ContextCm {
        &mut self.cm
    }

    /// This context as one of the device whose contexts share `share`
    /// (a fresh device is alone in its own).
    pub fn in_share(mut self, share: DeviceShare) -> Self {
        self.share = share;
        self
    }

    /// A device attached to hostd's fabric: its LID and GID are hostd's, and memory,
    /// keys, the doorbell, event rings, CQs and QPs are mirrored to hostd,
    /// with the eventfds `fds` lends.
    /// Both vdev's configured limits and hostd's policy are the operator's
    /// word, so the stricter of the two applies, limit by limit.
    pub fn with_fabric(
        mut identity: DeviceIdentity,
        local: Limits,
        fabric: Arc<Fabric>,
        fds: Arc<dyn NotifyFds>,
    ) -> Self {
        identity.lid = fabric.lid;
        identity.link_layer = fabric.link_layer;
        identity.gid = fabric.gid;
        identity.active_mtu = fabric.active_mtu();
        let mut device = RdmaDevice::new(identity, local.stricter(&fabric.policy.quotas));
        device.local_limits = local;
        device.fabric = Some(fabric);
        device.notify_fds = Some(fds);
        device
    }

    /// Applies a new policy's quotas (a reload), still capped by vdev's own
    /// limits. Raised limits apply at once; lowered ones only refuse new
    /// objects: nothing that exists is torn down. The config space and
    /// QUERY_DEVICE report the new limits.
    pub fn set_policy_quotas(&mut self, quotas: Limits) {
        let limits = self.local_limits.stricter(&quotas);
        if limits == self.limits {
            return;
        }
        tracing::info!(tenant = %self.identity.tenant, old = ?self.limits, new = ?limits, "Quotas changed");
        self.limits = limits;
        self.config = build_config(&self.identity, &limits);
        self.config.device.cm_queue = self.cm_queue_index();
    }

    /// The hostd link, if any.
    pub fn fabric(&self) -> Option<&Arc<Fabric>> {
        self.fabric.as_ref()
    }

    /// The tenant this device serves.
    pub fn tenant(&self) -> &str {
        &self.identity.tenant
    }

    /// The config space.
    pub fn config(&self) -> &DeviceConfig {
        &self.config
    }

    /// Takes a new memory table from the VMM and revokes the shadows of MRs
    /// whose memory is gone. Returns how many MRs it revoked.
    pub fn update_memory(&mut self, mem: Arc<GuestMemoryMmap>) -> usize {
        let slots = MemorySlots::of(&mem);
        self.mirror_slots(&mem, &slots);
        self.mem = mem;
        let revoked = self
            .mrs
            .values_mut()
            .filter_map(|mr| mr.shadow.revalidate(&slots).then_some(()))
            .count();
        if revoked > 0 {
            tracing::warn!(tenant = %self.identity.tenant, revoked, slots = slots.len(),
                "Guest memory removed under registered memory regions; their shadows are revoked");
        }
        revoked
    }

    /// Tells hostd about slots that appeared and slots that went away.
    fn mirror_slots(&mut self, mem: &GuestMemoryMmap, slots: &MemorySlots) {
        let Some(fabric) = self.fabric.clone() else {
            return;
        };
        let gone: Vec<SlotId> = self
            .slots
            .offered_slots()
            .into_iter()
            .filter(|s| !slots.contains(s))
            .collect();
        let mut changed = Vec::new();
        for slot in gone {
            if let Some(number) = self.slots.gone(&slot) {
                changed.push(number);
                if let Err(e) = fabric.remove_memory(number) {
                    tracing::warn!(tenant = %self.identity.tenant, slot = number, error = %e, "hostd did not drop a memory slot");
                }
            }
        }
        for region in mem.iter() {
            let slot = SlotId::of(region);
            if self.slots.offered(&slot) {
                continue;
            }
            let Some(file) = vm_memory::GuestMemoryRegion::file_offset(region) else {
                continue;
            };
            let number = self.slots.next_number();
            let gpa = vm_memory::GuestMemoryRegion::start_addr(region).0;
            let len = vm_memory::GuestMemoryRegion::len(region);
            match fabric.add_memory(number, gpa, len, file.file(), file.start()) {
                Ok(()) => {
                    self.slots.taken(slot, number);
                    changed.push(number);
                }
                Err(e) => {
                    let reason = vrdma_errors::error_chain(&e);
                    tracing::warn!(tenant = %self.identity.tenant, gpa, len, error = %reason,
                        "hostd refused a guest memory slot; memory regions in it will fail");
                    self.slots.refused(slot, e.errno(), reason);
                }
            }
        }
        self.journal_slots(&changed);
    }

    /// Releases every object, as a device reset or a departed frontend
    /// requires: hostd drops the device's QPs, CQs, event rings, MRs and
    /// doorbell in one `ResetDevice` (when its answer arrives nothing of
    /// the old driver's is touched any more), then vdev forgets them.
    /// Memory slots stay known to hostd. Nothing to release, nothing sent.
    pub fn release_all(&mut self) {
        self.cm.close_all();
        let (pds, mrs, cqs, qps) = self.object_counts();
        let eqs = self.eqs.len();
        let (srqs, ahs) = (self.srqs.len(), self.ahs.len());
        let doorbell = self.doorbell.is_some();
        if pds + mrs + cqs + qps + eqs + srqs + ahs == 0 && !doorbell {
            return;
        }
        if let Some(fabric) = &self.fabric {
            if let Err(e) = fabric.reset_device() {
                tracing::warn!(tenant = %self.identity.tenant, error = %e, "hostd did not reset the device");
            }
        }
        let gone = self.object_keys();
        self.journal_released(gone);
        // The device's other contexts keep theirs.
        for &qpn in self.qps.keys() {
            self.share.free_qpn(qpn);
        }
        for (what, n) in [
            (Counted::Pd, pds),
            (Counted::Mr, mrs),
            (Counted::Cq, cqs),
            (Counted::Qp, qps),
            (Counted::Srq, self.srqs.len()),
            (Counted::Ah, self.ahs.len()),
        ] {
            self.share.give_back(what, n as u32);
        }
        self.share.give_back_bytes(self.mr_bytes);
        self.qps.clear();
        self.srqs.clear();
        self.ahs.clear();
        self.db_indexes.clear();
        self.mrs.clear();
        self.lkeys.clear();
        self.mr_bytes = 0;
        self.cqs.clear();
        self.pds.clear();
        self.eqs.clear();
        self.doorbell = None;
        tracing::info!(tenant = %self.identity.tenant, pds, mrs, cqs, qps, srqs, ahs, eqs, doorbell,
            "Released all verbs objects");
    }

    /// hostd's number for a slot, or why it has none.
    fn slot_number(&self, slot: &SlotId, gpa: u64) -> VerbResult<u32> {
        if let Some(number) = self.slots.number(slot) {
            return Ok(number);
        }
        Err(match self.slots.refusal(slot) {
            Some((errno, reason)) => VerbError::SlotRefused {
                gpa,
                errno: *errno,
                reason: reason.clone(),
            },
            None => VerbError::Invalid(format!("guest memory at {gpa:#x} is not known to hostd")),
        })
    }

    /// The device's objects over all its contexts (the quotas' usage).
    pub fn usage(&self) -> Usage {
        self.share.usage()
    }

    /// The QPs.
    pub fn qps_iter(&self) -> impl Iterator<Item = &QueuePair> {
        self.qps.values()
    }

    /// Number of live objects: (PDs, MRs, CQs, QPs).
    pub fn object_counts(&self) -> (usize, usize, usize, usize) {
        (
            self.pds.len(),
            self.mrs.len(),
            self.cqs.len(),
            self.qps.len(),
        )
    }

    /// Executes one control command on its request payload and returns the
    /// response payload. A refusal for a quota is reported to hostd, which
    /// counts it for the tenant.
    pub fn execute(&mut self, opcode: Opcode, payload: &[u8]) -> VerbResult<Vec<u8>> {
        let result = self.dispatch(opcode, payload);
        if let (Err(VerbError::Limit { limit, .. }), Some(fabric)) = (&result, &self.fabric) {
            if let Err(e) = fabric.quota_rejected(limit) {
                tracing::warn!(tenant = %self.identity.tenant, quota = limit, error = %e,
                    "Cannot report a quota rejection to hostd");
            }
        }
        result
    }

    fn dispatch(&mut self, opcode: Opcode, payload: &[u8]) -> VerbResult<Vec<u8>> {
        match opcode {
            Opcode::QueryDevice => {
                expect_empty(payload)?;
                Ok(self.config.device.as_bytes().to_vec())
            }
            Opcode::QueryPort => {
                let req: control::QueryPortReq = decode(payload)?;
                check_port(req.port_num)?;
                Ok(self.config.port.as_bytes().to_vec())
            }
            Opcode::QueryGid => {
                let req: control::QueryGidReq = decode(payload)?;
                check_port(req.port_num)?;
                if req.index.get() != 0 {
                    return Err(VerbError::Invalid(format!(
                        "GID index {} (table has 1 entry)",
                        req.index
                    )));
                }
                // An InfiniBand port's GID is an IB GID (the same 16
                // bytes: hostd names devices by them either way).
                let gid_type = match self.identity.link_layer {
                    PortLinkLayer::Ethernet => control::gid_type::ROCE_V2,
                    PortLinkLayer::Infiniband => control::gid_type::IB,
                };
                let resp = control::QueryGidResp {
                    gid: self.config.gid,
                    gid_type: gid_type.into(),
                    reserved: 0.into(),
                };
                Ok(resp.as_bytes().to_vec())
            }
            Opcode::AllocPd => {
                expect_empty(payload)?;
                let pdn = self.alloc_pd()?;
                Ok(PdHandle {
                    pdn: pdn.into(),
                    reserved: 0.into(),
                }
                .as_bytes()
                .to_vec())
            }
            Opcode::DeallocPd => respond(payload, |req: PdHandle| self.dealloc_pd(req.pdn.get())),
            Opcode::RegMr => respond(payload, |req| self.reg_mr(&req)),
            Opcode::RegMrSg => respond(payload, |req| self.reg_mr_sg(&req)),
            Opcode::DeregMr => respond(payload, |req: MrHandle| self.dereg_mr(req.handle.get())),
            Opcode::CreateCq => respond(payload, |req| {
                let cqn = self.create_cq(&req)?;
                Ok(CqHandle {
                    cqn: cqn.into(),
                    reserved: 0.into(),
                })
            }),
            Opcode::DestroyCq => respond(payload, |req: CqHandle| self.destroy_cq(req.cqn.get())),
            Opcode::CreateQp => respond(payload, |req| self.create_qp(&req)),
            Opcode::ModifyQp => respond(payload, |req| self.modify_qp(&req)),
            Opcode::QueryQp => respond(payload, |req: QueryQpReq| self.query_qp(req.qpn.get())),
            Opcode::DestroyQp => respond(payload, |req: QpHandle| self.destroy_qp(req.qpn.get())),
            Opcode::SetDoorbell => respond(payload, |req| self.set_doorbell(&req)),
            Opcode::CreateEq => respond(payload, |req| self.create_eq(&req)),
            Opcode::CreateSrq => respond(payload, |req| self.create_srq(&req)),
            Opcode::ModifySrq => respond(payload, |req| self.modify_srq(&req)),
            Opcode::QuerySrq => respond(payload, |req: SrqHandle| self.query_srq(req.srqn.get())),
            Opcode::DestroySrq => {
                respond(payload, |req: SrqHandle| self.destroy_srq(req.srqn.get()))
            }
            Opcode::CreateAh => respond(payload, |req| self.create_ah(&req)),
            Opcode::DestroyAh => respond(payload, |req: AhHandle| self.destroy_ah(req.ahn.get())),
            Opcode::CmOpenChannel
            | Opcode::CmCloseChannel
            | Opcode::CmCreateId
            | Opcode::CmBindAddr
            | Opcode::CmListen
            | Opcode::CmResolveAddr
            | Opcode::CmResolveRoute
            | Opcode::CmConnect
            | Opcode::CmAccept
            | Opcode::CmReject
            | Opcode::CmEstablish
            | Opcode::CmDisconnect
            | Opcode::CmDestroyId
            | Opcode::CmInitQpAttr
            | Opcode::CmQueryId => self.cm.execute(opcode, payload),
            // A QP of this context moved by its CM ID's attributes.
            Opcode::CmMoveQp => respond(payload, |req| self.cm_move_qp(&req)),
        }
    }

    /// A fresh handle for a PD, CQ or MR. Handles are per device and never
    /// reused while the device lives, so a stale handle cannot alias a new
    /// object.
    fn new_handle(&mut self) -> u32 {
        let handle = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1).max(1);
        handle
    }

    fn alloc_pd(&mut self) -> VerbResult<u32> {
        self.share.take(Counted::Pd, self.limits.max_pd)?.keep();
        let pdn = self.new_handle();
        self.pds.insert(pdn, ProtectionDomain::default());
        Ok(pdn)
    }

    fn dealloc_pd(&mut self, pdn: u32) -> VerbResult<()> {
        let pd = self.pds.get(&pdn).ok_or(VerbError::NoObject {
            kind: "PD",
            handle: pdn,
        })?;
        if pd.mrs > 0 || pd.qps > 0 {
            return Err(VerbError::Busy {
                kind: "PD",
                handle: pdn,
                users: format!("{} MRs and {} QPs", pd.mrs, pd.qps),
            });
        }
        self.pds.remove(&pdn);
        self.share.give_back(Counted::Pd, 1);
        Ok(())
    }

    fn pd_mut(&mut self, pdn: u32) -> VerbResult<&mut ProtectionDomain> {
        self.pds.get_mut(&pdn).ok_or(VerbError::NoObject {
            kind: "PD",
            handle: pdn,
        })
    }

    /// Checks a ring of `bytes` at `addr` lies aligned in guest memory.
    fn check_ring(&self, addr: u64, bytes: u64) -> VerbResult<()> {
        let bad = || VerbError::Ring { addr, bytes };
        if !addr.is_multiple_of(RING_ALIGN) || addr.checked_add(bytes).is_none() {
            return Err(bad());
        }
        let len = usize::try_from(bytes).map_err(|_| bad())?;
        if !self.mem.check_range(GuestAddress(addr), len) {
            return Err(bad());
        }
        Ok(())
    }

    /// Resets the device-owned header line (index, flags) of a checked ring.
    fn reset_ring(&self, addr: u64) -> VerbResult<()> {
        self.clear_device_line(addr + ring::DEVICE_INDEX_OFFSET)
    }

    /// Sets [`ring::DEVICE_FLAG_ERROR`] in the device's flags of the ring at
    /// `addr` (checked at its creation), as the datapath does.
    fn flag_ring_error(&self, addr: u64) -> VerbResult<()> {
        let at = GuestAddress(addr + ring::DEVICE_FLAGS_OFFSET);
        let bad = || VerbError::Ring { addr, bytes: 4 };
        let flags = u32::from_le(self.mem.load(at, Ordering::Acquire).map_err(|_| bad())?);
        self.mem
            .store(
                (flags | ring::DEVICE_FLAG_ERROR).to_le(),
                at,
                Ordering::Release,
            )
            .map_err(|_| bad())
    }

    /// Zeroes the device-written cache line at `line` of a checked ring or
    /// page: the guest memory may hold a previous driver's bytes.
    fn clear_device_line(&self, line: u64) -> VerbResult<()> {
        let zeros = [0u8; ring::CACHE_LINE];
        self.mem
            .write_slice(&zeros, GuestAddress(line))
            .map_err(|_| VerbError::Ring {
                addr: line,
                bytes: ring::CACHE_LINE as u64,
            })
    }
}

fn check_port(port: u8) -> VerbResult<()> {
    if port != 1 {
        return Err(VerbError::Invalid(format!(
            "port {port} (the device has port 1)"
        )));
    }
    Ok(())
}

fn expect_empty(payload: &[u8]) -> VerbResult<()> {
    if !payload.is_empty() {
        return Err(VerbError::Malformed(format!(
            "{} payload bytes, expected none",
            payload.len()
        )));
    }
    Ok(())
}

/// Decodes a request payload that must be exactly one `T`.
fn decode<T: FromBytes + KnownLayout + Immutable>(payload: &[u8]) -> VerbResult<T> {
    T::read_from_bytes(payload).map_err(|_| {
        VerbError::Malformed(format!(
            "{} payload bytes, expected {}",
            payload.len(),
            core::mem::size_of::<T>()
        ))
    })
}

/// Runs a command's `verb` on its request, the one `Req` of `payload`; the
/// response payload is the `Resp` it returns (nothing for `()`).
fn respond<Req, Resp>(
    payload: &[u8],
    verb: impl FnOnce(Req) -> VerbResult<Resp>,
) -> VerbResult<Vec<u8>>
where
    Req: FromBytes + KnownLayout + Immutable,
    Resp: IntoBytes + Immutable,
{
    verb(decode(payload)?).map(|resp| resp.as_bytes().to_vec())
}

/// The config space of a device with this identity and these limits.
fn build_config(identity: &DeviceIdentity, limits: &Limits) -> DeviceConfig {
    // The GUID is derived from the LID, so it is unique wherever the LID is
    // (hostd assigns LIDs per host); the top bytes say "vrdma".
    let guid = u64::from_be_bytes([b'v', b'r', 0, 0, 0, 0, 0, 0]) | u64::from(identity.lid);
    let mut name = [0u8; 32];
    let dev_name = format!("vrdma_{}", identity.lid);
    // RoCEv2: devices are addressed by GID, there are no LIDs and no
    // subnet manager. InfiniBand: hostd is the subnet manager and its
    // LIDs are the ports'.
    let (lid, sm_lid) = match identity.link_layer {
        PortLinkLayer::Ethernet => (0, 0),
        PortLinkLayer::Infiniband => (identity.lid, SM_LID),
    };
    name[..dev_name.len().min(31)].copy_from_slice(&dev_name.as_bytes()[..dev_name.len().min(31)]);
    DeviceConfig {
        magic: CONFIG_MAGIC.into(),
        version_major: vrdma_spec::SPEC_VERSION_MAJOR.into(),
        version_minor: vrdma_spec::SPEC_VERSION_MINOR.into(),
        num_comp_vectors: identity.comp_vectors.into(),
        max_queue_size: identity.max_queue_size.into(),
        config_size: (CONFIG_SIZE as u32).into(),
        device: DeviceAttr {
            fw_ver: ((u64::from(vrdma_spec::SPEC_VERSION_MAJOR) << 32)
                | u64::from(vrdma_spec::SPEC_VERSION_MINOR))
            .into(),
            node_guid: guid.into(),
            sys_image_guid: guid.into(),
            max_mr_size: limits.max_mr_bytes.into(),
            page_size_cap: 0xffff_f000u64.into(),
            vendor_id: VENDOR_ID.into(),
            vendor_part_id: VENDOR_PART_ID.into(),
            hw_ver: 1.into(),
            max_qp: limits.max_qp.into(),
            max_qp_wr: limits.max_qp_depth.into(),
            device_cap_flags: (device_cap::RC_RNR_NAK_GEN
                | device_cap::CURR_QP_STATE_MOD
                | device_cap::PORT_ACTIVE_EVENT
                | device_cap::SYS_IMAGE_GUID)
                .into(),
            max_sge: limits.max_sge.into(),
            max_cq: limits.max_cq.into(),
            max_cqe: limits.max_cq_depth.into(),
            max_mr: limits.max_mr.into(),
            max_pd: limits.max_pd.into(),
            max_qp_rd_atom: limits.max_rd_atomic.into(),
            max_qp_init_rd_atom: limits.max_rd_atomic.into(),
            max_srq: limits.max_srq.into(),
            max_srq_wr: limits.max_qp_depth.into(),
            max_srq_sge: limits.max_sge.into(),
            max_inline_data: limits.max_inline_data.into(),
            atomic_cap: atomic_cap::HCA.into(),
            max_total_mr_bytes: limits.max_total_mr_bytes.into(),
            max_pkeys: 1.into(),
            phys_port_cnt: 1,
            max_ah: limits.max_ah.into(),
            // A device with a connection manager says so: `RdmaDevice::with_cm`.
            cm_queue: 0,
        },
        port: PortAttr {
            state: PortState::Active.into(),
            max_mtu: PORT_MTU.into(),
            active_mtu: identity.active_mtu.into(),
            link_layer: LinkLayer::from(identity.link_layer).into(),
            gid_tbl_len: 1.into(),
            port_cap_flags: 0.into(),
            max_msg_sz: vrdma_spec::limits::MAX_MSG_SIZE.into(),
            pkey_tbl_len: 1.into(),
            lid: lid.into(),
            sm_lid: sm_lid.into(),
            lmc: 0,
            max_vl_num: 1,
            sm_sl: 0,
            // 4x width, EDR speed: what ibv_devinfo shows as 100 Gb/s.
            active_width: 2,
            active_speed: 32,
            phys_state: port::PHYS_LINK_UP,
            reserved: [0; 4],
        },
        gid: identity.gid,
        name,
    }
}

/// A random key or QPN that `taken` does not hold and that is not in `reserved`.
fn random_unique(mask: u32, reserved: &[u32], taken: impl Fn(u32) -> bool) -> u32 {
    let mut rng = rand::rng();
    loop {
        let candidate = rng.random::<u32>() & mask;
        if !reserved.contains(&candidate) && !taken(candidate) {
            return candidate;
        }
    }
}

#[cfg(test)]
mod tests;
