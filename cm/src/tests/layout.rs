//! Byte-exact layouts: messages with known field values land at the
//! absolute offsets of the notes (§2.3, §2.5), written out by hand here
//! rather than derived from the codec.

use std::net::Ipv4Addr;

use crate::mad::{ATTR_APR, ATTR_LAP};
use crate::*;

/// A buffer with the CM MAD header (attribute `attr`, TID `tid`) and
/// nothing else.
fn header(attr: u16, tid: u64) -> [u8; MAD_SIZE] {
    let mut b = [0u8; MAD_SIZE];
    b[0] = 1; // BaseVersion
    b[1] = 0x07; // MgmtClass: CM
    b[2] = 2; // ClassVersion
    b[3] = 0x03; // Method: SEND
    b[8..16].copy_from_slice(&tid.to_be_bytes());
    b[16..18].copy_from_slice(&attr.to_be_bytes());
    b
}

fn put(b: &mut [u8; MAD_SIZE], off: usize, bytes: &[u8]) {
    b[off..off + bytes.len()].copy_from_slice(bytes);
}

fn encode(tid: u64, msg: CmMessage) -> [u8; MAD_SIZE] {
    Mad::new(tid, msg).encode().unwrap()
}

/// Asserts `bytes` decode to `msg` with `tid`, and `msg` encodes to them.
fn both_ways(bytes: &[u8; MAD_SIZE], tid: u64, msg: CmMessage) {
    let mad = Mad::new(tid, msg);
    assert_eq!(&mad.encode().unwrap(), bytes, "encode");
    assert_eq!(Mad::decode(bytes).unwrap(), mad, "decode");
}

const RXE_A_GUID: u64 = 0x5054_00ff_fe12_3456; // EUI-64 of 52:54:00:12:34:56
const RXE_B_GUID: u64 = 0x5054_00ff_fe65_4321;
const IP_A: Ipv4Addr = Ipv4Addr::new(192, 168, 1, 1);
const IP_B: Ipv4Addr = Ipv4Addr::new(192, 168, 1, 2);
const SPORT: u16 = 51413;
const SERVICE: u64 = 0x0000_0000_0106_1c06; // RDMA_PS_TCP, port 7174
const LINUX_TID: u64 = 0x0000_0042_0a0b_0c0d; // hi_tid 0x42, comm ID

/// The user bytes a client put after the CMA header.
const PING: &[u8] = b"ping";

fn cma_header() -> CmaHeader {
    CmaHeader {
        src_port: SPORT,
        addrs: CmaAddrs::V4 {
            src: IP_A,
            dst: IP_B,
        },
    }
}

/// A REQ shaped like what Linux rdma_cm sends over rxe (notes §2.7) for
/// `rdma_connect` from 192.168.1.1:51413 to 192.168.1.2:7174 on a 1500-byte
/// netdev with responder resources and initiator depth 1.
fn linux_req() -> Req {
    Req {
        local_comm_id: 0x0a0b_0c0d,
        vendor_id: 0,
        service_id: SERVICE,
        local_ca_guid: RXE_A_GUID,
        local_qkey: 0,
        local_qpn: 0x11,
        responder_resources: 1,
        local_eecn: 0,
        initiator_depth: 1,
        remote_eecn: 0,
        remote_cm_response_timeout: 20,
        transport: TransportType::Rc,
        e2e_flow_control: false,
        starting_psn: 0xab_cdef,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xffff,
        path_mtu: 3,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        extended_transport: 0,
        primary: PathInfo {
            local_lid: 0xffff,
            remote_lid: 0xffff,
            local_gid: Gid::from(IP_A),
            remote_gid: Gid::from(IP_B),
            flow_label: (u32::from(SPORT) * 31 + 7174) & 0xf_ffff,
            packet_rate: 0,
            traffic_class: 0,
            hop_limit: 64,
            sl: 0,
            subnet_local: false,
            local_ack_timeout: 19,
        },
        alternate: PathInfo::default(),
        sap_supported: false,
        private_data: cma_header().private_data(PING).unwrap(),
    }
}

