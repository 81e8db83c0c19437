//! Physical work-queue and completion entries: what a vdev posts to one of
//! its physical queue pairs on hostd and what hostd completes.
//!
//! A physical WQE is a guest WQE after vdev checked and translated it: it
//! names its virtual QP (the way DC transport names a target per WQE, many
//! virtual QPs share one physical QP), local buffers by (lkey, IOVA, length)
//! that hostd checks again against its own key table, and inline data copied
//! out of guest memory.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub use vrdma_spec::ring::Sge;

/// Largest number of SGEs or inline bytes one physical WQE carries.
pub const MAX_PHYS_SGE: usize = 16;
/// Bytes of the payload area (SGEs or inline data).
pub const PAYLOAD_BYTES: usize = MAX_PHYS_SGE * core::mem::size_of::<Sge>();

/// What a physical WQE asks for.
pub mod kind {
    /// A send-queue operation (SEND, WRITE, READ, atomics).
    pub const SEND: u8 = 1;
    /// A receive buffer for the virtual QP.
    pub const RECV: u8 = 2;
}

/// One entry of a physical QP's submission ring.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct PhysWqe {
    /// vdev's handle for the completion; returned as is.
    pub token: U64,
    /// [`kind`].
    pub kind: u8,
    /// A [`vrdma_spec::verbs::SendOpcode`] (SEND kind only).
    pub opcode: u8,
    /// [`vrdma_spec::ring::send_flags`].
    pub flags: u8,
    /// SGEs in `payload` (0 when inline).
    pub num_sge: u8,
    /// The virtual QP this work belongs to.
    pub vqpn: U32,
    pub remote_addr: U64,
    pub rkey: U32,
    pub imm_data: [u8; 4],
    pub compare_add: U64,
    pub swap: U64,
    /// Inline bytes in `payload` when `flags` has INLINE.
    pub inline_len: U32,
    pub reserved: [u8; 12],
    /// `num_sge` [`Sge`]s, or `inline_len` bytes of inline data.
    pub payload: [u8; PAYLOAD_BYTES],
}

impl PhysWqe {
    /// The SGEs of this WQE, `None` if `num_sge` is out of range.
    pub fn sges(&self) -> Option<Vec<Sge>> {
        let n = usize::from(self.num_sge);
        if n > MAX_PHYS_SGE {
            return None;
        }
        let bytes = &self.payload[..n * core::mem::size_of::<Sge>()];
        <[Sge]>::ref_from_bytes(bytes).ok().map(|s| s.to_vec())
    }

    /// Stores `sges` as the payload; false if there are too many.
    pub fn set_sges(&mut self, sges: &[Sge]) -> bool {
        if sges.len() > MAX_PHYS_SGE {
            return false;
        }
        let bytes = sges.as_bytes();
        self.payload[..bytes.len()].copy_from_slice(bytes);
        self.num_sge = sges.len() as u8;
        true
    }
}

impl Default for PhysWqe {
    fn default() -> Self {
        FromZeros::new_zeroed()
    }
}

use zerocopy::FromZeros;

/// Bits hostd sets in [`PhysCqe::wc_flags`] beside the verbs flags
/// ([`vrdma_spec::ring::wc_flags`]); vdev clears them before a CQE reaches
/// the guest.
pub mod cqe_marker {
    /// The successful completion of a WQE posted without SIGNALED. hostd
    /// completes every WQE so vdev knows its work is done; vdev drops these.
    /// Error and flush completions never carry it: verbs report those even
    /// for unsignaled work requests.
    pub const UNSIGNALED: u8 = 0x80;
    /// A receive completion of a message the sender marked SOLICITED.
    pub const SOLICITED: u8 = 0x40;
    /// Every marker bit.
    pub const ALL: u8 = UNSIGNALED | SOLICITED;
}

/// One entry of a physical completion ring.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct PhysCqe {
    /// The token of the WQE this completes.
    pub token: U64,
    pub vqpn: U32,
    /// A [`vrdma_spec::verbs::WcStatus`].
    pub status: u8,
    /// A [`vrdma_spec::verbs::WcOpcode`].
    pub opcode: u8,
    /// [`vrdma_spec::ring::wc_flags`].
    pub wc_flags: u8,
    /// [`kind`] of the completed WQE.
    pub kind: u8,
    pub byte_len: U32,
    pub imm_data: [u8; 4],
    /// Sender's QP (receive completions).
    pub src_qp: U32,
    /// Sender's LID (receive completions).
    pub slid: zerocopy::little_endian::U16,
    pub reserved: [u8; 2],
}

/// Size of a [`PhysWqe`].
pub const PHYS_WQE_SIZE: usize = core::mem::size_of::<PhysWqe>();
/// Size of a [`PhysCqe`].
pub const PHYS_CQE_SIZE: usize = core::mem::size_of::<PhysCqe>();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_fixed() {
        assert_eq!(PHYS_WQE_SIZE, 64 + 256);
        assert_eq!(PHYS_CQE_SIZE, 32);
    }

    #[test]
    fn sges_round_trip_and_are_bounded() {
        let mut wqe = PhysWqe::default();
        let sges = [Sge {
            addr: 0x1000.into(),
            length: 64.into(),
            lkey: 7.into(),
        }; 3];
        assert!(wqe.set_sges(&sges));
        assert_eq!(wqe.sges().expect("in range"), sges.to_vec());
        wqe.num_sge = 17;
        assert_eq!(wqe.sges(), None);
        assert!(!wqe.set_sges(&[Sge::default(); 17]));
    }
}
