//! What a destroyed RC QP had acknowledged, kept for a while so that a
//! retransmission of a message it took — whose acknowledgement the network
//! lost — is acknowledged again instead of running the sender out of
//! retries.
//!
//! The case is the end of every request/reply program on a lossy path:
//! the last reply arrives, the receiver's program exits and destroys its
//! QP, its ACK is lost; the sender retransmits to a QP that is gone and
//! fails with RETRY_EXC_ERR although every byte was delivered. TCP keeps
//! TIME-WAIT for the same lost last ACK. Only SEND and WRITE packets
//! before the closed QP's expected PSN are answered (they name work that
//! was done and acknowledged once); READs and atomics are not (their
//! answers need memory that is gone), nor anything new.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use vrdma_roce::Psn;

use super::state::{ack_timeout, Path, RemoteQp};

/// Closed QPs remembered at most (a program closing thousands of QPs at
/// once gets the rest forgotten, as every QP was before).
const MAX_CLOSED: usize = 4096;
/// A device's share of them: one tenant closing QPs by the thousand leaves
/// room for the others'.
const MAX_PER_DEVICE: usize = MAX_CLOSED / 4;
/// How long a closed QP answers at least and at most: the peer retries
/// for about its timeout × (retry count + 1); ours stands in for it.
const LINGER_MIN: Duration = Duration::from_millis(100);
const LINGER_MAX: Duration = Duration::from_secs(10);

/// The last acknowledgement of one closed QP.
#[derive(Debug, Clone, Copy)]
struct Closed {
    /// Where its acknowledgements went.
    path: Path,
    /// The PSN it expected next: everything before was taken.
    epsn: Psn,
    msn: u32,
    peer: usize,
    until: Instant,
}

/// Closed QPs by (local GID, QP number). A live QP of the same number is
/// found first, so a number taken again shadows its old owner.
#[derive(Debug, Default)]
pub struct ClosedQps(HashMap<(Ipv4Addr, u32), Closed>);

/// An acknowledgement a closed QP owes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reack {
    pub path: Path,
    pub psn: Psn,
    pub msn: u32,
    pub peer: usize,
}

impl ClosedQps {
    /// RC QP `qpn`, connected as `remote`, was destroyed at `now`.
    pub fn remember(&mut self, qpn: u32, remote: &RemoteQp, now: Instant) {
        let c = &remote.conn;
        let gid = c.path.src;
        let of_device = |m: &HashMap<(Ipv4Addr, u32), Closed>| {
            // A scan, only once the table holds a share's worth (a QP's
            // destruction is a control-path event, not per packet).
            m.len() >= MAX_PER_DEVICE && m.keys().filter(|k| k.0 == gid).count() >= MAX_PER_DEVICE
        };
        if self.0.len() >= MAX_CLOSED || of_device(&self.0) {
            self.0.retain(|_, c| c.until > now);
            if self.0.len() >= MAX_CLOSED || of_device(&self.0) {
                return;
            }
        }
        let linger = ack_timeout(c.timeout)
            .map_or(LINGER_MAX, |t| t.saturating_mul(u32::from(c.retry_cnt) + 1))
            .clamp(LINGER_MIN, LINGER_MAX);
        let closed = Closed {
            path: c.path,
            epsn: remote.epsn,
            msn: remote.msn,
            peer: c.peer,
            until: now + linger,
        };
        self.0.insert((gid, qpn), closed);
    }

    /// The acknowledgement owed for a SEND or WRITE packet `psn` from
    /// `src` to the closed QP `qpn` of `dst`, if it retransmits what that
    /// QP took.
    pub fn answer(
        &mut self,
        dst: Ipv4Addr,
        qpn: u32,
        src: Ipv4Addr,
        psn: Psn,
        now: Instant,
    ) -> Option<Reack> {
        let key = (dst, qpn);
        let c = *self.0.get(&key)?;
        if c.until <= now {
            self.0.remove(&key);
            return None;
        }
        (c.path.dst == src && psn.diff(c.epsn) < 0).then_some(Reack {
            path: c.path,
            psn: c.epsn.sub(1),
            msn: c.msn,
            peer: c.peer,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::wire::state::Connection;

    fn remote(gid: [u8; 4], epsn: u32) -> RemoteQp {
        let path = Path {
            src: Ipv4Addr::from(gid),
            dst: Ipv4Addr::new(10, 0, 0, 99),
            tos: 0,
            dest_qpn: 7,
            mtu: 4096,
        };
        let conn = Connection {
            path,
            sq_psn: 0,
            rq_psn: epsn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 1,
            peer: 1,
            unacknowledged: false,
        };
        RemoteQp::new(conn)
    }

    #[test]
    fn a_device_gets_a_share_and_only_retransmissions_are_answered() {
        let now = Instant::now();
        let mut closed = ClosedQps::default();
        let (busy, other) = ([10, 0, 0, 1], [10, 0, 0, 2]);
        for qpn in 0..MAX_PER_DEVICE as u32 + 10 {
            closed.remember(qpn, &remote(busy, 100), now);
        }
        assert_eq!(closed.0.len(), MAX_PER_DEVICE, "one device's share");
        closed.remember(5, &remote(other, 100), now);
        let src = Ipv4Addr::new(10, 0, 0, 99);
        let other_ip = Ipv4Addr::from(other);
        let old = Psn::new(90);
        let reack = closed
            .answer(other_ip, 5, src, old, now)
            .expect("remembered");
        assert_eq!((reack.psn, reack.peer), (Psn::new(99), 1));
        // Not a retransmission, not from the peer, not this QP: nothing.
        assert!(closed
            .answer(other_ip, 5, src, Psn::new(100), now)
            .is_none());
        assert!(closed
            .answer(other_ip, 5, Ipv4Addr::new(10, 0, 0, 98), old, now)
            .is_none());
        assert!(closed.answer(other_ip, 6, src, old, now).is_none());
        // Past its linger (14: 67 ms × 8 retries), forgotten.
        let later = now + Duration::from_secs(1);
        assert!(closed.answer(other_ip, 5, src, old, later).is_none());
        // Once the busy device's entries expire, it gets room again.
        closed.remember(99_999, &remote(busy, 100), later);
        assert!(closed.0.contains_key(&(Ipv4Addr::from(busy), 99_999)));
    }
}
