//! Counters per peer host: what an operator looks at when traffic to one
//! host goes wrong (`vrdmactl peers`, and the Prometheus output).

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ids::PickedMap;
use crate::net::directory::Directory;

/// What went to and came from one peer host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerStats {
    /// The host's name in the directory ("" for packets from sources it
    /// does not know).
    pub host: String,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Packets sent again (go-back-N after a NAK, a timeout or a lost
    /// READ response).
    pub retransmissions: u64,
    /// ACK timeouts that expired.
    pub timeouts: u64,
    /// Duplicate requests answered again.
    pub duplicates: u64,
    pub naks_sent: BTreeMap<String, u64>,
    pub naks_received: BTreeMap<String, u64>,
    /// Packets dropped, by reason.
    pub drops: BTreeMap<String, u64>,
    /// Smoothed round-trip time (RFC 6298's SRTT), in nanoseconds.
    pub rtt_ns: u64,
    pub rtt_samples: u64,
    /// Errors handing packets to the kernel, and taking them from it.
    pub send_errors: u64,
    pub receive_errors: u64,
}

/// Adds one to counter `kind` of `map` (allocating only the first time).
pub fn bump(map: &mut BTreeMap<String, u64>, kind: &str) {
    match map.get_mut(kind) {
        Some(n) => *n += 1,
        None => {
            map.insert(kind.to_owned(), 1);
        }
    }
}

impl PeerStats {
    /// Folds an RTT sample into the smoothed RTT (gain 1/8).
    pub fn rtt(&mut self, sample: Duration) {
        let ns = u64::try_from(sample.as_nanos()).unwrap_or(u64::MAX);
        self.rtt_ns = if self.rtt_samples == 0 {
            ns
        } else {
            self.rtt_ns - self.rtt_ns / 8 + ns / 8
        };
        self.rtt_samples += 1;
    }
}

/// The counters of every peer host; index 0 holds what cannot be
/// attributed to a known host.
#[derive(Debug)]
pub struct Peers {
    /// Counters not attributable to a host (index 0).
    pub global: PeerStats,
    hosts: Vec<PeerStats>,
    by_name: HashMap<String, usize>,
    /// GID → peer index and the GID's network, as the directory said at
    /// `generation` (looked up per packet; only GIDs the directory knows
    /// are inserted: foldhash).
    by_gid: PickedMap<Ipv4Addr, (usize, Arc<str>)>,
    generation: u64,
}

impl Default for Peers {
    fn default() -> Self {
        Peers {
            global: PeerStats::default(),
            hosts: Vec::new(),
            by_name: HashMap::new(),
            by_gid: PickedMap::default(),
            generation: u64::MAX,
        }
    }
}

impl Peers {
    /// The counters of peer `i` (0: the unattributed ones).
    pub fn at(&mut self, i: usize) -> &mut PeerStats {
        match i.checked_sub(1).and_then(|j| self.hosts.get_mut(j)) {
            Some(p) => p,
            None => &mut self.global,
        }
    }

    /// The peer index of the host serving `gid`, if the directory knows it.
    pub fn of_gid(&mut self, directory: &dyn Directory, gid: Ipv4Addr) -> Option<usize> {
        // No network name cloned for a counter's index.
        self.known(directory, gid).map(|&(i, _)| i)
    }

    /// The peer index of the host serving `gid` and the tenant network
    /// `gid` is in, if the directory knows it.
    pub fn source(
        &mut self,
        directory: &dyn Directory,
        gid: Ipv4Addr,
    ) -> Option<(usize, Arc<str>)> {
        let (i, network) = self.known(directory, gid)?;
        Some((*i, Arc::clone(network)))
    }

    /// `gid`'s peer index and network, from the cache of the directory's
    /// current generation or (once per generation) from the directory.
    fn known(&mut self, directory: &dyn Directory, gid: Ipv4Addr) -> Option<&(usize, Arc<str>)> {
        let generation = directory.generation();
        if generation != self.generation {
            self.by_gid.clear();
            self.generation = generation;
        }
        match self.by_gid.entry(gid) {
            Entry::Occupied(known) => Some(known.into_mut()),
            Entry::Vacant(new) => {
                let entry = directory.lookup(gid)?;
                let i = match self.by_name.get(&entry.host) {
                    Some(&i) => i,
                    None => {
                        self.hosts.push(PeerStats {
                            host: entry.host.clone(),
                            ..PeerStats::default()
                        });
                        let i = self.hosts.len();
                        self.by_name.insert(entry.host, i);
                        i
                    }
                };
                Some(new.insert((i, Arc::from(entry.network))))
            }
        }
    }

    /// A packet of `len` bytes went to peer `i`.
    pub fn sent(&mut self, i: usize, len: usize) {
        let p = self.at(i);
        p.tx_packets += 1;
        p.tx_bytes += len as u64;
    }

    /// A packet of `len` bytes came from peer `i`.
    pub fn received(&mut self, i: usize, len: usize) {
        let p = self.at(i);
        p.rx_packets += 1;
        p.rx_bytes += len as u64;
    }

    /// A packet from peer `i` was dropped for `why`.
    pub fn dropped(&mut self, i: usize, why: &'static str) {
        bump(&mut self.at(i).drops, why);
    }

    /// Every peer's counters, the unattributed ones first.
    pub fn snapshot(&self) -> Vec<PeerStats> {
        std::iter::once(&self.global)
            .chain(self.hosts.iter())
            .cloned()
            .collect()
    }
}
