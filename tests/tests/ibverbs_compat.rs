//! Binary compatibility: Debian's own RDMA programs (ibverbs-utils,
//! perftest), unmodified, on vrdma through the drop-in `libibverbs.so.1`
//! (`guest-driver/libibverbs`), between two process-mode tenants of one
//! hostd. The server side runs on tenant alpha's vdev, the client on
//! beta's; they exchange QP numbers and GIDs over TCP on 127.0.0.1. The
//! port is RoCEv2, so the programs address each other by GID
//! (`ibv_rc_pingpong -g 0`, perftest `-x 0` or its own choice).
//!
//! The programs come from Debian packages (ibverbs-utils, perftest,
//! libibverbs-dev) that `scripts/test` installs; where one is missing, the
//! test fails and says which package to install.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vrdma_tests::daemon::{tcp_listening, wait_output, Hostd, IbverbsShim, TempDir, Vdev};
use vrdma_tests::need;

/// The tests share two cores with the daemons: one program pair at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// TCP ports for the programs' QP exchange, one per run.
fn next_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20000 + (std::process::id() % 20000) as u16;
    base + NEXT.fetch_add(1, Ordering::Relaxed)
}

/// hostd with its two default tenants' vdevs.
struct Fabric {
    // Dropped in declaration order: the vdevs before hostd.
    alpha: Vdev,
    beta: Vdev,
    hostd: Hostd,
}

impl Fabric {
    fn start() -> Self {
        let hostd = Hostd::start(None);
        let alpha = Vdev::on_hostd(&hostd, "alpha", &[]);
        let beta = Vdev::on_hostd(&hostd, "beta", &[]);
        Fabric { alpha, beta, hostd }
    }

    fn logs(&self) -> String {
        format!(
            "--- hostd log:\n{}\n--- vdev alpha log:\n{}\n--- vdev beta log:\n{}",
            self.hostd.log(),
            self.alpha.log(),
            self.beta.log()
        )
    }
}

struct Run {
    server: Output,
    client: Output,
}

