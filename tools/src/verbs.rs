//! What every vrdma program does first with the verbs: open a device with
//! a protection domain and a completion queue, create RC queue pairs,
//! connect two of them (RESET → INIT → RTR → RTS), post signaled RDMA work
//! and poll for its completions. The demo, the bench, the guest program
//! and the tests all take it from here.

use std::path::Path;
use std::time::{Duration, Instant};

use vrdma_guest_driver::{
    CompletionQueue, Context, DeviceOptions, Error, ProtectionDomain, QpCapabilities, QpInitAttr,
    QueuePair, SendPayload, SendWr, Sge, WorkCompletion,
};
use vrdma_spec::control::QpAttr;
use vrdma_spec::qp_state::{mask, rc_transition};
use vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_spec::verbs::{access, Mtu, QpState, QpType, SendOpcode};

/// A device opened the way most programs start: one PD and one CQ, and
/// GID 0 of port 1. Fields drop in order: the objects before the device.
#[derive(Debug)]
pub struct Opened {
    pub cq: CompletionQueue,
    pub pd: ProtectionDomain,
    pub ctx: Context,
    /// Port 1's GID 0, what peers connect to (hostd assigns it).
    pub gid: [u8; 16],
}

impl Opened {
    /// Opens the device a vdev serves on `socket` (process mode) with a PD
    /// and a CQ of `cq_depth` entries on vector 0.
    pub fn open(socket: &Path, cq_depth: u32) -> Result<Self, Error> {
        Self::open_with(socket, cq_depth, DeviceOptions::default())
    }

    /// [`Opened::open`] with the device opened with `options`.
    pub fn open_with(socket: &Path, cq_depth: u32, options: DeviceOptions) -> Result<Self, Error> {
        let ctx = Context::open_vhost_user_with(socket, options)?;
        let gid = ctx.query_gid(1, 0)?.gid;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(cq_depth, 0)?;
        Ok(Self { cq, pd, ctx, gid })
    }

    /// A new RC QP on this device's PD whose work completes on its CQ.
    pub fn rc_qp(&self, cap: QpCapabilities) -> Result<QueuePair, Error> {
        rc_qp(&self.pd, &self.cq, cap)
    }
}

/// An RC QP on `pd` whose sends and receives complete on `cq`, signaled
/// per work request.
pub fn rc_qp(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    cap: QpCapabilities,
) -> Result<QueuePair, Error> {
    pd.create_qp(&QpInitAttr {
        send_cq: cq,
        recv_cq: cq,
        cap,
        qp_type: QpType::Rc,
        sq_sig_all: false,
        srq: None,
    })
}

/// Capacities for most programs: 64 WRs each way, 4 SGEs, 64 inline bytes.
pub fn default_caps() -> QpCapabilities {
    QpCapabilities {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    }
}

/// The attribute mask of the transition that connects a QP to `state`
/// (RESET → INIT, INIT → RTR or RTR → RTS): the state and every attribute
/// the spec requires for it (`vrdma_spec::qp_state::rc_transition`). For
/// any other state, the state alone.
pub fn mask_to(state: QpState) -> u32 {
    let from = match state {
        QpState::Init => QpState::Reset,
        QpState::Rtr => QpState::Init,
        QpState::Rts => QpState::Rtr,
        _ => return mask::STATE,
    };
    mask::STATE | rc_transition(from, state).map_or(0, |rule| rule.required)
}

/// How a QP is connected to its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connection {
    /// Remote access it grants its peer.
    pub access: u32,
    /// Retries of a SEND that found no receive (7: forever).
    pub rnr_retry: u8,
    /// The RNR delay it asks its peer for.
    pub min_rnr_timer: u8,
    /// Local ACK timeout (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Retries of a transport error (no answer).
    pub retry_cnt: u8,
    /// RDMA READs and atomics in flight, each way.
    pub rd_atomic: u8,
}

impl Connection {
    /// Every remote access, infinite RNR retries, the shortest RNR delay.
    pub const DEFAULT: Connection = Connection {
        access: access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
        rnr_retry: 7,
        min_rnr_timer: 1,
        timeout: 14,
        retry_cnt: 7,
        rd_atomic: 4,
    };
}