/// The same REQ written byte by byte at the notes' absolute offsets.
fn linux_req_bytes() -> [u8; MAD_SIZE] {
    let mut b = header(0x0010, LINUX_TID);
    put(&mut b, 24, &[0x0a, 0x0b, 0x0c, 0x0d]); // Local Comm ID
    put(&mut b, 32, &SERVICE.to_be_bytes()); // Service ID
    put(&mut b, 40, &RXE_A_GUID.to_be_bytes()); // Local CA GUID
    put(&mut b, 56, &[0x00, 0x00, 0x11, 0x01]); // Local QPN | Responder Resources
    put(&mut b, 60, &[0x00, 0x00, 0x00, 0x01]); // Local EECN | Initiator Depth
    b[67] = 20 << 3; // Remote CM Response Timeout | RC | no E2E flow control
    put(&mut b, 68, &[0xab, 0xcd, 0xef]); // Starting PSN
    b[71] = 20 << 3 | 7; // Local CM Response Timeout | Retry Count
    put(&mut b, 72, &[0xff, 0xff]); // P_Key
    b[74] = 3 << 4 | 7; // Path MTU 1024 | RDC 0 | RNR Retry Count
    b[75] = 15 << 4; // Max CM Retries | SRQ 0 | ext. transport 0
    put(&mut b, 76, &[0xff, 0xff, 0xff, 0xff]); // permissive LIDs
    put(
        &mut b,
        80,
        &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 168, 1, 1],
    );
    put(
        &mut b,
        96,
        &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 168, 1, 2],
    );
    // Flow label 0x86dd1 in the top 20 bits of bytes 112..116, packet rate
    // 0 in the low 6.
    put(&mut b, 112, &[0x86, 0xdd, 0x10, 0x00]);
    b[116] = 0; // Traffic Class
    b[117] = 64; // Hop Limit
    b[118] = 0; // SL | Subnet Local
    b[119] = 19 << 3; // Primary Local ACK Timeout
                      // Private data at 164: the CMA header, then the user's bytes.
    b[164] = 0x00; // cma_version
    b[165] = 0x40; // IPv4
    put(&mut b, 166, &SPORT.to_be_bytes());
    put(&mut b, 180, &[192, 168, 1, 1]); // 164 + 16
    put(&mut b, 196, &[192, 168, 1, 2]); // 164 + 32
    put(&mut b, 200, PING); // 164 + 36
    b
}

#[test]
fn linux_req_layout() {
    both_ways(&linux_req_bytes(), LINUX_TID, CmMessage::Req(linux_req()));
}

/// The REP Linux sends back from `rdma_accept` (resources 1/1, no private
/// data), written byte by byte.
fn linux_rep() -> Rep {
    Rep {
        local_comm_id: 0x7700_0001,
        remote_comm_id: 0x0a0b_0c0d,
        local_qkey: 0,
        local_qpn: 0x22,
        vendor_id: 0,
        local_eecn: 0,
        starting_psn: 0x12_3456,
        responder_resources: 1,
        initiator_depth: 1,
        target_ack_delay: 15,
        failover_accepted: 0,
        e2e_flow_control: false,
        rnr_retry_count: 7,
        srq: false,
        local_ca_guid: RXE_B_GUID,
        private_data: PrivateData::default(),
    }
}

fn linux_rep_bytes() -> [u8; MAD_SIZE] {
    let mut b = header(0x0013, LINUX_TID);
    put(&mut b, 24, &[0x77, 0x00, 0x00, 0x01]); // Local Comm ID
    put(&mut b, 28, &[0x0a, 0x0b, 0x0c, 0x0d]); // Remote Comm ID
    put(&mut b, 36, &[0x00, 0x00, 0x22, 0x00]); // Local QPN | vendor ID[23:16]
    put(&mut b, 44, &[0x12, 0x34, 0x56, 0x00]); // Starting PSN | vendor ID[7:0]
    b[48] = 1; // Responder Resources
    b[49] = 1; // Initiator Depth
    b[50] = 15 << 3; // Target ACK Delay | Failover 0 | E2E 0
    b[51] = 7 << 5; // RNR Retry Count | SRQ 0
    put(&mut b, 52, &RXE_B_GUID.to_be_bytes());
    b
}

