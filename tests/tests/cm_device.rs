//! The device's connection manager as a driver sees it: the `CM_*`
//! control commands and the CM event queue (docs/device-spec.md §4, §5.6),
//! served by real vdev processes on one hostd, through the guest driver's
//! CM API (`Context::cm_channel`) in process mode — listen, connect,
//! accept with private data, QPs moved with `init_qp_attr`, an RDMA WRITE
//! and a SEND over the connection, disconnect; a connect nobody listens
//! for, a peer in another network; and hostile requests and event buffers
//! from a VMM-like frontend (`vrdma_tools::vmm`).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use vrdma_guest_driver::cm::{event_kind, move_flags, port_space, MoveOverrides};
use vrdma_guest_driver::{CmChannel, CmEvent, CmId, ConnParam, QueuePair, RecvWr, SendWr};
use vrdma_spec::cm::{
    CmAddr, CmBindReq, CmChannelHandle, CmConnReq, CmCreateIdReq, CmEventRecord, CmIdReq,
    CmInitQpAttrReq, CmMoveQpReq, CmResolveAddrReq, CM_EVENT_SIZE, MOVE_KEEP,
};
use vrdma_spec::control::{Opcode, RequestHeader};
use vrdma_spec::qp_state::mask;
use vrdma_spec::verbs::{QpState, SendOpcode, WcOpcode, WcStatus};
use vrdma_spec::zerocopy::{FromBytes, FromZeros, IntoBytes};
use vrdma_tests::daemon::{Hostd, Vdev};
use vrdma_tests::tenant::{
    blue_and_red, default_caps, fill, one, rdma, read_mr, signaled, Tenant, ALL_ACCESS,
};
use vrdma_tools::vmm::{Desc, Vmm, FREE};

const WAIT: Duration = Duration::from_secs(10);

fn ip_of(t: &Tenant) -> Ipv4Addr {
    Ipv4Addr::from(vrdma_spec::gid::ipv4_of(&t.gid).expect("an IPv4 GID"))
}

/// The next event of `ch`, which must be of `kind`.
#[track_caller]
fn expect(ch: &CmChannel, kind: u32, t: &Tenant) -> CmEvent {
    let e = ch.wait_event(WAIT).expect("get_event").unwrap_or_else(|| {
        panic!(
            "no event within {WAIT:?}; expected kind {kind}\n{}",
            t.vdev.log()
        )
    });
    assert_eq!(e.kind, kind, "{e:?}");
    e
}

/// Moves `qp` to `state` with the attributes the CM gives for `id`.
#[track_caller]
fn move_qp(ch: &CmChannel, id: CmId, qp: &QueuePair, state: QpState) {
    let (attr, mask) = ch.init_qp_attr(id, state).expect("init_qp_attr");
    assert_eq!(attr.qp_state, u8::from(state));
    qp.modify(&attr, mask)
        .unwrap_or_else(|e| panic!("modify to {state:?} with mask {mask:#x}: {e}"));
}

fn param(data: &[u8], qp: &QueuePair) -> ConnParam {
    ConnParam {
        private_data: data.to_vec(),
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num: qp.qp_num(),
        ..ConnParam::default()
    }
}

/// A channel with an ID of the TCP port space resolved towards `to`.
fn resolved(ch: &CmChannel, t: &Tenant, to: SocketAddrV4) -> CmId {
    resolved_in(ch, t, port_space::TCP, to)
}

/// Whether `fd` becomes readable within `ms` milliseconds.
fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: i32) -> bool {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd that outlives the call.
    unsafe { libc::poll(&mut pfd, 1, ms) == 1 }
}

