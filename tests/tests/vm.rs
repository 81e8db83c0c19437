//! vrdma under a real VMM: stock QEMU 11 (TCG) from Debian trixie-backports
//! attaches vdev as `vhost-user-test-device-pci`, a Debian guest takes the
//! function from virtio-pci for uio_pci_generic and drives its virtio-pci
//! registers like a user-space driver: bring-up to DRIVER_OK, a device
//! reset, a second bring-up; then the machine is reset (QMP system_reset)
//! and QEMU quits. A recording proxy between QEMU and vdev shows what QEMU
//! sends at each step, and the test checks that vdev saw it.
//!
//! Needs root (debootstrap, chroot) and the cache `tests/vm/prepare.sh`
//! fills (docs/vm.md); outside CI without root it prints SKIPPED.

use std::path::Path;
use std::time::Duration;

use vhost::vhost_user::message::FrontendReq;
use vrdma_tests::daemon::{IbverbsShim, Vdev};
use vrdma_tests::vhost_tap::{render, Message, VhostTap};
use vrdma_tests::vm::{self, Guest, GuestConfig, VrdmaDevice, QEMU_VIRTIO_ID};

/// Boot, or one guest step, under TCG on a loaded 2-core machine.
const STEP: Duration = Duration::from_secs(90);
/// Guest-physical address of the control queue the guest script sets up:
/// near the top of the 512 MiB guest, which nothing touches this early.
const RING_GPA: u64 = 0x1f00_0000;

/// The raw PCI config space of the vrdma function under QEMU, for the
/// guest driver's capability-parsing tests. `VRDMA_VM_WRITE_FIXTURE=1`
/// rewrites it from the running guest.
const CONFIG_FIXTURE: &str = "vm/fixtures/vrdma-pci-config.bin";

