//! hostd's handover through the real binary and test clients (vdevs):
//! what a new hostd (`--take-over`) is handed, the tokens each context
//! gets and who may present them, and a hostd that carries on when the
//! new one never takes over.

mod common;

use std::time::Duration;

use common::*;
use vrdma_hostd::admin::{recv_response, AdminRequest, AdminResponse};
use vrdma_hostd::handover::{decode, Sockets};
use vrdma_hostd_protocol::channel::Channel;
use vrdma_hostd_protocol::messages::{Notification, Request};
use vrdma_spec::verbs::QpState;

/// The token the hostd that handed over sent `c` on its notification
/// channel.
fn token_of(c: &Client) -> String {
    match c.notification(DEADLINE) {
        Some(Notification::Handover { token }) => token,
        other => panic!("expected a handover token, got {other:?}"),
    }
}

fn resume(c: &Client, token: &str) -> Result<(), i32> {
    errno(c.call(&Request::ResumeHandover {
        token: token.into(),
    }))
}

#[test]
fn each_context_gets_a_token_only_its_own_device_may_present() {
    let mut hostd = Hostd::start("handover-tokens", &config(8));
    let mut alpha = Client::ready(&hostd.socket, "alpha", "a0");
    alpha.loopback(1, 2);
    let beta = Client::ready(&hostd.socket, "beta", "b0");
    let status = hostd.take_over();
    assert!(status.success(), "the previous hostd exited with {status}");
    let (ta, tb) = (token_of(&alpha), token_of(&beta));
    assert_ne!(ta, tb);
    // The vdevs register again with the new hostd.
    let alpha2 = Client::hello(&hostd.socket, "alpha", "a0").expect("alpha again");
    let beta2 = Client::hello(&hostd.socket, "beta", "b0").expect("beta again");
    let other = Client::hello(&hostd.socket, "alpha", "a1").expect("another device of alpha");
    // Another tenant's token, another device's, an unknown one: refused,
    // and the token stays for its own context.
    assert_eq!(resume(&alpha2, &tb), Err(libc::EACCES));
    assert_eq!(resume(&other, &ta), Err(libc::EACCES));
    assert_eq!(resume(&alpha2, &"0".repeat(32)), Err(libc::ENOENT));
    assert_eq!(resume(&alpha2, &ta), Ok(()));
    // Once only.
    assert_eq!(resume(&alpha2, &ta), Err(libc::ENOENT));
    assert_eq!(resume(&beta2, &tb), Ok(()));
}

/// A new hostd that takes the sockets and the blob but never says it took
/// them (it died, or refused the blob): the running hostd carries on, its
/// QPs with it. The blob names every context with its QPs in their states.
#[test]
fn a_handover_not_taken_leaves_the_running_hostd_serving() {
    let hostd = Hostd::start("handover-abandoned", &config(8));
    let mut alpha = Client::ready(&hostd.socket, "alpha", "a0");
    let qp = alpha.loopback(1, 2);
    alpha.loopback_write_works(qp, 0x100, 7);
    let chan = Channel::connect(&hostd.admin).expect("admin socket");
    chan.send(&AdminRequest::Handover, &[]).expect("ask");
    let (sockets, fds): (Sockets, _) = chan.recv().expect("the sockets");
    assert_eq!(
        fds.len(),
        2 + usize::from(sockets.udp) + usize::from(sockets.metrics),
        "{sockets:?}"
    );
    let blob = match recv_response(&chan).expect("the blob") {
        AdminResponse::Handover { blob } => blob,
        other => panic!("unexpected {other:?}"),
    };
    let handed = decode(blob.as_bytes()).expect("a valid blob");
    let context = (handed.contexts.values())
        .find(|c| c.tenant == "alpha" && c.device == "a0")
        .expect("alpha's context");
    let states: Vec<(u32, u8)> = context.qps.iter().map(|q| (q.vqpn, q.state)).collect();
    let rts = u8::from(QpState::Rts);
    assert_eq!(states, [(1, rts), (2, rts)]);
    // The new hostd goes without a word.
    drop(chan);
    drop(fds);
    std::thread::sleep(Duration::from_millis(50));
    alpha.loopback_write_works(qp, 0x200, 8);
    assert!(alpha.notification(Duration::from_millis(100)).is_none());
}

/// `--take-over` with no hostd running fails at once, saying why.
#[test]
fn take_over_without_a_running_hostd_fails_clearly() {
    let dir = std::env::temp_dir().join(format!("hostd-it-{}-none", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hostd"))
        .arg("--socket")
        .arg(dir.join("hostd.sock"))
        .arg("--take-over")
        .output()
        .expect("run hostd");
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("Cannot take over from the running hostd")
            && stderr.contains("Cannot reach the running hostd's admin socket"),
        "{stderr}"
    );
}
