//! vdev's connection manager service (`vrdma_vdev::cm`) through a real
//! hostd process: devices of tenants registered as vdev registers them
//! (`Fabric::connect`), each with its CM service (thread, QP1 eventfd),
//! speaking rdma_cm to each other over QP1 — listen/connect/accept with
//! private data and crossed QP attributes, reject, no listener, another
//! network, disconnect, a listener that goes away mid-handshake, SIDR for
//! UD, and 1,000 connect/disconnect cycles that leave nothing behind.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_cm::MessageKind;
use vrdma_spec::verbs::QpState;
use vrdma_tests::daemon::Hostd;
// alpha and gamma in network blue, beta alone in red.
use vrdma_tests::hosts::POLICY;
use vrdma_vdev::cm::{
    CmConfig, CmEvent, CmEventKind, CmOwner, CmService, ConnParam, IdNum, IdState, PortSpace,
    ADDR_ERROR_STATUS, UNREACHABLE_STATUS,
};
use vrdma_vdev::fabric::Fabric;
use vrdma_vdev::seccomp::Threads;

const WAIT: Duration = Duration::from_secs(5);

/// A device registered with hostd, and its connection manager.
struct Device {
    tenant: &'static str,
    ip: Ipv4Addr,
    cm: CmService,
    _fabric: Arc<Fabric>,
}

impl Device {
    fn new(hostd: &Hostd, tenant: &'static str, config: CmConfig) -> Device {
        // A name of its own each time: hostd tears a closed registration
        // down asynchronously.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("cm-{tenant}-{n}");
        let fabric = Arc::new(Fabric::connect(&hostd.socket, tenant, &name).expect("register"));
        let ip = Ipv4Addr::from(vrdma_spec::gid::ipv4_of(&fabric.gid).expect("an IPv4 GID"));
        let cm = CmService::start(fabric.clone(), tenant, config, &Threads::unfiltered())
            .expect("CM service");
        Device {
            tenant,
            ip,
            cm,
            _fabric: fabric,
        }
    }

    fn owner(&self) -> CmOwner {
        self.cm.open_owner().expect("owner")
    }
}

/// Short CM timers, so that timeouts and timewait end within a test: a
/// REQ is resent every 2·4 ms + 256 ms, 3 times (UNREACHABLE after about
/// 1 s); timewait is 128 ms.
fn fast() -> CmConfig {
    CmConfig {
        packet_life_time: 10,
        cm_response_timeout: 16,
        max_cm_retries: 3,
        sidr_timeout: 16,
        sidr_retries: 3,
        ..CmConfig::default()
    }
}

/// The next event of `owner`, which must be of `kind`.
#[track_caller]
fn expect(owner: &CmOwner, kind: CmEventKind) -> CmEvent {
    let e = owner
        .wait_event(WAIT)
        .expect("event")
        .unwrap_or_else(|| panic!("no event within {WAIT:?}; expected {kind:?}"));
    assert_eq!(e.kind, kind, "{e:?}");
    e
}

/// Nothing arrives for `owner` within `d`.
#[track_caller]
fn quiet(owner: &CmOwner, d: Duration) {
    if let Some(e) = owner.wait_event(d).expect("event") {
        panic!("unexpected event {e:?}");
    }
}

fn param(data: &[u8], qpn: u32, psn: u32) -> ConnParam {
    ConnParam {
        private_data: data.to_vec(),
        responder_resources: 4,
        initiator_depth: 2,
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num: qpn,
        starting_psn: Some(psn),
        ..ConnParam::default()
    }
}

/// A listener of `ps` on `port` of `dev`.
fn listener(dev: &Device, owner: &CmOwner, ps: PortSpace, port: u16) -> IdNum {
    let id = owner.create_id(ps, None).expect("create_id");
    let bound = owner
        .bind_addr(id, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port))
        .expect("bind");
    assert_eq!(bound.port(), port);
    owner.listen(id, 16).expect("listen");
    let _ = dev;
    id
}

