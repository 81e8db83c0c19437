//! hostd's WQE reader (`vrdma_hostd::engine::wqe`): any bytes in a ring
//! slot, any granted capacities, any stride. What it accepts is a
//! well-formed work request within every limit, copied exactly from the
//! slot; what it refuses gets one of the statuses a device gives a
//! malformed WQE, with the slot's wr_id.

use vrdma_hostd::engine::wqe::{
    read_recv, read_send, Local, Malformed, RecvLimits, RecvWork, SendLimits, SendWork,
};
use vrdma_spec::limits::{MAX_INLINE_DATA, MAX_MSG_SIZE, MAX_SGE};
use vrdma_spec::ring::{send_flags, RecvWqe, SendWqe, Sge, SGE_SIZE};
use vrdma_spec::verbs::{SendOpcode, WcStatus};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};

use crate::input::Input;

const SEND_FIXED: usize = core::mem::size_of::<SendWqe>();
const RECV_FIXED: usize = core::mem::size_of::<RecvWqe>();

/// Reads `data` as: limits, a stride, then one ring slot.
pub fn check(data: &[u8]) {
    let mut input = Input::new(data);
    let send_limits = SendLimits {
        max_sge: u32::from(input.u8() % 72),
        max_inline: u32::from(input.u16() % 1100),
        sig_all: input.bool(),
    };
    let recv_limits = RecvLimits {
        max_sge: u32::from(input.u8() % 72),
    };
    // Strides of 64 to 4096 bytes, as rings have.
    let stride = 64usize << (input.u8() % 7);
    let mut slot = vec![0u8; stride];
    let bytes = input.bytes(stride);
    slot[..bytes.len()].copy_from_slice(bytes);
    // Nudge the fixed part towards valid WQEs now and then, so the checks
    // after the opcode are reached as often as the refusals.
    if input.bool() {
        slot[8] %= 12;
        slot[10] %= 72;
    }
    check_send(&slot, &send_limits);
    check_recv(&slot, &recv_limits);
}

fn wr_id(slot: &[u8]) -> u64 {
    u64::from_le_bytes(slot[..8].try_into().unwrap_or([0; 8]))
}

fn check_send(slot: &[u8], limits: &SendLimits) {
    let mut work = SendWork::default();
    match read_send(slot, 0, limits, &mut work) {
        Ok(()) => {
            let fixed = SendWqe::read_from_bytes(&slot[..SEND_FIXED]).expect("fixed part");
            assert_eq!(work.wr_id, fixed.wr_id.get());
            assert_eq!(u8::from(work.opcode), fixed.opcode);
            assert!(!matches!(
                work.opcode,
                SendOpcode::LocalInv | SendOpcode::BindMw | SendOpcode::SendWithInv
            ));
            assert!(work.length <= u64::from(MAX_MSG_SIZE));
            assert_eq!(
                work.signaled(),
                limits.sig_all || fixed.flags & send_flags::SIGNALED != 0
            );
            match work.local {
                Local::Inline(n) => {
                    let n = usize::from(n);
                    assert!(n <= limits.max_inline.min(MAX_INLINE_DATA) as usize);
                    assert!(SEND_FIXED + n <= slot.len());
                    assert_eq!(work.inline(), &slot[SEND_FIXED..SEND_FIXED + n]);
                    assert_eq!(work.length, n as u64);
                    assert!(work.sges().is_empty());
                }
                Local::Sges(n) => {
                    let n = usize::from(n);
                    assert!(n <= limits.max_sge.min(MAX_SGE) as usize);
                    assert!(SEND_FIXED + n * SGE_SIZE <= slot.len());
                    let want = &slot[SEND_FIXED..SEND_FIXED + n * SGE_SIZE];
                    assert_eq!(work.sges().as_bytes(), want, "SGEs copied exactly");
                    let sum: u64 = work.sges().iter().map(|s| u64::from(s.length.get())).sum();
                    assert_eq!(work.length, sum);
                    if matches!(
                        work.opcode,
                        SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
                    ) {
                        assert_eq!(n, 1);
                        assert_eq!(work.sges()[0].length.get(), 8);
                    }
                }
                Local::None => panic!("an accepted WQE has SGEs or inline data"),
            }
        }
        Err(Malformed::Entry {
            wr_id: id, status, ..
        }) => {
            assert_eq!(id, wr_id(slot));
            assert!(
                matches!(status, WcStatus::LocQpOpErr | WcStatus::LocLenErr),
                "{status:?}"
            );
        }
        Err(Malformed::Unreadable) => panic!("every stride holds the fixed part"),
    }
}

fn check_recv(slot: &[u8], limits: &RecvLimits) {
    let mut work = RecvWork::default();
    match read_recv(slot, 0, limits, &mut work) {
        Ok(()) => {
            let fixed = RecvWqe::read_from_bytes(&slot[..RECV_FIXED]).expect("fixed part");
            let n = usize::from(fixed.num_sge);
            assert_eq!(work.wr_id, fixed.wr_id.get());
            assert!(n <= limits.max_sge.min(MAX_SGE) as usize);
            assert_eq!(work.sges().len(), n);
            let want = &slot[RECV_FIXED..RECV_FIXED + n * SGE_SIZE];
            assert_eq!(work.sges().as_bytes(), want);
            let sum: u64 = work
                .sges()
                .iter()
                .map(|s: &Sge| u64::from(s.length.get()))
                .sum();
            assert_eq!(work.length, sum);
            assert!(work.length <= u64::from(MAX_MSG_SIZE));
        }
        Err(Malformed::Entry {
            wr_id: id, status, ..
        }) => {
            assert_eq!(id, wr_id(slot));
            assert_eq!(status, WcStatus::LocLenErr);
        }
        Err(Malformed::Unreadable) => panic!("every stride holds the fixed part"),
    }
}