#[test]
fn connect_accept_move_qps_write_send_and_disconnect_through_the_cm() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let server = Tenant::start(&hostd, "alpha");
    let client = Tenant::start(&hostd, "beta");
    assert!(
        server.ctx.has_cm() && client.ctx.has_cm(),
        "the devices advertise a CM queue"
    );
    let cm_queue = u16::from(server.ctx.config().device.cm_queue);
    assert_eq!(
        cm_queue,
        vrdma_spec::cm_queue(server.ctx.num_comp_vectors())
    );
    let (sch, cch) = (
        server.ctx.cm_channel().expect("server channel"),
        client.ctx.cm_channel().expect("client channel"),
    );

    // Server: a listener on 7471 of any address.
    let listener = sch.create_id(port_space::TCP, None).expect("create_id");
    let bound = sch
        .bind_addr(listener, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7471))
        .expect("bind");
    assert_eq!(bound.port(), 7471);
    sch.listen(listener, 8).expect("listen");
    let info = sch.query(listener).expect("query");
    assert_eq!(info.state, vrdma_spec::cm::id_state::LISTEN);

    // Client: resolve, a QP in INIT, connect with private data.
    let id = resolved(&cch, &client, SocketAddrV4::new(ip_of(&server), 7471));
    let info = cch.query(id).expect("query");
    assert_eq!(
        info.src.ip,
        ip_of(&client).octets(),
        "bound to the device's address"
    );
    assert_eq!(info.route_valid, 1);
    assert_eq!(info.dgid, server.gid);
    let cqp = client.qp(default_caps());
    move_qp(&cch, id, &cqp, QpState::Init);
    // RTR needs the peer's answer first.
    let early = cch.init_qp_attr(id, QpState::Rtr).map_err(|e| e.errno());
    assert_eq!(early.err(), Some(libc::EINVAL), "RTR before the REP");
    let hello = b"hello from beta";
    cch.connect(id, &param(hello, &cqp)).expect("connect");

    // Server: the request, with the client's private data and QP.
    // The channel's fd wakes a poll()ing server when the request comes.
    assert!(
        readable(sch.event_fd(), 10_000),
        "the channel's fd becomes readable"
    );
    let req = expect(&sch, event_kind::CONNECT_REQUEST, &server);
    assert_eq!(req.listen_id, Some(listener));
    assert_ne!(req.id, listener, "a new ID for the request");
    assert_eq!(
        req.private_data.len(),
        56,
        "a REQ's field after the CMA header"
    );
    assert_eq!(&req.private_data[..hello.len()], hello);
    assert_eq!(req.qp_num, cqp.qp_num());
    let sqp = server.qp(default_caps());
    // The server's QP in one CM_MOVE_QP (the client's below state by
    // state): RESET to RTS with the ID's attributes, one overridden.
    let over = MoveOverrides {
        max_rd_atomic: Some(1),
        ..MoveOverrides::default()
    };
    let (rtr, mask) = (sch.move_qp(
        req.id,
        sqp.qp_num(),
        QpState::Rts,
        move_flags::FROM_INIT,
        over,
    ))
    .expect("CM_MOVE_QP");
    assert_eq!(rtr.qp_state, u8::from(QpState::Rtr), "the RTR step's AV");
    assert_eq!(rtr.dest_qp_num.get(), cqp.qp_num());
    assert_ne!(mask & mask::AV, 0);
    let now = sqp.query(0).expect("query");
    assert_eq!(now.attr.qp_state, u8::from(QpState::Rts));
    assert_eq!(now.attr.max_rd_atomic, 1);
    // The server's receive for the client's SEND, before it can come.
    let (smr, cmr) = (
        server.pd.alloc_mr(4096, ALL_ACCESS).expect("server MR"),
        client.pd.alloc_mr(4096, ALL_ACCESS).expect("client MR"),
    );
    let recv_sge = [smr.sge(2048, 1024)];
    sqp.post_recv(&[RecvWr {
        wr_id: 77,
        sg_list: &recv_sge,
    }])
    .expect("post_recv");
    let welcome = b"welcome, beta";
    sch.accept(req.id, &param(welcome, &sqp)).expect("accept");

    // Client: the response with the server's private data; RTR, RTS,
    // establish.
    let resp = expect(&cch, event_kind::CONNECT_RESPONSE, &client);
    assert_eq!(resp.id, id);
    assert_eq!(resp.private_data.len(), 196, "a REP's field after nothing");
    assert_eq!(&resp.private_data[..welcome.len()], welcome);
    assert_eq!(resp.qp_num, sqp.qp_num());
    move_qp(&cch, id, &cqp, QpState::Rtr);
    move_qp(&cch, id, &cqp, QpState::Rts);
    cch.establish(id).expect("establish");
    expect(&cch, event_kind::ESTABLISHED, &client);
    expect(&sch, event_kind::ESTABLISHED, &server);
    // Nothing waits any more: the fds are quiet once the device's news is
    // taken (get_event acknowledges the CM queue's interrupt).
    assert_eq!(sch.get_event().expect("get_event"), None);
    assert!(!readable(sch.event_fd(), 0), "no event, no readable fd");
    assert_eq!(
        sch.query(req.id).expect("query").state,
        vrdma_spec::cm::id_state::ESTABLISHED
    );

    // Bytes over the connection: the client WRITEs into the server's MR,
    // then SENDs; the server checks both.
    let data = fill(&cmr, 1024, 5);
    let sge = [cmr.sge(0, 1024)];
    cqp.post_send(&[rdma(1, SendOpcode::RdmaWrite, &sge, smr.iova(), smr.rkey())])
        .expect("post WRITE");
    let wc = one(&client.cq);
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, Some(WcOpcode::RdmaWrite))
    );
    assert_eq!(read_mr(&smr, 0, 1024), data, "the WRITE's bytes");
    cmr.write(1024, b"a SEND through the CM's QP")
        .expect("write");
    let sge = [cmr.sge(1024, 26)];
    let wr = signaled(SendWr::new(
        2,
        SendOpcode::Send,
        vrdma_guest_driver::SendPayload::Sges(&sge),
    ));
    cqp.post_send(&[wr]).expect("post SEND");
    assert_eq!(one(&client.cq).status, WcStatus::Success);
    let wc = one(&server.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (77, WcStatus::Success, 26)
    );
    assert_eq!(read_mr(&smr, 2048, 26), b"a SEND through the CM's QP");

    // Disconnect: the server sees DISCONNECTED, answers; then the client.
    cch.disconnect(id).expect("disconnect");
    expect(&sch, event_kind::DISCONNECTED, &server);
    sch.disconnect(req.id).expect("DREP");
    expect(&cch, event_kind::DISCONNECTED, &client);
    cch.destroy_id(id).expect("destroy");
    sch.destroy_id(req.id).expect("destroy");
    // A destroyed ID is unknown.
    assert_eq!(
        cch.query(id).map(|_| ()).map_err(|e| e.errno()),
        Err(libc::EINVAL)
    );
}