#[test]
fn linux_rep_layout() {
    both_ways(&linux_rep_bytes(), LINUX_TID, CmMessage::Rep(linux_rep()));
}

/// Our agent as the passive side of Linux's REQ: its REP has Linux's shape
/// (byte for byte but for its own comm ID and CA GUID), and the QP
/// attributes follow §2.8.
#[test]
fn agent_answers_a_linux_req_like_linux() {
    let now = std::time::Instant::now();
    let mut agent = Agent::new(AgentConfig::new(RXE_B_GUID, 1));
    agent.listen(SERVICE).unwrap();
    let path = MadPath {
        local: Gid::from(IP_B),
        remote: Gid::from(IP_A),
    };
    agent.handle_mad(now, path, &linux_req_bytes()).unwrap();
    let Some(Event::ConnectRequest { conn, req, path: p }) = agent.poll_event() else {
        panic!("no connect request")
    };
    assert_eq!(p, path);
    assert_eq!(*req, linux_req());
    let (hdr, user) = CmaHeader::split(req.private_data.as_bytes()).unwrap();
    assert_eq!(hdr, cma_header());
    assert_eq!(&user[..4], PING);
    assert_eq!(
        split_service_id(req.service_id),
        Some((PortSpace::Tcp, 7174))
    );

    let mut rep = Rep::accepting(0x22, 0x12_3456);
    rep.responder_resources = 1;
    rep.initiator_depth = 1;
    let qp = agent.accept(now, conn, &rep).unwrap();
    let tx = agent.poll_transmit().unwrap();
    assert_eq!(tx.path, path);
    let mut want = linux_rep_bytes();
    put(&mut want, 24, &conn.comm_id().to_be_bytes());
    assert_eq!(tx.mad, want);
    assert_eq!(
        qp,
        QpAttrs {
            dest_qpn: 0x11,
            rq_psn: 0x12_3456,
            sq_psn: 0xab_cdef,
            path_mtu: 3,
            max_dest_rd_atomic: 1,
            max_rd_atomic: 1,
            retry_count: 7,
            rnr_retry: 7,
            timeout: 19,
            local_gid: Gid::from(IP_B),
            remote_gid: Gid::from(IP_A),
            flow_label: 0x8_6dd1,
            traffic_class: 0,
            hop_limit: 64,
            sl: 0,
        }
    );
}

/// Our agent as the active side: its REQ from `ConnectParams::new` is
/// Linux's but for comm ID, CA GUID, PSN/QPN and private data; Linux's REP
/// gives the active QP attributes of §2.8.
#[test]
fn agent_connects_like_linux() {
    let now = std::time::Instant::now();
    let mut agent = Agent::new(AgentConfig::new(RXE_A_GUID, 2));
    let path = MadPath {
        local: Gid::from(IP_A),
        remote: Gid::from(IP_B),
    };
    let mut params = ConnectParams::new(SERVICE, path, 0x11, 0xab_cdef);
    params.req.responder_resources = 1;
    params.req.initiator_depth = 1;
    params.req.primary.flow_label = 0x8_6dd1;
    params.req.private_data = cma_header().private_data(PING).unwrap();
    let conn = agent.connect(now, &params).unwrap();
    let tx = agent.poll_transmit().unwrap();
    let mut want = linux_req_bytes();
    put(&mut want, 24, &conn.comm_id().to_be_bytes());
    // Our TID: our own high half, the comm ID low.
    assert_eq!(&tx.mad[12..16], &conn.comm_id().to_be_bytes());
    want[8..16].copy_from_slice(&tx.mad[8..16]);
    assert_eq!(tx.mad, want);
    let tid = u64::from_be_bytes(tx.mad[8..16].try_into().unwrap());

    let mut rep = linux_rep();
    rep.remote_comm_id = conn.comm_id();
    let peer = MadPath {
        local: path.local,
        remote: path.remote,
    };
    agent
        .handle_mad(now, peer, &encode(tid, CmMessage::Rep(rep.clone())))
        .unwrap();
    let Some(Event::ConnectResponse { qp, rep: got, .. }) = agent.poll_event() else {
        panic!("no connect response")
    };
    assert_eq!(*got, rep);
    assert_eq!(qp.dest_qpn, 0x22);
    assert_eq!(qp.rq_psn, 0xab_cdef);
    assert_eq!(qp.sq_psn, 0x12_3456);
    assert_eq!((qp.max_rd_atomic, qp.max_dest_rd_atomic), (1, 1));
    assert_eq!((qp.retry_count, qp.rnr_retry), (7, 7));
    assert_eq!(qp.timeout, 19); // cm_ack_timeout(15, 18)
    assert_eq!(qp.remote_gid, Gid::from(IP_B));
    agent.establish(conn, &[]).unwrap();
    let rtu = agent.poll_transmit().unwrap();
    let mut want = header(0x0014, tid);
    put(&mut want, 24, &conn.comm_id().to_be_bytes());
    put(&mut want, 28, &[0x77, 0x00, 0x00, 0x01]);
    assert_eq!(rtu.mad, want);
}

