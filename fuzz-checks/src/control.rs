//! Control commands: whole chains through `control::process_chain` and
//! decoded commands through `RdmaDevice::execute`, against a device with
//! guest memory.

use std::sync::Arc;

use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_spec::control::{Opcode, RequestHeader, ResponseHeader};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};
use vrdma_tenant_policy::Limits;
use vrdma_vdev::control::process_chain;
use vrdma_vdev::verbs::{DeviceIdentity, RdmaDevice};

use crate::input::Input;

/// Guest memory: a low region for the virtqueue and chain buffers, and a
/// data region for rings and memory regions.
pub const QUEUE_BASE: u64 = 0;
pub const QUEUE_SIZE: usize = 64 << 10;
pub const MEM_BASE: u64 = 0x10_0000;
pub const MEM_SIZE: usize = 1 << 20;
/// Where a chain's request and response buffers go.
const REQ_ADDR: u64 = 0x4000;
const RESP_ADDR: u64 = 0x8000;
const VIRTQ_LEN: u16 = 16;
/// Most commands per input.
const MAX_STEPS: usize = 48;

/// Small limits, so that inputs reach them.
pub fn fuzz_limits() -> Limits {
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

/// A device for tenant `tenant` with the two guest memory regions.
pub fn device(tenant: &str, limits: Limits) -> (RdmaDevice, Arc<GuestMemoryMmap>) {
    let identity = DeviceIdentity {
        tenant: Arc::from(tenant),
        lid: 1,
        comp_vectors: 2,
        max_queue_size: 256,
    };
    let mut dev = RdmaDevice::new(identity, limits);
    let mem = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(QUEUE_BASE), QUEUE_SIZE),
        (GuestAddress(MEM_BASE), MEM_SIZE),
    ])
    .expect("guest memory");
    let mem = Arc::new(mem);
    dev.update_memory(mem.clone());
    (dev, mem)
}

/// Everything a command may change, to compare around a refused one.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    counts: (usize, usize, usize, usize),
    mr_bytes: u64,
    qps: Vec<(u32, u32, u32, u32)>,
}

