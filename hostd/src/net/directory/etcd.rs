//! The etcd directory (`directory = "etcd"`): for real clusters.
//!
//! Keys, under one lease of this host (TTL `lease_seconds`):
//!
//! - `/vrdma/hosts/<name>` → JSON [`HostEntry`] (this host, at start);
//! - `/vrdma/gids/<a.b.c.d>` → JSON [`GidEntry`] (each GID a device took).
//!
//! A host whose hostd stops keeping its lease alive (crash, partition)
//! disappears from every view once the lease expires. The view is a range
//! read of `/vrdma/`, then a watch from the next revision, applied to a
//! local map behind a lock: lookups never wait on the network, except
//! one on the control path that missed the view ([`Directory::lookup_fresh`]:
//! a read of that one key, at most [`READS_PER_SECOND`], so that a GID
//! published a moment ago on another host is found at RTR). Entries
//! come from other hosts and are not trusted: each is validated (key and
//! value agree, names valid, addresses usable); a bad one is skipped and
//! logged.
//!
//! etcd is spoken to through its v3 JSON gateway (etcd 3.4, Debian
//! bookworm's `etcd-server`) over plain HTTP/1.1 ([`super::http`]); keys
//! and values are base64 there. Two threads, both under the directory's
//! seccomp role, do the network work after [`Directory::start`]:
//!
//! - `vrdma-directory`: keeps the lease alive every TTL/3, and makes the
//!   writes `publish` and `withdraw` ask for (hostd's other threads may not
//!   open sockets; they hand the write over and wait for its result). If
//!   the lease was lost (etcd said so), it grants a new one and publishes
//!   this host and its GIDs again.
//! - `vrdma-dir-watch`: the watch stream; when it breaks, a new range read
//!   (which also catches what was deleted meanwhile) and a new watch.
//!
//! etcd unreachable at start is an error; later outages keep the last
//! view and retry with backoff, logging once per change of state.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};
use vrdma_tenant_policy::{is_valid_name, Policy};

use super::cluster::unusable;
use super::http::{self, HttpError};
use super::{diff_views, networks_of, Cluster, Directory, DirectoryError, GidEntry, HostEntry};
use crate::seccomp::{Role, Threads};

/// The prefix of every key of the directory.
pub const PREFIX: &str = "/vrdma/";
const HOSTS: &str = "/vrdma/hosts/";
const GIDS: &str = "/vrdma/gids/";
/// The end of the prefix's range: `/vrdma0` (`'/' + 1 == '0'`).
const PREFIX_END: &str = "/vrdma0";

/// Longest wait between two attempts to reach etcd again.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// First wait after a failure.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// How often the watch thread looks whether it should stop, at most.
const WATCH_POLL: Duration = Duration::from_millis(500);
/// Reads of one key on a lookup that missed the view, at most, per
/// second (a tenant connecting to GIDs nobody has must not turn into a
/// flood of requests to etcd; past it, a miss answers from the view).
const READS_PER_SECOND: u32 = 50;

/// Why talking to etcd failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("No etcd endpoint answered (tried {tried})")]
    Unreachable {
        tried: String,
        #[source]
        last: HttpError,
    },
    #[error("etcd refused {what}")]
    Refused {
        what: &'static str,
        #[source]
        source: HttpError,
    },
    #[error("etcd answered {what} with something unexpected: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("etcd granted no lease: {0}")]
    NoLease(String),
    #[error("The directory's thread is gone")]
    Stopped,
}

/// What [`EtcdDirectory::open`] needs.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// This host's name (must be a host of `cluster`).
    pub host: String,
    pub cluster_file: PathBuf,
    /// The cluster file, validated: this host's address and GID pool.
    pub cluster: Cluster,
    /// etcd's client URLs as addresses (plain HTTP).
    pub endpoints: Vec<SocketAddr>,
    pub lease_seconds: u64,
    /// Tenant → network, for pool entries without a network.
    pub networks: BTreeMap<String, String>,
}

/// The view: what etcd holds under the prefix, validated.
#[derive(Debug, Default)]
struct View {
    gids: BTreeMap<Ipv4Addr, GidEntry>,
    hosts: BTreeMap<String, HostEntry>,
}

