//! Rates: how fast each tenant and the port may go — the tenants' token
//! buckets (rate limits in operations and bytes per second, for each kind
//! of work) and the NIC's port (the rate at which it puts bytes on the
//! wire, booked per priority class).

use std::time::{Duration, Instant};

use vrdma_tenant_policy::RateLimit;

use super::{BUSY_FOR, QUANTUM};

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
mod tests {
    use super::*;

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
}
