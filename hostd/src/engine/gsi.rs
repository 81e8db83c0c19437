//! QP1, the General Services Interface, of each device: the way the
//! InfiniBand connection manager's MADs travel (REQ, REP, RTU, REJ, DREQ,
//! ...; IBA 12, and as Linux speaks them over RoCEv2 in rdma-core's
//! `cma.c`/`cm.c`). No tenant QP is QP1 (vdev never hands out QP numbers
//! 0 and 1, and a tenant QP may not hold QP1's controlled Q_Key), so a
//! tenant never builds or receives these packets: the device's control
//! plane (vdev) hands hostd a MAD to send ([`Engine::gsi_send`]) and takes
//! the ones that arrived ([`Engine::take_gsi`]).
//!
//! What is policed here, whoever asks: only CM MADs (base version 1,
//! management class 0x07) of exactly [`MAD_LEN`] bytes go out or come in;
//! a MAD goes to another device of this host only if that device's tenant
//! may reach the sender's network, and comes in from another host only if
//! the receiving device's tenant may reach the network the directory gives
//! its source GID (the same walls as RTR and UD's); each device queues at
//! most [`GSI_QUEUE`] MADs not yet taken. On the wire a MAD is one UD SEND
//! ONLY from QP1 to QP1 with Q_Key [`GSI_QKEY`]. Every drop is counted.
//!
//! QP1 has a send queue of its own, as a NIC's: a MAD for another host
//! that finds the wire's packet queue full (a thousand REQs of one
//! `cmtime` come at once, from a vdev's connection thread, which may not
//! hand packets to the kernel itself) waits in the [`Outbox`], in order,
//! and the datapath's next round sends it. Refusing it instead left the
//! connection to the CM's retransmission timer: seconds.

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::channel::Channel;
use vrdma_hostd_protocol::messages::{MadIn, Response};
use vrdma_roce::{Bth, Deth, Headers, Ipv4Meta, Opcode, Packet, Psn, DEFAULT_PKEY};
use vrdma_spec::gid::{ipv4_mapped, ipv4_of};

use super::wire::state::Path;
use super::wire::{Emit, Wire};
use super::{DeviceId, Engine, EngineError};
use crate::gids::Gid;

/// QP1's number.
pub const GSI_QPN: u32 = 1;
/// QP1's well-known Q_Key (IBA 15.4.1, Linux's `IB_QP1_QKEY`).
pub const GSI_QKEY: u32 = 0x8001_0000;
/// A MAD's size.
pub const MAD_LEN: usize = 256;
/// The MAD common header's base version and the CM's management class.
pub const MAD_BASE_VERSION: u8 = 1;
pub const CM_CLASS: u8 = 0x07;
/// MADs a device queues for its control plane at most: a burst of
/// connection requests whole (`cmtime` sends a thousand REQs at once; 256
/// dropped some, and each drop cost its connection the CM's retransmission
/// timeout, seconds). Linux's MAD layer posts 512 receives on QP1 and
/// takes them in the kernel as they come; a vdev's CM thread takes them
/// in batches, later.
pub const GSI_QUEUE: usize = 4096;
/// MADs waiting in the [`Outbox`] at most: from one device, and in all.
pub const OUTBOX_PER_DEVICE: usize = 2048;
pub const OUTBOX: usize = 8192;

/// A CM MAD and the other end of its trip: its destination when sent,
/// its source when received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mad {
    pub peer: Gid,
    /// The QP number the peer used (QP1 for the CM; kept for SIDR
    /// replies, which Linux sends from QP1 too).
    pub peer_qpn: u32,
    /// The IP TOS it travels with (the path's traffic class).
    pub traffic_class: u8,
    pub bytes: Box<[u8; MAD_LEN]>,
}

/// What QP1 of a device did (kept in the device's counters, folded into
/// its tenant's: `vrdmactl stats`' `gsi`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GsiCounts {
    pub sent: u64,
    pub received: u64,
    /// Arrived while [`GSI_QUEUE`] MADs were waiting: dropped (the CM's
    /// retries recover).
    pub queue_full: u64,
}