#[test]
fn mra_layout() {
    let mut b = header(0x0011, 7);
    put(&mut b, 24, &[0, 0, 0, 1]);
    put(&mut b, 28, &[0, 0, 0, 2]);
    b[32] = 1 << 6; // Message MRAed: REP
    b[33] = 24 << 3; // Service Timeout
    put(&mut b, 34, &[0xaa; 222]);
    both_ways(
        &b,
        7,
        CmMessage::Mra(Mra {
            local_comm_id: 1,
            remote_comm_id: 2,
            message: TargetMessage::Rep,
            service_timeout: 24,
            private_data: PrivateData::from_array([0xaa; 222]),
        }),
    );
}

#[test]
fn rej_layout() {
    let mut b = header(0x0012, 8);
    put(&mut b, 24, &[0, 0, 0, 3]);
    put(&mut b, 28, &[0, 0, 0, 4]);
    b[32] = 2 << 6; // Message Rejected: other
    b[33] = 8 << 1; // Reject Info Length
    put(&mut b, 34, &[0, 4]); // Reason: timeout
    put(&mut b, 36, &RXE_A_GUID.to_be_bytes()); // ARI
    put(&mut b, 108, &[0xbb; 148]);
    let mut ari = [0u8; 72];
    ari[..8].copy_from_slice(&RXE_A_GUID.to_be_bytes());
    let rej = Rej {
        local_comm_id: 3,
        remote_comm_id: 4,
        message: TargetMessage::Other,
        ari_length: 8,
        reason: RejectReason::TIMEOUT,
        ari,
        private_data: PrivateData::from_array([0xbb; 148]),
    };
    assert_eq!(rej.ari(), &RXE_A_GUID.to_be_bytes());
    both_ways(&b, 8, CmMessage::Rej(rej));
}

#[test]
fn rtu_dreq_drep_layouts() {
    let mut b = header(0x0014, 9);
    put(&mut b, 24, &[0, 0, 0, 5]);
    put(&mut b, 28, &[0, 0, 0, 6]);
    put(&mut b, 32, &[0xcc; 224]);
    both_ways(
        &b,
        9,
        CmMessage::Rtu(Rtu {
            local_comm_id: 5,
            remote_comm_id: 6,
            private_data: PrivateData::from_array([0xcc; 224]),
        }),
    );

    let mut b = header(0x0015, 10);
    put(&mut b, 24, &[0, 0, 0, 5]);
    put(&mut b, 28, &[0, 0, 0, 6]);
    put(&mut b, 32, &[0x12, 0x34, 0x56]); // Remote QPN
    put(&mut b, 36, &[0xdd; 220]);
    both_ways(
        &b,
        10,
        CmMessage::Dreq(Dreq {
            local_comm_id: 5,
            remote_comm_id: 6,
            remote_qpn: 0x12_3456,
            private_data: PrivateData::from_array([0xdd; 220]),
        }),
    );

    let mut b = header(0x0016, 11);
    put(&mut b, 24, &[0, 0, 0, 6]);
    put(&mut b, 28, &[0, 0, 0, 5]);
    put(&mut b, 32, &[0xee; 224]);
    both_ways(
        &b,
        11,
        CmMessage::Drep(Drep {
            local_comm_id: 6,
            remote_comm_id: 5,
            private_data: PrivateData::from_array([0xee; 224]),
        }),
    );
}

