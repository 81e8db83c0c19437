//! Which device's physical QP the datapath drains next.
//!
//! The datapath stages the next send-side WQE of every physical QP (pQP) it
//! serves (one entry per pQP, popped from the ring and held by hostd) and
//! tells the scheduler its [`Head`]: kind and byte length. [`Scheduler::pick`]
//! then chooses which staged WQE enters the NIC next:
//!
//! 1. **Eligibility.** A staged WQE is admissible when its tenant's token
//!    buckets for its kind hold enough tokens (`rate.send` for SEND / RDMA
//!    WRITE / WRITE_WITH_IMM, `rate.read` for RDMA READ and atomics: one
//!    operation, and `min(bytes, burst)` bytes) and its device may take a
//!    credit (fewer than `per_device` send WQEs inside the NIC, and the NIC
//!    as a whole below its class's share of the global pool). A tenant is
//!    eligible when one of its staged WQEs is.
//! 2. **Strict priority.** The highest class with an eligible tenant is
//!    served (realtime, then priority, then normal).
//! 3. **Weighted fair sharing** inside the class: deficit round robin over
//!    bytes. A tenant at the head of its class's ring earns `weight × QUANTUM`
//!    once per turn and is served while its deficit covers the cost of its
//!    next WQE (byte length, at least [`MIN_COST`]); then the ring moves on.
//!    An ineligible tenant loses its deficit (it cannot hoard a share while
//!    idle or throttled). Inside a tenant, its pQPs take turns.
//!
//! Receive WQEs never reach the scheduler: the datapath posts them as it
//! pops them (they are not rate limited and cost the NIC nothing until a
//! message consumes them). Every decision takes `now` from the caller, so
//! tests drive the scheduler with a simulated clock.
//!
//! 4. **The port.** With a line rate configured ([`Link`]), a class may only
//!    put work into the NIC while the port is not booked too far ahead by
//!    work of that class or a higher one: the link, not the host's CPU, is
//!    then the resource the classes and weights divide.
//!
//! When nothing is admissible, [`Pick::Wait`] says when the earliest token
//! bucket (or the port) will allow some, so the datapath sleeps until then instead of
//! spinning. The time a tenant had work of a kind that no bucket allowed is
//! counted as throttled time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use vrdma_tenant_policy::{PriorityClass, RateLimit, TenantPolicy};

use crate::ids::IdMap;
use crate::nic::soft::BUSY_FOR;
use crate::nic::DeviceId;

/// Bytes a tenant of weight 1 may send per deficit-round-robin turn.
pub const QUANTUM: u64 = 64 * 1024;
/// Smallest cost of one WQE in the fair-share accounting: per-operation
/// work of the NIC (descriptor fetch, headers, completion) that a
/// zero-byte message costs too.
pub const MIN_COST: u64 = 256;
/// Default credits of one device: send WQEs it may have inside the NIC.
pub const DEFAULT_DEVICE_CREDITS: u32 = 256;
/// Default credits of the whole NIC.
pub const DEFAULT_TOTAL_CREDITS: u32 = 4096;

/// Token buckets hold tokens × `SCALE` (tokens per nanosecond are fractions).
const SCALE: i128 = 1_000_000_000;

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

/// Send WQEs inside the NIC, which is what credits bound.
pub trait CreditView {
    /// Send WQEs of `device` inside the NIC.
    fn device(&self, device: DeviceId) -> usize;
    /// Send WQEs of every device inside the NIC.
    fn total(&self) -> usize;
}

/// The credit pool: per device, and for the whole NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credits {
    pub per_device: usize,
    pub total: usize,
}

impl Credits {
    /// The part of the global pool a class may fill: normal-class devices
    /// are refused credits once half of it is in use, priority at three
    /// quarters, realtime only when it is exhausted. So under congestion a
    /// flood of normal work cannot starve realtime work of credits.
    pub fn class_limit(&self, class: PriorityClass) -> usize {
        let limit = match class {
            PriorityClass::Realtime => self.total,
            PriorityClass::Priority => self.total / 4 * 3,
            PriorityClass::Normal => self.total / 2,
        };
        limit.max(1)
    }

    /// Whether a device of `class` with `device_in_flight` send WQEs in the
    /// NIC may add one more while the NIC holds `total_in_flight`.
    pub fn grant(
        &self,
        class: PriorityClass,
        device_in_flight: usize,
        total_in_flight: usize,
    ) -> bool {
        device_in_flight < self.per_device && total_in_flight < self.class_limit(class)
    }
}

