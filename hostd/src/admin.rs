//! The admin socket: `vrdmactl` asks hostd for its tenants' stats, for
//! Prometheus metrics, or to reload the policy; and SIGHUP, which reloads
//! the policy too.
//!
//! The socket is a unix seqpacket socket (`admin_socket`, default
//! `<socket>.admin`, mode 0600) speaking JSON over
//! [`vrdma_hostd_protocol::channel`], like the vdev channel. A client sends
//! one [`AdminRequest`] per message and gets one [`AdminResponse`] back. A
//! response can outgrow one message (stats of many tenants), so it travels
//! as its JSON text cut into [`AdminFrame`]s, the last one marked `last`;
//! [`call`] puts it back together.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vrdma_hostd_protocol::channel::{Channel, ChannelError, Listener};

use crate::accept::{serve_connections, Connections};
use crate::seccomp::{Role, Threads};
use crate::server::Server;
use crate::stats::{render_prometheus, Stats, KINDS};

/// A request on the admin socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum AdminRequest {
    /// Every tenant's counters, usage and quotas.
    Stats,
    /// The same, in the Prometheus text exposition format.
    Metrics,
    /// Re-read the policy file (and a static cluster file).
    Reload,
    /// Per peer host counters of the RoCEv2 transport.
    Peers,
    /// A new hostd takes over (`hostd --take-over`): this hostd stops, and
    /// sends its sockets and then its contexts' state
    /// ([`crate::handover`]).
    Handover,
    /// The new hostd took what was handed over: this one exits.
    HandoverTaken,
}

/// hostd's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum AdminResponse {
    Stats(Stats),
    Peers(Vec<crate::engine::wire::PeerStats>),
    Metrics {
        text: String,
    },
    /// The new policy is in force; what changed, one line each.
    Reloaded {
        file: String,
        changes: Vec<String>,
    },
    /// What a hostd hands over of its contexts ([`crate::handover::Blob`]
    /// as JSON, decoded by the new hostd as untrusted input).
    Handover {
        blob: String,
    },
    /// The request failed (for a reload: the policy in force stays).
    Error {
        message: String,
    },
}

/// One message of a response: the next piece of its JSON text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminFrame {
    pub part: String,
    /// This is the response's last piece.
    pub last: bool,
}

/// Bytes of JSON text per frame: escaped once more inside the frame, a
/// piece at most doubles, which stays below the channel's message size.
pub const FRAME_TEXT: usize = 16 * 1024;
/// Largest response a client accepts.
pub const MAX_RESPONSE: usize = 64 << 20;
/// Admin connections served at once.
const MAX_ADMIN_CONNECTIONS: usize = 16;

