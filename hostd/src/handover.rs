//! hostd hands over to a new hostd (an upgrade without taking a tenant's
//! device: docs/architecture.md, "hostd hands over").
//!
//! The new hostd (`hostd --take-over`) connects to the running one's admin
//! socket before its sandbox and asks for everything ([`take`]):
//!
//! 1. The running hostd stops its datapath (it holds the datapath's lock
//!    from then on) and its registry, and sends its sockets — the vdev
//!    listener, the admin listener, the RoCEv2 send socket, the metrics
//!    listener — then the [`Blob`]: for each context a token, its tenant,
//!    device and vdev process, and its QPs' transport
//!    ([`crate::engine::handover`]).
//! 2. The new hostd checks the blob whole ([`decode`]) and answers that it
//!    took it; a blob it refuses, or no answer, and the running hostd
//!    carries on as if nothing happened.
//! 3. The running hostd sends each context its token
//!    ([`Notification::Handover`]) and exits. Each vdev registers its
//!    contexts with the new hostd, presents the token and gives the
//!    objects back in their states, as after a restart but with its port
//!    up and its QPs connected; the new hostd gives each QP its transport
//!    back once it is in its state again.
//!
//! What the previous hostd mapped (guest memory, rings) and the eventfds
//! come back from each vdev, which holds them (it re-sends them after a
//! restart too); the sockets every peer and vdev knows by address come
//! from the previous hostd.
//!
//! [`Notification::Handover`]: vrdma_hostd_protocol::messages::Notification::Handover

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use serde::{Deserialize, Serialize};
use vrdma_hostd_protocol::channel::{Channel, ChannelError, Listener};

use crate::admin::{recv_response, AdminError, AdminRequest, AdminResponse};
use crate::engine::handover::{QpTransport, TransportError};

/// The blob's format; a hostd refuses another.
pub const BLOB_VERSION: u32 = 1;
/// Contexts one blob names at most (a device has at most 64, a host a few
/// thousand devices).
pub const MAX_CONTEXTS: usize = 1 << 16;
/// QPs one context names at most (QP numbers have 24 bits; vdev's
/// `max_qp` is far below).
pub const MAX_QPS_PER_CONTEXT: usize = 1 << 16;
/// How long a context's token waits for its vdev.
pub const TOKEN_LIFETIME: std::time::Duration = std::time::Duration::from_secs(30);
/// Longest tenant or device name a blob may carry.
const MAX_NAME: usize = 256;

/// What a hostd hands over of its contexts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Blob {
    pub version: u32,
    pub contexts: Vec<HandedContext>,
}

/// One context as the previous hostd served it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedContext {
    /// 32 hex digits, random: what its vdev presents.
    pub token: String,
    pub tenant: String,
    pub device: String,
    /// The device's GID: it gets the same one from the new hostd.
    pub gid: [u8; 16],
    /// The vdev process, as the socket's credentials said.
    pub pid: Option<i32>,
    pub qps: Vec<QpTransport>,
}

/// What [`take`] sends ahead of the blob, with the descriptors in this
/// order: the vdev listener, the admin listener, then the RoCEv2 send
/// socket and the metrics listener when there are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sockets {
    pub udp: bool,
    pub metrics: bool,
}

