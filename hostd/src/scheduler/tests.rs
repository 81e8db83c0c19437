//! The scheduler's policy semantics, with a simulated clock.

use super::*;
use vrdma_tenant_policy::RateLimit;
use PriorityClass::{Normal, Priority, Realtime};

fn tenant(name: &str, class: PriorityClass, weight: u32) -> TenantPolicy {
    let mut t = vrdma_tenant_policy::Policy::default_policy().tenants[0].clone();
    t.name = name.into();
    t.priority = vrdma_tenant_policy::Priority { class, weight };
    t
}

/// A tenant whose sends are limited to `ops_per_sec`, in bursts of
/// `burst` (the policy's default when `None`).
fn send_limited(
    name: &str,
    class: PriorityClass,
    ops_per_sec: u64,
    burst: Option<u64>,
) -> TenantPolicy {
    let mut t = tenant(name, class, 1);
    t.rate.send.ops_per_sec = Some(ops_per_sec);
    t.rate.send.ops_burst = burst;
    t
}

fn send(bytes: u64) -> Head {
    Head {
        kind: OpKind::Send,
        bytes,
    }
}

/// A scheduler with one device (id = index + 1, pQP 0) per tenant.
fn setup(tenants: &[TenantPolicy], now: Instant) -> Scheduler {
    let mut s = Scheduler::new(None);
    for (i, t) in tenants.iter().enumerate() {
        s.configure(t, now);
        assert!(s.add_device(i as DeviceId + 1, &t.name));
    }
    s
}

/// A scheduler with one device (id = index + 1, pQP 0) per tenant of the
/// given class and weight, named `t1`, `t2`, ...
fn classes(now: Instant, tenants: &[(PriorityClass, u32)]) -> Scheduler {
    let tenants: Vec<TenantPolicy> = (1..)
        .zip(tenants)
        .map(|(i, &(class, weight))| tenant(&format!("t{i}"), class, weight))
        .collect();
    setup(&tenants, now)
}

/// Picks `n` times, re-staging whatever ran with `head_of(device)`;
/// returns bytes served per device.
fn run(
    s: &mut Scheduler,
    now: Instant,
    n: usize,
    head_of: impl Fn(DeviceId) -> Head,
) -> HashMap<DeviceId, u64> {
    let mut bytes = HashMap::new();
    for _ in 0..n {
        match s.pick(now) {
            Pick::Run(q) => {
                let head = head_of(q.0);
                *bytes.entry(q.0).or_insert(0) += head.bytes;
                s.stage(q, head, now);
            }
            other => panic!("expected work, got {other:?}"),
        }
    }
    bytes
}

#[test]
fn strict_priority_between_classes() {
    let now = Instant::now();
    let mut s = classes(now, &[(Normal, 1000), (Priority, 1), (Realtime, 1)]);
    for d in 1..=3 {
        s.stage((d, 0), send(4096), now);
    }
    // All three backlogged: only realtime is served, whatever the weights.
    let served = run(&mut s, now, 500, |_| send(4096));
    assert_eq!(served.keys().copied().collect::<Vec<_>>(), vec![3]);
    // Realtime runs dry: priority next, normal still nothing.
    s.unstage((3, 0));
    let served = run(&mut s, now, 500, |_| send(4096));
    assert_eq!(served.keys().copied().collect::<Vec<_>>(), vec![2]);
    // Only when no higher class has eligible work does normal run.
    s.unstage((2, 0));
    let served = run(&mut s, now, 10, |_| send(4096));
    assert_eq!(served.keys().copied().collect::<Vec<_>>(), vec![1]);
    // A throttled realtime tenant has no eligible work: normal runs.
    let rt = send_limited("t3", Realtime, 10, Some(1));
    s.configure(&rt, now);
    s.stage((3, 0), send(64), now);
    assert_eq!(s.pick(now), Pick::Run((3, 0)), "the burst");
    s.stage((3, 0), send(64), now);
    assert_eq!(s.pick(now), Pick::Run((1, 0)));
    // After 100 ms the realtime tenant has a token again and goes first.
    s.stage((1, 0), send(4096), now);
    let later = now + Duration::from_millis(100);
    assert_eq!(s.pick(later), Pick::Run((3, 0)));
}