#[test]
fn no_listener_or_a_reject_is_rejected_another_network_is_an_address_error() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let alpha = Tenant::start(&hostd, "alpha");
    let beta = Tenant::start(&hostd, "beta");
    let gamma = Tenant::start(&hostd, "gamma");
    let ch = beta.ctx.cm_channel().expect("channel");

    // alpha listens on nothing: the REQ is rejected.
    let id = resolved(&ch, &beta, SocketAddrV4::new(ip_of(&alpha), 7999));
    let qp = beta.qp(default_caps());
    ch.connect(id, &param(b"anyone?", &qp)).expect("connect");
    let rej = expect(&ch, event_kind::REJECTED, &beta);
    assert_eq!(rej.id, id);
    assert_eq!(rej.status, 8, "REJ reason 8, invalid service ID");

    // alpha listens on 7300 and rejects, with its reason in private data.
    let sch = alpha.ctx.cm_channel().expect("channel");
    let listener = sch.create_id(port_space::TCP, None).expect("create_id");
    sch.bind_addr(listener, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7300))
        .expect("bind");
    sch.listen(listener, 4).expect("listen");
    let id = resolved(&ch, &beta, SocketAddrV4::new(ip_of(&alpha), 7300));
    ch.connect(id, &param(b"let me in", &qp)).expect("connect");
    let req = expect(&sch, event_kind::CONNECT_REQUEST, &alpha);
    assert_eq!(
        sch.reject(req.id, &[0; 300]).map_err(|e| e.errno()),
        Err(libc::EINVAL),
        "more than 256 bytes: the driver refuses"
    );
    sch.reject(req.id, b"full").expect("reject");
    let rej = expect(&ch, event_kind::REJECTED, &beta);
    assert_eq!(rej.status, 28, "consumer reject");
    assert_eq!(rej.private_data.len(), 148, "a REJ's field");
    assert_eq!(&rej.private_data[..4], b"full");

    // gamma is in red: its address does not resolve for beta.
    let id = ch.create_id(port_space::TCP, None).expect("create_id");
    ch.resolve_addr(id, None, SocketAddrV4::new(ip_of(&gamma), 7471), WAIT)
        .expect("resolve_addr");
    let e = expect(&ch, event_kind::ADDR_ERROR, &beta);
    assert_eq!(e.status, -libc::EHOSTUNREACH);

    // Events go to their own channel only.
    let other = beta.ctx.cm_channel().expect("second channel");
    let id2 = other.create_id(port_space::TCP, None).expect("create_id");
    other
        .resolve_addr(id2, None, SocketAddrV4::new(ip_of(&alpha), 1), WAIT)
        .expect("resolve_addr");
    expect(&other, event_kind::ADDR_RESOLVED, &beta);
    assert_eq!(
        ch.get_event().expect("get_event"),
        None,
        "nothing for the first channel"
    );
    // Another channel's ID is unknown on this one.
    assert_eq!(
        ch.resolve_route(id2).map_err(|e| e.errno()),
        Err(libc::EINVAL)
    );
}

/// CPU time (user + system, in clock ticks) process `pid` used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (which ends with the last ')'):
    // utime and stime are the 12th and 13th.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

fn addr(ip: Ipv4Addr, port: u16) -> CmAddr {
    CmAddr {
        ip: ip.octets(),
        port: port.into(),
        reserved: [0; 2],
    }
}

fn id_req(channel: u32, id: u32) -> CmIdReq {
    CmIdReq {
        channel: channel.into(),
        id: id.into(),
    }
}

