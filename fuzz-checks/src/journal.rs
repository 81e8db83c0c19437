//! A context's journal as a successor vdev decodes it
//! (`RdmaDevice::rebuild_from`): the records hostd kept of a dead vdev's
//! context, which that vdev wrote — and which a compromised one may have
//! written to hurt its successor.
//!
//! The input edits a valid journal (a doorbell page, an event ring, two
//! PDs, a CQ, a memory slot with an MR in it, an SRQ, an RC QP and an AH,
//! the handle counter and the last command's answer): records dropped,
//! duplicated, renumbered or given another kind, their JSON bytes flipped,
//! cut, spliced with input bytes or replaced by them. Invariants: no
//! panic; a refused journal leaves the device as it was (no object, no
//! doorbell, no event ring, nothing counted in the quotas); an accepted one
//! is consistent — every object the records name can be destroyed through
//! the ordinary commands in dependency order (QPs and AHs, then MRs and
//! SRQs, then CQs, then PDs: each destroy succeeds, so every count of
//! users was right), after which the device is empty and its quota usage
//! zero.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, OnceLock};

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap};
use vrdma_hostd_protocol::messages::Record;
use vrdma_spec::control::{AhAttr, Opcode, QpAttr, QpCap};
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_tenant_policy::Limits;
use vrdma_vdev::verbs::{record_kind as kind, DeviceIdentity, RdmaDevice};

use crate::input::Input;

const MEM_BASE: u64 = 0x10_0000;
const MEM_SIZE: usize = 4 << 20;
/// Most edits per input.
const MAX_EDITS: usize = 32;

