//! The next hop's MAC address, from the kernel's routes and neighbor
//! (ARP) table.
//!
//! hostd's AF_XDP path builds whole Ethernet frames, so it must know, for
//! each destination, the MAC address of the next hop: the destination
//! itself when it is on the interface's link, else its gateway. The
//! kernel knows (and keeps knowing: ARP, route changes); hostd asks it
//! over rtnetlink with a socket opened before the sandbox goes up, from
//! the datapath thread, whose seccomp filter allows only `sendto` and
//! `recvfrom` with flags `MSG_DONTWAIT` on it. Each question is a single
//! get, which the kernel answers inside the `sendto`: the answer is queued
//! on the socket when `sendto` returns, so nothing ever waits.
//!
//! A next hop the kernel does not know yet is [`NextHop::Unresolved`]:
//! the caller sends through the kernel meanwhile, which makes it resolve
//! the address (ARP), and asks again later.

use std::fmt;
use std::io;
use std::net::Ipv4Addr;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// What the kernel says about reaching a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextHop {
    /// The destination (or its gateway) is reached through the interface,
    /// at this MAC.
    Mac([u8; 6]),
    /// The route leaves through another interface (or is
    /// local/blackhole/unreachable): not for this interface.
    Elsewhere,
    /// The route is through the interface but the neighbor's MAC is not
    /// known yet (no entry, INCOMPLETE or FAILED): the caller sends through
    /// the kernel meanwhile, which makes it resolve.
    Unresolved,
}

// Netlink's and rtnetlink's message layouts. The `libc` crate has no
// `struct rtmsg` or `struct ndmsg`: messages are built and read as bytes,
// in the host's byte order (netlink's), at these offsets.

/// `sizeof(struct nlmsghdr)` (linux/netlink.h): `nlmsg_len` (u32),
/// `nlmsg_type` (u16), `nlmsg_flags` (u16), `nlmsg_seq` (u32),
/// `nlmsg_pid` (u32).
const NLMSG_HDRLEN: usize = 16;
/// `sizeof(struct rtmsg)` (linux/rtnetlink.h): `rtm_family`,
/// `rtm_dst_len`, `rtm_src_len`, `rtm_tos`, `rtm_table`, `rtm_protocol`,
/// `rtm_scope`, `rtm_type` (u8 each), `rtm_flags` (u32).
const RTMSG_LEN: usize = 12;
/// The offset of `rtm_type` in `struct rtmsg` (linux/rtnetlink.h).
const RTM_TYPE: usize = 7;
/// `sizeof(struct ndmsg)` (linux/neighbour.h): `ndm_family` (u8),
/// `ndm_pad1` (u8), `ndm_pad2` (u16), `ndm_ifindex` (i32), `ndm_state`
/// (u16), `ndm_flags` (u8), `ndm_type` (u8).
const NDMSG_LEN: usize = 12;
/// The offset of `ndm_ifindex` in `struct ndmsg` (linux/neighbour.h).
const NDM_IFINDEX: usize = 4;
/// The offset of `ndm_state` in `struct ndmsg` (linux/neighbour.h).
const NDM_STATE: usize = 8;
/// `sizeof(struct rtattr)` (linux/rtnetlink.h): `rta_len` (u16),
/// `rta_type` (u16); the attribute's data follows, padded to 4 bytes.
const RTA_HDRLEN: usize = 4;
/// `RTA_VIA` (linux/rtnetlink.h; in the `libc` crate for glibc targets
/// only): a gateway of another family (an IPv4 route through an IPv6
/// next hop), a `struct rtvia`.
const RTA_VIA: u16 = 18;
/// `NLA_TYPE_MASK` (linux/netlink.h): an attribute's type without its
/// `NLA_F_NESTED` and `NLA_F_NET_BYTEORDER` flags.
const NLA_TYPE_MASK: u16 = 0x3fff;
/// `NUD_VALID` (include/net/neighbour.h, not uapi): the states in which a
/// neighbor's link-layer address is known and used.
const NUD_VALID: u16 = libc::NUD_PERMANENT
    | libc::NUD_NOARP
    | libc::NUD_REACHABLE
    | libc::NUD_PROBE
    | libc::NUD_STALE
    | libc::NUD_DELAY;

// Netlink's message types and flags, as `nlmsghdr` holds them (the `libc`
// crate declares them `c_int`).
const NLMSG_NOOP: u16 = libc::NLMSG_NOOP as u16;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
const NLM_F_REQUEST: u16 = libc::NLM_F_REQUEST as u16;

/// A request: a header, a 12-byte `rtmsg` or `ndmsg`, one attribute of 4
/// bytes.
const REQ_LEN: usize = NLMSG_HDRLEN + 12 + RTA_HDRLEN + 4;

/// The room for answers. A route or neighbor answer is some 100 bytes; a
/// datagram longer than this would be cut, and its message then refused
/// as truncated.
const BUF_LEN: usize = 8192;

