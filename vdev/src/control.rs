//! The control queue: turns descriptor chains into verbs and back.
//!
//! Everything in a chain is hostile: the descriptors, their lengths, the
//! bytes they point at, and the fact that the guest may change those bytes
//! while we look. So the request is copied out of guest memory exactly once,
//! bounded by [`MAX_CONTROL_MSG`], and only the copy is decoded. A chain
//! that cannot be answered (no room for a response header, descriptors
//! outside guest memory) is returned with a used length of 0 — the queue
//! never stalls on a bad chain.

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use virtio_queue::{DescriptorChain, Reader, Writer};
use vm_memory::GuestMemoryMmap;
use vrdma_errors::error_chain;
use vrdma_spec::control::{Opcode, RequestHeader, ResponseHeader};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};
use vrdma_spec::MAX_CONTROL_MSG;

use crate::verbs::{RdmaDevice, VerbResult};

const REQ_HDR: usize = core::mem::size_of::<RequestHeader>();
const RESP_HDR: usize = core::mem::size_of::<ResponseHeader>();

/// A request that could not be executed, with the errno to answer.
struct Refusal {
    errno: i32,
    reason: String,
}

impl Refusal {
    fn new(errno: i32, reason: impl Into<String>) -> Self {
        Refusal {
            errno,
            reason: reason.into(),
        }
    }
}

/// How long a command that met a hostd handover waits for its context to
/// be registered with the new hostd before it fails after all.
const REGISTER_WAIT: Duration = Duration::from_secs(10);

/// What runs a control command: a device ([`RdmaDevice`]: tests and
/// fuzzing), or a served device behind its lock ([`Locked`]).
pub trait Executor {
    fn tenant(&self) -> String;
    /// Runs the command at avail `position` (`RdmaDevice::execute_at`).
    fn execute(&mut self, position: u16, opcode: Opcode, request: &[u8]) -> VerbResult<Vec<u8>>;
}

impl Executor for RdmaDevice {
    fn tenant(&self) -> String {
        RdmaDevice::tenant(self).to_owned()
    }

    fn execute(&mut self, position: u16, opcode: Opcode, request: &[u8]) -> VerbResult<Vec<u8>> {
        self.execute_at(position, opcode, request)
    }
}

/// A served device behind its lock. A command whose request to hostd met
/// a handover (hostd said it hands over, then went) lets go of the device,
/// waits until the main thread has registered the context with the new
/// hostd and given it the context back, and runs again there: the driver
/// sees a pause, not an error. Running it again is safe — a command that
/// fails at hostd leaves vdev's tables as they were, and what the previous
/// hostd did of it went with that hostd, unless it was handed over, which
/// the new hostd then answers as the state it has.
pub struct Locked<'d>(pub &'d Arc<Mutex<RdmaDevice>>);

impl Locked<'_> {
    fn device(&self) -> std::sync::MutexGuard<'_, RdmaDevice> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Executor for Locked<'_> {
    fn tenant(&self) -> String {
        self.device().tenant().to_owned()
    }

    fn execute(&mut self, position: u16, opcode: Opcode, request: &[u8]) -> VerbResult<Vec<u8>> {
        let (result, fabric) = {
            let mut device = self.device();
            let fabric = (device.fabric().cloned()).map(|f| {
                let generation = f.generation();
                (f, generation)
            });
            (device.execute_at(position, opcode, request), fabric)
        };
        match (result, fabric) {
            (Err(e), Some((fabric, generation))) if e.handed_over() => {
                tracing::info!(tenant = %self.tenant(), ?opcode,
                    "Control command met a hostd handover: it runs again on the new hostd");
                if fabric.wait_registered(generation, REGISTER_WAIT) {
                    self.device().execute_at(position, opcode, request)
                } else {
                    Err(e)
                }
            }
            (result, _) => result,
        }
    }
}

