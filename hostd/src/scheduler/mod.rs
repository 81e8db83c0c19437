//! Which physical QP's next WQE the datapath runs next.
//!
//! The datapath stages the head WQE of every physical QP (pQP) that has
//! work (one per pQP: the next WQE of one of the virtual QPs multiplexed
//! onto it) and tells the scheduler its [`Head`]: kind and bytes.
//! [`Scheduler::pick`] then chooses which staged WQE runs next:
//!
//! 1. **Eligibility.** A staged WQE is admissible when its tenant's token
//!    buckets for its kind hold enough tokens (`rate.send` for SEND / RDMA
//!    WRITE / WRITE_WITH_IMM, `rate.read` for RDMA READ and atomics: one
//!    operation, and `min(bytes, burst)` bytes).
//! 2. **Strict priority.** The highest class with an eligible tenant is
//!    served (realtime, then priority, then normal).
//! 3. **Weighted fair sharing** inside the class: deficit round robin over
//!    bytes. A tenant at the head of its class's ring earns `weight ×
//!    QUANTUM` once per turn and is served while its deficit covers the
//!    cost of its next WQE (byte length, at least [`MIN_COST`]); then the
//!    ring moves on. A tenant without eligible work loses its deficit (it
//!    cannot hoard a share while idle or throttled). Inside a tenant, its
//!    pQPs take turns.
//! 4. **The port.** With a line rate configured ([`Link`]), a class may only
//!    run work while the port is not booked too far ahead by work of that
//!    class or a higher one: the link, not the host's CPU, is then the
//!    resource the classes and weights divide.
//!
//! Only tenants with staged work are in the class rings, so a pick costs
//! what the tenants with work cost, not what the host has; and
//! [`Scheduler::budget`] lets the tenant just served go on without a
//! new pick while nothing would have chosen otherwise.
//!
//! When nothing is admissible, [`Pick::Wait`] says when the earliest token
//! bucket (or the port) will allow some, so the datapath sleeps until then
//! instead of spinning. The time a tenant had work of a kind that no bucket
//! allowed is counted as throttled time. Every decision takes `now` from
//! the caller, so tests drive the scheduler with a simulated clock.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use vrdma_tenant_policy::{PriorityClass, RateLimit, TenantPolicy};

use crate::engine::DeviceId;
use crate::ids::IdMap;

/// Bytes a tenant of weight 1 may send per deficit-round-robin turn.
pub const QUANTUM: u64 = 64 * 1024;
/// Smallest cost of one WQE in the fair-share accounting: per-operation
/// work of the NIC (descriptor fetch, headers, completion) that a
/// zero-byte message costs too.
pub const MIN_COST: u64 = 256;
/// How long after it last had work a class counts as busy: a lower class
/// then books the port only a short way ahead, and moves its long
/// messages in segments so the busy class gets in between.
pub const BUSY_FOR: Duration = Duration::from_millis(10);
/// Most WQEs a tenant runs after a pick ([`Scheduler::budget`]).
pub const BURST: u32 = 32;

/// The rate-limit kinds of send-side work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// SEND, SEND_WITH_IMM, RDMA WRITE, WRITE_WITH_IMM (`rate.send`).
    Send = 0,
    /// RDMA READ and atomics (`rate.read`).
    Read = 1,
}

impl OpKind {
    /// Both kinds, in index order.
    pub const ALL: [OpKind; 2] = [OpKind::Send, OpKind::Read];

    /// The label of this kind in stats and metrics.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::Read => "read",
        }
    }
}

/// What the scheduler needs to know about a staged WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub kind: OpKind,
    /// Bytes the WQE moves (its SGEs, or its inline data; 8 for atomics).
    pub bytes: u64,
}

impl Head {
    /// Its cost in the fair-share accounting.
    pub fn cost(&self) -> u64 {
        self.bytes.max(MIN_COST)
    }
}

/// A physical QP of a device.
pub type QueueId = (DeviceId, u32);

/// The scheduler's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Run the staged WQE of this pQP (it is no longer staged).
    Run(QueueId),
    /// Staged work exists but none may go now; the earliest time a token
    /// bucket or the port allows some.
    Wait(Option<Instant>),
    /// Nothing is staged.
    Idle,
}

/// Class indices, highest priority first.
const CLASSES: usize = 3;

