//! UCX and Open MPI over UCX on vrdma, unmodified (issue 14): Debian 12's
//! `ucx_info`, `ucx_perftest` (`ucx-utils`, UCX 1.13) and `mpirun` (Open
//! MPI 4.1, `openmpi-bin`) run on the drop-in `libibverbs.so.1` between
//! two process-mode tenants of one hostd: servers and the first half of
//! the ranks on tenant alpha's device, clients and the other half on
//! beta's.
//!
//! UCX is restricted to vrdma's transports (`UCX_TLS`: `rc_verbs` — with
//! `ud_verbs` as its auxiliary transport, for the wire-up UCX insists on —
//! or `ud_verbs`; `UCX_NET_DEVICES=vrdma0:1`), and every test shows that
//! the traffic went over vrdma twice: UCX's log of the transports each
//! endpoint chose (`ep_cfg[..]: tag(rc_verbs/vrdma0:1)`), and hostd's
//! counters of the tenants' work (`vrdmactl stats`).
//!
//! UCX lists the device only when its node `/dev/infiniband/vrdma-uverbs0`
//! exists ([`vrdma_tests::ucx`]); the tests install it as an operator does,
//! and leave it.

use std::path::Path;
use std::time::Duration;

use vrdma_tests::c_program::build_mpi_program;
use vrdma_tests::daemon::{IbverbsShim, TempDir};
use vrdma_tests::need;
use vrdma_tests::two_tenants::{finish, run_one, run_pair_with, serial, Fabric};
use vrdma_tests::ucx::{assert_chose_only, device_name, install_device_node, ucx_env};

/// A choice of UCX transports: what `UCX_TLS` says, the transport UCX
/// must then choose for every endpoint, and for each ucx_perftest test the
/// kind of hostd work it must show and the tenants that do it.
struct Transports {
    tls: &'static str,
    chosen: &'static str,
    perftests: [(&'static str, &'static str, &'static [&'static str]); 4],
}

/// `rc_verbs`: UCX's wire-up needs a transport that connects to an
/// interface, and an RC QP connects only to an endpoint, so UCX refuses
/// `UCX_TLS=rc_verbs` alone ("no auxiliary transport"); `ud_verbs:aux`
/// (what UCX's own alias `rc_v` means) carries only the wire-up.
/// Over RC, puts are RDMA WRITEs and gets RDMA READs of beta's QP into
/// alpha's memory; tagged messages of 4 KiB go as sends both ways.
const RC: Transports = Transports {
    tls: "rc_verbs,ud_verbs:aux",
    chosen: "rc_verbs",
    perftests: [
        ("ucp_put_bw", "write", &["beta"]),
        ("ucp_get", "read", &["beta"]),
        ("tag_lat", "send", &["alpha", "beta"]),
        ("tag_bw", "send", &["beta"]),
    ],
};
/// Over UD, UCX emulates puts and gets with datagrams (its own
/// reliability protocol on top), so everything is SEND work in hostd, and
/// the gets' data comes back from alpha.
const UD: Transports = Transports {
    tls: "ud_verbs",
    chosen: "ud_verbs",
    perftests: [
        ("ucp_put_bw", "send", &["beta"]),
        ("ucp_get", "send", &["alpha"]),
        ("tag_lat", "send", &["alpha", "beta"]),
        ("tag_bw", "send", &["beta"]),
    ],
};

/// ucx_perftest's message size and iterations.
const SIZE: u64 = 4096;
const ITERS: u64 = 1000;

