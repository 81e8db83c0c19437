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

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use vrdma_tests::c_program::build_c_program;
use vrdma_tests::daemon::{wait_output, IbverbsShim, TempDir, Vdev};
use vrdma_tests::need;
use vrdma_tests::two_tenants::{run_one, run_pair, serial, Fabric, Run};

#[test]
fn ibv_devinfo_lists_the_vrdma_device_with_an_active_port() {
    need::program("ibv_devinfo", "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let fabric = Fabric::start();
    let text = run_one(
        &shim,
        "ibv_devinfo",
        &fabric.alpha.socket,
        &["-v"],
        Duration::from_secs(30),
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

/// `-N`: the new send API, rc_pingpong's sends posted with `ibv_wr_*` on a
/// QP from `ibv_create_qp_ex`, with the receive buffer checked (`-c`).
#[test]
fn ibv_rc_pingpong_new_send_api() {
    rc_pingpong(&["-n", "500", "-N", "-c"]);
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

	struct ibv_cq_init_attr_ex cattr = { .cqe = 16, .wc_flags = IBV_WC_EX_WITH_FLOW_TAG };
	errno = 0;
	struct ibv_cq_ex *cq_ex = ibv_create_cq_ex(ctx, &cattr);
	ok &= refused("ibv_create_cq_ex(FLOW_TAG)", cq_ex, errno);

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
    let shim = IbverbsShim::new();
    let dir = TempDir::new("ibverbs-refusals");
    let exe = build_c_program(&dir, "refusals", REFUSALS_C);
    // Control verbs only: a vdev without hostd serves them.
    let vdev = Vdev::start("refusals", &[]);
    run_c_program(&shim, &exe, &vdev.socket, "all refused", || {
        format!("--- vdev log:\n{}", vdev.log())
    });
}

/// Runs the C program `exe` on the shim with `devices` as its
/// `VRDMA_DEVICES`; it must exit 0 within 60 s, printing `ok_line`.
/// `logs` gives the daemons' logs for a failure's message.
fn run_c_program(
    shim: &IbverbsShim,
    exe: &Path,
    devices: &Path,
    ok_line: &str,
    logs: impl FnOnce() -> String,
) {
    let child = shim
        .command(exe.to_str().expect("UTF-8 path"), devices)
        .spawn()
        .expect("run the program");
    let (out, late) = wait_output(child, Duration::from_secs(60));
    let text = Run::text(&out);
    assert!(
        out.status.success() && !late && text.contains(ok_line),
        "{:?}{}\n{text}\n{}",
        out.status,
        if late { " (killed: too slow)" } else { "" },
        logs()
    );
}

/// The extended verbs between two tenants, in one process that opens both
/// devices (`tests/c/extended_verbs.c`): a QP and CQ made with
/// `ibv_create_qp_ex`/`ibv_create_cq_ex`, WRITE, WRITE_WITH_IMM, SEND (two
/// SGEs), SEND_WITH_IMM (inline list), READ and both atomics posted with
/// `ibv_wr_*` to an MR registered at an iova (`ibv_reg_mr_iova2`), polled
/// with `ibv_start_poll`/`ibv_next_poll` and the `ibv_wc_read_*`
/// accessors, bytes and values checked on both sides; an aborted batch
/// and a batch with a refused opcode post nothing; `ibv_query_device_ex`,
/// `ibv_query_gid_table`/`_ex`, and the refusals' errnos.
#[test]
fn extended_verbs_between_two_tenants() {
    let _serial = serial();
    let shim = IbverbsShim::new();
    let dir = TempDir::new("ibverbs-extended");
    let exe = build_c_program(
        &dir,
        "extended_verbs",
        include_str!("../c/extended_verbs.c"),
    );
    let fabric = Fabric::start();
    // Device "a" is tenant alpha's, "b" beta's.
    let devices = format!(
        "a={},b={}",
        fabric.alpha.socket.display(),
        fabric.beta.socket.display()
    );
    run_c_program(
        &shim,
        &exe,
        Path::new(&devices),
        "extended verbs OK",
        || fabric.logs(),
    );
}

/// Heap memory registered as programs register it (`tests/c/heap_memory.c`,
/// alpha and beta in one process): another thread freeing, allocating and
/// incrementing beside buffers registered and deregistered 200 times loses
/// no write (malloc would abort on a corrupted list); after `fork()` the
/// child's writes to a registered malloc'd buffer stay the child's, the
/// parent's registration still takes beta's RDMA WRITE, and after
/// `ibv_dereg_mr` a child's writes stay its own as well; one malloc'd
/// buffer registered on both devices takes WRITEs through either MR, also
/// after the other is gone.
#[test]
fn heap_memory_survives_other_threads_and_fork() {
    let _serial = serial();
    let shim = IbverbsShim::new();
    let dir = TempDir::new("ibverbs-heap");
    let exe = build_c_program(&dir, "heap_memory", include_str!("../c/heap_memory.c"));
    let fabric = Fabric::start();
    let devices = format!(
        "a={},b={}",
        fabric.alpha.socket.display(),
        fabric.beta.socket.display()
    );
    run_c_program(&shim, &exe, Path::new(&devices), "heap memory OK", || {
        fabric.logs()
    });
}

/// `name@VERSION` (default versions `name@@VERSION`) of every symbol a
/// shared library defines, and its version definitions.
fn exports_of(
    lib: &Path,
) -> (
    std::collections::BTreeSet<String>,
    std::collections::BTreeSet<String>,
) {
    need::program("readelf", "binutils");
    let run = |args: &[&str]| {
        let out = Command::new("readelf")
            .args(args)
            .arg(lib)
            .output()
            .expect("run readelf");
        assert!(
            out.status.success(),
            "readelf {args:?} {}: {}",
            lib.display(),
            Run::text(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let symbols = run(&["--dyn-syms", "-W"])
        .lines()
        .filter_map(|line| {
            // Num: Value Size Type Bind Vis Ndx Name
            let f: Vec<&str> = line.split_whitespace().collect();
            let (kind, ndx, name) = (*f.get(3)?, *f.get(6)?, *f.get(7)?);
            // Defined functions and variables; GNU ld also emits an
            // absolute symbol per version node (`IBVERBS_1.0`), which is
            // no export (LLD does not): the nodes are compared below.
            let defined = ndx != "UND" && ndx != "ABS" && ndx != "Ndx";
            (defined && matches!(kind, "FUNC" | "OBJECT")).then(|| name.to_owned())
        })
        .collect();
    // Each definition's index, flags and name ("Rev: 1  Flags: none
    // Index: 3  Cnt: 2  Name: IBVERBS_1.1"). Not its "Parent" lines: GNU
    // ld records the node a node inherits from (`} IBVERBS_1.0;`), LLD
    // does not, and the dynamic loader uses only the names.
    let versions = run(&["-V", "-W"])
        .lines()
        .skip_while(|l| !l.contains(".gnu.version_d"))
        .take_while(|l| !l.contains(".gnu.version_r"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let at = |key: &str| f.iter().position(|w| *w == key).and_then(|i| f.get(i + 1));
            Some(format!(
                "{} {} {}",
                at("Index:")?,
                at("Flags:")?,
                at("Name:")?
            ))
        })
        .collect();
    (symbols, versions)
}

/// The drop-in library exports exactly what Debian's libibverbs.so.1 and
/// librdmacm.so.1 export (it is both: `librdmacm.so.1` is a second name
/// of the file): every function and variable under the same version node,
/// the old `IBVERBS_1.0` versions beside the current ones, the same version
/// definitions, and nothing more (no extras are allowed: a program built
/// against vrdma's library must also run on rdma-core's).
#[test]
fn exports_match_debians_libibverbs_and_librdmacm() {
    use std::collections::BTreeSet;
    let debian = Path::new("/usr/lib/x86_64-linux-gnu/libibverbs.so.1");
    need::file(debian, "libibverbs1");
    let debian_cm = Path::new("/usr/lib/x86_64-linux-gnu/librdmacm.so.1");
    need::file(debian_cm, "librdmacm1");
    let shim = IbverbsShim::new();
    let ours = shim.path().join("libibverbs.so.1");
    let (mut theirs_syms, theirs_versions) = exports_of(debian);
    let (cm_syms, cm_versions) = exports_of(debian_cm);
    let (ours_syms, ours_versions) = exports_of(&ours);
    assert!(theirs_syms.len() > 150, "Debian's exports: {theirs_syms:?}");
    assert_eq!(cm_syms.len(), 68, "Debian's librdmacm exports: {cm_syms:?}");
    theirs_syms.extend(cm_syms);
    let missing: Vec<_> = theirs_syms.difference(&ours_syms).collect();
    let extra: Vec<_> = ours_syms.difference(&theirs_syms).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing from vrdma's library: {missing:?}\nexported only by vrdma's: {extra:?}"
    );
    assert!(ours_syms.contains("ibv_alloc_pd@IBVERBS_1.0"));
    assert!(ours_syms.contains("ibv_alloc_pd@@IBVERBS_1.1"));
    assert!(ours_syms.contains("ibv_query_qp_data_in_order@@IBVERBS_1.14"));
    assert!(ours_syms.contains("rdma_establish@@RDMACM_1.2"));
    // libibverbs' definitions keep their indices (librdmacm's follow).
    let (ours_cm, ours_ibv): (BTreeSet<String>, BTreeSet<String>) = ours_versions
        .into_iter()
        .partition(|v| v.contains("RDMACM_"));
    assert_eq!(ours_ibv, theirs_versions, "libibverbs' version definitions");
    let names = |v: &BTreeSet<String>| -> BTreeSet<String> {
        v.iter()
            .filter(|d| d.contains("RDMACM_"))
            .filter_map(|d| d.split_whitespace().last().map(str::to_owned))
            .collect()
    };
    assert_eq!(
        names(&ours_cm),
        names(&cm_versions),
        "librdmacm's version definitions"
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
/// port's MTU (4096 bytes), each with its GRH in the receive buffer; its
/// defaults (8192 receives, a CQ deeper than that) within the default
/// limits.
#[test]
fn perftest_ib_send_bw_over_ud() {
    let args = ["-x", "0", "-c", "UD"];
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

/// A C program on two vrdma devices of one process (alpha's and beta's):
/// an SRQ of beta whose armed limit reaches `ibv_get_async_event` as
/// IBV_EVENT_SRQ_LIMIT_REACHED naming the SRQ, and its QP's move to ERR as
/// IBV_EVENT_QP_LAST_WQE_REACHED naming the QP; `ibv_post_recv` on that QP
/// refused; a UD datagram whose completion and GRH make the address
/// handle back to its sender (`ibv_create_ah_from_wc`); and a CQ of alpha
/// overrun by sends nobody polls, which reaches `ibv_get_async_event` as
/// IBV_EVENT_CQ_ERR naming the CQ.
const TWO_DEVICES_C: &str = r#"
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <infiniband/verbs.h>

#define CHECK(c, what) do { if (!(c)) { printf("FAILED: %s (errno %d)\n", what, errno); return 1; } } while (0)

static struct ibv_wc wait_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	while (ibv_poll_cq(cq, 1, &wc) == 0)
		;
	return wc;
}

static int rc_up(struct ibv_qp *qp, union ibv_gid *dgid, uint32_t dqpn)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		return -1;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR; a.path_mtu = IBV_MTU_1024; a.dest_qp_num = dqpn;
	a.max_dest_rd_atomic = 1; a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1; a.ah_attr.grh.dgid = *dgid; a.ah_attr.grh.hop_limit = 1; a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		return -1;
	a.qp_state = IBV_QPS_RTS; a.timeout = 14; a.retry_cnt = 7; a.rnr_retry = 7; a.max_rd_atomic = 1;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

static int ud_up(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x11111111 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
		return -1;
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		return -1;
	a.qp_state = IBV_QPS_RTS;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
}

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 2, "two devices");
	struct ibv_context *a = ibv_open_device(list[0]), *b = ibv_open_device(list[1]);
	CHECK(a && b, "open");
	union ibv_gid ga, gb;
	CHECK(!ibv_query_gid(a, 1, 0, &ga) && !ibv_query_gid(b, 1, 0, &gb), "gids");
	struct ibv_pd *pa = ibv_alloc_pd(a), *pb = ibv_alloc_pd(b);
	struct ibv_cq *ca = ibv_create_cq(a, 64, NULL, NULL, 0), *cb = ibv_create_cq(b, 64, NULL, NULL, 0);
	static char bufa[4096] __attribute__((aligned(4096))), bufb[4096] __attribute__((aligned(4096)));
	struct ibv_mr *ma = ibv_reg_mr(pa, bufa, sizeof bufa, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *mb = ibv_reg_mr(pb, bufb, sizeof bufb, IBV_ACCESS_LOCAL_WRITE);
	CHECK(pa && pb && ca && cb && ma && mb, "pd, cq, mr");

	/* SRQ */
	struct ibv_srq_init_attr sattr = { .attr = { .max_wr = 16, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pb, &sattr);
	CHECK(srq && sattr.attr.max_wr >= 16, "ibv_create_srq");
	struct ibv_srq_attr lim = { .srq_limit = 4 };
	CHECK(!ibv_modify_srq(srq, &lim, IBV_SRQ_LIMIT), "arm the limit");
	struct ibv_qp_init_attr qi = { .send_cq = cb, .recv_cq = cb, .srq = srq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 8, .max_send_sge = 1 } };
	struct ibv_qp *qb = ibv_create_qp(pb, &qi);
	CHECK(qb, "QP on the SRQ");
	struct ibv_qp_attr qattr; struct ibv_qp_init_attr qinit;
	CHECK(!ibv_query_qp(qb, &qattr, 0, &qinit) && qinit.srq == srq, "query_qp names the SRQ");
	qi.send_cq = ca; qi.recv_cq = ca; qi.srq = NULL; qi.cap.max_recv_wr = 8; qi.cap.max_recv_sge = 1;
	struct ibv_qp *qa = ibv_create_qp(pa, &qi);
	CHECK(qa && !rc_up(qa, &gb, qb->qp_num) && !rc_up(qb, &ga, qa->qp_num), "connect");
	struct ibv_sge rs = { .addr = (uintptr_t)bufb, .length = 64, .lkey = mb->lkey };
	struct ibv_recv_wr rw = { .wr_id = 1, .sg_list = &rs, .num_sge = 1 }, *bad_r;
	CHECK(ibv_post_recv(qb, &rw, &bad_r) == EINVAL && bad_r == &rw, "post_recv on an SRQ QP is EINVAL");
	for (int i = 0; i < 6; i++)
		CHECK(!ibv_post_srq_recv(srq, &rw, &bad_r), "post_srq_recv");
	struct ibv_sge ss = { .addr = (uintptr_t)bufa, .length = 8, .lkey = ma->lkey };
	struct ibv_send_wr sw = { .wr_id = 2, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
		.send_flags = IBV_SEND_SIGNALED }, *bad_s;
	for (int i = 0; i < 3; i++) {
		CHECK(!ibv_post_send(qa, &sw, &bad_s), "send");
		CHECK(wait_wc(ca).status == IBV_WC_SUCCESS, "send completion");
		CHECK(wait_wc(cb).status == IBV_WC_SUCCESS, "receive from the SRQ");
	}
	struct ibv_async_event ev;
	CHECK(!ibv_get_async_event(b, &ev), "ibv_get_async_event");
	printf("async event: %s\n", ibv_event_type_str(ev.event_type));
	CHECK(ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED && ev.element.srq == srq, "SRQ limit event");
	ibv_ack_async_event(&ev);
	CHECK(!ibv_query_srq(srq, &lim) && lim.srq_limit == 0, "disarmed");
	struct ibv_qp_attr to_err = { .qp_state = IBV_QPS_ERR };
	CHECK(!ibv_modify_qp(qb, &to_err, IBV_QP_STATE), "the SRQ's QP to ERR");
	CHECK(!ibv_get_async_event(b, &ev), "ibv_get_async_event");
	printf("async event: %s\n", ibv_event_type_str(ev.event_type));
	CHECK(ev.event_type == IBV_EVENT_QP_LAST_WQE_REACHED && ev.element.qp == qb, "last WQE reached");
	ibv_ack_async_event(&ev);
	CHECK(ibv_destroy_srq(srq) == EBUSY, "an SRQ in use is busy");
	CHECK(!ibv_destroy_qp(qb) && !ibv_destroy_qp(qa) && !ibv_destroy_srq(srq), "destroy");

	/* UD, and an AH back from the completion */
	qi.qp_type = IBV_QPT_UD; qi.send_cq = ca; qi.recv_cq = ca;
	struct ibv_qp *ua = ibv_create_qp(pa, &qi);
	qi.send_cq = cb; qi.recv_cq = cb;
	struct ibv_qp *ub = ibv_create_qp(pb, &qi);
	CHECK(ua && ub && !ud_up(ua) && !ud_up(ub), "UD QPs");
	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1, .grh = { .dgid = gb, .hop_limit = 1 } };
	struct ibv_ah *ah = ibv_create_ah(pa, &aa);
	CHECK(ah, "ibv_create_ah");
	rs.length = 40 + 64;
	CHECK(!ibv_post_recv(ub, &rw, &bad_r), "post a UD receive");
	memcpy(bufa, "datagram", 8);
	sw.wr.ud.ah = ah; sw.wr.ud.remote_qpn = ub->qp_num; sw.wr.ud.remote_qkey = 0x11111111;
	CHECK(!ibv_post_send(ua, &sw, &bad_s), "UD send");
	CHECK(wait_wc(ca).status == IBV_WC_SUCCESS, "UD send completion");
	struct ibv_wc wc = wait_wc(cb);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == 48 && (wc.wc_flags & IBV_WC_GRH)
	      && wc.src_qp == ua->qp_num && !memcmp(bufb + 40, "datagram", 8), "UD receive");
	struct ibv_ah_attr back;
	CHECK(!ibv_init_ah_from_wc(b, 1, &wc, (struct ibv_grh *)bufb, &back), "init_ah_from_wc");
	CHECK(back.is_global && !memcmp(back.grh.dgid.raw, ga.raw, 16), "the AH names the sender");
	struct ibv_ah *reply = ibv_create_ah_from_wc(pb, &wc, (struct ibv_grh *)bufb, 1);
	CHECK(reply, "ibv_create_ah_from_wc");
	union ibv_gid mc = { .raw = { 0xff } };
	CHECK(ibv_attach_mcast(ub, &mc, 0) == EOPNOTSUPP, "no multicast");
	CHECK(!ibv_destroy_ah(reply) && !ibv_destroy_ah(ah) && !ibv_destroy_qp(ua) && !ibv_destroy_qp(ub),
	      "destroy UD");

	/* CQ overrun: more signaled SENDs than alpha's small CQ holds, none polled */
	struct ibv_cq *small = ibv_create_cq(a, 2, NULL, NULL, 0);
	CHECK(small && small->cqe >= 2, "a small CQ");
	int over = small->cqe + 2;
	qi.qp_type = IBV_QPT_RC; qi.send_cq = small; qi.recv_cq = small;
	qi.cap.max_send_wr = over; qi.cap.max_recv_wr = over;
	struct ibv_qp *oa = ibv_create_qp(pa, &qi);
	qi.send_cq = cb; qi.recv_cq = cb;
	struct ibv_qp *ob = ibv_create_qp(pb, &qi);
	CHECK(oa && ob && !rc_up(oa, &gb, ob->qp_num) && !rc_up(ob, &ga, oa->qp_num), "connect");
	rs.length = 64;
	for (int i = 0; i < over; i++)
		CHECK(!ibv_post_recv(ob, &rw, &bad_r), "post a receive");
	for (int i = 0; i < over; i++)
		CHECK(!ibv_post_send(oa, &sw, &bad_s), "post a send");
	for (int i = 0; i < over; i++)
		CHECK(wait_wc(cb).status == IBV_WC_SUCCESS, "receive");
	CHECK(!ibv_get_async_event(a, &ev), "ibv_get_async_event");
	printf("async event: %s\n", ibv_event_type_str(ev.event_type));
	CHECK(ev.event_type == IBV_EVENT_CQ_ERR && ev.element.cq == small, "CQ error event");
	ibv_ack_async_event(&ev);
	CHECK(!ibv_destroy_qp(oa) && !ibv_destroy_qp(ob) && !ibv_destroy_cq(small), "destroy");
	printf("all good\n");
	return 0;
}
"#;

#[test]
fn srq_limit_events_and_ud_address_handles_through_the_c_api() {
    let _serial = serial();
    let shim = IbverbsShim::new();
    let dir = TempDir::new("ibverbs-two-devices");
    let exe = build_c_program(&dir, "two_devices", TWO_DEVICES_C);
    let fabric = Fabric::start();
    let devices = format!(
        "{},{}",
        fabric.alpha.socket.display(),
        fabric.beta.socket.display()
    );
    let child = shim
        .command(exe.to_str().expect("UTF-8 path"), Path::new(&devices))
        .spawn()
        .expect("run the program");
    let (out, late) = wait_output(child, Duration::from_secs(60));
    let text = Run::text(&out);
    assert!(
        out.status.success() && !late && text.contains("all good"),
        "{:?}\n{text}\n{}",
        out.status,
        fabric.logs()
    );
    assert!(text.contains("async event: SRQ limit reached"), "{text}");
    assert!(text.contains("async event: last WQE reached"), "{text}");
    assert!(text.contains("async event: CQ error"), "{text}");
}
