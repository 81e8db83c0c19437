//! The InfiniBand Communication Manager as Linux speaks it over RoCEv2, as
//! pure code with no I/O, for a virtual RDMA device whose peers are Linux
//! hosts running rdma_cm over rxe (the wire is described in
//! `/work/shared/rdmacm-notes.md` §2, which this crate follows).
//!
//! # Model
//!
//! A CM conversation is 256-byte MADs on QP1 (UD, Q_Key 0x80010000): REQ,
//! REP, RTU to connect; DREQ, DREP to disconnect; MRA to ask for patience;
//! REJ to refuse; SIDR_REQ/SIDR_REP to find a UD QP by service ID.
//!
//! - [`Mad`] ([`mad`], [`messages`]): the codec. Decoding is of hostile bytes
//!   and never panics; every field of every message is carried at its wire
//!   width, and `decode(encode(m)) == m`.
//! - [`cma`]: what rdma_cm adds for IP addressing — the service ID
//!   `(port space << 16) | port` and the 36-byte header at the start of REQ
//!   and SIDR_REQ private data.
//! - [`Agent`] ([`agent`]): one device's CM — per-connection state machines
//!   as in Linux's `cm.c`, listeners by service ID, matching of incoming MADs
//!   to connections, retransmission with the timeouts the REQ carries,
//!   duplicates answered as Linux answers them, timewait.
//!
//! # Who owns what
//!
//! The agent owns the protocol: comm IDs and TIDs, every connection's state,
//! what to send when, retransmissions and their timers, matching replies to
//! requests, and bounds on all of it (a flood cannot grow its tables; what
//! does not fit is dropped and counted).
//!
//! The caller owns everything else:
//! - **QP1.** It receives MADs and hands them to [`Agent::handle_mad`] with
//!   the GIDs they travelled between, and sends what
//!   [`Agent::poll_transmit`] returns to the GID it names. It resolves
//!   addresses, and filters what its policy forbids before the agent sees
//!   it.
//! - **Time.** It passes `now` in and calls [`Agent::tick`] by
//!   [`Agent::next_deadline`]; the agent never reads a clock.
//! - **QPs.** The agent never touches one. [`Agent::accept`] returns and
//!   [`Event::ConnectResponse`] carries the [`QpAttrs`] to move the QP to
//!   RTR/RTS with (the passive side before its REP leaves, the active side
//!   before [`Agent::establish`] sends the RTU); the QP is put in ERR or
//!   destroyed on disconnect by the caller too.
//! - **The consumer.** Events from [`Agent::poll_event`] (connect request
//!   and response, established, rejected, unreachable, disconnected,
//!   timewait exit, SIDR request and response) go to whoever plays
//!   rdma_cm's application, whose answers come back as `accept`, `reject`,
//!   `establish`, `disconnect`, `destroy`, `sidr_accept`/`sidr_reject`.

pub mod agent;
pub mod cma;
mod gid;
pub mod mad;
pub mod messages;
mod qp;
mod timing;

pub use agent::{
    Agent, AgentConfig, AgentError, CmState, ConnId, ConnectParams, DropReason, Event, SidrParams,
    Stats, Transmit, DEFAULT_PKEY, LINUX_MRA_SERVICE_TIMEOUT,
};
pub use cma::{service_id, split_service_id, CmaAddrs, CmaError, CmaHeader, PortSpace};
pub use gid::{Gid, MadPath};
pub use mad::{
    CmMessage, DecodeError, EncodeError, Mad, MadHeader, MessageKind, PrivateData, MAD_SIZE,
};
pub use messages::{
    Drep, Dreq, Mra, PathInfo, Rej, RejectReason, Rep, Req, Rtu, SidrRep, SidrReq, SidrStatus,
    TargetMessage, TransportType,
};
pub use qp::{active_qp_attrs, passive_qp_attrs, QpAttrs};
pub use timing::{cm_ack_timeout, cm_time};

#[cfg(test)]
mod tests;
