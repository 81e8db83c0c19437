//! Tenant policy end to end: quotas from hostd's policy file enforced at
//! every verb (and again by hostd for memory), hot reload that raises and
//! lowers limits without touching what exists, rate limits, and the
//! per-tenant counters operators read with `vrdmactl`.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use vrdma_guest_driver::{Error, QpCapabilities, SendPayload, SendWr, WorkCompletion};
use vrdma_spec::verbs::{access, SendOpcode, WcStatus};
use vrdma_tests::daemon::{metric_value, Hostd};
use vrdma_tests::tenant::{connect, default_caps, policy, qp_pair, Connection, Tenant};

const RW: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
/// The network of hostd's default policy, which these policies keep.
const DEMO: &str = "network = \"demo\"";
const MIB: usize = 1 << 20;

/// The errno a device-side refusal carried.
#[track_caller]
fn refused<T: Debug>(result: Result<T, Error>) -> i32 {
    match result {
        Err(Error::Device(errno)) => errno,
        other => panic!("expected the device to refuse, got {other:?}"),
    }
}

fn caps(wr: u32) -> QpCapabilities {
    QpCapabilities {
        max_send_wr: wr,
        max_recv_wr: wr,
        ..default_caps()
    }
}

const QUOTA_POLICY: &str = r#"
[[tenant]]
name = "alpha"
network = "demo"
quotas = { max_pd = 2, max_cq = 3, max_qp = 2, max_mr = 3, max_cq_depth = 64, max_qp_depth = 32, max_mr_bytes = 1048576, max_total_mr_bytes = 1572864 }

[[tenant]]
name = "beta"
network = "demo"
"#;

#[test]
fn every_quota_refuses_the_next_object_and_freeing_makes_room() {
    let hostd = Hostd::start(Some(QUOTA_POLICY));
    // Tenant::start allocates one PD and one CQ (depth 1024 would exceed
    // max_cq_depth 64, so open the device by hand).
    let vdev = vrdma_tests::daemon::Vdev::on_hostd(&hostd, "alpha", &[]);
    let ctx = vrdma_guest_driver::Context::open_vhost_user(&vdev.socket).expect("open");
    let attr = ctx.query_device().expect("query_device");
    assert_eq!(
        (attr.max_pd.get(), attr.max_qp.get(), attr.max_mr.get()),
        (2, 2, 3),
        "the device advertises the policy"
    );

    // PDs
    let pd = ctx.alloc_pd().expect("pd 1");
    let pd2 = ctx.alloc_pd().expect("pd 2");
    assert_eq!(refused(ctx.alloc_pd()), libc::ENOMEM, "third PD");
    pd2.destroy().expect("free one");
    let pd2 = ctx.alloc_pd().expect("room again");

    // CQs, and the CQ depth
    assert_eq!(
        refused(ctx.create_cq(65, 0)),
        libc::EINVAL,
        "deeper than max_cq_depth"
    );
    let cqs: Vec<_> = (0..3)
        .map(|i| {
            ctx.create_cq(64, 0)
                .unwrap_or_else(|e| panic!("cq {i}: {e}"))
        })
        .collect();
    assert_eq!(refused(ctx.create_cq(8, 0)), libc::ENOMEM, "fourth CQ");

    // QPs, and the QP depth
    let init = |cap| vrdma_guest_driver::QpInitAttr {
        send_cq: &cqs[0],
        recv_cq: &cqs[0],
        cap,
        qp_type: vrdma_spec::verbs::QpType::Rc,
        sq_sig_all: false,
        srq: None,
    };
    assert_eq!(
        refused(pd.create_qp(&init(caps(33)))),
        libc::EINVAL,
        "deeper than max_qp_depth"
    );
    let qp1 = pd.create_qp(&init(caps(32))).expect("qp 1");
    let qp2 = pd2.create_qp(&init(caps(8))).expect("qp 2");
    assert_eq!(
        refused(pd.create_qp(&init(caps(8)))),
        libc::ENOMEM,
        "third QP"
    );
    assert!(qp1.query(0).is_ok(), "the other QPs keep working");
    qp2.destroy().expect("free one");
    let _qp3 = pd.create_qp(&init(caps(8))).expect("room again");

    // Memory: the largest MR, the bytes across MRs, the MR count
    assert_eq!(
        refused(pd.alloc_mr(2 * MIB, RW)),
        libc::ENOMEM,
        "above max_mr_bytes"
    );
    let big = pd.alloc_mr(MIB, RW).expect("1 MiB");
    assert_eq!(
        refused(pd.alloc_mr(MIB, RW)),
        libc::ENOMEM,
        "would pass 1.5 MiB in all"
    );
    let half = pd
        .alloc_mr(MIB / 2, RW)
        .expect("0.5 MiB: exactly the total");
    assert_eq!(
        refused(pd.alloc_mr(4096, RW)),
        libc::ENOMEM,
        "total reached"
    );
    big.write(0, b"still mine")
        .expect("the other MRs keep working");
    big.dereg().expect("free 1 MiB");
    let small: Vec<_> = (0..2)
        .map(|_| pd.alloc_mr(4096, RW).expect("room again"))
        .collect();
    assert_eq!(
        refused(pd.alloc_mr(4096, RW)),
        libc::ENOMEM,
        "fourth MR: max_mr = 3"
    );
    drop((half, small));

    // hostd counted the refusals for the tenant.
    let (code, metrics, err) = hostd.ctl(&["metrics"]);
    assert_eq!(code, 0, "{err}");
    for quota in [
        "max_pd",
        "max_cq",
        "max_qp",
        "max_mr_bytes",
        "max_total_mr_bytes",
        "max_mr",
    ] {
        let line =
            format!("vrdma_tenant_quota_rejections_total{{tenant=\"alpha\",quota=\"{quota}\"}}");
        let count = metric_value(&metrics, &line).unwrap_or(0.0);
        assert!(count >= 1.0, "{quota} rejection not counted:\n{metrics}");
    }
}

