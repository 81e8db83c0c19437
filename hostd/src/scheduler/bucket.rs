//! Token buckets: a tenant's rate limits, in operations and bytes per
//! second, for each kind of work.

use std::time::{Duration, Instant};

use vrdma_tenant_policy::RateLimit;

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