#[test]
fn hostile_cm_requests_and_event_buffers_get_their_errnos() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let beta = Tenant::start(&hostd, "beta");
    let beta_ip = ip_of(&beta);
    // The driver's context of beta holds a listener on 7000 and an ID.
    let ch = beta.ctx.cm_channel().expect("channel");
    let listener = ch.create_id(port_space::TCP, None).expect("create_id");
    ch.bind_addr(listener, SocketAddrV4::new(beta_ip, 7000))
        .expect("bind");
    ch.listen(listener, 1).expect("listen");

    // A second context of the same device, speaking the protocol by hand.
    let mut vmm = Vmm::attach(&beta.vdev.socket);
    let cm_queue = u16::from(vmm.config.device.cm_queue);
    assert_eq!(
        cm_queue,
        vrdma_spec::cm_queue(vmm.config.num_comp_vectors.get())
    );
    let open: CmChannelHandle = vmm.ok(Opcode::CmOpenChannel, &[]);
    let c = open.channel.get();
    let create = |channel: u32, ps: u32, qp_type: u8| CmCreateIdReq {
        channel: channel.into(),
        port_space: ps.into(),
        qp_type,
        reserved: [0; 7],
    };
    let mine: CmIdReq = vmm.ok(Opcode::CmCreateId, create(c, port_space::TCP, 0).as_bytes());
    let mine = mine.id.get();

    // Framing: a short payload, a long one, no room for the answer.
    let req = create(c, port_space::TCP, 0);
    let header = |len: u32| RequestHeader {
        opcode: u16::from(Opcode::CmCreateId).into(),
        flags: 0.into(),
        payload_len: len.into(),
    };
    let mut short = header(12).as_bytes().to_vec();
    short.extend_from_slice(&req.as_bytes()[..12]);
    assert_eq!(
        vmm.raw_command(&short, 64).0,
        libc::EINVAL as u32,
        "short payload"
    );
    let mut long = header(20).as_bytes().to_vec();
    long.extend_from_slice(req.as_bytes());
    long.extend_from_slice(&[0; 4]);
    assert_eq!(
        vmm.raw_command(&long, 64).0,
        libc::EINVAL as u32,
        "trailing bytes"
    );
    let mut full = header(16).as_bytes().to_vec();
    full.extend_from_slice(req.as_bytes());
    assert_eq!(
        vmm.raw_command(&full, 12).0,
        libc::EINVAL as u32,
        "no response room"
    );

    // Values.
    let errno = |vmm: &mut Vmm, op: Opcode, payload: &[u8]| vmm.errno(op, payload) as i32;
    assert_eq!(
        errno(
            &mut vmm,
            Opcode::CmCreateId,
            create(99, port_space::TCP, 0).as_bytes()
        ),
        libc::EINVAL,
        "unknown channel"
    );
    assert_eq!(
        errno(
            &mut vmm,
            Opcode::CmCreateId,
            create(c, 0x1234, 0).as_bytes()
        ),
        libc::EINVAL,
        "unknown port space"
    );
    assert_eq!(
        errno(
            &mut vmm,
            Opcode::CmCreateId,
            create(c, port_space::TCP, 9).as_bytes()
        ),
        libc::EINVAL,
        "QP type 9"
    );
    assert_eq!(
        errno(
            &mut vmm,
            Opcode::CmCreateId,
            create(c, port_space::TCP, 4).as_bytes()
        ),
        libc::EOPNOTSUPP,
        "TCP with UD"
    );
    // The driver context's listener is another owner's: unknown here.
    for op in [Opcode::CmQueryId, Opcode::CmDestroyId, Opcode::CmDisconnect] {
        assert_eq!(
            errno(&mut vmm, op, id_req(c, listener.0).as_bytes()),
            libc::EINVAL,
            "{op:?} of a foreign ID"
        );
    }
    assert_eq!(
        errno(&mut vmm, Opcode::CmQueryId, id_req(c, 0xdead).as_bytes()),
        libc::EINVAL,
        "unknown ID"
    );
    // Its port is taken, device-wide; an address not the device's.
    let bind = |port: u16, ip: Ipv4Addr| CmBindReq {
        channel: c.into(),
        id: mine.into(),
        addr: addr(ip, port),
    };
    assert_eq!(
        errno(&mut vmm, Opcode::CmBindAddr, bind(7000, beta_ip).as_bytes()),
        libc::EADDRINUSE
    );
    assert_eq!(
        errno(
            &mut vmm,
            Opcode::CmBindAddr,
            bind(7001, Ipv4Addr::new(10, 9, 9, 9)).as_bytes()
        ),
        libc::EADDRNOTAVAIL
    );
    // Reserved flags, overlong private data, a QP state init_qp_attr has
    // none for, a 25-bit QPN.
    let resolve = CmResolveAddrReq {
        channel: c.into(),
        id: mine.into(),
        dst: addr(beta_ip, 7000),
        flags: 0x80.into(),
        ..CmResolveAddrReq::default()
    };
    assert_eq!(
        errno(&mut vmm, Opcode::CmResolveAddr, resolve.as_bytes()),
        libc::EINVAL
    );
    let mut conn = CmConnReq::new_zeroed();
    conn.channel = c.into();
    conn.id = mine.into();
    conn.private_data_len = 300.into();
    assert_eq!(
        errno(&mut vmm, Opcode::CmConnect, conn.as_bytes()),
        libc::EINVAL,
        "private_data_len 300"
    );
    conn.private_data_len = 0.into();
    conn.qp_num = 0x100_0000.into();
    assert_eq!(
        errno(&mut vmm, Opcode::CmAccept, conn.as_bytes()),
        libc::EINVAL,
        "25-bit QPN"
    );
    let init = CmInitQpAttrReq {
        channel: c.into(),
        id: mine.into(),
        qp_state: 6.into(),
        reserved: [0; 4],
    };
    assert_eq!(
        errno(&mut vmm, Opcode::CmInitQpAttr, init.as_bytes()),
        libc::EINVAL
    );
    // CM_MOVE_QP: unknown flags, a state it does not move to, INIT
    // without FROM_INIT, a QP this context does not have (as MODIFY_QP's
    // unknown handle): each EINVAL.
    let moves = |qpn: u32, state: u8, flags: u8| CmMoveQpReq {
        qpn: qpn.into(),
        channel: c.into(),
        id: mine.into(),
        qp_state: state,
        flags,
        max_dest_rd_atomic: MOVE_KEEP,
        max_rd_atomic: MOVE_KEEP,
        timeout: MOVE_KEEP,
        reserved: [0; 7],
    };
    for (req, what) in [
        (moves(0x123, 3, 0x80), "unknown flags"),
        (moves(0x123, 6, move_flags::FROM_INIT), "to SQE"),
        (moves(0x123, 1, 0), "INIT without FROM_INIT"),
        (
            moves(0x123, 2, move_flags::FROM_INIT),
            "before the peer is known",
        ),
    ] {
        assert_eq!(
            errno(&mut vmm, Opcode::CmMoveQp, req.as_bytes()),
            libc::EINVAL,
            "CM_MOVE_QP: {what}"
        );
    }
    // Connect before resolving: the wrong state.
    conn.qp_num = 0x123.into();
    assert_eq!(
        errno(&mut vmm, Opcode::CmConnect, conn.as_bytes()),
        libc::EINVAL
    );
    let close = |channel: u32| CmChannelHandle {
        channel: channel.into(),
        reserved: [0; 4],
    };
    assert_eq!(
        errno(&mut vmm, Opcode::CmCloseChannel, close(c + 7).as_bytes()),
        libc::EINVAL
    );
    // 64 channels a context: the 64th opens, the 65th is ENOMEM.
    let mut extra = Vec::new();
    for _ in 1..64 {
        let h: CmChannelHandle = vmm.ok(Opcode::CmOpenChannel, &[]);
        extra.push(h.channel.get());
    }
    assert_eq!(errno(&mut vmm, Opcode::CmOpenChannel, &[]), libc::ENOMEM);
    for ch in extra {
        assert_eq!(
            errno(&mut vmm, Opcode::CmCloseChannel, close(ch).as_bytes()),
            0
        );
    }

    // Event buffers: an event waits while the queue is not even set up,
    // and vdev does not spin on it meanwhile; a buffer too short is
    // returned unused; the next, whole one gets the record.
    let resolve = CmResolveAddrReq {
        channel: c.into(),
        id: mine.into(),
        dst: addr(beta_ip, 7000),
        ..CmResolveAddrReq::default()
    };
    assert_eq!(
        errno(&mut vmm, Opcode::CmResolveAddr, resolve.as_bytes()),
        0
    );
    let before = cpu_ticks(beta.vdev.pid());
    std::thread::sleep(Duration::from_millis(500));
    let spent = cpu_ticks(beta.vdev.pid()) - before;
    assert!(
        spent <= 10,
        "vdev used {spent} ticks in 500 ms with an event waiting"
    );
    let mut events = vmm.queue(cm_queue, FREE);
    let buf = FREE + 0x10000;
    events.submit(&vmm.mem, 0, &[Desc::write(buf, 100)]);
    assert_eq!(
        events.wait_used(&vmm.mem),
        (0, 0),
        "a 100-byte buffer is returned unused"
    );
    events.submit(&vmm.mem, 1, &[Desc::write(buf, CM_EVENT_SIZE as u32)]);
    assert_eq!(events.wait_used(&vmm.mem), (1, CM_EVENT_SIZE as u32));
    let mut bytes = [0u8; CM_EVENT_SIZE];
    vm_memory::Bytes::read_slice(&vmm.mem, &mut bytes, vm_memory::GuestAddress(buf))
        .expect("record");
    let record = CmEventRecord::read_from_bytes(&bytes).expect("record");
    assert_eq!(record.kind.get(), event_kind::ADDR_RESOLVED);
    assert_eq!((record.channel.get(), record.id.get()), (c, mine));
    // A buffer outside guest memory: returned unused, the vdev lives on.
    events.submit(
        &vmm.mem,
        2,
        &[Desc::write(0xdead_0000_0000, CM_EVENT_SIZE as u32)],
    );
    let route = id_req(c, mine);
    assert_eq!(errno(&mut vmm, Opcode::CmResolveRoute, route.as_bytes()), 0);
    assert_eq!(events.wait_used(&vmm.mem), (2, 0));
    events.submit(&vmm.mem, 3, &[Desc::write(buf, CM_EVENT_SIZE as u32)]);
    assert_eq!(events.wait_used(&vmm.mem), (3, CM_EVENT_SIZE as u32));
    vm_memory::Bytes::read_slice(&vmm.mem, &mut bytes, vm_memory::GuestAddress(buf))
        .expect("record");
    let record = CmEventRecord::read_from_bytes(&bytes).expect("record");
    assert_eq!(record.kind.get(), event_kind::ROUTE_RESOLVED);

    // The driver's context was not disturbed: its listener is there.
    assert_eq!(
        ch.query(listener).expect("query").state,
        vrdma_spec::cm::id_state::LISTEN
    );
    // Closing the channel destroys its IDs: the port is free again.
    assert_eq!(
        errno(&mut vmm, Opcode::CmCloseChannel, close(c).as_bytes()),
        0
    );
    assert_eq!(
        errno(&mut vmm, Opcode::CmQueryId, id_req(c, mine).as_bytes()),
        libc::EINVAL
    );
}