/// An rtnetlink (NETLINK_ROUTE) socket opened before hostd's sandbox,
/// asked from the datapath thread which MAC address a destination is
/// reached at through interface `ifindex`.
pub struct Neighbors {
    fd: OwnedFd,
    ifindex: u32,
    /// The last request's sequence number; answers to others are skipped.
    seq: u32,
    /// Where answers are received, [`BUF_LEN`] bytes (allocated once: a
    /// lookup allocates nothing).
    buf: Box<[u8]>,
}

/// What the kernel answered a request with.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// The answer's payload (after its `nlmsghdr`): where in the buffer.
    Message(Range<usize>),
    /// An error: this (positive) errno.
    Refused(i32),
}

/// A route's gateway, from an RTM_NEWROUTE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gateway {
    /// None: the destination is on the link.
    None,
    /// An IPv4 gateway (`RTA_GATEWAY`).
    V4(Ipv4Addr),
    /// A gateway of another family (`RTA_VIA`), whose neighbor entry is
    /// not in the IPv4 table.
    Other,
}

/// What an RTM_NEWROUTE says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Route {
    /// `rtm_type`: `RTN_UNICAST`, `RTN_LOCAL` …
    kind: u8,
    /// The output interface (`RTA_OIF`).
    oif: Option<u32>,
    gateway: Gateway,
}

