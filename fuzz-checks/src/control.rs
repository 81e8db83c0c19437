//! Control commands: whole chains through `control::process_chain` and
//! decoded commands through `RdmaDevice::execute`, against a device with
//! guest memory — alone, or attached to a real hostd (its `Server` in this
//! process, over its socket), so that every object vdev accepts is
//! mirrored there and hostd's view is checked against vdev's.

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, OnceLock};

use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::GuestRegionMmap;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::control::{CreateQpResp, Opcode, RequestHeader, ResponseHeader};
use vrdma_spec::limits::MAX_QPS;
use vrdma_spec::ring::{self, doorbell, RING_ALIGN};
use vrdma_spec::verbs::QpState;
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};
use vrdma_tenant_policy::Limits;
use vrdma_vdev::control::process_chain;
use vrdma_vdev::fabric::Fabric;
use vrdma_vdev::verbs::{DeviceIdentity, EventRing, FdError, NotifyFds, RdmaDevice};

use crate::input::Input;
use crate::server::{eventfd, Hostd};

mod aim;

/// Guest memory: a low region for the virtqueue and chain buffers, and a
/// data region for rings and memory regions.
const QUEUE_BASE: u64 = 0;
const QUEUE_SIZE: usize = 64 << 10;
const MEM_BASE: u64 = 0x10_0000;
const MEM_SIZE: usize = 1 << 20;
/// Where a chain's request and response buffers go.
const REQ_ADDR: u64 = 0x4000;
const RESP_ADDR: u64 = 0x8000;
const VIRTQ_LEN: u16 = 16;
/// Most commands per input.
const MAX_STEPS: usize = 48;
/// The device's completion vectors; vector 1 has no call eventfd when
/// attached (the frontend never set it), so hostd cannot be given one.
const COMP_VECTORS: u16 = 2;
/// The tenant of the attached device, in hostd's policy.
const TENANT: &str = "ctl";
const POLICY: &str = r#"
[[tenant]]
name = "ctl"
network = "ctl"
physical_queues = 1
"#;

/// Small limits, so that inputs reach them.
fn fuzz_limits() -> Limits {
    Limits {
        max_pd: 4,
        max_qp: 4,
        max_cq: 4,
        max_mr: 8,
        max_mr_bytes: 256 << 10,
        max_total_mr_bytes: 512 << 10,
        ..Limits::default()
    }
}

fn identity() -> DeviceIdentity {
    DeviceIdentity {
        tenant: Arc::from(TENANT),
        lid: 1,
        link_layer: Default::default(),
        gid: vrdma_spec::gid::loopback_gid(1),
        comp_vectors: COMP_VECTORS,
        max_queue_size: 256,
        active_mtu: vrdma_spec::verbs::Mtu::Mtu4096,
    }
}

/// The two regions of guest memory. Attached, the data region is a sealed
/// memfd (vdev mirrors it to hostd) and the queue region anonymous (hostd
/// never has it): whatever hostd's datapath writes lands in the data
/// region, never in the chains this check reads.
fn guest_memory(attached: bool) -> Arc<GuestMemoryMmap> {
    let file = attached.then(|| {
        let memfd = sealed_memfd("fuzz-guest", MEM_SIZE as u64).expect("sealed memfd");
        FileOffset::new(memfd, 0)
    });
    let regions = vec![
        GuestRegionMmap::from_range(GuestAddress(QUEUE_BASE), QUEUE_SIZE, None).expect("mmap"),
        GuestRegionMmap::from_range(GuestAddress(MEM_BASE), MEM_SIZE, file).expect("mmap"),
    ];
    Arc::new(GuestMemoryMmap::from_regions(regions).expect("guest memory"))
}

/// The device's eventfds as a VMM would lend them: a doorbell kick and
/// vector 0's call (real eventfds, which hostd checks).
#[derive(Debug)]
struct TestFds {
    kick: std::fs::File,
    call0: std::fs::File,
}

impl NotifyFds for TestFds {
    fn doorbell_kick(&self) -> Result<OwnedFd, FdError> {
        dup(&self.kick, "kick", u32::from(vrdma_spec::DOORBELL_QUEUE))
    }

    fn vector_call(&self, vector: u32) -> Result<OwnedFd, FdError> {
        let queue = u32::from(vrdma_spec::FIRST_EVENT_QUEUE).saturating_add(vector);
        match vector {
            0 => dup(&self.call0, "call", queue),
            _ => Err(FdError::Missing {
                kind: "call",
                queue,
            }),
        }
    }
}

