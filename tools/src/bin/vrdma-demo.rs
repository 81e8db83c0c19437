//! `vrdma-demo`: see vrdma work without RDMA hardware or a VM.
//!
//! It starts `hostd` (the host's NIC, on its embedded default policy:
//! tenants `alpha` and `beta` in network `demo`) and a sandboxed `vdev` per
//! tenant, each a separate process on a unix socket in a scratch directory
//! (`vrdma_tools::supervisor`), the vdevs configured from `demo.toml`
//! beside this file. This process then plays both tenants' applications
//! through the guest driver in process mode: it opens both devices,
//! registers alpha's application memory in place, connects a QP of each
//! (every state read back from the device) and shows an operation the
//! device refuses. Then RDMA between the tenants, every result checked
//! byte for byte on the other side: a WRITE, a READ, a SEND with immediate
//! data, an atomic fetch-and-add, and a WRITE with a made-up rkey that
//! fails and leaves beta's memory alone. Last, teardown and the daemons'
//! exit. It ends with "vrdma demo: OK"; a failure prints its error chain
//! once, with the end of the daemons' logs, and exits with status 1.

use std::fmt::{self, Debug, Display};
use std::net::Ipv6Addr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use vrdma_errors::error_chain;
use vrdma_guest_driver::{
    CompletionQueue, MemoryRegion, QueuePair, RecvWr, SendPayload, SendWr, WorkCompletion,
};
use vrdma_spec::verbs::access::{LOCAL_WRITE, REMOTE_ATOMIC, REMOTE_READ, REMOTE_WRITE};
use vrdma_spec::verbs::SendOpcode::{self, RdmaRead, RdmaWrite};
use vrdma_spec::verbs::{PortState, QpState, WcStatus};
use vrdma_tools::app_memory::AppMemory;
use vrdma_tools::supervisor::{self, binary_or, Daemon, Launch, Scratch};
use vrdma_tools::verbs::{self, ib_name, poll_for, rdma_wr, signaled, Connection, Opened};

/// The vdev configuration the demo runs with unless `--config` names another.
const DEFAULT_CONFIG: &str = include_str!("demo.toml");
const ALPHA: &str = "alpha";
const BETA: &str = "beta";
/// Bytes of alpha's application buffer: what the WRITE and the READ move.
const LEN: usize = 2 * 4096;
const PATTERN: &[u8] = b"vrdma-demo ";
/// Beta's MR and alpha's second one: the WRITE and the READ land at 0;
/// past them, the SEND's message (sent and received), the atomic's counter
/// (and the value fetched), and what alpha tries to write with a made-up rkey.
const MR_LEN: usize = LEN + 4096;
const SEND_AT: usize = LEN;
const ATOMIC_AT: usize = LEN + 1024;
const INTRUDER_AT: usize = LEN + 2048;
const MESSAGE: &[u8] = b"hello beta, this is alpha";
const IMM: u32 = 0x1234_abcd;
const COUNTER: u64 = 41;
const CQ_TIMEOUT: Duration = Duration::from_secs(5);

