//! QP1 through a real hostd, as a device's control plane uses it: two
//! devices (raw hostd protocol clients, as vdev speaks it) of tenants in
//! one network exchange a connection-manager MAD — the receiver woken by
//! its eventfd, the MAD naming its sender's GID — while a tenant in
//! another network is refused (`EACCES`) and sees nothing.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_hostd_protocol::messages::{MadOut, Request};
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