fn dup(file: &std::fs::File, kind: &'static str, queue: u32) -> Result<OwnedFd, FdError> {
    file.try_clone()
        .map(OwnedFd::from)
        .map_err(|source| FdError::Dup {
            kind,
            queue,
            source,
        })
}

/// hostd for attached devices, one input at a time.
fn hostd() -> &'static Mutex<(Hostd, Arc<TestFds>)> {
    static HOSTD: OnceLock<Mutex<(Hostd, Arc<TestFds>)>> = OnceLock::new();
    HOSTD.get_or_init(|| {
        let fds = TestFds {
            kick: eventfd(),
            call0: eventfd(),
        };
        Mutex::new((Hostd::start("control", POLICY, 4, true), Arc::new(fds)))
    })
}

/// Everything a command may change, to compare around a refused one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    counts: (usize, usize, usize, usize),
    mr_bytes: u64,
    /// (qpn, pdn, state, access, db_index)
    qps: Vec<(u32, u32, QpState, u32, u32)>,
    doorbell: Option<u64>,
    eqs: Vec<Option<EventRing>>,
}

fn snapshot(dev: &RdmaDevice) -> Snapshot {
    let mut qps: Vec<_> = dev
        .qps_iter()
        .map(|qp| {
            let access = qp.attr.qp_access_flags.get();
            (qp.qpn, qp.pdn, qp.state, access, qp.db_index)
        })
        .collect();
    qps.sort_unstable_by_key(|q| q.0);
    Snapshot {
        counts: dev.object_counts(),
        mr_bytes: dev.registered_bytes(),
        qps,
        doorbell: dev.doorbell(),
        eqs: (0..u32::from(COMP_VECTORS))
            .map(|v| dev.event_ring(v))
            .collect(),
    }
}

impl Snapshot {
    /// `self` with the QPs that are in ERR in `after` in ERR: an attached
    /// device takes over the ERR its QPs entered in hostd's datapath before
    /// it looks at their state, even for a command it then refuses.
    fn adopting_err(&self, after: &Snapshot) -> Snapshot {
        let mut adopted = self.clone();
        for qp in &mut adopted.qps {
            if after.qps.iter().any(|q| q.0 == qp.0 && q.2 == QpState::Err) {
                qp.2 = QpState::Err;
            }
        }
        adopted
    }
}

/// Handles the device returned so far, to aim commands at live objects.
#[derive(Debug, Default)]
struct Handles {
    pds: Vec<u32>,
    mrs: Vec<u32>,
    cqs: Vec<u32>,
    qps: Vec<u32>,
}

/// The first byte says whether the device is attached to hostd; then up
/// to [`MAX_STEPS`] commands. Invariants: a refused command changes
/// nothing (objects, registered bytes, QP states, access and doorbell
/// indices, the doorbell page, event rings); an executed one answers
/// exactly the response size of its opcode; the tenant's limits always
/// hold; a chain's used length never exceeds its writable bytes and its
/// header tells the truth; a second `SET_DOORBELL` or `CREATE_EQ` of a
/// vector is refused (`EEXIST`), `CREATE_QP` before `SET_DOORBELL` too, and
/// what they accept lies aligned in guest memory; QPs get distinct doorbell
/// indices below `MAX_QPS`; attached, hostd holds what vdev holds (MRs,
/// their bytes, QPs, each QP's state) after every command, and nothing of
/// the device once it reset or hung up.
pub fn check(data: &[u8]) {
    let mut input = Input::new(data);
    if input.u8() & 1 == 0 {
        let mem = guest_memory(false);
        let mut dev = RdmaDevice::new(identity(), fuzz_limits());
        dev.update_memory(mem.clone());
        run(&mut dev, &mem, None, &mut input);
        return;
    }
    let shared = hostd().lock().unwrap_or_else(|e| e.into_inner());
    let (hostd, fds) = &*shared;
    let socket = hostd.socket.as_deref().expect("hostd listens");
    let fabric = Fabric::connect(socket, TENANT, "fuzz").expect("hostd registers the device");
    let fabric = Arc::new(fabric);
    let mut dev = RdmaDevice::with_fabric(identity(), fuzz_limits(), fabric.clone(), fds.clone());
    let mem = guest_memory(true);
    dev.update_memory(mem.clone());
    run(&mut dev, &mem, Some(hostd), &mut input);
    fabric.close();
    drop(dev);
    hostd.await_gone(TENANT);
}

