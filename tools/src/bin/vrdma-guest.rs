//! `vrdma-guest`: the guest side of the VM test, runnable on the host too.
//!
//! Two peers run this program, one with `--listen`, one with `--connect`;
//! they exchange their QP information over TCP and check RDMA WRITE, READ
//! and SEND/RECV byte for byte. The device is a vdev socket (process mode,
//! on the host) or a virtio-pci function (`pci:auto`, `pci:BDF`; inside a
//! VM, as root) — same code, other transport. Application buffers are
//! page-aligned anonymous memory registered with `reg_mr`, so in a VM they
//! are pinned and registered by their guest-physical segments.
//!
//! The last line printed is the verdict: `VRDMA-GUEST: PASS <what>` or
//! `VRDMA-GUEST: FAIL <reason>`; the exit code is 0 only on PASS. The
//! listener first prints `VRDMA-GUEST: LISTENING <addr>`.
//!
//! ```text
//! vrdma-guest --device pci:auto --virtio-id 38 --listen 0.0.0.0:18515
//! vrdma-guest --device /run/vrdma/beta.sock --connect 10.0.2.15:18515
//! ```

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv6Addr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use vrdma_errors::error_chain;
use vrdma_guest_driver::{
    CompletionQueue, Context, MemoryRegion, QpCapabilities, RecvWr, SendPayload, SendWr,
    WorkCompletion,
};
use vrdma_spec::verbs::{access, SendOpcode, WcStatus};
use vrdma_tools::app_memory::AppMemory;
use vrdma_tools::verbs::{bring_up, rc_qp, signaled, Connection};

#[derive(Debug, Parser)]
#[command(about = "vrdma guest-side check: WRITE, READ and SEND/RECV against a peer")]
struct Args {
    /// The device: a vdev socket path, `pci:auto` or `pci:<PCI address>`.
    #[arg(long)]
    device: String,
    /// Virtio device id of a PCI device (38 under QEMU 11).
    #[arg(long, default_value_t = 42)]
    virtio_id: u16,
    /// Wait for the peer on this address (e.g. 0.0.0.0:18515).
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    listen: Option<String>,
    /// Connect to the listening peer at this address.
    #[arg(long)]
    connect: Option<String>,
    /// Bytes of each transfer.
    #[arg(long, default_value_t = 64 * 1024)]
    size: usize,
}

const PREFIX: &str = "VRDMA-GUEST:";
const RW: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
const TIMEOUT: Duration = Duration::from_secs(30);

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(what) => {
            println!("{PREFIX} PASS {what}");
            ExitCode::SUCCESS
        }
        Err(reason) => {
            println!("{PREFIX} FAIL {reason}");
            ExitCode::FAILURE
        }
    }
}

/// What a peer tells the other: where its MR is and how to reach its QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PeerInfo {
    /// Its port's GID 0 (what the QP connects to).
    gid: Ipv6Addr,
    qpn: u32,
    rkey: u32,
    addr: u64,
}

impl PeerInfo {
    fn line(&self) -> String {
        format!("{} {} {} {}\n", self.gid, self.qpn, self.rkey, self.addr)
    }

    fn parse(line: &str) -> Result<Self, String> {
        let f: Vec<&str> = line.split_whitespace().collect();
        let bad = || format!("peer sent {line:?}, not `gid qpn rkey addr`");
        if f.len() != 4 {
            return Err(bad());
        }
        Ok(Self {
            gid: f[0].parse().map_err(|_| bad())?,
            qpn: f[1].parse().map_err(|_| bad())?,
            rkey: f[2].parse().map_err(|_| bad())?,
            addr: f[3].parse().map_err(|_| bad())?,
        })
    }
}

/// A line-based TCP channel to the peer.
struct Channel {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Channel {
    fn new(stream: TcpStream) -> Result<Self, String> {
        stream
            .set_read_timeout(Some(TIMEOUT))
            .map_err(|e| format!("socket timeout: {e}"))?;
        let writer = stream.try_clone().map_err(|e| format!("socket: {e}"))?;
        Ok(Self {
            reader: BufReader::new(stream),
            writer,
        })
    }

    fn send(&mut self, line: &str) -> Result<(), String> {
        self.writer
            .write_all(line.as_bytes())
            .map_err(|e| format!("cannot send to the peer: {e}"))
    }