#[test]
fn hostd_caps_memory_across_all_devices_of_a_tenant() {
    let quotas = "quotas = { max_mr_bytes = 1048576, max_total_mr_bytes = 1572864 }";
    let policy = policy(&[("alpha", &format!("{DEMO}\n{quotas}")), ("beta", DEMO)]);
    let hostd = Hostd::start(Some(&policy));
    let one = Tenant::start(&hostd, "alpha");
    let two = Tenant::start(&hostd, "alpha");
    let _a = one.pd.alloc_mr(MIB, RW).expect("1 MiB on the first device");
    // Each device alone is within its quota; together they are not.
    assert_eq!(
        refused(two.pd.alloc_mr(MIB, RW)),
        libc::ENOMEM,
        "hostd's tenant-wide cap"
    );
    let _b = two.pd.alloc_mr(MIB / 2, RW).expect("what is left");
}

/// Memory regions over scattered application memory (each its own page,
/// so each its own memory slot on hostd in process mode) are limited by
/// `max_mr` alone, with ENOMEM — not by hostd's memory slots (EINVAL after
/// 1,023) — and deregistering them gives their slots back for ever.
#[test]
fn scattered_memory_regions_are_limited_by_max_mr_alone() {
    const PAGE: usize = 4096;
    /// The policy's default `max_mr`.
    const MAX_MR: usize = 1024;
    let hostd = Hostd::start(None);
    let alpha = Tenant::start(&hostd, "alpha");
    // One anonymous mapping per page, with a gap between: no two regions
    // share or touch a page.
    let pages = MAX_MR + 1;
    // SAFETY: a fresh private anonymous mapping; unmapped at the end.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * PAGE * pages,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let page = |i: usize| base.cast::<u8>().wrapping_add(2 * PAGE * i);
    for round in 0..2 {
        let mut mrs = Vec::with_capacity(MAX_MR);
        for i in 0..MAX_MR {
            // SAFETY: page i is mapped, readable and stays mapped until
            // the end of the test; nothing else uses it.
            match unsafe { alpha.pd.reg_mr(page(i), PAGE, RW) } {
                Ok(mr) => mrs.push(mr),
                Err(e) => panic!("round {round}: MR {i} of {MAX_MR} refused: {e:?}"),
            }
        }
        // SAFETY: as above.
        let past = unsafe { alpha.pd.reg_mr(page(MAX_MR), PAGE, RW) };
        assert_eq!(
            refused(past),
            libc::ENOMEM,
            "round {round}: MR {}",
            MAX_MR + 1
        );
        let counts = hostd.usage("alpha");
        assert_eq!(counts["mrs"], MAX_MR as u64, "round {round}: {counts}");
        for mr in mrs {
            mr.dereg().map_err(|e| e.error).expect("dereg");
        }
    }
    // SAFETY: the mapping made above; no MR covers it any more.
    assert_eq!(unsafe { libc::munmap(base, 2 * PAGE * pages) }, 0);
}

