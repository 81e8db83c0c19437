//! The WQE reader: the only code in hostd that decodes work requests the
//! guest wrote.
//!
//! A WQE is read once from its ring slot — the fixed part, then exactly the
//! SGEs or inline bytes it says it has — into hostd's own [`SendWork`] or
//! [`RecvWork`], and everything after works on that copy, so a guest that
//! rewrites the slot meanwhile changes nothing. Every field is checked here
//! against the QP's granted capacities and the format's limits: what leaves
//! this module is a well-formed work request whose only unchecked parts
//! are its keys and addresses (the key table checks those when the work
//! executes, [`super::keys`]). A malformed WQE is not an error of hostd's:
//! it completes with the status an RDMA device gives it ([`Malformed`]).
//!
//! The reader takes its bytes from an [`EntrySource`] — a guest ring, or a
//! plain byte slice in the fuzz target — and never panics, whatever the
//! bytes.

use vrdma_spec::limits::{MAX_INLINE_DATA, MAX_MSG_SIZE, MAX_SGE};
use vrdma_spec::ring::{send_flags, RecvWqe, SendWqe, Sge, SGE_SIZE};
use vrdma_spec::verbs::{SendOpcode, WcOpcode, WcStatus};
use zerocopy::{FromBytes, IntoBytes};

use super::guest::GuestRing;

/// Bytes of a WQE's payload area: its SGEs or its inline data.
pub const PAYLOAD_BYTES: usize = 1024;
const _: () = assert!(PAYLOAD_BYTES >= MAX_SGE as usize * SGE_SIZE);
const _: () = assert!(PAYLOAD_BYTES >= MAX_INLINE_DATA as usize);

const SEND_FIXED: usize = core::mem::size_of::<SendWqe>();
const RECV_FIXED: usize = core::mem::size_of::<RecvWqe>();

/// Where a WQE's bytes come from: entry `index` of a ring of `stride`-byte
/// entries.
pub trait EntrySource {
    /// Bytes of one entry.
    fn stride(&self) -> u32;
    /// Copies `[at, at + out.len())` of entry `index`; false if outside it.
    fn read(&self, index: u32, at: usize, out: &mut [u8]) -> bool;
}

impl EntrySource for GuestRing {
    fn stride(&self) -> u32 {
        GuestRing::stride(self)
    }

    fn read(&self, index: u32, at: usize, out: &mut [u8]) -> bool {
        self.read_entry(index, at, out)
    }
}

/// One entry held in memory (the fuzz target's ring of one slot).
impl EntrySource for [u8] {
    fn stride(&self) -> u32 {
        u32::try_from(self.len()).unwrap_or(u32::MAX)
    }

    fn read(&self, _index: u32, at: usize, out: &mut [u8]) -> bool {
        match at.checked_add(out.len()).and_then(|end| self.get(at..end)) {
            Some(bytes) => {
                out.copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }
}

/// What a send WQE may carry on its QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendLimits {
    pub max_sge: u32,
    pub max_inline: u32,
    /// The QP signals every WQE (`sq_sig_all`).
    pub sig_all: bool,
}

/// What a receive WQE may carry on its QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvLimits {
    pub max_sge: u32,
}

/// A WQE that cannot run, and the completion it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformed {
    /// The entry was read but is not a valid work request.
    Entry {
        wr_id: u64,
        /// The completion's opcode (a [`WcOpcode`]).
        opcode: u8,
        status: WcStatus,
    },
    /// The entry could not be read at all: the ring itself is unusable.
    Unreadable,
}

/// The local side of a send WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Local {
    /// This many SGEs in the payload.
    #[default]
    None,
    Sges(u8),
    /// This many inline bytes in the payload.
    Inline(u16),
}

/// A WQE's SGEs or inline bytes as read (`Debug` leaves them out).
#[derive(Clone)]
struct Payload([u8; PAYLOAD_BYTES]);

impl Default for Payload {
    fn default() -> Self {
        Payload([0; PAYLOAD_BYTES])
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("..")
    }
}