fn class_index(class: PriorityClass) -> usize {
    match class {
        PriorityClass::Realtime => 0,
        PriorityClass::Priority => 1,
        PriorityClass::Normal => 2,
    }
}

/// The scheduler's view of one tenant.
#[derive(Debug, Clone)]
struct TenantState {
    class: usize,
    weight: u32,
    limiters: [Limiter; 2],
    /// Deficit round robin: bytes it may still send this turn.
    deficit: u64,
    /// It earned its quantum for the current turn.
    visited: bool,
    /// Its staged pQPs, in turn order.
    staged: VecDeque<QueueId>,
    /// In its class's ring (it has staged work).
    in_ring: bool,
    throttled_since: [Option<Instant>; 2],
    throttled: [Duration; 2],
}

impl TenantState {
    fn quantum(&self) -> u64 {
        u64::from(self.weight.max(1)) * QUANTUM
    }

    fn end_throttling(&mut self, kind: usize, now: Instant) {
        if let Some(since) = self.throttled_since[kind].take() {
            self.throttled[kind] += now.saturating_duration_since(since);
        }
    }
}

/// The scheduler: tenants, their devices, and the staged WQEs.
#[derive(Debug)]
pub struct Scheduler {
    tenants: Vec<TenantState>,
    by_name: HashMap<String, usize>,
    devices: IdMap<DeviceId, usize>,
    /// Staged heads and their tenant.
    heads: Heads,
    /// Tenants with staged work, per class, in deficit-round-robin order.
    rings: [VecDeque<usize>; CLASSES],
    /// When each class last had work staged or served.
    last_busy: [Option<Instant>; CLASSES],
    /// The tenant the last pick or burst served.
    last_served: Option<usize>,
    /// The latest `now` seen.
    clock: Option<Instant>,
    /// The port, when a line rate is configured.
    link: Option<Link>,
}

impl Scheduler {
    /// A scheduler with a port of `link` (`None`: unlimited).
    pub fn new(link: Option<Link>) -> Self {
        Scheduler {
            tenants: Vec::new(),
            by_name: HashMap::new(),
            devices: IdMap::default(),
            heads: Heads::default(),
            rings: Default::default(),
            last_busy: [None; CLASSES],
            last_served: None,
            clock: None,
            link,
        }
    }

    /// Creates or updates a tenant's class, weight and rates. Takes effect
    /// at the next pick; tokens held are kept (capped at new burst sizes).
    pub fn configure(&mut self, policy: &TenantPolicy, now: Instant) {
        let class = class_index(policy.priority.class);
        let index = match self.by_name.get(&policy.name) {
            Some(&i) => i,
            None => {
                self.tenants.push(TenantState {
                    class,
                    weight: 1,
                    limiters: [Limiter::default(); 2],
                    deficit: 0,
                    visited: false,
                    staged: VecDeque::new(),
                    in_ring: false,
                    throttled_since: [None; 2],
                    throttled: [Duration::ZERO; 2],
                });
                self.by_name
                    .insert(policy.name.clone(), self.tenants.len() - 1);
                self.tenants.len() - 1
            }
        };
        let Some(t) = self.tenants.get_mut(index) else {
            return;
        };
        if t.class != class {
            if t.in_ring {
                self.rings[t.class].retain(|&i| i != index);
                self.rings[class].push_back(index);
            }
            t.class = class;
            t.deficit = 0;
            t.visited = false;
        }
        t.weight = policy.priority.weight.max(1);
        t.limiters[OpKind::Send as usize].configure(&policy.rate.send, now);
        t.limiters[OpKind::Read as usize].configure(&policy.rate.read, now);
    }

    /// Whether the tenant is known.
    pub fn knows(&self, tenant: &str) -> bool {
        self.by_name.contains_key(tenant)
    }

    /// A device of a known tenant; false if the tenant is unknown.
    pub fn add_device(&mut self, device: DeviceId, tenant: &str) -> bool {
        match self.by_name.get(tenant) {
            Some(&i) => {
                self.devices.insert(device, i);
                true
            }
            None => false,
        }
    }

    /// The service rank of a device's work: its tenant's class, 0 for
    /// realtime.
    pub fn rank(&self, device: DeviceId) -> Option<u8> {
        let &tenant = self.devices.get(&device)?;
        Some(self.tenants.get(tenant)?.class as u8)
    }