/// An ID of `owner` resolved (address and route) towards `to`.
fn resolved(owner: &CmOwner, ps: PortSpace, to: SocketAddrV4) -> IdNum {
    let id = owner.create_id(ps, None).expect("create_id");
    owner.resolve_addr(id, None, to).expect("resolve_addr");
    expect(owner, CmEventKind::AddrResolved);
    owner.resolve_route(id).expect("resolve_route");
    expect(owner, CmEventKind::RouteResolved);
    id
}

/// Connects `a` to `b`'s listener on `port` and establishes: (active ID,
/// passive ID).
fn establish(a: (&CmOwner, Ipv4Addr), b: &CmOwner, port: u16, qpns: (u32, u32)) -> (IdNum, IdNum) {
    let (ao, bip) = a;
    let id = resolved(ao, PortSpace::Tcp, SocketAddrV4::new(bip, port));
    ao.connect(id, &param(b"hi", qpns.0, 1)).expect("connect");
    let req = expect(b, CmEventKind::ConnectRequest);
    b.accept(req.id, &param(b"ok", qpns.1, 2)).expect("accept");
    expect(ao, CmEventKind::ConnectResponse);
    ao.establish(id).expect("establish");
    expect(ao, CmEventKind::Established);
    expect(b, CmEventKind::Established);
    (id, req.id)
}

#[test]
fn listen_connect_accept_establish_then_disconnect_on_both_sides() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let (ao, bo) = (a.owner(), b.owner());
    let lid = listener(&b, &bo, PortSpace::Tcp, 7471);

    let id = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(b.ip, 7471));
    let info = ao.query(id).expect("query");
    assert_eq!(*info.src.ip(), a.ip, "bound to the device's address");
    assert!(info.src.port() >= 32768, "an ephemeral port: {}", info.src);
    let route = info.route.expect("route");
    assert_eq!(route.pkey, 0xffff);
    assert_eq!(route.dgid, vrdma_spec::gid::ipv4_mapped(b.ip.octets()));
    assert_eq!(route.sgid, vrdma_spec::gid::ipv4_mapped(a.ip.octets()));
    let init = ao.init_qp_attr(id, QpState::Init).expect("INIT");
    assert_eq!(
        (init.qp_state, init.port_num, init.pkey_index),
        (QpState::Init, 1, 0)
    );
    // RTR needs the peer: refused before the REP.
    assert_eq!(
        ao.init_qp_attr(id, QpState::Rtr).map_err(|e| e.errno()),
        Err(libc::EINVAL)
    );

    let hello = b"hello from alpha";
    ao.connect(id, &param(hello, 0x111, 0xabc))
        .expect("connect");
    let req = expect(&bo, CmEventKind::ConnectRequest);
    assert_eq!(req.listen_id, lid);
    assert_ne!(req.id, lid, "a new ID for the request");
    assert_eq!(&req.private_data()[..hello.len()], hello);
    assert_eq!(
        req.private_data().len(),
        56,
        "a REQ's field after the CMA header"
    );
    assert_eq!(req.qp_num, 0x111);
    // The receiver's view: the sender's initiator depth is its responder
    // resources.
    assert_eq!((req.responder_resources, req.initiator_depth), (2, 4));
    let passive = bo.query(req.id).expect("query");
    assert_eq!(passive.dst, info.src, "the CMA header's source");
    assert_eq!(passive.src, SocketAddrV4::new(b.ip, 7471));
    assert_eq!(passive.state, IdState::Connect);
    // Before accept the passive side already has its RTR attributes.
    let early = bo
        .init_qp_attr(req.id, QpState::Rtr)
        .expect("RTR before accept");
    assert_eq!(early.dest_qp_num, 0x111);

    let welcome = b"welcome, alpha";
    bo.accept(req.id, &param(welcome, 0x222, 0xdef))
        .expect("accept");
    let rep = expect(&ao, CmEventKind::ConnectResponse);
    assert_eq!(&rep.private_data()[..welcome.len()], welcome);
    assert_eq!(rep.private_data().len(), 196);
    assert_eq!(rep.qp_num, 0x222);

    // Each side's dest QPN is the other's QPN; PSNs crossed.
    let (a_rtr, a_rts) = (
        ao.init_qp_attr(id, QpState::Rtr).expect("RTR"),
        ao.init_qp_attr(id, QpState::Rts).expect("RTS"),
    );
    let (b_rtr, b_rts) = (
        bo.init_qp_attr(req.id, QpState::Rtr).expect("RTR"),
        bo.init_qp_attr(req.id, QpState::Rts).expect("RTS"),
    );
    assert_eq!(a_rtr.dest_qp_num, 0x222);
    assert_eq!(b_rtr.dest_qp_num, 0x111);
    assert_eq!((a_rtr.rq_psn, a_rts.sq_psn), (0xabc, 0xdef));
    assert_eq!((b_rtr.rq_psn, b_rts.sq_psn), (0xdef, 0xabc));
    assert_eq!(a_rtr.path_mtu, b_rtr.path_mtu);
    assert_eq!(a_rtr.ah_attr.dgid, route.dgid);
    assert_eq!(b_rtr.ah_attr.dgid, route.sgid);
    // Resources: what one side may have outstanding, the other accepts.
    assert_eq!(a_rts.max_rd_atomic, b_rtr.max_dest_rd_atomic);
    assert_eq!(b_rts.max_rd_atomic, a_rtr.max_dest_rd_atomic);
    assert_eq!((a_rts.retry_cnt, a_rts.rnr_retry), (7, 7));
    assert_eq!((b_rts.retry_cnt, b_rts.rnr_retry), (7, 7));
    assert_eq!(a_rtr.min_rnr_timer, 0);
    assert!(a_rts.timeout > 0 && b_rts.timeout > 0);

    ao.establish(id).expect("establish (RTU)");
    expect(&ao, CmEventKind::Established);
    expect(&bo, CmEventKind::Established);
    assert_eq!(a.cm.counters().connections_live, 1);
    assert_eq!(b.cm.counters().connections_live, 1);

    // Disconnect: DREQ → the peer's DISCONNECTED; its DREP → ours.
    ao.disconnect(id).expect("disconnect");
    expect(&bo, CmEventKind::Disconnected);
    bo.disconnect(req.id).expect("DREP");
    expect(&ao, CmEventKind::Disconnected);
    // Timewait ends on both sides.
    expect(&ao, CmEventKind::TimewaitExit);
    expect(&bo, CmEventKind::TimewaitExit);
    for dev in [&a, &b] {
        let c = dev.cm.counters();
        assert_eq!(c.connections_live, 0, "{}", dev.tenant);
        assert_eq!(c.agent_connections, 0, "{}", dev.tenant);
        assert_eq!(c.send_failed, 0, "{}", dev.tenant);
    }
    let (ca, cb) = (a.cm.counters(), b.cm.counters());
    assert_eq!(ca.sent(MessageKind::Req), 1);
    assert_eq!(cb.received(MessageKind::Req), 1);
    assert_eq!(cb.sent(MessageKind::Rep), 1);
    assert_eq!(cb.received(MessageKind::Rtu), 1);
    assert_eq!(ca.sent(MessageKind::Dreq), 1);
    assert_eq!(ca.received(MessageKind::Drep), 1);
}

