//! The smallest HTTP/1.1 client etcd's JSON gateway needs: a POST of a
//! JSON body over a fresh TCP connection (`Connection: close`), and its
//! response read whole or, for streams (`/v3/watch`), piece by piece.
//!
//! Hand-written on std's `TcpStream` to keep hostd free of an HTTP stack
//! (and its system calls: the directory thread's seccomp role lists what
//! this code makes). Plain HTTP only: etcd with TLS needs a proxy on the
//! host (documented limit).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::time::{Duration, Instant};

/// Largest response body read whole (a range read of the whole prefix).
pub const MAX_BODY: usize = 64 << 20;
/// Largest status line and headers.
const MAX_HEAD: usize = 64 << 10;

/// Why an HTTP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("Cannot connect to {addr}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("I/O with {addr} failed")]
    Io {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("{addr} answered HTTP {status}: {body}")]
    Status {
        addr: SocketAddr,
        status: u16,
        body: String,
    },
    #[error("Malformed HTTP response from {addr}: {what}")]
    Malformed {
        addr: SocketAddr,
        what: &'static str,
    },
    #[error("Response from {addr} larger than {MAX_BODY} bytes")]
    TooLarge { addr: SocketAddr },
    #[error("{addr} closed the connection")]
    Closed { addr: SocketAddr },
}

impl HttpError {
    /// Whether this is a read timeout on a stream (nothing arrived), not a
    /// failure.
    pub fn is_timeout(&self) -> bool {
        matches!(self, HttpError::Io { source, .. }
            if matches!(source.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }
}

/// How the body of a response is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Chunked,
    Length(usize),
    UntilClose,
}

/// A response being read: its body, piece by piece.
#[derive(Debug)]
pub struct Response {
    addr: SocketAddr,
    /// Non-blocking: every wait is a `poll` with a timeout.
    sock: TcpStream,
    /// Longest wait for bytes.
    timeout: Duration,
    /// Bytes received and not yet taken.
    raw: Vec<u8>,
    framing: Framing,
    /// The body has ended.
    done: bool,
}

/// POSTs `body` (JSON) to `path` at `addr` and returns the response once
/// its status line and headers are read (a status other than 2xx is an
/// error carrying the body). Every read and write waits at most `timeout`.
pub fn post(
    addr: SocketAddr,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    let deadline = Instant::now() + timeout;
    let sock = connect(addr, deadline).map_err(|source| HttpError::Connect { addr, source })?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    let mut sent = 0;
    while sent < request.len() {
        match (&sock).write(&request[sent..]) {
            Ok(0) => return Err(HttpError::Closed { addr }),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(&sock, libc::POLLOUT, deadline)
                .map_err(|source| HttpError::Io { addr, source })?,
            Err(source) => return Err(HttpError::Io { addr, source }),
        }
    }
    let mut response = Response {
        addr,
        sock,
        timeout,
        raw: Vec::new(),
        framing: Framing::UntilClose,
        done: false,
    };
    let status = response.read_head()?;
    if !(200..300).contains(&status) {
        let body = response.body().unwrap_or_default();
        let body = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
        return Err(HttpError::Status { addr, status, body });
    }
    Ok(response)
}

/// POSTs `body` to `path` and reads the whole response body.
pub fn post_read(
    addr: SocketAddr,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, HttpError> {
    post(addr, path, body, timeout)?.body()
}

/// A non-blocking TCP connection to `addr`, made by `deadline`.
///
/// By hand rather than `TcpStream::connect_timeout`, which switches the
/// socket's mode with `ioctl(FIONBIO)`, a call no hostd thread may make:
/// the socket is created non-blocking and stays so (every wait is a
/// `poll`), so the directory thread's seccomp role needs `socket`,
/// `connect`, `poll`, `getsockopt(SO_ERROR)`, `sendto` and `recvfrom` only.
fn connect(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let SocketAddr::V4(v4) = addr else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "IPv6 etcd endpoints are not supported",
        ));
    };
    // SAFETY: socket takes integer arguments only.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let sock = unsafe { TcpStream::from_raw_fd(fd) };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*v4.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sin` is a valid sockaddr_in of the length given, read only
    // during the call.
    let rc = unsafe {
        libc::connect(
            sock.as_raw_fd(),
            std::ptr::addr_of!(sin).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        wait(&sock, libc::POLLOUT, deadline)?;
        if let Some(e) = sock.take_error()? {
            return Err(e);
        }
    }
    Ok(sock)
}