/// A write the `vrdma-directory` thread makes for another thread.
#[derive(Debug)]
enum Command {
    Publish(GidEntry),
    Withdraw(Ipv4Addr),
    /// Put this host's entry again (its address changed on reload).
    PublishHost,
    /// Read one GID's key (a lookup that missed the view).
    Read(Ipv4Addr),
}

type Reply = mpsc::SyncSender<Result<(), DirectoryError>>;

/// What the directory and its threads share.
#[derive(Debug)]
struct Shared {
    /// This host (its address may change on reload).
    me: RwLock<HostEntry>,
    cluster_file: PathBuf,
    endpoints: Vec<SocketAddr>,
    /// The endpoint that answered last, tried first.
    preferred: AtomicUsize,
    lease_seconds: u64,
    /// Timeout of one request.
    timeout: Duration,
    /// This host's GIDs in the cluster file: what it may publish.
    pool: RwLock<BTreeMap<Ipv4Addr, GidEntry>>,
    view: RwLock<View>,
    generation: AtomicU64,
    /// The lease this host's keys are under.
    lease: AtomicI64,
    /// What this host has published (published again under a new lease).
    published: Mutex<BTreeMap<Ipv4Addr, GidEntry>>,
    /// etcd answered the last request (for logging changes of state).
    healthy: AtomicBool,
    stop: AtomicBool,
    /// Reads on a miss in the current second: (its start, how many).
    reads: Mutex<(Instant, u32)>,
}

/// The directory `directory = "etcd"` configures.
#[derive(Debug)]
pub struct EtcdDirectory {
    shared: Arc<Shared>,
    /// To the `vrdma-directory` thread, once started.
    commands: Mutex<Option<mpsc::Sender<(Command, Reply)>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Reloads run one at a time.
    reloading: Mutex<()>,
}

fn b64(s: &str) -> String {
    B64.encode(s.as_bytes())
}

fn gid_key(gid: Ipv4Addr) -> String {
    format!("{GIDS}{gid}")
}

impl EtcdDirectory {
    /// Registers this host in etcd (a lease, its host entry) and reads the
    /// current view. etcd unreachable is an error. Runs on the calling
    /// thread (before the sandbox); [`Directory::start`] then starts the
    /// threads that keep it up to date.
    pub fn open(options: EtcdOptions) -> Result<EtcdDirectory, DirectoryError> {
        let me = options
            .cluster
            .host(&options.host)
            .cloned()
            .ok_or_else(|| DirectoryError::UnknownHost {
                host: options.host.clone(),
                path: options.cluster_file.clone(),
            })?;
        let pool = options
            .cluster
            .pool(&options.host, &options.networks)
            .into_iter()
            .map(|e| (e.gid, e))
            .collect();
        let timeout = Duration::from_millis(options.lease_seconds * 1000 / 3)
            .clamp(Duration::from_millis(500), Duration::from_secs(2));
        let shared = Arc::new(Shared {
            me: RwLock::new(me),
            cluster_file: options.cluster_file,
            endpoints: options.endpoints,
            preferred: AtomicUsize::new(0),
            lease_seconds: options.lease_seconds,
            timeout,
            pool: RwLock::new(pool),
            view: RwLock::new(View::default()),
            generation: AtomicU64::new(0),
            lease: AtomicI64::new(0),
            published: Mutex::new(BTreeMap::new()),
            healthy: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            reads: Mutex::new((Instant::now(), 0)),
        });
        shared.register().map_err(DirectoryError::Etcd)?;
        shared.resync().map_err(DirectoryError::Etcd)?;
        tracing::info!(
            host = %shared.me().name,
            endpoints = ?shared.endpoints,
            lease = shared.lease.load(Ordering::Relaxed),
            gids = shared.view().gids.len(),
            "Registered in the etcd directory"
        );
        Ok(EtcdDirectory {
            shared,
            commands: Mutex::new(None),
            threads: Mutex::new(Vec::new()),
            reloading: Mutex::new(()),
        })
    }

    /// Has the `vrdma-directory` thread make `command`, or makes it here
    /// if the threads have not started.
    fn run(&self, command: Command) -> Result<(), DirectoryError> {
        let sender = self
            .commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(sender) = sender else {
            return self.shared.execute(command);
        };
        let (reply, result) = mpsc::sync_channel(1);
        let stopped = || DirectoryError::Etcd(EtcdError::Stopped);
        sender.send((command, reply)).map_err(|_| stopped())?;
        result.recv().map_err(|_| stopped())?
    }
}

