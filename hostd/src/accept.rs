//! The accept loop of hostd's two sockets, vdevs' and `vrdmactl`'s: a
//! thread per connection, a ceiling on how many are served at once, and a
//! failed accept that never spins.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vrdma_hostd_protocol::channel::{Channel, Listener};

use crate::seccomp::{Role, Threads};

/// Whose connections a socket takes, and how they are served.
#[derive(Debug, Clone, Copy)]
pub struct Connections {
    /// Who connects, in log lines: `vdev`, `admin`.
    pub peer: &'static str,
    /// The role and the name of each connection's thread.
    pub role: Role,
    pub thread: &'static str,
    /// Connections served at once (each costs a thread); one more is
    /// closed at once.
    pub max: usize,
}

/// Accepts connections on `listener` forever (it never returns), each
/// served by `serve` on a thread of its own started through `threads`.
pub fn serve_connections(
    listener: &Listener,
    threads: &Threads,
    connections: Connections,
    serve: impl Fn(Channel) + Send + Sync + 'static,
) {
    let Connections {
        peer,
        role,
        thread,
        max,
    } = connections;
    let serve = Arc::new(serve);
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let channel = match listener.accept() {
            Ok(channel) => channel,
            Err(e) => {
                tracing::warn!("{peer} accept failed: {}", vrdma_errors::error_chain(&e));
                // EMFILE and friends: do not spin on them.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= max {
            active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("Too many {peer} connections; closing a new one");
            continue;
        }
        let (serve, served) = (Arc::clone(&serve), Arc::clone(&active));
        let spawned = threads.spawn(role, thread, move || {
            serve(channel);
            served.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(e) = spawned {
            active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("Cannot start the thread of a {peer} connection: {e}");
        }
    }
}