#[test]
fn sidr_layouts() {
    let mut b = header(0x0017, 12);
    put(&mut b, 24, &[0, 0, 0, 7]); // Request ID
    put(&mut b, 28, &[0xff, 0xff]); // P_Key
    put(&mut b, 32, &0x0111_0007u64.to_be_bytes()); // Service ID: UDP port 7
    put(&mut b, 40, &[0x11; 216]);
    both_ways(
        &b,
        12,
        CmMessage::SidrReq(SidrReq {
            request_id: 7,
            pkey: 0xffff,
            service_id: service_id(PortSpace::Udp, 7),
            private_data: PrivateData::from_array([0x11; 216]),
        }),
    );

    let mut b = header(0x0018, 13);
    put(&mut b, 24, &[0, 0, 0, 7]); // Request ID
    b[28] = 0; // Status
    b[29] = 2; // Additional Info Length
    put(&mut b, 30, &[0xab, 0xcd]); // vendor ID[23:8]
    put(&mut b, 32, &[0x00, 0x00, 0x33]); // QPN
    b[35] = 0xef; // vendor ID[7:0]
    put(&mut b, 36, &0x0111_0007u64.to_be_bytes());
    put(&mut b, 44, &0x0123_4567u32.to_be_bytes()); // Q_Key
    put(&mut b, 48, &[0x5a, 0x5b]); // Additional Info
    put(&mut b, 120, &[0x22; 136]);
    let mut info = [0u8; 72];
    info[..2].copy_from_slice(&[0x5a, 0x5b]);
    let rep = SidrRep {
        request_id: 7,
        status: SidrStatus::SUCCESS,
        additional_info_length: 2,
        vendor_id: 0xab_cdef,
        qpn: 0x33,
        service_id: 0x0111_0007,
        qkey: 0x0123_4567,
        additional_info: info,
        private_data: PrivateData::from_array([0x22; 136]),
    };
    assert_eq!(rep.additional_info(), &[0x5a, 0x5b]);
    both_ways(&b, 13, CmMessage::SidrRep(rep));
}

/// Every bit field of the REQ at its place: ones in a field land in its
/// bits only.
#[test]
fn req_bit_fields() {
    let req = Req {
        vendor_id: 0xff_ffff,
        remote_cm_response_timeout: 0x1f,
        transport: TransportType::Extended,
        e2e_flow_control: true,
        local_cm_response_timeout: 0x1f,
        retry_count: 7,
        path_mtu: 0xf,
        rdc_exists: true,
        rnr_retry_count: 7,
        max_cm_retries: 0xf,
        srq: true,
        extended_transport: 7,
        primary: PathInfo {
            flow_label: 0xf_ffff,
            packet_rate: 0x3f,
            sl: 0xf,
            subnet_local: true,
            local_ack_timeout: 0x1f,
            ..PathInfo::default()
        },
        alternate: PathInfo {
            flow_label: 0xf_ffff,
            packet_rate: 0x3f,
            sl: 0xf,
            subnet_local: true,
            local_ack_timeout: 0x1f,
            ..PathInfo::default()
        },
        sap_supported: true,
        ..Req::default()
    };
    let b = encode(0, CmMessage::Req(req.clone()));
    assert_eq!(&b[28..32], &[0x00, 0xff, 0xff, 0xff]); // vendor ID, byte 28 reserved
    assert_eq!(b[67], 0xff);
    assert_eq!(b[71], 0xff);
    assert_eq!(b[74], 0xff);
    assert_eq!(b[75], 0xff);
    assert_eq!(&b[112..116], &[0xff, 0xff, 0xf0, 0x3f]);
    assert_eq!(b[118], 0xf8);
    assert_eq!(b[119], 0xf8);
    assert_eq!(&b[156..160], &[0xff, 0xff, 0xf0, 0x3f]);
    assert_eq!(b[162], 0xf8);
    assert_eq!(b[163], 0xfc); // ACK timeout | SAP supported
    assert_eq!(Mad::decode(&b).unwrap().msg, CmMessage::Req(req));
}