    /// Whether a class above `rank` was busy within [`BUSY_FOR`] of `now`:
    /// then a long message of `rank` moves in segments.
    pub fn outranked(&self, rank: u8, now: Instant) -> bool {
        (self.last_busy.iter().take(usize::from(rank)))
            .flatten()
            .any(|&at| now.saturating_duration_since(at) < BUSY_FOR)
    }

    /// Forgets a device and its staged WQEs.
    pub fn remove_device(&mut self, device: DeviceId) {
        let queues: Vec<QueueId> = self.heads.queues().filter(|q| q.0 == device).collect();
        for q in queues {
            self.unstage(q);
        }
        self.devices.remove(&device);
    }

    /// The next WQE of `queue` is staged (replacing what was staged).
    pub fn stage(&mut self, queue: QueueId, head: Head, now: Instant) {
        let Some(&ti) = self.devices.get(&queue.0) else {
            return;
        };
        self.clock = Some(self.clock.map_or(now, |c| c.max(now)));
        if self.heads.insert(queue, ti, head) {
            return;
        }
        let Some(t) = self.tenants.get_mut(ti) else {
            return;
        };
        t.staged.push_back(queue);
        self.last_busy[t.class] = Some(now);
        if !t.in_ring {
            t.in_ring = true;
            self.rings[t.class].push_back(ti);
        }
    }

    /// Whether `queue` has a staged WQE.
    pub fn is_staged(&self, queue: QueueId) -> bool {
        self.heads.get(queue).is_some()
    }

    /// Forgets the staged WQE of `queue`. Its tenant keeps its place in
    /// its class's ring (and its deficit) until the ring comes round to it
    /// with nothing staged: the datapath usually stages the queue's next
    /// WQE right away, and a tenant must not lose its turn in between.
    pub fn unstage(&mut self, queue: QueueId) {
        let Some((ti, _)) = self.heads.remove(queue) else {
            return;
        };
        if let Some(t) = self.tenants.get_mut(ti) {
            t.staged.retain(|&q| q != queue);
        }
    }

    /// Takes tenant `ti`, which has nothing staged, out of its ring.
    fn leave_ring(&mut self, ti: usize, now: Instant) {
        if let Some(class) = self.out_of_ring(ti, now) {
            self.rings[class].retain(|&i| i != ti);
        }
    }

    /// Tenant `ti` left its ring: no share saved up, no throttling going
    /// on. Returns its class.
    fn out_of_ring(&mut self, ti: usize, now: Instant) -> Option<usize> {
        let t = self.tenants.get_mut(ti)?;
        t.in_ring = false;
        t.deficit = 0;
        t.visited = false;
        for k in 0..2 {
            t.end_throttling(k, now);
        }
        Some(t.class)
    }

    /// Time the tenant spent throttled so far, per [`OpKind`].
    pub fn throttled(&self, tenant: &str, now: Instant) -> [Duration; 2] {
        let Some(t) = self.by_name.get(tenant).and_then(|&i| self.tenants.get(i)) else {
            return [Duration::ZERO; 2];
        };
        let mut out = t.throttled;
        for (k, since) in t.throttled_since.iter().enumerate() {
            if let Some(since) = since {
                out[k] += now.saturating_duration_since(*since);
            }
        }
        out
    }

    /// Whether any work is staged.
    pub fn has_work(&self) -> bool {
        !self.heads.is_empty()
    }

    /// Chooses the staged WQE to run next and charges its tenant's token
    /// buckets, deficit and the port; the WQE is no longer staged.
    pub fn pick(&mut self, now: Instant) -> Pick {
        self.clock = Some(self.clock.map_or(now, |c| c.max(now)));
        if self.heads.is_empty() {
            // Idle: whoever is still in a ring has nothing staged.
            for class in 0..CLASSES {
                while let Some(ti) = self.rings[class].pop_front() {
                    self.out_of_ring(ti, now);
                }
            }
            return Pick::Idle;
        }
        let mut wait: Option<Instant> = None;
        let mut earliest = |at: Instant| wait = Some(wait.map_or(at, |w: Instant| w.min(at)));
        for class in 0..CLASSES {
            if self.rings[class].is_empty() {
                continue;
            }
            if let Some(link) = &self.link {
                if !link.open(class, now) {
                    earliest(link.opens_at(class, now));
                    continue;
                }
            }
            if let Some(queue) = self.serve_class(class, now, &mut earliest) {
                return Pick::Run(queue);
            }
        }
        Pick::Wait(wait)
    }

