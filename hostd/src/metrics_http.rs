//! Prometheus metrics over HTTP: `GET /metrics` on the operator's opt-in
//! address (`metrics_listen`, `--metrics-listen`), the same text as
//! `vrdmactl metrics` ([`crate::stats::render_prometheus`]).
//!
//! The listener is bound before the sandbox (no role may bind); one thread
//! of its own seccomp role ([`crate::seccomp::Role::Metrics`]: accept and
//! the common read, write and close, nothing else) serves one scrape at a
//! time. Every byte a client sends is untrusted: the request head is read
//! into a bounded buffer within a timeout (set on the listener, inherited
//! by each connection), only `GET` and `HEAD` of `/metrics` are answered,
//! and anything else gets its HTTP status, never a panic. Serving one
//! connection at a time bounds what a client can hold to one thread for
//! one timeout; scrapes are seconds apart.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use crate::seccomp::{Role, Threads};
use crate::server::Server;
use crate::stats::render_prometheus;

/// The longest request head read (request line and headers).
const MAX_HEAD: usize = 8 * 1024;
/// How much of a longer head is read (and dropped) to find its end, so
/// that the 431 answer reaches a client still sending (closing with its
/// bytes unread would reset the connection first).
const MAX_DISCARD: usize = 64 * 1024;
/// How long a client may take to send its request or read the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// The exposition format's content type (text format 0.0.4).
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Why the metrics endpoint cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("Cannot listen for metrics scrapes on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("Cannot set the metrics listener's timeouts")]
    Timeouts(#[source] io::Error),
    #[error("The metrics listener handed over is not a bound TCP socket")]
    HandedOver(#[source] io::Error),
}

/// The bound endpoint: its listener and the address it got (port 0 asks
/// for any; asking later would take a call no role may make).
#[derive(Debug)]
pub struct Endpoint {
    listener: TcpListener,
    pub addr: SocketAddr,
}

/// Binds `addr` (before the sandbox) with send and receive timeouts that
/// every accepted connection inherits.
pub fn bind(addr: SocketAddr) -> Result<Endpoint, MetricsError> {
    let bind_error = |source| MetricsError::Bind { addr, source };
    let listener = TcpListener::bind(addr).map_err(bind_error)?;
    for option in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        set_timeout(&listener, option, IO_TIMEOUT).map_err(MetricsError::Timeouts)?;
    }
    let addr = listener.local_addr().map_err(bind_error)?;
    Ok(Endpoint { listener, addr })
}

/// The endpoint of a listener a previous hostd bound and handed over.
pub fn adopt(listener: TcpListener) -> Result<Endpoint, MetricsError> {
    let addr = listener.local_addr().map_err(MetricsError::HandedOver)?;
    Ok(Endpoint { listener, addr })
}

impl Endpoint {
    /// A descriptor of its listener, for a handover.
    pub fn listener_fd(&self) -> io::Result<std::os::fd::OwnedFd> {
        Ok(self.listener.try_clone()?.into())
    }
}

fn set_timeout(listener: &TcpListener, option: libc::c_int, t: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(t.subsec_micros()),
    };
    // SAFETY: a valid socket, and a timeval of the size passed.
    let r = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            std::ptr::from_ref(&tv).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Serves scrapes on a thread of the metrics role.
pub fn spawn(server: Arc<Server>, endpoint: Endpoint, threads: &Threads) -> io::Result<()> {
    let listener = endpoint.listener;
    threads
        .spawn(Role::Metrics, "metrics", move || loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    // Plain read and write on the descriptor (the role
                    // allows no recvfrom or sendto).
                    let mut conn = std::fs::File::from(OwnedFd::from(stream));
                    if let Err(e) = serve(&server, &mut conn) {
                        tracing::debug!(%peer, "Metrics scrape failed: {e}");
                    }
                }
                // The listener's receive timeout ends an accept too.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => {
                    tracing::warn!("Cannot accept a metrics scrape: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        })
        .map(|_| ())
}

/// Answers one connection's request.
fn serve(server: &Server, conn: &mut (impl Read + Write)) -> io::Result<()> {
    let head = match read_head(conn)? {
        Head::Complete(head) => head,
        Head::TooLong => {
            return respond(conn, 431, "Request Header Fields Too Large", "", "", true)
        }
        Head::Closed => return Ok(()),
    };
    match route(&head) {
        Route::Metrics { body } => {
            let text = render_prometheus(&server.stats());
            respond(conn, 200, "OK", CONTENT_TYPE, &text, body)
        }
        Route::Status(code, reason) => respond(conn, code, reason, "", "", true),
    }
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// The metrics, with the body (GET) or only its headers (HEAD).
    Metrics { body: bool },
    /// An error status.
    Status(u16, &'static str),
}

/// The answer to a request head (its request line; headers are ignored).
fn route(head: &[u8]) -> Route {
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let Ok(line) = std::str::from_utf8(line) else {
        return Route::Status(400, "Bad Request");
    };
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::Status(400, "Bad Request");
    };
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return Route::Status(505, "HTTP Version Not Supported");
    }
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    match (method, path) {
        ("GET", "/metrics") => Route::Metrics { body: true },
        ("HEAD", "/metrics") => Route::Metrics { body: false },
        (_, "/metrics") => Route::Status(405, "Method Not Allowed"),
        _ => Route::Status(404, "Not Found"),
    }
}

/// A request head as read.
enum Head {
    Complete(Vec<u8>),
    TooLong,
    /// The client closed (or timed out) before a whole head.
    Closed,
}

/// Reads until the blank line that ends the head, keeping at most
/// [`MAX_HEAD`]; a longer head is read to its end (at most
/// [`MAX_DISCARD`]) and dropped.
fn read_head(conn: &mut impl Read) -> io::Result<Head> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    let mut dropped = 0usize;
    loop {
        let n = match conn.read(&mut chunk) {
            Ok(0) => return Ok(Head::Closed),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(Head::Closed)
            }
            Err(e) => return Err(e),
        };
        head.extend_from_slice(&chunk[..n]);
        let end = find(&head, b"\r\n\r\n").or_else(|| find(&head, b"\n\n"));
        match end {
            Some(end) if dropped == 0 && end <= MAX_HEAD => {
                head.truncate(end);
                return Ok(Head::Complete(head));
            }
            Some(_) => return Ok(Head::TooLong),
            None if head.len() > MAX_HEAD => {
                if dropped > MAX_DISCARD {
                    return Ok(Head::TooLong);
                }
                // Keep the last 3 bytes: the end may straddle reads.
                let keep = head.split_off(head.len() - 3);
                dropped += head.len();
                head = keep;
            }
            None => {}
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Writes a whole response, `text` as its body unless `with_body` is
/// false (HEAD: the headers say the length a GET gets), and closes (no
/// keep-alive).
fn respond(
    conn: &mut impl Write,
    code: u16,
    reason: &str,
    content_type: &str,
    text: &str,
    with_body: bool,
) -> io::Result<()> {
    let mut out = format!("HTTP/1.1 {code} {reason}\r\nConnection: close\r\n");
    if code == 405 {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    if !content_type.is_empty() {
        out.push_str(&format!("Content-Type: {content_type}\r\n"));
    }
    out.push_str(&format!("Content-Length: {}\r\n\r\n", text.len()));
    conn.write_all(out.as_bytes())?;
    if with_body {
        conn.write_all(text.as_bytes())?;
    }
    conn.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_routed_by_method_and_path() {
        let r = |s: &str| route(s.as_bytes());
        assert_eq!(r("GET /metrics HTTP/1.1"), Route::Metrics { body: true });
        assert_eq!(
            r("GET /metrics?x=1 HTTP/1.0"),
            Route::Metrics { body: true }
        );
        assert_eq!(r("HEAD /metrics HTTP/1.1"), Route::Metrics { body: false });
        assert_eq!(r("POST /metrics HTTP/1.1").code(), 405);
        assert_eq!(r("GET / HTTP/1.1").code(), 404);
        assert_eq!(r("GET /metrics HTTP/2.0").code(), 505);
        for bad in [
            "",
            "GET",
            "GET /metrics",
            "GET  /metrics HTTP/1.1",
            "a b c d",
        ] {
            assert_eq!(r(bad).code(), 400, "{bad:?}");
        }
        assert_eq!(route(b"GET /metr\xffics HTTP/1.1").code(), 400);
    }

    #[test]
    fn heads_are_bounded_and_end_at_the_blank_line() {
        let mut ok: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\ntrailing";
        assert!(matches!(read_head(&mut ok), Ok(Head::Complete(h)) if h.ends_with(b"Host: x")));
        // Too long: read to its end (wherever the reads cut it), refused.
        for tail in [0, 1, 2, 3, 700] {
            let mut long = vec![b'a'; MAX_HEAD + 2048 + tail];
            long.extend_from_slice(b"\r\n\r\nnext");
            assert!(matches!(read_head(&mut long.as_slice()), Ok(Head::TooLong)));
        }
        // Endless: refused once MAX_DISCARD is passed, not read for ever.
        let endless = vec![b'a'; MAX_DISCARD * 4];
        assert!(matches!(
            read_head(&mut endless.as_slice()),
            Ok(Head::TooLong)
        ));
        let mut cut: &[u8] = b"GET /metrics HTTP/1.1\r\n";
        assert!(matches!(read_head(&mut cut), Ok(Head::Closed)));
    }

    impl Route {
        fn code(&self) -> u16 {
            match self {
                Route::Metrics { .. } => 200,
                Route::Status(code, _) => *code,
            }
        }
    }
}