#[test]
fn reload_raises_and_lowers_limits_without_touching_what_exists() {
    let policy = |max_qp: u32| {
        format!(
            "[[tenant]]\nname = \"alpha\"\nnetwork = \"demo\"\nquotas = {{ max_qp = {max_qp} }}\n\n[[tenant]]\nname = \"beta\"\nnetwork = \"demo\"\n"
        )
    };
    let mut hostd = Hostd::start(Some(&policy(1)));
    let a = Tenant::start(&hostd, "alpha");
    let b = Tenant::start(&hostd, "beta");
    let qa = a.qp(default_caps());
    assert_eq!(
        refused(a.pd.create_qp(&vrdma_guest_driver::QpInitAttr {
            send_cq: &a.cq,
            recv_cq: &a.cq,
            cap: default_caps(),
            qp_type: vrdma_spec::verbs::QpType::Rc,
            sq_sig_all: false,
            srq: None,
        })),
        libc::ENOMEM
    );

    // Raise with the control command: applies at once.
    std::fs::write(hostd.policy_path(), policy(3)).expect("rewrite");
    let (code, out, err) = hostd.ctl(&["reload"]);
    assert_eq!(code, 0, "reload: {out}{err}");
    let more = wait_for(|| a.pd.create_qp(&init(&a)).ok());
    let third = a.qp(default_caps());

    // Lower with SIGHUP: new objects refused, existing ones keep working.
    std::fs::write(hostd.policy_path(), policy(1)).expect("rewrite");
    hostd.sighup();
    wait_for(|| match a.pd.create_qp(&init(&a)) {
        Err(Error::Device(libc::ENOMEM)) => Some(()),
        Ok(qp) => {
            drop(qp);
            None
        }
        Err(e) => panic!("{e}"),
    });
    let qb = b.qp(default_caps());
    connect(&a, &qa, &b, &qb, Connection::default());
    let src = a.pd.alloc_mr(4096, RW).expect("src");
    let dst = b.pd.alloc_mr(4096, RW).expect("dst");
    src.write(0, b"after the reload").expect("fill");
    let sge = [src.sge(0, 16)];
    let mut wr = SendWr::new(1, SendOpcode::RdmaWrite, SendPayload::Sges(&sge));
    wr.flags = vrdma_spec::ring::send_flags::SIGNALED;
    wr.remote_addr = dst.iova();
    wr.rkey = dst.rkey();
    qa.post_send(&[wr]).expect("post");
    assert_eq!(
        vrdma_tests::tenant::wait_completions(&a.cq, 1)[0].status,
        WcStatus::Success
    );
    let mut got = [0u8; 16];
    dst.read(0, &mut got).expect("read");
    assert_eq!(&got, b"after the reload");
    assert!(
        more.query(0).is_ok() && third.query(0).is_ok(),
        "QPs above the lowered quota still exist"
    );

    // A broken file is refused with its location and changes nothing.
    std::fs::write(
        hostd.policy_path(),
        "[[tenant]]\nname = \"alpha\"\nquotas = { max_qp = -4 }\n",
    )
    .expect("rewrite");
    let (code, out, err) = hostd.ctl(&["reload"]);
    assert_ne!(code, 0, "a broken policy must not load: {out}");
    let text = format!("{out}{err}");
    assert!(
        text.contains("policy.toml:3") && text.contains("max_qp"),
        "{text}"
    );
    assert_eq!(
        refused(a.pd.create_qp(&init(&a))),
        libc::ENOMEM,
        "the policy in force is unchanged"
    );
    assert!(
        vrdma_spec::gid::ipv4_of(&Tenant::start(&hostd, "beta").gid).is_some(),
        "beta, absent from the broken file, still registers"
    );
}

fn init(t: &Tenant) -> vrdma_guest_driver::QpInitAttr<'_> {
    vrdma_guest_driver::QpInitAttr {
        send_cq: &t.cq,
        recv_cq: &t.cq,
        cap: default_caps(),
        qp_type: vrdma_spec::verbs::QpType::Rc,
        sq_sig_all: false,
        srq: None,
    }
}

/// Retries `f` until it gives a value: a policy notification reaches vdev
/// asynchronously, shortly after hostd answered the reload.
fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "the new policy did not reach vdev within 5 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The tests that measure rates take turns: two floods at once on a
/// 2-core machine would measure the CPUs, not hostd.
static FLOODS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Completed RDMA WRITEs per second of a QP kept busy for `window`.
fn measure_ops(
    t: &Tenant,
    qp: &vrdma_guest_driver::QueuePair,
    wr: SendWr<'_>,
    window: Duration,
) -> f64 {
    let start = Instant::now();
    let done = flood_while(t, qp, wr, || start.elapsed() < window);
    // The loop stops at its first look past the window.
    done as f64 / window.as_secs_f64()
}