impl Run {
    fn text(o: &Output) -> String {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    fn server_text(&self) -> String {
        Self::text(&self.server)
    }

    fn client_text(&self) -> String {
        Self::text(&self.client)
    }
}

/// Runs `program args` as the server on alpha and `program args localhost`
/// as the client on beta (both with `-p port`); both must exit 0.
fn run_pair(shim: &IbverbsShim, fabric: &Fabric, program: &str, args: &[&str]) -> Run {
    let port = next_port().to_string();
    let server = shim
        .command(program, &fabric.alpha.socket)
        .args(["-p", &port])
        .args(args)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tcp_listening(port.parse().expect("port")) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = shim
        .command(program, &fabric.beta.socket)
        .args(["-p", &port])
        .args(args)
        .arg("localhost")
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    let (client, client_late) = wait_output(client, Duration::from_secs(120));
    let (server, server_late) = wait_output(server, Duration::from_secs(20));
    let run = Run { server, client };
    let ok = run.server.status.success() && run.client.status.success();
    assert!(
        ok && !client_late && !server_late,
        "{program} {args:?}: server {:?}{}, client {:?}{}\n--- server:\n{}\n--- client:\n{}\n{}",
        run.server.status,
        if server_late {
            " (killed: too slow)"
        } else {
            ""
        },
        run.client.status,
        if client_late {
            " (killed: too slow)"
        } else {
            ""
        },
        run.server_text(),
        run.client_text(),
        fabric.logs()
    );
    run
}

#[test]
fn ibv_devinfo_lists_the_vrdma_device_with_an_active_port() {
    need::program("ibv_devinfo", "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let fabric = Fabric::start();
    let child = shim
        .command("ibv_devinfo", &fabric.alpha.socket)
        .arg("-v")
        .spawn()
        .expect("spawn ibv_devinfo");
    let (out, late) = wait_output(child, Duration::from_secs(30));
    let text = Run::text(&out);
    assert!(
        out.status.success() && !late,
        "ibv_devinfo: {:?}\n{text}",
        out.status
    );
    for expected in [
        "hca_id:\tvrdma0",
        "transport:\t\t\tInfiniBand (0)",
        "vendor_id:\t\t\t0x1af4",
        "phys_port_cnt:\t\t\t1",
        "state:\t\t\tPORT_ACTIVE (4)",
        "active_mtu:\t\t4096 (5)",
        "link_layer:\t\tEthernet",
        // hostd's GID (no fabric: 127.100.x.y, x.y the device's LID), of
        // type RoCE v2.
        "GID[  0]:\t\t::ffff:127.100.",
        ", RoCE v2",
    ] {
        assert!(text.contains(expected), "no {expected:?} in:\n{text}");
    }
    // RoCE has no LIDs.
    let lid = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("port_lid:"))
        .and_then(|v| v.trim().parse::<u32>().ok())
        .expect("port_lid line");
    assert_eq!(lid, 0, "{text}");
}

#[test]
fn misconfiguration_is_reported_clearly() {
    need::program("ibv_devinfo", "ibverbs-utils");
    let shim = IbverbsShim::new();
    let dir = TempDir::new("ibverbs-noconf");
    // ibv_devinfo on the shim with `VRDMA_DEVICES` unset or set: it fails.
    let fails = |devices: Option<&Path>| {
        let mut command = Command::new("ibv_devinfo");
        command.env("LD_LIBRARY_PATH", shim.path());
        match devices {
            Some(devices) => command.env("VRDMA_DEVICES", devices),
            None => command.env_remove("VRDMA_DEVICES"),
        };
        let config = dir.path().join("missing.toml");
        let out = command.env("VRDMA_CONFIG", config).output();
        let out = out.expect("run ibv_devinfo");
        let text = Run::text(&out);
        assert!(!out.status.success(), "{text}");
        text
    };
    // Nothing configured (a config file that is named but missing).
    let text = fails(None);
    assert!(
        text.contains("libibverbs (vrdma): invalid vrdma configuration in"),
        "{text}"
    );
    assert!(text.contains("No IB devices found"), "{text}");
    // A device whose vdev is not there.
    let text = fails(Some(&dir.path().join("gone.sock")));
    assert!(
        text.contains("libibverbs (vrdma): cannot open device vrdma0 (vdev socket")
            && text.contains("gone.sock"),
        "{text}"
    );
}

fn rc_pingpong(args: &[&str]) {
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    // A fresh fabric per pair: each program is a new vhost-user frontend.
    let fabric = Fabric::start();
    // RoCE: the GRH names the peer by GID index 0.
    let args = [&["-g", "0"], args].concat();
    let run = run_pair(&shim, &fabric, "ibv_rc_pingpong", &args);
    for (side, text) in [("server", run.server_text()), ("client", run.client_text())] {
        assert!(
            text.contains("local address:  LID 0x0000,") && text.contains("GID ::ffff:127.100."),
            "{side}:\n{text}"
        );
        assert!(
            text.contains("remote address: LID 0x0000,"),
            "{side}:\n{text}"
        );
        assert!(
            text.contains(" bytes in ") && text.contains(" iters in "),
            "{side}:\n{text}"
        );
    }
}

#[test]
fn ibv_rc_pingpong_polling() {
    rc_pingpong(&["-n", "500"]);
}

#[test]
fn ibv_rc_pingpong_with_completion_events() {
    rc_pingpong(&["-n", "500", "-e"]);
}

#[test]
fn ibv_rc_pingpong_validates_buffer_contents() {
    rc_pingpong(&["-n", "500", "-c"]);
}

/// 64-byte messages fit the QP's inline data (rc_pingpong asks
/// `ibv_query_qp` for it), so they go as IBV_SEND_INLINE; `-c` checks them.
#[test]
fn ibv_rc_pingpong_inline_sends_arrive_intact() {
    rc_pingpong(&["-n", "500", "-s", "64", "-c"]);
}

/// One perftest program at a small and a large message size, with GID
/// index 0 (`-x 0`).
fn perftest(program: &str, iters: &str) {
    perftest_with(program, iters, &["-x", "0"]);
}

/// The same with `gid_args` choosing the GID (none: perftest's own
/// choice on a RoCE port).
fn perftest_with(program: &str, iters: &str, gid_args: &[&str]) {
    perftest_sizes(program, iters, &["64", "65536"], gid_args);
}

/// `program` at each of `sizes` with `-n iters` and `args`.
fn perftest_sizes(program: &str, iters: &str, sizes: &[&str], args: &[&str]) {
    need::program(program, "perftest");
    let _serial = serial();
    let shim = IbverbsShim::new();
    for &size in sizes {
        let fabric = Fabric::start();
        let args = [&["-s", size, "-n", iters, "-F"], args].concat();
        let run = run_pair(&shim, &fabric, program, &args);
        // Both sides connected; the client reports the results (the
        // passive side of a READ test prints none).
        let server = run.server_text();
        assert!(
            server.contains(" local address: LID ")
                && server.contains("GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:100:"),
            "{program} server:\n{server}"
        );
        let client = run.client_text();
        assert!(
            client.contains("#bytes"),
            "{program} client (size {size}):\n{client}"
        );
        let row = client
            .lines()
            .find(|l| l.split_whitespace().next() == Some(size))
            .unwrap_or_else(|| panic!("{program}: no result row for {size}:\n{client}"));
        assert!(row.split_whitespace().count() >= 4, "{program}: {row}");
        eprintln!(
            "{program} -s {size}: {}",
            run.client_text()
                .lines()
                .find(|l| l.split_whitespace().next() == Some(size))
                .unwrap_or_default()
                .trim()
        );
    }
}

/// Without `-x`: perftest picks the GID itself on a RoCE port.
#[test]
fn perftest_ib_write_bw() {
    perftest_with("ib_write_bw", "2000", &[]);
}

#[test]
fn perftest_ib_read_bw() {
    perftest("ib_read_bw", "2000");
}

#[test]
fn perftest_ib_send_bw() {
    perftest("ib_send_bw", "2000");
}

#[test]
fn perftest_ib_write_lat() {
    perftest("ib_write_lat", "1000");
}

#[test]
fn perftest_ib_read_lat() {
    perftest("ib_read_lat", "1000");
}

#[test]
fn perftest_ib_send_lat() {
    perftest("ib_send_lat", "1000");
}

/// perftest's `-e`: both sides sleep on completion channels (perftest
/// allows it for SEND and READ tests).
#[test]
fn perftest_with_completion_events() {
    let _serial = serial();
    let shim = IbverbsShim::new();
    for program in ["ib_send_bw", "ib_send_lat", "ib_read_lat"] {
        need::program(program, "perftest");
        let fabric = Fabric::start();
        let run = run_pair(
            &shim,
            &fabric,
            program,
            &["-e", "-s", "64", "-n", "500", "-F", "-x", "0"],
        );
        let client = run.client_text();
        assert!(
            client
                .lines()
                .any(|l| l.split_whitespace().next() == Some("64")),
            "{program} -e: no result row:\n{client}"
        );
    }
}

/// A C program built against Debian's <infiniband/verbs.h> and libibverbs,
/// run on the shim: what vrdma refuses fails with EOPNOTSUPP/ENOSYS.
const REFUSALS_C: &str = r#"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <infiniband/verbs.h>

static int refused(const char *what, const void *obj, int err)
{
	printf("%s: %s, errno %d (%s)\n", what, obj ? "an object" : "NULL", err, strerror(err));
	return !obj && (err == EOPNOTSUPP || err == ENOSYS);
}

int main(void)
{
	int n = -1, ok = 1;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n != 1) { printf("device list: %d\n", n); return 2; }
	struct ibv_context *ctx = ibv_open_device(list[0]);
	if (!ctx) { perror("ibv_open_device"); return 3; }
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	if (!pd || !cq) { perror("pd/cq"); return 4; }