impl Neighbors {
    /// Opens the socket (SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE), bound;
    /// for interface `ifindex`. Asks the kernel two questions to learn
    /// early whether it answers this module's requests (single
    /// RTM_GETNEIGH gets need Linux 5.0) and whether the interface exists.
    /// Before the sandbox.
    pub fn open(ifindex: u32) -> io::Result<Neighbors> {
        // SAFETY: socket takes no pointers; its result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: all-zero is a valid `sockaddr_nl` (port id 0: the kernel
        // picks one; no multicast groups).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `addr` is a valid `sockaddr_nl` of the length given.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut neighbors = Neighbors {
            fd,
            ifindex,
            seq: 0,
            buf: vec![0; BUF_LEN].into_boxed_slice(),
        };
        neighbors.probe()?;
        Ok(neighbors)
    }

    /// Checks that the kernel takes this module's requests: a route to
    /// 127.0.0.1 (never a blackhole, so EINVAL would mean a refused
    /// request: see [`Neighbors::next_hop`]) and the neighbor 0.0.0.0 on
    /// the interface (ENOENT: none, as expected; ENODEV: no such interface;
    /// EOPNOTSUPP: a kernel before 5.0).
    fn probe(&mut self) -> io::Result<()> {
        if let Answer::Refused(libc::EINVAL) = self.ask_route(Ipv4Addr::LOCALHOST)? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the kernel refuses hostd's RTM_GETROUTE requests (EINVAL)",
            ));
        }
        match self.ask_neighbor(Ipv4Addr::UNSPECIFIED)? {
            Answer::Message(_) | Answer::Refused(libc::ENOENT) => Ok(()),
            Answer::Refused(errno) => {
                let e = io::Error::from_raw_os_error(errno);
                Err(io::Error::new(
                    e.kind(),
                    format!(
                        "the kernel refuses hostd's RTM_GETNEIGH requests for interface {} \
                         (single gets need Linux 5.0): {e}",
                        self.ifindex
                    ),
                ))
            }
        }
    }

    /// RTM_GETROUTE for `dst` (a single get: NLM_F_REQUEST with RTA_DST,
    /// rtm_dst_len 32) → the output interface (RTA_OIF) and the gateway
    /// (RTA_GATEWAY) if any; if the OIF is not `ifindex` or the route type
    /// is not RTN_UNICAST → Elsewhere; else RTM_GETNEIGH (single get:
    /// ndmsg with ndm_family AF_INET, ndm_ifindex, NDA_DST = gateway or
    /// dst) → Mac if its state is one of REACHABLE, STALE, DELAY, PROBE,
    /// PERMANENT, NOARP and NDA_LLADDR is 6 bytes; ENOENT or
    /// INCOMPLETE/FAILED/NONE → Unresolved.
    ///
    /// No route (ENETUNREACH), an `unreachable` route (EHOSTUNREACH), a
    /// `prohibit` one (EACCES) and a `blackhole` one (EINVAL: the kernel
    /// answers a lookup that ends in a blackhole so) are Elsewhere too, as
    /// is a gateway of another family (RTA_VIA: its neighbor is in the
    /// IPv6 table). A valid neighbor entry without a 6-byte address (a
    /// device without Ethernet addresses) is Unresolved.
    ///
    /// Only `sendto` and `recvfrom`, with flags `MSG_DONTWAIT`; no
    /// allocation. An error of kind [`io::ErrorKind::WouldBlock`] when no
    /// answer is queued (which the kernel does not do), other errors as
    /// the kernel gives them, [`io::ErrorKind::InvalidData`] for an answer
    /// that does not parse.
    pub fn next_hop(&mut self, dst: Ipv4Addr) -> io::Result<NextHop> {
        let route = match self.ask_route(dst)? {
            Answer::Message(at) => parse_route(self.buf.get(at).unwrap_or(&[]))?,
            Answer::Refused(
                libc::ENOENT | libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EACCES | libc::EINVAL,
            ) => return Ok(NextHop::Elsewhere),
            Answer::Refused(errno) => return Err(io::Error::from_raw_os_error(errno)),
        };
        if route.kind != libc::RTN_UNICAST || route.oif != Some(self.ifindex) {
            return Ok(NextHop::Elsewhere);
        }
        let neighbor = match route.gateway {
            Gateway::None => dst,
            Gateway::V4(gateway) => gateway,
            Gateway::Other => return Ok(NextHop::Elsewhere),
        };
        match self.ask_neighbor(neighbor)? {
            Answer::Message(at) => {
                parse_neighbor(self.buf.get(at).unwrap_or(&[]), self.ifindex, neighbor)
            }
            Answer::Refused(libc::ENOENT) => Ok(NextHop::Unresolved),
            Answer::Refused(errno) => Err(io::Error::from_raw_os_error(errno)),
        }
    }

    /// Asks for the route to `dst`.
    fn ask_route(&mut self, dst: Ipv4Addr) -> io::Result<Answer> {
        let mut rtmsg = [0u8; RTMSG_LEN];
        rtmsg[0] = libc::AF_INET as u8; // rtm_family
        rtmsg[1] = 32; // rtm_dst_len
        self.ask(
            libc::RTM_GETROUTE,
            libc::RTM_NEWROUTE,
            rtmsg,
            libc::RTA_DST,
            dst.octets(),
        )
    }

    /// Asks for the neighbor `addr` on the interface.
    fn ask_neighbor(&mut self, addr: Ipv4Addr) -> io::Result<Answer> {
        let mut ndmsg = [0u8; NDMSG_LEN];
        ndmsg[0] = libc::AF_INET as u8; // ndm_family
        ndmsg[NDM_IFINDEX..NDM_IFINDEX + 4].copy_from_slice(&self.ifindex.to_ne_bytes());
        self.ask(
            libc::RTM_GETNEIGH,
            libc::RTM_NEWNEIGH,
            ndmsg,
            libc::NDA_DST,
            addr.octets(),
        )
    }

    /// Sends a request of type `kind` (its family header `head`, one
    /// attribute) with a new sequence number and receives the answer to it
    /// (a message of type `answer`, or an error), skipping answers to
    /// earlier requests.
    fn ask(
        &mut self,
        kind: u16,
        answer: u16,
        head: [u8; 12],
        attr_type: u16,
        attr: [u8; 4],
    ) -> io::Result<Answer> {
        self.seq = self.seq.wrapping_add(1);
        self.send(&request(kind, self.seq, head, attr_type, attr))?;
        loop {
            let len = self.recv()?;
            if let Some(found) = find_answer(self.buf.get(..len).unwrap_or(&[]), self.seq, answer)?
            {
                return Ok(found);
            }
        }
    }

    /// Sends `req` to the kernel.
    fn send(&self, req: &[u8]) -> io::Result<()> {
        // SAFETY: `req` is valid for reads of `req.len()` bytes; no
        // address (null, 0) sends to the socket's default peer, the
        // kernel.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                req.as_ptr().cast(),
                req.len(),
                libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != req.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "rtnetlink took part of a request",
            ));
        }
        Ok(())
    }

    /// Receives one datagram into the buffer: its length.
    fn recv(&mut self) -> io::Result<usize> {
        // SAFETY: the buffer is valid for writes of its length; null
        // address pointers ask for no source address.
        let n = unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr().cast(),
                self.buf.len(),
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            // EAGAIN is of kind WouldBlock.
            return Err(io::Error::last_os_error());
        }
        Ok((n as usize).min(self.buf.len()))
    }
}

impl AsRawFd for Neighbors {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl fmt::Debug for Neighbors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Neighbors")
            .field("fd", &self.fd)
            .field("ifindex", &self.ifindex)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

/// A request of type `kind` with sequence number `seq`: `head` (an
/// `rtmsg` or `ndmsg`) and one attribute of type `attr_type` holding
/// `attr`.
fn request(kind: u16, seq: u32, head: [u8; 12], attr_type: u16, attr: [u8; 4]) -> [u8; REQ_LEN] {
    let mut req = [0u8; REQ_LEN];
    req[0..4].copy_from_slice(&(REQ_LEN as u32).to_ne_bytes()); // nlmsg_len
    req[4..6].copy_from_slice(&kind.to_ne_bytes()); // nlmsg_type
    req[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes()); // nlmsg_flags
    req[8..12].copy_from_slice(&seq.to_ne_bytes()); // nlmsg_seq
                                                    // nlmsg_pid 0: to the kernel.
    req[NLMSG_HDRLEN..NLMSG_HDRLEN + 12].copy_from_slice(&head);
    let at = NLMSG_HDRLEN + 12;
    req[at..at + 2].copy_from_slice(&((RTA_HDRLEN + 4) as u16).to_ne_bytes()); // rta_len
    req[at + 2..at + 4].copy_from_slice(&attr_type.to_ne_bytes()); // rta_type
    req[at + 4..at + 8].copy_from_slice(&attr);
    req
}

/// The error for an answer that does not parse.
fn invalid(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("rtnetlink answer: {what}"),
    )
}