/// Command line of `vrdma-demo`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Starts hostd and a vdev for tenants alpha and beta, opens both virtual RDMA \
             devices through the guest driver (process mode) and runs RDMA between them"
)]
struct Args {
    /// Keep the scratch directory (configuration, sockets, daemons' logs);
    /// it is always kept when the demo fails once a daemon ran.
    #[arg(long)]
    keep: bool,
    /// The hostd binary (default: `hostd` next to this executable).
    #[arg(long, value_name = "PATH")]
    hostd: Option<PathBuf>,
    /// The vdev binary (default: `vdev` next to this executable).
    #[arg(long, value_name = "PATH")]
    vdev: Option<PathBuf>,
    /// A vdev config file instead of the built-in one (the demo passes
    /// --socket, --tenant and --hostd, which override its keys).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
enum DemoError {
    #[error(transparent)]
    Daemon(#[from] supervisor::Error),
    #[error("{doing}")]
    Verb {
        doing: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{0}")]
    Wrong(String),
}

type Result<T, E = DemoError> = std::result::Result<T, E>;

/// Says what the demo was doing when a verb (or a mapping) failed.
trait Doing<T> {
    fn doing(self, what: impl Display) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Doing<T> for Result<T, E> {
    fn doing(self, what: impl Display) -> Result<T> {
        self.map_err(|e| DemoError::Verb {
            doing: what.to_string(),
            source: Box::new(e),
        })
    }
}

/// How `main` fails: the error chain once, then the daemons' log tails.
struct Failed(DemoError, Vec<String>);

impl Debug for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "vrdma demo: FAILED: {}", error_chain(&self.0))?;
        self.1.iter().try_for_each(|log| write!(f, "\n{log}"))
    }
}

/// The daemons, vdevs first: that is also the order they die in on drop.
#[derive(Debug, Default)]
struct Daemons {
    vdevs: Vec<Daemon>,
    hostd: Option<Daemon>,
}

fn main() -> Result<(), Failed> {
    let args = Args::parse();
    let mut daemons = Daemons::default();
    let mut scratch = None;
    let result = run(&args, &mut daemons, &mut scratch);
    let logs = daemons.vdevs.iter().chain(&daemons.hostd);
    let logs: Vec<String> = logs.map(|d| d.log_tail(12)).collect();
    drop(daemons);
    if let Some(dir) = scratch.as_mut().filter(|_| args.keep || result.is_err()) {
        dir.set_keep(true);
        println!("    (scratch directory kept: {})", dir.path().display());
    }
    result.map_err(|e| Failed(e, logs))?;
    println!("vrdma demo: OK");
    Ok(())
}

fn wrong<T>(what: String) -> Result<T> {
    Err(DemoError::Wrong(what))
}

/// Steps 1 and 12: the daemons' lives around the applications'.
fn run(args: &Args, daemons: &mut Daemons, scratch: &mut Option<Scratch>) -> Result<()> {
    let hostd = binary_or(args.hostd.as_deref(), "hostd", "vrdma-hostd")?;
    let vdev = binary_or(args.vdev.as_deref(), "vdev", "vrdma-vdev")?;
    println!("vrdma demo: RDMA between tenants {ALPHA} and {BETA}, each with its own device:");
    println!("    hostd plays the host's NIC, a vdev per tenant serves the tenant's device,");
    println!("    and this process is both tenants' application (guest driver, process mode)");
    let dir = scratch.insert(Scratch::new("demo")?);
    let config = match &args.config {
        Some(path) => path.clone(),
        None => dir.write("demo.toml", DEFAULT_CONFIG)?,
    };

    println!("[1] Start hostd, then a sandboxed vdev for each tenant");
    let hostd = Launch::hostd(&hostd, dir.path()).start()?;
    let (pid, socket) = (hostd.pid(), hostd.socket().to_owned());
    let at = socket.display();
    println!("    hostd      pid {pid} on {at}, policy: its embedded default");
    daemons.hostd = Some(hostd);
    for tenant in [ALPHA, BETA] {
        let launch = Launch::vdev(&vdev, dir.path(), tenant, Some(&socket));
        let vdev = launch.arg("--config").arg(&config).arg("--once").start()?;
        let (pid, at) = (vdev.pid(), vdev.socket().display());
        println!("    vdev       {tenant}: pid {pid} on {at}");
        daemons.vdevs.push(vdev);
    }
    let config = config.display();
    println!("    config     {config} (--tenant and --hostd given as flags)");
    applications(&daemons.vdevs[0], &daemons.vdevs[1])?;

    println!("[12] Stop the daemons");
    for vdev in &mut daemons.vdevs {
        let (status, name) = (vdev.wait_exit(supervisor::TIMEOUT)?, vdev.name());
        if !status.success() {
            return wrong(format!("{name} exited with {status}"));
        }
        println!("    {name:<10} exited with status 0 once its device was closed");
    }
    if let Some(hostd) = daemons.hostd.as_mut() {
        let status = hostd.stop()?;
        if !status.success() && status.signal() != Some(libc::SIGTERM) {
            return wrong(format!("hostd exited with {status} on SIGTERM"));
        }
        println!("    hostd      exited on the SIGTERM the demo sent ({status})");
    }
    Ok(())
}

/// Fails unless `mr` holds `want` at `at`.
fn expect_bytes(what: &str, mr: &MemoryRegion, at: usize, want: &[u8]) -> Result<()> {
    let mut got = vec![0; want.len()];
    mr.read(at, &mut got).doing(format!("reading {what}"))?;
    match got.iter().zip(want).position(|(g, w)| g != w) {
        Some(first) => wrong(format!("{what}: the bytes differ from offset {first} on")),
        None => Ok(()),
    }
}

/// One tenant's application: its device (PD, CQ) and an RC QP.
struct App {
    qp: QueuePair,
    dev: Opened,
    name: &'static str,
}

impl App {
    fn open(vdev: &Daemon, name: &'static str) -> Result<Self> {
        let dev = Opened::open(vdev.socket(), 64).doing(format!("opening {name}'s device"))?;
        let qp = dev.rc_qp(verbs::default_caps()).doing("create_qp")?;
        let port = dev.ctx.query_port(1).doing("query_port")?;
        let state = PortState::try_from(port.state).map_or_else(|v| v.to_string(), ib_name);
        let device = dev.ctx.config().name().unwrap_or("?").to_owned();
        let (gid, pd, cq, qpn) = (
            Ipv6Addr::from(dev.gid),
            dev.pd.pdn(),
            dev.cq.cqn(),
            qp.qp_num(),
        );
        println!(
            "    {name:<10} {device}: port 1 {state}, GID {gid}, PD {pd}, CQ {cq}, QP {qpn:#x}"
        );
        let (on, all) = vdev.seccomp_threads();
        println!("    sandbox    its vdev runs under a seccomp filter on {on} of {all} threads");
        Ok(Self { qp, dev, name })
    }