fn run(dev: &mut RdmaDevice, mem: &GuestMemoryMmap, hostd: Option<&Hostd>, input: &mut Input) {
    let limits = fuzz_limits();
    let mut handles = Handles::default();
    for _ in 0..MAX_STEPS {
        if input.is_empty() {
            break;
        }
        let mode = input.u8();
        let code = steer(input.u8(), dev, &handles);
        let Ok(opcode) = Opcode::try_from(code) else {
            // Unknown codes go through the chain path, which must refuse them.
            let request = framed(code, input.u16() & 1, input.bytes(64));
            let before = snapshot(dev);
            let status = run_chain(dev, mem, &request, 512, mode).map(|(s, _)| s);
            assert!(status != Some(0), "unknown command code {code} executed");
            assert_eq!(before, snapshot(dev), "refused chain changed the device");
            continue;
        };
        let mut payload = input.bytes(opcode.request_len()).to_vec();
        payload.resize(opcode.request_len(), 0);
        aim::aim(&mut payload, opcode, mode, &handles, &*dev, input);
        let before = snapshot(dev);
        let direct = mode & 0x80 == 0;
        let result = if direct {
            dev.execute(opcode, &payload).map_err(|e| {
                let errno = e.errno();
                assert!(errno > 0, "{opcode:?}: error {e} with errno {errno}");
                errno
            })
        } else {
            // Through the virtqueue: framing possibly broken on purpose.
            let flags = if mode & 0x40 != 0 { input.u16() } else { 0 };
            let mut request = framed(code, flags, &payload);
            if mode & 0x20 != 0 {
                let cut = usize::from(input.u16()) % (request.len() + 8);
                request.resize(cut, input.u8());
            }
            let writable = if mode & 0x10 != 0 {
                u32::from(input.u16() % 1024)
            } else {
                512
            };
            match run_chain(dev, mem, &request, writable, mode) {
                Some((0, response)) => Ok(response),
                Some((errno, _)) => Err(errno),
                None => Err(0),
            }
        };
        let after = snapshot(dev);
        match result {
            Ok(response) => {
                assert_eq!(
                    response.len(),
                    opcode.response_len(),
                    "{opcode:?}: response size"
                );
                check_accepted(
                    opcode,
                    &payload,
                    &response,
                    &before,
                    &after,
                    mem,
                    hostd.is_some(),
                );
                learn(&mut handles, opcode, &response);
            }
            Err(errno) => {
                let before = match hostd {
                    Some(_) => before.adopting_err(&after),
                    None => before,
                };
                assert_eq!(before, after, "{opcode:?}: refused but changed the device");
                if direct {
                    check_refused(opcode, &payload, errno, &before);
                }
            }
        }
        check_limits(dev, &limits);
        if let Some(hostd) = hostd {
            check_mirror(dev, hostd);
        }
    }
    // Tearing down always works and leaves nothing, in hostd either.
    dev.release_all();
    assert_eq!(dev.object_counts(), (0, 0, 0, 0));
    assert_eq!(dev.registered_bytes(), 0);
    assert_eq!((dev.doorbell(), dev.event_ring(0)), (None, None));
    if let Some(hostd) = hostd {
        let usage = hostd.usage(TENANT);
        assert_eq!(
            (usage.devices, usage.mrs, usage.mr_bytes, usage.qps),
            (1, 0, 0, 0)
        );
    }
}

/// The command code `byte` names, or one time in four what the device
/// lacks to go deeper (a doorbell page, a PD, a CQ, QPs, transitions), so
/// that short random inputs reach the states that take several commands.
fn steer(byte: u8, dev: &RdmaDevice, handles: &Handles) -> u16 {
    if byte & 0xc0 != 0xc0 {
        return u16::from(byte % 18);
    }
    let (pds, _, cqs, qps) = dev.object_counts();
    let opcode = if dev.doorbell().is_none() {
        Opcode::SetDoorbell
    } else if pds == 0 {
        Opcode::AllocPd
    } else if cqs == 0 {
        Opcode::CreateCq
    } else if qps < 2 && handles.qps.len() < 8 {
        Opcode::CreateQp
    } else {
        Opcode::ModifyQp
    };
    opcode.into()
}