/// The u16 at `at` in `b`, if `b` is long enough.
fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

/// The u32 at `at` in `b`, if `b` is long enough.
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

/// `n` rounded up to netlink's alignment, 4.
fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

/// Looks through the netlink messages of datagram `datagram` for the
/// answer to request `seq`: a message of type `answer` (where its payload
/// is) or an error. `None` if no message answers `seq`.
fn find_answer(datagram: &[u8], seq: u32, answer: u16) -> io::Result<Option<Answer>> {
    let mut at = 0;
    while at < datagram.len() {
        let (Some(len), Some(kind), Some(msg_seq)) = (
            u32_at(datagram, at),
            u16_at(datagram, at + 4),
            u32_at(datagram, at + 8),
        ) else {
            return Err(invalid("a truncated message header"));
        };
        let len = len as usize;
        if len < NLMSG_HDRLEN || len > datagram.len() - at {
            return Err(invalid("a message of a wrong length"));
        }
        let payload = at + NLMSG_HDRLEN..at + len;
        at = at.saturating_add(align4(len));
        if msg_seq != seq {
            continue;
        }
        match kind {
            NLMSG_ERROR => {
                // `struct nlmsgerr`: the error, then the request's header.
                let Some(error) = u32_at(datagram, payload.start) else {
                    return Err(invalid("a truncated error message"));
                };
                let error = error as i32;
                return match error.checked_neg() {
                    Some(errno) if errno > 0 => Ok(Some(Answer::Refused(errno))),
                    _ if error == 0 => Err(invalid("an acknowledgement instead of an answer")),
                    _ => Err(invalid("an error message with a bad error")),
                };
            }
            NLMSG_NOOP => continue,
            NLMSG_DONE => return Err(invalid("the end of a dump instead of an answer")),
            kind if kind == answer => return Ok(Some(Answer::Message(payload))),
            kind => return Err(invalid(&format!("a message of type {kind}"))),
        }
    }
    Ok(None)
}

/// Calls `f` with the type (flags masked off) and data of each attribute
/// in `attrs`, a message's attributes.
fn for_each_attr(attrs: &[u8], mut f: impl FnMut(u16, &[u8]) -> io::Result<()>) -> io::Result<()> {
    let mut at = 0;
    while at < attrs.len() {
        let (Some(len), Some(kind)) = (u16_at(attrs, at), u16_at(attrs, at + 2)) else {
            return Err(invalid("a truncated attribute header"));
        };
        let len = usize::from(len);
        if len < RTA_HDRLEN || len > attrs.len() - at {
            return Err(invalid("an attribute of a wrong length"));
        }
        f(
            kind & NLA_TYPE_MASK,
            attrs.get(at + RTA_HDRLEN..at + len).unwrap_or(&[]),
        )?;
        at = at.saturating_add(align4(len));
    }
    Ok(())
}

/// The four bytes of an IPv4 address or u32 attribute.
fn four(data: &[u8], what: &str) -> io::Result<[u8; 4]> {
    data.try_into()
        .map_err(|_| invalid(&format!("{what} of {} bytes", data.len())))
}

/// Reads an RTM_NEWROUTE's payload.
fn parse_route(msg: &[u8]) -> io::Result<Route> {
    let (Some(head), Some(attrs)) = (msg.get(..RTMSG_LEN), msg.get(RTMSG_LEN..)) else {
        return Err(invalid("a truncated route"));
    };
    if head.first().copied() != Some(libc::AF_INET as u8) {
        return Err(invalid("a route of another family"));
    }
    let mut route = Route {
        kind: head.get(RTM_TYPE).copied().unwrap_or(libc::RTN_UNSPEC),
        oif: None,
        gateway: Gateway::None,
    };
    for_each_attr(attrs, |kind, data| {
        match kind {
            libc::RTA_OIF => route.oif = Some(u32::from_ne_bytes(four(data, "an RTA_OIF")?)),
            libc::RTA_GATEWAY => {
                route.gateway = Gateway::V4(Ipv4Addr::from(four(data, "an RTA_GATEWAY")?))
            }
            RTA_VIA => route.gateway = Gateway::Other,
            _ => {}
        }
        Ok(())
    })?;
    Ok(route)
}