#[test]
fn reject_carries_private_data_and_no_listener_is_rejected_as_invalid_service_id() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let (ao, bo) = (a.owner(), b.owner());
    listener(&b, &bo, PortSpace::Tcp, 7000);

    let id = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(b.ip, 7000));
    ao.connect(id, &param(b"may I?", 0x10, 1)).expect("connect");
    let req = expect(&bo, CmEventKind::ConnectRequest);
    bo.reject(req.id, b"no, thank you").expect("reject");
    let rej = expect(&ao, CmEventKind::Rejected);
    assert_eq!(rej.status, 28, "consumer defined");
    assert_eq!(&rej.private_data()[..13], b"no, thank you");
    assert_eq!(rej.private_data().len(), 148);
    assert_eq!(ao.query(id).expect("query").state, IdState::Disconnect);

    // Nobody listens on 7001.
    let id = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(b.ip, 7001));
    ao.connect(id, &param(b"anyone?", 0x11, 1))
        .expect("connect");
    let rej = expect(&ao, CmEventKind::Rejected);
    assert_eq!(rej.status, 8, "invalid service ID");
    quiet(&bo, Duration::from_millis(100));
    assert_eq!(b.cm.counters().sent(MessageKind::Rej), 2);
}

#[test]
fn another_network_gets_addr_error_and_its_target_sees_nothing() {
    let hostd = Hostd::start(Some(POLICY));
    let b = Device::new(&hostd, "gamma", fast());
    let r = Device::new(&hostd, "beta", fast());
    let (bo, ro) = (b.owner(), r.owner());
    listener(&b, &bo, PortSpace::Tcp, 7100);
    let before = b.cm.counters();

    // An address in another network and one nobody has: the same answer.
    for dst in [b.ip, Ipv4Addr::new(203, 0, 113, 77)] {
        let id = ro.create_id(PortSpace::Tcp, None).expect("create_id");
        ro.resolve_addr(id, None, SocketAddrV4::new(dst, 7100))
            .expect("resolve_addr");
        let e = expect(&ro, CmEventKind::AddrError);
        assert_eq!(e.status, ADDR_ERROR_STATUS, "{dst}");
        // Nothing further is possible from there.
        assert_eq!(
            ro.resolve_route(id).map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
        assert_eq!(
            ro.connect(id, &param(b"x", 1, 1)).map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
    }
    assert_eq!(r.cm.counters().addr_errors, 2);
    quiet(&bo, Duration::from_millis(200));
    let after = b.cm.counters();
    assert_eq!(after.received, before.received, "no MAD reached gamma");
    assert_eq!(after.ids, before.ids);
}

#[test]
fn ports_are_per_device_and_bound_once() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let (b1, b2, ao) = (b.owner(), b.owner(), a.owner());
    listener(&b, &b1, PortSpace::Tcp, 7200);
    // Another owner of the same device: EADDRINUSE, with the address or any.
    for ip in [Ipv4Addr::UNSPECIFIED, b.ip] {
        let id = b2.create_id(PortSpace::Tcp, None).expect("create_id");
        let err = b2
            .bind_addr(id, SocketAddrV4::new(ip, 7200))
            .expect_err("bound twice");
        assert_eq!(err.errno(), libc::EADDRINUSE);
    }
    // UDP's port 7200 is another space; another device's 7200 another table.
    let u = b2.create_id(PortSpace::Udp, None).expect("create_id");
    b2.bind_addr(u, SocketAddrV4::new(b.ip, 7200))
        .expect("UDP 7200");
    listener(&a, &ao, PortSpace::Tcp, 7200);
    // Not the device's address: EADDRNOTAVAIL.
    let id = b2.create_id(PortSpace::Tcp, None).expect("create_id");
    let err = b2
        .bind_addr(id, SocketAddrV4::new(a.ip, 7300))
        .expect_err("foreign address");
    assert_eq!(err.errno(), libc::EADDRNOTAVAIL);
    // Closing the owner frees its port.
    drop(b1);
    let id = b2.create_id(PortSpace::Tcp, None).expect("create_id");
    b2.bind_addr(id, SocketAddrV4::new(b.ip, 7200))
        .expect("free again");
}

#[test]
fn a_listener_that_goes_away_mid_handshake_leaves_the_connector_rejected_or_unreachable() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let ao = a.owner();

    // The listener's owner closes with the request unanswered: REJ.
    let bo = b.owner();
    listener(&b, &bo, PortSpace::Tcp, 7400);
    let id = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(b.ip, 7400));
    ao.connect(id, &param(b"knock", 0x20, 1)).expect("connect");
    expect(&bo, CmEventKind::ConnectRequest);
    let started = Instant::now();
    drop(bo);
    let e = expect(&ao, CmEventKind::Rejected);
    assert_eq!(e.status, 28);
    assert!(started.elapsed() < Duration::from_secs(1));

    // The whole connection manager stops after the request arrived: the
    // connector's REQ goes unanswered through its retries.
    let bo = b.owner();
    listener(&b, &bo, PortSpace::Tcp, 7401);
    let id = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(b.ip, 7401));
    ao.connect(id, &param(b"knock", 0x21, 1)).expect("connect");
    expect(&bo, CmEventKind::ConnectRequest);
    let started = Instant::now();
    b.cm.stop();
    let e = expect(&ao, CmEventKind::Unreachable);
    assert_eq!(e.status, UNREACHABLE_STATUS);
    let took = started.elapsed();
    println!("UNREACHABLE after {took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert_eq!(a.cm.counters().connections_live, 0);

    // The listener's device goes away altogether (its registration ends,
    // as when its vdev is killed): hostd refuses the retransmissions to a
    // GID nobody has, and the connector gives up as before.
    let c = Device::new(&hostd, "gamma", fast());
    let co = c.owner();
    listener(&c, &co, PortSpace::Tcp, 7402);
    let id = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(c.ip, 7402));
    ao.connect(id, &param(b"knock", 0x22, 1)).expect("connect");
    expect(&co, CmEventKind::ConnectRequest);
    let refused_before = a.cm.counters().send_failed;
    c.cm.stop();
    c._fabric.close();
    let e = expect(&ao, CmEventKind::Unreachable);
    assert_eq!(e.status, UNREACHABLE_STATUS);
    assert!(
        a.cm.counters().send_failed > refused_before,
        "hostd refused the REQ's retransmissions"
    );
}