/// Keeps 32 copies of `wr` in flight on `qp` until `stop`, then drains.
fn flood_until(
    t: &Tenant,
    qp: &vrdma_guest_driver::QueuePair,
    wr: SendWr<'_>,
    stop: &std::sync::atomic::AtomicBool,
) {
    flood_while(t, qp, wr, || {
        !stop.load(std::sync::atomic::Ordering::Relaxed)
    });
}

/// Keeps 32 copies of `wr` in flight while `go()` says so (every
/// completion checked), then drains; returns the completions counted
/// while `go()` held.
fn flood_while(
    t: &Tenant,
    qp: &vrdma_guest_driver::QueuePair,
    wr: SendWr<'_>,
    go: impl Fn() -> bool,
) -> usize {
    let mut wcs = [WorkCompletion::default(); 32];
    let (mut posted, mut done) = (0usize, 0usize);
    while go() {
        while posted - done < 32 {
            qp.post_send(&[wr]).expect("post");
            posted += 1;
        }
        let n = t.cq.poll(&mut wcs).expect("poll");
        assert!(
            wcs[..n].iter().all(|wc| wc.status == WcStatus::Success),
            "{:?}",
            &wcs[..n]
        );
        done += n;
        if n == 0 {
            std::thread::yield_now();
        }
    }
    let counted = done;
    // Drain what is still in flight so the QP is quiet for the next user.
    while done < posted {
        done += t.cq.poll(&mut wcs).expect("poll");
    }
    counted
}