/// Reads an RTM_NEWNEIGH's payload, the answer about neighbor `addr` on
/// interface `ifindex`.
fn parse_neighbor(msg: &[u8], ifindex: u32, addr: Ipv4Addr) -> io::Result<NextHop> {
    let (Some(head), Some(attrs)) = (msg.get(..NDMSG_LEN), msg.get(NDMSG_LEN..)) else {
        return Err(invalid("a truncated neighbor"));
    };
    if head.first().copied() != Some(libc::AF_INET as u8) {
        return Err(invalid("a neighbor of another family"));
    }
    if u32_at(head, NDM_IFINDEX) != Some(ifindex) {
        return Err(invalid("a neighbor on another interface"));
    }
    let state = u16_at(head, NDM_STATE).unwrap_or(libc::NUD_NONE);
    let mut mac = None;
    for_each_attr(attrs, |kind, data| {
        match kind {
            libc::NDA_DST if Ipv4Addr::from(four(data, "an NDA_DST")?) != addr => {
                return Err(invalid("another neighbor"));
            }
            libc::NDA_LLADDR => mac = <[u8; 6]>::try_from(data).ok(),
            _ => {}
        }
        Ok(())
    })?;
    match mac {
        Some(mac) if state & NUD_VALID != 0 => Ok(NextHop::Mac(mac)),
        _ => Ok(NextHop::Unresolved),
    }
}

#[cfg(test)]
mod tests {
    use super::super::iface::tests::{in_netns, ip, sys_attr, try_ip};
    use super::*;

    /// The index of interface `name` in the current namespace.
    fn ifindex(name: &str) -> u32 {
        let s = sys_attr(name, "ifindex");
        s.parse()
            .unwrap_or_else(|e| panic!("{name}'s ifindex {s:?}: {e}"))
    }

    /// A network namespace (see [`in_netns`]) with two veth pairs: `va`
    /// (10.77.0.1/24), whose neighbors 10.77.0.2 (also the gateway of
    /// 10.88.0.0/16), .6 and .7 are known, and `vc` (10.99.0.1/24), and
    /// blackhole, prohibit and unreachable routes.
    fn with_links<T: Send>(f: impl FnOnce() -> T + Send) -> T {
        in_netns(|| {
            for cmd in [
                "link add va type veth peer name vb",
                "link add vc type veth peer name vd",
                "addr add 10.77.0.1/24 dev va",
                "addr add 10.99.0.1/24 dev vc",
                "link set va up",
                "link set vb up",
                "link set vc up",
                "link set vd up",
                "neigh add 10.77.0.2 lladdr 02:00:00:00:00:02 dev va nud permanent",
                "neigh add 10.77.0.6 lladdr 02:00:00:00:00:06 dev va nud reachable",
                "neigh add 10.77.0.7 lladdr 02:00:00:00:00:07 dev va nud stale",
                "neigh add 10.99.0.2 lladdr 02:00:00:00:00:99 dev vc nud permanent",
                "route add 10.88.0.0/16 via 10.77.0.2 dev va",
                "route add 10.89.0.0/16 via 10.99.0.2 dev vc",
                "route add blackhole 10.66.0.0/16",
                "route add prohibit 10.67.0.0/16",
                "route add unreachable 10.68.0.0/16",
            ] {
                ip(cmd);
            }
            f()
        })
    }

    fn mac(last: u8) -> NextHop {
        NextHop::Mac([2, 0, 0, 0, 0, last])
    }