    /// What `queue`'s tenant, just served by a pick, may run right away
    /// without another pick, `bytes` at most: while its deficit covers its
    /// WQEs, its buckets allow them, its class's port is open and no
    /// higher class has work — what picks would give it now. A tenant
    /// alone with work in its class, with no higher class busy lately, is
    /// not held to its deficit: every pick would choose it again. [`Budget::admit`] takes from it WQE by
    /// WQE; [`Scheduler::spend`] charges what was used.
    pub fn budget(&self, queue: QueueId, now: Instant, bytes: u64) -> Budget {
        let tenant = self
            .devices
            .get(&queue.0)
            .copied()
            .filter(|&ti| self.last_served == Some(ti));
        let Some((ti, t)) = tenant.and_then(|ti| Some((ti, self.tenants.get(ti)?))) else {
            return Budget::default();
        };
        if self.heads_above(t.class) {
            return Budget::default();
        }
        // Alone: nobody else of its class has work, and no higher class
        // was busy lately (whose next WQE must not find a long burst of
        // this one in its way).
        let alone = !self.outranked(t.class as u8, now)
            && (self.rings[t.class].iter())
                .all(|&i| i == ti || self.tenants.get(i).is_none_or(|o| o.staged.is_empty()));
        Budget {
            tenant: Some(ti),
            ops: BURST - 1,
            bytes,
            alone,
            deficit: if alone { u64::MAX } else { t.deficit },
            limiters: t.limiters,
            port: self
                .link
                .as_ref()
                .map_or(u64::MAX, |l| l.room(t.class, now)),
            ..Budget::default()
        }
    }

    /// Charges what a burst took from `budget` (see [`Scheduler::budget`]).
    pub fn spend(&mut self, budget: &Budget, now: Instant) {
        let Some(ti) = budget.tenant.filter(|_| budget.used > 0) else {
            return;
        };
        let Some(t) = self.tenants.get_mut(ti) else {
            return;
        };
        if !budget.alone {
            t.deficit = budget.deficit;
        }
        t.limiters = budget.limiters;
        for k in 0..2 {
            if budget.kinds & (1 << k) != 0 {
                t.end_throttling(k, now);
            }
        }
        let class = t.class;
        self.last_busy[class] = Some(now);
        if let Some(link) = &mut self.link {
            link.book(class, budget.cost, now);
        }
    }

    /// Whether a tenant of a class above `class` has work staged.
    fn heads_above(&self, class: usize) -> bool {
        (self.rings[..class].iter().flatten())
            .any(|&i| self.tenants.get(i).is_some_and(|t| !t.staged.is_empty()))
    }

    /// Charges tenant `ti` for running a WQE of `head`.
    fn charge(&mut self, ti: usize, head: Head, now: Instant) {
        let Some(t) = self.tenants.get_mut(ti) else {
            return;
        };
        t.deficit -= head.cost().min(t.deficit);
        t.limiters[head.kind as usize].take(head.bytes);
        t.end_throttling(head.kind as usize, now);
        let class = t.class;
        self.last_busy[class] = Some(now);
        self.last_served = Some(ti);
        if let Some(link) = &mut self.link {
            link.book(class, head.cost(), now);
        }
    }

    /// Takes tenant `ti`'s staged `queue` (at the front of its staged
    /// pQPs) to run now: its pQPs take turns, so it would go to the back
    /// when staged again.
    fn take_front(&mut self, ti: usize, queue: QueueId) {
        self.heads.remove(queue);
        if let Some(t) = self.tenants.get_mut(ti) {
            if t.staged.front() == Some(&queue) {
                t.staged.pop_front();
            } else {
                t.staged.retain(|&q| q != queue);
            }
        }
    }

