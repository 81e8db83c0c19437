//! Control messages between vdev and hostd.
//!
//! Each request gets exactly one response, in order. Requests that carry
//! file descriptors say so; the descriptors travel as `SCM_RIGHTS` with the
//! message. Messages are JSON (serde), at most [`MAX_MESSAGE`] bytes: the
//! control path is not hot, and a self-describing format keeps the hostile
//! decoder in hostd simple and strict (unknown fields are refused).

use serde::{Deserialize, Serialize};
pub use vrdma_tenant_policy::TenantPolicy;

/// Largest message in bytes.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// Version of this protocol; hostd refuses a vdev that speaks another.
/// Raised whenever a message changes shape, the tenant policy in the
/// Welcome included (2: `max_devices`), so that a vdev and a hostd of
/// different builds meet a clear EPROTO instead of a decoding error.
pub const PROTOCOL_VERSION: u32 = 2;

/// A request from vdev to hostd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Request {
    /// First message: who this vdev serves. hostd checks the tenant against
    /// its policy and the peer's credentials, assigns the device's LID and
    /// grants physical queues. The response carries, as fds, per granted
    /// queue: its shared memory; then hostd's doorbell eventfd, the
    /// completion eventfd hostd signals, and the notification channel (a
    /// seqpacket socket on which hostd sends [`Notification`]s).
    Hello {
        version: u32,
        tenant: String,
        device: String,
    },
    /// One fd: a guest memory slot (a sealed memfd) to map.
    AddMemory {
        slot: u32,
        gpa: u64,
        len: u64,
        file_offset: u64,
    },
    /// The slot is gone; keys over it are revoked.
    RemoveMemory { slot: u32 },
    /// Registers a memory region under its keys.
    RegisterMr(MrRegistration),
    /// Revokes a memory region. When the response arrives no WQE touches
    /// the region any more.
    DeregisterMr { lkey: u32 },
    /// A virtual QP exists on physical QP `pqp` in protection domain `pd`.
    CreateQp { vqpn: u32, pd: u32, pqp: u32 },
    /// Connect a virtual QP to its peer (at RTR). hostd checks the peer is
    /// reachable for this tenant.
    ConnectQp(QpConnection),
    /// The QP's remote access flags changed (INIT→INIT, RTS→RTS, ...).
    SetQpAccess { vqpn: u32, access: u32 },
    /// The virtual QP entered the error state: flush its work.
    ErrorQp { vqpn: u32 },
    /// The virtual QP went back to RESET: forget its connection and work.
    ResetQp { vqpn: u32 },
    /// The virtual QP is destroyed. When the response arrives no WQE of it
    /// is executed any more.
    DestroyQp { vqpn: u32 },
    /// vdev refused a verb because of the tenant's quota `quota` (a key of
    /// [`vrdma_tenant_policy::Limits`]); hostd counts it for the tenant.
    QuotaRejected { quota: String },
}

/// A message hostd sends on its own, on the notification channel (the last
/// descriptor of `Welcome`); vdev does not answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Notification {
    /// The operator reloaded the policy; this is the tenant's new one.
    /// Raised quotas apply at once, lowered ones to new objects only.
    Policy(TenantPolicy),
}

/// Where a virtual QP sends, and how it behaves as RC requester/responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QpConnection {
    pub vqpn: u32,
    /// The peer's LID and QP number.
    pub dest_lid: u16,
    pub dest_qpn: u32,
    /// Remote access this QP grants its peer ([`vrdma_spec::verbs::access`]).
    pub access: u32,
    /// RNR retries of this QP as requester (7 = infinite).
    pub rnr_retry: u8,
    /// Transport retries of this QP as requester.
    pub retry_cnt: u8,
    /// RNR timer code this QP advertises as responder (IBA table).
    pub min_rnr_timer: u8,
}

/// One piece of a memory region: `len` bytes at `offset` in memory slot `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MrSegment {
    pub slot: u32,
    pub offset: u64,
    pub len: u64,
}

/// A memory region as hostd records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MrRegistration {
    pub lkey: u32,
    pub rkey: u32,
    pub pd: u32,
    /// [`vrdma_spec::verbs::access`] flags.
    pub access: u32,
    pub iova: u64,
    pub len: u64,
    pub segments: Vec<MrSegment>,
}

/// hostd's answer to a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Response {
    /// Answer to `Hello`.
    Welcome(Box<Welcome>),
    /// The request was carried out.
    Ok,
    /// The request was refused: a positive errno and why.
    Refused { errno: i32, reason: String },
}

/// What hostd grants a vdev.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Welcome {
    /// The device's LID on hostd's fabric.
    pub lid: u16,
    /// Physical QPs granted; each arrives as one shared-memory fd, in order.
    pub queues: Vec<QueueGrant>,
    /// The tenant's policy in force: vdev enforces its quotas.
    pub policy: TenantPolicy,
}

/// Shape of one granted physical QP's shared memory: a submission ring of
/// [`crate::entries::PhysWqe`] then a completion ring of
/// [`crate::entries::PhysCqe`], laid out by [`crate::shm::QueueLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueGrant {
    /// Physical QP number on hostd.
    pub pqp: u32,
    /// Entries of the submission ring (power of two).
    pub sq_depth: u32,
    /// Entries of the completion ring (power of two).
    pub cq_depth: u32,
}

/// Why a message cannot be decoded or encoded.
#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    #[error("Message of {0} bytes exceeds {MAX_MESSAGE}")]
    TooLarge(usize),
    #[error("Malformed message")]
    Malformed(#[source] serde_json::Error),
}

/// Encodes a message.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, MessageError> {
    let bytes = serde_json::to_vec(msg).map_err(MessageError::Malformed)?;
    if bytes.len() > MAX_MESSAGE {
        return Err(MessageError::TooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Decodes a message, refusing anything larger than [`MAX_MESSAGE`].
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, MessageError> {
    if bytes.len() > MAX_MESSAGE {
        return Err(MessageError::TooLarge(bytes.len()));
    }
    serde_json::from_slice(bytes).map_err(MessageError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let req = Request::RegisterMr(MrRegistration {
            lkey: 1,
            rkey: 2,
            pd: 3,
            access: 7,
            iova: 0x1000,
            len: 4096,
            segments: vec![MrSegment {
                slot: 0,
                offset: 0x1000,
                len: 4096,
            }],
        });
        let bytes = encode(&req).expect("encode");
        assert_eq!(decode::<Request>(&bytes).expect("decode"), req);
    }

    #[test]
    fn the_largest_mr_a_vdev_may_register_fits_one_message() {
        let segment = MrSegment {
            slot: u32::MAX,
            offset: u64::MAX,
            len: u64::MAX,
        };
        let req = Request::RegisterMr(MrRegistration {
            lkey: u32::MAX,
            rkey: u32::MAX,
            pd: u32::MAX,
            access: u32::MAX,
            iova: u64::MAX,
            len: u64::MAX,
            segments: vec![segment; vrdma_spec::control::MAX_MR_PIECES],
        });
        let bytes = encode(&req).expect("within MAX_MESSAGE");
        assert!(bytes.len() <= MAX_MESSAGE);
    }

    #[test]
    fn hostile_messages_are_refused() {
        assert!(decode::<Request>(br#"{"remove_memory":{"slot":1,"extra":2}}"#).is_err());
        assert!(decode::<Request>(br#"{"remove_memory":{"slot":-1}}"#).is_err());
        assert!(decode::<Request>(br#"{"nonsense":{}}"#).is_err());
        assert!(decode::<Request>(&vec![b' '; MAX_MESSAGE + 1]).is_err());
    }
}