#[test]
fn rep_bit_fields() {
    let rep = Rep {
        vendor_id: 0x12_3456,
        target_ack_delay: 0x1f,
        failover_accepted: 3,
        e2e_flow_control: true,
        rnr_retry_count: 7,
        srq: true,
        ..Rep::default()
    };
    let b = encode(0, CmMessage::Rep(rep.clone()));
    assert_eq!((b[39], b[43], b[47]), (0x12, 0x34, 0x56));
    assert_eq!(b[50], 0xff);
    assert_eq!(b[51], 0xf0);
    assert_eq!(Mad::decode(&b).unwrap().msg, CmMessage::Rep(rep));
}

#[test]
fn header_fields_are_carried() {
    let mad = Mad {
        header: MadHeader {
            status: 0x1234,
            class_specific: 0x5678,
            tid: 0x0102_0304_0506_0708,
            attr_mod: 0x9abc_def0,
        },
        msg: CmMessage::Rtu(Rtu::default()),
    };
    let b = mad.encode().unwrap();
    assert_eq!(
        &b[..24],
        &[
            1, 7, 2, 3, 0x12, 0x34, 0x56, 0x78, 1, 2, 3, 4, 5, 6, 7, 8, 0x00, 0x14, 0, 0, 0x9a,
            0xbc, 0xde, 0xf0
        ]
    );
    assert_eq!(Mad::decode(&b), Ok(mad));
}

#[test]
fn refusals() {
    let good = linux_req_bytes();
    assert_eq!(Mad::decode(&good[..255]), Err(DecodeError::BadLength(255)));
    let mut long = good.to_vec();
    long.push(0);
    assert_eq!(Mad::decode(&long), Err(DecodeError::BadLength(257)));
    assert_eq!(Mad::decode(&[]), Err(DecodeError::BadLength(0)));

    let with = |off: usize, v: u8| {
        let mut b = good;
        b[off] = v;
        Mad::decode(&b)
    };
    assert_eq!(with(0, 2), Err(DecodeError::BadBaseVersion(2)));
    assert_eq!(with(1, 0x04), Err(DecodeError::BadClass(0x04)));
    assert_eq!(with(2, 1), Err(DecodeError::BadClassVersion(1)));
    assert_eq!(with(3, 0x83), Err(DecodeError::BadMethod(0x83)));
    assert_eq!(with(3, 0x01), Err(DecodeError::BadMethod(0x01)));
    assert_eq!(
        with(17, 0x19),
        Err(DecodeError::UnsupportedAttribute(ATTR_LAP))
    );
    assert_eq!(
        with(17, 0x1a),
        Err(DecodeError::UnsupportedAttribute(ATTR_APR))
    );
    assert_eq!(with(17, 0x1b), Err(DecodeError::UnknownAttribute(0x1b)));
    assert_eq!(with(17, 0x01), Err(DecodeError::UnknownAttribute(0x01)));
    assert_eq!(with(16, 0x01), Err(DecodeError::UnknownAttribute(0x0110)));

    let mut mra = header(0x0011, 0);
    mra[32] = 3 << 6;
    assert!(matches!(
        Mad::decode(&mra),
        Err(DecodeError::ReservedValue { value: 3, .. })
    ));
    let mut rej = header(0x0012, 0);
    rej[32] = 3 << 6;
    assert!(matches!(
        Mad::decode(&rej),
        Err(DecodeError::ReservedValue { value: 3, .. })
    ));
    rej[32] = 0;
    rej[33] = 72 << 1;
    assert!(Mad::decode(&rej).is_ok());
    rej[33] = 73 << 1;
    assert!(matches!(
        Mad::decode(&rej),
        Err(DecodeError::LengthTooLong { len: 73, .. })
    ));
    let mut sidr = header(0x0018, 0);
    sidr[29] = 72;
    assert!(Mad::decode(&sidr).is_ok());
    sidr[29] = 73;
    assert!(matches!(
        Mad::decode(&sidr),
        Err(DecodeError::LengthTooLong { len: 73, .. })
    ));
}