#[test]
fn weights_share_bytes_within_a_class() {
    let now = Instant::now();
    let mut s = classes(now, &[(Normal, 1), (Normal, 3)]);
    // Different message sizes: the share is in bytes, not messages.
    let head_of = |d: DeviceId| if d == 1 { send(4096) } else { send(1000) };
    s.stage((1, 0), head_of(1), now);
    s.stage((2, 0), head_of(2), now);
    let served = run(&mut s, now, 100_000, head_of);
    let ratio = served[&2] as f64 / served[&1] as f64;
    assert!((ratio - 3.0).abs() < 0.3, "1:3 weights gave 1:{ratio:.3}");
}

#[test]
fn a_tenants_queues_take_turns_and_keep_their_order() {
    let now = Instant::now();
    let mut s = Scheduler::new(None);
    s.configure(&tenant("t", Normal, 1), now);
    assert!(s.add_device(7, "t"));
    assert!(!s.add_device(8, "nobody"), "unknown tenant");
    s.stage((7, 0), send(100), now);
    s.stage((7, 1), send(100), now);
    let mut order = Vec::new();
    for _ in 0..6 {
        let Pick::Run(q) = s.pick(now) else {
            panic!("work is staged");
        };
        order.push(q.1);
        s.stage(q, send(100), now);
    }
    assert_eq!(order, vec![0, 1, 0, 1, 0, 1]);
    s.remove_device(7);
    assert_eq!(s.pick(now), Pick::Idle);
}

#[test]
fn huge_messages_are_scheduled_without_spinning_through_turns() {
    let now = Instant::now();
    let mut s = classes(now, &[(Normal, 1), (Normal, 1)]);
    let huge = 1u64 << 31;
    s.stage((1, 0), send(huge), now);
    s.stage((2, 0), send(huge), now);
    let served = run(&mut s, now, 100, |_| send(huge));
    assert_eq!(served[&1], served[&2], "equal turns: {served:?}");
}

