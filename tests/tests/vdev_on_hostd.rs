//! vdev attached to hostd, as a VMM meets it: the frontend drives a vdev
//! process over vhost-user (`vrdma_tests::vmm`), and hostd is either the
//! real one or a stand-in in this process (hostd-protocol's channel) that
//! records what vdev hands over: the doorbell virtqueue's kick, the event
//! virtqueues' calls, the device's objects and its resets.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::Duration;

use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vrdma_hostd_protocol::channel::{Channel, Listener};
use vrdma_hostd_protocol::messages::{Request, Response, Welcome};
use vrdma_spec::control::*;
use vrdma_spec::verbs::{access, QpState};
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_tenant_policy::Policy;
use vrdma_tests::daemon::{Hostd, TempDir, Vdev};
use vrdma_tests::vmm::{
    alloc_pd, cq_req, doorbell_req, eq_req, pd, qp_req, reg, Vmm, FREE, GUEST_BASE,
};

const EINVAL: u32 = libc::EINVAL as u32;

/// Where the tests' drivers keep their doorbell page and event rings.
const DOORBELL_PAGE: u64 = FREE + (4 << 20);
const EVENT_RING: u64 = FREE + (5 << 20);
/// The GID the stand-in hostd assigns.
const STAND_IN_GID: [u8; 16] = vrdma_spec::gid::ipv4_mapped([10, 200, 0, 32]);

fn set_doorbell(vmm: &mut Vmm) -> u32 {
    vmm.errno(Opcode::SetDoorbell, doorbell_req(DOORBELL_PAGE).as_bytes())
}

fn create_eq(vmm: &mut Vmm, vector: u32, addr: u64) -> u32 {
    vmm.errno(Opcode::CreateEq, eq_req(vector, 64, addr).as_bytes())
}

/// The doorbell virtqueue's rings, beside the control queue's.
const DOORBELL_RING: u64 = GUEST_BASE + 0x4000;
/// The first event virtqueue's rings.
const EVENT_QUEUE_RING: u64 = GUEST_BASE + 0x8000;

/// One of each object, registered with hostd: (pdn, MR lkey). The driver
/// first gives the doorbell page, whose kick eventfd (the doorbell
/// virtqueue's) hostd is lent.
fn make_objects(vmm: &mut Vmm) -> (u32, u32) {
    vmm.queue(vrdma_spec::DOORBELL_QUEUE, DOORBELL_RING);
    assert_eq!(set_doorbell(vmm), 0, "SET_DOORBELL");
    let pdn = alloc_pd(vmm);
    let rw = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
    let mr: RegMrResp = vmm.ok(Opcode::RegMr, reg(pdn, FREE, 1 << 20, rw).as_bytes());
    let cq: CqHandle = vmm.ok(Opcode::CreateCq, cq_req(FREE + (2 << 20), 64).as_bytes());
    let (sq, rq) = (FREE + (3 << 20), FREE + (3 << 20) + 0x10000);
    let _: CreateQpResp = vmm.ok(
        Opcode::CreateQp,
        qp_req(pdn, cq.cqn.get(), sq, rq).as_bytes(),
    );
    (pdn, mr.lkey.get())
}

/// What QEMU 11 sends when the guest resets the device (status 0) or the
/// machine resets (QMP system_reset, a reboot), as recorded by
/// tests/tests/vm.rs: every ring disabled, then GET_VRING_BASE for each
/// started ring. No RESET_DEVICE.
fn qemu_stops_the_device(vmm: &mut Vmm) {
    let queues = vrdma_spec::num_queues(1);
    for index in 0..usize::from(queues) {
        vmm.frontend
            .set_vring_enable(index, false)
            .expect("SET_VRING_ENABLE 0");
    }
    let base = vmm
        .frontend
        .get_vring_base(usize::from(vrdma_spec::CONTROL_QUEUE))
        .expect("GET_VRING_BASE");
    assert!(base > 0, "the control queue had served commands");
}

