//! Round trips: `decode(encode(m)) == m` for messages built field by field
//! and for every message random bytes decode to; decoding never panics.

use proptest::prelude::*;

use crate::*;

fn gid() -> impl Strategy<Value = Gid> {
    any::<[u8; 16]>().prop_map(Gid)
}

fn bytes<const N: usize>() -> impl Strategy<Value = [u8; N]> {
    proptest::collection::vec(any::<u8>(), N).prop_map(|v| {
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        a
    })
}

fn path_info() -> impl Strategy<Value = PathInfo> {
    (
        (any::<u16>(), any::<u16>(), gid(), gid()),
        (0u32..1 << 20, 0u8..64, any::<u8>(), any::<u8>()),
        (0u8..16, any::<bool>(), 0u8..32),
    )
        .prop_map(
            |(
                (local_lid, remote_lid, local_gid, remote_gid),
                (flow_label, packet_rate, traffic_class, hop_limit),
                (sl, subnet_local, local_ack_timeout),
            )| PathInfo {
                local_lid,
                remote_lid,
                local_gid,
                remote_gid,
                flow_label,
                packet_rate,
                traffic_class,
                hop_limit,
                sl,
                subnet_local,
                local_ack_timeout,
            },
        )
}

fn transport() -> impl Strategy<Value = TransportType> {
    prop_oneof![
        Just(TransportType::Rc),
        Just(TransportType::Uc),
        Just(TransportType::Rd),
        Just(TransportType::Extended),
    ]
}

prop_compose! {
    fn req()(
        ids in (any::<u32>(), 0u32..1 << 24, any::<u64>(), any::<u64>(), any::<u32>()),
        qp in (0u32..1 << 24, any::<u8>(), 0u32..1 << 24, any::<u8>(), 0u32..1 << 24),
        b43 in (0u8..32, transport(), any::<bool>()),
        psn in 0u32..1 << 24,
        b47 in (0u8..32, 0u8..8),
        pkey in any::<u16>(),
        b50 in (0u8..16, any::<bool>(), 0u8..8),
        b51 in (0u8..16, any::<bool>(), 0u8..8),
        primary in path_info(),
        alternate in path_info(),
        sap_supported in any::<bool>(),
        private_data in bytes::<92>(),
    ) -> Req {
        Req {
            local_comm_id: ids.0,
            vendor_id: ids.1,
            service_id: ids.2,
            local_ca_guid: ids.3,
            local_qkey: ids.4,
            local_qpn: qp.0,
            responder_resources: qp.1,
            local_eecn: qp.2,
            initiator_depth: qp.3,
            remote_eecn: qp.4,
            remote_cm_response_timeout: b43.0,
            transport: b43.1,
            e2e_flow_control: b43.2,
            starting_psn: psn,
            local_cm_response_timeout: b47.0,
            retry_count: b47.1,
            pkey,
            path_mtu: b50.0,
            rdc_exists: b50.1,
            rnr_retry_count: b50.2,
            max_cm_retries: b51.0,
            srq: b51.1,
            extended_transport: b51.2,
            primary,
            alternate,
            sap_supported,
            private_data: PrivateData::from_array(private_data),
        }
    }
}

prop_compose! {
    fn rep()(
        ids in (any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>()),
        qp in (0u32..1 << 24, 0u32..1 << 24, 0u32..1 << 24, 0u32..1 << 24),
        res in (any::<u8>(), any::<u8>()),
        b26 in (0u8..32, 0u8..4, any::<bool>()),
        b27 in (0u8..8, any::<bool>()),
        private_data in bytes::<196>(),
    ) -> Rep {
        Rep {
            local_comm_id: ids.0,
            remote_comm_id: ids.1,
            local_qkey: ids.2,
            local_qpn: qp.0,
            vendor_id: qp.1,
            local_eecn: qp.2,
            starting_psn: qp.3,
            responder_resources: res.0,
            initiator_depth: res.1,
            target_ack_delay: b26.0,
            failover_accepted: b26.1,
            e2e_flow_control: b26.2,
            rnr_retry_count: b27.0,
            srq: b27.1,
            local_ca_guid: ids.3,
            private_data: PrivateData::from_array(private_data),
        }
    }
}

fn header() -> impl Strategy<Value = MadHeader> {
    (any::<u16>(), any::<u16>(), any::<u64>(), any::<u32>()).prop_map(
        |(status, class_specific, tid, attr_mod)| MadHeader {
            status,
            class_specific,
            tid,
            attr_mod,
        },
    )
}