/// The guest memory every device of the check runs on: one memfd (a
/// memory slot with a file identity, as vhost-user gives).
fn memory() -> &'static (Arc<GuestMemoryMmap>, (u64, u64)) {
    static MEMORY: OnceLock<(Arc<GuestMemoryMmap>, (u64, u64))> = OnceLock::new();
    MEMORY.get_or_init(|| {
        // SAFETY: memfd_create with a valid C string; the fd it returns is
        // owned by the OwnedFd alone.
        let fd = unsafe { libc::memfd_create(c"journal-check".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create");
        // SAFETY: `fd` was just returned by memfd_create and nothing else
        // owns it.
        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(MEM_SIZE as u64).expect("memfd size");
        let meta = file.metadata().expect("memfd metadata");
        let region = GuestRegionMmap::from_range(
            GuestAddress(MEM_BASE),
            MEM_SIZE,
            Some(FileOffset::new(file, 0)),
        )
        .expect("mmap");
        let mem = GuestMemoryMmap::from_regions(vec![region]).expect("memory");
        (Arc::new(mem), (meta.dev(), meta.ino()))
    })
}

fn identity() -> DeviceIdentity {
    DeviceIdentity {
        tenant: Arc::from("journal"),
        lid: 7,
        link_layer: Default::default(),
        gid: vrdma_spec::gid::loopback_gid(7),
        comp_vectors: 2,
        max_queue_size: 256,
        active_mtu: vrdma_spec::verbs::Mtu::Mtu4096,
    }
}

/// A device over the check's memory, with nothing in it: the successor.
fn fresh() -> RdmaDevice {
    let mut dev = RdmaDevice::new(identity(), Limits::default());
    dev.update_memory(memory().0.clone());
    dev
}

fn record(kind: u8, id: u32, data: String) -> Record {
    Record {
        kind,
        id,
        data: Some(data),
    }
}

/// A valid journal of a context with one object of every kind.
pub fn template() -> Vec<Record> {
    let (dev, ino) = memory().1;
    let at = |offset: u64| MEM_BASE + offset;
    let bytes = |b: &[u8]| format!("{b:?}").replace(' ', "");
    let cap = bytes(QpCap::default().as_bytes());
    let attr = bytes(QpAttr::default().as_bytes());
    let ah = bytes(AhAttr::default().as_bytes());
    vec![
        record(
            kind::DOORBELL,
            0,
            format!(r#"{{"addr":{},"depth":0}}"#, at(0)),
        ),
        record(
            kind::EQ,
            0,
            format!(r#"{{"addr":{},"depth":64}}"#, at(0x1000)),
        ),
        record(kind::PD, 1, "{}".into()),
        record(kind::PD, 2, "{}".into()),
        record(
            kind::CQ,
            3,
            format!(
                r#"{{"depth":16,"comp_vector":1,"ring_addr":{}}}"#,
                at(0x2000)
            ),
        ),
        record(
            kind::SLOT,
            0,
            format!(r#"{{"gpa":{MEM_BASE},"len":{MEM_SIZE},"dev":{dev},"ino":{ino},"offset":0}}"#),
        ),
        record(
            kind::MR,
            4,
            format!(
                r#"{{"pdn":1,"lkey":256,"rkey":512,"iova":{0},"len":8192,"access":7,"segments":[[0,{0},8192]],"revoked":false}}"#,
                at(0x10_0000)
            ),
        ),
        record(
            kind::SRQ,
            5,
            format!(
                r#"{{"pdn":1,"ring":[{},16,64],"max_wr":16,"max_sge":2,"limit":0}}"#,
                at(0x4000)
            ),
        ),
        record(
            kind::QP,
            0x1234,
            format!(
                r#"{{"qp_type":2,"pdn":1,"send_cqn":3,"recv_cqn":3,"sq_sig_all":false,"cap":{cap},"sq":[{},16,64],"rq":[{},16,64],"db_index":0,"srqn":5,"state":1,"attr":{attr}}}"#,
                at(0x8000),
                at(0xc000)
            ),
        ),
        record(kind::AH, 6, format!(r#"{{"pdn":2,"attr":{ah}}}"#)),
        record(kind::HANDLES, 0, r#"{"next":7}"#.into()),
        record(
            kind::DONE,
            0,
            r#"{"position":9,"opcode":3,"request":[],"errno":0,"payload":[1,0,0,0,0,0,0,0]}"#
                .into(),
        ),
    ]
}

/// Applies the input's edits to `records`.
fn edit(input: &mut Input, records: &mut Vec<Record>) {
    for _ in 0..MAX_EDITS {
        if input.is_empty() {
            return;
        }
        let op = input.u8() % 10;
        let n = records.len();
        if n == 0 && op != 9 {
            continue;
        }
        let i = usize::from(input.u8()) % n.max(1);
        match op {
            0 => {
                records.remove(i);
            }
            1 => {
                let copy = records[i].clone();
                records.push(copy);
            }
            2 => records[i].kind = input.u8() % 13,
            3 => {
                records[i].id = if input.bool() {
                    u32::from(input.u8() % 8)
                } else {
                    input.u32()
                }
            }
            4..=7 => {
                let Some(data) = records[i].data.take() else {
                    continue;
                };
                let mut bytes = data.into_bytes();
                let at = usize::from(input.u16()) % bytes.len().max(1);
                match op {
                    4 => {
                        if let Some(b) = bytes.get_mut(at) {
                            *b ^= input.u8().max(1);
                        }
                    }
                    5 => bytes.truncate(at),
                    6 => {
                        let len = usize::from(input.u8() % 16);
                        let splice = input.bytes(len).to_vec();
                        let at = at.min(bytes.len());
                        bytes.splice(at..at, splice);
                    }
                    // A digit changed into another: numbers stay JSON.
                    _ => {
                        if let Some(b) = bytes.get_mut(at).filter(|b| b.is_ascii_digit()) {
                            *b = b'0' + input.u8() % 10;
                        }
                    }
                }
                records[i].data = Some(String::from_utf8_lossy(&bytes).into_owned());
            }
            8 => records[i].data = None,
            _ => {
                let len = usize::from(input.u8() % 64);
                let data = String::from_utf8_lossy(input.bytes(len)).into_owned();
                records.push(Record {
                    kind: input.u8() % 13,
                    id: u32::from(input.u8()),
                    data: Some(data),
                });
            }
        }
    }
}

/// Destroys `id` of `kind` through the ordinary command.
fn destroy(dev: &mut RdmaDevice, kind: u8, id: u32) -> Result<(), i32> {
    let opcode = match kind {
        kind::QP => Opcode::DestroyQp,
        kind::AH => Opcode::DestroyAh,
        kind::MR => Opcode::DeregMr,
        kind::SRQ => Opcode::DestroySrq,
        kind::CQ => Opcode::DestroyCq,
        kind::PD => Opcode::DeallocPd,
        _ => return Ok(()),
    };
    let mut request = Vec::new();
    let _ = request.write_all(&id.to_le_bytes());
    let _ = request.write_all(&0u32.to_le_bytes());
    dev.execute(opcode, &request)
        .map(drop)
        .map_err(|e| e.errno())
}

/// Edits the template journal as `data` says and rebuilds a fresh device
/// from it; see the module's invariants.
pub fn check(data: &[u8]) {
    let mut records = template();
    edit(&mut Input::new(data), &mut records);
    let mut dev = fresh();
    let result = dev.rebuild_from(&records);
    let Ok(()) = result else {
        assert_eq!(dev.object_counts(), (0, 0, 0, 0), "half restored");
        assert_eq!(dev.doorbell(), None, "half restored");
        assert!(dev.event_ring(0).is_none() && dev.event_ring(1).is_none());
        assert_eq!(dev.usage(), Default::default(), "counted while refused");
        return;
    };
    let objects: Vec<(u8, u32)> = dev
        .journal_records()
        .into_iter()
        .map(|r| (r.kind, r.id))
        .collect();
    for stage in [
        [kind::QP, kind::AH],
        [kind::MR, kind::SRQ],
        [kind::CQ, kind::CQ],
        [kind::PD, kind::PD],
    ] {
        for &(kind, id) in objects.iter().filter(|(k, _)| stage.contains(k)) {
            if let Err(errno) = destroy(&mut dev, kind, id) {
                panic!("destroying {kind}/{id} of an accepted journal: errno {errno}\n{records:?}");
            }
        }
    }
    assert_eq!(dev.object_counts(), (0, 0, 0, 0));
    assert_eq!(
        dev.usage(),
        Default::default(),
        "quota usage left after every object went\n{records:?}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_is_a_whole_context() {
        let mut dev = fresh();
        dev.rebuild_from(&template())
            .expect("the template rebuilds");
        assert_eq!(dev.object_counts(), (2, 1, 1, 1));
        assert!(dev.doorbell().is_some());
        check(&[]);
    }
}
