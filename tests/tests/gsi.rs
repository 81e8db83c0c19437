//! QP1 through a real hostd, as a device's control plane uses it: two
//! devices (raw hostd protocol clients, as vdev speaks it) of tenants in
//! one network exchange a connection-manager MAD — the receiver woken by
//! its eventfd, the MAD naming its sender's GID — while a tenant in
//! another network is refused (`EACCES`) and sees nothing; and MADs
//! pushed on the device's socket while none waits, the rest taken in
//! order behind them.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_hostd_protocol::messages::{MadOut, Request, Response};
use vrdma_tests::daemon::Hostd;
// alpha and gamma in network blue, beta alone in red.
use vrdma_tests::hosts::POLICY;
use vrdma_tests::rogue::{Answer, RogueVdev};

/// A REQ-shaped CM MAD (base version 1, class 0x07, method SEND,
/// attribute 0x0010) carrying `tag`.
fn req(tag: u8) -> Vec<u8> {
    let mut m = vec![0u8; 256];
    m[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
    m[16..18].copy_from_slice(&0x0010u16.to_be_bytes());
    m[24] = tag;
    m
}

fn send(to: [u8; 16], mad: Vec<u8>) -> Request {
    Request::SendMad(MadOut {
        peer: to,
        traffic_class: 0,
        mad,
    })
}

#[test]
fn a_cm_mad_reaches_qp1_of_a_device_in_the_senders_network_only() {
    let hostd = Hostd::start(Some(POLICY));
    let alpha = RogueVdev::hello(&hostd.socket, "alpha", "a0").expect("alpha");
    let gamma = RogueVdev::hello(&hostd.socket, "gamma", "g0").expect("gamma");
    let beta = RogueVdev::hello(&hostd.socket, "beta", "b0").expect("beta");
    let woken = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    assert_eq!(
        gamma.call(&Request::GsiNotify, &[woken.as_raw_fd()]),
        Answer::Ok
    );
    assert_eq!(alpha.call(&send(gamma.gid(), req(7)), &[]), Answer::Ok);
    let deadline = Instant::now() + Duration::from_secs(5);
    while woken.read().is_err() {
        assert!(Instant::now() < deadline, "gamma was not woken");
        std::thread::sleep(Duration::from_millis(1));
    }
    match gamma.call(&Request::TakeMads { max: 16 }, &[]) {
        Answer::Mads(mads) => {
            assert_eq!(mads.len(), 1);
            assert_eq!(mads[0].peer, alpha.gid(), "the sender's GID");
            assert_eq!(mads[0].peer_qpn, 1, "from QP1");
            assert_eq!(mads[0].mad, req(7));
        }
        other => panic!("{other:?}"),
    }
    // beta (red) may not reach alpha (blue), nor alpha beta.
    assert_eq!(
        beta.call(&send(alpha.gid(), req(8)), &[]),
        Answer::Refused(libc::EACCES)
    );
    assert_eq!(
        alpha.call(&send(beta.gid(), req(9)), &[]),
        Answer::Refused(libc::EACCES)
    );
    for (who, dev) in [("alpha", &alpha), ("beta", &beta), ("gamma", &gamma)] {
        assert_eq!(
            dev.call(&Request::TakeMads { max: 16 }, &[]),
            Answer::Mads(Vec::new()),
            "{who} got something"
        );
    }
    // Only CM MADs, of 256 bytes.
    let mut smp = req(1);
    smp[1] = 0x81;
    for bad in [smp, req(2)[..255].to_vec()] {
        assert_eq!(
            alpha.call(&send(gamma.gid(), bad), &[]),
            Answer::Refused(libc::EINVAL)
        );
    }
}

/// A REQ-shaped MAD numbered `n` (two bytes).
fn numbered(n: u16) -> Vec<u8> {
    let mut m = req(0);
    m[24..26].copy_from_slice(&n.to_be_bytes());
    m
}

fn number(mad: &[u8]) -> u16 {
    u16::from_be_bytes([mad[24], mad[25]])
}

#[test]
fn mads_are_pushed_while_none_waits_and_the_rest_wait_in_order_behind_them() {
    let hostd = Hostd::start(Some(POLICY));
    let alpha = RogueVdev::hello(&hostd.socket, "alpha", "a0").expect("alpha");
    let gamma = RogueVdev::hello(&hostd.socket, "gamma", "g0").expect("gamma");
    let woken = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    assert_eq!(
        gamma.call(&Request::GsiNotify, &[woken.as_raw_fd()]),
        Answer::Ok
    );
    let push = gamma.gsi_push();
    let pushed = |out: &mut Vec<u16>| {
        while let Some(r) = push.try_recv::<Response>().expect("push socket") {
            match r {
                Response::Mads(mads) => {
                    assert_eq!(mads.len(), 1, "one MAD a message");
                    assert_eq!(mads[0].peer, alpha.gid(), "the sender's GID");
                    assert_eq!(mads[0].peer_qpn, 1, "from QP1");
                    out.push(number(&mads[0].mad));
                }
                other => panic!("{other:?} on the push socket"),
            }
        }
    };
    // One MAD: pushed, nothing waits, no wake-up.
    assert_eq!(alpha.call(&send(gamma.gid(), numbered(0)), &[]), Answer::Ok);
    let mut got = Vec::new();
    pushed(&mut got);
    assert_eq!(got, vec![0]);
    assert!(woken.read().is_err(), "woken for a pushed MAD");
    assert_eq!(
        gamma.call(&Request::TakeMads { max: 16 }, &[]),
        Answer::Mads(Vec::new())
    );
    // A burst the socket cannot hold: what it holds comes first, the rest
    // waits in hostd (the eventfd says so), in order, and every MAD after
    // the first that waited waits too, until none does.
    const BURST: u16 = 1000;
    for n in 1..=BURST {
        assert_eq!(alpha.call(&send(gamma.gid(), numbered(n)), &[]), Answer::Ok);
    }
    let mut got = Vec::new();
    pushed(&mut got);
    let on_socket = got.len();
    assert!(
        (1..usize::from(BURST)).contains(&on_socket),
        "{on_socket} of {BURST} pushed: the socket should have filled"
    );
    assert!(woken.read().is_ok(), "not woken for the MADs that wait");
    loop {
        match gamma.call(&Request::TakeMads { max: 64 }, &[]) {
            Answer::Mads(mads) if mads.is_empty() => break,
            Answer::Mads(mads) => got.extend(mads.iter().map(|m| number(&m.mad))),
            other => panic!("{other:?}"),
        }
    }
    pushed(&mut got);
    assert_eq!(
        got,
        (1..=BURST).collect::<Vec<_>>(),
        "every MAD once, in order"
    );
    // None waits again: the next is pushed.
    assert_eq!(alpha.call(&send(gamma.gid(), numbered(7)), &[]), Answer::Ok);
    let mut got = Vec::new();
    pushed(&mut got);
    assert_eq!(got, vec![7]);
    // A socket whose reader is gone: MADs wait to be taken instead.
    drop(push);
    for n in [8, 9] {
        assert_eq!(alpha.call(&send(gamma.gid(), numbered(n)), &[]), Answer::Ok);
    }
    match gamma.call(&Request::TakeMads { max: 16 }, &[]) {
        Answer::Mads(mads) => {
            assert_eq!(
                mads.iter().map(|m| number(&m.mad)).collect::<Vec<_>>(),
                vec![8, 9]
            );
        }
        other => panic!("{other:?}"),
    }
}