    /// Deficit round robin among the eligible tenants of one class.
    fn serve_class(
        &mut self,
        class: usize,
        now: Instant,
        earliest: &mut impl FnMut(Instant),
    ) -> Option<QueueId> {
        for pass in 0..2 {
            let mut eligible = false;
            let mut visits = self.rings[class].len();
            while visits > 0 {
                visits -= 1;
                let &ti = self.rings[class].front()?;
                let Some(t) = self.tenants.get_mut(ti) else {
                    self.rings[class].rotate_left(1);
                    continue;
                };
                if t.staged.is_empty() {
                    // Nothing staged any more: out of the ring, no share
                    // saved up.
                    self.leave_ring(ti, now);
                    continue;
                }
                // Its first staged queue whose bucket allows its head (a
                // throttled READ does not hold its SENDs back).
                let mut ready = None;
                for (i, &queue) in t.staged.iter().enumerate() {
                    let Some((_, head)) = self.heads.get(queue) else {
                        continue;
                    };
                    let k = head.kind as usize;
                    let limiter = &mut t.limiters[k];
                    limiter.refill(now);
                    if limiter.ready(head.bytes) {
                        ready = Some((i, queue, head));
                        break;
                    }
                    if let Some(at) = limiter.ready_at(head.bytes, now) {
                        earliest(at);
                    }
                    t.throttled_since[k].get_or_insert(now);
                }
                let Some((i, queue, head)) = ready else {
                    // Throttled: no share saved up meanwhile.
                    t.deficit = 0;
                    t.visited = false;
                    self.rings[class].rotate_left(1);
                    continue;
                };
                t.staged.rotate_left(i);
                eligible = true;
                if !t.visited {
                    t.deficit = t.deficit.saturating_add(t.quantum());
                    t.visited = true;
                }
                if head.cost() <= t.deficit {
                    self.charge(ti, head, now);
                    self.take_front(ti, queue);
                    return Some(queue);
                }
                t.visited = false;
                self.rings[class].rotate_left(1);
            }
            if !eligible {
                return None;
            }
            if pass == 0 {
                self.skip_empty_turns(class);
            }
        }
        None
    }

    /// Nobody's deficit covers its next WQE (a message of many quanta):
    /// credits every tenant of the class the turns in which nothing would
    /// be sent, instead of spinning through them.
    fn skip_empty_turns(&mut self, class: usize) {
        let cost_left = |t: &TenantState, heads: &Heads| {
            let queue = t.staged.front()?;
            let (_, head) = heads.get(*queue)?;
            Some(head.cost().saturating_sub(t.deficit).div_ceil(t.quantum()))
        };
        let turns = (self.rings[class].iter())
            .filter_map(|&i| cost_left(self.tenants.get(i)?, &self.heads))
            .min()
            .unwrap_or(1)
            .max(1);
        for &i in &self.rings[class] {
            if let Some(t) = self.tenants.get_mut(i) {
                t.deficit = t.deficit.saturating_add((turns - 1) * t.quantum());
            }
        }
    }
}

/// What a tenant may run after a pick without another one.
#[derive(Debug, Clone, Default)]
pub struct Budget {
    tenant: Option<usize>,
    /// WQEs left.
    ops: u32,
    /// Bytes left.
    bytes: u64,
    /// No other tenant of its class has work: its deficit does not bound
    /// it (and is left as it was).
    alone: bool,
    /// Its deficit left.
    deficit: u64,
    /// Its buckets as the burst leaves them.
    limiters: [Limiter; 2],
    /// Bytes the port takes before it closes for the class.
    port: u64,
    /// WQEs admitted, their total cost, and the kinds among them.
    used: u32,
    cost: u64,
    kinds: u8,
}

impl Budget {
    /// Takes one WQE of `head` from the budget; false (and nothing taken)
    /// if a pick would not let it run now.
    pub fn admit(&mut self, head: &Head, now: Instant) -> bool {
        let cost = head.cost();
        if self.tenant.is_none()
            || self.ops == 0
            || cost > self.deficit
            || head.bytes > self.bytes
            || self.port == 0
        {
            return false;
        }
        let limiter = &mut self.limiters[head.kind as usize];
        limiter.refill(now);
        if !limiter.ready(head.bytes) {
            return false;
        }
        limiter.take(head.bytes);
        self.ops -= 1;
        self.bytes -= head.bytes;
        self.deficit -= cost;
        self.port = self.port.saturating_sub(cost);
        self.used += 1;
        self.cost += cost;
        self.kinds |= 1 << head.kind as u8;
        true
    }
}

/// The staged heads and their tenants.
#[derive(Debug, Default)]
struct Heads(IdMap<QueueId, (usize, Head)>);

impl Heads {
    fn get(&self, queue: QueueId) -> Option<(usize, Head)> {
        self.0.get(&queue).copied()
    }

    /// Stages `head` for `queue`; true if the queue had one staged already.
    fn insert(&mut self, queue: QueueId, ti: usize, head: Head) -> bool {
        self.0.insert(queue, (ti, head)).is_some()
    }