/// Why a handover did not happen, or its blob is refused.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("Cannot reach the running hostd's admin socket {path}")]
    Connect {
        path: String,
        #[source]
        source: ChannelError,
    },
    #[error("The handover's channel failed")]
    Channel(#[from] ChannelError),
    #[error("The handover's answer failed")]
    Admin(#[from] AdminError),
    #[error("The running hostd refused to hand over: {0}")]
    Refused(String),
    #[error("The running hostd sent {got} descriptors, its list names {want}")]
    Descriptors { got: usize, want: usize },
    #[error("The blob is not JSON of a handover")]
    Malformed(#[source] serde_json::Error),
    #[error("The blob is of format {0}, this hostd reads {BLOB_VERSION}")]
    Version(u32),
    #[error("The blob names {0} contexts, more than {MAX_CONTEXTS}")]
    TooMany(usize),
    #[error("Context {index}: {what}")]
    Context { index: usize, what: &'static str },
    #[error("Context {index}")]
    Transport {
        index: usize,
        #[source]
        source: TransportError,
    },
}

/// A checked blob: each context by its token.
#[derive(Debug, Default)]
pub struct Handover {
    pub contexts: HashMap<String, HandedContext>,
}

/// Decodes and checks a blob as a whole: a blob with one bad context is
/// refused, nothing of it taken.
pub fn decode(bytes: &[u8]) -> Result<Handover, HandoverError> {
    let blob: Blob = serde_json::from_slice(bytes).map_err(HandoverError::Malformed)?;
    if blob.version != BLOB_VERSION {
        return Err(HandoverError::Version(blob.version));
    }
    if blob.contexts.len() > MAX_CONTEXTS {
        return Err(HandoverError::TooMany(blob.contexts.len()));
    }
    let mut contexts = HashMap::with_capacity(blob.contexts.len());
    for (index, c) in blob.contexts.into_iter().enumerate() {
        let bad = |what| HandoverError::Context { index, what };
        if c.token.len() != 32 || !c.token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("the token is not 32 hex digits"));
        }
        if [&c.tenant, &c.device]
            .iter()
            .any(|n| n.is_empty() || n.len() > MAX_NAME)
        {
            return Err(bad("a tenant or device name is empty or too long"));
        }
        if c.qps.len() > MAX_QPS_PER_CONTEXT {
            return Err(bad("too many QPs"));
        }
        let mut seen = std::collections::HashSet::with_capacity(c.qps.len());
        for qp in &c.qps {
            qp.check()
                .map_err(|source| HandoverError::Transport { index, source })?;
            if !seen.insert(qp.vqpn) {
                return Err(bad("a QP is named twice"));
            }
        }
        if contexts.contains_key(&c.token) {
            return Err(bad("the token is another context's"));
        }
        contexts.insert(c.token.clone(), c);
    }
    Ok(Handover { contexts })
}

/// What the new hostd took over.
#[derive(Debug)]
pub struct Taken {
    pub listener: Listener,
    pub admin_listener: Listener,
    pub udp: Option<std::os::fd::OwnedFd>,
    pub metrics: Option<std::net::TcpListener>,
    pub handover: Handover,
    pub commit: Commit,
}

/// The channel to the previous hostd, which waits, stopped, for
/// [`Commit::commit`]; dropped instead, it carries on.
#[derive(Debug)]
pub struct Commit {
    channel: Channel,
}

impl Commit {
    /// Tells the previous hostd that this one took everything: it hands
    /// each context its token and exits. Written with `write(2)` (one
    /// seqpacket message), which every thread's filter allows: the main
    /// thread commits inside the sandbox, just before it serves.
    pub fn commit(self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let bytes = vrdma_hostd_protocol::messages::encode(&AdminRequest::HandoverTaken)
            .map_err(std::io::Error::other)?;
        // SAFETY: writes `bytes`, which lives across the call, to a socket
        // this value owns.
        let n =
            unsafe { libc::write(self.channel.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Asks the hostd serving the admin socket at `admin_socket` for its
/// sockets and its contexts' state. Before the sandbox (it connects by
/// path); the running hostd's datapath stands still from here until
/// [`Taken::commit`] (or until this process drops the channel: then it
/// carries on).
pub fn take(admin_socket: &Path) -> Result<Taken, HandoverError> {
    let channel = Channel::connect(admin_socket).map_err(|source| HandoverError::Connect {
        path: admin_socket.display().to_string(),
        source,
    })?;
    channel.send(&AdminRequest::Handover, &[])?;
    let (sockets, files): (Sockets, Vec<File>) = match channel.recv::<Sockets>() {
        Ok(got) => got,
        // A hostd that cannot hand over answers with an admin error frame.
        Err(ChannelError::Message(_)) => {
            return Err(HandoverError::Refused(
                "it answered with an error instead of its sockets".into(),
            ))
        }
        Err(e) => return Err(e.into()),
    };
    let want = 2 + usize::from(sockets.udp) + usize::from(sockets.metrics);
    if files.len() != want {
        return Err(HandoverError::Descriptors {
            got: files.len(),
            want,
        });
    }
    let blob = match recv_response(&channel)? {
        AdminResponse::Handover { blob } => blob,
        AdminResponse::Error { message } => return Err(HandoverError::Refused(message)),
        _ => return Err(HandoverError::Refused("it answered something else".into())),
    };
    let handover = decode(blob.as_bytes())?;
    let mut files = files.into_iter().map(std::os::fd::OwnedFd::from);
    let mut next = || {
        files
            .next()
            .ok_or(HandoverError::Descriptors { got: 0, want })
    };
    let listener = Listener::from(next()?);
    let admin_listener = Listener::from(next()?);
    let udp = sockets.udp.then(&mut next).transpose()?;
    let metrics = (sockets.metrics.then(&mut next).transpose()?).map(std::net::TcpListener::from);
    Ok(Taken {
        listener,
        admin_listener,
        udp,
        metrics,
        handover,
        commit: Commit { channel },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::handover::{HandedReceiving, RemoteTransport};

    fn blob() -> Blob {
        Blob {
            version: BLOB_VERSION,
            contexts: vec![HandedContext {
                token: "0123456789abcdef0123456789abcdef".into(),
                tenant: "alpha".into(),
                device: "a0".into(),
                gid: [0; 16],
                pid: Some(42),
                qps: vec![QpTransport {
                    vqpn: 7,
                    state: 3,
                    ud_psn: 0,
                    srq_receive: None,
                    remote: Some(RemoteTransport {
                        next_psn: 100,
                        acked: 99,
                        high: 120,
                        epsn: 5,
                        msn: 4,
                        receiving: HandedReceiving::Write {
                            va: 0x1000,
                            rkey: 9,
                            len: 8192,
                            offset: 4096,
                        },
                        reads: Vec::new(),
                        atomics: Vec::new(),
                        nak_sent: false,
                        dropping: false,
                    }),
                }],
            }],
        }
    }

    fn remote(b: &mut Blob) -> &mut RemoteTransport {
        b.contexts[0].qps[0].remote.as_mut().expect("remote")
    }

    fn text(b: &Blob) -> String {
        serde_json::to_string(b).expect("encode")
    }

    #[test]
    fn a_blob_decodes_to_what_was_handed_over() {
        let b = blob();
        let h = decode(text(&b).as_bytes()).expect("valid");
        assert_eq!(h.contexts.len(), 1);
        assert_eq!(h.contexts[&b.contexts[0].token], b.contexts[0]);
    }

    #[test]
    fn a_truncated_or_corrupted_blob_is_refused_whole() {
        let t = text(&blob());
        for cut in [0, 1, t.len() / 2, t.len() - 1] {
            assert!(matches!(
                decode(&t.as_bytes()[..cut]),
                Err(HandoverError::Malformed(_))
            ));
        }
        let flipped = t.replace("\"epsn\":5", "\"epsn\":\"5\"");
        assert!(matches!(
            decode(flipped.as_bytes()),
            Err(HandoverError::Malformed(_))
        ));
        let unknown = t.replace("\"msn\":4", "\"msn\":4,\"extra\":1");
        assert!(matches!(
            decode(unknown.as_bytes()),
            Err(HandoverError::Malformed(_))
        ));
    }

    #[test]
    fn every_field_is_checked() {
        let mut b = blob();
        b.version = 2;
        assert!(matches!(
            decode(text(&b).as_bytes()),
            Err(HandoverError::Version(2))
        ));
        let bad = |f: &dyn Fn(&mut Blob)| {
            let mut b = blob();
            f(&mut b);
            decode(text(&b).as_bytes()).map(|_| ())
        };
        assert!(bad(&|b| b.contexts[0].token = "xyz".into()).is_err());
        assert!(bad(&|b| b.contexts[0].tenant = String::new()).is_err());
        assert!(bad(&|b| b.contexts[0].qps[0].state = 9).is_err());
        assert!(bad(&|b| b.contexts[0].qps[0].vqpn = 1 << 24).is_err());
        assert!(bad(&|b| remote(b).epsn = 1 << 24).is_err());
        assert!(bad(&|b| remote(b).msn = u32::MAX).is_err());
        assert!(bad(&|b| remote(b).receiving = HandedReceiving::Write {
            va: 0,
            rkey: 1,
            len: 10,
            offset: 11,
        })
        .is_err());
        assert!(bad(&|b| {
            let qp = b.contexts[0].qps[0].clone();
            b.contexts[0].qps.push(qp);
        })
        .is_err());
        assert!(bad(&|b| {
            let c = b.contexts[0].clone();
            b.contexts.push(c);
        })
        .is_err());
    }
}