fn guest_script(host_port: u16) -> String {
    let helpers = include_str!("../vm/guest/find-device.sh");
    let device = vm::virtio_pci_device_id(QEMU_VIRTIO_ID);
    format!(
        r#"VRDMA_PCI_DEVICE={device:#06x}
{helpers}
ls /sys/bus/pci/devices
echo "vrdma guest says hello" | nc 10.0.2.2 {host_port} && pass net || fail net "no TCP to the host"
vrdma_find || {{ fail bind "no PCI function 1af4:{device:04x}"; exit; }}
echo "VRDMA-BDF $BDF driver=$(basename "$(readlink /sys/bus/pci/devices/$BDF/driver)")"
vrdma_take || {{ fail bind "cannot bind $BDF to uio_pci_generic"; exit; }}
[ -c /dev/uio0 ] || {{ fail bind "no /dev/uio0"; exit; }}
vrdma_bus_master || {{ fail bind "cannot enable bus mastering"; exit; }}
grep uio_pci_generic /proc/interrupts
pass bind
vrdma_dump_config
vrdma_caps || {{ fail caps "no virtio common configuration capability"; exit; }}
echo "VRDMA-QUEUES $(($(common_r 18 16)))"
echo "VRDMA-MAGIC $(devmem $DEVICE 32)"
pass caps
ibv_rc_pingpong -h 2>&1 | grep -q "Usage:" && pass libs || fail libs "ibv_rc_pingpong does not run: $(ibv_rc_pingpong -h 2>&1 | head -3)"
vrdma_bring_up {RING_GPA:#x} || {{ fail driver-ok "status $(common_r $STATUS 8)"; exit; }}
echo "VRDMA-STEP driver-ok"
sleep 2
vrdma_reset || {{ fail reset "status $(common_r $STATUS 8) after reset"; exit; }}
echo "VRDMA-STEP reset"
sleep 2
vrdma_bring_up {RING_GPA:#x} || {{ fail driver-ok-again "status $(common_r $STATUS 8)"; exit; }}
echo "VRDMA-STEP driver-ok-again"
pass cycle
# The host resets the machine or quits QEMU from here.
sleep 600
"#
    )
}

/// The config bytes between the guest's VRDMA-CONFIG markers.
fn config_bytes(console: &str) -> Vec<u8> {
    console
        .lines()
        .skip_while(|l| !l.contains("VRDMA-CONFIG-BEGIN"))
        .skip(1)
        .take_while(|l| !l.contains("VRDMA-CONFIG-END"))
        .flat_map(|l| {
            l.split_whitespace()
                .map(|b| u8::from_str_radix(b, 16).expect("hex byte"))
        })
        .collect()
}

/// (cfg_type, bar) of every virtio vendor capability in `config`.
fn virtio_caps(config: &[u8]) -> Vec<(u8, u8)> {
    let mut caps = Vec::new();
    let mut at = usize::from(config[0x34]);
    while at != 0 && caps.len() < 32 {
        if config[at] == 0x09 {
            caps.push((config[at + 3], config[at + 4]));
        }
        at = usize::from(config[at + 1]);
    }
    caps
}

/// The result, or a panic with everything that tells why: the guest's
/// console and QEMU's output (in the error), vdev's log, the vhost-user
/// messages.
fn check<T>(result: Result<T, vm::VmError>, vdev: &Vdev, tap: &VhostTap) -> T {
    match result {
        Ok(value) => value,
        Err(e) => panic!(
            "{e}\n--- vdev log ---\n{}\n--- vhost-user messages ---\n{}",
            vdev.log(),
            render(&tap.messages())
        ),
    }
}

fn step_messages(tap: &VhostTap, from: usize, what: &str) -> (usize, Vec<Message>) {
    let messages = tap.since(from);
    println!("--- QEMU -> vdev: {what} ---\n{}", render(&messages));
    (tap.len(), messages)
}

fn wait_for_request(tap: &VhostTap, from: usize, req: FrontendReq, what: &str) {
    assert!(
        tap.wait_for(from, Duration::from_secs(20), |m| m
            .iter()
            .any(|m| m.is(req))),
        "{what}: QEMU sent no {req:?}:\n{}",
        render(&tap.since(from))
    );
}

#[test]
fn a_qemu_guest_takes_the_device_and_drives_its_lifecycle() {
    let Some(image) = vm::image_for_test("vm smoke test") else {
        return;
    };
    let vdev = Vdev::start_in(image.temp_dir("vdev-vm"), "alpha", &[]);
    let tap_dir = image.temp_dir("tap");
    let tap = VhostTap::start(&tap_dir.path().join("vrdma.sock"), &vdev.socket)
        .expect("start the vhost-user tap");
    let config = GuestConfig {
        device: Some(VrdmaDevice::for_vdev(tap.socket())),
        allow_reboot: true,
        ..GuestConfig::default()
    };
    // The guest reaches a host process over TCP (QEMU user networking).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("host TCP listener");
    let port = listener.local_addr().expect("listener address").port();
    let host_side = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("the guest connects");
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stream, &mut text).expect("read the guest's line");
        text
    });
    // Debian's ibv_rc_pingpong with vrdma's libibverbs.so.1: the libraries
    // resolve in the guest as on the host.
    let shim = IbverbsShim::new();
    let initramfs = image
        .initramfs()
        .library_dir(shim.path())
        .binary(
            Path::new("/usr/bin/ibv_rc_pingpong"),
            "/bin/ibv_rc_pingpong",
        )
        .script(&guest_script(port));
    let mut guest = Guest::boot(&image, initramfs, &config).expect("boot the guest");
    println!("QEMU: {}", guest.command_line().join(" "));

    check(guest.verdict("net", STEP), &vdev, &tap);
    assert_eq!(
        host_side.join().expect("host side"),
        "vrdma guest says hello\n"
    );
    check(guest.verdict("bind", STEP), &vdev, &tap);
    let (mark, boot) = step_messages(&tap, 0, "boot");
    assert!(
        boot.iter().any(|m| m.is(FrontendReq::SET_OWNER)),
        "QEMU took the device"
    );
    assert!(
        vdev.log().contains("Frontend connected"),
        "vdev saw the frontend:\n{}",
        vdev.log()
    );

    check(guest.verdict("caps", STEP), &vdev, &tap);
    check(guest.verdict("libs", STEP), &vdev, &tap);
    let console = guest.console();
    let bytes = config_bytes(&console);
    assert!(
        bytes.len() >= 256,
        "config space dumped: {} bytes",
        bytes.len()
    );
    assert_eq!(&bytes[0..2], &[0xf4, 0x1a], "vendor 0x1af4");
    let device = vm::virtio_pci_device_id(QEMU_VIRTIO_ID);
    assert_eq!(
        u16::from_le_bytes([bytes[2], bytes[3]]),
        device,
        "device id"
    );
    let types: Vec<u8> = virtio_caps(&bytes).iter().map(|c| c.0).collect();
    for wanted in [1, 2, 3, 4, 5] {
        assert!(
            types.contains(&wanted),
            "virtio capability type {wanted} in {types:?}"
        );
    }
    // The guest read the device config space: QEMU asked vdev for it.
    let magic = format!("VRDMA-MAGIC {:#010X}", vrdma_spec::config::CONFIG_MAGIC);
    assert!(console.contains(&magic), "the guest read {magic}");
    let (mark, config_read) = step_messages(&tap, mark, "guest reads the config space");
    assert!(
        config_read.iter().any(|m| m.is(FrontendReq::GET_CONFIG)),
        "QEMU read vdev's config space"
    );
    let queues = format!(
        "VRDMA-QUEUES {}",
        VrdmaDevice::for_vdev(tap.socket()).num_queues
    );
    assert!(console.contains(&queues), "the guest sees {queues}");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join(CONFIG_FIXTURE);
    if std::env::var_os("VRDMA_VM_WRITE_FIXTURE").is_some() {
        std::fs::write(&fixture, &bytes).expect("write the config-space fixture");
    }
    let saved =
        std::fs::read(&fixture).expect("config-space fixture (VRDMA_VM_WRITE_FIXTURE=1 writes it)");
    assert_eq!(
        saved, bytes,
        "{CONFIG_FIXTURE} is what QEMU shows (VRDMA_VM_WRITE_FIXTURE=1 rewrites it)"
    );

    // Bring-up, reset, bring-up: what QEMU sends for each.
    check(guest.wait_for("VRDMA-STEP driver-ok", STEP), &vdev, &tap);
    wait_for_request(&tap, mark, FrontendReq::SET_VRING_KICK, "DRIVER_OK");
    let (mark, up) = step_messages(&tap, mark, "DRIVER_OK");
    assert!(up
        .iter()
        .any(|m| m.is(FrontendReq::ADD_MEM_REG) || m.is(FrontendReq::SET_MEM_TABLE)));
    assert!(up
        .iter()
        .any(|m| m.is(FrontendReq::SET_VRING_ADDR) && m.payload.first() == Some(&0)));
    check(guest.wait_for("VRDMA-STEP reset", STEP), &vdev, &tap);
    wait_for_request(&tap, mark, FrontendReq::GET_VRING_BASE, "device reset");
    let (mark, reset) = step_messages(&tap, mark, "device reset (status 0)");
    assert!(
        !reset.iter().any(|m| m.is(FrontendReq::RESET_DEVICE)),
        "QEMU 11 sends no RESET_DEVICE for vhost-user-base"
    );
    assert!(
        vdev.log().contains("Control queue stopped (device reset)"),
        "vdev took the stop as the reset:\n{}",
        vdev.log()
    );
    check(guest.verdict("cycle", STEP), &vdev, &tap);
    let (mark, _) = step_messages(&tap, mark, "DRIVER_OK again");

    // Machine reset: the guest boots again and brings the device up again.
    let console_mark = guest.console_mark();
    guest.system_reset().expect("QMP system_reset");
    check(
        guest
            .wait_for_after(console_mark, "VRDMA-STEP driver-ok-again", STEP)
            .map(drop),
        &vdev,
        &tap,
    );
    let (mark, reboot) = step_messages(&tap, mark, "system_reset, reboot, two bring-ups");
    assert!(
        reboot.iter().any(|m| m.is(FrontendReq::GET_VRING_BASE)),
        "the reset stopped the rings"
    );

    let status = guest.quit(STEP).expect("QEMU quits");
    assert!(status.success(), "QEMU exit status {status}");
    assert!(
        tap.wait_for(mark, Duration::from_secs(10), |m| m
            .iter()
            .any(|m| m.is(FrontendReq::GET_VRING_BASE))),
        "QEMU stopped the rings when quitting:\n{}",
        render(&tap.since(mark))
    );
    step_messages(&tap, mark, "QEMU quit");
    println!("--- vdev log ---\n{}", vdev.log());
}