#[test]
fn sidr_resolves_a_ud_service_and_a_missing_one_is_unreachable() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let (ao, bo) = (a.owner(), b.owner());
    let lid = listener(&b, &bo, PortSpace::Udp, 5000);

    let id = resolved(&ao, PortSpace::Udp, SocketAddrV4::new(b.ip, 5000));
    let init = ao.init_qp_attr(id, QpState::Init).expect("INIT");
    assert_eq!(init.qkey, 0x0123_4567, "RDMA_UDP_QKEY");
    ao.connect(id, &param(b"which QP?", 0, 0))
        .expect("SIDR_REQ");
    let req = expect(&bo, CmEventKind::ConnectRequest);
    assert_eq!(req.listen_id, lid);
    assert_eq!(&req.private_data()[..9], b"which QP?");
    assert_eq!(req.private_data().len(), 180);
    assert_eq!(
        req.ah_attr.dgid,
        vrdma_spec::gid::ipv4_mapped(a.ip.octets())
    );
    let mut answer = param(b"this one", 0x333, 0);
    answer.qkey = 0;
    bo.accept(req.id, &answer).expect("SIDR_REP");
    let est = expect(&ao, CmEventKind::Established);
    assert_eq!(est.qp_num, 0x333);
    assert_eq!(est.qkey, 0x0123_4567);
    assert_eq!(
        est.ah_attr.dgid,
        vrdma_spec::gid::ipv4_mapped(b.ip.octets())
    );
    assert_eq!(&est.private_data()[..8], b"this one");
    let info = ao.query(id).expect("query");
    assert_eq!((info.remote_qpn, info.remote_qkey), (0x333, 0x0123_4567));

    // No UD listener on 5001: SIDR_REP "unsupported" → UNREACHABLE.
    let id = resolved(&ao, PortSpace::Udp, SocketAddrV4::new(b.ip, 5001));
    ao.connect(id, &param(b"", 0, 0)).expect("SIDR_REQ");
    let e = expect(&ao, CmEventKind::Unreachable);
    assert_eq!(e.status, 1, "SIDR status unsupported");
    let (ca, cb) = (a.cm.counters(), b.cm.counters());
    assert_eq!(ca.sent(MessageKind::SidrReq), 2);
    assert_eq!(cb.sent(MessageKind::SidrRep), 2);
}

