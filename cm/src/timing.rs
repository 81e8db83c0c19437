//! CM time values: 5-bit exponents of 4.096 µs (IBA 12.7.x), converted the
//! way Linux's CM converts them, so that this agent waits as long as a
//! Linux peer expects.

use std::time::Duration;

/// A CM timeout field as a duration: 4.096 µs × 2^t, which Linux rounds to
/// `1 << max(t − 8, 0)` ms (`cm_convert_to_ms`): 20 → 4096 ms, 24 → 65.5 s,
/// anything up to 8 → 1 ms. Only the field's 5 bits count.
pub fn cm_time(t: u8) -> Duration {
    Duration::from_millis(1 << (t & 0x1f).saturating_sub(8))
}

/// The QP ACK timeout for a path: 4.096 µs × 2^t covering the peer's CA ACK
/// delay plus a round trip of packet lifetimes, as Linux's `cm_ack_timeout`
/// computes it (the larger of the two, incremented when the other is
/// within half of it), capped at 31.
pub fn cm_ack_timeout(ca_ack_delay: u8, packet_life_time: u8) -> u8 {
    let delay = u32::from(ca_ack_delay);
    let mut t = u32::from(packet_life_time) + 1;
    if t >= delay {
        t += u32::from(delay + 1 >= t);
    } else {
        t = delay + u32::from(t + 1 >= delay);
    }
    t.min(31) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux_conversions() {
        assert_eq!(cm_time(0), Duration::from_millis(1));
        assert_eq!(cm_time(8), Duration::from_millis(1));
        assert_eq!(cm_time(9), Duration::from_millis(2));
        assert_eq!(cm_time(16), Duration::from_millis(256));
        assert_eq!(cm_time(18), Duration::from_millis(1024));
        assert_eq!(cm_time(20), Duration::from_millis(4096));
        assert_eq!(cm_time(24), Duration::from_millis(65536));
        assert_eq!(cm_time(31), Duration::from_millis(1 << 23));
        // Linux's REQ retransmit interval over rxe (notes §2.9).
        assert_eq!(cm_time(18) * 2 + cm_time(20), Duration::from_millis(6144));
        assert_eq!(cm_time(16) * 2 + cm_time(20), Duration::from_millis(4608));
    }

    #[test]
    fn ack_timeouts() {
        // rxe's ack delay is 15: PLT 18 → 19, PLT 16 → 17 (notes §2.7).
        assert_eq!(cm_ack_timeout(15, 18), 19);
        assert_eq!(cm_ack_timeout(15, 16), 17);
        // Within half of each other: rounded up.
        assert_eq!(cm_ack_timeout(15, 14), 16);
        assert_eq!(cm_ack_timeout(15, 13), 16);
        assert_eq!(cm_ack_timeout(15, 12), 15);
        assert_eq!(cm_ack_timeout(0, 0), 2);
        assert_eq!(cm_ack_timeout(31, 31), 31);
        assert_eq!(cm_ack_timeout(255, 255), 31);
    }
}
