//! A context that outlives its vdev: the journal vdev keeps in hostd, and
//! the adoption that rebuilds a context from it.
//!
//! After every control command that changes something, vdev sends hostd
//! ([`Fabric::journal`], not answered) the records of the objects the
//! command touched — the object as it is now, or its removal — with the
//! command's answer. Should vdev die, hostd keeps the context running
//! (its QPs go on, the driver keeps posting work) and hands the records to
//! the next vdev of the device, whose frontend comes back with the same
//! control queue ([`RdmaDevice::adopt`]): the objects are rebuilt from the
//! records, each checked as a command from the guest would be (a vdev
//! compromised before it died wrote them), and the command the old vdev
//! answered in the journal but not on the queue is answered from the
//! journal, never executed twice.
//!
//! What hostd has is the truth of the datapath; the records are vdev's own
//! view (handles, attributes, ring addresses, quotas' usage). Derived
//! state — PD and CQ users, the lkey table, registered bytes, doorbell
//! indices in use — is recomputed, not recorded.

use std::collections::{BTreeMap, HashMap};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use vrdma_hostd_protocol::messages::{ContextKey, Journal, Record};
use vrdma_spec::control::{self, Opcode};
use vrdma_spec::ring::{self, WorkRingGeometry};
use vrdma_spec::verbs::{QpState, QpType};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};

use super::share::Counted;
use super::{
    AddressHandle, CompletionQueue, EventRing, MemoryRegion, ProtectionDomain, QueuePair,
    RdmaDevice, SharedReceiveQueue, VerbError, VerbResult,
};
use crate::shadow::{Segment, ShadowRegion, SlotId};