/// A send WQE, read once and checked: hostd's own copy.
#[derive(Clone, Debug)]
pub struct SendWork {
    pub wr_id: u64,
    pub opcode: SendOpcode,
    /// [`send_flags`] it had, SIGNALED added when the QP signals all.
    pub flags: u8,
    pub imm_data: [u8; 4],
    pub remote_addr: u64,
    pub rkey: u32,
    pub compare_add: u64,
    pub swap: u64,
    pub local: Local,
    /// Bytes the message carries (SGE lengths or inline bytes; 8 for atomics).
    pub length: u64,
    payload: Payload,
}

impl Default for SendWork {
    fn default() -> Self {
        SendWork {
            wr_id: 0,
            opcode: SendOpcode::Send,
            flags: 0,
            imm_data: [0; 4],
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            local: Local::None,
            length: 0,
            payload: Payload::default(),
        }
    }
}

impl SendWork {
    /// Its SGEs (none when inline).
    pub fn sges(&self) -> &[Sge] {
        let n = match self.local {
            Local::Sges(n) => usize::from(n),
            _ => 0,
        };
        sges_of(&self.payload.0, n)
    }

    /// Its inline bytes (none when it has SGEs).
    pub fn inline(&self) -> &[u8] {
        match self.local {
            Local::Inline(n) => &self.payload.0[..usize::from(n).min(PAYLOAD_BYTES)],
            _ => &[],
        }
    }

    /// Whether it completes with a CQE when it succeeds.
    pub fn signaled(&self) -> bool {
        self.flags & send_flags::SIGNALED != 0
    }

    /// The opcode of its completion.
    pub fn wc_opcode(&self) -> WcOpcode {
        self.opcode.completion_opcode()
    }
}

/// A receive WQE, read once and checked.
#[derive(Clone, Debug, Default)]
pub struct RecvWork {
    pub wr_id: u64,
    num_sge: u8,
    /// Bytes its buffers hold.
    pub length: u64,
    payload: Payload,
}

impl RecvWork {
    /// Its SGEs.
    pub fn sges(&self) -> &[Sge] {
        sges_of(&self.payload.0, usize::from(self.num_sge))
    }

    /// A receive with `sges` (address, length, lkey), checked as one read
    /// from a ring is (at most `max_sge` SGEs, a valid total length); the
    /// keys are checked when it is filled, as always. For a receive a
    /// previous hostd took off an SRQ and handed over.
    pub fn with_sges(wr_id: u64, sges: &[(u64, u32, u32)], max_sge: u32) -> Option<RecvWork> {
        let n = sges.len();
        if n > max_sge.min(MAX_SGE) as usize {
            return None;
        }
        let mut work = RecvWork {
            wr_id,
            num_sge: u8::try_from(n).ok()?,
            ..RecvWork::default()
        };
        for (slot, &(addr, length, lkey)) in (work.payload.0.chunks_exact_mut(SGE_SIZE)).zip(sges) {
            let sge = Sge {
                addr: addr.into(),
                length: length.into(),
                lkey: lkey.into(),
            };
            slot.copy_from_slice(sge.as_bytes());
        }
        work.length = total_length(work.sges())?;
        Some(work)
    }
}

fn sges_of(payload: &[u8; PAYLOAD_BYTES], n: usize) -> &[Sge] {
    payload
        .get(..n * SGE_SIZE)
        .and_then(|bytes| <[Sge]>::ref_from_bytes(bytes).ok())
        .unwrap_or(&[])
}

/// Sum of the SGE lengths, if it is a valid message length.
fn total_length(sges: &[Sge]) -> Option<u64> {
    let total: u64 = sges.iter().map(|s| u64::from(s.length.get())).sum();
    (total <= u64::from(MAX_MSG_SIZE)).then_some(total)
}

/// The fixed part of WQE `index` of `src`, copied out once.
fn read_fixed<W, S>(src: &S, index: u32) -> Result<W, Malformed>
where
    W: FromBytes + IntoBytes,
    S: EntrySource + ?Sized,
{
    let mut wqe = W::new_zeroed();
    if src.read(index, 0, wqe.as_mut_bytes()) {
        Ok(wqe)
    } else {
        Err(Malformed::Unreadable)
    }
}

