//! The device, its port and GID; protection domains, memory regions of
//! driver memory and completion queues, with every refusal's errno.

use std::time::Duration;

use vrdma_guest_driver::{QpInitAttr, Sge, WorkCompletion};
use vrdma_spec::config::DeviceConfig;
use vrdma_spec::verbs::{access, atomic_cap, device_cap, LinkLayer, Mtu, PortState, QpType};
use vrdma_tenant_policy::Limits;
use vrdma_tests::tenant::{pattern, rc_qp, read_mr};

use crate::*;

#[test]
fn queries_match_the_config_space() {
    let (_vdev, ctx) = device("pm-query", &["--lid", "9", "--comp-vectors", "2"]);
    let config: DeviceConfig = *ctx.config();
    assert_eq!(config.name(), Some("vrdma_9"));
    assert_eq!(ctx.num_comp_vectors(), 2);
    assert_eq!(config.num_comp_vectors.get(), 2);

    let dev = ctx.query_device().expect("query_device");
    assert_eq!(dev, config.device, "QUERY_DEVICE is the config space's");
    let guid = 0x7672_0000_0000_0000 | 9;
    assert_eq!(dev.node_guid.get(), guid);
    assert_eq!(dev.sys_image_guid.get(), guid);
    assert_eq!(
        dev.fw_ver.get(),
        3 << 32 | 4,
        "(major << 32) | minor of spec 3.4"
    );
    assert_eq!(
        (dev.vendor_id.get(), dev.vendor_part_id.get()),
        (0x1af4, 0x106a)
    );
    assert_eq!(dev.hw_ver.get(), 1);
    assert_eq!(dev.page_size_cap.get(), 0xffff_f000);
    assert_eq!(
        dev.device_cap_flags.get(),
        device_cap::CURR_QP_STATE_MOD
            | device_cap::PORT_ACTIVE_EVENT
            | device_cap::SYS_IMAGE_GUID
            | device_cap::RC_RNR_NAK_GEN
    );
    assert_eq!(dev.atomic_cap.get(), atomic_cap::HCA);
    assert_eq!(
        (
            dev.max_srq.get(),
            dev.max_srq_wr.get(),
            dev.max_srq_sge.get()
        ),
        (256, 8192, 16),
        "SRQs: the default limits (max_srq, max_qp_depth, max_sge)"
    );
    assert_eq!(dev.max_ah.get(), 65536, "the default max_ah");
    assert_eq!((dev.max_pkeys.get(), dev.phys_port_cnt), (1, 1));
    // No config file: the default tenant limits.
    assert_advertises(&dev, &Limits::default());

    let port = ctx.query_port(1).expect("query_port");
    assert_eq!(port, config.port);
    assert_eq!(port.state, u8::from(PortState::Active));
    assert_eq!((port.lid.get(), port.sm_lid.get()), (0, 0), "RoCE: no LIDs");
    assert_eq!(port.max_mtu, u8::from(Mtu::Mtu4096));
    assert_eq!(port.active_mtu, u8::from(Mtu::Mtu4096));
    assert_eq!(port.link_layer, u8::from(LinkLayer::Ethernet));
    assert_eq!(port.gid_tbl_len.get(), 1);
    assert_eq!(port.pkey_tbl_len.get(), 1);
    assert_eq!(port.max_msg_sz.get(), 1 << 31);
    assert_eq!(port.phys_state, 5, "LinkUp");

    let gid = ctx.query_gid(1, 0).expect("query_gid");
    assert_eq!(gid.gid, config.gid);
    // A vdev without hostd: ::ffff:127.100.0.9 for its LID 9.
    assert_eq!(gid.gid, vrdma_spec::gid::loopback_gid(9));
    assert_eq!(gid.gid_type.get(), vrdma_spec::control::gid_type::ROCE_V2);

    for bad_port in [0, 2, 255] {
        assert_eq!(
            device_errno(ctx.query_port(bad_port)),
            EINVAL,
            "port {bad_port}"
        );
        assert_eq!(device_errno(ctx.query_gid(bad_port, 0)), EINVAL);
    }
    assert_eq!(device_errno(ctx.query_gid(1, 1)), EINVAL, "GID index 1");
    // Refusals leave the device serving.
    assert_eq!(ctx.query_port(1).expect("still serving"), port);
}