#[test]
fn a_device_without_hostd_has_no_connection_manager() {
    let vdev = Vdev::start("alpha", &[]);
    let mut vmm = Vmm::attach(&vdev.socket);
    assert_eq!(vmm.config.device.cm_queue, 0, "no CM queue advertised");
    assert_eq!(vmm.errno(Opcode::CmOpenChannel, &[]) as i32, libc::ENODEV);
    assert_eq!(
        vmm.errno(Opcode::CmQueryId, id_req(1, 1).as_bytes()) as i32,
        libc::ENODEV
    );
    drop(vmm);
    // The guest driver sees no CM either, and works as before.
    let ctx = vrdma_guest_driver::Context::open_vhost_user(&vdev.socket).expect("open");
    assert!(!ctx.has_cm());
    assert_eq!(
        ctx.cm_channel().map(|_| ()).map_err(|e| e.errno()),
        Err(libc::ENODEV)
    );
    ctx.alloc_pd().expect("verbs as before");
}

#[test]
fn a_context_that_ends_disconnects_its_connections_and_the_device_serves_on() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let alpha = Tenant::start(&hostd, "alpha");
    let beta = Tenant::start(&hostd, "beta");
    let sch = alpha.ctx.cm_channel().expect("channel");
    let listener = sch.create_id(port_space::TCP, None).expect("create_id");
    sch.bind_addr(listener, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7200))
        .expect("bind");
    sch.listen(listener, 4).expect("listen");

    // A second context of beta's device connects by hand (QP-less, as
    // UCX does: a made-up QP number, then ESTABLISH).
    let mut vmm = Vmm::attach(&beta.vdev.socket);
    let c = vmm
        .ok::<CmChannelHandle>(Opcode::CmOpenChannel, &[])
        .channel
        .get();
    let create = CmCreateIdReq {
        channel: c.into(),
        port_space: port_space::TCP.into(),
        qp_type: 0,
        reserved: [0; 7],
    };
    let id = vmm
        .ok::<CmIdReq>(Opcode::CmCreateId, create.as_bytes())
        .id
        .get();
    let resolve = CmResolveAddrReq {
        channel: c.into(),
        id: id.into(),
        dst: addr(ip_of(&alpha), 7200),
        ..CmResolveAddrReq::default()
    };
    assert_eq!(vmm.errno(Opcode::CmResolveAddr, resolve.as_bytes()), 0);
    assert_eq!(
        vmm.errno(Opcode::CmResolveRoute, id_req(c, id).as_bytes()),
        0
    );
    let mut conn = CmConnReq::new_zeroed();
    conn.channel = c.into();
    conn.id = id.into();
    conn.qp_num = 0x4242.into();
    conn.retry_count = 7;
    conn.rnr_retry_count = 7;
    assert_eq!(vmm.errno(Opcode::CmConnect, conn.as_bytes()), 0);
    let req = expect(&sch, event_kind::CONNECT_REQUEST, &alpha);
    assert_eq!(req.qp_num, 0x4242);
    let accepted = ConnParam {
        qp_num: 0x5151,
        responder_resources: 1,
        initiator_depth: 1,
        ..ConnParam::default()
    };
    sch.accept(req.id, &accepted).expect("accept");
    // The REP comes asynchronously: ESTABLISH is refused until it did.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match vmm.errno(Opcode::CmEstablish, id_req(c, id).as_bytes()) as i32 {
            0 => break,
            libc::EINVAL if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            other => panic!("ESTABLISH: errno {other}\n{}", beta.vdev.log()),
        }
    }
    expect(&sch, event_kind::ESTABLISHED, &alpha);

    // The frontend goes: its context's channels close, its connection is
    // disconnected (a DREQ), and alpha hears of it.
    drop(vmm);
    expect(&sch, event_kind::DISCONNECTED, &alpha);
    sch.disconnect(req.id).expect("DREP");

    // beta's vdev lives on and serves its other context's CM.
    let ch = beta
        .ctx
        .cm_channel()
        .expect("channel after the other context ended");
    let id = resolved(&ch, &beta, SocketAddrV4::new(ip_of(&alpha), 7200));
    ch.connect(id, &param(b"again", &beta.qp(default_caps())))
        .expect("connect");
    let again = expect(&sch, event_kind::CONNECT_REQUEST, &alpha);
    assert_eq!(&again.private_data[..5], b"again");
    // All of it under vdev's seccomp filters.
    let (filtered, threads) = beta.vdev.seccomp_threads();
    assert!(threads > 0, "vdev runs");
    assert_eq!(filtered, threads, "every vdev thread is filtered");
}

