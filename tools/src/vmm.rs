//! Playing the VMM: memfd guest memory, the vhost-user frontend handshake,
//! and a split virtqueue whose descriptors the test writes by hand, so it can
//! write hostile ones too.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;
use vrdma_spec::config::{DeviceConfig, CONFIG_SIZE};
use vrdma_spec::control::{
    CreateCqReq, CreateEqReq, CreateQpReq, ModifyQpReq, MrHandle, MrSgSegment, Opcode, PdHandle,
    QpAttr, QpCap, QpHandle, QueryQpReq, RegMrReq, RequestHeader, ResponseHeader, SetDoorbellReq,
    NO_SRQ,
};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};

/// `VIRTIO_F_VERSION_1`.
pub const F_VERSION_1: u64 = 1 << 32;
/// `VHOST_USER_F_PROTOCOL_FEATURES`.
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;

/// A memfd of `size` bytes mapped as guest memory at `gpa`, sealed against
/// resizing as QEMU's `memory-backend-memfd` seals it (hostd maps only
/// sealed memory).
pub fn memfd_memory(name: &str, gpa: u64, size: usize) -> GuestMemoryMmap {
    let cname = std::ffi::CString::new(name).expect("no NUL");
    // SAFETY: memfd_create takes a valid NUL-terminated name and flags; it
    // returns a new fd or -1, checked below.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size as u64).expect("size memfd");
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on a descriptor we own; the result is checked.
    let rc = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            libc::F_ADD_SEALS,
            seals,
        )
    };
    assert_eq!(rc, 0, "seal memfd: {}", std::io::Error::last_os_error());
    GuestMemoryMmap::from_ranges_with_files(&[(
        GuestAddress(gpa),
        size,
        Some(FileOffset::new(file, 0)),
    )])
    .expect("map guest memory")
}

/// The vhost-user description of every region of `mem`: guest-physical
/// address, size, the VMM's mapping of it, and its fd.
pub fn region_infos(mem: &GuestMemoryMmap) -> Vec<VhostUserMemoryRegionInfo> {
    mem.iter()
        .map(|r| VhostUserMemoryRegionInfo::from_guest_region(r).expect("file backed region"))
        .collect()
}

/// Connects to a vhost-user socket, retrying while the backend comes up.
pub fn connect(socket: &Path, max_queues: u64) -> Frontend {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Frontend::connect(socket, max_queues) {
            Ok(frontend) => return frontend,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("cannot connect to {}: {e}", socket.display()),
        }
    }
}

/// Size of every queue the VMM sets up.
pub const QUEUE_SIZE: u16 = 64;

/// A split virtqueue laid out by the VMM-side test in guest memory.
#[derive(Debug)]
pub struct RawQueue {
    pub index: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub kick: EventFd,
    pub call: EventFd,
    next_avail: u16,
    last_used: u16,
}

/// A descriptor exactly as the test wants it in the table.
#[derive(Debug, Clone, Copy)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
    /// Index of the next descriptor, or `None` to end the chain.
    pub next: Option<u16>,
}

impl Desc {
    /// A device-readable descriptor (request bytes), chained to `next`.
    pub fn read(addr: u64, len: u32, next: Option<u16>) -> Desc {
        Desc {
            addr,
            len,
            write: false,
            next,
        }
    }

    /// A device-writable descriptor (room for the response) ending the
    /// chain.
    pub fn write(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            write: true,
            next: None,
        }
    }

    /// A command's chain as the control queue expects it, written at slot
    /// 0: the request (`len` bytes at `addr`), then `room` bytes for the
    /// response at `response`.
    pub fn command(addr: u64, len: u32, response: u64, room: u32) -> Vec<Desc> {
        vec![Desc::read(addr, len, Some(1)), Desc::write(response, room)]
    }
}

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