/// Record kinds (the `kind` of a [`Record`]); ids are the objects' handles.
pub mod kind {
    pub const PD: u8 = 1;
    pub const MR: u8 = 2;
    pub const CQ: u8 = 3;
    pub const QP: u8 = 4;
    pub const SRQ: u8 = 5;
    pub const AH: u8 = 6;
    /// Id: the completion vector.
    pub const EQ: u8 = 7;
    /// Id 0.
    pub const DOORBELL: u8 = 8;
    /// Id: hostd's number for the memory slot.
    pub const SLOT: u8 = 9;
    /// Id 0: the device's next handle.
    pub const HANDLES: u8 = 10;
    /// Id 0: the last command answered.
    pub const DONE: u8 = 11;
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PdRecord {}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct MrRecord {
    pdn: u32,
    lkey: u32,
    rkey: u32,
    iova: u64,
    len: u64,
    access: u32,
    /// (slot number, gpa, len) of each piece.
    segments: Vec<(u32, u64, u64)>,
    revoked: bool,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CqRecord {
    depth: u32,
    comp_vector: u32,
    ring_addr: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct QpRecord {
    qp_type: u8,
    pdn: u32,
    send_cqn: u32,
    recv_cqn: u32,
    sq_sig_all: bool,
    cap: Vec<u8>,
    /// (gpa, depth, stride) of the send and receive rings.
    sq: (u64, u32, u32),
    rq: (u64, u32, u32),
    db_index: u32,
    srqn: Option<u32>,
    state: u8,
    attr: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SrqRecord {
    pdn: u32,
    ring: (u64, u32, u32),
    max_wr: u32,
    max_sge: u32,
    limit: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct AhRecord {
    pdn: u32,
    attr: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RingRecord {
    addr: u64,
    depth: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SlotRecord {
    gpa: u64,
    len: u64,
    dev: u64,
    ino: u64,
    offset: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HandlesRecord {
    next: u32,
}

/// The last command answered: where it was on the control queue, what it
/// asked, and the answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DoneRecord {
    position: u16,
    opcode: u16,
    request: Vec<u8>,
    errno: i32,
    payload: Vec<u8>,
}

/// Why a journal cannot become a context.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("Record {kind}/{id} is malformed")]
    Malformed {
        kind: u8,
        id: u32,
        #[source]
        source: serde_json::Error,
    },
    #[error("Record {kind}/{id}: {reason}")]
    Invalid { kind: u8, id: u32, reason: String },
    #[error("hostd did not hand the context over")]
    Fabric(#[source] crate::fabric::FabricError),
}

/// The context's journal as vdev keeps it.
#[derive(Debug, Default)]
pub(super) struct JournalState {
    /// The context's key, once its control queue ran.
    key: Option<ContextKey>,
    /// hostd has the key.
    key_sent: bool,
    /// A command the previous vdev answered in the journal, to answer
    /// again if the driver offers it again.
    replay: Option<DoneRecord>,
    /// The context could not be taken over: every command fails (EIO).
    pub(super) lost: Option<String>,
    /// The frontend acked `VRDMA_F_RECONNECT`: it comes back after a
    /// restart, so hostd may keep the context for a successor.
    reconnects: bool,
}

fn invalid(kind: u8, id: u32, reason: impl Into<String>) -> AdoptError {
    AdoptError::Invalid {
        kind,
        id,
        reason: reason.into(),
    }
}

/// PD `pdn` of the tables being rebuilt, which record `r` names (whose
/// users the caller counts).
fn pd_of<'p>(
    pds: &'p mut HashMap<u32, ProtectionDomain>,
    pdn: u32,
    r: &Record,
) -> Result<&'p mut ProtectionDomain, AdoptError> {
    pds.get_mut(&pdn)
        .ok_or_else(|| invalid(r.kind, r.id, "no such PD"))
}

fn encode<T: Serialize>(value: &T) -> Option<String> {
    serde_json::to_string(value).ok()
}

fn decode<T: DeserializeOwned>(record: &Record) -> Result<T, AdoptError> {
    let data = record
        .data
        .as_deref()
        .ok_or_else(|| invalid(record.kind, record.id, "no data"))?;
    serde_json::from_str(data).map_err(|source| AdoptError::Malformed {
        kind: record.kind,
        id: record.id,
        source,
    })
}

fn geometry((gpa, depth, stride): (u64, u32, u32)) -> (u64, WorkRingGeometry) {
    (gpa, WorkRingGeometry { depth, stride })
}

/// Where a state-changing command names the object it touched.
#[derive(Clone, Copy)]
enum Named {
    /// The first 32-bit field of the request (a destroy, a modify; an
    /// event ring's vector).
    ByRequest,
    /// The first 32-bit field of the response (a creation's new handle).
    ByResponse,
    /// Always this id (the one doorbell page).
    Fixed(u32),
}

/// The record kind a state-changing command touches, and where its id is;
/// `None` for commands that change nothing kept here (queries, the
/// connection manager's, whose state does not outlive vdev).
fn journaled(opcode: Opcode) -> Option<(u8, Named)> {
    use Named::{ByRequest, ByResponse};
    Some(match opcode {
        Opcode::AllocPd => (kind::PD, ByResponse),
        Opcode::DeallocPd => (kind::PD, ByRequest),
        Opcode::RegMr | Opcode::RegMrSg => (kind::MR, ByResponse),
        Opcode::DeregMr => (kind::MR, ByRequest),
        Opcode::CreateCq => (kind::CQ, ByResponse),
        Opcode::DestroyCq => (kind::CQ, ByRequest),
        Opcode::CreateQp => (kind::QP, ByResponse),
        Opcode::ModifyQp | Opcode::DestroyQp | Opcode::CmMoveQp => (kind::QP, ByRequest),
        Opcode::CreateSrq => (kind::SRQ, ByResponse),
        Opcode::ModifySrq | Opcode::DestroySrq => (kind::SRQ, ByRequest),
        Opcode::CreateAh => (kind::AH, ByResponse),
        Opcode::DestroyAh => (kind::AH, ByRequest),
        Opcode::SetDoorbell => (kind::DOORBELL, Named::Fixed(0)),
        Opcode::CreateEq => (kind::EQ, ByRequest),
        _ => return None,
    })
}

/// The first little-endian 32-bit field of `bytes`.
fn first_u32(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?))
}

impl RdmaDevice {
    /// Executes the control command at avail `position` of the control
    /// queue: answered from the journal if the previous vdev did (the
    /// driver offered it again after the restart), else executed and, if
    /// it changed something, journaled.
    pub fn execute_at(
        &mut self,
        position: u16,
        opcode: Opcode,
        request: &[u8],
    ) -> VerbResult<Vec<u8>> {
        if let Some(why) = &self.journal.lost {
            return Err(VerbError::Lost(why.clone()));
        }
        if let Some(done) = self.journal.replay.take() {
            if done.position == position
                && done.opcode == u16::from(opcode)
                && done.request == request
            {
                tracing::info!(tenant = %self.identity.tenant, ?opcode, position,
                    "Answered from the journal a command the previous vdev had executed");
                return match done.errno {
                    0 => Ok(done.payload),
                    errno => Err(VerbError::Replayed(errno)),
                };
            }
        }
        let result = self.execute(opcode, request);
        if let (Some(_), Some(touched)) = (&self.fabric, journaled(opcode)) {
            self.journal_command(position, opcode, touched, request, &result);
        }
        result
    }

    /// Sends hostd the record of the object `opcode` touched (`touched`:
    /// [`journaled`]) and its answer.
    fn journal_command(
        &mut self,
        position: u16,
        opcode: Opcode,
        (kind, named): (u8, Named),
        request: &[u8],
        result: &VerbResult<Vec<u8>>,
    ) {
        let (errno, payload) = match result {
            Ok(payload) => (0, payload.clone()),
            Err(e) => (e.errno(), Vec::new()),
        };
        let mut records = Vec::new();
        let id = match named {
            Named::ByRequest => first_u32(request),
            // A failed creation made nothing.
            Named::ByResponse => first_u32(&payload),
            Named::Fixed(id) => Some(id),
        };
        if let Some(id) = id {
            records.push(self.record(kind, id));
            if matches!(named, Named::ByResponse) {
                records.push(self.record(kind::HANDLES, 0));
            }
        }
        let done = DoneRecord {
            position,
            opcode: u16::from(opcode),
            request: request.to_vec(),
            errno,
            payload,
        };
        records.push(Record {
            kind: kind::DONE,
            id: 0,
            data: encode(&done),
        });
        self.send_journal(records);
    }

    /// Sends `records` (and the key, the first time).
    fn send_journal(&mut self, records: Vec<Record>) {
        let Some(fabric) = &self.fabric else {
            return;
        };
        let key = (!self.journal.key_sent)
            .then_some(self.journal.key)
            .flatten();
        self.journal.key_sent |= key.is_some();
        fabric.journal(Journal { key, records });
    }

    /// The record of object `id` of `kind` as it is now (`data: None`:
    /// it is gone).
    fn record(&self, kind: u8, id: u32) -> Record {
        let data = match kind {
            kind::PD => self.pds.get(&id).and_then(|_| encode(&PdRecord {})),
            kind::MR => self.mrs.get(&id).and_then(|mr| {
                let segments = (mr.shadow.segments().iter())
                    .map(|s| Some((self.slots.number(&s.slot)?, s.gpa, s.len)))
                    .collect::<Option<Vec<_>>>()?;
                encode(&MrRecord {
                    pdn: mr.pdn,
                    lkey: mr.lkey,
                    rkey: mr.rkey,
                    iova: mr.shadow.iova,
                    len: mr.shadow.len,
                    access: mr.shadow.access,
                    segments,
                    revoked: mr.shadow.is_revoked(),
                })
            }),
            kind::CQ => self.cqs.get(&id).and_then(|cq| {
                encode(&CqRecord {
                    depth: cq.depth,
                    comp_vector: cq.comp_vector,
                    ring_addr: cq.ring_addr,
                })
            }),
            kind::QP => self.qps.get(&id).and_then(|qp| {
                encode(&QpRecord {
                    qp_type: u8::from(qp.qp_type),
                    pdn: qp.pdn,
                    send_cqn: qp.send_cqn,
                    recv_cqn: qp.recv_cqn,
                    sq_sig_all: qp.sq_sig_all,
                    cap: qp.cap.as_bytes().to_vec(),
                    sq: (qp.sq.0, qp.sq.1.depth, qp.sq.1.stride),
                    rq: (qp.rq.0, qp.rq.1.depth, qp.rq.1.stride),
                    db_index: qp.db_index,
                    srqn: qp.srqn,
                    state: u8::from(qp.state),
                    attr: qp.attr.as_bytes().to_vec(),
                })
            }),
            kind::SRQ => self.srqs.get(&id).and_then(|srq| {
                encode(&SrqRecord {
                    pdn: srq.pdn,
                    ring: (srq.ring.0, srq.ring.1.depth, srq.ring.1.stride),
                    max_wr: srq.max_wr,
                    max_sge: srq.max_sge,
                    limit: srq.limit,
                })
            }),
            kind::AH => self.ahs.get(&id).and_then(|ah| {
                encode(&AhRecord {
                    pdn: ah.pdn,
                    attr: ah.attr.as_bytes().to_vec(),
                })
            }),
            kind::EQ => self.eqs.get(&id).and_then(|eq| {
                encode(&RingRecord {
                    addr: eq.ring_addr,
                    depth: eq.depth,
                })
            }),
            kind::DOORBELL => self
                .doorbell
                .and_then(|addr| encode(&RingRecord { addr, depth: 0 })),
            kind::HANDLES => encode(&HandlesRecord {
                next: self.next_handle,
            }),
            kind::SLOT => (self.slots.slot_of(id)).and_then(|slot| {
                let (dev, ino, offset) = slot.file_backing()?;
                encode(&SlotRecord {
                    gpa: slot.gpa,
                    len: slot.len(),
                    dev,
                    ino,
                    offset,
                })
            }),
            _ => None,
        };
        Record { kind, id, data }
    }

    /// Journals memory slots hostd took or dropped under `numbers`.
    pub(super) fn journal_slots(&mut self, numbers: &[u32]) {
        if numbers.is_empty() || self.journal.lost.is_some() {
            return;
        }
        let records = numbers
            .iter()
            .map(|&n| self.record(kind::SLOT, n))
            .collect();
        self.send_journal(records);
    }

    /// Gives a hostd that holds nothing of this context's journal (it
    /// restarted, or took the context over in a handover) all of it: the
    /// key and every record, in messages of at most half a message of
    /// data (JSON escaping may double it). Without it the context would
    /// not be kept should this vdev die later.
    pub(super) fn journal_everything(&mut self) {
        if self.journal.lost.is_some() {
            return;
        }
        let Some(fabric) = self.fabric.clone() else {
            return;
        };
        let budget = vrdma_hostd_protocol::messages::MAX_MESSAGE / 2;
        let mut key = self.journal.key;
        self.journal.key_sent = key.is_some();
        let (mut page, mut used) = (Vec::new(), 0);
        for record in self.journal_records() {
            // The record's data and its frame (kind, id, field names).
            let len = record.data.as_ref().map_or(0, String::len) + 48;
            if used + len > budget && !page.is_empty() {
                let records = std::mem::take(&mut page);
                fabric.journal(Journal {
                    key: key.take(),
                    records,
                });
                used = 0;
            }
            used += len;
            page.push(record);
        }
        // The last (or only) message, even empty: it says the journal is
        // whole after the requests that brought the context back.
        fabric.journal(Journal {
            key: key.take(),
            records: page,
        });
    }

    /// Journals that every object is gone (the device was reset); the
    /// memory slots stay, as in hostd.
    pub(super) fn journal_released(&mut self, gone: Vec<(u8, u32)>) {
        let records = gone
            .into_iter()
            .map(|(kind, id)| Record {
                kind,
                id,
                data: None,
            })
            .collect();
        self.send_journal(records);
    }

    /// Every object's record key, for [`Self::journal_released`].
    pub(super) fn object_keys(&self) -> Vec<(u8, u32)> {
        let keys = |kind: u8, ids: Vec<u32>| ids.into_iter().map(move |id| (kind, id));
        keys(kind::PD, self.pds.keys().copied().collect())
            .chain(keys(kind::MR, self.mrs.keys().copied().collect()))
            .chain(keys(kind::CQ, self.cqs.keys().copied().collect()))
            .chain(keys(kind::QP, self.qps.keys().copied().collect()))
            .chain(keys(kind::SRQ, self.srqs.keys().copied().collect()))
            .chain(keys(kind::AH, self.ahs.keys().copied().collect()))
            .chain(keys(kind::EQ, self.eqs.keys().copied().collect()))
            .chain(self.doorbell.map(|_| (kind::DOORBELL, 0)))
            .chain([(kind::DONE, 0)])
            .collect()
    }

    /// The context's control queue is keyed `key` and starts at avail
    /// `position` (the frontend's). At 0 it is a fresh driver: hostd
    /// learns the key with the next journal (and drops an orphan of the
    /// same key). Past 0 it is a driver that was running when its vdev
    /// died: the context is taken over from hostd and rebuilt; if that
    /// fails, the context is lost and its commands fail with EIO. Returns
    /// false when it is too early to tell: a driver coming back has not
    /// given every queue's eventfds yet (try at its next notification).
    pub fn control_queue_started(&mut self, key: ContextKey, position: u16) -> bool {
        tracing::debug!(tenant = %self.identity.tenant, ?key, position, "Control queue started");
        if self.fabric.is_none() {
            self.journal.key = Some(key);
            return true;
        }
        if position == 0 {
            // A frontend that will not come back gives hostd no key: its
            // context goes with this vdev (its memory may be reused).
            if self.journal.reconnects {
                self.journal.key = Some(key);
                self.send_journal(Vec::new());
            }
            return true;
        }
        let Some(notifiers) = self.frontend_notifiers() else {
            tracing::debug!(tenant = %self.identity.tenant,
                "A driver is coming back; its queues are not all set up yet");
            return false;
        };
        self.journal.key = Some(key);
        match self
            .adopt(key)
            .and_then(|()| self.renew_notifiers(notifiers))
        {
            Ok(()) => {
                self.journal.key_sent = true;
                let (pds, mrs, cqs, qps) = self.object_counts();
                tracing::info!(tenant = %self.identity.tenant, pds, mrs, cqs, qps,
                    srqs = self.srqs.len(), ahs = self.ahs.len(), position,
                    "Took over the context of the previous vdev");
            }
            Err(e) => {
                let why = vrdma_errors::error_chain(&e);
                tracing::warn!(tenant = %self.identity.tenant, position,
                    "A driver came back but its context cannot be taken over; its commands \
                     fail: {why}");
                self.journal.lost = Some(why);
            }
        }
        true
    }

    /// Whether the frontend acked `VRDMA_F_RECONNECT` (SET_FEATURES).
    pub fn set_frontend_reconnects(&mut self, reconnects: bool) {
        self.journal.reconnects = reconnects;
    }

    /// Every eventfd hostd may need, if the frontend gave them all yet:
    /// the doorbell queue's kick and each completion vector's interrupt
    /// (none without eventfds to lend: nothing to renew).
    fn frontend_notifiers(&self) -> Option<Notifiers> {
        let Some(fds) = &self.notify_fds else {
            return Some(Notifiers::default());
        };
        let kick = fds.doorbell_kick().ok()?;
        let calls = (0..u32::from(self.identity.comp_vectors))
            .map(|v| fds.vector_call(v).ok().map(|fd| (v, fd)))
            .collect::<Option<Vec<_>>>()?;
        Some(Notifiers {
            kick: Some(kick),
            calls,
        })
    }

    /// Takes the orphan keyed `key` over from hostd and rebuilds this
    /// context from its records. All or nothing: on error nothing of the
    /// records is kept (hostd's side of an adopted context is reset).
    fn adopt(&mut self, key: ContextKey) -> Result<(), AdoptError> {
        let Some(fabric) = self.fabric.clone() else {
            return Ok(());
        };
        let records = fabric.adopt(key).map_err(AdoptError::Fabric)?;
        tracing::debug!(tenant = %self.identity.tenant, records = ?records.iter().map(|r| (r.kind, r.id)).collect::<Vec<_>>(),
            "The previous vdev's journal");
        match self.rebuild(&records) {
            Ok(()) => Ok(()),
            Err(e) => {
                // hostd's objects of the context must not run on
                // unaccounted: reset them.
                if let Err(reset) = fabric.reset_device() {
                    tracing::warn!(tenant = %self.identity.tenant, error = %reset,
                        "hostd did not reset the context that could not be taken over");
                }
                Err(e)
            }
        }
    }

    /// Gives hostd the eventfds the frontend came back with (`notifiers`)
    /// for the doorbell page and event rings the context has: a VMM
    /// creates new ones when it reconnects (a process-mode driver brings
    /// the same), and the old ones would wake and interrupt no one.
    fn renew_notifiers(&self, notifiers: Notifiers) -> Result<(), AdoptError> {
        let Some(fabric) = &self.fabric else {
            return Ok(());
        };
        let kick = notifiers.kick.as_ref().filter(|_| self.doorbell.is_some());
        let calls: Vec<(u32, std::os::fd::BorrowedFd<'_>)> = (notifiers.calls.iter())
            .filter(|(v, _)| self.eqs.contains_key(v))
            .map(|(v, fd)| (*v, std::os::fd::AsFd::as_fd(fd)))
            .collect();
        fabric
            .renew_notifiers(kick.map(std::os::fd::AsFd::as_fd), &calls)
            .map_err(AdoptError::Fabric)
    }

    /// Rebuilds the objects from `records`, checked like guest input.
    fn rebuild(&mut self, records: &[Record]) -> Result<(), AdoptError> {
        let mut by_kind: BTreeMap<u8, Vec<&Record>> = BTreeMap::new();
        let mut seen = std::collections::HashSet::new();
        for record in records {
            if !(kind::PD..=kind::DONE).contains(&record.kind) {
                return Err(invalid(record.kind, record.id, "unknown kind"));
            }
            // One record per object: hostd keeps them by kind and id.
            if !seen.insert((record.kind, record.id)) {
                return Err(invalid(record.kind, record.id, "recorded twice"));
            }
            by_kind.entry(record.kind).or_default().push(record);
        }
        let of = |k: u8| by_kind.get(&k).map(Vec::as_slice).unwrap_or_default();
        // A context that created nothing has no handle record yet.
        let mut next = Rebuilt {
            next_handle: 1,
            ..Rebuilt::default()
        };
        let max_handle = records
            .iter()
            // QPs are numbered apart (random QP numbers).
            .filter(|r| {
                matches!(
                    r.kind,
                    kind::PD | kind::MR | kind::CQ | kind::SRQ | kind::AH
                )
            })
            .map(|r| r.id)
            .max()
            .unwrap_or(0);
        for r in of(kind::SLOT) {
            let s: SlotRecord = decode(r)?;
            let slot = SlotId::of_file(s.gpa, s.len, s.dev, s.ino, s.offset);
            next.slots.insert(r.id, slot);
        }
        for r in of(kind::HANDLES) {
            let h: HandlesRecord = decode(r)?;
            next.next_handle = h.next;
        }
        if next.next_handle == 0 || next.next_handle <= max_handle {
            return Err(invalid(
                kind::HANDLES,
                0,
                "the next handle is already in use",
            ));
        }
        for r in of(kind::PD) {
            let _: PdRecord = decode(r)?;
            next.pds.insert(r.id, ProtectionDomain::default());
        }
        for r in of(kind::DOORBELL) {
            let d: RingRecord = decode(r)?;
            self.check_ring(d.addr, ring::doorbell::PAGE_SIZE)
                .map_err(|e| invalid(r.kind, r.id, e.to_string()))?;
            next.doorbell = Some(d.addr);
        }
        for r in of(kind::EQ) {
            let e: RingRecord = decode(r)?;
            let bad = |why: String| invalid(r.kind, r.id, why);
            self.check_vector(r.id).map_err(|e| bad(e.to_string()))?;
            if !ring::valid_depth(e.depth) {
                return Err(bad(format!("depth {}", e.depth)));
            }
            self.check_ring(e.addr, ring::event_ring_bytes(e.depth))
                .map_err(|e| bad(e.to_string()))?;
            next.eqs.insert(
                r.id,
                EventRing {
                    ring_addr: e.addr,
                    depth: e.depth,
                },
            );
        }
        for r in of(kind::CQ) {
            let c: CqRecord = decode(r)?;
            let bad = |why: String| invalid(r.kind, r.id, why);
            self.check_vector(c.comp_vector)
                .map_err(|e| bad(e.to_string()))?;
            if ring::cq_depth(c.depth) != Some(c.depth) {
                return Err(bad(format!("depth {}", c.depth)));
            }
            self.check_ring(c.ring_addr, ring::cq_ring_bytes(c.depth))
                .map_err(|e| bad(e.to_string()))?;
            next.cqs.insert(
                r.id,
                CompletionQueue {
                    depth: c.depth,
                    comp_vector: c.comp_vector,
                    ring_addr: c.ring_addr,
                    users: 0,
                },
            );
        }
        for r in of(kind::MR) {
            let m: MrRecord = decode(r)?;
            let bad = |why: &str| invalid(r.kind, r.id, why);
            let pd = pd_of(&mut next.pds, m.pdn, r)?;
            let segments = (m.segments.iter())
                .map(|&(number, gpa, len)| {
                    let slot = *next.slots.get(&number).ok_or_else(|| bad("no such slot"))?;
                    let end = gpa
                        .checked_add(len)
                        .ok_or_else(|| bad("segment overflows"))?;
                    let slot_end = slot.gpa.saturating_add(slot.len());
                    if gpa < slot.gpa || end > slot_end {
                        return Err(bad("segment outside its slot"));
                    }
                    Ok(Segment { slot, gpa, len })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let total = segments.iter().try_fold(0u64, |t, s| t.checked_add(s.len));
            if total != Some(m.len) || m.iova.checked_add(m.len).is_none() {
                return Err(bad("segments do not add up to the region"));
            }
            if m.lkey == 0 || m.rkey == 0 || next.lkeys.insert(m.lkey, r.id).is_some() {
                return Err(bad("keys zero or twice"));
            }
            pd.mrs += 1;
            next.mr_bytes = next.mr_bytes.saturating_add(m.len);
            let shadow = ShadowRegion::restored(m.iova, m.len, m.access, segments, m.revoked);
            next.mrs.insert(
                r.id,
                MemoryRegion {
                    pdn: m.pdn,
                    lkey: m.lkey,
                    rkey: m.rkey,
                    shadow,
                },
            );
        }
        for r in of(kind::SRQ) {
            let q: SrqRecord = decode(r)?;
            let bad = |why: String| invalid(r.kind, r.id, why);
            // SRQs and AHs keep their PD busy as QPs do.
            pd_of(&mut next.pds, q.pdn, r)?.qps += 1;
            let ring = geometry(q.ring);
            self.check_ring(ring.0, ring.1.ring_bytes())
                .map_err(|e| bad(e.to_string()))?;
            next.srqs.insert(
                r.id,
                SharedReceiveQueue {
                    pdn: q.pdn,
                    ring,
                    max_wr: q.max_wr,
                    max_sge: q.max_sge,
                    limit: q.limit,
                    users: 0,
                },
            );
        }
        for r in of(kind::QP) {
            let q: QpRecord = decode(r)?;
            let bad = |why: String| invalid(r.kind, r.id, why);
            let qp_type = QpType::try_from(q.qp_type).map_err(|t| bad(format!("QP type {t}")))?;
            let state = QpState::try_from(q.state).map_err(|s| bad(format!("state {s}")))?;
            let cap = control::QpCap::read_from_bytes(&q.cap).map_err(|_| bad("cap".into()))?;
            let attr = control::QpAttr::read_from_bytes(&q.attr).map_err(|_| bad("attr".into()))?;
            pd_of(&mut next.pds, q.pdn, r)?.qps += 1;
            for cqn in [q.send_cqn, q.recv_cqn] {
                let cq = next
                    .cqs
                    .get_mut(&cqn)
                    .ok_or_else(|| bad(format!("no CQ {cqn}")))?;
                cq.users += 1;
            }
            if let Some(srqn) = q.srqn {
                let srq = next
                    .srqs
                    .get_mut(&srqn)
                    .ok_or_else(|| bad(format!("no SRQ {srqn}")))?;
                srq.users += 1;
            }
            let (sq, rq) = (geometry(q.sq), geometry(q.rq));
            for (addr, g) in [sq, rq] {
                self.check_ring(addr, g.ring_bytes())
                    .map_err(|e| bad(e.to_string()))?;
            }
            if !next.db_indexes.claim(q.db_index) {
                return Err(bad(format!(
                    "doorbell index {} twice or too big",
                    q.db_index
                )));
            }
            next.qps.insert(
                r.id,
                QueuePair {
                    qpn: r.id,
                    qp_type,
                    pdn: q.pdn,
                    send_cqn: q.send_cqn,
                    recv_cqn: q.recv_cqn,
                    sq_sig_all: q.sq_sig_all,
                    cap,
                    sq,
                    rq,
                    db_index: q.db_index,
                    srqn: q.srqn,
                    state,
                    attr,
                },
            );
        }
        for r in of(kind::AH) {
            let a: AhRecord = decode(r)?;
            let bad = |why: &str| invalid(r.kind, r.id, why);
            pd_of(&mut next.pds, a.pdn, r)?.qps += 1;
            let attr = control::AhAttr::read_from_bytes(&a.attr).map_err(|_| bad("attr"))?;
            next.ahs.insert(r.id, AddressHandle { pdn: a.pdn, attr });
        }
        for r in of(kind::DONE) {
            next.replay = Some(decode(r)?);
        }
        if !next.qps.is_empty() && next.doorbell.is_none() {
            return Err(invalid(kind::QP, 0, "QPs without a doorbell page"));
        }
        self.install(next);
        Ok(())
    }

    /// Makes the checked objects of `next` this context's, counts them in
    /// the device's quotas (a policy lowered meanwhile only refuses new
    /// objects) and tells hostd which memory slots the context now has.
    fn install(&mut self, next: Rebuilt) {
        for (what, n) in [
            (Counted::Pd, next.pds.len()),
            (Counted::Mr, next.mrs.len()),
            (Counted::Cq, next.cqs.len()),
            (Counted::Qp, next.qps.len()),
            (Counted::Srq, next.srqs.len()),
            (Counted::Ah, next.ahs.len()),
        ] {
            self.share.add(what, n as u32);
        }
        self.share.add_bytes(next.mr_bytes);
        for &qpn in next.qps.keys() {
            self.share.hold_qpn(qpn);
        }
        self.pds = next.pds;
        self.mrs = next.mrs;
        self.lkeys = next.lkeys;
        self.mr_bytes = next.mr_bytes;
        self.cqs = next.cqs;
        self.qps = next.qps;
        self.srqs = next.srqs;
        self.ahs = next.ahs;
        self.eqs = next.eqs;
        self.doorbell = next.doorbell;
        self.db_indexes = next.db_indexes;
        self.next_handle = next.next_handle;
        self.journal.replay = next.replay;
        // The slots the orphan had are hostd's now; the fresh context's
        // went with it. Offer what the memory table has beyond them, drop
        // what it no longer has, and revoke shadows over memory gone.
        self.slots.clear();
        for (number, slot) in next.slots {
            self.slots.taken(slot, number);
        }
        let mem = self.mem.clone();
        self.update_memory(mem);
    }
}

/// The eventfds a frontend that came back lent vdev, for hostd.
#[derive(Default)]
struct Notifiers {
    /// The doorbell queue's kick.
    kick: Option<std::os::fd::OwnedFd>,
    /// Each completion vector's interrupt.
    calls: Vec<(u32, std::os::fd::OwnedFd)>,
}

/// Objects rebuilt from records, before they become the context's.
#[derive(Default)]
struct Rebuilt {
    slots: HashMap<u32, SlotId>,
    next_handle: u32,
    pds: HashMap<u32, ProtectionDomain>,
    mrs: HashMap<u32, MemoryRegion>,
    lkeys: HashMap<u32, u32>,
    mr_bytes: u64,
    cqs: HashMap<u32, CompletionQueue>,
    qps: HashMap<u32, QueuePair>,
    srqs: HashMap<u32, SharedReceiveQueue>,
    ahs: HashMap<u32, AddressHandle>,
    eqs: BTreeMap<u32, EventRing>,
    doorbell: Option<u64>,
    db_indexes: super::notify::DbIndexes,
    replay: Option<DoneRecord>,
}

impl RdmaDevice {
    /// Every record a journal of this context holds now (what hostd would
    /// hand a successor): for tests and the fuzz check.
    pub fn journal_records(&self) -> Vec<Record> {
        let keys = (self.object_keys().into_iter())
            .chain(self.slots.numbers().into_iter().map(|n| (kind::SLOT, n)))
            .chain([(kind::HANDLES, 0)]);
        keys.map(|(kind, id)| self.record(kind, id))
            .filter(|r| r.data.is_some())
            .collect()
    }

    /// Rebuilds this context (fresh, with its memory) from `records`, as a
    /// successor does after hostd handed them over: for tests and the
    /// fuzz check.
    pub fn rebuild_from(&mut self, records: &[Record]) -> Result<(), AdoptError> {
        self.rebuild(records)
    }
}