/// Why an admin call failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("Cannot reach hostd's admin socket {path}")]
    Connect {
        path: String,
        #[source]
        source: ChannelError,
    },
    #[error("Admin channel failed")]
    Channel(#[from] ChannelError),
    #[error("Response larger than {MAX_RESPONSE} bytes")]
    TooLarge,
    #[error("Malformed response")]
    Malformed(#[source] serde_json::Error),
}

/// Sends `response` as frames.
pub fn send_response(chan: &Channel, response: &AdminResponse) -> Result<(), ChannelError> {
    let text = serde_json::to_string(response).unwrap_or_else(|e| {
        format!(r#"{{"error":{{"message":"Cannot encode the response: {e}"}}}}"#)
    });
    let mut rest = text.as_str();
    loop {
        let mut cut = rest.len().min(FRAME_TEXT);
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        let (part, tail) = rest.split_at(cut);
        chan.send(
            &AdminFrame {
                part: part.to_owned(),
                last: tail.is_empty(),
            },
            &[],
        )?;
        if tail.is_empty() {
            return Ok(());
        }
        rest = tail;
    }
}

/// Receives one framed response.
pub fn recv_response(chan: &Channel) -> Result<AdminResponse, AdminError> {
    let mut text = String::new();
    loop {
        let (frame, _fds): (AdminFrame, _) = chan.recv()?;
        if text.len() + frame.part.len() > MAX_RESPONSE {
            return Err(AdminError::TooLarge);
        }
        text.push_str(&frame.part);
        if frame.last {
            return serde_json::from_str(&text).map_err(AdminError::Malformed);
        }
    }
}

/// Connects to the admin socket at `path`, sends `request`, returns the
/// response.
pub fn call(path: &Path, request: AdminRequest) -> Result<AdminResponse, AdminError> {
    let chan = Channel::connect(path).map_err(|source| AdminError::Connect {
        path: path.display().to_string(),
        source,
    })?;
    chan.send(&request, &[])?;
    recv_response(&chan)
}

/// What hostd answers to `request`.
pub fn answer(server: &Server, request: AdminRequest) -> AdminResponse {
    match request {
        AdminRequest::Stats => AdminResponse::Stats(server.stats()),
        AdminRequest::Metrics => AdminResponse::Metrics {
            text: render_prometheus(&server.stats()),
        },
        AdminRequest::Peers => AdminResponse::Peers(server.stats().peers),
        AdminRequest::Reload => match server.reload() {
            Ok(r) => AdminResponse::Reloaded {
                file: r.file.display().to_string(),
                changes: r.changes,
            },
            Err(message) => AdminResponse::Error { message },
        },
        AdminRequest::Handover | AdminRequest::HandoverTaken => AdminResponse::Error {
            message: "A handover runs on a connection of its own (hostd --take-over)".into(),
        },
    }
}

/// Binds the admin socket with mode 0600 (set through the umask while
/// binding, so it is never reachable by others, then once more
/// explicitly). Call before any thread starts: the umask is per process.
pub fn bind(path: &Path) -> Result<Listener, ChannelError> {
    // SAFETY: umask only changes this process's file-creation mask.
    let old = unsafe { libc::umask(0o177) };
    let listener = Listener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let listener = listener?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(ChannelError::Io)?;
    Ok(listener)
}

/// Serves the admin socket on a thread of its own, a thread per client
/// (all started through `threads`, under the admin role's filter).
pub fn spawn(server: Arc<Server>, listener: Listener, threads: &Threads) -> io::Result<()> {
    let client_threads = threads.clone();
    let clients = Connections {
        peer: "admin",
        role: Role::Admin,
        thread: "admin-conn",
        max: MAX_ADMIN_CONNECTIONS,
    };
    threads
        .spawn(Role::Admin, "admin", move || {
            serve_connections(&listener, &client_threads, clients, move |chan| {
                serve_client(&server, &chan)
            })
        })
        .map(|_| ())
}

fn serve_client(server: &Server, chan: &Channel) {
    loop {
        let response = match chan.recv::<AdminRequest>() {
            Ok((AdminRequest::Handover, fds)) if fds.is_empty() => {
                // Returns only when the handover did not happen (else
                // this process exits).
                let message = server.hand_over(chan);
                tracing::error!("No handover: {message}; serving on");
                AdminResponse::Error { message }
            }
            Ok((request, fds)) if fds.is_empty() => answer(server, request),
            Ok(_) => AdminResponse::Error {
                message: "Admin requests carry no file descriptors".into(),
            },
            Err(ChannelError::Message(e)) => {
                let message = format!("Bad admin request: {}", vrdma_errors::error_chain(&e));
                let _ = send_response(chan, &AdminResponse::Error { message });
                return;
            }
            Err(_) => return,
        };
        if send_response(chan, &response).is_err() {
            return;
        }
    }
}

/// Blocks SIGHUP for the calling thread and every thread it starts later,
/// and returns a signalfd that reads it instead. Call before any thread
/// starts.
pub fn block_sighup() -> io::Result<OwnedFd> {
    // SAFETY: sigset_t is plain data that sigemptyset initializes.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t; SIGHUP is a valid signal.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGHUP);
    }
    // SAFETY: `set` is initialized; the old mask is not asked for.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    // SAFETY: `set` is initialized; -1 asks for a new descriptor.
    let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Reloads the policy on every SIGHUP read from `signals` (a signalfd), on
/// a thread under the SIGHUP role's filter.
pub fn spawn_sighup(server: Arc<Server>, signals: OwnedFd, threads: &Threads) -> io::Result<()> {
    threads
        .spawn(Role::Sighup, "sighup", move || {
            let mut info = [0u8; std::mem::size_of::<libc::signalfd_siginfo>()];
            loop {
                // SAFETY: `info` is writable for its whole length.
                let n = unsafe {
                    libc::read(signals.as_raw_fd(), info.as_mut_ptr().cast(), info.len())
                };
                if n < 0 {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    tracing::error!("Reading SIGHUP failed, reload by signal is off: {e}");
                    return;
                }
                tracing::info!("SIGHUP: reloading the policy");
                // reload() logs the outcome either way.
                let _ = server.reload();
            }
        })
        .map(|_| ())
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Lays out rows as columns separated by two spaces.
fn table(out: &mut String, rows: &[Vec<String>]) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c + 1 == row.len() {
                line.push_str(cell);
            } else {
                let pad = widths[c] - cell.chars().count();
                line.push_str(cell);
                line.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// The stats as tables for people: one row per tenant (usage against
/// quotas, throttled time), one per tenant and kind (operations, bytes),
/// then errors and quota rejections.
pub fn render_peers(peers: &[crate::engine::wire::PeerStats]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:>10} {:>12} {:>10} {:>12} {:>8} {:>8} {:>10}  naks sent / received; drops",
        "host", "tx pkts", "tx bytes", "rx pkts", "rx bytes", "retrans", "timeout", "rtt us"
    );
    let join = |m: &std::collections::BTreeMap<String, u64>| {
        m.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    for p in peers {
        let host = if p.host.is_empty() {
            "(unknown)"
        } else {
            &p.host
        };
        let _ = writeln!(
            out,
            "{:<16} {:>10} {:>12} {:>10} {:>12} {:>8} {:>8} {:>10.1}  {} / {}; {}",
            host,
            p.tx_packets,
            p.tx_bytes,
            p.rx_packets,
            p.rx_bytes,
            p.retransmissions,
            p.timeouts,
            p.rtt_ns as f64 / 1000.0,
            join(&p.naks_sent),
            join(&p.naks_received),
            join(&p.drops),
        );
    }
    out
}

/// The `vrdmactl stats` tables.
pub fn render_table(stats: &Stats) -> String {
    let mut out = String::new();
    let get = |m: &std::collections::BTreeMap<String, u64>, k: &str| m.get(k).copied().unwrap_or(0);
    let mut rows = vec![[
        "TENANT",
        "CLASS",
        "WEIGHT",
        "DEVICES",
        "QUEUES",
        "QPS",
        "MRS",
        "REGISTERED / QUOTA",
        "THROTTLED SEND s",
        "THROTTLED READ s",
    ]
    .map(String::from)
    .to_vec()];
    for t in &stats.tenants {
        let secs = |k: &str| t.throttled_seconds.get(k).copied().unwrap_or(0.0);
        let mut name = t.tenant.clone();
        if !t.in_policy {
            name.push_str(" (removed)");
        }
        rows.push(vec![
            name,
            serde_json::to_value(t.class)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            t.weight.to_string(),
            get(&t.usage, "devices").to_string(),
            get(&t.usage, "physical_queues").to_string(),
            get(&t.usage, "qps").to_string(),
            get(&t.usage, "mrs").to_string(),
            format!(
                "{} / {}",
                human_bytes(get(&t.usage, "mr_bytes")),
                human_bytes(get(&t.quota, "max_total_mr_bytes"))
            ),
            format!("{:.3}", secs("send")),
            format!("{:.3}", secs("read")),
        ]);
    }
    table(&mut out, &rows);
    out.push('\n');
    let mut rows = vec![["TENANT", "KIND", "OPS", "BYTES"]
        .map(String::from)
        .to_vec()];
    for t in &stats.tenants {
        for kind in KINDS {
            rows.push(vec![
                t.tenant.clone(),
                kind.to_owned(),
                get(&t.ops, kind).to_string(),
                get(&t.bytes, kind).to_string(),
            ]);
        }
    }
    table(&mut out, &rows);
    for (title, pick) in [
        (
            "ERRORS",
            (|t| &t.errors)
                as fn(&crate::stats::TenantStats) -> &std::collections::BTreeMap<String, u64>,
        ),
        ("QUOTA REJECTIONS", |t| &t.quota_rejections),
        ("DROPPED", |t| &t.dropped),
    ] {
        let mut rows = vec![vec![
            "TENANT".to_owned(),
            title.to_owned(),
            "COUNT".to_owned(),
        ]];
        for t in &stats.tenants {
            for (k, v) in pick(t) {
                rows.push(vec![t.tenant.clone(), k.clone(), v.to_string()]);
            }
        }
        out.push('\n');
        if rows.len() == 1 {
            out.push_str(&format!("{title}: none\n"));
        } else {
            table(&mut out, &rows);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{Accounts, TenantStats};
    use std::time::Duration;
    use vrdma_tenant_policy::Policy;

    fn stats(tenants: usize) -> Stats {
        let policy = Policy::default_policy().tenants[0].clone();
        let mut acc = Accounts::default();
        acc.attach(1, "alpha", 2);
        acc.mr_registered(1, 1, 3 << 20);
        acc.quota_rejected("alpha", "max_qp");
        let account = acc.snapshot()["alpha"].clone();
        Stats {
            peers: Vec::new(),
            packet_io: None,
            tenants: (0..tenants)
                .map(|i| {
                    let mut t = TenantStats::new(
                        &account,
                        &policy,
                        i != 1,
                        [Duration::from_millis(250), Duration::ZERO],
                    );
                    t.tenant = format!("tenant-{i}");
                    t
                })
                .collect(),
        }
    }

    #[test]
    fn large_responses_travel_in_frames() {
        let (a, b) = Channel::pair().expect("pair");
        let big = AdminResponse::Stats(stats(400));
        let metrics = AdminResponse::Metrics {
            text: "é\"\\\n".repeat(20_000),
        };
        let writer = std::thread::spawn(move || {
            send_response(&a, &big).expect("send");
            send_response(&a, &metrics).expect("send");
            (big, metrics)
        });
        let got = recv_response(&b).expect("stats");
        let got_metrics = recv_response(&b).expect("metrics");
        let (big, metrics) = writer.join().expect("writer");
        assert_eq!(got, big);
        assert_eq!(got_metrics, metrics);
    }

    #[test]
    fn requests_are_strict_json() {
        let (a, b) = Channel::pair().expect("pair");
        a.send(&AdminRequest::Reload, &[]).expect("send");
        let (req, _): (AdminRequest, _) = b.recv().expect("recv");
        assert_eq!(req, AdminRequest::Reload);
        let text = serde_json::to_string(&AdminRequest::Stats).expect("encode");
        assert_eq!(text, r#""stats""#);
        assert!(serde_json::from_str::<AdminRequest>(r#""shutdown""#).is_err());
    }

    #[test]
    fn the_table_shows_usage_quota_and_kinds() {
        let text = render_table(&stats(2));
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("TENANT  "), "{text}");
        assert!(lines[1].contains("3.0 MiB / 16.0 GiB"), "{text}");
        assert!(lines[1].contains("0.250"), "{text}");
        assert!(lines[2].contains("tenant-1 (removed)"), "{text}");
        assert!(text.contains("QUOTA REJECTIONS"), "{text}");
        assert!(text.contains("ERRORS: none"), "{text}");
        assert!(
            text.lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["tenant-0", "max_qp", "1"]),
            "{text}"
        );
        assert_eq!(human_bytes(512), "512 B");
    }
}