#[test]
fn qemus_device_reset_sequence_releases_everything_in_vdev_and_hostd() {
    let hostd = Hostd::start(None);
    let alpha = Vdev::on_hostd(&hostd, "alpha", &[]);
    let beta = Vdev::on_hostd(&hostd, "beta", &[]);
    let mut vmm = Vmm::attach(&alpha.socket);
    let mut other = Vmm::attach(&beta.socket);
    let (pdn, _) = make_objects(&mut vmm);
    let (other_pdn, _) = make_objects(&mut other);
    let before = hostd.usage("alpha");
    assert_eq!(before["mrs"], 1, "alpha's MR in hostd: {before}");
    assert_eq!(before["mr_bytes"], 1 << 20);
    let other_before = hostd.usage("beta");

    for round in 0..2 {
        qemu_stops_the_device(&mut vmm);
        let after = hostd.usage("alpha");
        assert_eq!(
            after["mrs"], 0,
            "round {round}: MRs freed in hostd: {after}"
        );
        assert_eq!(
            after["mr_bytes"], 0,
            "round {round}: quota given back: {after}"
        );
        assert_eq!(
            after["qps"], 0,
            "round {round}: QPs freed in hostd: {after}"
        );
        assert_eq!(
            after["devices"], before["devices"],
            "the device stays registered: {after}"
        );
        assert_eq!(hostd.usage("beta"), other_before, "beta is untouched");

        // A fresh driver brings the device up again, as QEMU replays it.
        vmm.bring_up_again();
        assert_eq!(
            vmm.errno(Opcode::DeallocPd, pd(pdn).as_bytes()),
            EINVAL,
            "round {round}: the old PD went with the reset"
        );
        make_objects(&mut vmm);
        assert_eq!(
            hostd.usage("alpha")["mrs"],
            1,
            "round {round}: new MR in hostd"
        );
    }
    assert!(alpha
        .log()
        .contains("Control queue stopped (device reset): all verbs objects released"));
    // The other tenant's objects still work.
    let rw = access::LOCAL_WRITE;
    let _: RegMrResp = other.ok(
        Opcode::RegMr,
        reg(other_pdn, FREE + (8 << 20), 4096, rw).as_bytes(),
    );
    assert_eq!(hostd.usage("beta")["mrs"], 2);
}

/// A stand-in hostd in this process: accepts vdev's registrations and
/// records every request with the descriptors that came with it before
/// answering it (keys for `RegisterMr`, RESET for `QueryQp`, else `Ok`).
struct StandInHostd {
    socket: std::path::PathBuf,
    requests: mpsc::Receiver<(Request, Vec<File>)>,
    _dir: TempDir,
}

impl StandInHostd {
    fn start() -> Self {
        let dir = TempDir::new("stand-in-hostd");
        let socket = dir.path().join("hostd.sock");
        let listener = Listener::bind(&socket).expect("bind the stand-in hostd");
        // As hostd makes its socket: vdev, which registers as its
        // unprivileged uid, must be able to connect.
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o666);
        std::fs::set_permissions(&socket, mode).expect("chmod the stand-in's socket");
        let (tx, requests) = mpsc::channel();
        std::thread::spawn(move || {
            while let Ok(channel) = listener.accept() {
                let tx = tx.clone();
                std::thread::spawn(move || serve_vdev(channel, tx));
            }
        });
        StandInHostd {
            socket,
            requests,
            _dir: dir,
        }
    }

    /// The next request vdev sent, with its descriptors.
    fn next(&self) -> (Request, Vec<File>) {
        self.requests
            .recv_timeout(Duration::from_secs(10))
            .expect("a request to hostd within 10 s")
    }
}

fn serve_vdev(channel: Channel, tx: mpsc::Sender<(Request, Vec<File>)>) {
    let Ok((Request::OpenContext { .. }, _)) = channel.recv::<Request>() else {
        return;
    };
    // Kept open while the registration lasts.
    let (_notifications, theirs) = Channel::pair().expect("notification channel");
    let welcome = Response::Welcome(Box::new(Welcome {
        lid: 0x20,
        link_layer: Default::default(),
        gid: STAND_IN_GID,
        physical_queues: 2,
        policy: Policy::default_policy().tenants[0].clone(),
        active_mtu: 4096,
    }));
    if channel.send(&welcome, &[theirs.as_raw_fd()]).is_err() {
        return;
    }
    let mut keys = 0x100;
    let mut push_sockets = Vec::new();
    while let Ok((request, files)) = channel.recv::<Request>() {
        let answer = match request {
            // vdev's journal is not answered, nor followed by the test.
            Request::Journal(_) => continue,
            Request::RegisterMr(_) => {
                keys += 1;
                Response::MrKeys {
                    lkey: keys,
                    rkey: keys + 0x1000,
                }
            }
            Request::QueryQp { .. } => Response::QpState {
                state: QpState::Reset.into(),
            },
            // The device's connection manager (vdev starts one on the
            // registration): answered, not passed on to the test, which
            // follows the verbs' requests.
            Request::GsiNotify | Request::TakeMads { .. } => {
                let answer = match request {
                    Request::TakeMads { .. } => Response::Mads(Vec::new()),
                    _ => Response::Ok,
                };
                if channel.send(&answer, &[]).is_err() {
                    return;
                }
                continue;
            }
            // Its push socket, as hostd makes it (kept open; nothing comes).
            Request::GsiPush => {
                let Ok((ours, theirs)) = Channel::pair() else {
                    return;
                };
                push_sockets.push(ours);
                if channel
                    .send(&Response::MadPush, &[theirs.as_raw_fd()])
                    .is_err()
                {
                    return;
                }
                continue;
            }
            _ => Response::Ok,
        };
        if tx.send((request, files)).is_err() || channel.send(&answer, &[]).is_err() {
            return;
        }
    }
}