/// A MAD of every kind from random body bytes: a valid header with
/// attribute `kind`, the few codes and lengths that can be refused made
/// valid. Every message decodes from its own encoding, so this reaches
/// every message there is.
fn any_valid_mad(kind: usize, mut body: Vec<u8>, hdr: MadHeader) -> [u8; MAD_SIZE] {
    let kind = MessageKind::ALL[kind % MessageKind::COUNT];
    body.resize(MAD_SIZE - 24, 0);
    let mut b = [0u8; MAD_SIZE];
    b[24..].copy_from_slice(&body);
    b[..4].copy_from_slice(&[1, 7, 2, 3]);
    b[4..6].copy_from_slice(&hdr.status.to_be_bytes());
    b[6..8].copy_from_slice(&hdr.class_specific.to_be_bytes());
    b[8..16].copy_from_slice(&hdr.tid.to_be_bytes());
    b[16..18].copy_from_slice(&kind.attr_id().to_be_bytes());
    b[20..24].copy_from_slice(&hdr.attr_mod.to_be_bytes());
    match kind {
        MessageKind::Mra | MessageKind::Rej if b[32] >> 6 == 3 => b[32] &= 0x7f,
        MessageKind::SidrRep if b[29] > 72 => b[29] %= 73,
        _ => {}
    }
    if kind == MessageKind::Rej && b[33] >> 1 > 72 {
        b[33] &= 0x7f;
    }
    b
}

proptest! {
    #[test]
    fn req_round_trip(req in req(), hdr in header()) {
        let mad = Mad { header: hdr, msg: CmMessage::Req(req) };
        prop_assert_eq!(Mad::decode(&mad.encode().unwrap()), Ok(mad));
    }

    #[test]
    fn rep_round_trip(rep in rep(), hdr in header()) {
        let mad = Mad { header: hdr, msg: CmMessage::Rep(rep) };
        prop_assert_eq!(Mad::decode(&mad.encode().unwrap()), Ok(mad));
    }

    /// Every message of every kind: decoded from bytes, encoded, decoded
    /// back to itself; the encoding is a fixed point.
    #[test]
    fn every_message_round_trips(
        kind in 0usize..9,
        body in proptest::collection::vec(any::<u8>(), 232),
        hdr in header(),
    ) {
        let b = any_valid_mad(kind, body, hdr);
        let mad = Mad::decode(&b).unwrap();
        prop_assert_eq!(mad.header, hdr);
        let enc = mad.encode().unwrap();
        prop_assert_eq!(Mad::decode(&enc), Ok(mad.clone()));
        prop_assert_eq!(Mad::decode(&enc).unwrap().encode().unwrap(), enc);
    }

    /// Any bytes at all: decoding returns, and what it accepts round trips.
    #[test]
    fn decode_never_panics(data in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(mad) = Mad::decode(&data) {
            let enc = mad.encode().unwrap();
            prop_assert_eq!(Mad::decode(&enc), Ok(mad));
        }
    }

    /// Private data of any length up to the field round trips through a
    /// REQ with a CMA header.
    #[test]
    fn cma_header_round_trip(
        v6 in any::<bool>(),
        src in any::<[u8; 16]>(),
        dst in any::<[u8; 16]>(),
        src_port in any::<u16>(),
        user in proptest::collection::vec(any::<u8>(), 0..=56),
    ) {
        let addrs = if v6 {
            CmaAddrs::V6 { src: src.into(), dst: dst.into() }
        } else {
            CmaAddrs::V4 {
                src: [src[0], src[1], src[2], src[3]].into(),
                dst: [dst[0], dst[1], dst[2], dst[3]].into(),
            }
        };
        let hdr = CmaHeader { src_port, addrs };
        let req = Req {
            private_data: hdr.private_data(&user).unwrap(),
            ..Req::default()
        };
        let mad = Mad::decode(&Mad::new(1, CmMessage::Req(req)).encode().unwrap()).unwrap();
        let CmMessage::Req(req) = mad.msg else { panic!("not a REQ") };
        let (back, rest) = CmaHeader::split(req.private_data.as_bytes()).unwrap();
        prop_assert_eq!(back, hdr);
        prop_assert_eq!(&rest[..user.len()], &user[..]);
        prop_assert!(rest[user.len()..].iter().all(|&b| b == 0));
    }
}
