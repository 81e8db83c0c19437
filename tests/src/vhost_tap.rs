//! A recording vhost-user proxy: it sits between a frontend (QEMU) and a
//! backend (vdev), forwards every message with its file descriptors
//! unchanged, and keeps a log of what each side sent. That log is how the
//! tests learn the exact message sequence a real VMM sends on boot, guest
//! reset, reboot and exit (and replay it with [`crate::vmm`]).
//!
//! Only the main channel is tapped: a backend-request channel the frontend
//! hands over (SET_BACKEND_REQ_FD) is an fd that travels through untouched.

use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::FrontendReq;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// vhost-user header: request, flags, payload size (all u32, little endian).
const HEADER_LEN: usize = 12;
/// The most fds one vhost-user message carries (the vhost crate's limit).
const MAX_FDS: usize = 32;
/// Header flag of a reply (backend to frontend).
const FLAG_REPLY: u32 = 0x4;
/// Header flag asking for a REPLY_ACK.
const FLAG_NEED_REPLY: u32 = 0x8;

/// Which side sent a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Frontend (VMM) to backend: requests.
    ToBackend,
    /// Backend to frontend: replies.
    ToFrontend,
}

/// One message as it crossed the tap.
#[derive(Debug, Clone)]
pub struct Message {
    pub direction: Direction,
    /// Which connection (0 for the first frontend, 1 after a reconnect ...).
    pub connection: usize,
    pub request: u32,
    pub flags: u32,
    pub payload: Vec<u8>,
    pub fds: usize,
    /// Time since the tap started.
    pub at: Duration,
}

impl Message {
    /// The request's name (`SET_VRING_BASE`), or its number if unknown.
    pub fn name(&self) -> String {
        match FrontendReq::try_from(self.request) {
            Ok(req) => format!("{req:?}"),
            Err(()) => format!("REQUEST_{}", self.request),
        }
    }

    /// Whether this is the frontend's request `req`.
    pub fn is(&self, req: FrontendReq) -> bool {
        self.direction == Direction::ToBackend && self.request == u32::from(req)
    }

    fn u32_at(&self, offset: usize) -> Option<u32> {
        let bytes = self.payload.get(offset..offset + 4)?;
        Some(u32::from_le_bytes(bytes.try_into().ok()?))
    }

    fn u64_at(&self, offset: usize) -> Option<u64> {
        let bytes = self.payload.get(offset..offset + 8)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    }

    /// The (index, num) pair of a vring-state message (SET_VRING_NUM,
    /// SET_VRING_BASE, GET_VRING_BASE, SET_VRING_ENABLE and its reply).
    pub fn vring_state(&self) -> Option<(u32, u32)> {
        Some((self.u32_at(0)?, self.u32_at(4)?))
    }

    /// The u64 payload of SET_FEATURES, SET_STATUS and similar.
    pub fn u64_payload(&self) -> Option<u64> {
        (self.payload.len() == 8).then(|| self.u64_at(0)).flatten()
    }

    /// What the payload says, for the messages whose payload matters when
    /// reading a sequence.
    fn detail(&self) -> String {
        use FrontendReq as R;
        let req = FrontendReq::try_from(self.request).ok();
        let reply = self.flags & FLAG_REPLY != 0;
        // A REPLY_ACK: 0 is success.
        if reply && self.payload.len() == 8 && self.flags & FLAG_NEED_REPLY == 0 {
            if let Some(
                R::SET_VRING_KICK
                | R::SET_VRING_CALL
                | R::SET_VRING_ERR
                | R::SET_VRING_NUM
                | R::SET_VRING_ADDR
                | R::SET_VRING_BASE
                | R::SET_VRING_ENABLE
                | R::SET_FEATURES
                | R::SET_MEM_TABLE
                | R::ADD_MEM_REG
                | R::REM_MEM_REG
                | R::SET_STATUS
                | R::RESET_DEVICE
                | R::SET_OWNER
                | R::SET_PROTOCOL_FEATURES
                | R::SET_CONFIG,
            ) = req
            {
                return format!("ack={}", self.u64_at(0).unwrap_or_default());
            }
        }
        match req {
            Some(
                R::SET_VRING_NUM | R::SET_VRING_BASE | R::GET_VRING_BASE | R::SET_VRING_ENABLE,
            ) if !reply || req == Some(R::GET_VRING_BASE) => match self.vring_state() {
                Some((index, num)) => format!("index={index} num={num}"),
                None => String::new(),
            },
            Some(R::SET_VRING_KICK | R::SET_VRING_CALL | R::SET_VRING_ERR) => {
                match self.u64_at(0) {
                    Some(v) => format!("index={} fd={}", v & 0xff, v & 0x100 == 0),
                    None => String::new(),
                }
            }
            Some(R::SET_VRING_ADDR) => match self.u32_at(0) {
                Some(index) => format!("index={index}"),
                None => String::new(),
            },
            Some(R::GET_CONFIG | R::SET_CONFIG) => match (self.u32_at(0), self.u32_at(4)) {
                (Some(offset), Some(size)) => format!("offset={offset} size={size}"),
                _ => String::new(),
            },
            Some(R::SET_MEM_TABLE) if !reply => match self.u32_at(0) {
                Some(regions) => format!("regions={regions}"),
                None => String::new(),
            },
            Some(R::ADD_MEM_REG | R::REM_MEM_REG) if !reply => {
                match (self.u64_at(8), self.u64_at(16)) {
                    (Some(gpa), Some(size)) => format!("gpa={gpa:#x} size={size:#x}"),
                    _ => String::new(),
                }
            }
            _ => match self.u64_payload() {
                Some(v) => format!("{v:#x}"),
                None => String::new(),
            },
        }
    }
}

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let arrow = match self.direction {
            Direction::ToBackend => "->",
            Direction::ToFrontend => "<-",
        };
        let ack = if self.flags & FLAG_NEED_REPLY != 0 {
            " need_reply"
        } else {
            ""
        };
        let fds = if self.fds > 0 {
            format!(" fds={}", self.fds)
        } else {
            String::new()
        };
        write!(
            f,
            "{:>8.3}s #{} {arrow} {}{ack}{fds} {}",
            self.at.as_secs_f64(),
            self.connection,
            self.name(),
            self.detail()
        )
    }
}