impl Drop for EtcdDirectory {
    /// Stops the threads (without revoking the lease: this host's entries
    /// expire with it, as after a crash).
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        for thread in self
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = thread.join();
        }
    }
}

impl Shared {
    fn me(&self) -> HostEntry {
        self.me.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn view(&self) -> std::sync::RwLockReadGuard<'_, View> {
        self.view.read().unwrap_or_else(|e| e.into_inner())
    }

    fn view_mut(&self) -> std::sync::RwLockWriteGuard<'_, View> {
        self.view.write().unwrap_or_else(|e| e.into_inner())
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Logs when etcd becomes unreachable or reachable again.
    fn health(&self, ok: bool, why: Option<&dyn std::error::Error>) {
        if self.healthy.swap(ok, Ordering::AcqRel) != ok {
            if ok {
                tracing::info!("etcd reachable again");
            } else {
                let why = why.map(vrdma_errors::error_chain).unwrap_or_default();
                tracing::warn!("etcd unreachable, keeping the last view and retrying: {why}");
            }
        }
    }

    /// The endpoints in the order to try them: the one that answered last
    /// first.
    fn order(&self) -> impl Iterator<Item = (usize, SocketAddr)> + '_ {
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed) % n.max(1);
        (0..n).map(move |i| {
            let k = (first + i) % n;
            (k, self.endpoints[k])
        })
    }

    /// POSTs `body` to `path` at the first endpoint that answers; returns
    /// the JSON answer.
    fn call(&self, what: &'static str, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let body = body.to_string();
        let mut last = None;
        for (k, addr) in self.order() {
            match http::post_read(addr, path, body.as_bytes(), self.timeout) {
                Ok(answer) => {
                    self.preferred.store(k, Ordering::Relaxed);
                    return serde_json::from_slice(&answer).map_err(|e| EtcdError::Malformed {
                        what,
                        detail: e.to_string(),
                    });
                }
                Err(source @ HttpError::Status { .. }) => {
                    return Err(EtcdError::Refused { what, source })
                }
                Err(e) => last = Some(e),
            }
        }
        Err(EtcdError::Unreachable {
            tried: format!("{:?}", self.endpoints),
            last: last.unwrap_or(HttpError::Malformed {
                addr: SocketAddr::from(([0, 0, 0, 0], 0)),
                what: "no endpoint configured",
            }),
        })
    }

    /// Grants a lease and puts this host's entry under it.
    fn register(&self) -> Result<(), EtcdError> {
        let answer = self.call(
            "the lease grant",
            "/v3/lease/grant",
            &json!({ "TTL": self.lease_seconds }),
        )?;
        let id = int_field(&answer, "ID")
            .filter(|&id| id != 0)
            .ok_or_else(|| {
                EtcdError::NoLease(
                    answer
                        .get("error")
                        .map_or_else(|| answer.to_string(), |e| e.to_string()),
                )
            })?;
        self.lease.store(id, Ordering::Release);
        self.put_host()
    }

    fn put_host(&self) -> Result<(), EtcdError> {
        let me = self.me();
        let value = serde_json::to_string(&me).unwrap_or_default();
        self.call(
            "the host entry's put",
            "/v3/kv/put",
            &json!({
                "key": b64(&format!("{HOSTS}{}", me.name)),
                "value": b64(&value),
                "lease": self.lease.load(Ordering::Acquire).to_string(),
            }),
        )?;
        let mut view = self.view_mut();
        if view.hosts.get(&me.name) != Some(&me) {
            view.hosts.insert(me.name.clone(), me);
            self.changed();
        }
        Ok(())
    }

    /// Puts `entry` under this host's lease unless another host holds its
    /// key (a transaction: create if absent, else read the holder).
    fn put_gid(&self, entry: &GidEntry) -> Result<(), DirectoryError> {
        let key = b64(&gid_key(entry.gid));
        let value = b64(&serde_json::to_string(entry).unwrap_or_default());
        let lease = self.lease.load(Ordering::Acquire).to_string();
        let put = json!({ "request_put": { "key": key, "value": value, "lease": lease } });
        let answer = self
            .call(
                "the GID's put",
                "/v3/kv/txn",
                &json!({
                    "compare": [{ "key": key, "target": "CREATE", "result": "EQUAL",
                                  "create_revision": "0" }],
                    "success": [put],
                    "failure": [{ "request_range": { "key": key } }],
                }),
            )
            .map_err(DirectoryError::Etcd)?;
        if answer.get("succeeded").and_then(Value::as_bool) == Some(true) {
            return Ok(());
        }
        let holder = answer
            .pointer("/responses/0/response_range/kvs/0/value")
            .and_then(Value::as_str)
            .and_then(|v| B64.decode(v).ok())
            .and_then(|v| serde_json::from_slice::<GidEntry>(&v).ok());
        match holder {
            Some(h) if h.host != entry.host => Err(DirectoryError::Taken {
                gid: entry.gid,
                owner: h.host,
            }),
            // Ours already (a publish again, or under an old lease), or
            // garbage: this host's entry replaces it.
            _ => {
                self.call("the GID's put", "/v3/kv/put", &put["request_put"])
                    .map_err(DirectoryError::Etcd)?;
                Ok(())
            }
        }
    }

    /// Makes a write another thread asked for.
    fn execute(&self, command: Command) -> Result<(), DirectoryError> {
        match command {
            Command::Publish(entry) => self.publish(&entry),
            Command::Withdraw(gid) => self.withdraw(gid),
            Command::PublishHost => self.put_host().map_err(DirectoryError::Etcd),
            Command::Read(gid) => self.read_gid(gid).map_err(DirectoryError::Etcd),
        }
    }

    /// Reads `gid`'s key (a linearizable read) into the view. An absent
    /// key changes nothing: deletions are the watch's to apply, in order.
    fn read_gid(&self, gid: Ipv4Addr) -> Result<(), EtcdError> {
        let answer = self.call(
            "the GID's read",
            "/v3/kv/range",
            &json!({ "key": b64(&gid_key(gid)) }),
        )?;
        let mut view = self.view_mut();
        let mut changed = false;
        for kv in answer
            .get("kvs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            changed |= apply(&mut view, kv, false);
        }
        if changed {
            self.changed();
        }
        Ok(())
    }

    /// Whether one more read on a miss fits this second's budget.
    fn may_read(&self) -> bool {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if now.duration_since(reads.0) >= Duration::from_secs(1) {
            *reads = (now, 0);
        }
        reads.1 += 1;
        reads.1 <= READS_PER_SECOND
    }

    fn publish(&self, entry: &GidEntry) -> Result<(), DirectoryError> {
        let me = self.me().name;
        let not_ours = |detail: String| DirectoryError::NotInPool {
            gid: entry.gid,
            host: me.clone(),
            detail,
        };
        if entry.host != me {
            return Err(not_ours(format!(
                " (the entry names host {}, this is {me})",
                entry.host
            )));
        }
        match self
            .pool
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&entry.gid)
        {
            Some(p) if p.tenant == entry.tenant => {}
            Some(p) => {
                return Err(not_ours(format!(
                    " for tenant {} (the file gives it to tenant {})",
                    entry.tenant, p.tenant
                )))
            }
            None => return Err(not_ours(String::new())),
        }
        if let Some(other) = self.view().gids.get(&entry.gid).filter(|g| g.host != me) {
            return Err(DirectoryError::Taken {
                gid: entry.gid,
                owner: other.host.clone(),
            });
        }
        self.put_gid(entry)?;
        self.published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(entry.gid, entry.clone());
        let mut view = self.view_mut();
        if view.gids.get(&entry.gid) != Some(entry) {
            view.gids.insert(entry.gid, entry.clone());
            self.changed();
        }
        Ok(())
    }

    fn withdraw(&self, gid: Ipv4Addr) -> Result<(), DirectoryError> {
        let mine = self
            .published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&gid);
        if !mine {
            return Ok(());
        }
        let key = b64(&gid_key(gid));
        self.call(
            "the GID's delete",
            "/v3/kv/deleterange",
            &json!({ "key": key }),
        )
        .map_err(DirectoryError::Etcd)?;
        self.published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&gid);
        if self.view_mut().gids.remove(&gid).is_some() {
            self.changed();
        }
        Ok(())
    }

    /// Keeps the lease alive; if etcd lost it, registers again and
    /// publishes this host's GIDs again.
    fn keepalive(&self) -> Result<(), EtcdError> {
        let id = self.lease.load(Ordering::Acquire);
        let answer = self.call(
            "the lease keepalive",
            "/v3/lease/keepalive",
            &json!({ "ID": id.to_string() }),
        )?;
        // A stream of answers: one here. TTL absent or 0: the lease is gone.
        let ttl = int_field(answer.get("result").unwrap_or(&answer), "TTL").unwrap_or(0);
        if ttl > 0 {
            return Ok(());
        }
        tracing::warn!(lease = id, "etcd lost this host's lease: registering again");
        self.register()?;
        let published: Vec<GidEntry> = self
            .published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for entry in published {
            if let Err(e) = self.put_gid(&entry) {
                tracing::error!(
                    tenant = %entry.tenant,
                    gid = %entry.gid,
                    "Cannot publish the GID again: {}",
                    vrdma_errors::error_chain(&e)
                );
            }
        }
        Ok(())
    }

    /// Replaces the view with a range read of the prefix; returns its
    /// revision.
    fn resync(&self) -> Result<i64, EtcdError> {
        let answer = self.call(
            "the range read",
            "/v3/kv/range",
            &json!({ "key": b64(PREFIX), "range_end": b64(PREFIX_END) }),
        )?;
        let revision = answer
            .pointer("/header/revision")
            .and_then(as_int)
            .ok_or_else(|| EtcdError::Malformed {
                what: "the range read",
                detail: "no header.revision".into(),
            })?;
        let mut fresh = View::default();
        for kv in answer
            .get("kvs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            apply(&mut fresh, kv, false);
        }
        let mut view = self.view_mut();
        let same = view.gids == fresh.gids && view.hosts == fresh.hosts;
        *view = fresh;
        if !same {
            self.changed();
        }
        Ok(revision)
    }

    /// Follows the watch from `start` until it breaks or the directory
    /// stops; returns why it broke.
    fn watch(&self, start: i64) -> Result<(), EtcdError> {
        let body = json!({ "create_request": {
            "key": b64(PREFIX), "range_end": b64(PREFIX_END), "start_revision": start.to_string(),
        }})
        .to_string();
        let mut last = None;
        let mut stream = None;
        for (k, addr) in self.order() {
            match http::post(addr, "/v3/watch", body.as_bytes(), WATCH_POLL) {
                Ok(s) => {
                    self.preferred.store(k, Ordering::Relaxed);
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let Some(mut stream) = stream else {
            return Err(EtcdError::Unreachable {
                tried: format!("{:?}", self.endpoints),
                last: last.unwrap_or(HttpError::Malformed {
                    addr: SocketAddr::from(([0, 0, 0, 0], 0)),
                    what: "no endpoint configured",
                }),
            });
        };
        let mut pending: Vec<u8> = Vec::new();
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            let piece = match stream.next_piece() {
                Ok(Some(piece)) => piece,
                Ok(None) => {
                    return Err(EtcdError::Malformed {
                        what: "the watch",
                        detail: "the stream ended".into(),
                    })
                }
                Err(e) if e.is_timeout() => continue,
                Err(last) => {
                    return Err(EtcdError::Unreachable {
                        tried: stream_addr(&last),
                        last,
                    })
                }
            };
            pending.extend_from_slice(&piece);
            if pending.len() > http::MAX_BODY {
                return Err(EtcdError::Malformed {
                    what: "the watch",
                    detail: "a message larger than 64 MiB".into(),
                });
            }
            let mut messages = serde_json::Deserializer::from_slice(&pending).into_iter::<Value>();
            let mut consumed = 0;
            let mut batch = Vec::new();
            while let Some(message) = messages.next() {
                match message {
                    Ok(m) => {
                        consumed = messages.byte_offset();
                        batch.push(m);
                    }
                    Err(e) if e.is_eof() => break,
                    Err(e) => {
                        return Err(EtcdError::Malformed {
                            what: "the watch",
                            detail: e.to_string(),
                        })
                    }
                }
            }
            pending.drain(..consumed);
            for message in batch {
                self.watch_message(&message)?;
            }
        }
    }

    /// Applies one message of the watch stream.
    fn watch_message(&self, message: &Value) -> Result<(), EtcdError> {
        if let Some(error) = message.get("error") {
            return Err(EtcdError::Malformed {
                what: "the watch",
                detail: error.to_string(),
            });
        }
        let result = message.get("result").unwrap_or(message);
        if result.get("canceled").and_then(Value::as_bool) == Some(true)
            || result.get("compact_revision").and_then(as_int).unwrap_or(0) != 0
        {
            return Err(EtcdError::Malformed {
                what: "the watch",
                detail: format!("cancelled by etcd: {result}"),
            });
        }
        let events = result.get("events").and_then(Value::as_array);
        let mut view = self.view_mut();
        let mut changed = false;
        for event in events.into_iter().flatten() {
            let delete = event.get("type").and_then(Value::as_str) == Some("DELETE");
            if let Some(kv) = event.get("kv") {
                changed |= apply(&mut view, kv, delete);
            }
        }
        if changed {
            self.changed();
        }
        self.health(true, None);
        Ok(())
    }

    /// Sleeps `d`, waking early if the directory stops; `false` if it did.
    fn sleep(&self, d: Duration) -> bool {
        let end = Instant::now() + d;
        while !self.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= end {
                return true;
            }
            std::thread::sleep((end - now).min(Duration::from_millis(100)));
        }
        false
    }
}