fn check_limits(dev: &RdmaDevice, limits: &Limits) {
    let (pds, mrs, cqs, qps) = dev.object_counts();
    assert!(pds as u64 <= u64::from(limits.max_pd), "max_pd exceeded");
    assert!(mrs as u64 <= u64::from(limits.max_mr), "max_mr exceeded");
    assert!(cqs as u64 <= u64::from(limits.max_cq), "max_cq exceeded");
    assert!(qps as u64 <= u64::from(limits.max_qp), "max_qp exceeded");
    assert!(
        dev.registered_bytes() <= limits.max_total_mr_bytes,
        "max_total_mr_bytes exceeded"
    );
}

/// Whether `[addr, addr + bytes)` lies in guest memory, `RING_ALIGN`-aligned.
fn ring_fits(mem: &GuestMemoryMmap, addr: u64, bytes: u64) -> bool {
    addr.is_multiple_of(RING_ALIGN)
        && usize::try_from(bytes).is_ok_and(|n| mem.check_range(GuestAddress(addr), n))
}

/// What an executed command must have done.
fn check_accepted(
    opcode: Opcode,
    payload: &[u8],
    response: &[u8],
    before: &Snapshot,
    after: &Snapshot,
    mem: &GuestMemoryMmap,
    attached: bool,
) {
    let word = |at: usize| u32::from_le_bytes(payload[at..at + 4].try_into().expect("u32"));
    let addr = |at: usize| u64::from_le_bytes(payload[at..at + 8].try_into().expect("u64"));
    match opcode {
        Opcode::SetDoorbell => {
            assert_eq!(before.doorbell, None, "a second doorbell page accepted");
            assert_eq!(after.doorbell, Some(addr(0)));
            assert!(
                ring_fits(mem, addr(0), doorbell::PAGE_SIZE),
                "doorbell page outside memory"
            );
        }
        Opcode::CreateEq => {
            let (vector, depth, at) = (word(0), word(4), addr(8));
            assert!(
                vector < u32::from(COMP_VECTORS),
                "event ring of vector {vector}"
            );
            assert_eq!(
                before.eqs[vector as usize], None,
                "a second event ring accepted"
            );
            assert!(
                !(attached && vector == 1),
                "an event ring accepted that hostd has no call eventfd for"
            );
            let eq = EventRing {
                ring_addr: at,
                depth,
            };
            assert_eq!(after.eqs[vector as usize], Some(eq));
            assert!(ring::valid_depth(depth), "event ring depth {depth}");
            assert!(
                ring_fits(mem, at, ring::event_ring_bytes(depth)),
                "event ring outside memory"
            );
        }
        Opcode::CreateQp => {
            assert!(before.doorbell.is_some(), "CREATE_QP before SET_DOORBELL");
            let resp = CreateQpResp::read_from_bytes(response).expect("response size");
            let (qpn, db) = (resp.qpn.get(), resp.db_index.get());
            assert!(db < MAX_QPS, "doorbell index {db}");
            let taken: BTreeSet<u32> = before.qps.iter().map(|q| q.4).collect();
            assert!(!taken.contains(&db), "doorbell index {db} given twice");
            assert!(after.qps.iter().any(|q| q.0 == qpn && q.4 == db));
        }
        _ => {}
    }
}

/// Why a command directly executed must have been refused.
fn check_refused(opcode: Opcode, payload: &[u8], errno: i32, before: &Snapshot) {
    let word = |at: usize| u32::from_le_bytes(payload[at..at + 4].try_into().expect("u32"));
    match opcode {
        Opcode::SetDoorbell if before.doorbell.is_some() => {
            assert_eq!(errno, libc::EEXIST, "second SET_DOORBELL");
        }
        Opcode::CreateEq => {
            let vector = word(0);
            let exists = before.eqs.get(vector as usize).is_some_and(Option::is_some);
            if exists {
                assert_eq!(errno, libc::EEXIST, "second CREATE_EQ of vector {vector}");
            }
        }
        Opcode::CreateQp if before.doorbell.is_none() => {
            assert_eq!(errno, libc::EINVAL, "CREATE_QP before SET_DOORBELL");
        }
        _ => {}
    }
}