/// A UD QP of `t` moved to RTS with the attributes the CM gives `id`.
fn ud_qp_for(ch: &CmChannel, id: CmId, t: &Tenant) -> QueuePair {
    let qp =
        t.pd.create_qp(&vrdma_guest_driver::QpInitAttr {
            send_cq: &t.cq,
            recv_cq: &t.cq,
            cap: default_caps(),
            qp_type: vrdma_spec::verbs::QpType::Ud,
            sq_sig_all: false,
            srq: None,
        })
        .expect("UD QP");
    move_qp(ch, id, &qp, QpState::Init);
    move_qp(ch, id, &qp, QpState::Rtr);
    move_qp(ch, id, &qp, QpState::Rts);
    qp
}

#[test]
fn sidr_gives_the_ud_peer_and_a_datagram_reaches_it() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let server = Tenant::start(&hostd, "alpha");
    let client = Tenant::start(&hostd, "beta");
    let (sch, cch) = (
        server.ctx.cm_channel().expect("channel"),
        client.ctx.cm_channel().expect("channel"),
    );
    let listener = sch.create_id(port_space::UDP, None).expect("create_id");
    sch.bind_addr(listener, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 5000))
        .expect("bind");
    sch.listen(listener, 4).expect("listen");

    // udaddy's way: SIDR_REQ, the passive side answers with its UD QP.
    let cid = resolved_in(
        &cch,
        &client,
        port_space::UDP,
        SocketAddrV4::new(ip_of(&server), 5000),
    );
    let cqp = ud_qp_for(&cch, cid, &client);
    cch.connect(cid, &param(b"which QP?", &cqp))
        .expect("SIDR_REQ");
    let req = expect(&sch, event_kind::CONNECT_REQUEST, &server);
    assert_eq!(req.private_data.len(), 180, "a SIDR_REQ's field");
    assert_eq!(&req.private_data[..9], b"which QP?");
    let from = req.ah_attr.expect("the requester's address");
    assert_eq!(from.dgid, client.gid);
    let sqp = ud_qp_for(&sch, req.id, &server);
    let smr = server.pd.alloc_mr(4096, ALL_ACCESS).expect("MR");
    let recv_sge = [smr.sge(0, 40 + 64)];
    sqp.post_recv(&[RecvWr {
        wr_id: 9,
        sg_list: &recv_sge,
    }])
    .expect("post_recv");
    sch.accept(req.id, &param(b"this one", &sqp))
        .expect("SIDR_REP");
    let est = expect(&cch, event_kind::ESTABLISHED, &client);
    assert_eq!(est.qp_num, sqp.qp_num());
    assert_eq!(est.qkey, 0x0123_4567, "RDMA_UDP_QKEY");
    assert_eq!(&est.private_data[..8], b"this one");
    let to = est.ah_attr.expect("the responder's address");
    assert_eq!(to.dgid, server.gid);

    // The event's address vector is an AH; the datagram arrives.
    let ah = client.pd.create_ah(&to).expect("AH from the event");
    let cmr = client.pd.alloc_mr(4096, ALL_ACCESS).expect("MR");
    cmr.write(0, b"a datagram").expect("fill");
    let sge = [cmr.sge(0, 10)];
    let wr = signaled(
        SendWr::new(
            1,
            SendOpcode::Send,
            vrdma_guest_driver::SendPayload::Sges(&sge),
        )
        .to_ud(vrdma_guest_driver::UdDest {
            ah: ah.ahn(),
            remote_qpn: est.qp_num,
            remote_qkey: est.qkey,
        }),
    );
    cqp.post_send(&[wr]).expect("post_send");
    assert_eq!(one(&client.cq).status, WcStatus::Success);
    let wc = one(&server.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (9, WcStatus::Success, 50)
    );
    assert_eq!(read_mr(&smr, 40, 10), b"a datagram");
}

