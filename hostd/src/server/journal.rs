//! What hostd keeps of a context for the next vdev of its device: the
//! journal its vdev sends after every control command that changed
//! something ([`Request::Journal`]), and the contexts left behind by a vdev
//! that died (orphans), running on until a successor adopts them or their
//! grace period ends.
//!
//! hostd interprets nothing in the records: they are vdev's own encoding of
//! its objects, and the next vdev decodes them as hostile input (a
//! compromised vdev could have written them, and it serves the same tenant
//! and device). What hostd guarantees is that a successor only ever gets
//! its own device's contexts, whole: a context whose vdev died between a
//! state-changing request and its journal (half-way through a command) is
//! never kept, nor one whose journal outgrew its bounds.
//!
//! [`Request::Journal`]: vrdma_hostd_protocol::messages::Request::Journal

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use vrdma_hostd_protocol::messages::{
    ContextKey, Journal, Record, MAX_DEVICE_RECORD_BYTES, MAX_MESSAGE, MAX_RECORDS,
    MAX_RECORD_BYTES,
};

use super::registry::Session;

/// One context's records and whether they say all there is.
#[derive(Debug, Default)]
pub(super) struct ContextJournal {
    key: Option<ContextKey>,
    records: BTreeMap<(u8, u32), String>,
    bytes: usize,
    /// A state-changing request arrived after the last journal.
    pending: bool,
    /// The journal outgrew [`MAX_RECORDS`] or [`MAX_RECORD_BYTES`], or the
    /// device's journals [`MAX_DEVICE_RECORD_BYTES`].
    overflowed: bool,
    /// The bytes every context of the device keeps (shared by them).
    device_bytes: Arc<AtomicUsize>,
}

impl Drop for ContextJournal {
    fn drop(&mut self) {
        self.device_bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl ContextJournal {
    /// An empty journal of a context of the device whose contexts'
    /// journals hold `device_bytes` together.
    pub(super) fn of_device(device_bytes: Arc<AtomicUsize>) -> Self {
        ContextJournal {
            key: None,
            records: BTreeMap::new(),
            bytes: 0,
            pending: false,
            overflowed: false,
            device_bytes,
        }
    }

    /// A request that changes the context's state arrived.
    pub(super) fn changed(&mut self) {
        self.pending = true;
    }

    /// Applies a journal message. Returns why the context stops being
    /// adoptable, once, when this message made it so.
    pub(super) fn apply(&mut self, journal: Journal) -> Option<&'static str> {
        self.pending = false;
        if let Some(key) = journal.key {
            self.key = Some(key);
        }
        if self.overflowed {
            return None;
        }
        let before = self.bytes;
        for record in journal.records {
            let at = (record.kind, record.id);
            if let Some(old) = self.records.remove(&at) {
                self.bytes -= old.len();
            }
            if let Some(data) = record.data {
                self.bytes += data.len();
                self.records.insert(at, data);
            }
        }
        let device = if self.bytes >= before {
            self.device_bytes
                .fetch_add(self.bytes - before, Ordering::Relaxed)
                + (self.bytes - before)
        } else {
            self.device_bytes
                .fetch_sub(before - self.bytes, Ordering::Relaxed)
                - (before - self.bytes)
        };
        if self.records.len() > MAX_RECORDS
            || self.bytes > MAX_RECORD_BYTES
            || device > MAX_DEVICE_RECORD_BYTES
        {
            self.overflowed = true;
            self.records.clear();
            self.device_bytes.fetch_sub(self.bytes, Ordering::Relaxed);
            self.bytes = 0;
            return Some("the context's journal outgrew its bounds");
        }
        None
    }

    /// The key to keep the context under, if a successor can take it over.
    pub(super) fn adoptable(&self) -> Result<ContextKey, &'static str> {
        if self.overflowed {
            return Err("its journal outgrew its bounds");
        }
        if self.pending {
            return Err("its vdev died in the middle of a control command");
        }
        self.key.ok_or(
            "its frontend does not come back after a restart, or its control queue never ran",
        )
    }