/// A device's QP1 state.
#[derive(Debug, Default)]
pub struct Gsi {
    queue: VecDeque<Mad>,
    /// Signalled when a MAD joins an empty queue.
    notify: Option<EventFd>,
    /// Where a MAD goes at once while none is queued (the connection
    /// manager reads it there, without a request per MAD); one that finds
    /// it full is queued, and so is every MAD after it until the queue is
    /// empty again, so that all that came there is older than what waits.
    push: Option<Channel>,
}

/// `mad` as vdev receives it.
pub fn mad_in(mad: &Mad) -> MadIn {
    MadIn {
        peer: mad.peer,
        peer_qpn: mad.peer_qpn,
        traffic_class: mad.traffic_class,
        mad: mad.bytes.to_vec(),
    }
}

/// QP1's send queue towards other hosts: MADs the wire had no room for
/// yet, oldest first, and how many each sending context has in it.
#[derive(Debug, Default)]
pub struct Outbox {
    waiting: VecDeque<Outgoing>,
    per_device: std::collections::HashMap<DeviceId, usize>,
}

#[derive(Debug)]
struct Outgoing {
    from: DeviceId,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    mad: Mad,
}

impl Outbox {
    /// Whether MADs wait.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    fn push(&mut self, m: Outgoing) -> Result<(), EngineError> {
        let mine = self.per_device.get(&m.from).copied().unwrap_or(0);
        if mine >= OUTBOX_PER_DEVICE || self.waiting.len() >= OUTBOX {
            return Err(EngineError::Limit("MADs queued towards the network"));
        }
        self.per_device.insert(m.from, mine + 1);
        self.waiting.push_back(m);
        Ok(())
    }

    fn pop(&mut self) -> Option<Outgoing> {
        let m = self.waiting.pop_front()?;
        if let Some(n) = self.per_device.get_mut(&m.from) {
            *n -= 1;
            if *n == 0 {
                self.per_device.remove(&m.from);
            }
        }
        Some(m)
    }
}

/// Whether `bytes` is a CM MAD hostd carries.
fn is_cm_mad(bytes: &[u8]) -> bool {
    bytes.len() == MAD_LEN && bytes[0] == MAD_BASE_VERSION && bytes[1] == CM_CLASS
}

impl Engine {
    /// Sends CM MAD `mad` from QP1 of device `id` to QP1 of `mad.peer`:
    /// queued at once for a device of this host, one packet on the wire
    /// for another host's GID.
    pub fn gsi_send(&mut self, id: DeviceId, mad: &Mad) -> Result<(), EngineError> {
        if !is_cm_mad(&mad.bytes[..]) {
            return Err(EngineError::Invalid(
                "QP1 carries connection manager MADs only (base version 1, class 0x07)",
            ));
        }
        let dev = self.devices.get(&id).ok_or(EngineError::UnknownDevice)?;
        let (src_gid, network) = (dev.gid, Arc::<str>::from(dev.policy.network()));
        let local = (self.gids.get(&mad.peer))
            .and_then(|contexts| contexts.first())
            .copied();
        if let Some(dest) = local {
            let received = Mad {
                peer: src_gid,
                peer_qpn: GSI_QPN,
                ..mad.clone()
            };
            let reaches = (self.devices.get(&dest)).is_some_and(|d| d.policy.may_reach(&network));
            if !reaches {
                return Err(EngineError::Privileged(
                    "the destination's tenant may not be reached from this network",
                ));
            }
            self.gsi_deliver(dest, received);
            self.gsi_count(id, |c| c.sent += 1);
            return Ok(());
        }
        let ends = ipv4_of(&src_gid).zip(ipv4_of(&mad.peer));
        let (src, dst) = ends
            .map(|(s, d)| (Ipv4Addr::from(s), Ipv4Addr::from(d)))
            .ok_or(EngineError::Invalid("not an IPv4 GID"))?;
        let mut w = self.wire.take().ok_or(EngineError::Unsupported(
            "a MAD towards another host (this hostd is on no fabric)",
        ))?;
        // Behind MADs already waiting, in order.
        let emitted = match self.gsi_out.is_empty() {
            true => gsi_emit(&mut w, src, dst, mad),
            false => Emit::Full,
        };
        self.wire = Some(w);
        match emitted {
            Emit::Sent => {
                self.gsi_count(id, |c| c.sent += 1);
                Ok(())
            }
            Emit::Full => self.gsi_out.push(Outgoing {
                from: id,
                src,
                dst,
                mad: mad.clone(),
            }),
            Emit::LocalError => Err(EngineError::Invalid("the MAD could not be put in a packet")),
        }
    }