	errno = 0;
	struct ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
	ok &= refused("ibv_alloc_mw", mw, errno);

	struct ibv_xrcd_init_attr xattr = {
		.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS,
		.fd = -1, .oflags = O_CREAT,
	};
	errno = 0;
	struct ibv_xrcd *xrcd = ibv_open_xrcd(ctx, &xattr);
	ok &= refused("ibv_open_xrcd", xrcd, errno);

	struct ibv_srq_init_attr_ex sattr = {
		.attr = { .max_wr = 16, .max_sge = 1 },
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD,
		.srq_type = IBV_SRQT_XRC, .pd = pd,
	};
	errno = 0;
	struct ibv_srq *srq = ibv_create_srq_ex(ctx, &sattr);
	ok &= refused("ibv_create_srq_ex(XRC)", srq, errno);

	struct ibv_cq_init_attr_ex cattr = { .cqe = 16 };
	errno = 0;
	struct ibv_cq_ex *cq_ex = ibv_create_cq_ex(ctx, &cattr);
	ok &= refused("ibv_create_cq_ex", cq_ex, errno);

	struct ibv_qp_init_attr qattr = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UD,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *ud = ibv_create_qp(pd, &qattr);
	if (!ud) { perror("ibv_create_qp(UD)"); return 5; }
	union ibv_gid gid = { .raw = { 0xff } };
	int ret = ibv_attach_mcast(ud, &gid, 0xc001);
	ok &= refused("ibv_attach_mcast", NULL, ret);
	if (ibv_destroy_qp(ud)) { perror("ibv_destroy_qp(UD)"); return 5; }