// ---------------------------------------------------------------------------
// Protection domains.
// ---------------------------------------------------------------------------

#[test]
fn protection_domains_and_what_keeps_them_busy() {
    let (_vdev, ctx) = device("pm-pd", &[]);
    let a = ctx.alloc_pd().expect("alloc_pd");
    let b = ctx.alloc_pd().expect("alloc_pd");
    assert_ne!(a.pdn(), 0);
    assert_ne!(a.pdn(), b.pdn());
    destroyed(b.destroy());

    // A PD with an MR is busy; the refused PD is handed back, still usable.
    let mr = a.alloc_mr(PAGE, RW).expect("alloc_mr");
    let (a, errno) = refused_destroy(a.destroy());
    assert_eq!(errno, EBUSY, "PD with an MR");
    let mr2 = a.alloc_mr(PAGE, 0).expect("the handed-back PD still works");
    destroyed(mr2.dereg());
    destroyed(mr.dereg());

    // A PD with a QP (and no MR) is busy too.
    let cq = ctx.create_cq(16, 0).expect("create_cq");
    let qp = rc_qp(&a, &cq, caps(4, 4, 1, 0)).expect("create_qp");
    let (a, errno) = refused_destroy(a.destroy());
    assert_eq!(errno, EBUSY, "PD with a QP");
    destroyed(qp.destroy());
    destroyed(a.destroy());
    destroyed(cq.destroy());
    // Double dealloc cannot be expressed: `destroy` consumes the PD. The
    // device's EINVAL for an unknown PD is covered in vdev_as_vmm.rs.
}

// ---------------------------------------------------------------------------
// Memory regions.
// ---------------------------------------------------------------------------

#[test]
fn driver_memory_regions_and_their_access_rules() {
    let (_vdev, ctx) = device("pm-mr", &[]);
    let pd = ctx.alloc_pd().expect("alloc_pd");

    let mr = pd.alloc_mr(3 * PAGE, RW).expect("alloc_mr");
    assert_eq!(mr.len(), 3 * PAGE);
    assert_eq!(mr.as_ptr() as usize % PAGE, 0, "page-aligned");
    assert_eq!(mr.iova(), mr.as_ptr() as u64);
    assert_ne!(mr.lkey(), 0);
    assert_ne!(mr.rkey(), 0);
    assert_ne!(mr.lkey(), mr.rkey());
    assert_eq!(read_mr(&mr, 0, 64), vec![0; 64], "zeroed");
    let data = pattern(5000, 7);
    mr.write(1000, &data).expect("write");
    assert_eq!(read_mr(&mr, 1000, data.len()), data);
    assert_eq!(
        mr.sge(16, 100),
        Sge {
            addr: mr.iova() + 16,
            length: 100,
            lkey: mr.lkey()
        }
    );
    assert_eq!(driver_errno(mr.read(3 * PAGE - 1, &mut [0; 2])), EINVAL);
    assert_eq!(driver_errno(mr.write(3 * PAGE, &[1])), EINVAL);
    assert_eq!(driver_errno(pd.alloc_mr(0, RW)), EINVAL);

    // Access flags the device refuses.
    let refused = [
        (
            access::REMOTE_WRITE,
            EINVAL,
            "REMOTE_WRITE without LOCAL_WRITE",
        ),
        (
            access::REMOTE_ATOMIC | access::REMOTE_READ,
            EINVAL,
            "REMOTE_ATOMIC without LOCAL_WRITE",
        ),
        (1 << 9, EINVAL, "unknown access bit"),
        (access::LOCAL_WRITE | access::MW_BIND, EOPNOTSUPP, "MW_BIND"),
        (access::ZERO_BASED, EOPNOTSUPP, "ZERO_BASED"),
        (access::ON_DEMAND, EOPNOTSUPP, "ON_DEMAND"),
    ];
    for (flags, errno, what) in refused {
        assert_eq!(device_errno(pd.alloc_mr(PAGE, flags)), errno, "{what}");
    }
    // Accepted: every supported flag, and the hints.
    let all = access::LOCAL_WRITE
        | access::REMOTE_WRITE
        | access::REMOTE_READ
        | access::REMOTE_ATOMIC
        | access::HUGETLB
        | access::RELAXED_ORDERING;
    let mut mrs = vec![pd.alloc_mr(PAGE, all).expect("all supported flags")];
    for flags in [0, access::LOCAL_WRITE, access::REMOTE_READ] {
        mrs.push(pd.alloc_mr(PAGE, flags).expect("alloc_mr"));
    }
    mrs.push(mr);
    // Every key of the device is distinct.
    let mut keys: Vec<u32> = mrs.iter().flat_map(|m| [m.lkey(), m.rkey()]).collect();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), 2 * mrs.len(), "keys are unique");
    for mr in mrs {
        destroyed(mr.dereg());
    }
    destroyed(pd.destroy());
}

