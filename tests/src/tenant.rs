//! The tests' harness for RDMA between tenants: a tenant as applications
//! see one (its vdev attached to hostd, the device opened through the
//! guest driver's process mode, a PD and a CQ), connected RC queue pairs,
//! and the checks most tests make on their completions and memory. The
//! verbs themselves come from `vrdma_tools::verbs`, which the programs use
//! too; here a failure fails the test.

use std::time::{Duration, Instant};

use vrdma_guest_driver::{
    CompletionQueue, Context, DeviceOptions, MemoryRegion, ProtectionDomain, QpCapabilities,
    QueuePair, RecvWr, SendPayload, SendWr, Sge, WorkCompletion,
};
use vrdma_spec::verbs::{access, SendOpcode, WcStatus};
pub use vrdma_tools::verbs::{
    bring_up, default_caps, mask_to, rc_qp, rdma_wr as rdma, signaled, Connection,
};
use vrdma_tools::verbs::{poll_for, Opened};

use crate::daemon::{Hostd, Vdev};

/// One tenant's device, opened. Fields drop in order: the verbs objects and
/// the device before the vdev process that serves them.
#[derive(Debug)]
pub struct Tenant {
    pub cq: CompletionQueue,
    pub pd: ProtectionDomain,
    pub ctx: Context,
    /// The port's GID 0, what peers connect to (assigned by hostd).
    pub gid: [u8; 16],
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

    /// Opens the device `vdev` serves (a new frontend connection), with a
    /// CQ of 1024 entries.
    pub fn open(vdev: Vdev) -> Self {
        Self::open_with(vdev, DeviceOptions::default())
    }

    /// [`Tenant::open`], the device opened so that it does not wait for a
    /// vdev that went away to come back: its verbs fail at once.
    pub fn open_without_reconnect(vdev: Vdev) -> Self {
        let options = DeviceOptions {
            reconnect_patience: Duration::ZERO,
            ..DeviceOptions::default()
        };
        Self::open_with(vdev, options)
    }

    fn open_with(vdev: Vdev, options: DeviceOptions) -> Self {
        let Opened { cq, pd, ctx, gid } = Opened::open_with(&vdev.socket, 1024, options)
            .unwrap_or_else(|e| panic!("open the device: {e}\n{}", vdev.log()));
        Tenant {
            cq,
            pd,
            ctx,
            gid,
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
            gid: _,
            vdev,
        } = self;
        drop((cq, pd, ctx));
        vdev
    }

    /// A new RC QP on this tenant's PD and CQ.
    pub fn qp(&self, cap: QpCapabilities) -> QueuePair {
        rc_qp(&self.pd, &self.cq, cap).expect("create_qp")
    }
}

/// Connects `qa` (of `a`) and `qb` (of `b`) to each other.
pub fn connect(a: &Tenant, qa: &QueuePair, b: &Tenant, qb: &QueuePair, how: Connection) {
    bring_up(qa, qb.qp_num(), b.gid, how).expect("bring up the first QP");
    bring_up(qb, qa.qp_num(), a.gid, how).expect("bring up the second QP");
}

/// A QP of `a` and a QP of `b` (default capacities), connected to each
/// other.
pub fn qp_pair(a: &Tenant, b: &Tenant, how: Connection) -> (QueuePair, QueuePair) {
    let (qa, qb) = (a.qp(default_caps()), b.qp(default_caps()));
    connect(a, &qa, b, &qb, how);
    (qa, qb)
}

/// hostd, tenants alpha and beta (its default policy's), and one
/// connected QP pair: where most RDMA tests start. Fields drop in order:
/// the QPs before their devices, the devices before hostd.
#[derive(Debug)]
pub struct Pair {
    pub qa: QueuePair,
    pub qb: QueuePair,
    pub a: Tenant,
    pub b: Tenant,
    pub hostd: Hostd,
}

impl Pair {
    /// A pair connected as [`Connection::default`].
    pub fn start() -> Self {
        Self::start_with(Connection::default())
    }

    /// A pair connected `how`.
    pub fn start_with(how: Connection) -> Self {
        let hostd = Hostd::start(None);
        let a = Tenant::start(&hostd, "alpha");
        let b = Tenant::start(&hostd, "beta");
        assert_ne!(a.gid, b.gid, "hostd gives each device its own GID");
        let (qa, qb) = qp_pair(&a, &b, how);
        Pair {
            qa,
            qb,
            a,
            b,
            hostd,
        }
    }
}

