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
use vrdma_vdev::cm::{CmConfig, CmEventKind, CmOwner, CmService, ConnParam, PortSpace};
use vrdma_vdev::fabric::Fabric;
use vrdma_vdev::seccomp::{Role, Threads};

const POLICY: &str = r#"
[[tenant]]
name = "alpha"
network = "blue"

[[tenant]]
name = "gamma"
network = "blue"
"#;

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