impl RawQueue {
    /// Lays out queue `index` at `base` (4 KiB for descriptors, then avail,
    /// then used) and tells the backend about it.
    pub fn setup(frontend: &mut Frontend, mem: &GuestMemoryMmap, index: u16, base: u64) -> Self {
        let (desc, avail, used) = (base, base + 0x1000, base + 0x2000);
        mem.write_slice(&[0u8; 0x3000], GuestAddress(base))
            .expect("clear ring");
        let host = |gpa: u64| mem.get_host_address(GuestAddress(gpa)).expect("in memory") as u64;
        let idx = usize::from(index);
        frontend
            .set_vring_num(idx, QUEUE_SIZE)
            .expect("set_vring_num");
        let config = VringConfigData {
            queue_max_size: QUEUE_SIZE,
            queue_size: QUEUE_SIZE,
            flags: 0,
            desc_table_addr: host(desc),
            used_ring_addr: host(used),
            avail_ring_addr: host(avail),
            log_addr: None,
        };
        frontend
            .set_vring_addr(idx, &config)
            .expect("set_vring_addr");
        frontend.set_vring_base(idx, 0).expect("set_vring_base");
        let kick = EventFd::new(libc::EFD_NONBLOCK).expect("kick eventfd");
        let call = EventFd::new(libc::EFD_NONBLOCK).expect("call eventfd");
        frontend.set_vring_call(idx, &call).expect("set_vring_call");
        frontend.set_vring_kick(idx, &kick).expect("set_vring_kick");
        frontend
            .set_vring_enable(idx, true)
            .expect("set_vring_enable");
        RawQueue {
            index,
            desc,
            avail,
            used,
            kick,
            call,
            next_avail: 0,
            last_used: 0,
        }
    }

    /// Writes `descs` at table slots `first..`, makes `first` available and kicks.
    pub fn submit(&mut self, mem: &GuestMemoryMmap, first: u16, descs: &[Desc]) {
        for (i, d) in descs.iter().enumerate() {
            let slot = self.desc + 16 * u64::from(first + i as u16);
            let mut flags = if d.write { F_WRITE } else { 0 };
            if d.next.is_some() {
                flags |= F_NEXT;
            }
            mem.write_obj(d.addr, GuestAddress(slot))
                .expect("desc addr");
            mem.write_obj(d.len, GuestAddress(slot + 8))
                .expect("desc len");
            mem.write_obj(flags, GuestAddress(slot + 12))
                .expect("desc flags");
            mem.write_obj(d.next.unwrap_or(0), GuestAddress(slot + 14))
                .expect("desc next");
        }
        let ring_slot = self.avail + 4 + 2 * u64::from(self.next_avail % QUEUE_SIZE);
        mem.write_obj(first, GuestAddress(ring_slot))
            .expect("avail ring");
        self.next_avail = self.next_avail.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        mem.write_obj(self.next_avail, GuestAddress(self.avail + 2))
            .expect("avail idx");
        self.kick.write(1).expect("kick");
    }