#[test]
fn completion_queues_and_what_keeps_them_busy() {
    let (_vdev, ctx) = device("pm-cq", &[]);
    let cq = ctx.create_cq(100, 0).expect("create_cq");
    assert_eq!(cq.depth(), 128, "rounded up to a power of two");
    assert_eq!(cq.comp_vector(), 0);
    assert_ne!(cq.cqn(), 0);
    let mut wc = [WorkCompletion::default(); 8];
    assert_eq!(cq.poll(&mut wc).expect("poll"), 0, "empty CQ");
    cq.req_notify(false);
    assert_eq!(cq.poll(&mut wc).expect("poll"), 0);
    assert_eq!(
        ctx.get_event(0, Some(Duration::from_millis(20)))
            .expect("get_event"),
        None
    );
    assert_eq!(driver_errno(ctx.get_event(1, Some(Duration::ZERO))), EINVAL);

    assert_eq!(
        device_errno(ctx.create_cq(Limits::default().max_cq_depth + 1, 0)),
        EINVAL,
        "above max_cqe (the policy's 1 Mi: the device refuses)"
    );
    assert_eq!(
        driver_errno(ctx.create_cq(vrdma_spec::limits::MAX_CQ_DEPTH + 1, 0)),
        EINVAL,
        "above the format's 4 Mi: the driver knows"
    );
    // The default fits what programs ask for (UCX, perftest's UD tests,
    // CQs shared by many QPs).
    let deep = ctx
        .create_cq(Limits::default().max_cq_depth, 0)
        .expect("a CQ of 1 Mi entries");
    destroyed(deep.destroy());
    assert_eq!(device_errno(ctx.create_cq(16, 1)), EINVAL, "no vector 1");
    assert_eq!(driver_errno(ctx.create_cq(u32::MAX, 0)), EINVAL);
    let big = ctx.create_cq(4096, 0).expect("max_cqe itself");
    assert_eq!(big.depth(), 4096);
    destroyed(big.destroy());

    // A CQ a QP uses, as send or receive CQ, is busy.
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let other = ctx.create_cq(16, 0).expect("create_cq");
    let qp = pd
        .create_qp(&QpInitAttr {
            send_cq: &cq,
            recv_cq: &other,
            cap: caps(4, 4, 1, 0),
            qp_type: QpType::Rc,
            sq_sig_all: true,
            srq: None,
        })
        .expect("create_qp");
    assert_eq!(qp.cq_nums(), (cq.cqn(), other.cqn()));
    let (cq, errno) = refused_destroy(cq.destroy());
    assert_eq!(errno, EBUSY, "send CQ in use");
    let (other, errno) = refused_destroy(other.destroy());
    assert_eq!(errno, EBUSY, "receive CQ in use");
    assert_eq!(cq.poll(&mut wc).expect("handed back, still polls"), 0);
    destroyed(qp.destroy());
    destroyed(cq.destroy());
    destroyed(other.destroy());
    destroyed(pd.destroy());
}

// ---------------------------------------------------------------------------