    /// How many records there are.
    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    /// The records from the `from`th on, as many as fit one message with
    /// room to spare, and whether more follow.
    pub(super) fn page(&self, from: usize) -> (Vec<Record>, bool) {
        // JSON escaping can grow data (a quote becomes two bytes): half a
        // message of raw data always fits.
        let budget = MAX_MESSAGE / 2;
        let mut used = 0;
        let mut page = Vec::new();
        for (&(kind, id), data) in self.records.iter().skip(from) {
            if !page.is_empty() && used + data.len() + 32 > budget {
                return (page, true);
            }
            used += data.len() + 32;
            page.push(Record {
                kind,
                id,
                data: Some(data.clone()),
            });
        }
        (page, false)
    }
}

/// A context whose vdev died, still attached to the datapath: its QPs go
/// on, its memory stays mapped, until a successor adopts it or `until`.
#[derive(Debug)]
pub(super) struct Orphan {
    pub(super) session: Session,
    pub(super) key: ContextKey,
    pub(super) until: Instant,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: u8, id: u32, data: Option<&str>) -> Record {
        Record {
            kind,
            id,
            data: data.map(str::to_owned),
        }
    }

    #[test]
    fn records_are_replaced_and_dropped_by_key() {
        let mut j = ContextJournal::default();
        assert!(j.adoptable().is_err(), "no key yet");
        let key = ContextKey {
            dev: 1,
            ino: 2,
            offset: 3,
        };
        j.apply(Journal {
            key: Some(key),
            records: vec![record(1, 7, Some("a")), record(2, 7, Some("bb"))],
        });
        j.apply(Journal {
            key: None,
            records: vec![record(1, 7, Some("ccc")), record(2, 7, None)],
        });
        assert_eq!(j.adoptable(), Ok(key));
        assert_eq!(j.page(0), (vec![record(1, 7, Some("ccc"))], false));
        assert_eq!(j.bytes, 3);
        j.changed();
        assert!(j.adoptable().is_err(), "a command half done");
    }

    #[test]
    fn a_journal_past_its_bounds_is_not_kept() {
        let device = Arc::new(AtomicUsize::new(0));
        let mut j = ContextJournal::of_device(device.clone());
        let big = "x".repeat(MAX_RECORD_BYTES / 4 + 1);
        let mut why = None;
        for id in 0..4 {
            why = why.or(j.apply(Journal {
                key: Some(ContextKey {
                    dev: 0,
                    ino: 0,
                    offset: 0,
                }),
                records: vec![record(1, id, Some(&big))],
            }));
        }
        assert!(why.is_some());
        assert_eq!(j.adoptable(), Err("its journal outgrew its bounds"));
        assert_eq!(j.len(), 0);
        assert_eq!(device.load(Ordering::Relaxed), 0, "its bytes given back");
    }

    /// The device's contexts together stay within their budget: once
    /// they hold it, the next context's growth overflows that context.
    #[test]
    fn a_devices_contexts_share_one_budget() {
        let device = Arc::new(AtomicUsize::new(0));
        let chunk = "z".repeat(MAX_RECORD_BYTES / 2);
        let mut journals: Vec<ContextJournal> = Vec::new();
        let mut overflowed = 0;
        for _ in 0..(2 * MAX_DEVICE_RECORD_BYTES / chunk.len() + 2) {
            let mut j = ContextJournal::of_device(device.clone());
            let why = j.apply(Journal {
                key: None,
                records: vec![record(2, 1, Some(&chunk))],
            });
            overflowed += usize::from(why.is_some());
            journals.push(j);
        }
        assert!(overflowed > 0);
        assert!(device.load(Ordering::Relaxed) <= MAX_DEVICE_RECORD_BYTES);
        drop(journals);
        assert_eq!(device.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn pages_fit_a_message_and_cover_every_record() {
        let mut j = ContextJournal::default();
        let data = "y".repeat(1000);
        j.apply(Journal {
            key: None,
            records: (0..200).map(|id| record(3, id, Some(&data))).collect(),
        });
        let (mut from, mut seen) = (0, 0);
        loop {
            let (page, more) = j.page(from);
            let size = serde_json::to_vec(&page).map(|v| v.len()).unwrap_or(0);
            assert!(size < MAX_MESSAGE, "{size}");
            seen += page.len();
            from += page.len();
            if !more {
                break;
            }
        }
        assert_eq!(seen, 200);
    }
}