#[test]
fn a_thousand_connect_disconnect_cycles_leave_nothing_behind() {
    let hostd = Hostd::start(Some(POLICY));
    // Linux's timers (retransmits after seconds: a loaded machine causes
    // none, so the MAD counts below are exact); timewait is 2 s.
    let a = Device::new(&hostd, "alpha", CmConfig::default());
    let b = Device::new(&hostd, "gamma", CmConfig::default());
    let (ao, bo) = (a.owner(), b.owner());
    let lid = listener(&b, &bo, PortSpace::Tcp, 7500);
    let (a0, b0) = (a.cm.counters(), b.cm.counters());
    let hostd_before = (hostd.tenant_stats("alpha"), hostd.tenant_stats("gamma"));

    const CYCLES: u32 = 1000;
    let started = Instant::now();
    for n in 0..CYCLES {
        let (active, passive) = establish((&ao, b.ip), &bo, 7500, (0x1000 + n, 0x8000 + n));
        ao.disconnect(active).expect("disconnect");
        expect(&bo, CmEventKind::Disconnected);
        bo.disconnect(passive).expect("DREP");
        expect(&ao, CmEventKind::Disconnected);
        ao.destroy_id(active).expect("destroy");
        bo.destroy_id(passive).expect("destroy");
    }
    let took = started.elapsed();
    let rate = f64::from(CYCLES) / took.as_secs_f64();
    println!(
        "{CYCLES} connect/establish/disconnect/destroy cycles in {took:?}: {rate:.0} cycles/s"
    );

    // Timewait drains; then everything is where it started.
    let deadline = Instant::now() + 2 * WAIT;
    while a.cm.counters().agent_connections + b.cm.counters().agent_connections > 0 {
        assert!(Instant::now() < deadline, "timewait does not drain");
        std::thread::sleep(Duration::from_millis(20));
    }
    for (dev, start) in [(&a, &a0), (&b, &b0)] {
        let now = dev.cm.counters();
        assert_eq!(
            now.connections_live, start.connections_live,
            "{}",
            dev.tenant
        );
        assert_eq!(now.ids, start.ids, "{}", dev.tenant);
        assert_eq!(now.listeners, start.listeners, "{}", dev.tenant);
        assert_eq!(now.agent_connections, 0, "{}", dev.tenant);
        assert_eq!(now.send_failed, 0, "{}", dev.tenant);
        assert_eq!(now.events_dropped, 0, "{}", dev.tenant);
        assert_eq!(now.transmits_lost + now.events_lost, 0, "{}", dev.tenant);
    }
    let (ca, cb) = (a.cm.counters(), b.cm.counters());
    assert_eq!(ca.sent(MessageKind::Req), u64::from(CYCLES));
    assert_eq!(cb.received(MessageKind::Rtu), u64::from(CYCLES));
    assert_eq!(ca.received(MessageKind::Drep), u64::from(CYCLES));
    assert_eq!(ca.retransmits + cb.retransmits, 0, "nothing was lost");
    let hostd_after = (hostd.tenant_stats("alpha"), hostd.tenant_stats("gamma"));
    // hostd carried every MAD each CM sent, to the other, and dropped none.
    let gsi = |stats: &serde_json::Value, what: &str| stats["gsi"][what].as_u64().expect("gsi");
    let delta = |i: usize, what: &str| {
        let (b, a) = match i {
            0 => (&hostd_before.0, &hostd_after.0),
            _ => (&hostd_before.1, &hostd_after.1),
        };
        gsi(a, what) - gsi(b, what)
    };
    assert_eq!(delta(0, "sent"), ca.sent_total() - a0.sent_total());
    assert_eq!(delta(1, "sent"), cb.sent_total() - b0.sent_total());
    assert_eq!(delta(1, "received"), delta(0, "sent"));
    assert_eq!(delta(0, "received"), delta(1, "sent"));
    assert_eq!(
        ca.received_total() - a0.received_total(),
        delta(0, "received")
    );
    assert_eq!(
        gsi(&hostd_after.0, "queue_full") + gsi(&hostd_after.1, "queue_full"),
        0
    );
    println!(
        "hostd carried {} MADs alpha → gamma and {} back",
        delta(0, "sent"),
        delta(1, "sent")
    );
    for (before, after) in [
        (&hostd_before.0, &hostd_after.0),
        (&hostd_before.1, &hostd_after.1),
    ] {
        for key in ["usage", "ops", "errors", "dropped", "quota_rejections"] {
            assert!(before.get(key).is_some(), "hostd reports no {key}");
            assert_eq!(before[key], after[key], "hostd's {key}");
        }
    }
    // The listener still serves.
    assert_eq!(bo.query(lid).expect("listener").state, IdState::Listen);
}