/// An ID of `ps` resolved (address and route) towards `to`.
fn resolved_in(ch: &CmChannel, t: &Tenant, ps: u32, to: SocketAddrV4) -> CmId {
    let id = ch.create_id(ps, None).expect("create_id");
    ch.resolve_addr(id, None, to, Duration::from_secs(2))
        .expect("resolve_addr");
    expect(ch, event_kind::ADDR_RESOLVED, t);
    ch.resolve_route(id).expect("resolve_route");
    expect(ch, event_kind::ROUTE_RESOLVED, t);
    id
}

#[test]
fn many_more_events_than_buffers_all_arrive_in_order_per_channel() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let alpha = Tenant::start(&hostd, "alpha");
    let beta = Tenant::start(&hostd, "beta");
    let to = SocketAddrV4::new(ip_of(&alpha), 9);
    let (one_ch, two_ch) = (
        beta.ctx.cm_channel().expect("channel"),
        beta.ctx.cm_channel().expect("channel"),
    );
    // 150 events on each channel while nobody reads: far more than the
    // driver's 32 buffers.
    const N: usize = 150;
    let mut ids = (Vec::new(), Vec::new());
    for _ in 0..N {
        for (ch, ids) in [(&one_ch, &mut ids.0), (&two_ch, &mut ids.1)] {
            let id = ch.create_id(port_space::TCP, None).expect("create_id");
            ch.resolve_addr(id, None, to, WAIT).expect("resolve_addr");
            ids.push(id);
        }
    }
    for (ch, ids) in [(&one_ch, &ids.0), (&two_ch, &ids.1)] {
        for (n, &id) in ids.iter().enumerate() {
            let e = expect(ch, event_kind::ADDR_RESOLVED, &beta);
            assert_eq!(e.id, id, "event {n} of channel {}", ch.channel());
        }
        assert_eq!(ch.get_event().expect("get_event"), None);
    }
}

