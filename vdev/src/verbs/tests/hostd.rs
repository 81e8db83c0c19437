//! What hostd is told: a device registered with a stand-in hostd (a real
//! seqpacket peer speaking hostd-protocol) that records every request and
//! the descriptors that came with it.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::channel::{Channel, Listener};
use vrdma_hostd_protocol::messages::{
    QpConnection, QpModify, QpSetup, Request, Response, Welcome, WorkRing,
};
use vrdma_spec::limits::QpGrant;
use vrdma_spec::verbs::Mtu;
use vrdma_tenant_policy::Policy;

use super::*;
use crate::fabric::Fabric;

/// The GID the stand-in hostd assigns.
const HOSTD_GID: [u8; 16] = vrdma_spec::gid::ipv4_mapped([10, 200, 0, 9]);

/// The test's own eventfds, lent as the device's: the test can then tell
/// whether what hostd received is the same eventfd.
#[derive(Debug)]
pub(super) struct TestFds {
    kick: EventFd,
    /// Vector 1 has a call eventfd; vector 0's is set only when a test
    /// asks for it ([`attached_with_vector_0`]).
    call1: EventFd,
    call0: Option<EventFd>,
}

fn test_fds() -> Arc<TestFds> {
    fds_with(None)
}

fn fds_with(call0: Option<EventFd>) -> Arc<TestFds> {
    Arc::new(TestFds {
        kick: EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
        call1: EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
        call0,
    })
}

fn dup(fd: &EventFd) -> Result<OwnedFd, FdError> {
    let copy = fd.try_clone().expect("dup");
    // SAFETY: `into_raw_fd` releases the fresh duplicate's only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(copy.into_raw_fd()) })
}

impl NotifyFds for TestFds {
    fn doorbell_kick(&self) -> Result<OwnedFd, FdError> {
        dup(&self.kick)
    }

    fn vector_call(&self, vector: u32) -> Result<OwnedFd, FdError> {
        match (vector, &self.call0) {
            (1, _) => dup(&self.call1),
            (0, Some(call0)) => dup(call0),
            _ => Err(FdError::Missing {
                kind: "call",
                queue: 2 + vector,
            }),
        }
    }
}

/// How the stand-in answers.
#[derive(Debug, Default)]
struct Script {
    /// The QP state `QueryQp` reports.
    qp_state: AtomicU8,
    /// Refuse `CreateQp` with EAGAIN.
    refuse_create_qp: AtomicBool,
    /// Memory regions registered: `RegisterMr` answers keys
    /// `(0x100 + n, 0x200 + n)` for the n-th, or the first region's
    /// again when `repeat_keys` is set.
    mrs: AtomicU32,
    repeat_keys: AtomicBool,
    /// The active MTU a registration is welcomed with (0: 1024).
    active_mtu: AtomicU32,
}

/// A stand-in hostd: one registration, then every request recorded (with
/// its descriptors) before it is answered.
pub(super) struct FakeHostd {
    requests: mpsc::Receiver<(Request, Vec<File>)>,
    script: Arc<Script>,
    dir: PathBuf,
}