    fn remove(&mut self, queue: QueueId) -> Option<(usize, Head)> {
        self.0.remove(&queue)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn queues(&self) -> impl Iterator<Item = QueueId> + '_ {
        self.0.keys().copied()
    }
}

// Rates: the tenants' token buckets and the NIC's port.

/// Token buckets hold tokens × `SCALE` (tokens per nanosecond are fractions).
const SCALE: i128 = 1_000_000_000;

/// A token bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bucket {
    /// Tokens per second.
    rate: u64,
    /// Bucket size in tokens.
    burst: u64,
    /// Tokens × SCALE; negative after a message larger than the burst.
    tokens: i128,
    last: Instant,
}

impl Bucket {
    fn new(rate: u64, burst: u64, now: Instant) -> Self {
        let burst = burst.max(1);
        Bucket {
            rate,
            burst,
            tokens: i128::from(burst) * SCALE,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        // Datapath threads read the clock before taking the lock, so `now`
        // may lag `last` a little: never refill backwards.
        if now <= self.last {
            return;
        }
        let ns = i128::try_from((now - self.last).as_nanos()).unwrap_or(i128::MAX / 4);
        let full = i128::from(self.burst) * SCALE;
        self.tokens = self
            .tokens
            .saturating_add(ns.saturating_mul(i128::from(self.rate)))
            .min(full);
        self.last = now;
    }

    /// Tokens a WQE of `amount` needs before it may go: a message larger
    /// than the bucket goes when the bucket is full (and leaves it in debt).
    fn need(&self, amount: u64) -> i128 {
        i128::from(amount.min(self.burst)) * SCALE
    }

    fn ready(&self, amount: u64) -> bool {
        self.tokens >= self.need(amount)
    }

    /// When the bucket will hold enough for `amount`.
    fn ready_at(&self, amount: u64) -> Option<Instant> {
        let missing = self.need(amount) - self.tokens;
        if missing <= 0 {
            return Some(self.last);
        }
        if self.rate == 0 {
            return None;
        }
        let rate = i128::from(self.rate);
        let ns = (missing + rate - 1) / rate;
        let ns = u64::try_from(ns).ok()?;
        self.last.checked_add(Duration::from_nanos(ns))
    }

    fn take(&mut self, amount: u64) {
        self.tokens = self
            .tokens
            .saturating_sub(i128::from(amount).saturating_mul(SCALE));
    }

    /// New parameters; the tokens held are kept, capped at the new size.
    fn reconfigure(&mut self, rate: u64, burst: u64, now: Instant) {
        self.refill(now);
        self.rate = rate;
        self.burst = burst.max(1);
        self.tokens = self.tokens.min(i128::from(self.burst) * SCALE);
    }
}

/// The buckets of one kind: operations and bytes, each optional.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limiter {
    ops: Option<Bucket>,
    bytes: Option<Bucket>,
}

impl Limiter {
    pub fn configure(&mut self, limit: &RateLimit, now: Instant) {
        let effective = limit.effective();
        for (slot, wanted) in [
            (&mut self.ops, effective.ops),
            (&mut self.bytes, effective.bytes),
        ] {
            *slot = match (slot.take(), wanted) {
                (Some(mut bucket), Some((rate, burst))) => {
                    bucket.reconfigure(rate, burst, now);
                    Some(bucket)
                }
                (None, Some((rate, burst))) => Some(Bucket::new(rate, burst, now)),
                (_, None) => None,
            };
        }
    }

    pub fn refill(&mut self, now: Instant) {
        for bucket in [&mut self.ops, &mut self.bytes].into_iter().flatten() {
            bucket.refill(now);
        }
    }

    pub fn ready(&self, bytes: u64) -> bool {
        self.ops.is_none_or(|b| b.ready(1)) && self.bytes.is_none_or(|b| b.ready(bytes))
    }

    /// When both buckets will allow a WQE of `bytes` (`None`: never).
    pub fn ready_at(&self, bytes: u64, now: Instant) -> Option<Instant> {
        let mut at = now;
        if let Some(b) = &self.ops {
            at = at.max(b.ready_at(1)?);
        }
        if let Some(b) = &self.bytes {
            at = at.max(b.ready_at(bytes)?);
        }
        Some(at)
    }