/// Simulates `secs` seconds: picks as long as work may go, jumping the
/// clock to the next refill when told to wait. With `background`, an
/// unlimited tenant (device 2) is always backlogged and the clock moves
/// by `step` per pick. Returns ops and bytes served per device.
fn simulate(
    s: &mut Scheduler,
    start: Instant,
    secs: u64,
    head: Head,
    step: Duration,
) -> HashMap<DeviceId, (u64, u64)> {
    let end = start + Duration::from_secs(secs);
    let mut now = start;
    let mut served: HashMap<DeviceId, (u64, u64)> = HashMap::new();
    while now < end {
        match s.pick(now) {
            Pick::Run(q) => {
                let e = served.entry(q.0).or_default();
                e.0 += 1;
                e.1 += head.bytes;
                s.stage(q, head, now);
                now += step;
            }
            Pick::Wait(Some(at)) => {
                assert!(at > now, "woken for nothing at {at:?}");
                now = at;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    served
}

#[test]
fn token_buckets_hold_the_configured_rates() {
    let start = Instant::now();
    // 1000 ops/s, burst 10: 10 s give 10 000 (+ the burst).
    let mut s = setup(&[send_limited("ops", Realtime, 1000, Some(10))], start);
    s.stage((1, 0), send(64), start);
    let served = simulate(&mut s, start, 10, send(64), Duration::ZERO);
    let n = served[&1].0 as f64;
    assert!((n - 10_000.0).abs() / 10_000.0 < 0.1, "{n} ops in 10 s");

    // 1 MB/s of 4 KiB reads (default burst of 64 KiB).
    let mut bytes = tenant("bytes", Normal, 1);
    bytes.rate.read.bytes_per_sec = Some(1_000_000);
    let mut s = setup(&[bytes], start);
    let read = Head {
        kind: OpKind::Read,
        bytes: 4096,
    };
    s.stage((1, 0), read, start);
    let served = simulate(&mut s, start, 10, read, Duration::ZERO);
    let b = served[&1].1 as f64;
    assert!((b - 10e6).abs() / 10e6 < 0.1, "{b} bytes in 10 s");
    // Sends of the same tenant are not limited by its read bucket.
    let now = start + Duration::from_secs(10);
    while let Pick::Run(q) = s.pick(now) {
        s.stage(q, read, now);
    }
    s.stage((1, 1), send(4096), now);
    assert_eq!(s.pick(now), Pick::Run((1, 1)));
}

#[test]
fn a_limited_tenant_keeps_its_rate_beside_an_unlimited_one() {
    let start = Instant::now();
    let mut s = setup(
        &[
            send_limited("slow", Normal, 2000, None),
            tenant("fast", Normal, 1),
        ],
        start,
    );
    s.stage((1, 0), send(64), start);
    s.stage((2, 0), send(64), start);
    // One pick per 10 µs: the NIC could do 100 000 ops/s.
    let served = simulate(&mut s, start, 5, send(64), Duration::from_micros(10));
    let slow_rate = served[&1].0 as f64 / 5.0;
    assert!(
        (slow_rate - 2000.0).abs() / 2000.0 < 0.1,
        "slow tenant ran at {slow_rate}/s"
    );
    assert!(served[&2].0 > 400_000, "fast tenant: {:?}", served[&2]);
    let throttled = s.throttled("slow", start + Duration::from_secs(5))[0];
    // It also waits for its fair-share turn with tokens in hand, which
    // is not throttling; what remains is still well above zero.
    assert!(throttled > Duration::from_millis(100), "{throttled:?}");
    assert_eq!(
        s.throttled("fast", start + Duration::from_secs(5)),
        [Duration::ZERO; 2]
    );
}

#[test]
fn throttled_time_is_counted() {
    let start = Instant::now();
    let mut s = setup(&[send_limited("t", Normal, 100, Some(1))], start);
    s.stage((1, 0), send(64), start);
    // Poll every millisecond for a second: the tenant can run 100
    // times, and waits for a token the rest of the time.
    let mut ran = 0;
    for ms in 0..1000 {
        let now = start + Duration::from_millis(ms);
        if let Pick::Run(q) = s.pick(now) {
            ran += 1;
            s.stage(q, send(64), now);
        }
    }
    assert!((99..=101).contains(&ran), "ran {ran}");
    let end = start + Duration::from_secs(1);
    let [send_t, read_t] = s.throttled("t", end);
    assert!(
        send_t > Duration::from_millis(850) && send_t <= Duration::from_secs(1),
        "throttled {send_t:?}"
    );
    assert_eq!(read_t, Duration::ZERO);
    // No work: the throttled time stops growing.
    s.unstage((1, 0));
    assert_eq!(s.pick(end), Pick::Idle);
    let later = s.throttled("t", end + Duration::from_secs(5));
    assert_eq!(later[0], s.throttled("t", end)[0]);
    // The wait is exact: the next token is due 10 ms after the last.
    s.stage((1, 0), send(64), end);
    let mut now = end;
    let at = loop {
        match s.pick(now) {
            Pick::Run(q) => s.stage(q, send(64), now),
            Pick::Wait(Some(at)) => break at,
            other => panic!("unexpected {other:?}"),
        }
        now += Duration::from_millis(1);
    };
    assert!(at > now && at - now <= Duration::from_millis(10));
}

#[test]
fn reconfiguring_applies_at_once_and_keeps_tokens_bounded() {
    let now = Instant::now();
    let mut t = send_limited("t", Normal, 1, Some(1));
    let mut s = setup(&[t.clone(), tenant("rt", Realtime, 1)], now);
    s.stage((1, 0), send(64), now);
    assert_eq!(s.pick(now), Pick::Run((1, 0)));
    s.stage((1, 0), send(64), now);
    assert!(matches!(s.pick(now), Pick::Wait(Some(_))));
    // Lifting the limit lets it run at once.
    t.rate.send = RateLimit::default();
    s.configure(&t, now);
    assert_eq!(s.pick(now), Pick::Run((1, 0)));
    // Moving it to realtime puts it beside "rt" (device 2).
    t.priority.class = Realtime;
    s.configure(&t, now);
    s.stage((1, 0), send(64), now);
    s.stage((2, 0), send(64), now);
    let served = run(&mut s, now, 1000, |_| send(64));
    assert_eq!(served.len(), 2, "both realtime tenants share: {served:?}");
}

#[test]
fn the_port_is_shared_by_weight_and_realtime_overtakes_booked_work() {
    let start = Instant::now();
    let mut s = classes(start, &[(Normal, 1), (Normal, 3), (Realtime, 1)]);
    // 1 GB/s: one byte per nanosecond.
    s.link = Some(Link::new(1_000_000_000));
    let big = send(65536);
    s.stage((1, 0), big, start);
    s.stage((2, 0), big, start);
    let mut now = start;
    let mut served: HashMap<DeviceId, u64> = HashMap::new();
    let end = start + Duration::from_millis(100);
    while now < end {
        match s.pick(now) {
            Pick::Run(q) => {
                *served.entry(q.0).or_default() += big.bytes;
                s.stage(q, big, now);
            }
            Pick::Wait(Some(at)) => {
                assert!(at > now, "a wait must move time forward");
                now = at;
            }
            other => panic!("backlogged tenants got {other:?}"),
        }
    }
    // The port, not the caller's speed, sets the total: 100 ms at
    // 1 GB/s plus the booked backlog (nobody of a higher class busy).
    let total = served.values().sum::<u64>();
    let wire = 100_000_000 + Link::IDLE_BACKLOG_BYTES + big.bytes;
    assert!(total <= wire && total >= 99_000_000, "{total} bytes");
    let ratio = served[&2] as f64 / served[&1] as f64;
    assert!(
        (ratio - 3.0).abs() < 0.06,
        "1:3 on the port gave 1:{ratio:.3}"
    );
    // The normal class books the port ahead; realtime then goes at once.
    while let Pick::Run(q) = s.pick(now) {
        s.stage(q, big, now);
    }
    s.stage((3, 0), send(64), now);
    assert_eq!(s.pick(now), Pick::Run((3, 0)));
    // ... and the normal class waits behind it.
    let link = s.link.expect("link");
    assert!(link.busy_until[2] > link.busy_until[0]);
}

/// How many WQEs of `head` `budget` admits before it refuses one.
fn admitted(budget: &mut Budget, head: Head, now: Instant) -> usize {
    std::iter::from_fn(|| budget.admit(&head, now).then_some(())).count()
}

#[test]
fn a_burst_goes_on_only_while_a_pick_would_choose_the_same() {
    let now = Instant::now();
    let mut s = classes(now, &[(Normal, 1), (Normal, 1), (Realtime, 1)]);
    s.stage((1, 0), send(4096), now);
    s.stage((2, 0), send(4096), now);
    let first = match s.pick(now) {
        Pick::Run(q) => q,
        other => panic!("{other:?}"),
    };
    // The same tenant's next WQEs ride on its turn: 16 of 4 KiB fill a
    // 64 KiB quantum, the first one included.
    let mut budget = s.budget(first, now, u64::MAX);
    assert_eq!(
        1 + admitted(&mut budget, send(4096), now),
        16,
        "one quantum"
    );
    s.spend(&budget, now);
    s.stage(first, send(4096), now);
    // The other tenant's turn now, through a pick.
    let other = (3 - first.0, 0);
    assert!(
        !s.budget(other, now, u64::MAX).admit(&send(64), now),
        "not the tenant served last"
    );
    assert_eq!(s.pick(now), Pick::Run(other));
    // Work of a higher class ends a burst at once.
    s.stage((3, 0), send(64), now);
    assert!(!s.budget(other, now, u64::MAX).admit(&send(64), now));
    assert_eq!(s.pick(now), Pick::Run((3, 0)));
}

#[test]
fn a_tenant_alone_in_its_class_bursts_past_its_quantum_up_to_the_bytes_given() {
    let now = Instant::now();
    let mut s = classes(now, &[(Normal, 1), (Normal, 1)]);
    s.stage((1, 0), send(65536), now);
    assert_eq!(s.pick(now), Pick::Run((1, 0)));
    // Nobody else has work: 64 KiB messages go on past the 64 KiB
    // quantum, as long as the bytes given last.
    let mut budget = s.budget((1, 0), now, 3 * 65536);
    assert_eq!(
        admitted(&mut budget, send(65536), now),
        3,
        "bounded by the bytes, not the deficit"
    );
    s.spend(&budget, now);
    // Once the other tenant has work, the deficit bounds the burst again
    // and the next pick is the other tenant's.
    s.stage((1, 0), send(65536), now);
    s.stage((2, 0), send(65536), now);
    assert!(!s.budget((1, 0), now, u64::MAX).admit(&send(65536), now));
    assert_eq!(s.pick(now), Pick::Run((2, 0)));

    // Alone in its class, but a higher class was busy lately: the deficit
    // bounds it (the next realtime WQE must not wait behind a long burst).
    let mut s = classes(now, &[(Normal, 1), (Realtime, 1)]);
    s.stage((2, 0), send(64), now);
    assert_eq!(s.pick(now), Pick::Run((2, 0)));
    s.stage((1, 0), send(65536), now);
    assert_eq!(s.pick(now), Pick::Run((1, 0)));
    let mut budget = s.budget((1, 0), now, u64::MAX);
    assert!(!budget.admit(&send(65536), now), "one quantum, used");
    let later = now + BUSY_FOR;
    s.stage((1, 0), send(65536), later);
    assert_eq!(s.pick(later), Pick::Run((1, 0)));
    assert!(
        s.budget((1, 0), later, u64::MAX).admit(&send(65536), later),
        "realtime went quiet: alone again"
    );
}

#[test]
fn a_tenant_keeps_its_turn_while_its_queue_is_restaged() {
    let now = Instant::now();
    let mut s = classes(now, &[(Normal, 1), (Normal, 3)]);
    // As the datapath does: the pick unstages, the next WQE is staged
    // after the previous one ran. The weights still hold.
    s.stage((1, 0), send(1000), now);
    s.stage((2, 0), send(1000), now);
    let mut served: HashMap<DeviceId, u64> = HashMap::new();
    for _ in 0..40_000 {
        let Pick::Run(q) = s.pick(now) else {
            panic!("backlogged");
        };
        *served.entry(q.0).or_default() += 1000;
        s.stage(q, send(1000), now);
    }
    let ratio = served[&2] as f64 / served[&1] as f64;
    assert!((ratio - 3.0).abs() < 0.1, "1:3 gave 1:{ratio:.3}");
}

#[test]
fn a_burst_is_charged_like_the_picks_it_replaces() {
    let now = Instant::now();
    let mut s = setup(&[send_limited("limited", Normal, 10, Some(4))], now);
    // 1 MB/s: the port closes after a few WQEs too.
    s.stage((1, 0), send(64), now);
    assert_eq!(s.pick(now), Pick::Run((1, 0)));
    let mut budget = s.budget((1, 0), now, u64::MAX);
    assert_eq!(
        admitted(&mut budget, send(64), now),
        3,
        "the bucket held 4 operations"
    );
    s.spend(&budget, now);
    s.stage((1, 0), send(64), now);
    assert!(
        matches!(s.pick(now), Pick::Wait(Some(_))),
        "the tokens are spent"
    );
    assert!(s.throttled("limited", now + Duration::from_millis(1))[0] > Duration::ZERO);
}

#[test]
fn a_class_is_outranked_while_a_higher_one_was_busy_lately() {
    let now = Instant::now();
    let mut s = classes(now, &[(Normal, 1), (Realtime, 1)]);
    assert!(!s.outranked(2, now));
    s.stage((2, 0), send(64), now);
    assert_eq!(s.pick(now), Pick::Run((2, 0)));
    assert!(s.outranked(2, now), "normal is outranked by realtime");
    assert!(!s.outranked(0, now), "nothing outranks realtime");
    assert!(!s.outranked(2, now + BUSY_FOR), "realtime went quiet");
}

#[test]
fn a_class_books_far_ahead_only_while_no_higher_class_is_busy() {
    let start = Instant::now();
    let (realtime, normal) = (0, 2);
    // 1 MB/s: a quantum is 65.5 ms on the wire.
    let mut link = Link::new(1_000_000);
    let quantum = link.wire(QUANTUM);
    // Alone, the normal class books two quanta ahead, not three.
    for _ in 0..2 {
        assert!(link.open(normal, start));
        link.book(normal, QUANTUM, start);
    }
    assert!(link.open(normal, start), "exactly two quanta booked");
    link.book(normal, QUANTUM, start);
    assert!(!link.open(normal, start));
    assert_eq!(link.opens_at(normal, start), start + quantum);
    // Realtime books: it goes at once, and from then on the normal
    // class may book only the short backlog ahead.
    assert!(link.open(realtime, start));
    link.book(realtime, 1000, start);
    let busy = start + 3 * quantum + Duration::from_millis(1);
    assert_eq!(link.opens_at(normal, start), busy - Link::BACKLOG);
    // Once realtime has been quiet for BUSY_FOR, the long one again.
    let later = start + BUSY_FOR;
    assert_eq!(link.opens_at(normal, later), busy - 2 * quantum);
}