    /// Waits for the next used entry: (head, used length).
    pub fn wait_used(&mut self, mem: &GuestMemoryMmap) -> (u16, u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let used_idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).expect("used idx");
            if used_idx != self.last_used {
                let slot = self.used + 4 + 8 * u64::from(self.last_used % QUEUE_SIZE);
                let head: u32 = mem.read_obj(GuestAddress(slot)).expect("used id");
                let len: u32 = mem.read_obj(GuestAddress(slot + 4)).expect("used len");
                self.last_used = self.last_used.wrapping_add(1);
                let _ = self.call.read();
                return (head as u16, len);
            }
            assert!(
                Instant::now() < deadline,
                "no used entry on queue {} within 10 s",
                self.index
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// A VMM attached to one vdev: guest memory, the frontend, the control queue.
pub struct Vmm {
    pub frontend: Frontend,
    pub mem: GuestMemoryMmap,
    pub control: RawQueue,
    pub config: DeviceConfig,
}

/// Guest memory layout of a [`Vmm`].
pub const GUEST_BASE: u64 = 0x10_0000;
pub const GUEST_SIZE: usize = 16 << 20;
/// Where the control queue's rings live.
pub const CONTROL_RING: u64 = GUEST_BASE;
/// Scratch area for requests and responses.
pub const SCRATCH: u64 = GUEST_BASE + 0x10000;
/// Free guest memory for the test's own objects (rings, buffers).
pub const FREE: u64 = GUEST_BASE + 0x100000;

impl Vmm {
    /// Attaches to the vdev at `socket` the way a VMM does.
    pub fn attach(socket: &Path) -> Self {
        Self::attach_with_memory(socket, GUEST_SIZE)
    }

    /// Like [`Vmm::attach`], with `size` bytes of guest memory (a sparse
    /// memfd: only touched pages cost memory).
    pub fn attach_with_memory(socket: &Path, size: usize) -> Self {
        let mut frontend = connect(socket, 8);
        // Every message waits for the backend's ack (REPLY_ACK), so a memory
        // table change is in force before the next control command.
        frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        frontend.set_owner().expect("set_owner");
        let features = frontend.get_features().expect("get_features");
        assert!(features & F_VERSION_1 != 0, "VERSION_1 offered");
        frontend
            .set_features(F_VERSION_1 | F_PROTOCOL_FEATURES)
            .expect("set_features");
        let proto = frontend
            .get_protocol_features()
            .expect("get_protocol_features");
        let wanted = VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS;
        assert!(proto.contains(wanted), "protocol features {proto:?}");
        // Like QEMU, take RESET_DEVICE when offered, to pass guest resets on.
        let acked = wanted | (proto & VhostUserProtocolFeatures::RESET_DEVICE);
        frontend
            .set_protocol_features(acked)
            .expect("set_protocol_features");
        let buf = [0u8; CONFIG_SIZE];
        let (_, bytes) = frontend
            .get_config(0, CONFIG_SIZE as u32, VhostUserConfigFlags::empty(), &buf)
            .expect("get_config");
        let config = DeviceConfig::read_from_bytes(&bytes).expect("config size");
        let mem = memfd_memory("vmm-guest", GUEST_BASE, size);
        frontend
            .set_mem_table(&region_infos(&mem))
            .expect("set_mem_table");
        let control = RawQueue::setup(&mut frontend, &mem, vrdma_spec::CONTROL_QUEUE, CONTROL_RING);
        Vmm {
            frontend,
            mem,
            control,
            config,
        }
    }

    /// After a device reset, a fresh driver brings the device up again, as
    /// QEMU replays it: the features, then the control queue from index 0.
    pub fn bring_up_again(&mut self) {
        self.frontend
            .set_features(F_VERSION_1 | F_PROTOCOL_FEATURES)
            .expect("set_features");
        self.control = RawQueue::setup(
            &mut self.frontend,
            &self.mem,
            vrdma_spec::CONTROL_QUEUE,
            CONTROL_RING,
        );
    }

    /// Lays out virtqueue `index` at `base` ([`RawQueue::setup`]).
    pub fn queue(&mut self, index: u16, base: u64) -> RawQueue {
        RawQueue::setup(&mut self.frontend, &self.mem, index, base)
    }

    /// Sends a well-formed command and returns (status, response payload).
    pub fn command(&mut self, opcode: Opcode, payload: &[u8]) -> (u32, Vec<u8>) {
        let header = RequestHeader {
            opcode: u16::from(opcode).into(),
            flags: 0.into(),
            payload_len: (payload.len() as u32).into(),
        };
        let mut request = header.as_bytes().to_vec();
        request.extend_from_slice(payload);
        self.raw_command(&request, 512)
    }

    /// Sends arbitrary request bytes with `room` writable bytes for the
    /// answer; returns (status, response payload).
    pub fn raw_command(&mut self, request: &[u8], room: u32) -> (u32, Vec<u8>) {
        let (req_addr, resp_addr) = (SCRATCH, SCRATCH + 0x8000);
        self.mem
            .write_slice(request, GuestAddress(req_addr))
            .expect("request");
        self.mem
            .write_slice(&vec![0xeeu8; room as usize], GuestAddress(resp_addr))
            .expect("poison");
        let descs = Desc::command(req_addr, request.len() as u32, resp_addr, room);
        let used_len = self.submit_chain(&descs);
        assert!(
            used_len as usize >= core::mem::size_of::<ResponseHeader>(),
            "no response header (used {used_len})"
        );
        let mut bytes = vec![0u8; used_len as usize];
        self.mem
            .read_slice(&mut bytes, GuestAddress(resp_addr))
            .expect("response");
        let (header, rest) =
            ResponseHeader::split(&bytes).expect("payload_len matches used length");
        (header.status.get(), rest.to_vec())
    }

    /// Submits a chain written as-is at descriptor slot 0 and returns the
    /// used length the device reported for it.
    pub fn submit_chain(&mut self, descs: &[Desc]) -> u32 {
        self.control.submit(&self.mem, 0, descs);
        let (head, len) = self.control.wait_used(&self.mem);
        assert_eq!(head, 0, "used head");
        len
    }

    /// Sends a command that must succeed and decodes its response.
    pub fn ok<T: FromBytes>(&mut self, opcode: Opcode, payload: &[u8]) -> T {
        let (status, bytes) = self.command(opcode, payload);
        assert_eq!(status, 0, "{opcode:?} failed with errno {status}");
        T::read_from_bytes(&bytes).expect("response size")
    }

    /// Sends a command and returns its errno (0 on success).
    pub fn errno(&mut self, opcode: Opcode, payload: &[u8]) -> u32 {
        self.command(opcode, payload).0
    }
}

// Command builders for the tests' own objects.

/// ALLOC_PD, which must succeed: the new PD's number.
pub fn alloc_pd(vmm: &mut Vmm) -> u32 {
    vmm.ok::<PdHandle>(Opcode::AllocPd, &[]).pdn.get()
}

/// A PD handle (DEALLOC_PD).
pub fn pd(pdn: u32) -> PdHandle {
    PdHandle {
        pdn: pdn.into(),
        reserved: 0.into(),
    }
}

/// An MR handle (DEREG_MR).
pub fn mr(handle: u32) -> MrHandle {
    MrHandle {
        handle: handle.into(),
        reserved: 0.into(),
    }
}

/// A QP handle (DESTROY_QP).
pub fn qp(qpn: u32) -> QpHandle {
    QpHandle {
        qpn: qpn.into(),
        reserved: 0.into(),
    }
}

/// QUERY_QP of every attribute.
pub fn query_qp(qpn: u32) -> QueryQpReq {
    QueryQpReq {
        qpn: qpn.into(),
        attr_mask: 0.into(),
    }
}

/// SET_DOORBELL: the doorbell page at `addr`.
pub fn doorbell_req(addr: u64) -> SetDoorbellReq {
    SetDoorbellReq { addr: addr.into() }
}

/// CREATE_EQ: completion vector `vector`'s event ring of `depth` events
/// at `addr`.
pub fn eq_req(vector: u32, depth: u32, addr: u64) -> CreateEqReq {
    CreateEqReq {
        vector: vector.into(),
        depth: depth.into(),
        ring_addr: addr.into(),
    }
}

/// MODIFY_QP of QP `qpn`: the attributes of `attr` that `attr_mask` names.
pub fn modify_req(qpn: u32, attr_mask: u32, attr: QpAttr) -> ModifyQpReq {
    ModifyQpReq {
        qpn: qpn.into(),
        attr_mask: attr_mask.into(),
        attr,
    }
}

/// A REG_MR_SG segment list: the `(guest address, length)` pieces in
/// order, as written to guest memory.
pub fn sg_list(segments: &[(u64, u64)]) -> Vec<MrSgSegment> {
    segments
        .iter()
        .map(|&(addr, len)| MrSgSegment {
            addr: addr.into(),
            len: len.into(),
        })
        .collect()
}

/// REG_MR of `len` bytes at guest address `addr`, iova = addr.
pub fn reg(pdn: u32, addr: u64, len: u64, flags: u32) -> RegMrReq {
    RegMrReq {
        pdn: pdn.into(),
        access: flags.into(),
        addr: addr.into(),
        length: len.into(),
        iova: addr.into(),
    }
}

/// CREATE_CQ with its ring at `addr`, vector 0.
pub fn cq_req(addr: u64, depth: u32) -> CreateCqReq {
    CreateCqReq {
        depth: depth.into(),
        comp_vector: 0.into(),
        ring_addr: addr.into(),
    }
}

/// CREATE_QP (RC, 16 WRs and 1 SGE each way, 32 inline bytes) with its
/// rings at `sq` and `rq`.
pub fn qp_req(pdn: u32, cqn: u32, sq: u64, rq: u64) -> CreateQpReq {
    CreateQpReq {
        pdn: pdn.into(),
        send_cqn: cqn.into(),
        recv_cqn: cqn.into(),
        srqn: NO_SRQ.into(),
        qp_type: 2,
        cap: QpCap {
            max_send_wr: 16.into(),
            max_recv_wr: 16.into(),
            max_send_sge: 1.into(),
            max_recv_sge: 1.into(),
            max_inline_data: 32.into(),
        },
        sq_ring_addr: sq.into(),
        rq_ring_addr: rq.into(),
        ..CreateQpReq::default()
    }
}