    /// The QP's state, as the device reports it.
    fn state(&self) -> Result<String> {
        let (qp, name) = (&self.qp, self.name);
        let query = qp.query(0).doing(format!("{name}'s query_qp"))?;
        let state = QpState::try_from(query.attr.qp_state);
        Ok(state.map_or_else(|v| v.to_string(), ib_name))
    }

    /// Posts `wr` and waits for its completion, which must have `status`;
    /// says what completed: `RDMA_WRITE SUCCESS`.
    fn post(&self, wr: SendWr<'_>, status: WcStatus) -> Result<String> {
        let (qp, name) = (&self.qp, self.name);
        qp.post_send(&[wr]).doing(format!("{name}'s post_send"))?;
        let wc = one(&self.dev.cq, name)?;
        if (wc.wr_id, wc.status) != (wr.wr_id, status) {
            return wrong(format!("{name}'s completion {wc:?} is not wr {}", wr.wr_id));
        }
        Ok(match wc.opcode.filter(|_| status == WcStatus::Success) {
            Some(opcode) => format!("{} {}", ib_name(opcode), ib_name(status)),
            None => ib_name(status),
        })
    }
}

/// The one completion `cq` gets within [`CQ_TIMEOUT`].
fn one(cq: &CompletionQueue, whose: &str) -> Result<WorkCompletion> {
    let wcs = poll_for(cq, 1, CQ_TIMEOUT).doing(format!("polling {whose}'s CQ"))?;
    match wcs[..] {
        [wc] => Ok(wc),
        _ => wrong(format!("{whose}'s CQ had {wcs:?} within {CQ_TIMEOUT:?}")),
    }
}

/// Steps 2 to 11: what the two tenants' applications do.
fn applications(alpha: &Daemon, beta: &Daemon) -> Result<()> {
    println!("[2] Open both devices: this process is each vdev's vhost-user frontend");
    let (mut a, b) = (App::open(alpha, ALPHA)?, App::open(beta, BETA)?);
    let gid = a.dev.ctx.query_gid(1, 0).doing("query_gid")?;
    let kind = match gid.gid_type.get() {
        vrdma_spec::control::gid_type::ROCE_V2 => "RoCE v2",
        _ => "not RoCE v2",
    };
    println!("    GID 0      {} ({kind})", Ipv6Addr::from(gid.gid));

    println!("[3] Register alpha's application memory in place; beta allocates an MR");
    let buffer = AppMemory::new(LEN).doing("mapping a buffer")?;
    buffer.write(&PATTERN.repeat(LEN / PATTERN.len() + 1)[..LEN]);
    let flags = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ;
    // SAFETY: `buffer` is this process's private mapping, used by this
    // thread only; the MR is deregistered before `buffer` is unmapped.
    let mr = unsafe { a.dev.pd.reg_mr(buffer.as_ptr(), buffer.len(), flags) }.doing("reg_mr")?;
    expect_bytes("the registered buffer", &mr, 0, &buffer.read())?;
    let (lkey, rkey, at) = (mr.lkey(), mr.rkey(), buffer.as_ptr());
    println!("    alpha      {LEN} bytes at {at:p}: lkey {lkey:#010x}, rkey {rkey:#010x}");
    let text = String::from_utf8_lossy(&buffer.read()[..PATTERN.len()]).into_owned();
    println!("    in place   the application's pointer still reads {text:?}");
    let (pd_a, pd_b) = (&a.dev.pd, &b.dev.pd);
    let landing = pd_a.alloc_mr(MR_LEN, LOCAL_WRITE).doing("alloc_mr")?;
    let flags = flags | REMOTE_ATOMIC;
    let peer = pd_b.alloc_mr(MR_LEN, flags).doing("alloc_mr")?;
    let (rkey, iova) = (peer.rkey(), peer.iova());
    println!("    beta       alloc_mr of {MR_LEN} bytes: rkey {rkey:#010x}, iova {iova:#x}");

    println!("[4] Connect the QPs: RESET -> INIT -> RTR -> RTS, as queried back from vdev");
    println!("    {:<10} alpha's QP, as created", a.state()?);
    let (qpn, gid) = (b.qp.qp_num(), b.dev.gid);
    for (attr, mask) in verbs::transitions(qpn, gid, Connection::DEFAULT) {
        a.qp.modify(&attr, mask).doing("alpha's modify_qp")?;
        let state = a.state()?;
        let at = Ipv6Addr::from(gid);
        println!("    {state:<10} towards beta's QP {qpn:#08x} at GID {at}");
    }
    let (qpn, gid) = (a.qp.qp_num(), a.dev.gid);
    verbs::bring_up(&b.qp, qpn, gid, Connection::DEFAULT).doing("beta's modify_qp")?;
    println!("    beta       its QP went the same way to {}", b.state()?);

    println!("[5] An operation the device refuses");
    a.dev.pd = match a.dev.pd.destroy() {
        Err(refused) if refused.errno() == libc::EBUSY => refused.object,
        Err(refused) => return Err(refused).doing("dealloc_pd of a busy PD"),
        Ok(()) => return wrong("the device let a PD with MRs and a QP go".into()),
    };
    println!("    refused    dealloc_pd of a PD with MRs and a QP: EBUSY; the PD is handed back");

    // A WRITE of alpha's buffer into beta's MR, then a READ of it back.
    let write = "[6] RDMA WRITE: alpha's application buffer -> beta's MR";
    let wrote = format!("beta's MR holds the {LEN} bytes");
    let read = "[7] RDMA READ: beta's MR -> another MR of alpha's";
    let back = format!("the {LEN} bytes read back equal alpha's buffer");
    let transfers = [
        (write, RdmaWrite, &mr, &peer, wrote),
        (read, RdmaRead, &landing, &landing, back),
    ];
    for (wr_id, (title, op, from, to, verified)) in (1..).zip(transfers) {
        println!("{title}");
        let sge = [from.sge(0, LEN as u32)];
        let wr = rdma_wr(wr_id, op, &sge, peer.iova(), peer.rkey());
        println!("    alpha      {}", a.post(wr, WcStatus::Success)?);
        expect_bytes(title, to, 0, &buffer.read())?;
        println!("    verified   {verified}, byte for byte");
    }

    println!("[8] SEND with immediate data: alpha -> a receive beta posted");
    let sg_list: &[_] = &[peer.sge(SEND_AT as u64, 256)];
    let recv = RecvWr { wr_id: 9, sg_list };
    b.qp.post_recv(&[recv]).doing("post_recv")?;
    landing.write(SEND_AT, MESSAGE).doing("writing")?;
    let sge = [landing.sge(SEND_AT as u64, MESSAGE.len() as u32)];
    let payload = SendPayload::Sges(&sge);
    let mut wr = signaled(SendWr::new(3, SendOpcode::SendWithImm, payload));
    wr.imm_data = IMM.to_be_bytes();
    let done = a.post(wr, WcStatus::Success)?;
    println!("    alpha      {done} with imm {IMM:#010x}");
    let wc = one(&b.dev.cq, BETA)?;
    let imm = wc.imm_data.map(u32::from_be_bytes).unwrap_or_default();
    let got = (wc.status, wc.byte_len as usize, imm, wc.src_qp);
    if got != (WcStatus::Success, MESSAGE.len(), IMM, a.qp.qp_num()) {
        return wrong(format!("beta's completion {wc:?} is not alpha's SEND"));
    }
    expect_bytes("beta's receive buffer", &peer, SEND_AT, MESSAGE)?;
    let (status, len) = (ib_name(wc.status), wc.byte_len);
    println!("    beta       RECV {status}, byte_len {len}, imm {imm:#010x}, from alpha's QP");

    println!("[9] Atomic fetch-and-add: alpha adds 1 to a counter in beta's MR");
    let (old, new) = (COUNTER.to_le_bytes(), (COUNTER + 1).to_le_bytes());
    peer.write(ATOMIC_AT, &old).doing("writing the counter")?;
    let sge = [landing.sge(ATOMIC_AT as u64, 8)];
    let at = peer.iova() + ATOMIC_AT as u64;
    let mut wr = rdma_wr(4, SendOpcode::AtomicFetchAndAdd, &sge, at, peer.rkey());
    wr.compare_add = 1;
    let done = a.post(wr, WcStatus::Success)?;
    expect_bytes("the fetched value", &landing, ATOMIC_AT, &old)?;
    println!("    alpha      {done}, fetched {COUNTER}");
    expect_bytes("the counter", &peer, ATOMIC_AT, &new)?;
    let after = COUNTER + 1;
    println!("    verified   beta's counter went from {COUNTER} to {after}");

    println!("[10] Isolation: an RDMA WRITE with a made-up rkey");
    let keys = [&mr, &landing, &peer].map(|m| [m.lkey(), m.rkey()]);
    let rkey = (0x0bad_c0de..).find(|k| !keys.as_flattened().contains(k));
    let rkey = rkey.unwrap_or_default();
    landing.write(INTRUDER_AT, &[0xee; 64]).doing("writing")?;
    let mut before = vec![0; MR_LEN];
    peer.read(0, &mut before).doing("reading beta's MR")?;
    let sge = [landing.sge(INTRUDER_AT as u64, 64)];
    let wr = rdma_wr(5, RdmaWrite, &sge, peer.iova(), rkey);
    let status = a.post(wr, WcStatus::RemAccessErr)?;
    println!("    alpha      a WRITE with rkey {rkey:#010x} -> {status} (remote access error)");
    expect_bytes("beta's MR after the made-up rkey", &peer, 0, &before)?;
    let (alpha, beta) = (a.state()?, b.state()?);
    if (alpha.as_str(), beta.as_str()) != ("ERR", "RTS") {
        return wrong(format!("then alpha's QP is {alpha}, beta's {beta}"));
    }
    println!("    verified   beta's MR is unchanged; alpha's QP is now {alpha}, beta's {beta}");
    teardown([a, b], [mr, landing, peer], &buffer)
}

/// Step 11: everything destroyed, children first, then both devices closed.
fn teardown(apps: [App; 2], mrs: [MemoryRegion; 3], buffer: &AppMemory) -> Result<()> {
    println!("[11] Tear down, children first");
    let mut devices = Vec::new();
    for App { qp, dev, name } in apps {
        qp.destroy().doing(format!("{name}'s destroy_qp"))?;
        devices.push(dev);
    }
    for mr in mrs {
        mr.dereg().doing("dereg_mr")?;
    }
    let text = String::from_utf8_lossy(&buffer.read()[..PATTERN.len()]).into_owned();
    println!("    QPs, MRs   destroyed; alpha's buffer is the application's again: {text:?}");
    for Opened { cq, pd, ctx, .. } in devices {
        cq.destroy().doing("destroy_cq")?;
        pd.destroy().doing("dealloc_pd")?;
        drop(ctx);
    }
    println!("    CQs, PDs   destroyed; both devices closed, so both vdevs exit (--once)");
    Ok(())
}
