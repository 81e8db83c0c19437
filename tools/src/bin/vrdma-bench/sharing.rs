//! How hostd shares its port between tenants: a realtime tenant's latency
//! while a normal tenant floods, and the bandwidth shares of two flooding
//! tenants weighted 1:3 — for WRITE floods and SEND floods alike.
//!
//! The modelled port runs at `--line-rate-mbps`, below what this host's
//! CPUs can move, so that the port, as on a real NIC, is the resource the
//! tenants contend for.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vrdma_spec::verbs::SendOpcode;
use vrdma_tenant_policy::PriorityClass::{Normal, Realtime};

use crate::cores;
use crate::host::{policy, Host};
use crate::latency::{self, Kind};
use crate::report::{us, Bound, Targets};
use crate::throughput::{stream, Flood, Shape, Until};
use crate::{BenchError, Result};

/// hostd on `policy` with a port of `mbps`.
fn hostd_at_line_rate(policy: &str, mbps: u32) -> Result<Host> {
    Host::start(Some(policy), &["--line-rate-mbps", &mbps.to_string()])
}

fn op_name(op: SendOpcode) -> &'static str {
    if op == SendOpcode::Send {
        "SEND"
    } else {
        "WRITE"
    }
}

/// A realtime tenant's 64-byte READ latency alone and under a normal
/// tenant's `flood_size`-byte flood of `op`, with the policy and without
/// (everyone normal). The probe and the flood each run on a thread of
/// their own at their class's CPU priority ([`cores::run_as`]); the flood's
/// rate is the one while the probe measured.
pub fn isolation(
    iters: usize,
    mbps: u32,
    flood_size: usize,
    op: SendOpcode,
    targets: &mut Targets,
) -> Result<()> {
    let setups = [
        ("policy: probe realtime, flood normal", Realtime, true),
        ("no policy: everyone normal", Normal, false),
    ];
    for (label, probe_class, checked) in setups {
        let classes = [
            ("probe", probe_class.name(), 1),
            ("flood", "normal", 1),
            ("peer", probe_class.name(), 1),
        ];
        let host = hostd_at_line_rate(&policy(classes), mbps)?;
        let probe = host.tenant("probe")?;
        let flooder = host.tenant("flood")?;
        let peer = host.tenant("peer")?;
        let probe_as = || {
            cores::run_as(probe_class)?;
            latency::ping_pong(Kind::Read, &probe, &peer, 64, iters)
        };
        let (alone50, alone99) = std::thread::scope(|scope| {
            scope
                .spawn(probe_as)
                .join()
                .map_err(|_| BenchError::Panicked)?
        })?;
        let flood = Flood::default();
        let shape = Shape::flood(op, flood_size);
        let (probed, flooded) = std::thread::scope(|scope| {
            let f = scope.spawn(|| {
                cores::run_as(Normal)?;
                stream(&flooder, &peer, shape, Until::Stopped(&flood))
            });
            std::thread::sleep(Duration::from_millis(200));
            let (done, start) = (flood.done.load(Ordering::Relaxed), Instant::now());
            let probed = scope
                .spawn(probe_as)
                .join()
                .map_err(|_| BenchError::Panicked);
            let during = flood.done.load(Ordering::Relaxed) - done;
            let rate = during as f64 * flood_size as f64 / start.elapsed().as_secs_f64();
            flood.stop();
            let flooded = f.join().map_err(|_| BenchError::Panicked);
            (probed, flooded.map(|f| f.map(|_| rate)))
        });
        let ((load50, load99), gbps) = (probed??, flooded?? / 1e9);
        let ratio = load99.as_secs_f64() / alone99.as_secs_f64();
        let op = op_name(op);
        println!(
            "isolation  port {mbps} Mbit/s, {label}: probe read_lat 64 B alone p50 {} p99 {}; under a {flood_size} B {op} flood ({gbps:.2} GB/s while probing) p50 {} p99 {}; p99 ratio {ratio:.2}",
            us(alone50),
            us(alone99),
            us(load50),
            us(load99),
        );
        if checked {
            let what = format!("realtime p99 under a {op} flood / alone");
            targets.check(what, ratio, "", Bound::AtMost(2.0));
        }
    }
    Ok(())
}

/// Two normal tenants weighted 1:3 flooding a sink each with 64 KiB
/// `op`s for three seconds: their bandwidth shares of the port. (A sink
/// each: a tenant's receives complete on its one CQ, which one receiving
/// thread per flooder could not share.)
pub fn weights(mbps: u32, op: SendOpcode, targets: &mut Targets) -> Result<()> {
    let tenants = [
        ("light", "normal", 1),
        ("heavy", "normal", 3),
        ("light-sink", "normal", 1),
        ("heavy-sink", "normal", 1),
    ];
    let host = hostd_at_line_rate(&policy(tenants), mbps)?;
    let light = host.tenant("light")?;
    let heavy = host.tenant("heavy")?;
    let light_sink = host.tenant("light-sink")?;
    let heavy_sink = host.tenant("heavy-sink")?;
    let flood = Flood::default();
    let shape = Shape::flood(op, 65536);
    let (l, h) = std::thread::scope(|scope| {
        let l = scope.spawn(|| stream(&light, &light_sink, shape, Until::Stopped(&flood)));
        let h = scope.spawn(|| stream(&heavy, &heavy_sink, shape, Until::Stopped(&flood)));
        std::thread::sleep(Duration::from_secs(3));
        flood.stop();
        let join = |t: std::thread::ScopedJoinHandle<'_, Result<_>>| {
            t.join().map_err(|_| BenchError::Panicked)?
        };
        (join(l), join(h))
    });
    let bytes = |c: crate::throughput::Completed| c.ops_per_sec() * 65536.0;
    let (l, h) = (bytes(l?), bytes(h?));
    let busy = (l + h) * 8.0 / (f64::from(mbps) * 1e6) * 100.0;
    let op = op_name(op);
    println!(
        "weights    port {mbps} Mbit/s, normal 1:3 flooding 64 KiB {op}s for 3 s: light {:.2} GB/s, heavy {:.2} GB/s (port {busy:.0} % busy), heavy/light {:.2}",
        l / 1e9,
        h / 1e9,
        h / l
    );
    if busy < 90.0 {
        println!(
            "weights    the port was not the bottleneck (the CPUs were): measure on an idle machine or with a lower --line-rate-mbps"
        );
    }
    let what = format!("{op} flood shares heavy/light (weights 3:1)");
    let near = Bound::Near {
        value: 3.0,
        tolerance: 0.1,
    };
    targets.check(what, h / l, "", near);
    Ok(())
}
