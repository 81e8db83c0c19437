//! An AF_PACKET raw socket bound to one interface, promiscuous, that
//! receives every frame arriving on it (not those sent from this host) with
//! the kernel's note on whether the frame's checksum was left for the NIC
//! to fill in (`PACKET_AUXDATA`), and sends whole frames out of it.

use std::ffi::CString;
use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Socket buffers asked for (root may exceed `rmem_max`): a burst of small
/// frames must not overflow them while the relay is busy.
const BUFFER_BYTES: libc::c_int = 8 << 20;

/// `TP_STATUS_CSUMNOTREADY`: the frame's transport checksum is partial
/// (`CHECKSUM_PARTIAL`, to be completed by the NIC it would have left by).
const TP_STATUS_CSUMNOTREADY: u32 = 1 << 3;

/// A frame received: its length and whether its checksum is to be completed.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub len: usize,
    pub csum_not_ready: bool,
}

/// The raw socket of one interface.
#[derive(Debug)]
pub struct PacketSocket {
    fd: OwnedFd,
    pub name: String,
}

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn setsockopt<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` points to a live T of the size given; setsockopt
    // reads it and nothing else.
    check(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (value as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    })
    .map(drop)
}

impl PacketSocket {
    /// Opens the socket of interface `name` (which must exist and be up),
    /// non-blocking.
    pub fn open(name: &str) -> io::Result<Self> {
        let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `cname` is a valid NUL-terminated string.
        let index = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if index == 0 {
            return Err(io::Error::last_os_error());
        }
        // Protocol 0: the socket receives nothing until bound to the
        // interface with ETH_P_ALL below, so no frame of another interface
        // slips in between.
        // SAFETY: socket(2) with constant arguments; the fd it returns is
        // owned below.
        let raw = check(unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        })?;
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let all = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: all-zero is a valid sockaddr_ll.
        let mut addr: libc::sockaddr_ll = unsafe { zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = all;
        addr.sll_ifindex = index as libc::c_int;
        // SAFETY: `addr` is a live sockaddr_ll of the size given.
        check(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        })?;
        // SAFETY: all-zero is a valid packet_mreq.
        let mut mreq: libc::packet_mreq = unsafe { zeroed() };
        mreq.mr_ifindex = index as libc::c_int;
        mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
        let raw = fd.as_raw_fd();
        setsockopt(raw, libc::SOL_PACKET, libc::PACKET_ADD_MEMBERSHIP, &mreq)?;
        setsockopt(
            raw,
            libc::SOL_PACKET,
            libc::PACKET_AUXDATA,
            &1 as &libc::c_int,
        )?;
        // Frames this host sends on the interface (the relay's own) are
        // not received again.
        setsockopt(
            raw,
            libc::SOL_PACKET,
            libc::PACKET_IGNORE_OUTGOING,
            &1 as &libc::c_int,
        )?;
        // Best effort: the defaults still work, with less slack.
        let _ = setsockopt(raw, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &BUFFER_BYTES);
        let _ = setsockopt(raw, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, &BUFFER_BYTES);
        Ok(Self {
            fd,
            name: name.into(),
        })
    }

    /// Receives one frame into `buf` (truncated to it); `None` when none waits.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Option<Received>> {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // u64 elements: aligned for cmsghdr.
        let mut control = [0u64; 16];
        let mut from: libc::sockaddr_ll =
            // SAFETY: all-zero is a valid sockaddr_ll.
            unsafe { zeroed() };
        // SAFETY: all-zero is a valid msghdr (null pointers, zero lengths).
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_name = (&mut from as *mut libc::sockaddr_ll).cast();
        msg.msg_namelen = size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of::<[u64; 16]>();
        // SAFETY: every pointer in `msg` refers to a live buffer of the
        // length given, which recvmsg may write.
        let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, libc::MSG_TRUNC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(e),
            };
        }
        let mut csum_not_ready = false;
        // SAFETY: `msg` was filled by recvmsg: its control buffer holds
        // msg_controllen bytes of well-formed cmsgs, which these macros
        // walk without going past it.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_PACKET
                    && (*cmsg).cmsg_type == libc::PACKET_AUXDATA
                {
                    let aux: libc::tpacket_auxdata =
                        std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                    csum_not_ready = aux.tp_status & TP_STATUS_CSUMNOTREADY != 0;
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        if from.sll_pkttype == libc::PACKET_OUTGOING {
            return Ok(None);
        }
        Ok(Some(Received {
            len: (n as usize).min(buf.len()),
            csum_not_ready,
        }))
    }

    /// Frames the kernel dropped because this socket's receive buffer was
    /// full, since the last call (the kernel resets its count when read).
    pub fn take_drops(&self) -> io::Result<u64> {
        // SAFETY: all-zero is a valid tpacket_stats.
        let mut stats: libc::tpacket_stats = unsafe { zeroed() };
        let mut len = size_of::<libc::tpacket_stats>() as libc::socklen_t;
        // SAFETY: `stats` and `len` are live and describe a buffer of that
        // length, which getsockopt fills.
        check(unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                (&mut stats as *mut libc::tpacket_stats).cast(),
                &mut len,
            )
        })?;
        Ok(u64::from(stats.tp_drops))
    }

    /// Sends `frame` out of the interface.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: `frame` is a live buffer of the length given.
        let n = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl AsRawFd for PacketSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