#[test]
fn destroying_or_closing_ends_connections_as_rdma_cm_does() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let bo = b.owner();
    listener(&b, &bo, PortSpace::Tcp, 7700);

    // An established ID destroyed: its DREQ tells the peer.
    let ao = a.owner();
    let (active, passive) = establish((&ao, b.ip), &bo, 7700, (0x50, 0x60));
    ao.destroy_id(active).expect("destroy");
    expect(&bo, CmEventKind::Disconnected);
    assert_eq!(a.cm.counters().sent(MessageKind::Dreq), 1);
    bo.destroy_id(passive).expect("destroy");

    // A context closing with an established connection: DREQ too.
    let (_, passive) = establish((&ao, b.ip), &bo, 7700, (0x51, 0x61));
    drop(ao);
    expect(&bo, CmEventKind::Disconnected);
    bo.destroy_id(passive).expect("destroy");

    // The active side destroyed while its REQ waits: REJ (timeout), and
    // the passive ID learns it.
    let ao = a.owner();
    let id = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(b.ip, 7700));
    ao.connect(id, &param(b"", 0x52, 1)).expect("connect");
    let req = expect(&bo, CmEventKind::ConnectRequest);
    ao.destroy_id(id).expect("destroy");
    let rej = expect(&bo, CmEventKind::Rejected);
    assert_eq!(rej.id, req.id);
    assert_eq!(rej.status, 4, "timeout: the requester gave up");
    quiet(&ao, Duration::from_millis(100));

    let deadline = Instant::now() + WAIT;
    while a.cm.counters().agent_connections + b.cm.counters().agent_connections > 0 {
        assert!(Instant::now() < deadline, "connections linger");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(a.cm.counters().ids, 0);
}

