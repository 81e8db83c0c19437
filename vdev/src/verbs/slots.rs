//! hostd's numbers for the guest memory slots a context gave it.
//!
//! A number freed by a slot that went away is given to the next slot (the
//! lowest free first): hostd bounds a device's slot numbers by the tenant's
//! `max_mr` and a few more, so a program that registers and deregisters
//! memory regions over scattered memory for ever never runs out of them.
//! A slot hostd refused keeps its reason, so that a memory region over it
//! is refused with that reason (and hostd's errno), not as unknown memory.

use std::collections::{BTreeSet, HashMap};

use crate::shadow::SlotId;

/// The slots hostd has, and the ones it refused.
#[derive(Debug, Default)]
pub(super) struct HostdSlots {
    numbers: HashMap<SlotId, u32>,
    /// The same, by number (a rebuild looks up every MR segment's slot).
    slots: HashMap<u32, SlotId>,
    /// Numbers below `next` no slot holds.
    free: BTreeSet<u32>,
    next: u32,
    /// hostd's errno and reason for each slot it refused.
    refused: HashMap<SlotId, (i32, String)>,
}

impl HostdSlots {
    /// hostd's number for `slot`, if it has it.
    pub(super) fn number(&self, slot: &SlotId) -> Option<u32> {
        self.numbers.get(slot).copied()
    }

    /// Why hostd refused `slot`, if it did.
    pub(super) fn refusal(&self, slot: &SlotId) -> Option<&(i32, String)> {
        self.refused.get(slot)
    }

    /// Whether `slot` was offered to hostd (taken or refused).
    pub(super) fn offered(&self, slot: &SlotId) -> bool {
        self.numbers.contains_key(slot) || self.refused.contains_key(slot)
    }

    /// The number to offer the next slot under.
    pub(super) fn next_number(&self) -> u32 {
        self.free.first().copied().unwrap_or(self.next)
    }

    /// hostd took `slot` under `number` (from [`Self::next_number`]).
    pub(super) fn taken(&mut self, slot: SlotId, number: u32) {
        if !self.free.remove(&number) {
            self.next = self.next.max(number.saturating_add(1));
        }
        if let Some(old) = self.numbers.insert(slot, number) {
            self.slots.remove(&old);
        }
        self.slots.insert(number, slot);
    }

    /// hostd refused `slot`: `errno`, `reason`.
    pub(super) fn refused(&mut self, slot: SlotId, errno: i32, reason: String) {
        self.refused.insert(slot, (errno, reason));
    }

    /// `slot` is gone from guest memory: its number, if hostd had it, is
    /// free again (the caller tells hostd).
    pub(super) fn gone(&mut self, slot: &SlotId) -> Option<u32> {
        self.refused.remove(slot);
        let number = self.numbers.remove(slot)?;
        self.slots.remove(&number);
        self.free.insert(number);
        Some(number)
    }

    /// Every slot ever offered: to see which went away.
    pub(super) fn offered_slots(&self) -> Vec<SlotId> {
        self.numbers
            .keys()
            .chain(self.refused.keys())
            .copied()
            .collect()
    }

    /// The slot hostd has under `number`.
    pub(super) fn slot_of(&self, number: u32) -> Option<SlotId> {
        self.slots.get(&number).copied()
    }

    /// hostd's numbers of the slots it has.
    pub(super) fn numbers(&self) -> Vec<u32> {
        self.numbers.values().copied().collect()
    }

    /// How many slots hostd has.
    pub(super) fn len(&self) -> usize {
        self.numbers.len()
    }

    /// Forgets everything (a new hostd has none of them).
    pub(super) fn clear(&mut self) {
        *self = HostdSlots::default();
    }
}