/// Processes one control chain, the one at avail `position` of the
/// queue, and returns the used length to report.
pub fn process_chain(
    device: &mut impl Executor,
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
    position: u16,
) -> u32 {
    let tenant = device.tenant();
    let head = chain.head_index();
    let (mut reader, mut writer) = match (Reader::new(mem, chain.clone()), Writer::new(mem, chain))
    {
        (Ok(r), Ok(w)) => (r, w),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(tenant, head, error = %e, "Control chain refused: descriptors outside guest memory or overflowing");
            return 0;
        }
    };
    if writer.available_bytes() < RESP_HDR {
        tracing::warn!(
            tenant,
            head,
            writable = writer.available_bytes(),
            "Control chain refused: no room for a response header"
        );
        return 0;
    }
    let (status, payload) = match read_request(&mut reader, writer.available_bytes()) {
        Ok((opcode, request)) => match device.execute(position, opcode, &request) {
            Ok(payload) => {
                tracing::debug!(tenant, ?opcode, "Control command done");
                (0, payload)
            }
            Err(e) => {
                tracing::info!(tenant, ?opcode, errno = e.errno(), error = %error_chain(&e),
                    "Control command failed");
                (e.errno(), Vec::new())
            }
        },
        Err(refusal) => {
            tracing::warn!(tenant, head, errno = refusal.errno, reason = %refusal.reason,
                "Malformed control command");
            (refusal.errno, Vec::new())
        }
    };
    let header = ResponseHeader {
        status: (status as u32).into(),
        payload_len: (payload.len() as u32).into(),
    };
    // The room was checked before executing, so these writes only fail if
    // the guest memory map changed under us; then report what was written.
    let written = writer
        .write_all(header.as_bytes())
        .and_then(|()| writer.write_all(&payload));
    if let Err(e) = written {
        tracing::warn!(tenant, head, error = %e, "Control response not fully written");
    }
    writer.bytes_written() as u32
}

/// Copies the request out of the chain once and checks its framing. The
/// response must fit in `writable` bytes, checked before anything executes
/// so that a command never takes effect without its answer.
fn read_request(reader: &mut Reader<'_>, writable: usize) -> Result<(Opcode, Vec<u8>), Refusal> {
    let len = reader.available_bytes();
    if len > MAX_CONTROL_MSG {
        return Err(Refusal::new(
            libc::EMSGSIZE,
            format!("request of {len} bytes exceeds {MAX_CONTROL_MSG}"),
        ));
    }
    if len < REQ_HDR {
        return Err(Refusal::new(
            libc::EINVAL,
            format!("request of {len} bytes has no header"),
        ));
    }
    let mut bytes = vec![0u8; len];
    reader
        .read_exact(&mut bytes)
        .map_err(|e| Refusal::new(libc::EFAULT, format!("request unreadable: {e}")))?;
    let (header, payload) = RequestHeader::read_from_prefix(&bytes)
        .map_err(|_| Refusal::new(libc::EINVAL, "request header unreadable"))?;
    let opcode = Opcode::try_from(header.opcode.get())
        .map_err(|code| Refusal::new(libc::EOPNOTSUPP, format!("unknown command code {code}")))?;
    if header.flags.get() != 0 {
        return Err(Refusal::new(
            libc::EINVAL,
            format!("{opcode:?}: flags {:#x} must be 0", header.flags),
        ));
    }
    if header.payload_len.get() as usize != payload.len() || payload.len() != opcode.request_len() {
        return Err(Refusal::new(
            libc::EINVAL,
            format!(
                "{opcode:?}: payload_len {} with {} bytes present, command takes {}",
                header.payload_len,
                payload.len(),
                opcode.request_len()
            ),
        ));
    }
    let need = RESP_HDR + opcode.response_len();
    if writable < need {
        return Err(Refusal::new(
            libc::EINVAL,
            format!("{opcode:?}: response room {writable} < {need} bytes"),
        ));
    }
    Ok((opcode, payload.to_vec()))
}