    /// Moves the MADs waiting in the outbox to the wire's send queue (a
    /// datapath round: a full queue goes to the kernel on the way) while
    /// it takes them; true if some still wait. A MAD of a context gone
    /// meanwhile goes too: its peer's CM sorts it out as any late MAD.
    pub(super) fn gsi_send_waiting(&mut self, w: &mut Wire) -> bool {
        while let Some(m) = self.gsi_out.waiting.front() {
            match gsi_emit(w, m.src, m.dst, &m.mad) {
                Emit::Full => return true,
                emitted => {
                    let from = m.from;
                    self.gsi_out.pop();
                    if emitted == Emit::Sent {
                        self.gsi_count(from, |c| c.sent += 1);
                    }
                }
            }
        }
        false
    }

    /// Up to `max` MADs that arrived for device `id` (any context of it),
    /// oldest first.
    pub fn take_gsi(&mut self, id: DeviceId, max: usize) -> Result<Vec<Mad>, EngineError> {
        let owner = self.gsi_owner(id)?;
        let dev = self.device_mut(owner)?;
        let n = dev.gsi.queue.len().min(max);
        Ok(dev.gsi.queue.drain(..n).collect())
    }

    /// From now on `notify` is signalled when a MAD arrives for device
    /// `id` (any context of it) and none was waiting.
    pub fn set_gsi_notify(&mut self, id: DeviceId, notify: EventFd) -> Result<(), EngineError> {
        let owner = self.gsi_owner(id)?;
        let dev = self.device_mut(owner)?;
        if !dev.gsi.queue.is_empty() {
            let _ = notify.write(1);
        }
        dev.gsi.notify = Some(notify);
        Ok(())
    }

    /// From now on MADs for device `id` (any context of it) are pushed on
    /// `push` while none waits to be taken (a previous socket no longer).
    pub fn set_gsi_push(&mut self, id: DeviceId, push: Channel) -> Result<(), EngineError> {
        let owner = self.gsi_owner(id)?;
        self.device_mut(owner)?.gsi.push = Some(push);
        Ok(())
    }

    /// The context that holds QP1 of context `id`'s device: its first
    /// (QP1 is the device's, whichever context asks).
    fn gsi_owner(&self, id: DeviceId) -> Result<DeviceId, EngineError> {
        let gid = self.devices.get(&id).ok_or(EngineError::UnknownDevice)?.gid;
        Ok((self.gids.get(&gid))
            .and_then(|contexts| contexts.first())
            .copied()
            .unwrap_or(id))
    }

    /// Context `gone`, which held its device's QP1, is leaving and `next`
    /// is its device's first context now: QP1's waiting MADs and eventfd
    /// move there.
    pub(super) fn gsi_hand_over(&mut self, gsi: Gsi, next: DeviceId) {
        if let Some(dev) = self.devices.get_mut(&next) {
            dev.gsi = gsi;
        }
    }

    /// What QP1 of device `id` did.
    pub fn gsi_counts(&self, id: DeviceId) -> Option<GsiCounts> {
        self.devices.get(&id).map(|d| d.counters.gsi)
    }