	qattr.qp_type = IBV_QPT_RC;
	struct ibv_qp *rc = ibv_create_qp(pd, &qattr);
	if (!rc) { perror("ibv_create_qp(RC)"); return 5; }
	struct ibv_ece ece;
	ret = ibv_query_ece(rc, &ece);
	ok &= refused("ibv_query_ece", NULL, ret);

	if (ibv_destroy_qp(rc) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx)) {
		perror("cleanup");
		return 6;
	}
	ibv_free_device_list(list);
	printf(ok ? "all refused\n" : "SOMETHING WAS NOT REFUSED\n");
	return ok ? 0 : 1;
}
"#;

#[test]
fn refused_verbs_return_errors_not_crashes() {
    need::program("cc", "gcc");
    need::file(
        Path::new("/usr/include/infiniband/verbs.h"),
        "libibverbs-dev",
    );
    let shim = IbverbsShim::new();
    let dir = TempDir::new("ibverbs-refusals");
    let src = dir.path().join("refusals.c");
    std::fs::File::create(&src)
        .and_then(|mut f| f.write_all(REFUSALS_C.as_bytes()))
        .expect("write the C program");
    let exe = dir.path().join("refusals");
    // Linked against Debian's libibverbs, so the binary imports versioned
    // symbols exactly as packaged programs do.
    let cc = Command::new("cc")
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .args(["-Wl,-z,now", "-libverbs"])
        .output()
        .expect("run cc");
    assert!(cc.status.success(), "cc: {}", Run::text(&cc));
    // Control verbs only: a vdev without hostd serves them.
    let vdev = Vdev::start("refusals", &[]);
    let child = shim
        .command(exe.to_str().expect("UTF-8 path"), &vdev.socket)
        .spawn()
        .expect("run the program");
    let (out, late) = wait_output(child, Duration::from_secs(30));
    let text = Run::text(&out);
    assert!(
        out.status.success() && !late && text.contains("all refused"),
        "{:?}\n{text}\n--- vdev log:\n{}",
        out.status,
        vdev.log()
    );
}