impl Default for Connection {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The three transitions that connect a QP to `dest_qpn` at GID `dgid`
/// on port 1 (a GRH from GID index 0, as RoCE wants; path MTU 1024, what
/// every port of a cluster takes; PSNs 0), each with its mask.
pub fn transitions(dest_qpn: u32, dgid: [u8; 16], how: Connection) -> [(QpAttr, u32); 3] {
    transitions_at(dest_qpn, dgid, how, Mtu::Mtu1024)
}

/// [`transitions`] with path MTU `mtu` (at most the port's active MTU).
pub fn transitions_at(
    dest_qpn: u32,
    dgid: [u8; 16],
    how: Connection,
    mtu: Mtu,
) -> [(QpAttr, u32); 3] {
    let init = QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        qp_access_flags: how.access.into(),
        ..QpAttr::default()
    };
    let mut rtr = QpAttr {
        qp_state: QpState::Rtr.into(),
        // A QP between devices of one host ignores it.
        path_mtu: mtu.into(),
        dest_qp_num: dest_qpn.into(),
        max_dest_rd_atomic: how.rd_atomic,
        min_rnr_timer: how.min_rnr_timer,
        ..QpAttr::default()
    };
    rtr.ah_attr.port_num = 1;
    rtr.ah_attr.is_global = 1;
    rtr.ah_attr.dgid = dgid;
    rtr.ah_attr.sgid_index = 0;
    rtr.ah_attr.hop_limit = 64;
    let rts = QpAttr {
        qp_state: QpState::Rts.into(),
        timeout: how.timeout,
        retry_cnt: how.retry_cnt,
        rnr_retry: how.rnr_retry,
        max_rd_atomic: how.rd_atomic,
        ..QpAttr::default()
    };
    let to = [QpState::Init, QpState::Rtr, QpState::Rts];
    [(init, to[0]), (rtr, to[1]), (rts, to[2])].map(|(attr, to)| (attr, mask_to(to)))
}

/// RESET → INIT → RTR → RTS towards `dest_qpn` at GID `dgid`.
pub fn bring_up(
    qp: &QueuePair,
    dest_qpn: u32,
    dgid: [u8; 16],
    how: Connection,
) -> Result<(), Error> {
    bring_up_at(qp, dest_qpn, dgid, how, Mtu::Mtu1024)
}

/// [`bring_up`] with path MTU `mtu`.
pub fn bring_up_at(
    qp: &QueuePair,
    dest_qpn: u32,
    dgid: [u8; 16],
    how: Connection,
    mtu: Mtu,
) -> Result<(), Error> {
    for (attr, attr_mask) in transitions_at(dest_qpn, dgid, how, mtu) {
        qp.modify(&attr, attr_mask)?;
    }
    Ok(())
}

/// A signaled RDMA or atomic work request from `sges` to `remote_addr`
/// under `rkey`.
pub fn rdma_wr(
    wr_id: u64,
    opcode: SendOpcode,
    sges: &[Sge],
    remote_addr: u64,
    rkey: u32,
) -> SendWr<'_> {
    let mut wr = signaled(SendWr::new(wr_id, opcode, SendPayload::Sges(sges)));
    wr.remote_addr = remote_addr;
    wr.rkey = rkey;
    wr
}

/// `wr`, asking for a completion.
pub fn signaled(mut wr: SendWr<'_>) -> SendWr<'_> {
    wr.flags |= SIGNALED;
    wr
}

/// A verbs enum as libibverbs spells it: `RdmaWrite` → `RDMA_WRITE`.
pub fn ib_name(value: impl std::fmt::Debug) -> String {
    let mut out = String::new();
    for (i, c) in format!("{value:?}").chars().enumerate() {
        if i > 0 && c.is_ascii_uppercase() {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Polls `cq` until at least `want` completions arrived or `within`
/// passed, and returns all that arrived, in order (more than `want` when
/// more were there: a caller that expects exactly `want` sees them). Yields the CPU between empty
/// polls: on a small machine the daemons need it.
pub fn poll_for(
    cq: &CompletionQueue,
    want: usize,
    within: Duration,
) -> Result<Vec<WorkCompletion>, Error> {
    let deadline = Instant::now() + within;
    let mut out = Vec::with_capacity(want);
    let mut batch = [WorkCompletion::default(); 16];
    while out.len() < want {
        let got = cq.poll(&mut batch)?;
        out.extend_from_slice(&batch[..got]);
        if got == 0 {
            if Instant::now() >= deadline {
                break;
            }
            std::thread::yield_now();
        }
    }
    Ok(out)
}