    #[test]
    fn finds_next_hops() {
        with_links(|| {
            let mut n = Neighbors::open(ifindex("va")).unwrap();
            let hop = |n: &mut Neighbors, a: [u8; 4]| {
                n.next_hop(Ipv4Addr::from(a))
                    .unwrap_or_else(|e| panic!("next_hop({}): {e}", Ipv4Addr::from(a)))
            };
            // Neighbors on the link, permanent, reachable, stale.
            assert_eq!(hop(&mut n, [10, 77, 0, 2]), mac(2));
            assert_eq!(hop(&mut n, [10, 77, 0, 6]), mac(6));
            assert_eq!(hop(&mut n, [10, 77, 0, 7]), mac(7));
            // Through the gateway 10.77.0.2.
            assert_eq!(hop(&mut n, [10, 88, 1, 1]), mac(2));
            assert_eq!(hop(&mut n, [10, 88, 255, 254]), mac(2));
            // On the link, but no entry.
            assert_eq!(hop(&mut n, [10, 77, 0, 3]), NextHop::Unresolved);
            // Through the other interface, with or without a known MAC.
            assert_eq!(hop(&mut n, [10, 99, 0, 5]), NextHop::Elsewhere);
            assert_eq!(hop(&mut n, [10, 99, 0, 2]), NextHop::Elsewhere);
            assert_eq!(hop(&mut n, [10, 89, 0, 1]), NextHop::Elsewhere);
            // Local addresses.
            assert_eq!(hop(&mut n, [127, 0, 0, 1]), NextHop::Elsewhere);
            assert_eq!(hop(&mut n, [10, 77, 0, 1]), NextHop::Elsewhere);
            assert_eq!(hop(&mut n, [10, 99, 0, 1]), NextHop::Elsewhere);
            // Blackhole, prohibit, unreachable, no route at all.
            assert_eq!(hop(&mut n, [10, 66, 0, 1]), NextHop::Elsewhere);
            assert_eq!(hop(&mut n, [10, 67, 0, 1]), NextHop::Elsewhere);
            assert_eq!(hop(&mut n, [10, 68, 0, 1]), NextHop::Elsewhere);
            assert_eq!(hop(&mut n, [192, 0, 2, 1]), NextHop::Elsewhere);

            // Seen from vc.
            let mut c = Neighbors::open(ifindex("vc")).unwrap();
            assert_eq!(
                hop(&mut c, [10, 99, 0, 2]),
                NextHop::Mac([2, 0, 0, 0, 0, 0x99])
            );
            assert_eq!(
                hop(&mut c, [10, 89, 7, 7]),
                NextHop::Mac([2, 0, 0, 0, 0, 0x99])
            );
            assert_eq!(hop(&mut c, [10, 77, 0, 2]), NextHop::Elsewhere);

            // A neighbor that changes.
            ip("neigh replace 10.77.0.2 lladdr 02:00:00:00:00:22 dev va nud permanent");
            assert_eq!(hop(&mut n, [10, 88, 1, 1]), mac(0x22));
            ip("neigh del 10.77.0.2 dev va");
            assert_eq!(hop(&mut n, [10, 88, 1, 1]), NextHop::Unresolved);
        })
    }

    #[test]
    fn unresolved_entries() {
        with_links(|| {
            let mut n = Neighbors::open(ifindex("va")).unwrap();
            let mut states = 0;
            for (addr, nud) in [
                ([10, 77, 0, 4], "failed"),
                ([10, 77, 0, 5], "incomplete"),
                ([10, 77, 0, 8], "none"),
            ] {
                let (ok, stderr) = try_ip(&format!(
                    "neigh add {} dev va nud {nud}",
                    Ipv4Addr::from(addr)
                ));
                if !ok {
                    eprintln!("skipped a neighbor in state {nud}: ip refused: {stderr}");
                    continue;
                }
                states += 1;
                assert_eq!(
                    n.next_hop(Ipv4Addr::from(addr)).unwrap(),
                    NextHop::Unresolved,
                    "{nud}"
                );
            }
            assert!(states > 0, "ip made no neighbor entry without an address");

            // The kernel's own entry, made by sending to an address nobody
            // answers ARP for: INCOMPLETE, then FAILED.
            let udp = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            udp.send_to(b"x", "10.77.0.9:4791").unwrap();
            let (_, shown) = try_ip("neigh show 10.77.0.9 dev va");
            assert!(
                shown.contains("INCOMPLETE") || shown.contains("FAILED"),
                "the kernel made no entry for 10.77.0.9: {shown:?}"
            );
            assert_eq!(
                n.next_hop(Ipv4Addr::new(10, 77, 0, 9)).unwrap(),
                NextHop::Unresolved
            );
        })
    }

    #[test]
    fn skips_answers_to_earlier_requests() {
        with_links(|| {
            let mut n = Neighbors::open(ifindex("va")).unwrap();
            // Nothing queued: WouldBlock.
            assert_eq!(n.recv().unwrap_err().kind(), io::ErrorKind::WouldBlock);
            // Requests whose answers are never read (as if an earlier call
            // had failed between its sendto and its recvfrom), in separate
            // datagrams.
            for (seq, dst) in [(7000, [10, 77, 0, 6]), (7001, [10, 99, 0, 2])] {
                let mut ndmsg = [0u8; NDMSG_LEN];
                ndmsg[0] = libc::AF_INET as u8;
                ndmsg[NDM_IFINDEX..NDM_IFINDEX + 4].copy_from_slice(&n.ifindex.to_ne_bytes());
                n.send(&request(libc::RTM_GETNEIGH, seq, ndmsg, libc::NDA_DST, dst))
                    .unwrap();
            }
            assert_eq!(n.next_hop(Ipv4Addr::new(10, 77, 0, 2)).unwrap(), mac(2));
            assert_eq!(n.next_hop(Ipv4Addr::new(10, 77, 0, 7)).unwrap(), mac(7));
            assert_eq!(n.recv().unwrap_err().kind(), io::ErrorKind::WouldBlock);
        })
    }

    #[test]
    fn open_refuses_a_missing_interface() {
        in_netns(|| {
            let e = Neighbors::open(4_000_000).unwrap_err();
            assert_eq!(e.raw_os_error(), None);
            assert!(e.to_string().contains("4000000"), "{e}");
        })
    }