/// Reads send WQE `index` of `src` into `out`.
pub fn read_send<S: EntrySource + ?Sized>(
    src: &S,
    index: u32,
    limits: &SendLimits,
    out: &mut SendWork,
) -> Result<(), Malformed> {
    let wqe: SendWqe = read_fixed(src, index)?;
    let wr_id = wqe.wr_id.get();
    let reject = |opcode: u8, status| Malformed::Entry {
        wr_id,
        opcode,
        status,
    };
    let send_opcode = u8::from(WcOpcode::Send);
    let Ok(opcode) = SendOpcode::try_from(wqe.opcode) else {
        return Err(reject(send_opcode, WcStatus::LocQpOpErr));
    };
    let wc = u8::from(opcode.completion_opcode());
    use SendOpcode as Op;
    if matches!(opcode, Op::LocalInv | Op::BindMw | Op::SendWithInv) {
        // Memory windows and invalidation are not supported.
        return Err(reject(wc, WcStatus::LocQpOpErr));
    }
    let mut flags = wqe.flags
        & (send_flags::FENCE | send_flags::SIGNALED | send_flags::SOLICITED | send_flags::INLINE);
    if limits.sig_all {
        flags |= send_flags::SIGNALED;
    }
    let room = (src.stride() as usize).saturating_sub(SEND_FIXED);
    let is_atomic = matches!(opcode, Op::AtomicCmpAndSwp | Op::AtomicFetchAndAdd);
    let (local, length) = if flags & send_flags::INLINE != 0 {
        let inline_ok = matches!(
            opcode,
            Op::Send | Op::SendWithImm | Op::RdmaWrite | Op::RdmaWriteWithImm
        );
        if !inline_ok {
            return Err(reject(wc, WcStatus::LocQpOpErr));
        }
        let len = wqe.inline_len.get() as usize;
        if len > limits.max_inline.min(MAX_INLINE_DATA) as usize || len > room {
            return Err(reject(wc, WcStatus::LocLenErr));
        }
        if !src.read(index, SEND_FIXED, &mut out.payload.0[..len]) {
            return Err(Malformed::Unreadable);
        }
        (Local::Inline(len as u16), len as u64)
    } else {
        let n = usize::from(wqe.num_sge);
        if n > limits.max_sge.min(MAX_SGE) as usize || n * SGE_SIZE > room {
            return Err(reject(wc, WcStatus::LocLenErr));
        }
        if !src.read(index, SEND_FIXED, &mut out.payload.0[..n * SGE_SIZE]) {
            return Err(Malformed::Unreadable);
        }
        let sges = sges_of(&out.payload.0, n);
        if is_atomic && (n != 1 || sges.first().map(|s| s.length.get()) != Some(8)) {
            return Err(reject(wc, WcStatus::LocLenErr));
        }
        let Some(length) = total_length(sges) else {
            return Err(reject(wc, WcStatus::LocLenErr));
        };
        (Local::Sges(wqe.num_sge), length)
    };
    out.wr_id = wr_id;
    out.opcode = opcode;
    out.flags = flags;
    out.imm_data = wqe.imm_data;
    out.remote_addr = wqe.remote_addr.get();
    out.rkey = wqe.rkey.get();
    out.compare_add = wqe.compare_add.get();
    out.swap = wqe.swap.get();
    out.local = local;
    out.length = length;
    Ok(())
}

/// Reads receive WQE `index` of `src` into `out`.
pub fn read_recv<S: EntrySource + ?Sized>(
    src: &S,
    index: u32,
    limits: &RecvLimits,
    out: &mut RecvWork,
) -> Result<(), Malformed> {
    let wqe: RecvWqe = read_fixed(src, index)?;
    let wr_id = wqe.wr_id.get();
    let reject = |status| Malformed::Entry {
        wr_id,
        opcode: u8::from(WcOpcode::Recv),
        status,
    };
    let n = usize::from(wqe.num_sge);
    let room = (src.stride() as usize).saturating_sub(RECV_FIXED);
    if n > limits.max_sge.min(MAX_SGE) as usize || n * SGE_SIZE > room {
        return Err(reject(WcStatus::LocLenErr));
    }
    if !src.read(index, RECV_FIXED, &mut out.payload.0[..n * SGE_SIZE]) {
        return Err(Malformed::Unreadable);
    }
    let Some(length) = total_length(sges_of(&out.payload.0, n)) else {
        return Err(reject(WcStatus::LocLenErr));
    };
    out.wr_id = wr_id;
    out.num_sge = wqe.num_sge;
    out.length = length;
    Ok(())
}