fn stream_addr(e: &HttpError) -> String {
    match e {
        HttpError::Connect { addr, .. }
        | HttpError::Io { addr, .. }
        | HttpError::Status { addr, .. }
        | HttpError::Malformed { addr, .. }
        | HttpError::TooLarge { addr }
        | HttpError::Closed { addr } => addr.to_string(),
    }
}

/// An int64 of the JSON gateway: a string of digits (or a number).
fn as_int(v: &Value) -> Option<i64> {
    v.as_str()
        .and_then(|s| s.parse().ok())
        .or_else(|| v.as_i64())
}

fn int_field(v: &Value, name: &str) -> Option<i64> {
    v.get(name).and_then(as_int)
}

/// Applies a key-value of etcd to `view` (a put, or a delete); returns
/// whether the view changed. A bad entry is skipped and logged (and what
/// its key held before is dropped: the key no longer holds it).
fn apply(view: &mut View, kv: &Value, delete: bool) -> bool {
    let Some(key) = kv
        .get("key")
        .and_then(Value::as_str)
        .and_then(|k| B64.decode(k).ok())
        .and_then(|k| String::from_utf8(k).ok())
    else {
        tracing::warn!("Skipping an etcd entry with an undecodable key");
        return false;
    };
    let value = kv
        .get("value")
        .and_then(Value::as_str)
        .and_then(|v| B64.decode(v).ok())
        .unwrap_or_default();
    if let Some(name) = key.strip_prefix(HOSTS) {
        let old = view.hosts.remove(name);
        if delete {
            return old.is_some();
        }
        match parse_host(name, &value) {
            Ok(entry) => {
                let changed = old.as_ref() != Some(&entry);
                view.hosts.insert(name.to_owned(), entry);
                changed
            }
            Err(why) => {
                tracing::warn!(key, "Skipping a bad host entry from etcd: {why}");
                old.is_some()
            }
        }
    } else if let Some(addr) = key.strip_prefix(GIDS) {
        let Ok(gid) = addr.parse::<Ipv4Addr>() else {
            tracing::warn!(key, "Skipping an etcd entry whose key is no IPv4 GID");
            return false;
        };
        let old = view.gids.remove(&gid);
        if delete {
            return old.is_some();
        }
        match parse_gid(gid, &value) {
            Ok(entry) => {
                let changed = old.as_ref() != Some(&entry);
                view.gids.insert(gid, entry);
                changed
            }
            Err(why) => {
                tracing::warn!(key, "Skipping a bad GID entry from etcd: {why}");
                old.is_some()
            }
        }
    } else {
        tracing::debug!(key, "Ignoring an unknown key under the directory's prefix");
        false
    }
}