impl Default for Credits {
    fn default() -> Self {
        Credits {
            per_device: DEFAULT_DEVICE_CREDITS as usize,
            total: DEFAULT_TOTAL_CREDITS as usize,
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
    busy_until: [Option<Instant>; 3],
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
    fn wire(&self, bytes: u64) -> Duration {
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
    fn open(&self, class: usize, now: Instant) -> bool {
        self.busy_until
            .get(class)
            .copied()
            .flatten()
            .is_none_or(|busy| busy <= now + self.backlog(class, now))
    }

    /// When work of class index `class` may enter next.
    fn opens_at(&self, class: usize, now: Instant) -> Instant {
        match self.busy_until.get(class).copied().flatten() {
            Some(busy) => busy.checked_sub(self.backlog(class, now)).unwrap_or(busy),
            None => now,
        }
    }

    /// Books the wire time of `bytes` of class index `class`.
    fn book(&mut self, class: usize, bytes: u64, now: Instant) {
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
struct Limiter {
    ops: Option<Bucket>,
    bytes: Option<Bucket>,
}

impl Limiter {
    fn configure(&mut self, limit: &RateLimit, now: Instant) {
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

    fn refill(&mut self, now: Instant) {
        for bucket in [&mut self.ops, &mut self.bytes].into_iter().flatten() {
            bucket.refill(now);
        }
    }

    fn ready(&self, bytes: u64) -> bool {
        self.ops.is_none_or(|b| b.ready(1)) && self.bytes.is_none_or(|b| b.ready(bytes))
    }

    /// When both buckets will allow a WQE of `bytes` (`None`: never).
    fn ready_at(&self, bytes: u64, now: Instant) -> Option<Instant> {
        let mut at = now;
        if let Some(b) = &self.ops {
            at = at.max(b.ready_at(1)?);
        }
        if let Some(b) = &self.bytes {
            at = at.max(b.ready_at(bytes)?);
        }
        Some(at)
    }

    fn take(&mut self, bytes: u64) {
        if let Some(b) = &mut self.ops {
            b.take(1);
        }
        if let Some(b) = &mut self.bytes {
            b.take(bytes);
        }
    }
}

/// The scheduler's view of one tenant.
#[derive(Debug, Clone)]
struct TenantState {
    class: PriorityClass,
    weight: u32,
    limiters: [Limiter; 2],
    /// Deficit round robin: bytes it may still send this turn.
    deficit: u64,
    /// It earned its quantum for the current turn.
    visited: bool,
    /// The pQP served last, so that its pQPs take turns.
    cursor: Option<QueueId>,
    throttled_since: [Option<Instant>; 2],
    throttled: [Duration; 2],
}

impl TenantState {
    fn quantum(&self) -> u64 {
        u64::from(self.weight.max(1)) * QUANTUM
    }
}

/// What one pick found out about a tenant.
#[derive(Debug, Clone, Copy, Default)]
struct View {
    /// The admissible staged WQE to serve next: the first after the cursor,
    /// else the first.
    next: Option<(QueueId, u64)>,
    first: Option<(QueueId, u64)>,
    /// It has staged work of the kind / some of it has tokens.
    has: [bool; 2],
    ready: [bool; 2],
}

/// The scheduler's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Post the staged WQE of this pQP into the NIC.
    Run(QueueId),
    /// Staged work exists but none may go now; the earliest time a token
    /// bucket allows some (`None`: only credits hold it back, which
    /// completions give back).
    Wait(Option<Instant>),
    /// Nothing is staged.
    Idle,
}

const CLASSES: [PriorityClass; 3] = [
    PriorityClass::Realtime,
    PriorityClass::Priority,
    PriorityClass::Normal,
];

fn class_index(class: PriorityClass) -> usize {
    match class {
        PriorityClass::Realtime => 0,
        PriorityClass::Priority => 1,
        PriorityClass::Normal => 2,
    }
}

/// The scheduler: tenants, their devices, and the staged WQEs.
#[derive(Debug)]
pub struct Scheduler {
    credits: Credits,
    tenants: Vec<TenantState>,
    by_name: HashMap<String, usize>,
    devices: IdMap<DeviceId, usize>,
    /// Staged WQEs: their tenant's index and head.
    heads: BTreeMap<QueueId, (usize, Head)>,
    /// Tenants of each class in deficit-round-robin order.
    rings: [VecDeque<usize>; 3],
    views: Vec<View>,
    /// The port, when a line rate is configured.
    link: Option<Link>,
}

/// The admissible WQE a tenant would send next, from its view.
fn candidate(views: &[View], tenant: usize) -> Option<(QueueId, u64)> {
    views.get(tenant).and_then(|v| v.next.or(v.first))
}

impl Scheduler {
    /// A scheduler handing out `credits`, with a port of `link` (`None`:
    /// unlimited).
    pub fn new(credits: Credits, link: Option<Link>) -> Self {
        Scheduler {
            link,
            credits,
            tenants: Vec::new(),
            by_name: HashMap::new(),
            devices: IdMap::default(),
            heads: BTreeMap::new(),
            rings: Default::default(),
            views: Vec::new(),
        }
    }

    /// The credit pool.
    pub fn credits(&self) -> Credits {
        self.credits
    }

    /// Creates or updates a tenant's class, weight and rates. Takes effect
    /// at the next pick; tokens held are kept (capped at new burst sizes).
    pub fn configure(&mut self, policy: &TenantPolicy, now: Instant) {
        let index = match self.by_name.get(&policy.name) {
            Some(&i) => i,
            None => {
                let i = self.tenants.len();
                self.tenants.push(TenantState {
                    class: policy.priority.class,
                    weight: 1,
                    limiters: [Limiter::default(); 2],
                    deficit: 0,
                    visited: false,
                    cursor: None,
                    throttled_since: [None; 2],
                    throttled: [Duration::ZERO; 2],
                });
                self.by_name.insert(policy.name.clone(), i);
                self.rings[class_index(policy.priority.class)].push_back(i);
                self.views.push(View::default());
                i
            }
        };
        let Some(t) = self.tenants.get_mut(index) else {
            return;
        };
        if t.class != policy.priority.class {
            self.rings[class_index(t.class)].retain(|&i| i != index);
            self.rings[class_index(policy.priority.class)].push_back(index);
            t.class = policy.priority.class;
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
    /// realtime (what the NIC's arbiter orders by, [`crate::nic::Nic::set_rank`]).
    pub fn rank(&self, device: DeviceId) -> Option<u8> {
        let &tenant = self.devices.get(&device)?;
        let class = self.tenants.get(tenant)?.class;
        Some(class_index(class) as u8)
    }

    /// Forgets a device and its staged WQEs.
    pub fn remove_device(&mut self, device: DeviceId) {
        self.devices.remove(&device);
        self.heads.retain(|q, _| q.0 != device);
    }

    /// The next WQE of `queue` is staged.
    pub fn stage(&mut self, queue: QueueId, head: Head) {
        if let Some(&tenant) = self.devices.get(&queue.0) {
            self.heads.insert(queue, (tenant, head));
        }
    }

    /// Whether `queue` has a staged WQE.
    pub fn is_staged(&self, queue: QueueId) -> bool {
        self.heads.contains_key(&queue)
    }

    /// Forgets the staged WQE of `queue` (it went some other way).
    pub fn unstage(&mut self, queue: QueueId) {
        self.heads.remove(&queue);
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

    /// Chooses the staged WQE to post next and charges its tenant's token
    /// buckets and deficit; the WQE is no longer staged afterwards.
    pub fn pick(&mut self, now: Instant, credits: &dyn CreditView) -> Pick {
        if self.heads.is_empty() {
            self.end_throttling(now);
            return Pick::Idle;
        }
        for v in &mut self.views {
            *v = View::default();
        }
        let total = credits.total();
        let mut wait: Option<Instant> = None;
        for (&queue, &(ti, ref head)) in &self.heads {
            let (Some(t), Some(view)) = (self.tenants.get_mut(ti), self.views.get_mut(ti)) else {
                continue;
            };
            let k = head.kind as usize;
            let limiter = &mut t.limiters[k];
            limiter.refill(now);
            view.has[k] = true;
            if !limiter.ready(head.bytes) {
                if let Some(at) = limiter.ready_at(head.bytes, now) {
                    wait = Some(wait.map_or(at, |w| w.min(at)));
                }
                continue;
            }
            view.ready[k] = true;
            if !self.credits.grant(t.class, credits.device(queue.0), total) {
                continue;
            }
            let entry = (queue, head.cost());
            if view.first.is_none() {
                view.first = Some(entry);
            }
            if view.next.is_none() && t.cursor.is_none_or(|c| queue > c) {
                view.next = Some(entry);
            }
        }
        // Throttled time: work of a kind waiting and no bucket allowing any.
        for (t, view) in self.tenants.iter_mut().zip(&self.views) {
            for k in 0..2 {
                let throttled = view.has[k] && !view.ready[k];
                match (throttled, t.throttled_since[k]) {
                    (true, None) => t.throttled_since[k] = Some(now),
                    (false, Some(since)) => {
                        t.throttled[k] += now.saturating_duration_since(since);
                        t.throttled_since[k] = None;
                    }
                    _ => {}
                }
            }
        }
        for class in CLASSES.map(class_index) {
            if let Some(link) = &self.link {
                if !link.open(class, now) {
                    // Lower classes are booked at least as far ahead.
                    if self.rings[class]
                        .iter()
                        .any(|&i| candidate(&self.views, i).is_some())
                    {
                        let at = link.opens_at(class, now);
                        wait = Some(wait.map_or(at, |w| w.min(at)));
                    }
                    continue;
                }
            }
            if let Some((queue, cost)) = self.serve_class(class) {
                if let Some(link) = &mut self.link {
                    link.book(class, cost, now);
                }
                return Pick::Run(queue);
            }
        }
        Pick::Wait(wait)
    }

    fn end_throttling(&mut self, now: Instant) {
        for t in &mut self.tenants {
            for k in 0..2 {
                if let Some(since) = t.throttled_since[k].take() {
                    t.throttled[k] += now.saturating_duration_since(since);
                }
            }
        }
    }

    /// Deficit round robin among the eligible tenants of one class: the
    /// chosen pQP and the cost of its WQE.
    fn serve_class(&mut self, class: usize) -> Option<(QueueId, u64)> {
        let ring = &self.rings[class];
        if !ring.iter().any(|&i| candidate(&self.views, i).is_some()) {
            return None;
        }
        let len = ring.len();
        for pass in 0..2 {
            for _ in 0..len {
                let &i = self.rings[class].front()?;
                let Some(t) = self.tenants.get_mut(i) else {
                    self.rings[class].rotate_left(1);
                    continue;
                };
                let Some((queue, cost)) = candidate(&self.views, i) else {
                    // Idle, throttled or out of credits: no share saved up.
                    t.deficit = 0;
                    t.visited = false;
                    self.rings[class].rotate_left(1);
                    continue;
                };
                if !t.visited {
                    t.deficit = t.deficit.saturating_add(t.quantum());
                    t.visited = true;
                }
                if cost <= t.deficit {
                    t.deficit -= cost;
                    t.cursor = Some(queue);
                    let head = self.heads.remove(&queue);
                    if let Some((_, head)) = head {
                        t.limiters[head.kind as usize].take(head.bytes);
                    }
                    return Some((queue, cost));
                }
                t.visited = false;
                self.rings[class].rotate_left(1);
            }
            if pass == 0 {
                // Nobody's deficit covers its next WQE (a message of many
                // quanta): skip the turns in which nothing would be sent.
                let turns = self.rings[class]
                    .iter()
                    .filter_map(|&i| {
                        let (_, cost) = candidate(&self.views, i)?;
                        let t = self.tenants.get(i)?;
                        Some(cost.saturating_sub(t.deficit).div_ceil(t.quantum()))
                    })
                    .min()
                    .unwrap_or(1)
                    .max(1);
                for &i in &self.rings[class] {
                    if candidate(&self.views, i).is_some() {
                        if let Some(t) = self.tenants.get_mut(i) {
                            t.deficit = t.deficit.saturating_add((turns - 1) * t.quantum());
                        }
                    }
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_tenant_policy::Priority;

    /// In-flight send WQEs per device, as the NIC would report them.
    #[derive(Default)]
    struct Nic {
        in_flight: HashMap<DeviceId, usize>,
    }

    impl CreditView for Nic {
        fn device(&self, device: DeviceId) -> usize {
            self.in_flight.get(&device).copied().unwrap_or(0)
        }
        fn total(&self) -> usize {
            self.in_flight.values().sum()
        }
    }

    fn tenant(name: &str, class: PriorityClass, weight: u32) -> TenantPolicy {
        let mut t = vrdma_tenant_policy::Policy::default_policy().tenants[0].clone();
        t.name = name.into();
        t.priority = Priority { class, weight };
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
        let mut s = Scheduler::new(Credits::default(), None);
        for (i, t) in tenants.iter().enumerate() {
            s.configure(t, now);
            assert!(s.add_device(i as DeviceId + 1, &t.name));
        }
        s
    }

    /// Picks `n` times, re-staging whatever ran with `head_of(device)`;
    /// returns bytes served per device.
    fn run(
        s: &mut Scheduler,
        now: Instant,
        n: usize,
        head_of: impl Fn(DeviceId) -> Head,
    ) -> HashMap<DeviceId, u64> {
        let nic = Nic::default();
        let mut bytes = HashMap::new();
        for _ in 0..n {
            match s.pick(now, &nic) {
                Pick::Run(q) => {
                    let head = head_of(q.0);
                    *bytes.entry(q.0).or_insert(0) += head.bytes;
                    s.stage(q, head);
                }
                other => panic!("expected work, got {other:?}"),
            }
        }
        bytes
    }

    #[test]
    fn strict_priority_between_classes() {
        let now = Instant::now();
        let mut s = setup(
            &[
                tenant("normal", PriorityClass::Normal, 1000),
                tenant("prio", PriorityClass::Priority, 1),
                tenant("rt", PriorityClass::Realtime, 1),
            ],
            now,
        );
        for d in 1..=3 {
            s.stage((d, 0), send(4096));
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
        let mut rt = tenant("rt", PriorityClass::Realtime, 1);
        rt.rate.send.ops_per_sec = Some(10);
        rt.rate.send.ops_burst = Some(1);
        s.configure(&rt, now);
        s.stage((3, 0), send(64));
        assert_eq!(s.pick(now, &Nic::default()), Pick::Run((3, 0)), "the burst");
        s.stage((3, 0), send(64));
        assert_eq!(s.pick(now, &Nic::default()), Pick::Run((1, 0)));
        // After 100 ms the realtime tenant has a token again and goes first.
        s.stage((1, 0), send(4096));
        let later = now + Duration::from_millis(100);
        assert_eq!(s.pick(later, &Nic::default()), Pick::Run((3, 0)));
    }

    #[test]
    fn weights_share_bytes_within_a_class() {
        let now = Instant::now();
        let mut s = setup(
            &[
                tenant("one", PriorityClass::Normal, 1),
                tenant("three", PriorityClass::Normal, 3),
            ],
            now,
        );
        // Different message sizes: the share is in bytes, not messages.
        let head_of = |d: DeviceId| if d == 1 { send(4096) } else { send(1000) };
        s.stage((1, 0), head_of(1));
        s.stage((2, 0), head_of(2));
        let served = run(&mut s, now, 100_000, head_of);
        let ratio = served[&2] as f64 / served[&1] as f64;
        assert!((ratio - 3.0).abs() < 0.3, "1:3 weights gave 1:{ratio:.3}");
    }

    #[test]
    fn a_tenants_queues_take_turns_and_keep_their_order() {
        let now = Instant::now();
        let mut s = Scheduler::new(Credits::default(), None);
        s.configure(&tenant("t", PriorityClass::Normal, 1), now);
        assert!(s.add_device(7, "t"));
        assert!(!s.add_device(8, "nobody"), "unknown tenant");
        s.stage((7, 0), send(100));
        s.stage((7, 1), send(100));
        let nic = Nic::default();
        let mut order = Vec::new();
        for _ in 0..6 {
            let Pick::Run(q) = s.pick(now, &nic) else {
                panic!("work is staged");
            };
            order.push(q.1);
            s.stage(q, send(100));
        }
        assert_eq!(order, vec![0, 1, 0, 1, 0, 1]);
        s.remove_device(7);
        assert_eq!(s.pick(now, &nic), Pick::Idle);
    }

    #[test]
    fn huge_messages_are_scheduled_without_spinning_through_turns() {
        let now = Instant::now();
        let mut s = setup(
            &[
                tenant("a", PriorityClass::Normal, 1),
                tenant("b", PriorityClass::Normal, 1),
            ],
            now,
        );
        let huge = 1u64 << 31;
        s.stage((1, 0), send(huge));
        s.stage((2, 0), send(huge));
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
        let nic = Nic::default();
        let end = start + Duration::from_secs(secs);
        let mut now = start;
        let mut served: HashMap<DeviceId, (u64, u64)> = HashMap::new();
        while now < end {
            match s.pick(now, &nic) {
                Pick::Run(q) => {
                    let e = served.entry(q.0).or_default();
                    e.0 += 1;
                    e.1 += head.bytes;
                    s.stage(q, head);
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
        let mut ops = tenant("ops", PriorityClass::Realtime, 1);
        ops.rate.send.ops_per_sec = Some(1000);
        ops.rate.send.ops_burst = Some(10);
        let mut s = setup(&[ops], start);
        s.stage((1, 0), send(64));
        let served = simulate(&mut s, start, 10, send(64), Duration::ZERO);
        let n = served[&1].0 as f64;
        assert!((n - 10_000.0).abs() / 10_000.0 < 0.1, "{n} ops in 10 s");

        // 1 MB/s of 4 KiB reads (default burst of 64 KiB).
        let mut bytes = tenant("bytes", PriorityClass::Normal, 1);
        bytes.rate.read.bytes_per_sec = Some(1_000_000);
        let mut s = setup(&[bytes], start);
        let read = Head {
            kind: OpKind::Read,
            bytes: 4096,
        };
        s.stage((1, 0), read);
        let served = simulate(&mut s, start, 10, read, Duration::ZERO);
        let b = served[&1].1 as f64;
        assert!((b - 10e6).abs() / 10e6 < 0.1, "{b} bytes in 10 s");
        // Sends of the same tenant are not limited by its read bucket.
        let now = start + Duration::from_secs(10);
        while let Pick::Run(q) = s.pick(now, &Nic::default()) {
            s.stage(q, read);
        }
        s.stage((1, 1), send(4096));
        assert_eq!(s.pick(now, &Nic::default()), Pick::Run((1, 1)));
    }

    #[test]
    fn a_limited_tenant_keeps_its_rate_beside_an_unlimited_one() {
        let start = Instant::now();
        let mut slow = tenant("slow", PriorityClass::Normal, 1);
        slow.rate.send.ops_per_sec = Some(2000);
        let fast = tenant("fast", PriorityClass::Normal, 1);
        let mut s = setup(&[slow, fast], start);
        s.stage((1, 0), send(64));
        s.stage((2, 0), send(64));
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
        let mut t = tenant("t", PriorityClass::Normal, 1);
        t.rate.send.ops_per_sec = Some(100);
        t.rate.send.ops_burst = Some(1);
        let mut s = setup(&[t], start);
        let nic = Nic::default();
        s.stage((1, 0), send(64));
        // Poll every millisecond for a second: the tenant can run 100
        // times, and waits for a token the rest of the time.
        let mut ran = 0;
        for ms in 0..1000 {
            let now = start + Duration::from_millis(ms);
            if let Pick::Run(q) = s.pick(now, &nic) {
                ran += 1;
                s.stage(q, send(64));
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
        assert_eq!(s.pick(end, &nic), Pick::Idle);
        let later = s.throttled("t", end + Duration::from_secs(5));
        assert_eq!(later[0], s.throttled("t", end)[0]);
        // The wait is exact: the next token is due 10 ms after the last.
        s.stage((1, 0), send(64));
        let mut now = end;
        let at = loop {
            match s.pick(now, &nic) {
                Pick::Run(q) => s.stage(q, send(64)),
                Pick::Wait(Some(at)) => break at,
                other => panic!("unexpected {other:?}"),
            }
            now += Duration::from_millis(1);
        };
        assert!(at > now && at - now <= Duration::from_millis(10));
    }

    #[test]
    fn credits_refuse_normal_before_realtime_when_scarce() {
        let credits = Credits {
            per_device: 3,
            total: 8,
        };
        assert!(credits.grant(PriorityClass::Normal, 0, 3));
        assert!(!credits.grant(PriorityClass::Normal, 0, 4));
        assert!(credits.grant(PriorityClass::Priority, 0, 5));
        assert!(!credits.grant(PriorityClass::Priority, 0, 6));
        assert!(credits.grant(PriorityClass::Realtime, 0, 7));
        assert!(!credits.grant(PriorityClass::Realtime, 0, 8));
        assert!(!credits.grant(PriorityClass::Realtime, 3, 0), "per device");

        let now = Instant::now();
        let mut s = Scheduler::new(credits, None);
        for (i, class) in [PriorityClass::Normal, PriorityClass::Realtime]
            .into_iter()
            .enumerate()
        {
            s.configure(&tenant(&format!("t{i}"), class, 1), now);
            assert!(s.add_device(i as DeviceId + 1, &format!("t{i}")));
        }
        let mut nic = Nic::default();
        // Device 3 (not scheduled here) holds 5 of the 8 credits.
        nic.in_flight.insert(3, 5);
        s.stage((1, 0), send(64));
        assert_eq!(s.pick(now, &nic), Pick::Wait(None), "normal is refused");
        s.stage((2, 0), send(64));
        assert_eq!(s.pick(now, &nic), Pick::Run((2, 0)), "realtime is not");
        // A device at its own limit gets nothing, whatever its class.
        nic.in_flight.insert(3, 0);
        nic.in_flight.insert(2, 3);
        s.stage((2, 0), send(64));
        assert_eq!(s.pick(now, &nic), Pick::Run((1, 0)));
        assert_eq!(s.pick(now, &nic), Pick::Wait(None));
        // Completions give credits back.
        nic.in_flight.insert(2, 2);
        assert_eq!(s.pick(now, &nic), Pick::Run((2, 0)));
    }

    #[test]
    fn reconfiguring_applies_at_once_and_keeps_tokens_bounded() {
        let now = Instant::now();
        let mut t = tenant("t", PriorityClass::Normal, 1);
        t.rate.send.ops_per_sec = Some(1);
        t.rate.send.ops_burst = Some(1);
        let mut s = setup(&[t.clone(), tenant("rt", PriorityClass::Realtime, 1)], now);
        let nic = Nic::default();
        s.stage((1, 0), send(64));
        assert_eq!(s.pick(now, &nic), Pick::Run((1, 0)));
        s.stage((1, 0), send(64));
        assert!(matches!(s.pick(now, &nic), Pick::Wait(Some(_))));
        // Lifting the limit lets it run at once.
        t.rate.send = RateLimit::default();
        s.configure(&t, now);
        assert_eq!(s.pick(now, &nic), Pick::Run((1, 0)));
        // Moving it to realtime puts it beside "rt" (device 2).
        t.priority.class = PriorityClass::Realtime;
        s.configure(&t, now);
        s.stage((1, 0), send(64));
        s.stage((2, 0), send(64));
        let served = run(&mut s, now, 1000, |_| send(64));
        assert_eq!(served.len(), 2, "both realtime tenants share: {served:?}");
    }

    #[test]
    fn a_class_books_far_ahead_only_while_no_higher_class_is_busy() {
        let start = Instant::now();
        let (realtime, normal) = (
            class_index(PriorityClass::Realtime),
            class_index(PriorityClass::Normal),
        );
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

    #[test]
    fn the_port_is_shared_by_weight_and_realtime_overtakes_booked_work() {
        let start = Instant::now();
        let mut s = setup(
            &[
                tenant("one", PriorityClass::Normal, 1),
                tenant("three", PriorityClass::Normal, 3),
                tenant("rt", PriorityClass::Realtime, 1),
            ],
            start,
        );
        // 1 GB/s: one byte per nanosecond.
        s.link = Some(Link::new(1_000_000_000));
        let nic = Nic::default();
        let big = send(65536);
        s.stage((1, 0), big);
        s.stage((2, 0), big);
        let mut now = start;
        let mut served: HashMap<DeviceId, u64> = HashMap::new();
        let end = start + Duration::from_millis(100);
        while now < end {
            match s.pick(now, &nic) {
                Pick::Run(q) => {
                    *served.entry(q.0).or_default() += big.bytes;
                    s.stage(q, big);
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
        while let Pick::Run(q) = s.pick(now, &nic) {
            s.stage(q, big);
        }
        s.stage((3, 0), send(64));
        assert_eq!(s.pick(now, &nic), Pick::Run((3, 0)));
        // ... and the normal class waits behind it.
        let link = s.link.expect("link");
        assert!(link.busy_until[2] > link.busy_until[0]);
    }
}