/// `ibv_srq_pingpong`: 16 QPs on each side take their receives from one
/// shared receive queue (`ibv_post_srq_recv`, QPs created with `srq`),
/// 10000 exchanges spread over the QPs, each received buffer checked
/// (`-c`).
#[test]
fn ibv_srq_pingpong_shares_one_receive_queue_among_16_qps() {
    need::program("ibv_srq_pingpong", "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let fabric = Fabric::start();
    let run = run_pair(
        &shim,
        &fabric,
        "ibv_srq_pingpong",
        &["-g", "0", "-n", "10000", "-c"],
    );
    for (side, text) in [("server", run.server_text()), ("client", run.client_text())] {
        // One "remote address" line per QP: 16 connected QPs.
        let remotes = text.matches("remote address:").count();
        assert_eq!(remotes, 16, "{side}:\n{text}");
        // 10000 exchanges of 4096 bytes each way.
        assert!(
            text.contains("81920000 bytes in ") && text.contains("\n10000 iters in "),
            "{side}:\n{text}"
        );
    }
}

/// Runs `program` (a pingpong of ibverbs-utils) with GID index 0 and
/// `args` between the two tenants; both sides report the exchanges.
fn pingpong(program: &str, args: &[&str], iters: &str) -> Run {
    need::program(program, "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let fabric = Fabric::start();
    let args = [&["-g", "0", "-n", iters], args].concat();
    let run = run_pair(&shim, &fabric, program, &args);
    for (side, text) in [("server", run.server_text()), ("client", run.client_text())] {
        assert!(
            text.contains(&format!("\n{iters} iters in ")),
            "{side}:\n{text}"
        );
    }
    run
}

/// `ibv_ud_pingpong`: UD QPs, address handles from the exchanged GIDs,
/// 10000 exchanges of 2048 bytes (as it counts them), each received buffer checked
/// past its 40-byte GRH (`-c`).
#[test]
fn ibv_ud_pingpong_exchanges_datagrams_with_address_handles() {
    let run = pingpong("ibv_ud_pingpong", &["-c"], "10000");
    for text in [run.server_text(), run.client_text()] {
        assert!(text.contains("20480000 bytes in "), "{text}");
    }
}

/// `ibv_uc_pingpong`: UC QPs (no acknowledgements), 10000 exchanges of
/// 4096 bytes, each received buffer checked (`-c`).
#[test]
fn ibv_uc_pingpong_runs_unreliable_connected_qps() {
    let run = pingpong("ibv_uc_pingpong", &["-c"], "10000");
    for text in [run.server_text(), run.client_text()] {
        assert!(text.contains("81920000 bytes in "), "{text}");
    }
}

/// perftest over UD (`-c UD`): address handles, datagrams up to the
/// port's MTU (4096 bytes), each with its GRH in the receive buffer.
/// `-r 1024`: ib_send_bw's UD default of 8192 receives asks for a CQ
/// deeper than the default tenant limit (`max_cq_depth` 4096).
#[test]
fn perftest_ib_send_bw_over_ud() {
    let args = ["-x", "0", "-c", "UD", "-r", "1024"];
    perftest_sizes("ib_send_bw", "5000", &["64", "4096"], &args);
}

#[test]
fn perftest_ib_send_lat_over_ud() {
    perftest_sizes(
        "ib_send_lat",
        "2000",
        &["64", "4096"],
        &["-x", "0", "-c", "UD"],
    );
}

/// perftest over UC (`-c UC`): RDMA WRITEs without acknowledgements.
#[test]
fn perftest_ib_write_bw_over_uc() {
    perftest_sizes(
        "ib_write_bw",
        "5000",
        &["64", "65536"],
        &["-x", "0", "-c", "UC"],
    );
}