/// The running tap: listens on `socket`, connects each frontend it accepts
/// to `backend`, records everything in both directions. Stops on drop.
#[derive(Debug)]
pub struct VhostTap {
    socket: PathBuf,
    log: Arc<Mutex<Vec<Message>>>,
    listener: UnixListener,
    accept: Option<JoinHandle<()>>,
}

impl VhostTap {
    /// Listens on `socket` (removed first if it exists) and forwards to the
    /// vhost-user backend listening on `backend`.
    pub fn start(socket: &Path, backend: &Path) -> io::Result<Self> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let accepting = listener.try_clone()?;
        let backend = backend.to_path_buf();
        let shared = log.clone();
        let started = Instant::now();
        let accept = std::thread::Builder::new()
            .name("vhost-tap".into())
            .spawn(move || {
                for (connection, frontend) in accepting.incoming().enumerate() {
                    let Ok(frontend) = frontend else { return };
                    let Ok(backend) = UnixStream::connect(&backend) else {
                        return;
                    };
                    let pumps = (
                        frontend.try_clone(),
                        backend.try_clone(),
                        shared.clone(),
                        shared.clone(),
                    );
                    let (Ok(front2), Ok(back2), log1, log2) = pumps else {
                        return;
                    };
                    std::thread::spawn(move || {
                        pump(
                            frontend,
                            backend,
                            Direction::ToBackend,
                            connection,
                            started,
                            log1,
                        )
                    });
                    std::thread::spawn(move || {
                        pump(
                            back2,
                            front2,
                            Direction::ToFrontend,
                            connection,
                            started,
                            log2,
                        )
                    });
                }
            })?;
        Ok(VhostTap {
            socket: socket.to_path_buf(),
            log,
            listener,
            accept: Some(accept),
        })
    }

    /// Where frontends connect.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Everything recorded so far.
    pub fn messages(&self) -> Vec<Message> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many messages were recorded so far (a mark for [`VhostTap::since`]).
    pub fn len(&self) -> usize {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether nothing was recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The messages recorded after mark `from` (a [`VhostTap::len`]).
    pub fn since(&self, from: usize) -> Vec<Message> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.get(from..).map(<[Message]>::to_vec).unwrap_or_default()
    }

    /// Waits until `done` holds for the messages after `from`.
    pub fn wait_for(
        &self,
        from: usize,
        timeout: Duration,
        done: impl Fn(&[Message]) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if done(&self.since(from)) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for VhostTap {
    fn drop(&mut self) {
        // SAFETY: shutdown() on a socket fd this tap owns; it only wakes the
        // accept thread's blocking accept(), which then ends.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Renders messages one per line.
pub fn render(messages: &[Message]) -> String {
    messages.iter().map(|m| format!("{m}\n")).collect()
}

/// Forwards messages from `from` to `to` until either side closes, then
/// shuts both down so the other pump ends too.
fn pump(
    from: UnixStream,
    mut to: UnixStream,
    direction: Direction,
    connection: usize,
    started: Instant,
    log: Arc<Mutex<Vec<Message>>>,
) {
    while let Ok((header, fds)) = read_header(&from) {
        let word =
            |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        let (request, flags, size) = (word(0), word(4), word(8) as usize);
        let mut payload = vec![0u8; size];
        if (&from).read_exact(&mut payload).is_err() {
            break;
        }
        let mut bytes = header.to_vec();
        bytes.extend_from_slice(&payload);
        let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        let sent = if raw.is_empty() {
            to.write_all(&bytes).map(|()| bytes.len())
        } else {
            to.send_with_fds(&[&bytes[..]], &raw)
                .map_err(|e| io::Error::from_raw_os_error(e.errno()))
        };
        log.lock().unwrap_or_else(|p| p.into_inner()).push(Message {
            direction,
            connection,
            request,
            flags,
            payload,
            fds: fds.len(),
            at: started.elapsed(),
        });
        match sent {
            Ok(n) if n == bytes.len() => {}
            _ => break,
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// Reads one header and the fds that came with it.
fn read_header(from: &UnixStream) -> io::Result<([u8; HEADER_LEN], Vec<File>)> {
    let mut header = [0u8; HEADER_LEN];
    let mut raw = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: HEADER_LEN,
    }];
    // SAFETY: the iovec points at `header`, a live buffer of HEADER_LEN bytes
    // that any bytes may be written to.
    let (n, nfds) = unsafe { from.recv_with_fds(&mut iov, &mut raw) }
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    let fds = raw[..nfds]
        .iter()
        // SAFETY: recv_with_fds handed us ownership of the first nfds fds.
        .map(|&fd| unsafe { File::from_raw_fd(fd) })
        .collect();
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    if n < HEADER_LEN {
        let mut rest = from;
        rest.read_exact(&mut header[n..])?;
    }
    Ok((header, fds))
}