/// The wr_id of send or receive WQE `index` alone (to flush it: a flushed
/// WQE's other fields do not matter, and need not be valid).
pub fn read_wr_id<S: EntrySource + ?Sized>(src: &S, index: u32) -> Option<u64> {
    let mut id = [0u8; 8];
    src.read(index, 0, &mut id).then(|| u64::from_le_bytes(id))
}

/// The completion opcode of send WQE `index` alone (to flush it).
pub fn read_opcode<S: EntrySource + ?Sized>(src: &S, index: u32) -> WcOpcode {
    let mut opcode = [0u8; 1];
    let at = core::mem::offset_of!(SendWqe, opcode);
    if !src.read(index, at, &mut opcode) {
        return WcOpcode::Send;
    }
    SendOpcode::try_from(opcode[0]).map_or(WcOpcode::Send, SendOpcode::completion_opcode)
}

/// A send WQE's bytes as a driver writes them (tests and the fuzz
/// target's seeds).
pub fn encode_send(wqe: &SendWqe, payload: &[u8], stride: usize) -> Vec<u8> {
    let mut slot = vec![0u8; stride];
    let fixed = wqe.as_bytes();
    slot[..fixed.len()].copy_from_slice(fixed);
    let end = (fixed.len() + payload.len()).min(stride);
    slot[fixed.len()..end].copy_from_slice(&payload[..end - fixed.len()]);
    slot
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: SendLimits = SendLimits {
        max_sge: 4,
        max_inline: 64,
        sig_all: false,
    };

    fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
        Sge {
            addr: addr.into(),
            length: length.into(),
            lkey: lkey.into(),
        }
    }

    fn send(opcode: SendOpcode, flags: u8, sges: &[Sge]) -> Vec<u8> {
        let wqe = SendWqe {
            wr_id: 42.into(),
            opcode: opcode.into(),
            flags,
            num_sge: sges.len() as u8,
            rkey: 7.into(),
            remote_addr: 0x1000.into(),
            ..SendWqe::default()
        };
        encode_send(&wqe, sges.as_bytes(), 256)
    }

    fn status(r: Result<(), Malformed>) -> Option<WcStatus> {
        match r {
            Err(Malformed::Entry { status, .. }) => Some(status),
            _ => None,
        }
    }

    #[test]
    fn a_good_write_is_copied_whole() {
        let slot = send(
            SendOpcode::RdmaWrite,
            send_flags::SIGNALED | 0x80,
            &[sge(0x10, 100, 1), sge(0x20, 28, 2)],
        );
        let mut w = SendWork::default();
        read_send(&slot[..], 0, &LIMITS, &mut w).expect("valid");
        assert_eq!(
            (w.wr_id, w.opcode, w.length),
            (42, SendOpcode::RdmaWrite, 128)
        );
        assert_eq!(w.flags, send_flags::SIGNALED, "unknown flag bits dropped");
        assert_eq!(w.sges().len(), 2);
        assert_eq!(w.sges()[1].lkey.get(), 2);
        assert_eq!((w.remote_addr, w.rkey), (0x1000, 7));
        assert!(w.inline().is_empty());
    }

    #[test]
    fn inline_data_is_copied_and_bounded() {
        let wqe = SendWqe {
            wr_id: 1.into(),
            opcode: SendOpcode::Send.into(),
            flags: send_flags::INLINE,
            inline_len: 5.into(),
            ..SendWqe::default()
        };
        let slot = encode_send(&wqe, b"hello", 128);
        let mut w = SendWork::default();
        read_send(&slot[..], 0, &LIMITS, &mut w).expect("valid");
        assert_eq!(w.inline(), b"hello");
        assert_eq!(w.length, 5);
        let long = SendWqe {
            inline_len: 65.into(),
            ..wqe
        };
        let slot = encode_send(&long, &[0; 65], 256);
        assert_eq!(
            status(read_send(&slot[..], 0, &LIMITS, &mut w)),
            Some(WcStatus::LocLenErr)
        );
        let beyond_slot = SendWqe {
            inline_len: 60.into(),
            ..wqe
        };
        let slot = encode_send(&beyond_slot, &[0; 60], 64 + 32);
        assert_eq!(
            status(read_send(&slot[..], 0, &LIMITS, &mut w)),
            Some(WcStatus::LocLenErr)
        );
        let read = SendWqe {
            opcode: SendOpcode::RdmaRead.into(),
            ..wqe
        };
        let slot = encode_send(&read, b"hello", 128);
        assert_eq!(
            status(read_send(&slot[..], 0, &LIMITS, &mut w)),
            Some(WcStatus::LocQpOpErr)
        );
    }

    #[test]
    fn malformed_wqes_get_the_statuses_devices_give() {
        let mut w = SendWork::default();
        let five = [sge(0, 1, 1); 5];
        assert_eq!(
            status(read_send(
                &send(SendOpcode::Send, 0, &five)[..],
                0,
                &LIMITS,
                &mut w
            )),
            Some(WcStatus::LocLenErr),
            "more SGEs than granted"
        );
        let mut bad_opcode = send(SendOpcode::Send, 0, &[]);
        bad_opcode[8] = 0xee;
        assert_eq!(
            status(read_send(&bad_opcode[..], 0, &LIMITS, &mut w)),
            Some(WcStatus::LocQpOpErr)
        );
        assert_eq!(
            status(read_send(
                &send(SendOpcode::BindMw, 0, &[])[..],
                0,
                &LIMITS,
                &mut w
            )),
            Some(WcStatus::LocQpOpErr)
        );
        let cas_short = send(SendOpcode::AtomicCmpAndSwp, 0, &[sge(0, 4, 1)]);
        assert_eq!(
            status(read_send(&cas_short[..], 0, &LIMITS, &mut w)),
            Some(WcStatus::LocLenErr)
        );
        let huge = send(
            SendOpcode::RdmaWrite,
            0,
            &[sge(0, u32::MAX, 1), sge(0, u32::MAX, 1)],
        );
        assert_eq!(
            status(read_send(&huge[..], 0, &LIMITS, &mut w)),
            Some(WcStatus::LocLenErr),
            "beyond the port's max_msg_sz"
        );
        assert_eq!(
            read_send(&[0u8; 10][..], 0, &LIMITS, &mut w),
            Err(Malformed::Unreadable)
        );
    }

    #[test]
    fn the_format_limits_bound_even_generous_grants() {
        let generous = SendLimits {
            max_sge: u32::MAX,
            max_inline: u32::MAX,
            sig_all: true,
        };
        let many = [sge(0, 1, 1); MAX_SGE as usize];
        let wqe = SendWqe {
            opcode: SendOpcode::Send.into(),
            num_sge: MAX_SGE as u8,
            ..SendWqe::default()
        };
        let slot = encode_send(&wqe, many.as_bytes(), 2048);
        let mut w = SendWork::default();
        read_send(&slot[..], 0, &generous, &mut w).expect("64 SGEs are carried");
        assert_eq!(w.sges().len(), 64);
        assert!(w.signaled(), "sq_sig_all signals every WQE");
        let too_many = SendWqe {
            num_sge: MAX_SGE as u8 + 1,
            ..wqe
        };
        let slot = encode_send(&too_many, &[0; 65 * 16], 4096);
        assert_eq!(
            status(read_send(&slot[..], 0, &generous, &mut w)),
            Some(WcStatus::LocLenErr)
        );
    }

    #[test]
    fn receives_are_checked_like_sends() {
        let wqe = RecvWqe {
            wr_id: 9.into(),
            num_sge: 2,
            reserved: [0; 7],
        };
        let mut slot = [0u8; 64];
        slot[..16].copy_from_slice(wqe.as_bytes());
        slot[16..48].copy_from_slice([sge(0x10, 10, 1), sge(0x20, 20, 1)].as_bytes());
        let mut r = RecvWork::default();
        read_recv(&slot[..], 0, &RecvLimits { max_sge: 2 }, &mut r).expect("valid");
        assert_eq!((r.wr_id, r.length, r.sges().len()), (9, 30, 2));
        assert_eq!(
            status(read_recv(&slot[..], 0, &RecvLimits { max_sge: 1 }, &mut r)),
            Some(WcStatus::LocLenErr)
        );
        assert_eq!(read_wr_id(&slot[..], 0), Some(9));
    }
}