/// A tenant's bytes of work of `kind` (send, write, read, recv) in hostd.
fn bytes(fabric: &Fabric, tenant: &str, kind: &str) -> u64 {
    fabric.hostd.tenant_stats(tenant)["bytes"][kind]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn ucx_info_lists_the_vrdma_device_with_rc_verbs_and_ud_verbs() {
    let program = need::program("ucx_info", "ucx-utils");
    let _serial = serial();
    install_device_node(0);
    let shim = IbverbsShim::new();
    let fabric = Fabric::start();
    let program = program.to_str().expect("UTF-8 path");
    let text = run_one(
        &shim,
        program,
        &fabric.alpha.socket,
        &["-d"],
        Duration::from_secs(60),
    );
    // The memory domain of the device, its IB component, and both verbs
    // transports on its port 1 (the text between the domain's header and
    // the next one).
    let dev = device_name(0);
    let (_, domain) = text
        .split_once(&format!("# Memory domain: {dev}\n"))
        .unwrap_or_else(|| panic!("no memory domain {dev}:\n{text}"));
    let domain = domain.split("# Memory domain:").next().unwrap_or_default();
    assert!(domain.contains("#     Component: ib\n"), "{domain}");
    for tl in ["rc_verbs", "ud_verbs"] {
        let (_, transport) = domain
            .split_once(&format!("#      Transport: {tl}\n"))
            .unwrap_or_else(|| panic!("no transport {tl} on {dev}:\n{domain}"));
        assert!(
            transport.starts_with(&format!("#         Device: {dev}:1\n")),
            "{tl}:\n{transport}"
        );
    }
    // RC carries RDMA: puts and gets without copies, and 64-bit atomics.
    let (_, rc) = domain.split_once("Transport: rc_verbs").unwrap_or_default();
    for capability in ["put_zcopy:", "get_zcopy:", "atomic_fadd: 64 bit"] {
        assert!(
            rc.contains(capability),
            "rc_verbs has no {capability}:\n{rc}"
        );
    }
}

/// Runs ucx_perftest `test` (server on alpha, client on beta) over
/// transports `tls`; checks UCX's choice of transports, its result row,
/// and that hostd counted at least the messages' bytes of `kind` for the
/// tenants in `movers`. Returns the client's result row.
fn perftest(fabric: &Fabric, tls: &Transports, test: &str, kind: &str, movers: &[&str]) -> String {
    let shim = IbverbsShim::new();
    let before: Vec<u64> = movers.iter().map(|t| bytes(fabric, t, kind)).collect();
    let size = SIZE.to_string();
    let iters = ITERS.to_string();
    let args = ["-t", test, "-s", &size, "-n", &iters];
    let run = run_pair_with(&shim, fabric, "ucx_perftest", &args, |c| {
        ucx_env(c, tls.tls);
    });
    let client = run.client_text();
    assert_chose_only(&client, 1, tls.chosen);
    assert_chose_only(&run.server_text(), 1, tls.chosen);
    let tls = tls.tls;
    let row = client
        .lines()
        .find(|l| l.starts_with("Final:"))
        .unwrap_or_else(|| panic!("{test} over {tls}: no result:\n{client}"))
        .to_owned();
    let fields: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(fields.get(1), Some(&iters.as_str()), "{row}");
    for (tenant, before) in movers.iter().zip(before) {
        let moved = bytes(fabric, tenant, kind) - before;
        assert!(
            moved >= ITERS * SIZE,
            "{test} over {tls}: hostd counted {moved} bytes of {kind} for {tenant}, \
             not at least {}\n{}",
            ITERS * SIZE,
            fabric.logs()
        );
    }
    eprintln!("ucx_perftest -t {test} -s {SIZE} -n {ITERS}, UCX_TLS={tls}: {row}");
    row
}

/// ucx_perftest's put bandwidth, get, tag-matching latency and bandwidth
/// over `tls` on one fabric, each showing its work in hostd.
fn perftests(tls: &Transports) {
    need::program("ucx_perftest", "ucx-utils");
    let _serial = serial();
    install_device_node(0);
    let fabric = Fabric::start();
    for (test, kind, movers) in tls.perftests {
        perftest(&fabric, tls, test, kind, movers);
    }
}

#[test]
fn ucx_perftest_over_rc_verbs_between_two_tenants() {
    perftests(&RC);
}

#[test]
fn ucx_perftest_over_ud_verbs_between_two_tenants() {
    perftests(&UD);
}

/// `mpirun` of `tests/c/mpi_pingpong.c` with `ranks` ranks, half on
/// alpha's device and half on beta's (one app context per device, each
/// with its `VRDMA_DEVICES`; the ranks of one device are contexts of it),
/// Open MPI's PML and one-sided component forced to UCX and its other
/// transports (shared memory, TCP) excluded, UCX on `rc_verbs` only.
fn mpi_pingpong(ranks: usize) {
    need::program("mpirun", "openmpi-bin");
    let _serial = serial();
    install_device_node(0);
    let dir = TempDir::new("ucx-mpi");
    let exe = build_mpi_program(&dir, "mpi_pingpong", include_str!("../c/mpi_pingpong.c"));
    let exe = exe.to_str().expect("UTF-8 path");
    let shim = IbverbsShim::new();
    let fabric = Fabric::start();
    let traffic = |t: &str| {
        ["send", "write", "read"]
            .map(|k| bytes(&fabric, t, k))
            .iter()
            .sum::<u64>()
    };
    let before = traffic("alpha") + traffic("beta");
    let per_device = (ranks / 2).to_string();
    let device = |path: &Path| format!("VRDMA_DEVICES={}", path.display());
    let mut mpirun = shim.command("mpirun", &fabric.alpha.socket);
    ucx_env(&mut mpirun, RC.tls);
    mpirun
        .args(["--allow-run-as-root", "--oversubscribe"])
        .args([
            "-x",
            "LD_LIBRARY_PATH",
            "-x",
            "UCX_TLS",
            "-x",
            "UCX_NET_DEVICES",
        ])
        .args(["-x", "UCX_LOG_LEVEL"])
        .args([
            "--mca",
            "pml",
            "ucx",
            "--mca",
            "btl",
            "^vader,tcp,openib,uct",
        ])
        .args(["--mca", "osc", "ucx"])
        .args([
            "-np",
            &per_device,
            "-x",
            &device(&fabric.alpha.socket),
            exe,
            ":",
        ])
        .args(["-np", &per_device, "-x", &device(&fabric.beta.socket), exe]);
    let child = mpirun.spawn().expect("spawn mpirun");
    let what = format!("mpirun with {ranks} ranks");
    let text = finish(child, &what, Duration::from_secs(120), || fabric.logs());
    // Every rank checked its partner's messages and the reductions.
    for rank in 0..ranks {
        let partner = (rank + ranks / 2) % ranks;
        let ok = format!("rank {rank} of {ranks} partner {partner} OK");
        assert!(text.contains(&ok), "no {ok:?}:\n{text}");
    }
    // Each rank's UCX chose rc_verbs on vrdma for its endpoints, nothing
    // else (no shared memory, no TCP).
    assert_chose_only(&text, ranks, RC.chosen);
    // And hostd moved it: each rank sent its partner 20 messages of 1 MiB
    // (the largest size) across the two tenants, as RDMA or sends.
    let moved = traffic("alpha") + traffic("beta") - before;
    let least = ranks as u64 * 20 * (1 << 20);
    assert!(
        moved >= least,
        "hostd moved {moved} bytes for the two tenants, not at least {least}\n{}",
        fabric.logs()
    );
    eprintln!("mpirun, {ranks} ranks: hostd moved {moved} bytes between alpha and beta");
}

#[test]
fn open_mpi_over_ucx_with_two_ranks_on_two_tenants() {
    mpi_pingpong(2);
}

/// Two ranks per tenant device: each device serves two processes at once
/// (two contexts), and the allreduce crosses both tenants.
#[test]
fn open_mpi_over_ucx_with_four_ranks_two_per_tenant_device() {
    mpi_pingpong(4);
}
