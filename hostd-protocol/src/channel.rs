//! A unix `SOCK_SEQPACKET` channel: message boundaries kept by the kernel,
//! file descriptors passed with a message, peer credentials read from the
//! kernel (not from anything the peer says).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::messages::{self, MessageError, MAX_MESSAGE};

/// Most descriptors one message carries.
pub const MAX_FDS: usize = 32;

/// Why a channel operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("Socket operation failed")]
    Io(#[from] io::Error),
    #[error("Peer closed the channel")]
    Closed,
    #[error("Socket path {0:?} is too long for a unix socket")]
    PathTooLong(String),
    #[error("Message refused")]
    Message(#[from] MessageError),
}

/// The kernel's word on who is at the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

fn sockaddr(path: &Path) -> Result<(libc::sockaddr_un, libc::socklen_t), ChannelError> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(ChannelError::PathTooLong(path.display().to_string()));
    }
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory-safety preconditions; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `bind` or `connect`, the calls that take a socket address.
type AddressCall =
    unsafe extern "C" fn(libc::c_int, *const libc::sockaddr, libc::socklen_t) -> libc::c_int;

/// A new seqpacket socket, bound or connected (`call`) to `path`.
fn seqpacket_socket_at(path: &Path, call: AddressCall) -> Result<OwnedFd, ChannelError> {
    let fd = seqpacket_socket()?;
    let (addr, len) = sockaddr(path)?;
    // SAFETY: addr is a valid sockaddr_un of length len; fd is open.
    let rc = unsafe {
        call(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(fd)
}

/// A listening seqpacket socket.
#[derive(Debug)]
pub struct Listener {
    fd: OwnedFd,
}

/// Binds and listens on a temporary sibling of `path`, then renames it to
/// `path`, so that the socket file appears only once it accepts
/// connections. Whoever waits for the file (a supervisor, a vdev, QEMU)
/// would otherwise meet ECONNREFUSED in the window between `bind()` and
/// `listen()`. The rename replaces a stale socket file left by a previous
/// process.
pub fn bind_published<T, E: From<io::Error>>(
    path: &Path,
    bind_and_listen: impl FnOnce(&Path) -> Result<T, E>,
) -> Result<T, E> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let staging = path.with_file_name(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&staging);
    let listener = bind_and_listen(&staging)?;
    if let Err(e) = std::fs::rename(&staging, path) {
        let _ = std::fs::remove_file(&staging);
        return Err(e.into());
    }
    Ok(listener)
}

impl Listener {
    /// Binds `path` (replacing a stale socket file) and listens; `path`
    /// exists only once it is listening (see [`bind_published`]).
    pub fn bind(path: &Path) -> Result<Self, ChannelError> {
        bind_published(path, Self::bind_here)
    }

    fn bind_here(path: &Path) -> Result<Self, ChannelError> {
        let fd = seqpacket_socket_at(path, libc::bind)?;
        // SAFETY: fd is a bound socket.
        if unsafe { libc::listen(fd.as_raw_fd(), 64) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        Ok(Listener { fd })
    }

    /// Accepts one connection.
    pub fn accept(&self) -> Result<Channel, ChannelError> {
        // SAFETY: accept4 with null address arguments only returns a new fd.
        let fd = unsafe {
            libc::accept4(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        Ok(Channel::from_owned(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl From<OwnedFd> for Listener {
    /// A listening seqpacket socket another process bound and handed over
    /// (hostd's handover).
    fn from(fd: OwnedFd) -> Self {
        Listener { fd }
    }
}

impl Listener {
    /// Another descriptor of the listening socket (to hand it over).
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }
}

/// One end of a connected seqpacket channel.
#[derive(Debug)]
pub struct Channel {
    // A UnixStream over a SOCK_SEQPACKET fd: std's type only supplies the
    // fd plumbing (ScmSocket, shutdown); every message is one datagram.
    sock: UnixStream,
}

impl Channel {
    fn from_owned(fd: OwnedFd) -> Self {
        Channel {
            sock: UnixStream::from(fd),
        }
    }

    /// Connects to a listening channel at `path`.
    pub fn connect(path: &Path) -> Result<Self, ChannelError> {
        Ok(Channel::from_owned(seqpacket_socket_at(
            path,
            libc::connect,
        )?))
    }

    /// A connected pair (tests, in-process use).
    pub fn pair() -> Result<(Self, Self), ChannelError> {
        let mut fds = [0; 2];
        // SAFETY: fds has room for the two descriptors socketpair writes.
        let rc = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: both descriptors are fresh and owned by nobody else.
        let (a, b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok((Channel::from_owned(a), Channel::from_owned(b)))
    }

    /// The peer's pid, uid and gid as the kernel recorded them at connect.
    pub fn peer_cred(&self) -> Result<PeerCred, ChannelError> {
        // SAFETY: ucred is plain data; all-zero is a valid value.
        let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: cred/len describe a writable ucred; the fd is a socket.
        let rc = unsafe {
            libc::getsockopt(
                self.sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error().into());
        }
        Ok(PeerCred {
            pid: cred.pid,
            uid: cred.uid,
            gid: cred.gid,
        })
    }

    /// Sends one message with `fds` attached.
    pub fn send<T: Serialize>(&self, msg: &T, fds: &[RawFd]) -> Result<(), ChannelError> {
        self.send_bytes(&messages::encode(msg)?, fds)
    }

    /// Sends `bytes` as one message, as they are, with `fds` attached: what
    /// a peer that is not vrdma's code (a compromised vdev, a fuzzer playing
    /// one) can send.
    pub fn send_bytes(&self, bytes: &[u8], fds: &[RawFd]) -> Result<(), ChannelError> {
        // A signal handled by this process interrupts a blocked sendmsg
        // (EINTR) before anything was sent: try again, do not fail.
        loop {
            match self.sock.send_with_fds(&[bytes], fds) {
                Err(e) if e.errno() == libc::EINTR => continue,
                Err(e) => return Err(io::Error::from_raw_os_error(e.errno()).into()),
                Ok(_) => return Ok(()),
            }
        }
    }

    /// Receives one message and the descriptors that came with it. A message
    /// larger than [`MAX_MESSAGE`] is refused (its descriptors are closed).
    pub fn recv<T: DeserializeOwned>(&self) -> Result<(T, Vec<File>), ChannelError> {
        with_recv_buf(|buf| self.recv_into(buf))
    }

    fn recv_into<T: DeserializeOwned>(
        &self,
        buf: &mut [u8],
    ) -> Result<(T, Vec<File>), ChannelError> {
        let mut fds = [-1; MAX_FDS];
        let mut iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // A signal handled by this process interrupts a blocked recvmsg
        // (EINTR) before anything was received: wait again. Giving up would
        // end a healthy connection (hostd tears a vdev's device down when
        // its recv fails).
        let (len, nfds) = loop {
            // SAFETY: iov points at buf, which outlives the call; fds has
            // MAX_FDS slots for the descriptors the kernel installs.
            match unsafe { self.sock.recv_with_fds(&mut iov, &mut fds) } {
                Err(e) if e.errno() == libc::EINTR => continue,
                // The peer closed its end with messages of ours unread in
                // it (a hostd that exits with a context's journal pending
                // on the notification channel). The kernel reports that
                // once, before what the peer sent ahead of closing: read
                // on, for those messages and then the end.
                Err(e) if e.errno() == libc::ECONNRESET => continue,
                Err(e) => return Err(io::Error::from_raw_os_error(e.errno()).into()),
                Ok(received) => break received,
            }
        };
        let files: Vec<File> = fds[..nfds.min(MAX_FDS)]
            .iter()
            .filter(|&&fd| fd >= 0)
            // SAFETY: the kernel just installed these descriptors for us.
            .map(|&fd| unsafe { File::from_raw_fd(fd) })
            .collect();
        if len == 0 && nfds == 0 {
            return Err(ChannelError::Closed);
        }
        if len > MAX_MESSAGE {
            return Err(MessageError::TooLarge(len).into());
        }
        Ok((messages::decode(&buf[..len])?, files))
    }

    /// Sends a request and waits for its response.
    pub fn call<Q: Serialize, R: DeserializeOwned>(
        &self,
        request: &Q,
        fds: &[RawFd],
    ) -> Result<(R, Vec<File>), ChannelError> {
        self.send(request, fds)?;
        self.recv()
    }

    /// Sends one message without descriptors if the socket takes it now:
    /// `Ok(false)` where a blocking send would wait (the peer's buffer
    /// full), and nothing was sent.
    pub fn try_send<T: Serialize>(&self, msg: &T) -> Result<bool, ChannelError> {
        let bytes = messages::encode(msg)?;
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr().cast_mut().cast(),
            iov_len: bytes.len(),
        };
        // SAFETY: msghdr is plain data; all zeros is no name, no control.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        loop {
            // SAFETY: `hdr` names one iovec over `bytes`, both alive for the
            // call, which only reads them.
            let n = unsafe {
                libc::sendmsg(
                    self.sock.as_raw_fd(),
                    &hdr,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                return Ok(true);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(false),
                _ => return Err(e.into()),
            }
        }
    }

    /// The next message if one is there, without waiting (`None`: none
    /// yet). For messages that carry no descriptors: any that came are
    /// closed by the kernel (no room given for them).
    pub fn try_recv<T: DeserializeOwned>(&self) -> Result<Option<T>, ChannelError> {
        with_recv_buf(|buf| self.try_recv_into(buf))
    }

    fn try_recv_into<T: DeserializeOwned>(
        &self,
        buf: &mut [u8],
    ) -> Result<Option<T>, ChannelError> {
        loop {
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            // SAFETY: msghdr is plain data; all zeros is no name, no control.
            let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
            hdr.msg_iov = &mut iov;
            hdr.msg_iovlen = 1;
            // recvmsg, as `recv` (the sandboxes' filters allow it, not
            // recvfrom). SAFETY: `hdr` names one iovec over `buf`, writable
            // for its length, both alive for the call.
            let n = unsafe { libc::recvmsg(self.sock.as_raw_fd(), &mut hdr, libc::MSG_DONTWAIT) };
            let len = match usize::try_from(n) {
                Ok(0) => return Err(ChannelError::Closed),
                Ok(len) => len,
                Err(_) => {
                    let e = io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EINTR) => continue,
                        Some(libc::EAGAIN) => return Ok(None),
                        // As in `recv`: reported once, ahead of what the
                        // peer sent before it closed.
                        Some(libc::ECONNRESET) => continue,
                        _ => return Err(e.into()),
                    }
                }
            };
            if len > MAX_MESSAGE {
                return Err(MessageError::TooLarge(len).into());
            }
            return Ok(Some(messages::decode(&buf[..len])?));
        }
    }

    /// A second handle on this end (a duplicated descriptor).
    pub fn try_clone(&self) -> io::Result<Channel> {
        Ok(Channel {
            sock: self.sock.try_clone()?,
        })
    }

    /// Shuts both directions down, waking a peer blocked in `recv`.
    pub fn shutdown(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

/// Runs `f` on this thread's receive buffer ([`MAX_MESSAGE`] + 1 bytes).
/// One buffer per thread, kept: a fresh zeroed 64 KiB per message (page
/// faults and a memset on every verb's round trip) was a measurable part
/// of a control call.
fn with_recv_buf<R>(f: impl FnOnce(&mut [u8]) -> R) -> R {
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.resize(MAX_MESSAGE + 1, 0);
        f(&mut buf)
    })
}

impl From<OwnedFd> for Channel {
    /// A channel over a connected `SOCK_SEQPACKET` socket received from the
    /// peer (e.g. hostd's notification channel).
    fn from(fd: OwnedFd) -> Self {
        Channel::from_owned(fd)
    }
}

impl AsRawFd for Channel {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{Request, Response};
    use std::io::{Read, Seek, Write};

    #[test]
    fn messages_and_fds_cross() {
        let (a, b) = Channel::pair().expect("pair");
        let mut file = tempfile_with(b"hello");
        a.send(&Request::RemoveMemory { slot: 3 }, &[file.as_raw_fd()])
            .expect("send");
        let (req, mut files): (Request, _) = b.recv().expect("recv");
        assert_eq!(req, Request::RemoveMemory { slot: 3 });
        assert_eq!(files.len(), 1);
        let mut text = String::new();
        files[0].rewind().expect("seek");
        files[0].read_to_string(&mut text).expect("read");
        assert_eq!(text, "hello");
        file.write_all(b"!").expect("write");
        b.send(&Response::Ok, &[]).expect("reply");
        let (resp, fds): (Response, _) = a.recv().expect("reply");
        assert_eq!((resp, fds.len()), (Response::Ok, 0));
        assert_eq!(b.peer_cred().expect("cred").pid, std::process::id() as i32);
    }

    #[test]
    fn closed_and_garbage_are_errors() {
        let (a, b) = Channel::pair().expect("pair");
        a.sock
            .send_with_fds(&[b"{not json".as_slice()], &[])
            .expect("send");
        assert!(matches!(b.recv::<Request>(), Err(ChannelError::Message(_))));
        drop(a);
        assert!(matches!(b.recv::<Request>(), Err(ChannelError::Closed)));
    }

    #[test]
    fn try_recv_takes_what_is_there_and_never_waits() {
        let (a, b) = Channel::pair().expect("pair");
        assert!(matches!(b.try_recv::<Response>(), Ok(None)));
        a.send(&Response::QpState { state: 3 }, &[]).expect("send");
        a.send(&Response::Ok, &[]).expect("send");
        assert_eq!(
            b.try_recv::<Response>().expect("first"),
            Some(Response::QpState { state: 3 })
        );
        assert_eq!(
            b.try_recv::<Response>().expect("second"),
            Some(Response::Ok)
        );
        assert!(matches!(b.try_recv::<Response>(), Ok(None)));
        a.sock
            .send_with_fds(&[b"{not json".as_slice()], &[])
            .expect("send");
        assert!(matches!(
            b.try_recv::<Response>(),
            Err(ChannelError::Message(_))
        ));
        drop(a);
        assert!(matches!(
            b.try_recv::<Response>(),
            Err(ChannelError::Closed)
        ));
    }

    #[test]
    fn a_peer_gone_with_our_messages_unread_leaves_its_own_to_read() {
        let (a, b) = Channel::pair().expect("pair");
        // b's journal, which a never read: a's close resets b's end. What a
        // sent before (a hostd's handover notice) is still b's to read.
        assert!(b.try_send(&Request::Release).expect("try_send"));
        a.send(&Response::Ok, &[]).expect("send");
        drop(a);
        assert!(matches!(b.recv::<Response>(), Ok((Response::Ok, _))));
        assert!(matches!(b.recv::<Response>(), Err(ChannelError::Closed)));
    }

    extern "C" fn ignore_signal(_: libc::c_int) {}

    /// A signal with a handler (installed without SA_RESTART, as libFuzzer
    /// and many runtimes do) delivered to a thread blocked in `recv` used to
    /// end the channel with EINTR; hostd then dropped a healthy vdev.
    #[test]
    fn a_signal_does_not_break_a_blocked_recv() {
        // SAFETY: sigaction is plain data; all-zero is a valid value.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = ignore_signal as extern "C" fn(libc::c_int) as usize;
        // SAFETY: installs a handler that does nothing for SIGUSR2, which
        // no other test of this crate uses; no SA_RESTART.
        let rc = unsafe { libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()) };
        assert_eq!(rc, 0, "sigaction");
        let (a, b) = Channel::pair().expect("pair");
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let receiver = std::thread::spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            tid_tx.send(unsafe { libc::pthread_self() }).expect("tid");
            b.recv::<Request>().map(|(req, _)| req)
        });
        let tid = tid_rx.recv().expect("tid");
        // Interrupt the receiver a few times while it waits.
        for _ in 0..5 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            // SAFETY: the thread is alive (it waits for our message).
            assert_eq!(unsafe { libc::pthread_kill(tid, libc::SIGUSR2) }, 0);
        }
        a.send(&Request::RemoveMemory { slot: 7 }, &[])
            .expect("send");
        let got = receiver.join().expect("receiver thread");
        assert_eq!(
            got.expect("recv survives signals"),
            Request::RemoveMemory { slot: 7 }
        );
    }

    /// The socket file appears only once it listens; a stale file is
    /// replaced; a failed bind leaves neither the staging file nor `path`.
    #[test]
    fn a_listener_is_published_only_once_it_listens() {
        let dir = std::env::temp_dir().join(format!("vrdma-publish-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("scratch dir");
        let path = dir.join("hostd.sock");
        std::fs::write(&path, b"stale").expect("stale file");
        let listener = bind_published(&path, |staging| {
            assert_ne!(staging, path.as_path());
            assert_eq!(staging.parent(), path.parent());
            let listener = Listener::bind_here(staging)?;
            // Bound and listening, but not yet under its name: whoever
            // waits for `path` still sees the stale file.
            assert_eq!(std::fs::read(&path).expect("stale"), b"stale");
            Ok::<_, ChannelError>(listener)
        })
        .expect("bind");
        let client = Channel::connect(&path).expect("connect right after bind");
        let server = listener.accept().expect("accept");
        client
            .send(&Request::RemoveMemory { slot: 1 }, &[])
            .expect("send");
        let (req, _): (Request, _) = server.recv().expect("recv");
        assert_eq!(req, Request::RemoveMemory { slot: 1 });
        let entries = std::fs::read_dir(&dir).expect("dir").count();
        assert_eq!(entries, 1, "the staging file was renamed, not left behind");

        let other = dir.join("other.sock");
        let failed = bind_published(&other, |_| {
            Err::<(), _>(ChannelError::Io(io::Error::from_raw_os_error(libc::EACCES)))
        });
        assert!(matches!(failed, Err(ChannelError::Io(_))));
        assert!(!other.exists());
        assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 1);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    fn tempfile_with(data: &[u8]) -> File {
        let name = std::ffi::CString::new("chan-test").expect("name");
        // SAFETY: valid NUL-terminated name; result checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh descriptor.
        let mut file = unsafe { File::from_raw_fd(fd) };
        file.write_all(data).expect("write");
        file
    }
}