    fn recv(&mut self) -> Result<String, String> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => Err("the peer closed the connection".into()),
            Ok(_) => Ok(line.trim_end().to_owned()),
            Err(e) => Err(format!("cannot read from the peer: {e}")),
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn open(args: &Args) -> Result<Context, String> {
    let opened = match args.device.strip_prefix("pci:") {
        Some("auto") => Context::open_pci(&[], args.virtio_id),
        Some(bdf) => Context::open_pci(&[bdf.to_owned()], args.virtio_id),
        None => Context::open_vhost_user(&args.device),
    };
    opened.map_err(|e| format!("cannot open {}: {}", args.device, error_chain(&e)))
}

/// The CQ's completions, taken by work-request id: the peer's SEND may land
/// in our receive before our own WRITE completes (a slow guest sees that),
/// so completions that are not awaited yet are kept for later.
struct Completions<'a> {
    cq: &'a CompletionQueue,
    early: Vec<WorkCompletion>,
}

impl<'a> Completions<'a> {
    fn new(cq: &'a CompletionQueue) -> Self {
        Self {
            cq,
            early: Vec::new(),
        }
    }

    /// The successful completion of work request `wr_id` (`what`, for errors).
    fn take(&mut self, wr_id: u64, what: &str) -> Result<WorkCompletion, String> {
        let deadline = Instant::now() + TIMEOUT;
        let mut wc = [WorkCompletion::default(); 1];
        loop {
            if let Some(at) = self.early.iter().position(|c| c.wr_id == wr_id) {
                return Ok(self.early.swap_remove(at));
            }
            if self.cq.poll(&mut wc).map_err(|e| format!("poll_cq: {e}"))? == 1 {
                if wc[0].status != WcStatus::Success {
                    return Err(format!(
                        "work request {} completed with {:?} (waiting for {what})",
                        wc[0].wr_id, wc[0].status
                    ));
                }
                if ![WR_WRITE, WR_SEND, WR_READ, WR_RECV].contains(&wc[0].wr_id) {
                    return Err(format!("unexpected completion {}", wc[0].wr_id));
                }
                self.early.push(wc[0]);
                continue;
            }
            if Instant::now() > deadline {
                return Err(format!("no completion for {what} within {TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Work-request ids.
const WR_WRITE: u64 = 1;
const WR_SEND: u64 = 2;
const WR_READ: u64 = 3;
const WR_RECV: u64 = 10;

fn run(args: &Args) -> Result<String, String> {
    let size = args.size;
    if size == 0 || size > (64 << 20) {
        return Err(format!("--size {size}: use 1 byte to 64 MiB"));
    }
    // The device first: a device that cannot be opened fails at once.
    let ctx = open(args)?;
    let gid = ctx
        .query_gid(1, 0)
        .map_err(|e| format!("query_gid: {e}"))?
        .gid;
    let pd = ctx.alloc_pd().map_err(|e| format!("alloc_pd: {e}"))?;
    let cq = ctx
        .create_cq(64, 0)
        .map_err(|e| format!("create_cq: {e}"))?;
    let cap = QpCapabilities {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = rc_qp(&pd, &cq, cap).map_err(|e| format!("create_qp: {e}"))?;
    // Layout of each side's buffer: [0, size) is written by the peer,
    // [size, 2 size) is read by the peer, [2 size, 3 size) is the source of
    // our WRITE and SEND, [3 size, 4 size) receives the peer's SEND and then
    // our READ.
    let buffer =
        AppMemory::new(4 * size).map_err(|e| format!("cannot map {} bytes: {e}", 4 * size))?;
    // SAFETY: our own mapping, alive until after the MR (dropped first,
    // declared later); no other thread touches it.
    let mr: MemoryRegion = unsafe { pd.reg_mr(buffer.as_ptr(), buffer.len(), RW) }
        .map_err(|e| format!("reg_mr: {}", error_chain(&e)))?;
    // Then the peer: the listener's address is printed once it listens.
    let (stream, listening) = match (&args.listen, &args.connect) {
        (Some(addr), _) => {
            let listener =
                TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            let local = listener.local_addr().map_err(|e| e.to_string())?;
            println!("{PREFIX} LISTENING {local}");
            std::io::stdout().flush().map_err(|e| e.to_string())?;
            (
                listener.accept().map_err(|e| format!("accept: {e}"))?.0,
                true,
            )
        }
        (None, Some(addr)) => (connect_retrying(addr)?, false),
        (None, None) => return Err("give --listen or --connect".into()),
    };
    let mut peer_channel = Channel::new(stream)?;

    let seed = if listening { 1 } else { 2 };
    mr.write(size, &pattern(size, seed + 100))
        .map_err(|e| e.to_string())?;
    let me = PeerInfo {
        gid: Ipv6Addr::from(gid),
        qpn: qp.qp_num(),
        rkey: mr.rkey(),
        addr: mr.iova(),
    };
    peer_channel.send(&me.line())?;
    let peer = PeerInfo::parse(&peer_channel.recv()?)?;
    bring_up(&qp, peer.qpn, peer.gid.octets(), Connection::default())
        .map_err(|e| format!("connecting the QP: {}", error_chain(&e)))?;
    let landing = 3 * size as u64;
    let recv_sge = [mr.sge(landing, size as u32)];
    qp.post_recv(&[RecvWr {
        wr_id: WR_RECV,
        sg_list: &recv_sge,
    }])
    .map_err(|e| format!("post_recv: {e}"))?;
    // Both QPs are ready and a receive is posted on each side.
    peer_channel.send("ready\n")?;
    if peer_channel.recv()? != "ready" {
        return Err("peer is not ready".into());
    }

    let peer_seed = if listening { 2 } else { 1 };
    let source = 2 * size as u64;
    // WRITE our pattern into the peer's [0, size).
    mr.write(2 * size, &pattern(size, seed))
        .map_err(|e| e.to_string())?;
    let sge = [mr.sge(source, size as u32)];
    let mut completions = Completions::new(&cq);
    let mut wr = signaled(SendWr::new(
        WR_WRITE,
        SendOpcode::RdmaWrite,
        SendPayload::Sges(&sge),
    ));
    (wr.remote_addr, wr.rkey) = (peer.addr, peer.rkey);
    qp.post_send(&[wr])
        .map_err(|e| format!("post WRITE: {e}"))?;
    completions.take(WR_WRITE, "RDMA WRITE")?;
    // SEND the same bytes; the peer receives them into its landing area.
    let mut wr = signaled(SendWr::new(
        WR_SEND,
        SendOpcode::Send,
        SendPayload::Sges(&sge),
    ));
    wr.imm_data = [0; 4];
    qp.post_send(&[wr]).map_err(|e| format!("post SEND: {e}"))?;
    // Two completions: our SEND and the peer's SEND into our receive.
    completions.take(WR_SEND, "SEND")?;
    let wc = completions.take(WR_RECV, "RECV")?;
    if wc.byte_len as usize != size {
        return Err(format!("received {} bytes, {size} sent", wc.byte_len));
    }
    let mut received = vec![0u8; size];
    mr.read(3 * size, &mut received)
        .map_err(|e| e.to_string())?;
    if received != pattern(size, peer_seed) {
        return Err("RECV: the bytes differ from what the peer sent".into());
    }
    // READ the peer's [size, 2 size) into our landing area.
    let landing_sge = [mr.sge(landing, size as u32)];
    let mut wr = signaled(SendWr::new(
        WR_READ,
        SendOpcode::RdmaRead,
        SendPayload::Sges(&landing_sge),
    ));
    (wr.remote_addr, wr.rkey) = (peer.addr + size as u64, peer.rkey);
    qp.post_send(&[wr]).map_err(|e| format!("post READ: {e}"))?;
    completions.take(WR_READ, "RDMA READ")?;
    let mut read = vec![0u8; size];
    mr.read(3 * size, &mut read).map_err(|e| e.to_string())?;
    if read != pattern(size, peer_seed + 100) {
        return Err("READ: the bytes differ from the peer's memory".into());
    }
    // The peer's WRITE landed in our [0, size) once it says it is done.
    peer_channel.send("done\n")?;
    if peer_channel.recv()? != "done" {
        return Err("peer did not finish".into());
    }
    let mut written = vec![0u8; size];
    mr.read(0, &mut written).map_err(|e| e.to_string())?;
    if written != pattern(size, peer_seed) {
        return Err("WRITE: the peer's bytes did not land in this memory".into());
    }
    // Tell each other the verdict, so each side's PASS means both passed.
    peer_channel.send("pass\n")?;
    if peer_channel.recv()? != "pass" {
        return Err("the peer failed".into());
    }
    Ok(format!(
        "WRITE, READ and SEND/RECV of {size} bytes with {} (qpn {:#x} <-> {:#x})",
        args.device, me.qpn, peer.qpn
    ))
}

/// Connects to `addr`, retrying while the listener is not up yet.
fn connect_retrying(addr: &str) -> Result<TcpStream, String> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("cannot connect to {addr}: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_info_round_trips_and_refuses_garbage() {
        let info = PeerInfo {
            gid: Ipv6Addr::from(vrdma_spec::gid::ipv4_mapped([10, 0, 2, 15])),
            qpn: 0xabcdef,
            rkey: 0xdead_beef,
            addr: 0x7f00_1234_5000,
        };
        assert_eq!(PeerInfo::parse(info.line().trim()).unwrap(), info);
        assert!(PeerInfo::parse("1 2 3").is_err());
        assert!(PeerInfo::parse("1 2 3 x").is_err());
        assert_eq!(
            info.line(),
            "::ffff:10.0.2.15 11259375 3735928559 139638282145792\n"
        );
        assert!(PeerInfo::parse("70000 2 3 4").is_err(), "a LID is no GID");
    }
}