#[test]
fn a_listener_takes_more_requests_than_its_backlog_as_linux_on_roce() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let (ao, bo) = (a.owner(), b.owner());
    let l = bo.create_id(PortSpace::Tcp, None).expect("create_id");
    bo.bind_addr(l, SocketAddrV4::new(b.ip, 7800))
        .expect("bind");
    bo.listen(l, 1).expect("listen");
    let to = SocketAddrV4::new(b.ip, 7800);
    // Three requests at once on a backlog of 1: each is delivered (Linux's
    // CM on IB and RoCE keeps no backlog; cmtime and rping rely on it).
    let mut requests = Vec::new();
    for n in 0..3u8 {
        let id = resolved(&ao, PortSpace::Tcp, to);
        ao.connect(id, &param(&[b'1' + n], 0x70 + u32::from(n), 1))
            .expect("connect");
        let req = expect(&bo, CmEventKind::ConnectRequest);
        assert_eq!(req.private_data()[0], b'1' + n);
        requests.push(req.id);
    }
    assert_eq!(b.cm.counters().requests_refused, 0);
    for id in requests {
        bo.reject(id, b"").expect("reject");
        assert_eq!(expect(&ao, CmEventKind::Rejected).status, 28);
    }
}

#[test]
fn rdma_ps_ib_connects_rc_with_ipv4_addresses() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let (ao, bo) = (a.owner(), b.owner());
    listener(&b, &bo, PortSpace::Ib, 7900);
    // Another port space than TCP's: TCP's 7900 reaches no listener.
    let tcp = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(b.ip, 7900));
    ao.connect(tcp, &param(b"", 0x90, 1)).expect("connect");
    assert_eq!(expect(&ao, CmEventKind::Rejected).status, 8);
    let id = resolved(&ao, PortSpace::Ib, SocketAddrV4::new(b.ip, 7900));
    ao.connect(id, &param(b"ib", 0x91, 1)).expect("connect");
    let req = expect(&bo, CmEventKind::ConnectRequest);
    assert_eq!(&req.private_data()[..2], b"ib");
    bo.accept(req.id, &param(b"", 0x92, 2)).expect("accept");
    expect(&ao, CmEventKind::ConnectResponse);
    ao.establish(id).expect("establish");
    expect(&ao, CmEventKind::Established);
    expect(&bo, CmEventKind::Established);
    assert_eq!(
        ao.init_qp_attr(id, QpState::Rtr).expect("RTR").dest_qp_num,
        0x92
    );
}