#[test]
fn a_rate_limited_tenant_stays_within_ten_percent_while_another_floods() {
    let _turn = FLOODS.lock().unwrap_or_else(|p| p.into_inner());
    const LIMIT: f64 = 2000.0;
    /// Beta's WRITEs: big, yet cheap enough in a debug build to outrun
    /// alpha's limit by far even on a loaded machine.
    const FLOOD_BYTES: u32 = 16384;
    let rate = "rate.send = { ops_per_sec = 2000, ops_burst = 20 }";
    let policy = policy(&[("alpha", &format!("{DEMO}\n{rate}")), ("beta", DEMO)]);
    let hostd = Hostd::start(Some(&policy));
    let a = Tenant::start(&hostd, "alpha");
    let b = Tenant::start(&hostd, "beta");
    let (qa, _qb) = qp_pair(&a, &b, Connection::default());
    let (qb2, _qa2) = qp_pair(&b, &a, Connection::default());
    let (src_a, dst_b) = (
        a.pd.alloc_mr(4096, RW).expect("mr"),
        b.pd.alloc_mr(4096, RW).expect("mr"),
    );
    let (src_b, dst_a) = (
        b.pd.alloc_mr(65536, RW).expect("mr"),
        a.pd.alloc_mr(65536, RW).expect("mr"),
    );
    let small_sge = [src_a.sge(0, 64)];
    let mut small = SendWr::new(0, SendOpcode::RdmaWrite, SendPayload::Sges(&small_sge));
    small.flags = vrdma_spec::ring::send_flags::SIGNALED;
    small.remote_addr = dst_b.iova();
    small.rkey = dst_b.rkey();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (limited, unlimited) = std::thread::scope(|scope| {
        let flood = scope.spawn(|| {
            let sge = [src_b.sge(0, FLOOD_BYTES)];
            let mut wr = SendWr::new(0, SendOpcode::RdmaWrite, SendPayload::Sges(&sge));
            wr.flags = vrdma_spec::ring::send_flags::SIGNALED;
            wr.remote_addr = dst_a.iova();
            wr.rkey = dst_a.rkey();
            let mut rates = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                rates.push(measure_ops(&b, &qb2, wr, Duration::from_millis(200)));
            }
            rates.iter().sum::<f64>() / rates.len().max(1) as f64
        });
        // Spend the burst, then measure over a window.
        measure_ops(&a, &qa, small, Duration::from_millis(300));
        let limited = measure_ops(&a, &qa, small, Duration::from_secs(2));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (limited, flood.join().expect("flood"))
    });
    assert!(
        (limited - LIMIT).abs() <= LIMIT * 0.10,
        "alpha ran at {limited:.0} ops/s, limit {LIMIT}"
    );
    // Beta, without a limit, runs past alpha's (its rate is what a debug
    // build copies 16 KiB at: 64 KiB gave 4,000-6,000 ops/s here, and
    // 2,125 once with other builds on both cores) and is never throttled,
    // while alpha is.
    assert!(
        unlimited > 1.5 * LIMIT,
        "beta is not limited: {unlimited:.0} ops/s"
    );
    let (code, metrics, err) = hostd.ctl(&["metrics"]);
    assert_eq!(code, 0, "{err}");
    let throttled = |tenant: &str| -> f64 {
        let prefix = format!("vrdma_tenant_throttled_seconds_total{{tenant=\"{tenant}\"");
        let values: Vec<f64> = (metrics.lines())
            .filter(|l| l.starts_with(&prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .collect();
        assert_eq!(values.len(), 2, "{tenant}'s send and read lines: {metrics}");
        values.iter().sum()
    };
    assert!(throttled("alpha") > 0.5, "alpha was throttled: {metrics}");
    assert_eq!(throttled("beta"), 0.0, "beta never was: {metrics}");
    assert!(
        metrics.contains("vrdma_tenant_ops_total{tenant=\"beta\""),
        "{metrics}"
    );
}

#[test]
fn weights_one_to_three_share_a_congested_port_within_ten_percent() {
    // A 250 Mbit/s port: slow enough that even debug builds on a loaded
    // 2-core machine keep both tenants' queues full (32 writes of 64 KiB
    // queued each are 67 ms of the port's time), so the port is the
    // bottleneck and hostd's scheduler decides the shares.
    let _turn = FLOODS.lock().unwrap_or_else(|p| p.into_inner());
    let weight =
        |w| format!("network = \"bench\"\npriority = {{ class = \"normal\", weight = {w} }}");
    let (light, heavy) = (weight(1), weight(3));
    let policy = policy(&[
        ("light", &light),
        ("heavy", &heavy),
        ("sink", "network = \"bench\""),
    ]);
    let hostd = Hostd::start_with(Some(&policy), &["--line-rate-mbps", "250"]);
    let sink = Tenant::start(&hostd, "sink");
    // Per flooding tenant: its QP, the sink's QP, source and destination.
    let floods: Vec<_> = ["light", "heavy"]
        .into_iter()
        .map(|name| {
            let t = Tenant::start(&hostd, name);
            let (q, qs) = qp_pair(&t, &sink, Connection::default());
            let src = t.pd.alloc_mr(65536, RW).expect("source");
            let dst = sink.pd.alloc_mr(65536, RW).expect("destination");
            (t, q, qs, src, dst)
        })
        .collect();
    // Both flood until told to stop; hostd's counters of completed writes,
    // read at the ends of a window while both are backlogged, give the
    // shares over one and the same window. Shares mean something only on
    // a congested port: a window in which other load on the machine kept
    // the flooders from filling the port (below 80 %) is measured again,
    // up to 4 windows.
    // Together they fill the port (31.25 MB/s = 477 writes of 64 KiB per s).
    let port = 250e6 / 8.0 / 65536.0;
    let congested = |rates: &[f64]| rates.iter().sum::<f64>() >= port * 0.8;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let window = Duration::from_secs(2);
    let rates: Vec<f64> = std::thread::scope(|scope| {
        for (t, q, _, src, dst) in &floods {
            let stop = &stop;
            scope.spawn(move || {
                let sge = [src.sge(0, 65536)];
                let mut wr = SendWr::new(0, SendOpcode::RdmaWrite, SendPayload::Sges(&sge));
                wr.flags = vrdma_spec::ring::send_flags::SIGNALED;
                wr.remote_addr = dst.iova();
                wr.rkey = dst.rkey();
                flood_until(t, q, wr, stop);
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        let mut rates = Vec::new();
        for _ in 0..4 {
            let before = ["light", "heavy"].map(|name| hostd.ops(name));
            std::thread::sleep(window);
            let after = ["light", "heavy"].map(|name| hostd.ops(name));
            rates = (0..2)
                .map(|i| (after[i] - before[i]) as f64 / window.as_secs_f64())
                .collect();
            if congested(&rates) {
                break;
            }
            println!("port not congested ({rates:?} writes/s of {port:.0}), measuring again");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        rates
    });
    let (light, heavy) = (rates[0], rates[1]);
    let ratio = heavy / light;
    assert!(
        (ratio - 3.0).abs() <= 0.3,
        "weights 1:3 gave light {light:.0} ops/s, heavy {heavy:.0} ops/s (1:{ratio:.2})"
    );
    let total = light + heavy;
    assert!(
        total <= port * 1.05 && total >= port * 0.8,
        "{total:.0} writes/s on a port of {port:.0}"
    );
}
