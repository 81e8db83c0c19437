//! A tenant as RDMA applications see one: its vdev (attached to hostd), the
//! device opened through the guest driver's process mode, a PD and a CQ —
//! and the connection dance of two RC queue pairs.

use std::time::{Duration, Instant};

use vrdma_guest_driver::{
    CompletionQueue, Context, ProtectionDomain, QpCapabilities, QpInitAttr, QueuePair,
    WorkCompletion,
};
use vrdma_spec::control::QpAttr;
use vrdma_spec::qp_state::mask;
use vrdma_spec::verbs::{access, Mtu, QpState, QpType};

use crate::daemon::{Hostd, Vdev};

/// One tenant's device, opened. Fields drop in order: the verbs objects and
/// the device before the vdev process that serves them.
#[derive(Debug)]
pub struct Tenant {
    pub cq: CompletionQueue,
    pub pd: ProtectionDomain,
    pub ctx: Context,
    /// The port's LID (assigned by hostd).
    pub lid: u16,
    pub vdev: Vdev,
}

impl Tenant {
    /// Starts a vdev for `tenant` on `hostd` and opens its device.
    pub fn start(hostd: &Hostd, tenant: &str) -> Self {
        Self::start_with(hostd, tenant, &[])
    }

    /// Like [`Tenant::start`] with extra vdev arguments.
    pub fn start_with(hostd: &Hostd, tenant: &str, args: &[&str]) -> Self {
        Self::open(Vdev::on_hostd(hostd, tenant, args))
    }

    /// Opens the device `vdev` serves (a new frontend connection).
    pub fn open(vdev: Vdev) -> Self {
        let ctx = Context::open_vhost_user(&vdev.socket).expect("open the device");
        let lid = ctx.query_port(1).expect("query_port").lid.get();
        let pd = ctx.alloc_pd().expect("alloc_pd");
        let cq = ctx.create_cq(1024, 0).expect("create_cq");
        Tenant {
            cq,
            pd,
            ctx,
            lid,
            vdev,
        }
    }

    /// Closes the device, children first, and hands its vdev back (still
    /// running, waiting for the next frontend, unless it was killed).
    pub fn close(self) -> Vdev {
        let Tenant {
            cq,
            pd,
            ctx,
            lid: _,
            vdev,
        } = self;
        drop((cq, pd, ctx));
        vdev
    }

    /// A new RC QP on this tenant's PD and CQ.
    pub fn qp(&self, cap: QpCapabilities) -> QueuePair {
        self.pd
            .create_qp(&QpInitAttr {
                send_cq: &self.cq,
                recv_cq: &self.cq,
                cap,
                qp_type: QpType::Rc,
                sq_sig_all: false,
            })
            .expect("create_qp")
    }
}

/// Capacities for most tests: 64 WRs each way, 4 SGEs, 64 inline bytes.
pub fn default_caps() -> QpCapabilities {
    QpCapabilities {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    }
}

/// Attribute masks of the connection transitions.
pub const INIT_MASK: u32 = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
pub const RTR_MASK: u32 = mask::STATE
    | mask::AV
    | mask::PATH_MTU
    | mask::DEST_QPN
    | mask::RQ_PSN
    | mask::MAX_DEST_RD_ATOMIC
    | mask::MIN_RNR_TIMER;
pub const RTS_MASK: u32 = mask::STATE
    | mask::SQ_PSN
    | mask::TIMEOUT
    | mask::RETRY_CNT
    | mask::RNR_RETRY
    | mask::MAX_QP_RD_ATOMIC;

/// How a QP is connected.
#[derive(Debug, Clone, Copy)]
pub struct Connection {
    /// Remote access it grants its peer.
    pub access: u32,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
}

impl Default for Connection {
    fn default() -> Self {
        Connection {
            access: access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
            rnr_retry: 7,
            min_rnr_timer: 1,
        }
    }
}

/// RESET → INIT → RTR → RTS towards `dest_qpn` behind `dlid`.
pub fn bring_up(
    qp: &QueuePair,
    dest_qpn: u32,
    dlid: u16,
    how: Connection,
) -> Result<(), vrdma_guest_driver::Error> {
    let init = QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        qp_access_flags: how.access.into(),
        ..QpAttr::default()
    };
    qp.modify(&init, INIT_MASK)?;
    let mut rtr = QpAttr {
        qp_state: QpState::Rtr.into(),
        path_mtu: Mtu::Mtu4096.into(),
        dest_qp_num: dest_qpn.into(),
        max_dest_rd_atomic: 4,
        min_rnr_timer: how.min_rnr_timer,
        ..QpAttr::default()
    };
    rtr.ah_attr.dlid = dlid.into();
    rtr.ah_attr.port_num = 1;
    qp.modify(&rtr, RTR_MASK)?;
    let rts = QpAttr {
        qp_state: QpState::Rts.into(),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: how.rnr_retry,
        max_rd_atomic: 4,
        ..QpAttr::default()
    };
    qp.modify(&rts, RTS_MASK)
}

/// Connects `qa` (of `a`) and `qb` (of `b`) to each other.
pub fn connect(a: &Tenant, qa: &QueuePair, b: &Tenant, qb: &QueuePair, how: Connection) {
    bring_up(qa, qb.qp_num(), b.lid, how).expect("bring up the first QP");
    bring_up(qb, qa.qp_num(), a.lid, how).expect("bring up the second QP");
}

/// Polls `cq` until `n` completions arrived (or panics after 10 s).
pub fn wait_completions(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut batch = [WorkCompletion::default(); 16];
    while out.len() < n {
        let got = cq.poll(&mut batch).expect("poll_cq");
        out.extend_from_slice(&batch[..got]);
        if got == 0 {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} completions within 10 s: {out:?}",
                out.len()
            );
            std::thread::yield_now();
        }
    }
    out
}

/// Asserts no completion arrives on `cq` within `wait`.
pub fn assert_no_completion(cq: &CompletionQueue, wait: Duration) {
    let deadline = Instant::now() + wait;
    let mut batch = [WorkCompletion::default(); 4];
    while Instant::now() < deadline {
        let got = cq.poll(&mut batch).expect("poll_cq");
        assert_eq!(got, 0, "unexpected completion {:?}", &batch[..got]);
        std::thread::sleep(Duration::from_millis(1));
    }
}
