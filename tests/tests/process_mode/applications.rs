//! Limits from a vdev config file, and applications: one after another,
//! several on the device at once, one that exits without cleaning up, two
//! on two devices at once.

use std::process::Command;
use std::time::Duration;

use vrdma_guest_driver::{
    CompletionQueue, Context, DeviceOptions, Error, MemoryRegion, ProtectionDomain, QueuePair,
    VhostUserTransport,
};
use vrdma_spec::control::QpAttr;
use vrdma_spec::gid::loopback_gid;
use vrdma_spec::verbs::QpState;
use vrdma_tenant_policy::Limits;
use vrdma_tests::daemon::Vdev;
use vrdma_tests::tenant::{mask_to, rc_qp};

use crate::*;

const LIMITS_TOML: &str = "\
lid = 7
comp_vectors = 2

[limits]
max_pd = 2
max_qp = 2
max_cq = 3
max_mr = 3
max_cq_depth = 256
max_qp_depth = 64
max_sge = 4
max_inline_data = 128
max_rd_atomic = 4
max_mr_bytes = 65536
max_total_mr_bytes = 131072
";

#[test]
fn limits_from_the_config_file_are_advertised_and_enforced() {
    let vdev = Vdev::start_with_config("pm-limits", LIMITS_TOML, &[]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    assert_eq!(ctx.config().name(), Some("vrdma_7"), "lid from the file");
    assert_eq!(ctx.num_comp_vectors(), 2);
    let dev = ctx.query_device().expect("query_device");
    let table: toml::Table = toml::from_str(LIMITS_TOML).expect("valid TOML");
    let limits: Limits = table["limits"].clone().try_into().expect("limits");
    assert_eq!((limits.max_pd, limits.max_total_mr_bytes), (2, 131072));
    assert_advertises(&dev, &limits);

    // QPs: the third fails with ENOMEM; freeing one makes room.
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(256, 1).expect("max_cqe on vector 1");
    let a = rc_qp(&pd, &cq, caps(64, 64, 4, 128)).expect("QP 1 at every limit");
    let b = rc_qp(&pd, &cq, caps(4, 4, 1, 0)).expect("QP 2");
    assert_eq!(
        device_errno(rc_qp(&pd, &cq, caps(4, 4, 1, 0))),
        ENOMEM,
        "QP 3"
    );
    destroyed(a.destroy());
    let c = rc_qp(&pd, &cq, caps(4, 4, 1, 0)).expect("room again");
    assert_ne!(c.qp_num(), b.qp_num());
    assert_eq!(device_errno(rc_qp(&pd, &cq, caps(4, 4, 1, 0))), ENOMEM);
    destroyed(b.destroy());
    // Per-QP limits.
    for (cap, what) in [
        (caps(65, 4, 1, 0), "max_send_wr above max_qp_depth"),
        (caps(4, 65, 1, 0), "max_recv_wr above max_qp_depth"),
        (caps(4, 4, 5, 0), "max_sge"),
        (caps(4, 4, 1, 129), "max_inline_data"),
    ] {
        assert_eq!(device_errno(rc_qp(&pd, &cq, cap)), EINVAL, "{what}");
    }
    let rd_atomic = QpAttr {
        max_dest_rd_atomic: 5,
        ..rtr_attr(0x42, 1)
    };
    c.modify(&init_attr(), mask_to(QpState::Init))
        .expect("INIT");
    assert_eq!(
        device_errno(c.modify(&rd_atomic, mask_to(QpState::Rtr))),
        EINVAL,
        "max_rd_atomic"
    );
    let at_limit = QpAttr {
        max_dest_rd_atomic: 4,
        ..rtr_attr(0x42, 1)
    };
    c.modify(&at_limit, mask_to(QpState::Rtr))
        .expect("at max_rd_atomic");
    destroyed(c.destroy());

    // CQs: 3 at most, 256 entries at most, vectors 0 and 1.
    assert_eq!(device_errno(ctx.create_cq(257, 0)), EINVAL, "max_cqe");
    assert_eq!(device_errno(ctx.create_cq(16, 2)), EINVAL, "vector 2");
    let cq2 = ctx.create_cq(16, 0).expect("CQ 2");
    let cq3 = ctx.create_cq(16, 0).expect("CQ 3");
    assert_eq!(device_errno(ctx.create_cq(16, 0)), ENOMEM, "CQ 4");
    destroyed(cq3.destroy());
    let cq3 = ctx.create_cq(16, 0).expect("room again");

    // MRs: bytes of one, bytes of all, and the count.
    assert_eq!(device_errno(pd.alloc_mr(65537, 0)), ENOMEM, "max_mr_bytes");
    let m1 = pd.alloc_mr(65536, RW).expect("max_mr_bytes itself");
    let m2 = pd.alloc_mr(65536, 0).expect("up to the total");
    assert_eq!(
        device_errno(pd.alloc_mr(PAGE, 0)),
        ENOMEM,
        "max_total_mr_bytes"
    );
    destroyed(m2.dereg());
    let m2 = pd.alloc_mr(PAGE, 0).expect("MR 2");
    let m3 = pd.alloc_mr(PAGE, 0).expect("MR 3");
    assert_eq!(device_errno(pd.alloc_mr(PAGE, 0)), ENOMEM, "MR 4");
    destroyed(m1.dereg());
    let m1 = pd.alloc_mr(PAGE, 0).expect("room again");

    // PDs: a PD dropped while its MRs live is deallocated with the last one.
    let pd2 = ctx.alloc_pd().expect("PD 2");
    assert_eq!(device_errno(ctx.alloc_pd()), ENOMEM, "PD 3");
    drop(pd);
    assert_eq!(
        device_errno(ctx.alloc_pd()),
        ENOMEM,
        "the dropped PD waits for its MRs"
    );
    drop((m1, m2));
    assert_eq!(device_errno(ctx.alloc_pd()), ENOMEM);
    drop(m3);
    let pd3 = ctx.alloc_pd().expect("the last MR took the PD with it");
    destroyed(pd3.destroy());
    destroyed(pd2.destroy());
    for cq in [cq, cq2, cq3] {
        destroyed(cq.destroy());
    }
}

// ---------------------------------------------------------------------------
// Applications and devices.
// ---------------------------------------------------------------------------

const ONE_OF_EACH: &str = "[limits]\nmax_pd = 1\nmax_qp = 1\nmax_cq = 1\nmax_mr = 1\n";

/// What an application makes: one PD, MR, CQ and connected QP. Returns the
/// handles, in creation order.
fn one_of_each(ctx: &Context) -> (ProtectionDomain, MemoryRegion, CompletionQueue, QueuePair) {
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let mr = pd.alloc_mr(PAGE, RW).expect("alloc_mr");
    let cq = ctx.create_cq(16, 0).expect("create_cq");
    let qp = rc_qp(&pd, &cq, caps(4, 4, 1, 0)).expect("create_qp");
    connect(&qp, 0x42, 1);
    (pd, mr, cq, qp)
}

#[test]
fn applications_one_after_another_each_get_a_fresh_device() {
    let vdev = Vdev::start_with_config("pm-sequential", ONE_OF_EACH, &[]);
    let first = {
        let ctx = Context::open_vhost_user(&vdev.socket).expect("first application");
        let (pd, mr, cq, qp) = one_of_each(&ctx);
        let handles = (pd.pdn(), cq.cqn());
        assert_eq!(device_errno(ctx.alloc_pd()), ENOMEM, "max_pd = 1");
        drop((qp, mr, cq, pd));
        handles
    };
    // Handles come from a per-device counter starting at 1: a new device
    // numbers its objects like the old one did, and has room for them.
    let ctx = Context::open_vhost_user(&vdev.socket).expect("second application");
    let (pd, mr, cq, qp) = one_of_each(&ctx);
    assert_eq!((pd.pdn(), cq.cqn()), first);
    assert_eq!(state_of(&qp), QpState::Rts);
    drop((qp, mr, cq, pd));
    let mut vdev = vdev;
    assert!(vdev.is_running(), "vdev serves again:\n{}", vdev.log());
}

/// Applications open the device at once: each is a context of it with
/// its own objects, and the device's quotas count all of them.
#[test]
fn applications_open_the_device_at_once_within_its_quotas() {
    let vdev = Vdev::start_with_config("pm-together", ONE_OF_EACH, &[]);
    let first = Context::open_vhost_user(&vdev.socket).expect("first application");
    let objects = one_of_each(&first);
    // The second does not wait for the first to close the device.
    let second = VhostUserTransport::connect_within(&vdev.socket, Duration::from_secs(2))
        .map_err(Error::from)
        .and_then(|t| Context::open(Box::new(t), DeviceOptions::default()))
        .expect("a second application opens the device while the first holds it");
    assert_eq!(second.config().name(), first.config().name(), "one device");
    let gid = |c: &Context| c.query_gid(1, 0).expect("query_gid").gid;
    assert_eq!(gid(&second), gid(&first), "one port GID");
    // max_pd = 1 is the device's: the first application holds it.
    assert_eq!(
        device_errno(second.alloc_pd()),
        ENOMEM,
        "the device's one PD is taken"
    );
    assert_eq!(
        state_of(&objects.3),
        QpState::Rts,
        "the first is undisturbed"
    );
    drop(objects);
    // Given back, the quota is the second's to take; its handles are its own.
    let (pd, mr, cq, qp) = one_of_each(&second);
    assert_eq!(pd.pdn(), 1);
    assert_eq!(state_of(&qp), QpState::Rts);
    drop((qp, mr, cq, pd));
    drop((first, second));
    let mut vdev = vdev;
    assert!(vdev.is_running(), "vdev serves on:\n{}", vdev.log());
}

const CHILD_SOCKET: &str = "VRDMA_TEST_CHILD_SOCKET";

/// Run as a separate process by
/// `an_application_that_exits_without_cleaning_up_leaves_nothing_behind`:
/// makes objects and exits without destroying any.
#[test]
#[ignore = "helper process of another test"]
fn child_application_exits_without_cleaning_up() {
    // Run on its own (`--ignored`), it has no device to open: a failure,
    // not a pass, since it ran nothing.
    let socket = std::env::var_os(CHILD_SOCKET).expect(
        "VRDMA_TEST_CHILD_SOCKET: this helper runs only as the child of \
         an_application_that_exits_without_cleaning_up_leaves_nothing_behind",
    );
    let ctx = Context::open_vhost_user(&socket).expect("child: open");
    let objects = one_of_each(&ctx);
    println!(
        "child made pd={} qpn={}",
        objects.0.pdn(),
        objects.3.qp_num()
    );
    // Like a crash: no destructor runs, the socket closes with the process.
    std::process::exit(0);
}

#[test]
fn an_application_that_exits_without_cleaning_up_leaves_nothing_behind() {
    let vdev = Vdev::start_with_config("pm-crash", ONE_OF_EACH, &[]);
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "applications::child_application_exits_without_cleaning_up",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_SOCKET, &vdev.socket)
        .output()
        .expect("run the child application");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("child made pd=1"), "{stdout}");
    // Every limit is 1, and the child left one of each behind: only a fresh
    // device lets this application make its own.
    let ctx = Context::open_vhost_user(&vdev.socket).expect("next application");
    let (pd, mr, cq, qp) = one_of_each(&ctx);
    assert_eq!(pd.pdn(), 1);
    drop((qp, mr, cq, pd));
    // vdev said what the child left behind when it released it.
    vdev.assert_logged(&["Released all verbs objects", "pds=1 mrs=1 cqs=1 qps=1"]);
}