/// Waits until `sock` is ready for `events` (`POLLIN`, `POLLOUT`), at
/// most until `deadline` (then a `TimedOut` error).
fn wait(sock: &TcpStream, events: libc::c_short, deadline: Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        let mut fd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd, for the duration of the call.
        let rc = unsafe { libc::poll(&mut fd, 1, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if rc > 0 {
            // Ready, or an error or hang-up the next call reports.
            return Ok(());
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

impl Response {
    /// Reads more bytes into `raw`; `false` at end of stream.
    fn fill(&mut self) -> Result<bool, HttpError> {
        let mut buf = [0u8; 16 * 1024];
        let deadline = Instant::now() + self.timeout;
        let addr = self.addr;
        loop {
            match (&self.sock).read(&mut buf) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.raw.extend_from_slice(&buf[..n]);
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait(&self.sock, libc::POLLIN, deadline)
                        .map_err(|source| HttpError::Io { addr, source })?
                }
                Err(source) => return Err(HttpError::Io { addr, source }),
            }
        }
    }

    /// Reads the status line and headers; returns the status.
    fn read_head(&mut self) -> Result<u16, HttpError> {
        let addr = self.addr;
        let malformed = |what| HttpError::Malformed { addr, what };
        let end = loop {
            if let Some(end) = find(&self.raw, b"\r\n\r\n") {
                break end;
            }
            if self.raw.len() > MAX_HEAD {
                return Err(malformed("headers too long"));
            }
            if !self.fill()? {
                return Err(HttpError::Closed { addr });
            }
        };
        let head = std::str::from_utf8(&self.raw[..end])
            .map_err(|_| malformed("headers are not UTF-8"))?
            .to_owned();
        self.raw.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let mut parts = status_line.split(' ');
        if !parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) {
            return Err(malformed("not an HTTP/1.x status line"));
        }
        let status = parts
            .next()
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| malformed("no status code"))?;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                return Err(malformed("header without a colon"));
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("transfer-encoding") {
                if value.eq_ignore_ascii_case("chunked") {
                    self.framing = Framing::Chunked;
                } else {
                    return Err(malformed("unsupported transfer encoding"));
                }
            } else if name.eq_ignore_ascii_case("content-length")
                && self.framing != Framing::Chunked
            {
                let n = value
                    .parse::<usize>()
                    .map_err(|_| malformed("bad Content-Length"))?;
                if n > MAX_BODY {
                    return Err(HttpError::TooLarge { addr });
                }
                self.framing = Framing::Length(n);
            }
        }
        if self.framing == Framing::Length(0) {
            self.done = true;
        }
        Ok(status)
    }

    /// The next piece of the body as it arrives (for chunked responses,
    /// one chunk); `None` once the body has ended. A read timeout returns
    /// an error for which [`HttpError::is_timeout`] holds, and loses
    /// nothing: call again.
    pub fn next_piece(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        let addr = self.addr;
        loop {
            if let Some(piece) = self.take()? {
                return Ok(Some(piece));
            }
            if self.done {
                return Ok(None);
            }
            if !self.fill()? {
                return match self.framing {
                    Framing::UntilClose => {
                        self.done = true;
                        Ok(None)
                    }
                    _ => Err(HttpError::Closed { addr }),
                };
            }
        }
    }

    /// Takes a whole piece from `raw`, if one is there.
    fn take(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        let addr = self.addr;
        match self.framing {
            _ if self.done => Ok(None),
            Framing::UntilClose if self.raw.is_empty() => Ok(None),
            Framing::UntilClose => Ok(Some(std::mem::take(&mut self.raw))),
            Framing::Length(_) if self.raw.is_empty() => Ok(None),
            Framing::Length(rest) => {
                let n = rest.min(self.raw.len());
                let piece: Vec<u8> = self.raw.drain(..n).collect();
                self.framing = Framing::Length(rest - n);
                self.done = rest == n;
                Ok(Some(piece))
            }
            Framing::Chunked => {
                let Some(eol) = find(&self.raw, b"\r\n") else {
                    if self.raw.len() > 1024 {
                        return Err(HttpError::Malformed {
                            addr,
                            what: "chunk size line too long",
                        });
                    }
                    return Ok(None);
                };
                let line = std::str::from_utf8(&self.raw[..eol]).ok();
                let size = line
                    .map(|l| l.split(';').next().unwrap_or_default().trim())
                    .and_then(|s| usize::from_str_radix(s, 16).ok())
                    .ok_or(HttpError::Malformed {
                        addr,
                        what: "bad chunk size",
                    })?;
                if size > MAX_BODY {
                    return Err(HttpError::TooLarge { addr });
                }
                if size == 0 {
                    // Trailers, if any, are not read: the connection closes.
                    self.done = true;
                    self.raw.clear();
                    return Ok(None);
                }
                let start = eol + 2;
                if self.raw.len() < start + size + 2 {
                    return Ok(None);
                }
                if &self.raw[start + size..start + size + 2] != b"\r\n" {
                    return Err(HttpError::Malformed {
                        addr,
                        what: "chunk not followed by CRLF",
                    });
                }
                let piece = self.raw[start..start + size].to_vec();
                self.raw.drain(..start + size + 2);
                Ok(Some(piece))
            }
        }
    }

    /// The rest of the body, whole.
    pub fn body(mut self) -> Result<Vec<u8>, HttpError> {
        let mut body = Vec::new();
        while let Some(piece) = self.next_piece()? {
            if body.len() + piece.len() > MAX_BODY {
                return Err(HttpError::TooLarge { addr: self.addr });
            }
            body.extend_from_slice(&piece);
        }
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Serves one connection: reads the request head and body, answers
    /// `response` in `parts` (with a pause between them), returns the
    /// request.
    fn serve_once(response: Vec<Vec<u8>>) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let thread = std::thread::spawn(move || {
            let (mut sock, _) = listener.accept().expect("accept");
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&request).contains("{}") {
                let n = sock.read(&mut buf).expect("read");
                assert_ne!(n, 0, "request cut short");
                request.extend_from_slice(&buf[..n]);
            }
            for part in response {
                sock.write_all(&part).expect("write");
                std::thread::sleep(Duration::from_millis(20));
            }
            String::from_utf8_lossy(&request).into_owned()
        });
        (addr, thread)
    }

    #[test]
    fn chunked_and_sized_bodies_are_read_across_reads() {
        let parts = vec![
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel".to_vec(),
            b"lo\r\n6;ext=1\r\n world\r\n".to_vec(),
            b"0\r\n\r\n".to_vec(),
        ];
        let (addr, server) = serve_once(parts);
        let mut r = post(addr, "/v3/watch", b"{}", Duration::from_secs(5)).expect("post");
        assert_eq!(r.next_piece().expect("1").as_deref(), Some(&b"hello"[..]));
        assert_eq!(r.next_piece().expect("2").as_deref(), Some(&b" world"[..]));
        assert_eq!(r.next_piece().expect("end"), None);
        let request = server.join().expect("server");
        assert!(
            request.starts_with("POST /v3/watch HTTP/1.1\r\n")
                && request.contains("Content-Length: 2\r\n")
                && request.ends_with("\r\n\r\n{}"),
            "{request:?}"
        );
        let (addr, server) = serve_once(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n{\"a\"".to_vec(),
            b":1}".to_vec(),
        ]);
        let body = post_read(addr, "/v3/kv/range", b"{}", Duration::from_secs(5)).expect("body");
        assert_eq!(body, b"{\"a\":1}");
        server.join().expect("server");
    }

    #[test]
    fn errors_are_reported() {
        let (addr, server) = serve_once(vec![
            b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nbad request".to_vec(),
        ]);
        let err = post_read(addr, "/x", b"{}", Duration::from_secs(5)).expect_err("400");
        assert!(
            matches!(&err, HttpError::Status { status: 400, body, .. } if body == "bad request"),
            "{err}"
        );
        server.join().expect("server");
        let (addr, server) = serve_once(vec![
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".to_vec(),
        ]);
        let err = post_read(addr, "/x", b"{}", Duration::from_secs(5)).expect_err("bad chunk");
        assert!(matches!(err, HttpError::Malformed { .. }), "{err}");
        server.join().expect("server");
        let (addr, server) = serve_once(vec![
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort".to_vec(),
        ]);
        let err = post_read(addr, "/x", b"{}", Duration::from_secs(5)).expect_err("cut");
        assert!(matches!(err, HttpError::Closed { .. }), "{err}");
        server.join().expect("server");
        // Nobody listening.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let err = post_read(addr, "/x", b"{}", Duration::from_secs(1)).expect_err("refused");
        assert!(matches!(err, HttpError::Connect { .. }), "{err}");
    }
}