fn snapshot(dev: &RdmaDevice) -> Snapshot {
    let mut qps: Vec<_> = dev
        .qps_iter()
        .map(|qp| {
            (
                qp.qpn,
                qp.pdn,
                u32::from(u8::from(qp.state)),
                qp.attr.qp_access_flags.get(),
            )
        })
        .collect();
    qps.sort_unstable();
    Snapshot {
        counts: dev.object_counts(),
        mr_bytes: dev.registered_bytes(),
        qps,
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

/// Runs up to [`MAX_STEPS`] commands from `data`. Invariants: a refused
/// command changes nothing (objects, registered bytes, QP states); an
/// executed one answers exactly the response size of its opcode; the
/// tenant's limits always hold; a chain's used length never exceeds its
/// writable bytes and its header tells the truth.
pub fn check(data: &[u8]) {
    let limits = fuzz_limits();
    let (mut dev, mem) = device("fuzz", limits);
    let mut input = Input::new(data);
    let mut handles = Handles::default();
    for _ in 0..MAX_STEPS {
        if input.is_empty() {
            break;
        }
        let mode = input.u8();
        let code = u16::from(input.u8() % 15);
        let Ok(opcode) = Opcode::try_from(code) else {
            // Unknown codes go through the chain path, which must refuse them.
            let request = framed(code, input.u16() & 1, input.bytes(64));
            let before = snapshot(&dev);
            let status = run_chain(&mut dev, &mem, &request, 512, mode).map(|(s, _)| s);
            assert!(status != Some(0), "unknown command code {code} executed");
            assert_eq!(before, snapshot(&dev), "refused chain changed the device");
            continue;
        };
        let mut payload = input.bytes(opcode.request_len()).to_vec();
        payload.resize(opcode.request_len(), 0);
        aim(&mut payload, opcode, mode, &handles, &mut input);
        let before = snapshot(&dev);
        let result = if mode & 0x80 != 0 {
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
            match run_chain(&mut dev, &mem, &request, writable, mode) {
                Some((0, response)) => Ok(response),
                Some((errno, _)) => Err(errno),
                None => Err(0),
            }
        } else {
            dev.execute(opcode, &payload).map_err(|e| {
                let errno = e.errno();
                assert!(errno > 0, "{opcode:?}: error {e} with errno {errno}");
                errno
            })
        };
        match result {
            Ok(response) => {
                assert_eq!(
                    response.len(),
                    opcode.response_len(),
                    "{opcode:?}: response size"
                );
                learn(&mut handles, opcode, &response);
            }
            Err(_) => assert_eq!(
                before,
                snapshot(&dev),
                "{opcode:?}: refused but changed the device"
            ),
        }
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
    // Tearing down always works and leaves nothing.
    dev.release_all();
    assert_eq!(dev.object_counts(), (0, 0, 0, 0));
    assert_eq!(dev.registered_bytes(), 0);
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
    let used = process_chain(dev, mem, chain);
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
    let (header, payload) = ResponseHeader::read_from_prefix(&out).expect("header");
    assert_eq!(
        header.payload_len.get() as usize,
        payload.len(),
        "response header payload_len disagrees with the used length"
    );
    let status = header.status.get() as i32;
    assert!(status >= 0, "negative errno");
    if status != 0 {
        assert!(payload.is_empty(), "error response with a payload");
    }
    Some((status, payload.to_vec()))
}

/// Points the handle fields of a payload at live objects and its guest
/// addresses into guest memory, as `mode` says: random bytes alone would
/// almost never name an object.
fn aim(payload: &mut [u8], opcode: Opcode, mode: u8, handles: &Handles, input: &mut Input<'_>) {
    let put32 = |payload: &mut [u8], at: usize, v: u32| {
        if let Some(dst) = payload.get_mut(at..at + 4) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
    };
    let put64 = |payload: &mut [u8], at: usize, v: u64| {
        if let Some(dst) = payload.get_mut(at..at + 8) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
    };
    let pool: &[u32] = match opcode {
        Opcode::DeallocPd | Opcode::RegMr | Opcode::RegMrSg | Opcode::CreateQp => &handles.pds,
        Opcode::DeregMr => &handles.mrs,
        Opcode::DestroyCq => &handles.cqs,
        Opcode::ModifyQp | Opcode::QueryQp | Opcode::DestroyQp => &handles.qps,
        _ => &[],
    };
    if mode & 1 != 0 {
        if let Some(&h) = input.pick(pool) {
            put32(payload, 0, h);
        }
    }
    if mode & 2 != 0 {
        let ring = |input: &mut Input<'_>| MEM_BASE + u64::from(input.u8() % 64) * 4096;
        match opcode {
            Opcode::RegMr => {
                // pdn, access, addr, length, iova.
                let addr = MEM_BASE + u64::from(input.u32()) % MEM_SIZE as u64;
                let len = u64::from(input.u32() % (300 << 10));
                put64(payload, 8, addr);
                put64(payload, 16, len);
                if mode & 4 != 0 {
                    put64(payload, 24, addr);
                }
            }
            Opcode::RegMrSg => {
                // pdn, access, iova, length, nsegs, reserved, list_addr: a
                // short list somewhere in guest memory, whose entries are
                // whatever bytes are there.
                let list = MEM_BASE + u64::from(input.u32()) % MEM_SIZE as u64;
                put64(payload, 16, u64::from(input.u32() % (300 << 10)));
                put32(payload, 24, u32::from(input.u8() % 5));
                put64(payload, 32, list);
            }
            Opcode::CreateCq => {
                // depth, comp_vector, ring_addr.
                put32(payload, 0, 1 << (input.u8() % 8));
                put32(payload, 4, u32::from(input.u8() % 3));
                put64(payload, 8, ring(input));
            }
            Opcode::CreateQp => {
                if let Some(&c) = input.pick(&handles.cqs) {
                    put32(payload, 4, c);
                    put32(payload, 8, c);
                }
                put32(payload, 12, vrdma_spec::control::NO_SRQ);
                if let Some(last) = payload.len().checked_sub(16) {
                    let (sq, rq) = (ring(input), ring(input));
                    put64(payload, last, sq);
                    put64(payload, last + 8, rq);
                }
            }
            _ => {}
        }
    }
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