impl FakeHostd {
    /// Starts the stand-in and registers a device with it.
    fn start(tag: &str) -> (FakeHostd, Arc<Fabric>) {
        let dir =
            std::env::temp_dir().join(format!("vdev-fake-hostd-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let path = dir.join("hostd.sock");
        let listener = Listener::bind(&path).expect("bind");
        let script = Arc::new(Script::default());
        let (tx, requests) = mpsc::channel();
        let answers = script.clone();
        std::thread::spawn(move || serve(listener, answers, tx));
        let fabric = Fabric::connect(&path, "t1", "dev").expect("registered");
        let hostd = FakeHostd {
            requests,
            script,
            dir,
        };
        (hostd, Arc::new(fabric))
    }

    /// The next request vdev sent, with its descriptors.
    pub(super) fn next(&self) -> (Request, Vec<File>) {
        self.requests
            .recv_timeout(Duration::from_secs(10))
            .expect("a request within 10 s")
    }

    /// The next request, which must carry no descriptor.
    pub(super) fn next_plain(&self) -> Request {
        let (request, files) = self.next();
        assert!(files.is_empty(), "{request:?} carried descriptors");
        request
    }

    /// Asserts vdev sent nothing more (every request is recorded before it
    /// is answered, so a finished verb's requests are all here).
    pub(super) fn assert_quiet(&self, after: &str) {
        if let Ok((request, _)) = self.requests.try_recv() {
            panic!("after {after}, hostd was sent {request:?}");
        }
    }
}

impl Drop for FakeHostd {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Serves every registration (a re-registration after a restart too),
/// each on a thread of its own, until the test ends.
fn serve(listener: Listener, script: Arc<Script>, tx: mpsc::Sender<(Request, Vec<File>)>) {
    while let Ok(channel) = listener.accept() {
        let (script, tx) = (script.clone(), tx.clone());
        std::thread::spawn(move || serve_one(channel, script, tx));
    }
}

fn serve_one(channel: Channel, script: Arc<Script>, tx: mpsc::Sender<(Request, Vec<File>)>) {
    let (hello, _): (Request, _) = channel.recv().expect("hello");
    assert!(matches!(hello, Request::OpenContext { .. }), "{hello:?}");
    let (_notifications, theirs) = Channel::pair().expect("pair");
    let welcome = Response::Welcome(Box::new(Welcome {
        lid: 9,
        link_layer: Default::default(),
        gid: HOSTD_GID,
        physical_queues: 4,
        policy: Policy::default_policy().tenants[0].clone(),
        active_mtu: match script.active_mtu.load(Ordering::SeqCst) {
            0 => 1024,
            mtu => mtu,
        },
    }));
    channel
        .send(&welcome, &[theirs.as_raw_fd()])
        .expect("welcome");
    while let Ok((request, files)) = channel.recv::<Request>() {
        if matches!(request, Request::Journal(_)) {
            // Not answered; the tests follow the verbs' requests.
            continue;
        }
        let answer = match &request {
            Request::QueryQp { .. } => Response::QpState {
                state: script.qp_state.load(Ordering::SeqCst),
            },
            Request::RegisterMr(_) => {
                let n = match script.repeat_keys.load(Ordering::SeqCst) {
                    true => 0,
                    false => script.mrs.fetch_add(1, Ordering::SeqCst),
                };
                Response::MrKeys {
                    lkey: 0x100 + n,
                    rkey: 0x200 + n,
                }
            }
            // A MAD tagged 0xee (byte 24): refused, as one to a peer the
            // tenant may not reach.
            Request::SendMad(m) if m.mad.get(24) == Some(&0xee) => Response::Refused {
                errno: libc::EACCES,
                reason: "stand-in refuses".into(),
            },
            // As hostd: a QP the datapath failed takes RESET or ERR only.
            Request::ModifyQp(m)
                if script.qp_state.load(Ordering::SeqCst) == u8::from(QpState::Err)
                    && !matches!(
                        QpState::try_from(m.state),
                        Ok(QpState::Reset | QpState::Err)
                    ) =>
            {
                Response::Refused {
                    errno: libc::EINVAL,
                    reason: "the QP is in the error state".into(),
                }
            }
            Request::CreateQp(_) if script.refuse_create_qp.load(Ordering::SeqCst) => {
                Response::Refused {
                    errno: libc::EAGAIN,
                    reason: "stand-in refuses".into(),
                }
            }
            _ => Response::Ok,
        };
        if tx.send((request, files)).is_err() {
            return;
        }
        if channel.send(&answer, &[]).is_err() {
            return;
        }
    }
}

/// Eventfd bytes: what one side writes, the other reads.
fn write_u64(file: &mut File, value: u64) {
    file.write_all(&value.to_ne_bytes()).expect("write eventfd");
}

fn read_u64(file: &mut File) -> u64 {
    let mut bytes = [0u8; 8];
    file.read_exact(&mut bytes).expect("read eventfd");
    u64::from_ne_bytes(bytes)
}

pub(super) fn attached(tag: &str) -> (FakeHostd, RdmaDevice, Arc<TestFds>) {
    attached_to(tag, test_fds())
}

/// [`attached`], with a call eventfd on vector 0 too.
fn attached_with_vector_0(tag: &str) -> (FakeHostd, RdmaDevice, Arc<TestFds>) {
    attached_to(
        tag,
        fds_with(Some(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"))),
    )
}

fn attached_to(tag: &str, fds: Arc<TestFds>) -> (FakeHostd, RdmaDevice, Arc<TestFds>) {
    let (hostd, fabric) = FakeHostd::start(tag);
    let mut dev = RdmaDevice::with_fabric(identity(), Limits::default(), fabric, fds.clone());
    // Anonymous memory has no file to give hostd: no AddMemory.
    dev.update_memory(guest_memory());
    hostd.assert_quiet("update_memory");
    (hostd, dev, fds)
}

/// The port's state as `QUERY_PORT` reports it.
fn port_state(dev: &mut RdmaDevice) -> u8 {
    query_port(dev).state
}

fn query_port(dev: &mut RdmaDevice) -> vrdma_spec::config::PortAttr {
    let req = vrdma_spec::control::QueryPortReq {
        port_num: 1,
        ..Default::default()
    };
    run::<vrdma_spec::config::PortAttr>(dev, Opcode::QueryPort, req.as_bytes()).expect("QUERY_PORT")
}

/// Sets event ring `eq`'s indices as hostd and the driver left them.
fn set_indices(dev: &RdmaDevice, eq: u64, producer: u32, consumer: u32) {
    let mem = &dev.mem;
    mem.write_obj(
        producer.to_le(),
        GuestAddress(eq + ring::DEVICE_INDEX_OFFSET),
    )
    .expect("device index");
    mem.write_obj(
        consumer.to_le(),
        GuestAddress(eq + ring::DRIVER_INDEX_OFFSET),
    )
    .expect("driver index");
}

fn read_u32(dev: &RdmaDevice, addr: u64) -> u32 {
    u32::from_le(dev.mem.read_obj(GuestAddress(addr)).expect("guest u32"))
}

#[test]
fn posted_mads_are_answered_before_the_next_request_and_refusals_counted() {
    let (hostd, fabric) = FakeHostd::start("posted");
    let mad = |tag: u8| {
        let mut mad = vec![0u8; 256];
        mad[24] = tag;
        vrdma_hostd_protocol::messages::MadOut {
            peer: [0; 16],
            traffic_class: 0,
            mad,
        }
    };
    for tag in [1, 0xee, 2] {
        fabric.post_mad(mad(tag)).expect("posted");
    }
    for tag in [1, 0xee, 2] {
        match hostd.next_plain() {
            Request::SendMad(m) => assert_eq!(m.mad[24], tag, "in order"),
            other => panic!("{other:?}"),
        }
    }
    // The next request gets its own answer, not one of theirs.
    hostd
        .script
        .qp_state
        .store(QpState::Rts.into(), Ordering::SeqCst);
    assert_eq!(fabric.query_qp(5).expect("query"), u8::from(QpState::Rts));
    assert_eq!(hostd.next_plain(), Request::QueryQp { vqpn: 5 });
    assert_eq!(fabric.mads_refused(), 1, "the refused one");
    // More than are owed at most: the oldest answers are read on the way.
    for _ in 0..200 {
        fabric.post_mad(mad(0xee)).expect("posted");
    }
    assert_eq!(fabric.mads_refused(), 201);
}

#[test]
fn a_lost_hostd_takes_the_port_down_with_one_event_on_ring_0() {
    let (hostd, mut dev, fds) = attached_with_vector_0("port-lost");
    let eq = MEM_BASE + 0x31_0000;
    create_eq(&mut dev, 0, 4, eq).expect("EQ of vector 0");
    assert!(matches!(
        hostd.next().0,
        Request::CreateEq { vector: 0, .. }
    ));
    assert_eq!(port_state(&mut dev), u8::from(PortState::Active));
    // hostd wrote 5 events (the index wrapped once); the driver read 3.
    set_indices(&dev, eq, 5, 3);

    dev.port_lost();
    assert_eq!(port_state(&mut dev), u8::from(PortState::Down));
    let call0 = fds.call0.as_ref().expect("vector 0's call");
    assert_eq!(call0.read().expect("interrupt"), 1);
    assert_eq!(read_u32(&dev, eq + ring::DEVICE_INDEX_OFFSET), 6);
    let at = eq + ring::event_entry_offset(5, 4);
    let mut raw = [0u8; ring::EVENT_SIZE];
    dev.mem
        .read_slice(&mut raw, GuestAddress(at))
        .expect("event");
    let event = ring::Event::read_from_bytes(&raw).expect("event size");
    assert_eq!(
        (event.kind.get(), event.object.get()),
        (ring::event_kind::PORT_ERROR, 1),
        "PORT_ERROR of port 1 in slot 1"
    );
    assert_eq!(read_u32(&dev, eq + ring::DEVICE_FLAGS_OFFSET), 0);

    // Down already: no second event.
    dev.port_lost();
    assert_eq!(read_u32(&dev, eq + ring::DEVICE_INDEX_OFFSET), 6);
    assert!(call0.read().is_err(), "no second interrupt");
    hostd.assert_quiet("the port going down");
}

#[test]
fn a_port_error_on_a_full_ring_is_counted_lost() {
    let (_hostd, mut dev, fds) = attached_with_vector_0("port-lost-full");
    let eq = MEM_BASE + 0x31_0000;
    create_eq(&mut dev, 0, 4, eq).expect("EQ of vector 0");
    set_indices(&dev, eq, 7, 3);

    dev.port_lost();
    assert_eq!(port_state(&mut dev), u8::from(PortState::Down));
    assert_eq!(
        read_u32(&dev, eq + ring::DEVICE_INDEX_OFFSET),
        7,
        "nothing written"
    );
    assert_eq!(
        read_u32(&dev, eq + ring::DEVICE_FLAGS_OFFSET),
        ring::DEVICE_FLAG_ERROR,
        "the ring says events were lost"
    );
    let call0 = fds.call0.as_ref().expect("vector 0's call");
    assert_eq!(
        call0.read().expect("interrupt"),
        1,
        "the driver still wakes"
    );
}

#[test]
fn the_doorbell_and_event_rings_reach_hostd_with_their_eventfds() {
    let (hostd, mut dev, fds) = attached("notify");
    assert_eq!(dev.config().gid, HOSTD_GID, "hostd's GID");
    let gid: vrdma_spec::control::QueryGidResp = run(
        &mut dev,
        Opcode::QueryGid,
        vrdma_spec::control::QueryGidReq {
            port_num: 1,
            ..Default::default()
        }
        .as_bytes(),
    )
    .expect("QUERY_GID");
    assert_eq!(gid.gid, HOSTD_GID, "QUERY_GID returns the Welcome's GID");
    assert_eq!(gid.gid_type.get(), vrdma_spec::control::gid_type::ROCE_V2);
    assert_eq!(
        dev.config().name().map(str::to_owned),
        Some("vrdma_9".into())
    );

    set_doorbell(&mut dev, DOORBELL).expect("doorbell");
    let (request, mut files) = hostd.next();
    assert_eq!(request, Request::SetDoorbell { gpa: DOORBELL });
    assert_eq!(files.len(), 1, "the kick eventfd");
    // The driver's notification reaches whoever holds hostd's copy.
    fds.kick.write(3).expect("kick");
    assert_eq!(read_u64(&mut files[0]), 3);
    assert_eq!(set_doorbell(&mut dev, DOORBELL), Err(libc::EEXIST));
    hostd.assert_quiet("a second SET_DOORBELL");

    let eq = MEM_BASE + 0x31_0000;
    assert_eq!(
        create_eq(&mut dev, 0, 64, eq),
        Err(libc::EINVAL),
        "vector 0's event queue has no call eventfd"
    );
    hostd.assert_quiet("a CREATE_EQ without an eventfd");
    assert_eq!(dev.event_ring(0), None);
    create_eq(&mut dev, 1, 64, eq).expect("EQ of vector 1");
    let (request, mut files) = hostd.next();
    assert_eq!(
        request,
        Request::CreateEq {
            vector: 1,
            gpa: eq,
            depth: 64
        }
    );
    assert_eq!(files.len(), 1, "the call eventfd");
    // hostd's interrupt reaches the driver.
    write_u64(&mut files[0], 1);
    assert_eq!(fds.call1.read().expect("interrupt"), 1);

    dev.release_all();
    assert_eq!(hostd.next_plain(), Request::ResetDevice);
    dev.release_all();
    hostd.assert_quiet("a second reset with nothing left");
}

#[test]
fn cqs_and_qps_reach_hostd_with_their_rings_and_grants() {
    let (hostd, mut dev, _fds) = attached("qp");
    set_doorbell(&mut dev, DOORBELL).expect("doorbell");
    let _ = hostd.next();
    let pdn = alloc_pd(&mut dev);
    let cqn = create_cq(&mut dev, MEM_BASE).expect("cq");
    assert_eq!(
        hostd.next_plain(),
        Request::CreateCq {
            cqn,
            gpa: MEM_BASE,
            depth: 16,
            vector: 0
        }
    );

    let (sq, rq) = (MEM_BASE + 0x10000, MEM_BASE + 0x20000);
    let qp = create_qp(&mut dev, pdn, cqn, sq, rq).expect("qp");
    let qpn = qp.qpn.get();
    let grant = QpGrant::compute(
        crate::verbs::qp::caps_of(&qp_cap(10, 2, 64)),
        crate::verbs::qp::cap_limits(&Limits::default()),
    )
    .expect("grant");
    assert_eq!(
        hostd.next_plain(),
        Request::CreateQp(QpSetup {
            vqpn: qpn,
            pd: pdn,
            db_index: 0,
            send_cqn: cqn,
            recv_cqn: cqn,
            sq_sig_all: false,
            sq: WorkRing {
                gpa: sq,
                depth: grant.sq.depth,
                stride: grant.sq.stride
            },
            rq: WorkRing {
                gpa: rq,
                depth: grant.rq.depth,
                stride: grant.rq.stride
            },
            max_send_sge: grant.caps.max_send_sge,
            max_recv_sge: grant.caps.max_recv_sge,
            max_inline_data: grant.caps.max_inline_data,
            srqn: None,
            qp_type: 2,
        })
    );
    assert_eq!(qp.cap.max_send_sge.get(), grant.caps.max_send_sge);

    // Each transition, without asking hostd for the QP's state first.
    modify(&mut dev, qpn, INIT_MASK, init_attr()).expect("INIT");
    assert_eq!(
        hostd.next_plain(),
        Request::ModifyQp(QpModify {
            vqpn: qpn,
            state: QpState::Init.into(),
            connection: None,
            access: Some(access::REMOTE_WRITE),
            qkey: None,
        })
    );
    modify(&mut dev, qpn, RTR_MASK, rtr_attr()).expect("RTR");
    // At RTR: the peer (GRH), the responder's attributes, and the
    // requester's as they stand (not set yet).
    let at_rtr = QpConnection {
        dgid: PEER_GID,
        dlid: None,
        dest_qpn: 0x1234,
        flow_label: 0x1_2345,
        hop_limit: 64,
        traffic_class: 0x20,
        access: access::REMOTE_WRITE,
        rnr_retry: 0,
        retry_cnt: 0,
        min_rnr_timer: 12,
        timeout: 0,
        path_mtu: 1024,
        sq_psn: 0,
        rq_psn: 0x42,
        max_rd_atomic: 0,
        max_dest_rd_atomic: 4,
    };
    assert_eq!(
        hostd.next_plain(),
        Request::ModifyQp(QpModify {
            vqpn: qpn,
            state: QpState::Rtr.into(),
            connection: Some(at_rtr),
            access: None,
            qkey: None,
        })
    );
    let rts = QpAttr {
        retry_cnt: 5,
        rnr_retry: 3,
        sq_psn: 0xab_cdef.into(),
        ..rts_attr()
    };
    modify(&mut dev, qpn, RTS_MASK, rts).expect("RTS");
    assert_eq!(
        hostd.next_plain(),
        Request::ModifyQp(QpModify {
            vqpn: qpn,
            state: QpState::Rts.into(),
            connection: Some(QpConnection {
                rnr_retry: 3,
                retry_cnt: 5,
                timeout: 14,
                sq_psn: 0xab_cdef,
                max_rd_atomic: 1,
                ..at_rtr
            }),
            access: None,
            qkey: None,
        }),
        "at RTS the whole connection: what RTR set and the requester's attributes"
    );

    // The QP fails in the datapath: a modify hostd refuses for it is
    // EINVAL, as one checked against ERR, and vdev takes the ERR over.
    hostd
        .script
        .qp_state
        .store(QpState::Err.into(), Ordering::SeqCst);
    let sqd = QpAttr {
        qp_state: QpState::Sqd.into(),
        ..QpAttr::default()
    };
    assert_eq!(
        modify(&mut dev, qpn, mask::STATE, sqd),
        Err(libc::EINVAL),
        "RTS -> SQD of a QP the datapath failed"
    );
    assert!(matches!(
        hostd.next_plain(),
        Request::ModifyQp(QpModify { state: 4, .. })
    ));
    assert_eq!(hostd.next_plain(), Request::QueryQp { vqpn: qpn });
    assert_eq!(query_state(&mut dev, qpn), QpState::Err);
    assert_eq!(hostd.next_plain(), Request::QueryQp { vqpn: qpn });
    // Known to be in ERR: refused here, hostd not asked.
    assert_eq!(
        modify(&mut dev, qpn, mask::STATE, sqd),
        Err(libc::EINVAL),
        "ERR -> SQD is not a transition"
    );
    hostd.assert_quiet("a refused MODIFY_QP");
    let reset = QpAttr {
        qp_state: QpState::Reset.into(),
        ..QpAttr::default()
    };
    modify(&mut dev, qpn, mask::STATE, reset).expect("ERR -> RESET");
    assert!(matches!(
        hostd.next_plain(),
        Request::ModifyQp(QpModify {
            state: 0,
            connection: None,
            access: None,
            ..
        })
    ));

    release(&mut dev, Opcode::DestroyQp, qpn).expect("destroy qp");
    assert_eq!(hostd.next_plain(), Request::DestroyQp { vqpn: qpn });

    // hostd refuses a QP: its errno reaches the driver, the doorbell bit
    // is given back.
    hostd.script.refuse_create_qp.store(true, Ordering::SeqCst);
    assert_eq!(
        create_qp(&mut dev, pdn, cqn, sq, rq).map(|_| ()),
        Err(libc::EAGAIN)
    );
    assert!(matches!(
        hostd.next_plain(),
        Request::CreateQp(QpSetup { db_index: 0, .. })
    ));
    hostd.script.refuse_create_qp.store(false, Ordering::SeqCst);
    let again = create_qp(&mut dev, pdn, cqn, sq, rq).expect("qp");
    assert_eq!(again.db_index.get(), 0, "the refused QP's bit came back");
    let _ = hostd.next();

    assert_eq!(
        release(&mut dev, Opcode::DestroyCq, cqn + 100),
        Err(libc::EINVAL)
    );
    hostd.assert_quiet("destroying an unknown CQ");
    let spare = create_cq(&mut dev, MEM_BASE + 0x30000).expect("cq");
    let _ = hostd.next_plain();
    release(&mut dev, Opcode::DestroyCq, spare).expect("destroy cq");
    assert_eq!(hostd.next_plain(), Request::DestroyCq { cqn: spare });

    // A reset is one message, whatever is left.
    dev.release_all();
    assert_eq!(hostd.next_plain(), Request::ResetDevice);
    hostd.assert_quiet("the reset");
    assert_eq!(dev.object_counts(), (0, 0, 0, 0));
}

/// Guest memory backed by a memfd, as a VMM's is: hostd is given the slot.
fn memfd_memory() -> Arc<GuestMemoryMmap> {
    let name = std::ffi::CString::new("vdev-test-guest").expect("name");
    // SAFETY: a valid NUL-terminated name and flags; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is fresh and owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(MEM_SIZE as u64).expect("size");
    let mem = GuestMemoryMmap::from_ranges_with_files(&[(
        GuestAddress(MEM_BASE),
        MEM_SIZE,
        Some(vm_memory::FileOffset::new(file, 0)),
    )])
    .expect("map");
    Arc::new(mem)
}

#[test]
fn memory_regions_take_the_keys_hostd_assigns() {
    let (hostd, fabric) = FakeHostd::start("mr");
    let mut dev = RdmaDevice::with_fabric(identity(), Limits::default(), fabric, test_fds());
    dev.update_memory(memfd_memory());
    let (request, files) = hostd.next();
    assert_eq!(
        request,
        Request::AddMemory {
            slot: 0,
            gpa: MEM_BASE,
            len: MEM_SIZE as u64,
            file_offset: 0
        }
    );
    assert_eq!(files.len(), 1, "the memfd");

    let pdn = alloc_pd(&mut dev);
    let flags = access::LOCAL_WRITE | access::REMOTE_WRITE;
    let mr = reg_mr(&mut dev, pdn, MEM_BASE + 0x5000, 0x3000, flags).expect("mr");
    assert_eq!(
        (mr.lkey.get(), mr.rkey.get()),
        (0x100, 0x200),
        "hostd's keys"
    );
    assert_eq!(
        hostd.next_plain(),
        Request::RegisterMr(vrdma_hostd_protocol::messages::MrRegistration {
            pd: pdn,
            access: flags,
            iova: MEM_BASE + 0x5000,
            len: 0x3000,
            segments: vec![vrdma_hostd_protocol::messages::MrSegment {
                slot: 0,
                offset: 0x5000,
                len: 0x3000
            }],
        })
    );
    assert!(dev
        .translate_local(pdn, 0x100, MEM_BASE + 0x5000, 0x3000, access::LOCAL_WRITE)
        .is_ok());

    // Keys already in use would make two regions one: refused.
    hostd.script.repeat_keys.store(true, Ordering::SeqCst);
    assert_eq!(
        reg_mr(&mut dev, pdn, MEM_BASE, 0x1000, 0).map(|_| ()),
        Err(libc::EIO)
    );
    let _ = hostd.next_plain();
    assert_eq!(dev.object_counts().1, 1, "one MR");

    release(&mut dev, Opcode::DeregMr, mr.handle.get()).expect("dereg");
    assert_eq!(hostd.next_plain(), Request::DeregisterMr { lkey: 0x100 });
    assert_eq!(dev.registered_bytes(), 0);
}

/// The event in slot `index` of event ring `eq` (of 4 slots).
fn event_at(dev: &RdmaDevice, eq: u64, index: u32) -> (u16, u32) {
    let mut raw = [0u8; ring::EVENT_SIZE];
    dev.mem
        .read_slice(
            &mut raw,
            GuestAddress(eq + ring::event_entry_offset(index, 4)),
        )
        .expect("event");
    let event = ring::Event::read_from_bytes(&raw).expect("event size");
    (event.kind.get(), event.object.get())
}

/// A context that lost hostd registers again with the hostd that comes
/// back and hands it everything it had: its memory, doorbell page and
/// event ring (with their eventfds), its CQ and MR (under the MR's keys),
/// and its QPs — the connected one in ERR (hostd flushes it), the one in
/// INIT with its access flags, the one in RESET as it is. The port goes
/// DOWN with PORT_ERROR and the connected QP's QP_FATAL, and ACTIVE again
/// with PORT_ACTIVE, all on event ring 0, which hostd then resumes.
#[test]
fn a_restarted_hostd_gets_the_context_back_and_the_port_comes_up() {
    let fds = fds_with(Some(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd")));
    let (hostd, fabric) = FakeHostd::start("restore");
    let mut dev = RdmaDevice::with_fabric(identity(), Limits::default(), fabric, fds.clone());
    dev.update_memory(memfd_memory());
    set_doorbell(&mut dev, DOORBELL).expect("doorbell");
    let eq = MEM_BASE + 0x31_0000;
    create_eq(&mut dev, 0, 4, eq).expect("EQ of vector 0");
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let flags = access::LOCAL_WRITE | access::REMOTE_WRITE;
    let mr = reg_mr(&mut dev, pdn, MEM_BASE + 0x5000, 0x3000, flags).expect("mr");
    let mut qp = |n: u64| {
        let base = MEM_BASE + 0x10_0000 + n * 0x2_0000;
        create_qp(&mut dev, pdn, cqn, base, base + 0x1_0000)
            .expect("qp")
            .qpn
            .get()
    };
    let (connected, waiting, fresh) = (qp(0), qp(1), qp(2));
    modify(&mut dev, connected, INIT_MASK, init_attr()).expect("INIT");
    modify(&mut dev, connected, RTR_MASK, rtr_attr()).expect("RTR");
    modify(&mut dev, connected, RTS_MASK, rts_attr()).expect("RTS");
    modify(&mut dev, waiting, INIT_MASK, init_attr()).expect("INIT");
    // AddMemory, SetDoorbell, CreateEq, CreateCq, RegisterMr, 3 CreateQp,
    // 4 ModifyQp: what the first hostd had.
    for _ in 0..12 {
        hostd.next();
    }
    hostd.assert_quiet("the objects' creation");
    // hostd wrote 2 events, the driver read them; it also left the CQ's
    // producer at 3, which the next hostd continues from (vdev does not
    // touch it).
    set_indices(&dev, eq, 2, 2);
    let cq_ring = dev.cq(cqn).expect("cq").ring_addr;
    dev.mem
        .write_obj(
            3u32.to_le(),
            GuestAddress(cq_ring + ring::DEVICE_INDEX_OFFSET),
        )
        .expect("CQ index");

    dev.port_lost();
    assert_eq!(port_state(&mut dev), u8::from(PortState::Down));
    assert_eq!(read_u32(&dev, eq + ring::DEVICE_INDEX_OFFSET), 4);
    assert_eq!(event_at(&dev, eq, 2), (ring::event_kind::PORT_ERROR, 1));
    assert_eq!(
        event_at(&dev, eq, 3),
        (ring::event_kind::QP_FATAL, connected),
        "the connected QP failed with the port"
    );
    assert_eq!(query_state(&mut dev, connected), QpState::Err);
    assert_eq!(
        query_state(&mut dev, waiting),
        QpState::Init,
        "INIT lives on"
    );
    assert_eq!(query_state(&mut dev, fresh), QpState::Reset);
    let call0 = fds.call0.as_ref().expect("vector 0's call");
    assert_eq!(call0.read().expect("interrupts"), 2, "PORT_ERROR, QP_FATAL");
    hostd.assert_quiet("the port going down");
    // The driver read both events.
    set_indices(&dev, eq, 4, 4);

    // The new hostd runs with another `[fabric] ip_mtu`.
    assert_eq!(query_port(&mut dev).active_mtu, u8::from(Mtu::Mtu1024));
    hostd.script.active_mtu.store(2048, Ordering::SeqCst);
    let fabric = dev.fabric().cloned().expect("fabric");
    let welcome = fabric.reconnect().expect("registered again");
    let restored = dev.restore(&welcome);
    assert_eq!(
        query_port(&mut dev).active_mtu,
        u8::from(Mtu::Mtu2048),
        "the port has the new hostd's MTU"
    );
    assert_eq!(fabric.active_mtu(), Mtu::Mtu2048);
    assert_eq!(
        restored,
        Restored {
            // A memory slot, the doorbell, an event ring, a CQ, an MR and
            // three QPs.
            objects: 8,
            refused: 0,
            flushed_qps: 1,
            gid_changed: false,
            handed_over: false,
        }
    );
    assert_eq!(port_state(&mut dev), u8::from(PortState::Active));
    assert_eq!(event_at(&dev, eq, 0), (ring::event_kind::PORT_ACTIVE, 1));
    assert_eq!(read_u32(&dev, eq + ring::DEVICE_INDEX_OFFSET), 5);
    assert_eq!(call0.read().expect("interrupt"), 1);
    assert_eq!(
        read_u32(&dev, cq_ring + ring::DEVICE_INDEX_OFFSET),
        3,
        "the CQ's ring is left for hostd to continue"
    );

    let (request, files) = hostd.next();
    assert!(
        matches!(
            request,
            Request::AddMemory {
                slot: 0,
                gpa: MEM_BASE,
                ..
            }
        ) && files.len() == 1,
        "{request:?}"
    );
    let (request, files) = hostd.next();
    assert_eq!(
        (request, files.len()),
        (Request::SetDoorbell { gpa: DOORBELL }, 1)
    );
    let (request, files) = hostd.next();
    assert_eq!(
        (request, files.len()),
        (
            Request::ResumeEq {
                vector: 0,
                gpa: eq,
                depth: 4
            },
            1
        ),
        "the event ring continues at its index (after PORT_ACTIVE)"
    );
    assert_eq!(
        hostd.next_plain(),
        Request::ResumeCq {
            cqn,
            gpa: cq_ring,
            depth: dev.cq(cqn).expect("cq").depth,
            vector: 0
        }
    );
    let Request::RestoreMr {
        lkey,
        rkey,
        mr: reg,
    } = hostd.next_plain()
    else {
        panic!("RestoreMr expected");
    };
    assert_eq!(
        (lkey, rkey),
        (mr.lkey.get(), mr.rkey.get()),
        "the same keys"
    );
    assert_eq!((reg.pd, reg.access, reg.len), (pdn, flags, 0x3000));
    let mut qps = std::collections::BTreeMap::new();
    for _ in 0..5 {
        match hostd.next_plain() {
            Request::ResumeQp(setup) => {
                assert_eq!(setup, dev.qp(setup.vqpn).expect("qp").setup());
                qps.entry(setup.vqpn).or_insert_with(Vec::new);
            }
            Request::ModifyQp(m) => {
                qps.entry(m.vqpn).or_insert_with(Vec::new).push(m);
            }
            other => panic!("{other:?}"),
        }
    }
    let state = |m: &QpModify| QpState::try_from(m.state).expect("state");
    let moves = |qpn: u32| -> Vec<(QpState, Option<u32>)> {
        qps[&qpn].iter().map(|m| (state(m), m.access)).collect()
    };
    assert_eq!(moves(connected), [(QpState::Err, None)], "flushed");
    assert_eq!(
        moves(waiting),
        [(QpState::Init, Some(access::REMOTE_WRITE))],
        "INIT again, with its access flags"
    );
    assert_eq!(moves(fresh), [], "RESET as it was");
    hostd.assert_quiet("the restore");

    // The context works on: a new QP reaches the new hostd.
    let base = MEM_BASE + 0x10_0000 + 3 * 0x2_0000;
    create_qp(&mut dev, pdn, cqn, base, base + 0x1_0000).expect("a new QP");
    assert!(matches!(hostd.next_plain(), Request::CreateQp(_)));
}