#[test]
fn two_applications_on_two_devices_at_once() {
    let vdev_a = Vdev::start_with_config("pm-two-a", "[limits]\nmax_pd = 1\n", &["--lid", "3"]);
    let vdev_b = Vdev::start("pm-two-b", &["--lid", "4", "--comp-vectors", "2"]);
    let a = Context::open_vhost_user(&vdev_a.socket).expect("open A");
    let b = Context::open_vhost_user(&vdev_b.socket).expect("open B");
    assert_eq!(a.config().name(), Some("vrdma_3"));
    assert_eq!(b.config().name(), Some("vrdma_4"));
    assert_eq!((a.num_comp_vectors(), b.num_comp_vectors()), (1, 2));
    let (gid_a, gid_b) = (
        a.query_gid(1, 0).expect("gid A").gid,
        b.query_gid(1, 0).expect("gid B").gid,
    );
    // Without hostd a device's GID spells its LID; the RoCE port has none.
    assert_eq!((gid_a, gid_b), (loopback_gid(3), loopback_gid(4)));
    assert_eq!(a.query_port(1).expect("port A").lid.get(), 0);

    // Each device has its own objects and limits.
    let pd_a = a.alloc_pd().expect("PD on A");
    let pd_b = b.alloc_pd().expect("PD on B");
    assert_eq!((pd_a.pdn(), pd_b.pdn()), (1, 1), "separate handle spaces");
    assert_eq!(device_errno(a.alloc_pd()), ENOMEM, "A's max_pd = 1");
    let pd_b2 = b.alloc_pd().expect("B has room");
    let cq_a = a.create_cq(16, 0).expect("CQ on A");
    let cq_b = b.create_cq(16, 1).expect("CQ on B, vector 1");
    assert_eq!(device_errno(a.create_cq(16, 1)), EINVAL, "A has one vector");
    let qp_a = rc_qp(&pd_a, &cq_a, caps(8, 8, 1, 16)).expect("QP on A");
    let qp_b = rc_qp(&pd_b, &cq_b, caps(8, 8, 1, 16)).expect("QP on B");
    // Connected to each other, as two applications exchanging QPN and GID.
    connect(&qp_a, qp_b.qp_num(), 4);
    connect(&qp_b, qp_a.qp_num(), 3);
    let qa = qp_a.query(0).expect("query A");
    let qb = qp_b.query(0).expect("query B");
    assert_eq!(
        (qa.attr.dest_qp_num.get(), qa.attr.ah_attr.dgid),
        (qp_b.qp_num(), gid_b)
    );
    assert_eq!(
        (qb.attr.dest_qp_num.get(), qb.attr.ah_attr.dgid),
        (qp_a.qp_num(), gid_a)
    );

    // Both devices serve concurrently.
    std::thread::scope(|s| {
        for (ctx, gid) in [(&a, gid_a), (&b, gid_b)] {
            s.spawn(move || {
                for _ in 0..50 {
                    assert_eq!(ctx.query_gid(1, 0).expect("query_gid").gid, gid);
                    let cq = ctx.create_cq(8, 0).expect("create_cq");
                    destroyed(cq.destroy());
                }
            });
        }
    });

    // Closing A leaves B untouched.
    drop((qp_a, cq_a, pd_a, a));
    assert_eq!(state_of(&qp_b), QpState::Rts);
    destroyed(pd_b2.destroy());
    destroyed(qp_b.destroy());
    destroyed(cq_b.destroy());
    destroyed(pd_b.destroy());
}