fn parse_host(name: &str, value: &[u8]) -> Result<HostEntry, String> {
    let entry: HostEntry = serde_json::from_slice(value).map_err(|e| e.to_string())?;
    if entry.name != name {
        return Err(format!("it names host {:?}", entry.name));
    }
    if !is_valid_name(name) {
        return Err("invalid host name".into());
    }
    if let Some(problem) = unusable(entry.address) {
        return Err(format!("address {}: {problem}", entry.address));
    }
    Ok(entry)
}

fn parse_gid(gid: Ipv4Addr, value: &[u8]) -> Result<GidEntry, String> {
    let entry: GidEntry = serde_json::from_slice(value).map_err(|e| e.to_string())?;
    if entry.gid != gid {
        return Err(format!("it names GID {}", entry.gid));
    }
    if let Some(problem) = unusable(gid) {
        return Err(problem.into());
    }
    for (what, name) in [
        ("host", &entry.host),
        ("tenant", &entry.tenant),
        ("network", &entry.network),
    ] {
        if !is_valid_name(name) {
            return Err(format!("invalid {what} name {name:?}"));
        }
    }
    Ok(entry)
}

/// The `vrdma-directory` thread: the lease kept alive, writes made.
fn keepalive_thread(shared: &Shared, commands: &mpsc::Receiver<(Command, Reply)>) {
    let period = Duration::from_millis(shared.lease_seconds * 1000 / 3);
    let mut next = Instant::now() + period;
    let mut backoff = MIN_BACKOFF;
    loop {
        let wait = next.saturating_duration_since(Instant::now());
        match commands.recv_timeout(wait) {
            Ok((command, reply)) => {
                let _ = reply.send(shared.execute(command));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        if Instant::now() < next {
            continue;
        }
        match shared.keepalive() {
            Ok(()) => {
                shared.health(true, None);
                backoff = MIN_BACKOFF;
                next = Instant::now() + period;
            }
            Err(e) => {
                shared.health(false, Some(&e));
                next = Instant::now() + backoff.min(period);
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// The `vrdma-dir-watch` thread: the view kept up to date.
fn watch_thread(shared: &Shared, mut revision: Option<i64>) {
    let mut backoff = MIN_BACKOFF;
    while !shared.stop.load(Ordering::Acquire) {
        let start = match revision.take() {
            Some(r) => r + 1,
            None => match shared.resync() {
                Ok(r) => r + 1,
                Err(e) => {
                    shared.health(false, Some(&e));
                    if !shared.sleep(backoff) {
                        return;
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            },
        };
        backoff = MIN_BACKOFF;
        if let Err(e) = shared.watch(start) {
            // A resync (range read) follows: it also catches deletions
            // made while the watch was down.
            shared.health(false, Some(&e));
            if !shared.sleep(backoff) {
                return;
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

impl Directory for EtcdDirectory {
    fn lookup(&self, gid: Ipv4Addr) -> Option<GidEntry> {
        self.shared.view().gids.get(&gid).cloned()
    }

    fn lookup_fresh(&self, gid: Ipv4Addr) -> Option<GidEntry> {
        if let Some(entry) = self.lookup(gid) {
            return Some(entry);
        }
        if !self.shared.may_read() {
            tracing::debug!(%gid, "Lookup missed the view; over the read budget, not asking etcd");
            return None;
        }
        if let Err(e) = self.run(Command::Read(gid)) {
            tracing::debug!(%gid, "Lookup missed the view and etcd could not be read: {}",
                vrdma_errors::error_chain(&e));
        }
        self.lookup(gid)
    }

    fn hosts(&self) -> Vec<HostEntry> {
        self.shared.view().hosts.values().cloned().collect()
    }

    fn publish(&self, entry: &GidEntry) -> Result<(), DirectoryError> {
        self.run(Command::Publish(entry.clone()))
    }

    fn withdraw(&self, gid: Ipv4Addr) -> Result<(), DirectoryError> {
        self.run(Command::Withdraw(gid))
    }

    fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::Acquire)
    }

    /// Re-reads the cluster file: this host's pool and address.
    fn reload(&self, policy: &Policy) -> Result<Vec<String>, DirectoryError> {
        let _one_at_a_time = self.reloading.lock().unwrap_or_else(|e| e.into_inner());
        let shared = &self.shared;
        let cluster = Cluster::load(&shared.cluster_file)?;
        let old_me = shared.me();
        let me =
            cluster
                .host(&old_me.name)
                .cloned()
                .ok_or_else(|| DirectoryError::UnknownHost {
                    host: old_me.name.clone(),
                    path: shared.cluster_file.clone(),
                })?;
        let pool: BTreeMap<Ipv4Addr, GidEntry> = cluster
            .pool(&me.name, &networks_of(policy))
            .into_iter()
            .map(|e| (e.gid, e))
            .collect();
        let old_pool: Vec<GidEntry> = {
            let mut current = shared.pool.write().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *current, pool.clone())
                .into_values()
                .collect()
        };
        let new_pool: Vec<GidEntry> = pool.into_values().collect();
        let mut changes = diff_views(
            std::slice::from_ref(&old_me),
            std::slice::from_ref(&me),
            &old_pool,
            &new_pool,
        );
        for c in &mut changes {
            c.insert_str(0, "pool: ");
        }
        if me != old_me {
            *shared.me.write().unwrap_or_else(|e| e.into_inner()) = me;
            self.run(Command::PublishHost)?;
        }
        Ok(changes)
    }

    fn start(&self, threads: &Threads) -> Result<(), DirectoryError> {
        let mut running = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        if !running.is_empty() {
            return Ok(());
        }
        // The watch thread starts with a resync (a range read), so that
        // nothing between open and start is lost; the calling thread (under
        // the main role, after the sandbox) opens no socket.
        let revision = None;
        let (sender, receiver) = mpsc::channel();
        let shared = Arc::clone(&self.shared);
        running.push(
            threads
                .spawn(Role::Directory, "vrdma-directory", move || {
                    keepalive_thread(&shared, &receiver)
                })
                .map_err(DirectoryError::Thread)?,
        );
        *self.commands.lock().unwrap_or_else(|e| e.into_inner()) = Some(sender);
        let shared = Arc::clone(&self.shared);
        running.push(
            threads
                .spawn(Role::Directory, "vrdma-dir-watch", move || {
                    watch_thread(&shared, revision)
                })
                .map_err(DirectoryError::Thread)?,
        );
        Ok(())
    }

    fn cluster_file(&self) -> PathBuf {
        self.shared.cluster_file.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &str) -> Value {
        json!({ "key": b64(key), "value": b64(value) })
    }

    #[test]
    fn entries_from_etcd_are_validated() {
        let mut view = View::default();
        let good = r#"{"gid":"10.0.0.5","host":"h2","tenant":"alpha","network":"blue"}"#;
        assert!(apply(&mut view, &kv("/vrdma/gids/10.0.0.5", good), false));
        assert!(!apply(&mut view, &kv("/vrdma/gids/10.0.0.5", good), false));
        assert_eq!(
            view.gids
                .get(&Ipv4Addr::new(10, 0, 0, 5))
                .map(|g| g.host.as_str()),
            Some("h2")
        );
        // Key and value disagree, bad names, unknown fields, garbage,
        // unusable addresses: skipped.
        for (key, value) in [
            ("/vrdma/gids/10.0.0.6", good),
            (
                "/vrdma/gids/10.0.0.7",
                r#"{"gid":"10.0.0.7","host":"h 2","tenant":"alpha","network":"blue"}"#,
            ),
            (
                "/vrdma/gids/10.0.0.7",
                r#"{"gid":"10.0.0.7","host":"h2","tenant":"alpha","network":"blue","x":1}"#,
            ),
            ("/vrdma/gids/10.0.0.7", "not json"),
            ("/vrdma/gids/fd00::1", good),
            (
                "/vrdma/gids/0.0.0.0",
                r#"{"gid":"0.0.0.0","host":"h2","tenant":"alpha","network":"blue"}"#,
            ),
            ("/vrdma/hosts/h3", r#"{"name":"h4","address":"10.1.0.4"}"#),
            (
                "/vrdma/hosts/h3",
                r#"{"name":"h3","address":"255.255.255.255"}"#,
            ),
            ("/vrdma/other", "x"),
        ] {
            assert!(!apply(&mut view, &kv(key, value), false), "{key} {value}");
        }
        assert_eq!(view.gids.len(), 1);
        assert!(view.hosts.is_empty());
        assert!(apply(
            &mut view,
            &kv("/vrdma/hosts/h3", r#"{"name":"h3","address":"10.1.0.3"}"#),
            false
        ));
        // A bad value replacing a good one drops it; a delete removes.
        assert!(apply(&mut view, &kv("/vrdma/gids/10.0.0.5", "{}"), false));
        assert!(view.gids.is_empty());
        assert!(apply(&mut view, &kv("/vrdma/hosts/h3", ""), true));
        assert!(view.hosts.is_empty());
        assert_eq!(as_int(&json!("42")), Some(42));
        assert_eq!(as_int(&json!(7)), Some(7));
    }
}
