//! vdev's connection manager thread under its own seccomp filter (role
//! `Cm`, violations kill the process): a whole connection — listen,
//! connect, accept, establish, disconnect — through a real hostd, with
//! both devices' CM threads filtered. A call missing from the role's
//! allow-list kills this test's process.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use vrdma_isolation::seccomp::SeccompMode;
use vrdma_tests::daemon::Hostd;
// alpha and gamma in network blue, beta alone in red.
use vrdma_tests::hosts::POLICY;
use vrdma_vdev::cm::{CmConfig, CmEventKind, CmOwner, CmService, ConnParam, PortSpace};
use vrdma_vdev::fabric::Fabric;
use vrdma_vdev::seccomp::{Role, Threads};

#[track_caller]
fn expect(owner: &CmOwner, kind: CmEventKind) {
    let e = owner
        .wait_event(Duration::from_secs(5))
        .expect("event")
        .unwrap_or_else(|| panic!("no {kind:?}"));
    assert_eq!(e.kind, kind, "{e:?}");
}

#[test]
fn the_cm_thread_runs_a_connection_under_its_seccomp_role() {
    let hostd = Hostd::start(Some(POLICY));
    // Threads::start filters the thread that calls it (as vdev's main
    // thread): a thread of its own here, so that this one stays free to
    // play the owners. The CM threads are started by its launcher, each
    // under the Cm role's filter.
    let threads = std::thread::spawn(|| {
        Threads::start(SeccompMode::default(), Role::Main, &Role::SPAWNED, "vdev").expect("seccomp")
    })
    .join()
    .expect("seccomp thread");
    assert!(threads.is_filtered());
    let config = CmConfig {
        packet_life_time: 10,
        cm_response_timeout: 14,
        max_cm_retries: 3,
        ..CmConfig::default()
    };
    let start = |tenant: &str| {
        let fabric = Arc::new(Fabric::connect(&hostd.socket, tenant, tenant).expect("register"));
        let ip = Ipv4Addr::from(vrdma_spec::gid::ipv4_of(&fabric.gid).expect("IPv4"));
        let cm = CmService::start(fabric, tenant, config.clone(), &threads).expect("CM");
        (cm, ip)
    };
    let (a, _) = start("alpha");
    let (b, bip) = start("gamma");
    let (ao, bo) = (
        a.open_owner().expect("owner"),
        b.open_owner().expect("owner"),
    );
    let l = bo.create_id(PortSpace::Tcp, None).expect("id");
    bo.bind_addr(l, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7600))
        .expect("bind");
    bo.listen(l, 4).expect("listen");
    let id = ao.create_id(PortSpace::Tcp, None).expect("id");
    ao.resolve_addr(id, None, SocketAddrV4::new(bip, 7600))
        .expect("resolve");
    expect(&ao, CmEventKind::AddrResolved);
    ao.resolve_route(id).expect("route");
    expect(&ao, CmEventKind::RouteResolved);
    let param = ConnParam {
        qp_num: 0x42,
        ..ConnParam::default()
    };
    ao.connect(id, &param).expect("connect");
    let req = bo
        .wait_event(Duration::from_secs(5))
        .expect("event")
        .expect("CONNECT_REQUEST");
    assert_eq!(req.kind, CmEventKind::ConnectRequest);
    bo.accept(req.id, &param).expect("accept");
    expect(&ao, CmEventKind::ConnectResponse);
    ao.establish(id).expect("establish");
    expect(&ao, CmEventKind::Established);
    expect(&bo, CmEventKind::Established);
    ao.disconnect(id).expect("disconnect");
    expect(&bo, CmEventKind::Disconnected);
    bo.disconnect(req.id).expect("DREP");
    expect(&ao, CmEventKind::Disconnected);
    // Timers ran on the filtered threads too.
    expect(&ao, CmEventKind::TimewaitExit);
    expect(&bo, CmEventKind::TimewaitExit);
    drop((ao, bo));
    a.stop();
    b.stop();
}

/// The `gid=` a vdev logged when it registered with hostd.
fn logged_gid(log: &str) -> [u8; 16] {
    let line = log
        .lines()
        .find(|l| l.contains("Registered with hostd"))
        .expect("vdev logged its registration");
    let at = line.find(" gid=").expect("vdev logged its GID") + 5;
    let text: String = line[at..]
        .chars()
        .take_while(|c| !c.is_whitespace())
        .collect();
    let ip: std::net::Ipv6Addr = text
        .trim_matches(|c: char| !c.is_ascii_hexdigit() && c != ':' && c != '.')
        .parse()
        .unwrap_or_else(|e| panic!("{e}: {text:?} in\n{log}"));
    ip.octets()
}

#[test]
fn the_vdev_daemon_runs_a_connection_manager_that_answers_peers() {
    use std::os::fd::AsRawFd;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
    use vrdma_cm::{
        service_id, CmMessage, ConnectParams, Gid, Mad, MadPath, RejectReason, TargetMessage,
    };
    use vrdma_hostd_protocol::messages::{MadOut, Request};
    use vrdma_tests::daemon::Vdev;
    use vrdma_tests::rogue::{Answer, RogueVdev};

    let hostd = Hostd::start(Some(POLICY));
    let vdev = Vdev::on_hostd(&hostd, "gamma", &[]);
    vdev.wait_for_frontend(1);
    let gid = logged_gid(&vdev.log());
    let peer = RogueVdev::hello(&hostd.socket, "alpha", "peer").expect("alpha");
    let woken = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    assert_eq!(
        peer.call(&Request::GsiNotify, &[woken.as_raw_fd()]),
        Answer::Ok
    );
    // A REQ for TCP port 1234, where nobody listens on vdev's device.
    let path = MadPath {
        local: Gid(peer.gid()),
        remote: Gid(gid),
    };
    let mut req = ConnectParams::new(service_id(PortSpace::Tcp, 1234), path, 0x77, 1).req;
    req.local_comm_id = 0x1234_5678;
    req.local_ca_guid = 0x0200_0000_0000_0001;
    let mad = Mad::new(0xabcd_0000_1234_5678, CmMessage::Req(req))
        .encode()
        .expect("REQ");
    let sent = peer.call(
        &Request::SendMad(MadOut {
            peer: gid,
            traffic_class: 0,
            mad: mad.to_vec(),
        }),
        &[],
    );
    assert_eq!(sent, Answer::Ok);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while woken.read().is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "vdev's CM did not answer:\n{}",
            vdev.log()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let Answer::Mads(mads) = peer.call(&Request::TakeMads { max: 8 }, &[]) else {
        panic!("TakeMads");
    };
    assert_eq!(mads.len(), 1);
    assert_eq!(mads[0].peer, gid);
    let reply = Mad::decode(&mads[0].mad).expect("a CM MAD");
    assert_eq!(reply.header.tid, 0xabcd_0000_1234_5678, "the REQ's TID");
    let CmMessage::Rej(rej) = reply.msg else {
        panic!("{:?}", reply.msg);
    };
    assert_eq!(rej.reason, RejectReason::INVALID_SERVICE_ID);
    assert_eq!(rej.message, TargetMessage::Req);
    assert_eq!(rej.remote_comm_id, 0x1234_5678);
    // vdev runs sandboxed: every thread filtered, the CM's too.
    let (filtered, all) = vdev.seccomp_threads();
    assert_eq!(filtered, all, "{}", vdev.log());
    vdev.assert_logged(&["Connection manager started"]);
}