#[test]
fn encode_refuses_wide_fields() {
    let wide = |req: Req| Mad::new(0, CmMessage::Req(req)).encode();
    assert!(matches!(
        wide(Req {
            local_qpn: 1 << 24,
            ..Req::default()
        }),
        Err(EncodeError::TooWide {
            field: "local QPN",
            bits: 24,
            ..
        })
    ));
    assert!(wide(Req {
        starting_psn: 1 << 24,
        ..Req::default()
    })
    .is_err());
    assert!(wide(Req {
        retry_count: 8,
        ..Req::default()
    })
    .is_err());
    assert!(wide(Req {
        primary: PathInfo {
            flow_label: 1 << 20,
            ..PathInfo::default()
        },
        ..Req::default()
    })
    .is_err());
    let rej = Rej {
        ari_length: 73,
        ..Rej::default()
    };
    assert!(Mad::new(0, CmMessage::Rej(rej)).encode().is_err());
    let dreq = Dreq {
        remote_qpn: 1 << 24,
        ..Dreq::default()
    };
    assert!(Mad::new(0, CmMessage::Dreq(dreq)).encode().is_err());
    let mra = Mra {
        service_timeout: 32,
        ..Mra::default()
    };
    assert!(Mad::new(0, CmMessage::Mra(mra)).encode().is_err());
}

/// Reserved bits set on the wire are ignored (as Linux ignores them), and
/// come back cleared.
#[test]
fn reserved_bits_are_ignored() {
    let mut b = linux_req_bytes();
    b[18] = 0xff; // header reserved
    b[28] = 0xff; // body byte 4
    b[48..52].copy_from_slice(&[0xff; 4]); // body 24..28
    b[114] |= 0x0f; // below the flow label
    b[115] |= 0xc0; // above the packet rate
    b[118] |= 0x07;
    b[119] |= 0x07;
    let mad = Mad::decode(&b).unwrap();
    assert_eq!(mad.msg, CmMessage::Req(linux_req()));
    assert_eq!(mad.encode().unwrap(), linux_req_bytes());
}

/// Flipping each bit of a MAD's body one at a time: a bit of a field is
/// carried (the message re-encodes to the flipped bytes), a reserved bit
/// is ignored (it re-encodes to the original). The count of ignored bits
/// per message is the count of reserved bits in its layout.
#[test]
fn every_field_bit_is_carried() {
    let cases: [(CmMessage, usize, usize); 9] = [
        // REQ: body 4 (8), 24..28 (32), and per path 6 + 3 + 3, less SAP.
        (CmMessage::Req(Req::default()), 8 + 32 + 12 + 11, 0),
        (CmMessage::Mra(Mra::default()), 6 + 3, 0),
        (CmMessage::Rej(Rej::default()), 6 + 1, 0),
        (CmMessage::Rep(Rep::default()), 4, 0),
        (CmMessage::Rtu(Rtu::default()), 0, 0),
        (CmMessage::Dreq(Dreq::default()), 8, 0),
        (CmMessage::Drep(Drep::default()), 0, 0),
        (CmMessage::SidrReq(SidrReq::default()), 16, 0),
        // Additional Info Length's top bit makes it 128 > 72: refused.
        (CmMessage::SidrRep(SidrRep::default()), 0, 1),
    ];
    for (msg, reserved, refused) in cases {
        let kind = msg.kind();
        let base = encode(0, msg);
        let (mut ignored, mut refusals) = (0, 0);
        // The header bytes 4..16 and 18..24 (16 reserved bits at 18..20);
        // the fixed bytes 0..4 and the attribute are tested in `refusals`.
        for byte in (4..16).chain(18..MAD_SIZE) {
            for bit in 0..8 {
                let mut b = base;
                b[byte] ^= 1 << bit;
                match Mad::decode(&b) {
                    Ok(m) => {
                        let back = m.encode().unwrap();
                        if back == base {
                            ignored += 1;
                        } else {
                            assert_eq!(back, b, "{kind:?} byte {byte} bit {bit}");
                        }
                    }
                    Err(_) => refusals += 1,
                }
            }
        }
        assert_eq!(ignored, reserved + 16, "{kind:?} reserved bits");
        assert_eq!(refusals, refused, "{kind:?} refusals");
    }
}
