//! Many processes of a QEMU guest on its vrdma devices (issue 14): a device
//! is given to the guest as PCI functions on its vdev's socket, each a
//! context slot (docs/architecture.md, "Contexts"); every `ibv_open_device`
//! in the guest takes a free function of its device. The guest has two
//! devices, of tenants alpha (8 functions) and beta (4), at fixed PCI
//! slots so each process can name its device. In one boot (TCG):
//!
//! - `tests/c/contexts.c` on alpha's device: one process opens it 8 times
//!   and writes between its contexts; 8 processes at once, a ninth refused
//!   (EBUSY: every function is taken), one killed mid-traffic — hostd
//!   frees its QPs, a newcomer takes its function, the other 7 run to
//!   their end with every WRITE checked, and everything is freed when they
//!   are gone;
//! - Debian trixie's UCX (`ucx_info -d` lists vrdma0 with `rc_verbs` and
//!   `ud_verbs`; `ucx_perftest` put, get, tag latency and bandwidth over
//!   `rc_verbs` and over `ud_verbs`, server on alpha's device, client on
//!   beta's) and Open MPI 5 over UCX (`mpirun` with 2 and with 4 ranks of
//!   `tests/c/mpi_pingpong.c`, half on each tenant's device, partners on
//!   different tenants), UCX restricted to vrdma's transports, its log
//!   showing what each process chose, and hostd counting the work.
//!
//! The guest runs trixie's programs and libraries; vrdma's libibverbs.so.1
//! and the test's C programs (built here) are linked against them
//! ([`Initramfs::guest_linked`](vrdma_tests::vm::Initramfs)).
//!
//! Needs root, debootstrap, xz-utils, gcc and libopenmpi-dev
//! (`scripts/test` installs them); fills the cache of `tests/vm/prepare.sh`
//! on its first run.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use vrdma_tests::c_program::{build_c_program, build_mpi_program};
use vrdma_tests::daemon::{Hostd, IbverbsShim, TempDir, Vdev};
use vrdma_tests::ucx::assert_chose_only;
use vrdma_tests::vm::{self, Guest, GuestConfig, VrdmaDevice, QEMU_VIRTIO_ID};

/// The devices' PCI functions (context slots) and first PCI slots.
const ALPHA_FUNCTIONS: u16 = 8;
const ALPHA_SLOT: u8 = 0x10;
const BETA_FUNCTIONS: u16 = 4;
const BETA_SLOT: u8 = 0x18;
/// One guest step under TCG on a loaded 2-core machine.
const STEP: Duration = Duration::from_secs(180);
/// ucx_perftest's message size and iterations.
const UCX_SIZE: u64 = 4096;
const UCX_ITERS: u64 = 200;
/// Every UCX run: (name, UCX_TLS, the transport each endpoint must use).
const UCX_TRANSPORTS: [(&str, &str, &str); 2] = [
    // UCX refuses rc_verbs without a transport for its wire-up.
    ("rc", "rc_verbs,ud_verbs:aux", "rc_verbs"),
    ("ud", "ud_verbs", "ud_verbs"),
];
const UCX_TESTS: [&str; 4] = ["ucp_put_bw", "ucp_get", "tag_lat", "tag_bw"];
/// Ranks of the MPI runs.
const MPI_RANKS: [usize; 2] = [2, 4];

const POLICY: &str = r#"
[[tenant]]
name = "alpha"
network = "lab"

[[tenant]]
name = "beta"
network = "lab"
"#;

/// Where the guest waits for the host: a `wget` of
/// `http://10.0.2.2:<port>/<name>` (the host's loopback through QEMU's user
/// networking) that is answered once the host has checked what it must.
struct Barrier {
    listener: TcpListener,
}

