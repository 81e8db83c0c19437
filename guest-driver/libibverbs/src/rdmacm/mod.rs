//! librdmacm: the RDMA connection manager's API (`<rdma/rdma_cma.h>`),
//! served by the vrdma devices' own connection managers.
//!
//! Debian's librdmacm talks to the kernel's rdma_cm (`/dev/infiniband/
//! rdma_cm`), which has no vrdma devices under it. vrdma's device runs the
//! IB CM itself (in vdev, docs/device-spec.md §5.6), so this library is a
//! client of it. It lives in the same shared object as the drop-in
//! libibverbs: `librdmacm.so.1` is a second name of that file, and the
//! dynamic loader, which recognises a file it has loaded already, maps it
//! once. So `id->verbs` is an `ibv_context` this same library opened, and
//! the QPs and CQs librdmacm creates are libibverbs objects like any other.
//!
//! Modules, one job each:
//! - [`devices`]: the devices the CM uses, opened once per process, with
//!   one device CM channel and one PD each;
//! - [`channel`]: event channels, and routing the devices' events to them;
//! - [`event`]: turning a device event into a `struct rdma_cm_event`, with
//!   the QP moves rdma-core's library makes on the way (`rdma_get_cm_event`,
//!   `rdma_ack_cm_event`);
//! - [`id`]: CM IDs and the calls on them (bind, resolve, listen, connect,
//!   accept, ...), synchronous IDs included;
//! - [`qp`]: QPs, CQs and SRQs created through an ID;
//! - [`addrinfo`] for `rdma_getaddrinfo` and the endpoints made from it;
//! - [`refused`]: what vrdma does not offer (rsockets, multicast), refused
//!   with the errno a program expects.

pub(crate) mod addrinfo;
pub(crate) mod channel;
pub(crate) mod devices;
pub(crate) mod event;
pub(crate) mod id;
pub(crate) mod qp;
pub(crate) mod refused;

/// `rdma_cm` calls return 0 or -1 with `errno` set (rdma-core's `ERR()`).
pub(crate) use crate::ffi::minus_one_verb as cm_call;