    pub fn take(&mut self, bytes: u64) {
        if let Some(b) = &mut self.ops {
            b.take(1);
        }
        if let Some(b) = &mut self.bytes {
            b.take(bytes);
        }
    }
}

/// The NIC's port: the rate at which it puts bytes on the wire.
///
/// A real NIC's transmit arbiter works in packets, so a message of a higher
/// class overtakes a lower class's long message at the next packet boundary
/// instead of waiting for all of it. The model books the port per class:
/// `busy_until[c]` is when the port has sent everything admitted of class
/// `c` or higher. Admitting work of class `c` books the port for its wire
/// time in `c` and every lower class (they wait behind it), never in a
/// higher one. Without a configured line rate the port is never the
/// bottleneck (the host's memory bandwidth is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    /// Bytes per second on the wire.
    rate: u64,
    /// Per class index (realtime first).
    pub(super) busy_until: [Option<Instant>; 3],
    /// When each class index last booked the port.
    last_booked: [Option<Instant>; 3],
}

impl Link {
    /// Work a class may admit ahead of the wire while a higher class is
    /// busy: enough to keep the port busy across a datapath thread that
    /// comes back a little late, small enough that the lower class cannot
    /// book the port far ahead of the higher one.
    pub const BACKLOG: Duration = Duration::from_micros(20);
    /// Work a class may admit ahead of the wire while no higher class has
    /// booked the port within [`BUSY_FOR`]: two quanta. On a slow port
    /// that is milliseconds, which keeps the port busy across a datapath
    /// thread that a loaded host wakes late (at 500 Mbit/s and 20 µs, two
    /// busy loops beside it left the port 54 % idle); a higher class that
    /// shows up finds at most this much work ahead of it in the NIC, and
    /// from then on the short backlog holds.
    pub const IDLE_BACKLOG_BYTES: u64 = 2 * QUANTUM;

    /// A port sending `rate` bytes per second.
    pub fn new(rate: u64) -> Self {
        Link {
            rate: rate.max(1),
            busy_until: [None; 3],
            last_booked: [None; 3],
        }
    }

    /// The wire time of `bytes`.
    pub(super) fn wire(&self, bytes: u64) -> Duration {
        let ns = u128::from(bytes) * 1_000_000_000 / u128::from(self.rate);
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// How far ahead of the wire class index `class` may book at `now`.
    fn backlog(&self, class: usize, now: Instant) -> Duration {
        let higher_busy = self.last_booked[..class.min(3)]
            .iter()
            .flatten()
            .any(|&at| now.saturating_duration_since(at) < BUSY_FOR);
        if higher_busy {
            Self::BACKLOG
        } else {
            Self::BACKLOG.max(self.wire(Self::IDLE_BACKLOG_BYTES))
        }
    }

    /// Whether work of class index `class` may enter the NIC at `now`.
    pub(super) fn open(&self, class: usize, now: Instant) -> bool {
        self.busy_until
            .get(class)
            .copied()
            .flatten()
            .is_none_or(|busy| busy <= now + self.backlog(class, now))
    }

    /// When work of class index `class` may enter next.
    pub(super) fn opens_at(&self, class: usize, now: Instant) -> Instant {
        match self.busy_until.get(class).copied().flatten() {
            Some(busy) => busy.checked_sub(self.backlog(class, now)).unwrap_or(busy),
            None => now,
        }
    }

    /// Bytes of class index `class` the port takes at `now` before it
    /// closes for the class (`u64::MAX` when nothing is booked).
    pub(super) fn room(&self, class: usize, now: Instant) -> u64 {
        let Some(busy) = self.busy_until.get(class).copied().flatten() else {
            return u64::MAX;
        };
        let ahead = (now + self.backlog(class, now)).saturating_duration_since(busy);
        let bytes = ahead.as_nanos() * u128::from(self.rate) / 1_000_000_000;
        u64::try_from(bytes).unwrap_or(u64::MAX)
    }

    /// Books the wire time of `bytes` of class index `class`.
    pub(super) fn book(&mut self, class: usize, bytes: u64, now: Instant) {
        let wire = self.wire(bytes);
        for busy in self.busy_until.iter_mut().skip(class) {
            let from = busy.map_or(now, |b| b.max(now));
            *busy = Some(from.checked_add(wire).unwrap_or(from));
        }
        if let Some(at) = self.last_booked.get_mut(class) {
            *at = Some(now);
        }
    }
}

#[cfg(test)]
mod tests;