    /// Queues `mad` for device `dest`'s control plane (counted, or
    /// dropped when its queue is full).
    fn gsi_deliver(&mut self, dest: DeviceId, mad: Mad) {
        if let Some(dev) = self.devices.get_mut(&dest) {
            if dev.gsi.queue.is_empty() {
                if let Some(push) = &dev.gsi.push {
                    match push.try_send(&Response::Mads(vec![mad_in(&mad)])) {
                        Ok(true) => {
                            dev.counters.gsi.received += 1;
                            return;
                        }
                        // Full: queued, the eventfd wakes the reader.
                        Ok(false) => {}
                        // Its reader gone (or not a socket that takes
                        // them): the queue alone from now on.
                        Err(_) => dev.gsi.push = None,
                    }
                }
            }
            if dev.gsi.queue.len() >= GSI_QUEUE {
                dev.counters.gsi.queue_full += 1;
                return;
            }
            dev.gsi.queue.push_back(mad);
            dev.counters.gsi.received += 1;
            if dev.gsi.queue.len() == 1 {
                if let Some(n) = &dev.gsi.notify {
                    // A full counter already wakes the reader.
                    let _ = n.write(1);
                }
            }
        }
    }

    fn gsi_count(&mut self, id: DeviceId, f: impl FnOnce(&mut GsiCounts)) {
        if let Some(dev) = self.devices.get_mut(&id) {
            f(&mut dev.counters.gsi);
        }
    }

    /// A UD packet for QP1 from peer host `peer`, whose source GID is in
    /// `network`.
    pub(super) fn gsi_receive(
        &mut self,
        w: &mut Wire,
        peer: usize,
        network: &str,
        meta: &Ipv4Meta,
        tos: u8,
        pkt: &Packet<'_>,
    ) {
        self.gsi_packets += 1;
        let Some(deth) = pkt.deth else {
            w.drop_packet(peer, "missing_deth");
            return;
        };
        if deth.qkey != GSI_QKEY {
            w.drop_packet(peer, "gsi_qkey");
            return;
        }
        let Ok(bytes) = <[u8; MAD_LEN]>::try_from(pkt.payload) else {
            w.drop_packet(peer, "gsi_not_cm");
            return;
        };
        if !is_cm_mad(&bytes) {
            w.drop_packet(peer, "gsi_not_cm");
            return;
        }
        let dgid = ipv4_mapped(meta.dst.octets());
        let Some(dest) = (self.gids.get(&dgid))
            .and_then(|contexts| contexts.first())
            .copied()
        else {
            w.drop_packet(peer, "gsi_no_device");
            return;
        };
        if !(self.devices.get(&dest)).is_some_and(|d| d.policy.may_reach(network)) {
            w.drop_packet(peer, "gsi_unreachable_source");
            return;
        }
        let mad = Mad {
            peer: ipv4_mapped(meta.src.octets()),
            peer_qpn: deth.src_qp,
            traffic_class: tos,
            bytes: Box::new(bytes),
        };
        let full = (self.devices.get(&dest)).is_some_and(|d| d.gsi.queue.len() >= GSI_QUEUE);
        if full {
            w.drop_packet(peer, "gsi_queue_full");
        }
        self.gsi_deliver(dest, mad);
    }
}

/// Queues `mad` as a UD SEND ONLY from QP1 of `src` to QP1 of `dst`.
fn gsi_emit(w: &mut Wire, src: Ipv4Addr, dst: Ipv4Addr, mad: &Mad) -> Emit {
    let path = Path {
        src,
        dst,
        tos: mad.traffic_class,
        dest_qpn: GSI_QPN,
        mtu: MAD_LEN as u32,
    };
    let mut h = Headers::new(Bth {
        opcode: Opcode::UdSendOnly,
        solicited: false,
        migreq: false,
        pad: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qp: GSI_QPN,
        ack_req: false,
        psn: Psn::new(0),
    });
    h.deth = Some(Deth {
        qkey: GSI_QKEY,
        src_qp: GSI_QPN,
    });
    w.emit_control(&path, &h, MAD_LEN, |out| {
        out.copy_from_slice(&mad.bytes[..]);
        true
    })
}