#[test]
fn a_peer_that_stops_answering_times_out_disconnect_and_accept() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());

    // DREQ unanswered: DISCONNECTED with −ETIMEDOUT after the retries.
    let b = Device::new(&hostd, "gamma", fast());
    let (ao, bo) = (a.owner(), b.owner());
    listener(&b, &bo, PortSpace::Tcp, 8000);
    let (active, _) = establish((&ao, b.ip), &bo, 8000, (0xa0, 0xb0));
    b.cm.stop();
    let started = Instant::now();
    ao.disconnect(active).expect("disconnect");
    let e = expect(&ao, CmEventKind::Disconnected);
    assert_eq!(e.status, UNREACHABLE_STATUS, "timed out");
    println!("DREQ timed out after {:?}", started.elapsed());
    drop(bo);
    drop(b);

    // REP unanswered (the active side's CM stopped after sending its
    // REQ): the passive ID becomes UNREACHABLE.
    let c = Device::new(&hostd, "gamma", fast());
    let co = c.owner();
    listener(&c, &co, PortSpace::Tcp, 8001);
    let id = resolved(&ao, PortSpace::Tcp, SocketAddrV4::new(c.ip, 8001));
    ao.connect(id, &param(b"", 0xa1, 1)).expect("connect");
    let req = expect(&co, CmEventKind::ConnectRequest);
    a.cm.stop();
    co.accept(req.id, &param(b"", 0xb1, 2)).expect("accept");
    let e = expect(&co, CmEventKind::Unreachable);
    assert_eq!((e.id, e.status), (req.id, UNREACHABLE_STATUS));
    assert_eq!(c.cm.counters().connections_live, 0);
}

#[test]
fn the_service_carries_on_with_a_restarted_hostd() {
    let mut hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    let b = Device::new(&hostd, "gamma", fast());
    let (ao, bo) = (a.owner(), b.owner());
    listener(&b, &bo, PortSpace::Tcp, 8100);
    establish((&ao, b.ip), &bo, 8100, (0xc0, 0xd0));

    hostd.restart().expect("hostd starts again");
    for dev in [&a, &b] {
        let deadline = Instant::now() + WAIT;
        while let Err(e) = dev._fabric.reconnect() {
            assert!(Instant::now() < deadline, "{}: {e}", dev.tenant);
            std::thread::sleep(Duration::from_millis(20));
        }
        // Without it the new hostd never wakes the service (checked: the
        // next CONNECT_REQUEST then never arrives).
        dev.cm.hostd_restarted().expect("QP1 wake-ups again");
    }
    // The listener and the port space survived; a new connection works
    // through the new hostd.
    let (active, passive) = establish((&ao, b.ip), &bo, 8100, (0xc1, 0xd1));
    assert_eq!(b.cm.counters().connections_live, 2);
    ao.disconnect(active).expect("disconnect");
    expect(&bo, CmEventKind::Disconnected);
    bo.disconnect(passive).expect("DREP");
    expect(&ao, CmEventKind::Disconnected);
}

#[test]
fn the_service_moves_to_another_context_of_its_device() {
    let hostd = Hostd::start(Some(POLICY));
    let a = Device::new(&hostd, "alpha", fast());
    // Two contexts of gamma's device; the CM starts on the first's.
    let first = Arc::new(Fabric::connect(&hostd.socket, "gamma", "cm-two").expect("first"));
    let second = Arc::new(Fabric::connect(&hostd.socket, "gamma", "cm-two").expect("second"));
    assert_eq!(first.gid, second.gid, "one device");
    let bip = Ipv4Addr::from(vrdma_spec::gid::ipv4_of(&first.gid).expect("IPv4"));
    let cm = CmService::start(first.clone(), "gamma", fast(), &Threads::unfiltered())
        .expect("CM service");
    let (ao, bo) = (a.owner(), cm.open_owner().expect("owner"));
    listener(&a, &bo, PortSpace::Tcp, 8200);
    let (one, _) = establish((&ao, bip), &bo, 8200, (0xe0, 0xf0));

    // The first context ends: the CM goes on through the second, with its
    // listener and its established connection.
    cm.rebind(second.clone()).expect("rebind");
    first.close();
    let (two, _) = establish((&ao, bip), &bo, 8200, (0xe1, 0xf1));
    assert_eq!(cm.counters().connections_live, 2);
    ao.disconnect(one).expect("disconnect");
    expect(&bo, CmEventKind::Disconnected);
    ao.disconnect(two).expect("disconnect");
    expect(&bo, CmEventKind::Disconnected);
}
