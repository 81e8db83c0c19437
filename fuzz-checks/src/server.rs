//! A real hostd for the checks that need one: its [`Server`] with the
//! policy file loaded by `Config::try_from` as hostd's command line does,
//! its datapath with a thread, and its software NIC, in this process. One
//! per check and process: hostd is built to outlive its vdevs, so serving
//! input after input is what it promises.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vrdma_hostd::config::{Args, Config};
use vrdma_hostd::datapath::Datapath;
use vrdma_hostd::server::Server;
use vrdma_hostd::stats::Usage;
use vrdma_hostd_protocol::channel::{ChannelError, Listener};

/// Prefix of the scratch directories (policy file, socket).
const SCRATCH: &str = "vrdma-fuzz-hostd";

/// A running hostd.
pub struct Hostd {
    pub server: Arc<Server>,
    /// The server's datapath, whose accounts the admin socket reports.
    pub datapath: Arc<Datapath>,
    /// Its control socket, when it listens on one ([`Hostd::start`] with
    /// `listen`); connections otherwise arrive over socketpairs.
    pub socket: Option<PathBuf>,
    /// One message each time a connection on the socket has been served
    /// to its end (its device torn down, its thread idle again).
    ended: Option<Mutex<Receiver<()>>>,
}

impl Hostd {
    /// Starts hostd as `tag` with `policy` (TOML) and `physical_qps`
    /// physical QPs; with `listen`, it also accepts vdevs on a socket in a
    /// scratch directory that lives as long as the process.
    pub fn start(tag: &str, policy: &str, physical_qps: u32, listen: bool) -> Self {
        remove_stale_scratch();
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("{SCRATCH}-{pid}-{tag}"));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let policy_file = dir.join("policy.toml");
        std::fs::write(&policy_file, policy).expect("write the policy file");
        let socket = dir.join("hostd.sock");
        let config = Config::try_from(Args {
            socket: Some(socket.clone()),
            admin_socket: None,
            config: None,
            policy: Some(policy_file.clone()),
            physical_qps: Some(physical_qps),
            datapath_threads: Some(1),
            datapath_cpus: None,
            spin_us: Some(0),
            line_rate_mbps: None,
            metrics_listen: None,
            link_layer: None,
            // Sessions end without a release: nothing is kept for a
            // successor.
            orphan_grace_ms: Some(0),
            take_over: false,
            sandbox: Default::default(),
        })
        .expect("a valid hostd configuration");
        let _ = std::fs::remove_file(&policy_file);
        let datapath = vrdma_hostd::datapath(&config).expect("datapath");
        datapath
            .start(&vrdma_hostd::seccomp::Threads::unfiltered())
            .expect("datapath threads");
        let server = Server::new(config, Arc::clone(&datapath));
        let (socket, ended) = if listen {
            let ended = serve_one_at_a_time(&server, &socket, tag);
            (Some(socket), Some(Mutex::new(ended)))
        } else {
            let _ = std::fs::remove_dir_all(&dir);
            (None, None)
        };
        Hostd {
            server,
            datapath,
            socket,
            ended,
        }
    }

    /// What `tenant` holds by hostd's accounts.
    pub fn usage(&self, tenant: &str) -> Usage {
        self.datapath.lock().accounts().usage(tenant)
    }

    /// Waits until hostd has served the connection on its socket to the
    /// end, after the vdev hung up (at most 10 s), and asserts that
    /// `tenant` holds nothing any more.
    pub fn await_gone(&self, tenant: &str) {
        let ended = self.ended.as_ref().expect("hostd listens on a socket");
        let ended = ended.lock().unwrap_or_else(|e| e.into_inner());
        let served = ended.recv_timeout(Duration::from_secs(10));
        assert!(served.is_ok(), "hostd still serves a vdev that hung up");
        assert_eq!(
            self.usage(tenant),
            Usage::default(),
            "{tenant} holds something after its vdev left"
        );
    }
}

/// Accepts vdevs on `socket` and serves them one at a time on one thread,
/// as `Server::serve` does on a thread per connection: a check waits for
/// the end of each connection (the returned receiver), so no thread of a
/// past input is still exiting when the next input begins (LeakSanitizer
/// would take its thread record for a leak) and the device's name is free
/// again.
fn serve_one_at_a_time(server: &Arc<Server>, socket: &std::path::Path, tag: &str) -> Receiver<()> {
    let listener = Listener::bind(socket).expect("bind hostd's socket");
    let (done, ended) = mpsc::channel();
    let serving = Arc::clone(server);
    std::thread::Builder::new()
        .name(format!("fuzz-hostd-{tag}"))
        .spawn(move || loop {
            match listener.accept() {
                Ok(channel) => serving.connection(Arc::new(channel)),
                // libFuzzer's timer signal (as `Server::serve`, try again).
                Err(ChannelError::Io(e)) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => panic!("hostd's socket failed: {e}"),
            }
            if done.send(()).is_err() {
                return;
            }
        })
        .expect("hostd's accept thread");
    ended
}

/// Removes scratch directories of processes that are gone (a listening
/// hostd's socket must outlive every input, so its directory outlives the
/// process).
fn remove_stale_scratch() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SCRATCH)) else {
            continue;
        };
        let pid = rest.trim_start_matches('-').split('-').next();
        let Some(pid) = pid.and_then(|p| p.parse::<libc::pid_t>().ok()) else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A fresh eventfd.
pub fn eventfd() -> File {
    // SAFETY: eventfd has no memory preconditions; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    unsafe { File::from_raw_fd(fd) }
}