    /// A netlink message of type `kind` answering `seq` with `payload`.
    fn message(kind: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let len = NLMSG_HDRLEN + payload.len();
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(payload);
        m.resize(align4(m.len()), 0);
        m
    }

    /// An attribute.
    fn attr(kind: u16, data: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&((RTA_HDRLEN + data.len()) as u16).to_ne_bytes());
        a.extend_from_slice(&kind.to_ne_bytes());
        a.extend_from_slice(data);
        a.resize(align4(a.len()), 0);
        a
    }

    /// An error message answering `seq` with `error`.
    fn error(seq: u32, error: i32) -> Vec<u8> {
        let mut p = error.to_ne_bytes().to_vec();
        p.extend_from_slice(&[0; NLMSG_HDRLEN]);
        message(NLMSG_ERROR, seq, &p)
    }

    #[test]
    fn finds_answers_among_messages() {
        let new = libc::RTM_NEWROUTE;
        let mut d = error(4, -libc::ENOENT);
        d.extend(message(new, 4, &[1; 12]));
        d.extend(message(NLMSG_NOOP, 5, &[]));
        let start = d.len() + NLMSG_HDRLEN;
        d.extend(message(new, 5, &[2; 12]));
        assert_eq!(
            find_answer(&d, 5, new).unwrap(),
            Some(Answer::Message(start..start + 12))
        );
        assert_eq!(
            find_answer(&d, 4, new).unwrap(),
            Some(Answer::Refused(libc::ENOENT))
        );
        assert_eq!(find_answer(&d, 6, new).unwrap(), None);
        assert_eq!(find_answer(&[], 6, new).unwrap(), None);
        // An acknowledgement, DONE, another type, a positive error, the
        // most negative one.
        for bad in [
            error(5, 0),
            message(NLMSG_DONE, 5, &[0; 4]),
            message(libc::RTM_NEWNEIGH, 5, &[0; 12]),
            error(5, 3),
            error(5, i32::MIN),
            message(NLMSG_ERROR, 5, &[0; 2]),
        ] {
            let e = find_answer(&bad, 5, new).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        }
    }

    #[test]
    fn refuses_malformed_datagrams() {
        let good = message(libc::RTM_NEWROUTE, 5, &[2; 12]);
        // Every truncation of a good message, and of one after another
        // seq's message.
        let mut two = message(libc::RTM_NEWROUTE, 4, &[2; 12]);
        two.extend_from_slice(&good);
        for d in [&good, &two] {
            for cut in 1..d.len() {
                let r = find_answer(&d[..cut], 5, libc::RTM_NEWROUTE);
                if d == &two && cut == good.len() {
                    // Only the other seq's message, whole.
                    assert!(matches!(r, Ok(None)), "{r:?}");
                    continue;
                }
                assert!(
                    matches!(&r, Err(e) if e.kind() == io::ErrorKind::InvalidData),
                    "cut at {cut}: {r:?}"
                );
            }
        }
        // Lengths shorter than a header, longer than the datagram, huge.
        for len in [0u32, 15, 29, 4096, u32::MAX] {
            let mut d = good.clone();
            d[..4].copy_from_slice(&len.to_ne_bytes());
            assert!(find_answer(&d, 5, libc::RTM_NEWROUTE).is_err(), "{len}");
        }
    }

    /// An RTM_NEWROUTE payload.
    fn route_msg(kind: u8, attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut m = vec![libc::AF_INET as u8, 32, 0, 0, 254, 0, 0, kind, 0, 0, 0, 0];
        for a in attrs {
            m.extend_from_slice(a);
        }
        m
    }

    #[test]
    fn parses_routes() {
        let oif = attr(libc::RTA_OIF, &7u32.to_ne_bytes());
        let gw = attr(libc::RTA_GATEWAY, &[10, 0, 0, 1]);
        let table = attr(libc::RTA_TABLE, &254u32.to_ne_bytes());
        let nested = attr(libc::RTA_OIF | 0x8000, &9u32.to_ne_bytes());
        assert_eq!(
            parse_route(&route_msg(
                libc::RTN_UNICAST,
                &[table.clone(), oif.clone(), gw]
            ))
            .unwrap(),
            Route {
                kind: libc::RTN_UNICAST,
                oif: Some(7),
                gateway: Gateway::V4(Ipv4Addr::new(10, 0, 0, 1))
            }
        );
        assert_eq!(
            parse_route(&route_msg(libc::RTN_LOCAL, &[nested])).unwrap(),
            Route {
                kind: libc::RTN_LOCAL,
                oif: Some(9),
                gateway: Gateway::None
            }
        );
        let via = attr(RTA_VIA, &[0; 18]);
        assert_eq!(
            parse_route(&route_msg(libc::RTN_UNICAST, &[oif.clone(), via]))
                .unwrap()
                .gateway,
            Gateway::Other
        );
        // Wrong sizes, truncations, another family.
        let short_oif = attr(libc::RTA_OIF, &[7, 0]);
        assert!(parse_route(&route_msg(libc::RTN_UNICAST, &[short_oif])).is_err());
        let good = route_msg(libc::RTN_UNICAST, &[oif, table]);
        for cut in 0..good.len() {
            if cut == RTMSG_LEN || cut == RTMSG_LEN + 8 {
                assert!(parse_route(&good[..cut]).is_ok(), "{cut}");
            } else {
                assert!(parse_route(&good[..cut]).is_err(), "{cut}");
            }
        }
        let mut other = good.clone();
        other[0] = libc::AF_INET6 as u8;
        assert!(parse_route(&other).is_err());
        let mut zero_len = good.clone();
        zero_len[RTMSG_LEN..RTMSG_LEN + 2].copy_from_slice(&0u16.to_ne_bytes());
        assert!(parse_route(&zero_len).is_err());
    }

    /// An RTM_NEWNEIGH payload.
    fn neigh_msg(ifindex: u32, state: u16, attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut m = vec![libc::AF_INET as u8, 0, 0, 0];
        m.extend_from_slice(&ifindex.to_ne_bytes());
        m.extend_from_slice(&state.to_ne_bytes());
        m.extend_from_slice(&[0, 1]);
        for a in attrs {
            m.extend_from_slice(a);
        }
        m
    }

    #[test]
    fn parses_neighbors() {
        let a = Ipv4Addr::new(10, 0, 0, 2);
        let dst = attr(libc::NDA_DST, &a.octets());
        let ll = attr(libc::NDA_LLADDR, &[2, 0, 0, 0, 0, 2]);
        for state in [
            libc::NUD_REACHABLE,
            libc::NUD_STALE,
            libc::NUD_DELAY,
            libc::NUD_PROBE,
            libc::NUD_PERMANENT,
            libc::NUD_NOARP,
        ] {
            let m = neigh_msg(3, state, &[dst.clone(), ll.clone()]);
            assert_eq!(parse_neighbor(&m, 3, a).unwrap(), mac(2), "{state}");
        }
        for state in [libc::NUD_NONE, libc::NUD_INCOMPLETE, libc::NUD_FAILED] {
            let m = neigh_msg(3, state, &[dst.clone(), ll.clone()]);
            assert_eq!(
                parse_neighbor(&m, 3, a).unwrap(),
                NextHop::Unresolved,
                "{state}"
            );
        }
        // No address, or not an Ethernet one.
        let m = neigh_msg(3, libc::NUD_REACHABLE, std::slice::from_ref(&dst));
        assert_eq!(parse_neighbor(&m, 3, a).unwrap(), NextHop::Unresolved);
        let long = attr(libc::NDA_LLADDR, &[1; 20]);
        let m = neigh_msg(3, libc::NUD_REACHABLE, &[dst.clone(), long]);
        assert_eq!(parse_neighbor(&m, 3, a).unwrap(), NextHop::Unresolved);
        // Another interface, another neighbor, another family, truncated.
        let m = neigh_msg(3, libc::NUD_REACHABLE, &[dst.clone(), ll.clone()]);
        assert!(parse_neighbor(&m, 4, a).is_err());
        assert!(parse_neighbor(&m, 3, Ipv4Addr::new(10, 0, 0, 3)).is_err());
        let mut other = m.clone();
        other[0] = libc::AF_INET6 as u8;
        assert!(parse_neighbor(&other, 3, a).is_err());
        for cut in 0..m.len() {
            let r = parse_neighbor(&m[..cut], 3, a);
            if cut == NDMSG_LEN || cut == NDMSG_LEN + dst.len() {
                assert_eq!(r.unwrap(), NextHop::Unresolved, "{cut}");
            } else if cut >= NDMSG_LEN + dst.len() + RTA_HDRLEN + 6 {
                // The last attribute whole, without its padding.
                assert_eq!(r.unwrap(), mac(2), "{cut}");
            } else {
                assert!(r.is_err(), "{cut}");
            }
        }
    }

    #[test]
    fn builds_requests() {
        let r = request(
            libc::RTM_GETROUTE,
            0x0102_0304,
            [9; 12],
            libc::RTA_DST,
            [10, 0, 0, 1],
        );
        assert_eq!(u32_at(&r, 0), Some(REQ_LEN as u32));
        assert_eq!(u16_at(&r, 4), Some(libc::RTM_GETROUTE));
        assert_eq!(u16_at(&r, 6), Some(NLM_F_REQUEST));
        assert_eq!(u32_at(&r, 8), Some(0x0102_0304));
        assert_eq!(u32_at(&r, 12), Some(0));
        assert_eq!(&r[16..28], &[9; 12]);
        assert_eq!(u16_at(&r, 28), Some(8));
        assert_eq!(u16_at(&r, 30), Some(libc::RTA_DST));
        assert_eq!(&r[32..36], &[10, 0, 0, 1]);
    }
}