impl Barrier {
    fn new() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the barrier's port");
        listener.set_nonblocking(true).expect("non-blocking");
        Barrier { listener }
    }

    fn port(&self) -> u16 {
        self.listener.local_addr().expect("local address").port()
    }

    /// Waits until the guest arrives at barrier `name`; the guest goes on
    /// when the returned stream is answered ([`Barrier::release`]).
    fn arrive(&self, name: &str, timeout: Duration, guest: &Guest) -> TcpStream {
        let deadline = Instant::now() + timeout;
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).expect("blocking");
                    let mut line = String::new();
                    BufReader::new(&stream)
                        .read_line(&mut line)
                        .expect("read the guest's request");
                    let wanted = format!("GET /{name} ");
                    assert!(
                        line.starts_with(&wanted),
                        "the guest asked {line:?} while the host waited for barrier {name}\n{}",
                        guest.console()
                    );
                    return stream;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("accept at barrier {name}: {e}"),
            }
            assert!(
                Instant::now() < deadline,
                "the guest did not reach barrier {name} within {timeout:?}\n{}",
                guest.console()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn release(mut stream: TcpStream) {
        stream
            .write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            .expect("answer the guest");
    }
}

/// The guest's part: every step ends in a verdict (`pass`/`fail`), and the
/// output the host checks is printed between `VRDMA-OUT` markers.
fn guest_script(barrier_port: u16, alpha: &str, beta: &str) -> String {
    let device = vm::virtio_pci_device_id(QEMU_VIRTIO_ID);
    let tls_runs: String = UCX_TRANSPORTS
        .iter()
        .map(|(name, tls, _)| format!("{name}={tls} "))
        .collect();
    let tests = UCX_TESTS.join(" ");
    let ranks: String = MPI_RANKS.map(|r| r.to_string()).join(" ");
    format!(
        r#"# Each process's one device, vrdma0 (no `name=`: Open MPI's `-x` takes
# the first '=' only, and prterun crashes on a second).
ALPHA=pci:{alpha}
BETA=pci:{beta}
export VRDMA_DEVICES=$ALPHA VRDMA_VIRTIO_ID={QEMU_VIRTIO_ID}
show() {{ echo "VRDMA-OUT-BEGIN $1"; cat "$2"; echo "VRDMA-OUT-END $1"; }}
# expect NAME FILE TEXT: shows FILE; verdict NAME is whether it holds TEXT.
expect() {{
    show "$1" "$2"
    if grep -q -- "$3" "$2"; then pass "$1"; else fail "$1" "no '$3' in its output"; fi
}}
barrier() {{ wget -q -O /dev/null "http://10.0.2.2:{barrier_port}/$1" || fail "$1" "barrier"; }}
# waitfor FILE TEXT SECONDS: until FILE holds TEXT.
waitfor() {{
    i=0
    while ! grep -q -- "$2" "$1" 2>/dev/null; do
        i=$((i + 1)); [ $i -gt $(($3 * 10)) ] && return 1; sleep 0.1
    done
}}
echo "VRDMA-FUNCTIONS $(grep -l {device:#06x} /sys/bus/pci/devices/*/device | wc -l)"
# UCX lists a device only when its uverbs node exists (docs/compat.md).
mkdir -p /dev/infiniband && mknod -m 666 /dev/infiniband/vrdma-uverbs0 c 1 3
# Shared memory is there, as on any Linux: UCX_TLS alone keeps UCX off it.
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm
echo "127.0.0.1 localhost" > /etc/hosts
hostname vrdma-guest

# 1. One process, 8 contexts: one per function.
/bin/contexts many 8 > /tmp/many 2>&1
expect many /tmp/many "8 contexts OK"

# 2. 8 processes at once, a ninth refused, one killed.
for i in 0 1 2 3 4 5 6 7; do
    /bin/contexts alone $i 20 > /tmp/alone.$i 2>&1 &
    echo $! > /tmp/alone.$i.pid
done
up=0
for i in 0 1 2 3 4 5 6 7; do waitfor /tmp/alone.$i running 120 && up=$((up + 1)); done
if [ $up -eq 8 ]; then pass eight-running; else fail eight-running "$up of 8 running"; fi
/bin/contexts alone 99 1 > /tmp/ninth 2>&1
expect ninth-busy /tmp/ninth "ibv_open_device (errno 16)"
barrier eight
kill -9 "$(cat /tmp/alone.3.pid)"
barrier killed
/bin/contexts alone 100 1 > /tmp/newcomer 2>&1
expect newcomer /tmp/newcomer "100 OK"
for i in 0 1 2 4 5 6 7; do wait "$(cat /tmp/alone.$i.pid)"; done
ok=0
for i in 0 1 2 4 5 6 7; do grep -q "$i OK rounds=" /tmp/alone.$i && ok=$((ok + 1)); show alone.$i /tmp/alone.$i; done
if [ $ok -eq 7 ]; then pass seven-finished; else fail seven-finished "$ok of 7 finished OK"; fi
barrier contexts-closed

# 3. UCX.
ucx_info -d > /tmp/ucx_info 2>&1
expect ucx-info /tmp/ucx_info "Transport: ud_verbs"
export UCX_NET_DEVICES=vrdma0:1 UCX_LOG_LEVEL=info
port=13337
for run in {tls_runs}; do
    name=${{run%%=*}}; export UCX_TLS=${{run#*=}}
    for t in {tests}; do
        port=$((port + 1))
        # -P 0: the socket-based setup (Debian builds it with MPI as default).
        VRDMA_DEVICES=$ALPHA ucx_perftest -P 0 -p $port > /tmp/server 2>&1 &
        server=$!
        waitfor /proc/net/tcp ":$(printf %04X $port) 00000000:0000 0A" 60
        VRDMA_DEVICES=$BETA ucx_perftest -P 0 127.0.0.1 -p $port -t $t -s {UCX_SIZE} -n {UCX_ITERS} > /tmp/client 2>&1
        wait $server
        show ucx-$name-$t-server /tmp/server
        expect ucx-$name-$t /tmp/client "Final:"
    done
done
unset UCX_TLS

# 4. Open MPI over UCX, rc_verbs only: the first half of the ranks on
# alpha's device, the second on beta's, chosen by a wrapper from the rank
# (trixie's mpirun 5.0.7 crashes on the `-np 1 a : -np 1 b` form).
cat > /tmp/by-rank.sh <<EOF
#!/bin/sh
if [ "\$OMPI_COMM_WORLD_RANK" -lt \$((OMPI_COMM_WORLD_SIZE / 2)) ]; then
    export VRDMA_DEVICES=$ALPHA
else
    export VRDMA_DEVICES=$BETA
fi
exec /bin/mpi_pingpong
EOF
chmod +x /tmp/by-rank.sh
export UCX_TLS=rc_verbs,ud_verbs:aux
for n in {ranks}; do
    mpirun.openmpi --allow-run-as-root --oversubscribe -np $n \
        -x LD_LIBRARY_PATH -x UCX_TLS -x UCX_NET_DEVICES -x UCX_LOG_LEVEL -x VRDMA_VIRTIO_ID \
        --mca pml ucx --mca osc ucx --mca btl self \
        /tmp/by-rank.sh > /tmp/mpi 2>&1
    echo "mpirun exit status $?" >> /tmp/mpi
    expect mpi-$n /tmp/mpi "mpirun exit status 0"
done
"#
    )
}

/// The text the guest printed between its markers for `name`.
fn output(console: &str, name: &str) -> String {
    let begin = format!("VRDMA-OUT-BEGIN {name}\n");
    let Some((_, rest)) = console.split_once(&begin) else {
        panic!("the guest printed no output {name}:\n{console}")
    };
    let end = format!("VRDMA-OUT-END {name}");
    rest.split_once(&end)
        .map(|(text, _)| text.to_owned())
        .unwrap_or_else(|| panic!("output {name} has no end:\n{console}"))
}

/// hostd's view of tenant alpha: its QPs.
fn qps(hostd: &Hostd) -> u64 {
    hostd.usage("alpha")["qps"].as_u64().unwrap_or(u64::MAX)
}

/// A tenant's bytes of SEND, WRITE and READ work in hostd.
fn traffic(hostd: &Hostd, tenant: &str) -> u64 {
    let stats = hostd.tenant_stats(tenant);
    ["send", "write", "read"]
        .iter()
        .map(|k| stats["bytes"][k].as_u64().unwrap_or(0))
        .sum()
}

/// Waits (30 s at most) until hostd holds `n` QPs of tenant alpha.
fn wait_qps(hostd: &Hostd, n: u64, vdev: &Vdev) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while qps(hostd) != n {
        assert!(
            Instant::now() < deadline,
            "tenant alpha holds {} QPs, not {n}\n--- vdev:\n{}\n--- hostd:\n{}",
            qps(hostd),
            vdev.log(),
            hostd.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn processes_of_a_qemu_guest_share_its_vrdma_device_with_ucx_and_open_mpi() {
    let image = vm::image_for_test("vm contexts test");
    let started = Instant::now();
    let dir = TempDir::new("vm-contexts");
    let contexts = build_c_program(&dir, "contexts", include_str!("../c/contexts.c"));
    let mpi = build_mpi_program(&dir, "mpi_pingpong", include_str!("../c/mpi_pingpong.c"));
    let hostd = Hostd::start(Some(POLICY));
    let hostd_socket = hostd.socket.to_str().expect("UTF-8 path").to_owned();
    let vdev = Vdev::start_in(
        image.temp_dir("vdev-a"),
        "alpha",
        &["--hostd", &hostd_socket],
    );
    let barrier = Barrier::new();
    let beta_vdev = Vdev::start_in(
        image.temp_dir("vdev-b"),
        "beta",
        &["--hostd", &hostd_socket],
    );
    let alpha_device = VrdmaDevice::for_vdev(&vdev.socket)
        .with_functions(ALPHA_FUNCTIONS)
        .at_slot(ALPHA_SLOT);
    let beta_device = VrdmaDevice::for_vdev(&beta_vdev.socket)
        .with_functions(BETA_FUNCTIONS)
        .at_slot(BETA_SLOT);
    let addresses = |d: &VrdmaDevice| d.guest_addresses().expect("functions at fixed slots");
    let script = guest_script(
        barrier.port(),
        &addresses(&alpha_device),
        &addresses(&beta_device),
    );
    let shim = IbverbsShim::new();
    let lib = "/usr/lib/x86_64-linux-gnu";
    let initramfs = image
        .initramfs()
        .strip_debug()
        .library_dir(shim.path())
        .guest_linked(&contexts, "/bin/contexts")
        .guest_linked(&mpi, "/bin/mpi_pingpong")
        .guest_program("/usr/bin/ucx_info")
        .guest_program("/usr/bin/ucx_perftest")
        .guest_dir(&format!("{lib}/ucx"))
        .guest_program("/usr/bin/mpirun.openmpi")
        .guest_program("/usr/bin/prterun")
        .guest_program("/usr/bin/prted")
        .guest_dir(&format!("{lib}/openmpi"))
        .guest_dir(&format!("{lib}/pmix2"))
        .guest_dir(&format!("{lib}/hwloc"))
        .guest_dir("/usr/share/openmpi")
        .guest_dir("/usr/share/prte")
        .guest_dir("/etc/openmpi")
        .script(&script);
    let config = GuestConfig {
        memory_mib: 2048,
        devices: vec![alpha_device, beta_device],
        ..GuestConfig::default()
    };
    let mut guest = Guest::boot(&image, initramfs, &config).expect("boot the guest");
    let step = |guest: &mut Guest, name: &str| {
        if let Err(e) = guest.verdict(name, STEP) {
            panic!(
                "{name}: {e}\n--- vdev:\n{}\n--- hostd:\n{}",
                vdev.log(),
                hostd.log()
            );
        }
        println!("{:?}: {name} passed", started.elapsed());
    };

    // Contexts: one process with 8, then 8 processes.
    step(&mut guest, "many");
    step(&mut guest, "eight-running");
    step(&mut guest, "ninth-busy");
    let eight = barrier.arrive("eight", STEP, &guest);
    // Each of the 8 contexts holds its two QPs.
    wait_qps(&hostd, 16, &vdev);
    Barrier::release(eight);
    let killed = barrier.arrive("killed", STEP, &guest);
    // The killed process's function was reset when its uio descriptor
    // closed; vdev released that context's QPs, the others kept theirs.
    wait_qps(&hostd, 14, &vdev);
    Barrier::release(killed);
    step(&mut guest, "newcomer");
    step(&mut guest, "seven-finished");
    let closed = barrier.arrive("contexts-closed", STEP, &guest);
    wait_qps(&hostd, 0, &vdev);
    Barrier::release(closed);

    // UCX: the device with both verbs transports, then ucx_perftest.
    step(&mut guest, "ucx-info");
    for (name, _, transport) in UCX_TRANSPORTS {
        for test in UCX_TESTS {
            let before = [traffic(&hostd, "alpha"), traffic(&hostd, "beta")];
            step(&mut guest, &format!("ucx-{name}-{test}"));
            let moved = [
                traffic(&hostd, "alpha") - before[0],
                traffic(&hostd, "beta") - before[1],
            ];
            // The client (beta) always sends; over RC its puts and gets
            // are its WRITEs and READs of alpha's memory.
            assert!(
                moved[1] > 0 && moved[0] + moved[1] >= UCX_SIZE * UCX_ITERS,
                "ucx_perftest {test} over {transport}: hostd moved {moved:?} bytes for alpha, beta"
            );
        }
    }
    let both = |hostd: &Hostd| traffic(hostd, "alpha") + traffic(hostd, "beta");
    for n in MPI_RANKS {
        let before = both(&hostd);
        step(&mut guest, &format!("mpi-{n}"));
        // Each rank sent its partner 20 messages of 1 MiB (the largest
        // size), as RDMA or sends through hostd.
        let moved = both(&hostd) - before;
        let least = n as u64 * 20 * (1 << 20);
        assert!(
            moved >= least,
            "mpirun with {n} ranks: hostd moved {moved} bytes for alpha and beta, not at least {least}"
        );
        println!(
            "mpirun, {n} ranks in the guest: hostd moved {moved} bytes between alpha and beta"
        );
    }
    let status = guest.wait_exit(STEP).expect("the guest powers off");
    assert!(status.success(), "QEMU exit status {status}");

    let console = guest.console();
    assert!(
        console.contains(&format!(
            "VRDMA-FUNCTIONS {}",
            ALPHA_FUNCTIONS + BETA_FUNCTIONS
        )),
        "{console}"
    );
    let info = output(&console, "ucx-info");
    for tl in ["rc_verbs", "ud_verbs"] {
        let needle = format!("#      Transport: {tl}\n#         Device: vrdma0:1\n");
        assert!(info.contains(&needle), "no {tl} on vrdma0:\n{info}");
    }
    for (name, _, transport) in UCX_TRANSPORTS {
        for test in UCX_TESTS {
            let client = output(&console, &format!("ucx-{name}-{test}"));
            let server = output(&console, &format!("ucx-{name}-{test}-server"));
            assert_chose_only(&client, 1, transport);
            assert_chose_only(&server, 1, transport);
            let row = client
                .lines()
                .find(|l| l.starts_with("Final:"))
                .unwrap_or_default();
            assert_eq!(
                row.split_whitespace().nth(1),
                Some(UCX_ITERS.to_string().as_str()),
                "{client}"
            );
            println!("guest ucx_perftest -t {test} over {transport}: {row}");
        }
    }
    for n in MPI_RANKS {
        let text = output(&console, &format!("mpi-{n}"));
        for rank in 0..n {
            let partner = (rank + n / 2) % n;
            let ok = format!("rank {rank} of {n} partner {partner} OK");
            assert!(text.contains(&ok), "no {ok:?}:\n{text}");
        }
        assert_chose_only(&text, n, "rc_verbs");
    }
    println!("{:?}: done", started.elapsed());
}