impl Pair {
    /// An MR of `len` bytes with every access on each side: alpha's and
    /// beta's.
    pub fn mrs(&self, len: usize) -> (MemoryRegion, MemoryRegion) {
        let on = |t: &Tenant| t.pd.alloc_mr(len, ALL_ACCESS).expect("alloc_mr");
        (on(&self.a), on(&self.b))
    }

    /// Posts `wr` on alpha's QP and returns its one completion.
    #[track_caller]
    pub fn post(&self, wr: SendWr<'_>) -> WorkCompletion {
        self.qa.post_send(&[wr]).expect("post_send");
        one(&self.a.cq)
    }

    /// Beta posts receive `wr_id` into `sg_list`.
    #[track_caller]
    pub fn recv(&self, wr_id: u64, sg_list: &[Sge]) {
        self.qb
            .post_recv(&[RecvWr { wr_id, sg_list }])
            .expect("post_recv");
    }

    /// Alpha sends `message` inline, unsignaled, as work request `wr_id`.
    #[track_caller]
    pub fn send_inline(&self, wr_id: u64, message: &[u8]) {
        let wr = SendWr::new(wr_id, SendOpcode::Send, SendPayload::Inline(message));
        self.qa.post_send(&[wr]).expect("post_send");
    }

    /// Posts on alpha's QP the RDMA or atomic `opcode` (wr_id 1) from
    /// `local` to `remote_addr` under `rkey`; returns its one completion's
    /// status.
    #[track_caller]
    pub fn rdma(&self, opcode: SendOpcode, local: &[Sge], remote_addr: u64, rkey: u32) -> WcStatus {
        self.post(rdma(1, opcode, local, remote_addr, rkey)).status
    }
}

/// Every access an MR can grant.
pub const ALL_ACCESS: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// Polls `cq` until `n` completions arrived (or panics after 10 s).
#[track_caller]
pub fn wait_completions(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let out = poll_for(cq, n, Duration::from_secs(10)).expect("poll_cq");
    assert!(
        out.len() >= n,
        "only {} of {n} completions within 10 s: {out:?}",
        out.len()
    );
    out
}

/// The one completion `cq` gets (more, or none within 10 s, fails).
#[track_caller]
pub fn one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wcs = wait_completions(cq, 1);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    wcs.remove(0)
}

/// Asserts no completion arrives on `cq` within `wait`.
#[track_caller]
pub fn assert_no_completion(cq: &CompletionQueue, wait: Duration) {
    let deadline = Instant::now() + wait;
    let mut batch = [WorkCompletion::default(); 4];
    while Instant::now() < deadline {
        let got = cq.poll(&mut batch).expect("poll_cq");
        assert_eq!(got, 0, "unexpected completion {:?}", &batch[..got]);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `len` bytes of `mr` at `offset`.
#[track_caller]
pub fn read_mr(mr: &MemoryRegion, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    mr.read(offset, &mut out).expect("read the MR");
    out
}

/// The work request id and status of the next `n` completions on `cq`,
/// in order.
#[track_caller]
pub fn statuses(cq: &CompletionQueue, n: usize) -> Vec<(u64, WcStatus)> {
    wait_completions(cq, n)
        .iter()
        .map(|wc| (wc.wr_id, wc.status))
        .collect()
}

/// Writes [`pattern`]`(len, seed)` at the start of `mr`; the bytes.
pub fn fill(mr: &MemoryRegion, len: usize, seed: u8) -> Vec<u8> {
    let data = pattern(len, seed);
    mr.write(0, &data).expect("fill the MR");
    data
}

/// `len` bytes that differ with `seed` and along the buffer (no period of
/// a page or less), to tell one buffer's bytes from another's.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// A hostd policy of two networks: alpha and beta in `blue`, gamma in
/// `red` (the isolation tests' world).
pub fn blue_and_red() -> String {
    let blue = "network = \"blue\"";
    policy(&[
        ("alpha", blue),
        ("beta", blue),
        ("gamma", "network = \"red\""),
    ])
}

/// A hostd policy: a `[[tenant]]` for each `(name, its other keys)`.
pub fn policy(tenants: &[(&str, &str)]) -> String {
    let block = |(name, keys): &(&str, &str)| format!("[[tenant]]\nname = \"{name}\"\n{keys}\n\n");
    tenants.iter().map(block).collect()
}