/// Reads an eventfd's counter, `None` if nothing is pending.
fn take_count(file: &mut File) -> Option<u64> {
    let mut bytes = [0u8; 8];
    file.read_exact(&mut bytes).ok()?;
    Some(u64::from_ne_bytes(bytes))
}

/// vdev hands hostd the eventfds the frontend set: the doorbell
/// virtqueue's kick (which vdev itself never polls: a notification sent
/// before hostd had it is still there for hostd) and an event virtqueue's
/// call (hostd's signal interrupts the driver). A vector whose call the
/// frontend never set is refused. vdev's CREATE_CQ, CREATE_QP and a device
/// reset reach hostd too.
#[test]
fn hostd_is_lent_the_doorbell_kick_and_the_event_interrupts() {
    let hostd = StandInHostd::start();
    let path = hostd.socket.to_str().expect("UTF-8 path").to_owned();
    let vdev = Vdev::start("lent", &["--hostd", &path, "--comp-vectors", "2"]);
    let mut vmm = Vmm::attach(&vdev.socket);
    let (request, files) = hostd.next();
    assert!(
        matches!(
            request,
            Request::AddMemory {
                gpa: GUEST_BASE,
                ..
            }
        ),
        "{request:?}"
    );
    assert_eq!(files.len(), 1, "the guest memory's memfd");
    assert_eq!(
        vmm.config.gid, STAND_IN_GID,
        "hostd's GID is the port's GID 0"
    );
    assert_eq!(vmm.config.port.lid.get(), 0, "RoCE: no LID");
    assert_eq!(
        vmm.config.name(),
        Some("vrdma_32"),
        "named after hostd's LID"
    );

    let doorbell = vmm.queue(vrdma_spec::DOORBELL_QUEUE, DOORBELL_RING);
    let events = vmm.queue(vrdma_spec::FIRST_EVENT_QUEUE, EVENT_QUEUE_RING);
    // The driver notifies the doorbell queue; were vdev polling it, the
    // notification would be consumed by the time hostd gets the eventfd.
    doorbell.kick.write(5).expect("kick");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(set_doorbell(&mut vmm), 0);
    let (request, mut files) = hostd.next();
    assert_eq!(request, Request::SetDoorbell { gpa: DOORBELL_PAGE });
    assert_eq!(files.len(), 1, "the doorbell queue's kick");
    assert_eq!(
        take_count(&mut files[0]),
        Some(5),
        "the kick is the doorbell queue's, and still pending for hostd"
    );

    assert_eq!(create_eq(&mut vmm, 0, EVENT_RING), 0);
    let (request, mut files) = hostd.next();
    assert_eq!(
        request,
        Request::CreateEq {
            vector: 0,
            gpa: EVENT_RING,
            depth: 64
        }
    );
    assert_eq!(files.len(), 1, "the event queue's call");
    files[0].write_all(&1u64.to_ne_bytes()).expect("signal");
    assert_eq!(events.call.read().expect("the driver is interrupted"), 1);
    // Vector 1's event queue (virtqueue 3) was never set up.
    assert_eq!(create_eq(&mut vmm, 1, EVENT_RING + 0x10000), EINVAL);
    assert!(
        vdev.log()
            .contains("The frontend has set no call eventfd on virtqueue 3"),
        "{}",
        vdev.log()
    );

    let pdn = alloc_pd(&mut vmm);
    let cq_ring = FREE + (2 << 20);
    let cq: CqHandle = vmm.ok(Opcode::CreateCq, cq_req(cq_ring, 64).as_bytes());
    assert_eq!(
        hostd.next().0,
        Request::CreateCq {
            cqn: cq.cqn.get(),
            gpa: cq_ring,
            depth: 64,
            vector: 0
        }
    );
    let (sq, rq) = (FREE + (3 << 20), FREE + (3 << 20) + 0x10000);
    let qp: CreateQpResp = vmm.ok(
        Opcode::CreateQp,
        qp_req(pdn, cq.cqn.get(), sq, rq).as_bytes(),
    );
    match hostd.next().0 {
        Request::CreateQp(setup) => {
            assert_eq!(setup.vqpn, qp.qpn.get());
            assert_eq!(setup.db_index, qp.db_index.get());
            assert_eq!((setup.sq.gpa, setup.rq.gpa), (sq, rq));
            assert_eq!(setup.max_send_sge, qp.cap.max_send_sge.get());
            assert_eq!(setup.max_inline_data, qp.cap.max_inline_data.get());
        }
        other => panic!("CREATE_QP sent {other:?}"),
    }

    vmm.frontend.reset_device().expect("RESET_DEVICE");
    assert_eq!(hostd.next().0, Request::ResetDevice);
    let mut vdev = vdev;
    assert!(vdev.is_running(), "vdev died:\n{}", vdev.log());
}