/// Attached: hostd holds what vdev holds, and each QP is in vdev's state
/// there — or in ERR, which vdev then takes over when asked.
fn check_mirror(dev: &mut RdmaDevice, hostd: &Hostd) {
    let usage = hostd.usage(TENANT);
    let (_, mrs, _, qps) = dev.object_counts();
    assert_eq!(
        (usage.devices, usage.mrs, usage.mr_bytes, usage.qps),
        (1, mrs as u64, dev.registered_bytes(), qps as u64),
        "hostd's accounts differ from vdev's objects"
    );
    let Some(fabric) = dev.fabric().cloned() else {
        return;
    };
    let states: Vec<(u32, QpState)> = dev.qps_iter().map(|q| (q.qpn, q.state)).collect();
    for (qpn, state) in states {
        let there = fabric.query_qp(qpn).expect("hostd knows the QP");
        if there == u8::from(state) {
            continue;
        }
        assert_eq!(
            there,
            u8::from(QpState::Err),
            "QP {qpn} is {state:?} in vdev, {there} in hostd"
        );
        let query = vrdma_spec::control::QueryQpReq {
            qpn: qpn.into(),
            attr_mask: 0.into(),
        };
        assert!(dev.execute(Opcode::QueryQp, query.as_bytes()).is_ok());
        assert_eq!(
            dev.qp(qpn).map(|q| q.state),
            Some(QpState::Err),
            "ERR not taken over"
        );
    }
}

/// A request: header then payload.
fn framed(code: u16, flags: u16, payload: &[u8]) -> Vec<u8> {
    let header = RequestHeader {
        opcode: code.into(),
        flags: flags.into(),
        payload_len: (payload.len() as u32).into(),
    };
    let mut bytes = header.as_bytes().to_vec();
    bytes.extend_from_slice(payload);
    bytes
}

/// Sends `request` as a chain (one readable, one writable descriptor of
/// `writable` bytes) through `process_chain`. Returns the response status
/// and payload, or `None` when the chain got no response.
fn run_chain(
    dev: &mut RdmaDevice,
    mem: &GuestMemoryMmap,
    request: &[u8],
    writable: u32,
    mode: u8,
) -> Option<(i32, Vec<u8>)> {
    mem.write_slice(request, GuestAddress(REQ_ADDR))
        .expect("request buffer");
    mem.write_slice(&[0xeeu8; 1024], GuestAddress(RESP_ADDR))
        .expect("response buffer");
    // VRING_DESC_F_WRITE: the device writes this buffer.
    let write = 2;
    let mut descs = Vec::new();
    if !request.is_empty() || mode & 0x08 != 0 {
        descs.push(RawDescriptor::from(SplitDescriptor::new(
            REQ_ADDR,
            request.len() as u32,
            0,
            0,
        )));
    }
    descs.push(RawDescriptor::from(SplitDescriptor::new(
        RESP_ADDR, writable, write, 0,
    )));
    let queue = MockSplitQueue::new(mem, VIRTQ_LEN);
    let chain = queue.build_desc_chain(&descs).expect("chain");
    let used = process_chain(dev, mem, chain, 0);
    assert!(
        used <= writable,
        "used length {used} beyond {writable} writable bytes"
    );
    let header_len = core::mem::size_of::<ResponseHeader>();
    if (used as usize) < header_len {
        assert_eq!(used, 0, "partial response header");
        return None;
    }
    let mut out = vec![0u8; used as usize];
    mem.read_slice(&mut out, GuestAddress(RESP_ADDR))
        .expect("response");
    let (header, payload) = ResponseHeader::split(&out)
        .expect("response header payload_len disagrees with the used length");
    let status = header.status.get() as i32;
    assert!(status >= 0, "negative errno");
    if status != 0 {
        assert!(payload.is_empty(), "error response with a payload");
    }
    Some((status, payload.to_vec()))
}

/// Remembers the handle a successful command returned.
fn learn(handles: &mut Handles, opcode: Opcode, response: &[u8]) {
    let first = response
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes);
    let Some(handle) = first else { return };
    match opcode {
        Opcode::AllocPd => handles.pds.push(handle),
        Opcode::RegMr | Opcode::RegMrSg => handles.mrs.push(handle),
        Opcode::CreateCq => handles.cqs.push(handle),
        Opcode::CreateQp => handles.qps.push(handle),
        _ => {}
    }
}