#[test]
fn the_channels_of_a_context_keep_working_when_the_context_the_cm_uses_ends() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let alpha = Tenant::start(&hostd, "alpha");
    // beta's first context (whose registration the CM uses) is a bare
    // frontend; the driver's is the second.
    let vdev = Vdev::on_hostd(&hostd, "beta", &[]);
    let first = Vmm::attach(&vdev.socket);
    let beta = Tenant::open(vdev);
    let sch = beta.ctx.cm_channel().expect("channel");
    let listener = sch.create_id(port_space::TCP, None).expect("create_id");
    sch.bind_addr(listener, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7400))
        .expect("bind");
    sch.listen(listener, 4).expect("listen");
    let cch = alpha.ctx.cm_channel().expect("channel");
    let to = SocketAddrV4::new(ip_of(&beta), 7400);
    let connect = |data: &[u8]| {
        let id = resolved(&cch, &alpha, to);
        let p = ConnParam {
            qp_num: 0x100,
            ..param(data, &alpha.qp(default_caps()))
        };
        cch.connect(id, &p).expect("connect");
        let req = expect(&sch, event_kind::CONNECT_REQUEST, &beta);
        assert_eq!(&req.private_data[..data.len()], data);
        let a = ConnParam {
            qp_num: 0x200,
            ..ConnParam::default()
        };
        sch.accept(req.id, &a).expect("accept");
        expect(&cch, event_kind::CONNECT_RESPONSE, &alpha);
        cch.establish(id).expect("establish");
        expect(&cch, event_kind::ESTABLISHED, &alpha);
        expect(&sch, event_kind::ESTABLISHED, &beta);
        (id, req.id)
    };
    let (active, passive) = connect(b"before");

    // The CM's context goes: the CM moves to the driver's registration.
    drop(first);
    beta.vdev.wait_settled(1);
    cch.disconnect(active).expect("disconnect");
    expect(&sch, event_kind::DISCONNECTED, &beta);
    sch.disconnect(passive).expect("DREP");
    expect(&cch, event_kind::DISCONNECTED, &alpha);
    // The listener still hears new requests.
    connect(b"after");
}

#[test]
fn random_cm_requests_get_answers_and_leave_the_device_serving() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let beta = Tenant::start(&hostd, "beta");
    let mut vmm = Vmm::attach(&beta.vdev.socket);
    let seed = vrdma_tests::rng::seed_from_env();
    let mut rng = vrdma_tests::rng::Rng(seed);
    let mut channel = vmm
        .ok::<CmChannelHandle>(Opcode::CmOpenChannel, &[])
        .channel
        .get();
    let mut answered = [0u32; 2];
    for n in 0..3000 {
        let code = 24 + rng.below(14) as u16;
        let opcode = Opcode::try_from(code).expect("a CM opcode");
        let mut payload = rng.bytes(opcode.request_len());
        // Mostly this context's channel and small IDs, so that commands
        // get past the first checks.
        if payload.len() >= 8 && !rng.chance(8) {
            payload[..4].copy_from_slice(&channel.to_le_bytes());
            let id = 1 + rng.below(40) as u32;
            payload[4..8].copy_from_slice(&id.to_le_bytes());
        }
        let (status, _) = vmm.command(opcode, &payload);
        answered[usize::from(status == 0)] += 1;
        if opcode == Opcode::CmCloseChannel && status == 0 || n % 500 == 499 {
            // Keep a channel to play with.
            let (s, bytes) = vmm.command(Opcode::CmOpenChannel, &[]);
            if s == 0 {
                channel = CmChannelHandle::read_from_bytes(&bytes)
                    .expect("handle")
                    .channel
                    .get();
            }
        }
    }
    assert!(answered[1] > 0, "some commands succeeded (seed {seed})");
    // The device and its CM still serve the driver's context.
    let ch = beta.ctx.cm_channel().expect("channel");
    let id = ch.create_id(port_space::TCP, None).expect("create_id");
    ch.resolve_addr(id, None, SocketAddrV4::new(ip_of(&beta), 1), WAIT)
        .expect("resolve_addr");
    expect(&ch, event_kind::ADDR_RESOLVED, &beta);
    let (filtered, threads) = beta.vdev.seccomp_threads();
    assert!(threads > 0 && filtered == threads, "vdev runs, filtered");
}
