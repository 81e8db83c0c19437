//! What a device's connection manager did: the agent's counters (MADs
//! by kind, drops by reason) and the service's own, as one snapshot.

use vrdma_cm::{DropReason, MessageKind, Stats};

/// Every [`DropReason`], in index order.
const DROP_REASONS: [DropReason; DropReason::COUNT] = [
    DropReason::Malformed,
    DropReason::Unsupported,
    DropReason::UnknownConnection,
    DropReason::UnexpectedState,
    DropReason::Duplicate,
    DropReason::WrongQpn,
    DropReason::TableFull,
];

/// The service's own counters, beside the agent's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ServiceCounts {
    /// MADs hostd refused to send (the agent's retries or timeouts follow).
    pub send_failed: u64,
    /// `TakeMads` requests that failed.
    pub take_failed: u64,
    /// Events an owner's full queue could not take.
    pub events_dropped: u64,
    /// Connect requests refused before any owner saw them (bad CMA
    /// header, wrong destination address or QP type, backlog full).
    pub requests_refused: u64,
    /// Address resolutions answered ADDR_ERROR.
    pub addr_errors: u64,
}

/// A snapshot of a device's connection-manager counters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CmCounters {
    /// MADs queued for sending, by [`MessageKind::index`] (retransmissions
    /// included).
    pub sent: [u64; MessageKind::COUNT],
    /// MADs received and decoded, by kind.
    pub received: [u64; MessageKind::COUNT],
    pub retransmits: u64,
    pub duplicates: u64,
    /// Received MADs dropped by the agent, by [`DropReason::index`].
    pub dropped: [u64; DropReason::COUNT],
    /// MADs or events the agent's bounded queues lost.
    pub transmits_lost: u64,
    pub events_lost: u64,
    pub send_failed: u64,
    pub take_failed: u64,
    pub events_dropped: u64,
    pub requests_refused: u64,
    pub addr_errors: u64,
    /// CM IDs with an established connection now.
    pub connections_live: u64,
    /// CM IDs, listeners and owners now.
    pub ids: u64,
    pub listeners: u64,
    pub owners: u64,
    /// The agent's connections now, timewait included.
    pub agent_connections: u64,
}

impl CmCounters {
    pub(crate) fn new(stats: &Stats, own: ServiceCounts) -> CmCounters {
        CmCounters {
            sent: stats.sent,
            received: stats.received,
            retransmits: stats.retransmits,
            duplicates: stats.duplicates,
            dropped: stats.dropped,
            transmits_lost: stats.transmits_lost,
            events_lost: stats.events_lost,
            send_failed: own.send_failed,
            take_failed: own.take_failed,
            events_dropped: own.events_dropped,
            requests_refused: own.requests_refused,
            addr_errors: own.addr_errors,
            ..CmCounters::default()
        }
    }

    pub fn sent(&self, kind: MessageKind) -> u64 {
        self.sent[kind.index()]
    }

    pub fn received(&self, kind: MessageKind) -> u64 {
        self.received[kind.index()]
    }

    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()]
    }

    /// MADs received, all kinds.
    pub fn received_total(&self) -> u64 {
        self.received.iter().sum()
    }

    /// MADs sent, all kinds.
    pub fn sent_total(&self) -> u64 {
        self.sent.iter().sum()
    }

    /// `(label, value)` pairs for a report: `sent_req`, `received_rep`,
    /// `dropped_unknown_connection`, `connections_live`, ...
    pub fn labelled(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for kind in MessageKind::ALL {
            out.push((format!("sent_{}", kind.name()), self.sent(kind)));
            out.push((format!("received_{}", kind.name()), self.received(kind)));
        }
        for reason in DROP_REASONS {
            out.push((format!("dropped_{}", reason.name()), self.dropped(reason)));
        }
        for (name, v) in [
            ("retransmits", self.retransmits),
            ("duplicates", self.duplicates),
            ("transmits_lost", self.transmits_lost),
            ("events_lost", self.events_lost),
            ("send_failed", self.send_failed),
            ("take_failed", self.take_failed),
            ("events_dropped", self.events_dropped),
            ("requests_refused", self.requests_refused),
            ("addr_errors", self.addr_errors),
            ("connections_live", self.connections_live),
            ("ids", self.ids),
            ("listeners", self.listeners),
            ("owners", self.owners),
            ("agent_connections", self.agent_connections),
        ] {
            out.push((name.to_owned(), v));
        }
        out
    }
}
