//! The key table and the DMA engine: memory regions by key, every access
//! checked against its region, and the copies between regions.
//!
//! hostd assigns the keys, as a NIC assigns memory keys: a key is a table
//! index (the upper 24 bits) and a tag (the low 8 bits, random), so a
//! lookup is an array access and a key that lost its region (or one made
//! up) misses. An lkey and its rkey are distinct keys of one region.
//!
//! Access checks happen when work executes, against the table as it is
//! then: once `deregister` or `revoke_slot` returned, no later access goes
//! through what they removed. The copies ([`copy`]) move opaque payload
//! between mappings with `memmove`: bytes a guest rewrites meanwhile change
//! only which bytes arrive, exactly as with a DMA engine.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_hostd_protocol::messages::MrRegistration;
use vrdma_spec::ring::Sge;
use vrdma_spec::verbs::access;

use super::guest::{GuestMemory, SharedMapping};
use super::{DeviceId, EngineError};

/// Most memory regions on the host (24-bit key index).
pub const MAX_MRS: usize = 1 << 24;
/// Most memory regions of one device.
pub const MAX_MRS_PER_DEVICE: usize = 1 << 16;

/// One piece of a region: `len` bytes at `offset` of a slot's mapping,
/// starting at byte `start` of the region.
#[derive(Debug, Clone)]
struct Segment {
    slot: u32,
    map: Arc<SharedMapping>,
    offset: usize,
    len: u64,
    start: u64,
}

/// A registered memory region.
#[derive(Debug)]
pub struct Mr {
    device: DeviceId,
    pd: u32,
    access: u32,
    iova: u64,
    len: u64,
    segments: Vec<Segment>,
    /// A slot under it was removed: no access succeeds any more.
    revoked: bool,
    lkey: u32,
    rkey: u32,
}

impl Mr {
    /// Offset in the region of `[addr, addr + len)` if `device`'s work in
    /// `pd` may access it with `need`.
    fn check(&self, device: DeviceId, pd: u32, need: u32, addr: u64, len: u64) -> Option<u64> {
        if self.device != device || self.pd != pd || self.revoked || self.access & need != need {
            return None;
        }
        let end = addr.checked_add(len)?;
        if addr < self.iova || end > self.iova.checked_add(self.len)? {
            return None;
        }
        Some(addr - self.iova)
    }

    /// The contiguous run at byte `at` of the region: its mapping, offset
    /// there, and bytes left in that segment.
    fn run(&self, at: u64) -> Option<(&SharedMapping, usize, u64)> {
        // Most regions are one piece (process mode, hugepages): no search.
        let i = if self.segments.len() == 1 {
            0
        } else {
            self.segments.partition_point(|s| s.start + s.len <= at)
        };
        let seg = self.segments.get(i)?;
        let skip = at.checked_sub(seg.start)?;
        let offset = seg.offset.checked_add(usize::try_from(skip).ok()?)?;
        Some((&seg.map, offset, seg.len - skip))
    }
}

/// A checked range of a region: `len` bytes from byte `start` (an empty
/// range, a zero-length SGE, names no region).
#[derive(Debug, Clone, Copy)]
pub struct Extent<'k> {
    mr: Option<&'k Mr>,
    start: u64,
    len: u64,
}

impl<'k> Extent<'k> {
    /// Its bytes `[skip, skip + len)`, if they are one run of one mapping.
    fn contiguous(self, skip: u64, len: u64) -> Option<(&'k SharedMapping, usize)> {
        if skip.checked_add(len)? > self.len {
            return None;
        }
        let (map, at, avail) = self.mr?.run(self.start + skip)?;
        (avail >= len).then_some((map, at))
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One slot of the table: a region under its lkey, or the rkey that
/// leads to it.
#[derive(Debug)]
enum Entry {
    Region(Mr),
    Rkey { lkey: u32, rkey: u32 },
}

/// Every memory region of the host, by key.
#[derive(Debug, Default)]
pub struct KeyTable {
    entries: Vec<Option<Entry>>,
    free: Vec<u32>,
    /// Regions per device.
    counts: crate::ids::IdMap<DeviceId, usize>,
    /// State of the tag generator (xorshift, seeded from the OS).
    rng: u64,
}

fn index_of(key: u32) -> usize {
    (key >> 8) as usize
}

impl KeyTable {
    /// An empty table whose tags come from the OS's randomness.
    pub fn new() -> Self {
        let mut seed = [0u8; 8];
        let seed = if crate::ids::os_random(&mut seed).is_ok() {
            u64::from_ne_bytes(seed)
        } else {
            // No entropy: tags are a defence in depth only (keys are
            // checked against the device, PD and connection anyway).
            0x9e37_79b9_7f4a_7c15
        };
        KeyTable {
            rng: seed | 1,
            ..KeyTable::default()
        }
    }

    fn tag(&mut self) -> u8 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 32) as u8
    }

    /// Records a region of `device` over its memory `mem` and returns its
    /// (lkey, rkey).
    pub fn register(
        &mut self,
        device: DeviceId,
        reg: &MrRegistration,
        mem: &GuestMemory,
    ) -> Result<(u32, u32), EngineError> {
        self.insert(device, reg, mem, None)
    }

    /// Records a region a previous hostd had registered as (`lkey`,
    /// `rkey`), under those keys: the driver and its peers hold them.
    /// Refused ([`EngineError::KeyTaken`]) when a key's table slot holds
    /// another region now (one registered since this hostd started).
    pub fn restore(
        &mut self,
        device: DeviceId,
        reg: &MrRegistration,
        mem: &GuestMemory,
        (lkey, rkey): (u32, u32),
    ) -> Result<(u32, u32), EngineError> {
        self.insert(device, reg, mem, Some((lkey, rkey)))
    }

    /// [`KeyTable::register`], under `keys` when given.
    fn insert(
        &mut self,
        device: DeviceId,
        reg: &MrRegistration,
        mem: &GuestMemory,
        keys: Option<(u32, u32)>,
    ) -> Result<(u32, u32), EngineError> {
        if reg.access & !access::MR_KNOWN != 0 {
            return Err(EngineError::Invalid("unknown access flags"));
        }
        if reg.access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0
            && reg.access & access::LOCAL_WRITE == 0
        {
            return Err(EngineError::Invalid(
                "remote write or atomic access needs local write",
            ));
        }
        if reg.iova.checked_add(reg.len).is_none() {
            return Err(EngineError::Invalid("IOVA range overflows"));
        }
        if reg.segments.len() > vrdma_spec::control::MAX_MR_PIECES {
            return Err(EngineError::Invalid("too many segments"));
        }
        let mut segments = Vec::with_capacity(reg.segments.len());
        let mut start: u64 = 0;
        for seg in &reg.segments {
            let map = mem
                .slot(seg.slot)
                .ok_or(EngineError::UnknownSlot(seg.slot))?;
            let end = seg.offset.checked_add(seg.len);
            if seg.len == 0 || end.is_none_or(|end| end > map.len() as u64) {
                return Err(EngineError::Invalid("segment outside its memory slot"));
            }
            segments.push(Segment {
                slot: seg.slot,
                map: Arc::clone(map),
                offset: usize::try_from(seg.offset)
                    .map_err(|_| EngineError::Invalid("segment offset"))?,
                len: seg.len,
                start,
            });
            start = start
                .checked_add(seg.len)
                .ok_or(EngineError::Invalid("segment lengths overflow"))?;
        }
        if start != reg.len {
            return Err(EngineError::Invalid("segment lengths do not add up to len"));
        }
        if self.counts.get(&device).copied().unwrap_or(0) >= MAX_MRS_PER_DEVICE {
            return Err(EngineError::Limit("memory regions"));
        }
        let (lkey, rkey) = match keys {
            Some((lkey, rkey)) => {
                self.claim(lkey, rkey)?;
                (lkey, rkey)
            }
            None => {
                let lkey_index = self.slot_index()?;
                let rkey_index = match self.slot_index() {
                    Ok(i) => i,
                    Err(e) => {
                        self.free.push(lkey_index);
                        return Err(e);
                    }
                };
                (
                    (lkey_index << 8) | u32::from(self.tag()),
                    (rkey_index << 8) | u32::from(self.tag()),
                )
            }
        };
        let (lkey_index, rkey_index) = (index_of(lkey), index_of(rkey));
        let mr = Mr {
            device,
            pd: reg.pd,
            access: reg.access,
            iova: reg.iova,
            len: reg.len,
            segments,
            revoked: false,
            lkey,
            rkey,
        };
        self.entries[rkey_index] = Some(Entry::Rkey { lkey, rkey });
        self.entries[lkey_index] = Some(Entry::Region(mr));
        *self.counts.entry(device).or_insert(0) += 1;
        Ok((lkey, rkey))
    }

    /// Takes the table slots of `lkey` and `rkey`, if both are free, distinct
    /// and not 0 (a restored region's keys).
    fn claim(&mut self, lkey: u32, rkey: u32) -> Result<(), EngineError> {
        let (l, r) = (index_of(lkey), index_of(rkey));
        // A restored key lies at most a device's worth of regions (twice:
        // two keys each) beyond the table's end, so that one request of a
        // hostile vdev grows the table by no more than that.
        let reach = self.entries.len().max(1) + 2 * MAX_MRS_PER_DEVICE;
        if l == 0 || r == 0 || l == r || l.max(r) >= MAX_MRS.min(reach) {
            return Err(EngineError::Invalid("restored keys"));
        }
        for i in [l, r] {
            if self.entries.get(i).is_some_and(Option::is_some) {
                return Err(EngineError::KeyTaken(if i == l { lkey } else { rkey }));
            }
        }
        if self.entries.is_empty() {
            self.entries.push(None);
        }
        // Slots between the table's end and the claimed ones are free.
        while self.entries.len() <= l.max(r) {
            self.free.push(self.entries.len() as u32);
            self.entries.push(None);
        }
        self.free.retain(|&i| i as usize != l && i as usize != r);
        Ok(())
    }

    /// A free table index (never 0, so no key is 0).
    fn slot_index(&mut self) -> Result<u32, EngineError> {
        if let Some(i) = self.free.pop() {
            return Ok(i);
        }
        if self.entries.is_empty() {
            self.entries.push(None);
        }
        if self.entries.len() >= MAX_MRS {
            return Err(EngineError::Limit("memory regions on the host"));
        }
        self.entries.push(None);
        Ok((self.entries.len() - 1) as u32)
    }

    /// The region whose lkey is `lkey`.
    fn by_lkey(&self, lkey: u32) -> Option<&Mr> {
        match self.entries.get(index_of(lkey))? {
            Some(Entry::Region(mr)) if mr.lkey == lkey => Some(mr),
            _ => None,
        }
    }

    /// The region whose rkey is `rkey`.
    fn by_rkey(&self, rkey: u32) -> Option<&Mr> {
        match self.entries.get(index_of(rkey))? {
            Some(Entry::Rkey { lkey, rkey: r }) if *r == rkey => self.by_lkey(*lkey),
            _ => None,
        }
    }

    /// Revokes the region `lkey` of `device`: its keys are gone when this
    /// returns.
    pub fn deregister(&mut self, device: DeviceId, lkey: u32) -> Result<(), EngineError> {
        let rkey = match self.by_lkey(lkey) {
            Some(mr) if mr.device == device => mr.rkey,
            _ => return Err(EngineError::UnknownKey(lkey)),
        };
        for key in [lkey, rkey] {
            let i = index_of(key);
            if let Some(entry) = self.entries.get_mut(i) {
                *entry = None;
                self.free.push(i as u32);
            }
        }
        if let Some(n) = self.counts.get_mut(&device) {
            *n = n.saturating_sub(1);
        }
        Ok(())
    }

    /// Revokes every region of `device` over slot `slot`.
    pub fn revoke_slot(&mut self, device: DeviceId, slot: u32) {
        for entry in self.entries.iter_mut().flatten() {
            if let Entry::Region(mr) = entry {
                if mr.device == device && mr.segments.iter().any(|s| s.slot == slot) {
                    mr.revoked = true;
                }
            }
        }
    }

    /// Forgets every region of `device`; returns their lkeys.
    pub fn remove_device(&mut self, device: DeviceId) -> Vec<u32> {
        let lkeys: Vec<u32> = (self.entries.iter().flatten())
            .filter_map(|e| match e {
                Entry::Region(mr) if mr.device == device => Some(mr.lkey),
                _ => None,
            })
            .collect();
        for &lkey in &lkeys {
            let _ = self.deregister(device, lkey);
        }
        self.counts.remove(&device);
        lkeys
    }

    /// The range `sge` names, if `device`'s work in `pd` may access it
    /// with `need`.
    pub fn local(&self, device: DeviceId, pd: u32, sge: &Sge, need: u32) -> Option<Extent<'_>> {
        let len = u64::from(sge.length.get());
        let mr = self.by_lkey(sge.lkey.get())?;
        let start = mr.check(device, pd, need, sge.addr.get(), len)?;
        Some(Extent {
            mr: Some(mr),
            start,
            len,
        })
    }

    /// The range `[addr, addr + len)` of the region `rkey` names, if
    /// `device`'s work in `pd` may access it with `need`.
    pub fn remote(
        &self,
        device: DeviceId,
        pd: u32,
        rkey: u32,
        addr: u64,
        len: u64,
        need: u32,
    ) -> Option<Extent<'_>> {
        let mr = self.by_rkey(rkey)?;
        let start = mr.check(device, pd, need, addr, len)?;
        Some(Extent {
            mr: Some(mr),
            start,
            len,
        })
    }

    /// Whether every SGE of `sges` is accessible to `device`'s work in
    /// `pd` with `need` (zero-length SGEs are skipped, as on IB).
    pub fn check_sges(&self, device: DeviceId, pd: u32, sges: &[Sge], need: u32) -> bool {
        SgeList::new(self, device, pd, sges, need).all_valid()
    }
}

/// A sequence of extents read or written in order: the gather or scatter
/// list of one side of a transfer.
pub trait Extents {
    /// Extent `i`, or `None` past the end (or where a key stopped
    /// resolving).
    fn get(&self, i: usize) -> Option<Extent<'_>>;

    /// Bytes `[skip, skip + len)` as one contiguous run of one mapping (its
    /// offset there), if they are one: the common case of one SGE over a
    /// region in one piece, which a copy then moves without walking.
    fn single_run(&self, skip: u64, len: u64) -> Option<(&SharedMapping, usize)>;
}

/// One extent.
impl Extents for Extent<'_> {
    fn get(&self, i: usize) -> Option<Extent<'_>> {
        (i == 0).then_some(*self)
    }

    fn single_run(&self, skip: u64, len: u64) -> Option<(&SharedMapping, usize)> {
        self.contiguous(skip, len)
    }
}

/// A list of SGEs, resolved through the key table as it is walked (the
/// last one resolved is kept: a walk asks for the same SGE many times).
pub struct SgeList<'a> {
    keys: &'a KeyTable,
    device: DeviceId,
    pd: u32,
    sges: &'a [Sge],
    need: u32,
    last: std::cell::Cell<Option<(usize, Extent<'a>)>>,
}

impl<'a> SgeList<'a> {
    /// `sges` of `device`'s work in `pd`, accessed with `need`.
    pub fn new(keys: &'a KeyTable, device: DeviceId, pd: u32, sges: &'a [Sge], need: u32) -> Self {
        SgeList {
            keys,
            device,
            pd,
            sges,
            need,
            last: std::cell::Cell::new(None),
        }
    }

    /// Whether every SGE resolves (a zero-length one always does), keeping
    /// the last one resolved for the walk that follows (a one-SGE list is
    /// looked up once for check and copy).
    pub fn all_valid(&self) -> bool {
        (0..self.sges.len()).all(|i| self.get(i).is_some())
    }
}

impl Extents for SgeList<'_> {
    fn get(&self, i: usize) -> Option<Extent<'_>> {
        if let Some((j, extent)) = self.last.get() {
            if i == j {
                return Some(extent);
            }
        }
        let sge = self.sges.get(i)?;
        let extent = if sge.length.get() == 0 {
            Extent {
                mr: None,
                start: 0,
                len: 0,
            }
        } else {
            self.keys.local(self.device, self.pd, sge, self.need)?
        };
        self.last.set(Some((i, extent)));
        Some(extent)
    }

    fn single_run(&self, skip: u64, len: u64) -> Option<(&SharedMapping, usize)> {
        if self.sges.len() != 1 {
            return None;
        }
        self.get(0)?.contiguous(skip, len)
    }
}

/// Where a walk over extents stands.
#[derive(Debug, Default, Clone, Copy)]
struct Cursor {
    extent: usize,
    offset: u64,
}

impl Cursor {
    /// The cursor at byte `skip` of the sequence (at its end when `skip`
    /// is its length).
    fn seek<E: Extents + ?Sized>(list: &E, mut skip: u64) -> Option<Cursor> {
        let mut extent = 0;
        loop {
            match list.get(extent) {
                Some(e) if skip < e.len => {
                    return Some(Cursor {
                        extent,
                        offset: skip,
                    })
                }
                Some(e) => {
                    skip -= e.len;
                    extent += 1;
                }
                None => return (skip == 0).then_some(Cursor { extent, offset: 0 }),
            }
        }
    }

    /// The contiguous run at the cursor: mapping, offset, bytes available.
    fn run<'e, E: Extents + ?Sized>(
        &mut self,
        list: &'e E,
    ) -> Option<(&'e SharedMapping, usize, u64)> {
        loop {
            let e = list.get(self.extent)?;
            if self.offset < e.len {
                let (map, at, avail) = e.mr?.run(e.start + self.offset)?;
                return Some((map, at, avail.min(e.len - self.offset)));
            }
            self.extent += 1;
            self.offset = 0;
        }
    }
}

/// Copies `len` bytes from byte `skip` of `src` to byte `skip` of `dst`
/// (a segment of a long message moves the same bytes of both sides);
/// false if either side runs out or a key stopped resolving.
pub fn copy<S: Extents + ?Sized, D: Extents + ?Sized>(
    src: &S,
    dst: &D,
    skip: u64,
    len: u64,
) -> bool {
    copy_between(src, skip, dst, skip, len)
}

/// Copies `len` bytes from byte `src_skip` of `src` to byte `dst_skip` of
/// `dst`.
pub fn copy_between<S: Extents + ?Sized, D: Extents + ?Sized>(
    src: &S,
    src_skip: u64,
    dst: &D,
    dst_skip: u64,
    len: u64,
) -> bool {
    if len == 0 {
        return true;
    }
    if let (Some((smap, soff)), Some((dmap, doff))) =
        (src.single_run(src_skip, len), dst.single_run(dst_skip, len))
    {
        return usize::try_from(len).is_ok_and(|n| smap.copy_to(soff, dmap, doff, n));
    }
    let (Some(mut s), Some(mut d)) = (Cursor::seek(src, src_skip), Cursor::seek(dst, dst_skip))
    else {
        return false;
    };
    let mut left = len;
    while left > 0 {
        let (Some((smap, soff, savail)), Some((dmap, doff, davail))) = (s.run(src), d.run(dst))
        else {
            return false;
        };
        let n = savail.min(davail).min(left);
        let Ok(n_usize) = usize::try_from(n) else {
            return false;
        };
        if !smap.copy_to(soff, dmap, doff, n_usize) {
            return false;
        }
        s.offset += n;
        d.offset += n;
        left -= n;
    }
    true
}

/// Writes `data` into `dst` from its first byte.
pub fn write_bytes<D: Extents + ?Sized>(data: &[u8], dst: &D) -> bool {
    scatter(data, dst, 0)
}

/// Reads `out.len()` bytes of `src` from byte `skip` into `out` (a packet
/// being built); false if `src` runs out or a key stopped resolving.
pub fn gather<S: Extents + ?Sized>(src: &S, skip: u64, out: &mut [u8]) -> bool {
    let Some(mut s) = Cursor::seek(src, skip) else {
        return out.is_empty();
    };
    let mut rest = out;
    while !rest.is_empty() {
        let Some((map, off, avail)) = s.run(src) else {
            return false;
        };
        let n = usize::try_from(avail).unwrap_or(usize::MAX).min(rest.len());
        let (now, later) = rest.split_at_mut(n);
        if !map.read(off, now) {
            return false;
        }
        s.offset += n as u64;
        rest = later;
    }
    true
}

/// Writes `data` into `dst` from byte `skip` (a packet's payload landing
/// in a message); false if `dst` runs out or a key stopped resolving.
pub fn scatter<D: Extents + ?Sized>(data: &[u8], dst: &D, skip: u64) -> bool {
    let Some(mut d) = Cursor::seek(dst, skip) else {
        return data.is_empty();
    };
    let mut rest = data;
    while !rest.is_empty() {
        let Some((map, off, avail)) = d.run(dst) else {
            return false;
        };
        let n = usize::try_from(avail).unwrap_or(usize::MAX).min(rest.len());
        if !map.write(off, &rest[..n]) {
            return false;
        }
        d.offset += n as u64;
        rest = &rest[n..];
    }
    true
}

/// The 8 bytes of an atomic's target, if they are one aligned run: then
/// the operation is a real atomic on guest memory.
fn atomic_word<'e>(target: &'e Extent<'e>) -> Option<&'e std::sync::atomic::AtomicU64> {
    let (map, at, avail) = target.mr?.run(target.start)?;
    (avail >= 8).then(|| map.atomic_u64(at))?
}

/// Executes an atomic on the 8 bytes of `target`: compare-and-swap when
/// `swap` is given, fetch-and-add of `operand` otherwise. Returns the
/// original value, or `None` if the target cannot be accessed.
///
/// A target that is one aligned run is updated with a real atomic, so
/// guest CPUs' atomics on it see a consistent word; otherwise (an IOVA
/// whose mapping is not 8-aligned) the bytes are read and written under
/// the engine's lock, which serializes it with every other RDMA atomic.
pub fn atomic(target: &Extent<'_>, operand: u64, swap: Option<u64>) -> Option<u64> {
    if let Some(word) = atomic_word(target) {
        let old = match swap {
            Some(new) => match word.compare_exchange(
                operand.to_le(),
                new.to_le(),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(v) | Err(v) => v,
            },
            None => {
                // fetch_add on the little-endian value.
                let mut cur = word.load(Ordering::Acquire);
                loop {
                    let new = u64::from_le(cur).wrapping_add(operand).to_le();
                    match word.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire)
                    {
                        Ok(_) => break cur,
                        Err(actual) => cur = actual,
                    }
                }
            }
        };
        return Some(u64::from_le(old));
    }
    let mut bytes = [0u8; 8];
    let mut got = 0;
    let mut c = Cursor::default();
    while got < 8 {
        let (map, at, avail) = c.run(target)?;
        let n = (avail as usize).min(8 - got);
        if !map.read(at, &mut bytes[got..got + n]) {
            return None;
        }
        got += n;
        c.offset += n as u64;
    }
    let old = u64::from_le_bytes(bytes);
    let new = match swap {
        Some(new) if old == operand => new,
        Some(_) => old,
        None => old.wrapping_add(operand),
    };
    write_bytes(&new.to_le_bytes(), target).then_some(old)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_hostd_protocol::messages::MrSegment;
    use vrdma_hostd_protocol::shm::sealed_memfd;

    const DEV: DeviceId = 1;
    const ALL: u32 =
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

    fn memory(slots: &[(u32, u64)]) -> (GuestMemory, Vec<SharedMapping>) {
        let mut mem = GuestMemory::default();
        let mut views = Vec::new();
        for &(slot, bytes) in slots {
            let file = sealed_memfd("keys-test", bytes).expect("memfd");
            views.push(SharedMapping::map(file.try_clone().expect("dup"), 0, bytes).expect("map"));
            mem.add(
                slot,
                u64::from(slot) << 32,
                SharedMapping::map(file, 0, bytes).expect("map"),
                crate::engine::guest::MAX_SLOTS,
            )
            .expect("slot");
        }
        (mem, views)
    }

    /// Registers an MR of PD 1 with every access at IOVA `iova` over
    /// `segments` (slot, offset, length) for `device`: its (lkey, rkey).
    fn register(
        keys: &mut KeyTable,
        mem: &GuestMemory,
        device: DeviceId,
        iova: u64,
        segments: &[(u32, u64, u64)],
    ) -> (u32, u32) {
        keys.register(device, &reg(1, ALL, iova, segments), mem)
            .expect("register")
    }

    fn reg(pd: u32, access: u32, iova: u64, segments: &[(u32, u64, u64)]) -> MrRegistration {
        MrRegistration {
            pd,
            access,
            iova,
            len: segments.iter().map(|s| s.2).sum(),
            segments: segments
                .iter()
                .map(|&(slot, offset, len)| MrSegment { slot, offset, len })
                .collect(),
        }
    }

    fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
        Sge {
            addr: addr.into(),
            length: length.into(),
            lkey: lkey.into(),
        }
    }

    #[test]
    fn keys_are_distinct_nonzero_and_found_only_by_their_kind() {
        let (mem, _) = memory(&[(0, 8192)]);
        let mut keys = KeyTable::new();
        let (lkey, rkey) = register(&mut keys, &mem, DEV, 0x1000, &[(0, 0, 4096)]);
        assert!(lkey != 0 && rkey != 0 && lkey != rkey);
        assert!(keys.local(DEV, 1, &sge(0x1000, 16, lkey), 0).is_some());
        assert!(
            keys.local(DEV, 1, &sge(0x1000, 16, rkey), 0).is_none(),
            "an rkey is no lkey"
        );
        assert!(
            keys.remote(DEV, 1, lkey, 0x1000, 16, 0).is_none(),
            "an lkey is no rkey"
        );
        assert!(keys
            .remote(DEV, 1, rkey, 0x1000, 16, access::REMOTE_WRITE)
            .is_some());
        assert!(
            keys.local(DEV, 2, &sge(0x1000, 16, lkey), 0).is_none(),
            "another PD"
        );
        assert!(
            keys.local(DEV + 1, 1, &sge(0x1000, 16, lkey), 0).is_none(),
            "another device"
        );
        assert!(
            keys.local(DEV, 1, &sge(0x1ff8, 16, lkey), 0).is_none(),
            "past the end"
        );
        assert!(
            keys.local(DEV, 1, &sge(0x0ff8, 16, lkey), 0).is_none(),
            "before the start"
        );
        assert!(
            keys.local(DEV, 1, &sge(0x1000, 16, lkey ^ 1), 0).is_none(),
            "wrong tag"
        );
        keys.deregister(DEV, lkey).expect("dereg");
        assert!(keys.local(DEV, 1, &sge(0x1000, 16, lkey), 0).is_none());
        assert!(keys.remote(DEV, 1, rkey, 0x1000, 16, 0).is_none());
        assert!(keys.deregister(DEV, lkey).is_err());
        // The freed indices are reused with fresh tags.
        let (l2, r2) = register(&mut keys, &mem, DEV, 0, &[(0, 0, 4096)]);
        assert!(keys.local(DEV, 1, &sge(0x1000, 16, lkey), 0).is_none() || l2 == lkey);
        assert!(keys.remote(DEV, 1, r2, 0, 16, 0).is_some());
    }

    #[test]
    fn registration_is_validated() {
        let (mem, _) = memory(&[(0, 8192)]);
        let mut keys = KeyTable::new();
        for bad in [
            reg(1, 1 << 30, 0, &[(0, 0, 16)]),
            reg(1, access::REMOTE_WRITE, 0, &[(0, 0, 16)]),
            reg(1, 0, u64::MAX, &[(0, 0, 16)]),
            reg(1, 0, 0, &[(0, 8000, 400)]),
            reg(1, 0, 0, &[(0, 0, 0)]),
            reg(1, 0, 0, &[(9, 0, 16)]),
        ] {
            assert!(keys.register(DEV, &bad, &mem).is_err(), "{bad:?}");
        }
        let mut lying = reg(1, 0, 0, &[(0, 0, 16)]);
        lying.len = 32;
        assert!(keys.register(DEV, &lying, &mem).is_err());
    }

    #[test]
    fn copies_walk_segments_and_sges() {
        // A region of two slots, the second piece first in the slot order.
        let (mem, views) = memory(&[(0, 8192), (1, 8192)]);
        let mut keys = KeyTable::new();
        let (src, _) = register(&mut keys, &mem, DEV, 0, &[(1, 100, 50), (0, 4000, 50)]);
        let (_, dst_r) = register(&mut keys, &mem, DEV, 0x9000, &[(0, 0, 4096)]);
        let pattern: Vec<u8> = (0..100u8).collect();
        assert!(views[1].write(100, &pattern[..50]));
        assert!(views[0].write(4000, &pattern[50..]));
        let sges = [sge(10, 40, src), sge(0, 0, 0), sge(50, 50, src)];
        let list = SgeList::new(&keys, DEV, 1, &sges, 0);
        let dst = keys
            .remote(DEV, 1, dst_r, 0x9000, 90, access::REMOTE_WRITE)
            .expect("dst");
        assert!(copy(&list, &dst, 0, 90));
        let mut out = [0u8; 90];
        assert!(views[0].read(0, &mut out));
        let mut want: Vec<u8> = (10..50u8).collect();
        want.extend(50..100u8);
        assert_eq!(&out[..], &want[..]);
        // A segment in the middle moves the same bytes.
        assert!(views[0].write(0, &[0u8; 90]));
        assert!(copy(&list, &dst, 30, 20));
        assert!(views[0].read(0, &mut out));
        assert_eq!(&out[30..50], &want[30..50]);
        assert_eq!(out[29], 0);
        assert!(!copy(&list, &dst, 0, 91), "the source runs out");
    }

    #[test]
    fn atomics_are_atomic_where_aligned_and_correct_everywhere() {
        let (mem, views) = memory(&[(0, 8192)]);
        let mut keys = KeyTable::new();
        let (_, aligned) = register(&mut keys, &mem, DEV, 0, &[(0, 0, 64)]);
        // IOVA 0 is mapping offset 3: never 8-aligned in the mapping.
        let (_, odd) = register(&mut keys, &mem, DEV, 0, &[(0, 3, 64)]);
        assert!(views[0].write(8, &41u64.to_le_bytes()));
        let t = keys
            .remote(DEV, 1, aligned, 8, 8, access::REMOTE_ATOMIC)
            .expect("target");
        assert_eq!(atomic(&t, 1, None), Some(41));
        assert_eq!(atomic(&t, 42, Some(7)), Some(42));
        assert_eq!(atomic(&t, 42, Some(9)), Some(7), "compare fails: unchanged");
        let mut word = [0u8; 8];
        assert!(views[0].read(8, &mut word));
        assert_eq!(u64::from_le_bytes(word), 7);
        let t = keys
            .remote(DEV, 1, odd, 16, 8, access::REMOTE_ATOMIC)
            .expect("target");
        assert!(views[0].write(19, &100u64.to_le_bytes()));
        assert_eq!(atomic(&t, 5, None), Some(100));
        assert!(views[0].read(19, &mut word));
        assert_eq!(u64::from_le_bytes(word), 105);
    }

    #[test]
    fn removed_slots_and_devices_revoke_their_regions() {
        let (mem, _) = memory(&[(0, 8192), (1, 8192)]);
        let mut keys = KeyTable::new();
        let (a, _) = register(&mut keys, &mem, DEV, 0, &[(0, 0, 64)]);
        let (b, _) = register(&mut keys, &mem, DEV, 0, &[(1, 0, 64)]);
        let (c, _) = register(&mut keys, &mem, DEV + 1, 0, &[(0, 0, 64)]);
        keys.revoke_slot(DEV, 0);
        assert!(keys.local(DEV, 1, &sge(0, 8, a), 0).is_none());
        assert!(keys.local(DEV, 1, &sge(0, 8, b), 0).is_some());
        assert!(
            keys.local(DEV + 1, 1, &sge(0, 8, c), 0).is_some(),
            "other devices keep theirs"
        );
        keys.remove_device(DEV);
        assert!(keys.local(DEV, 1, &sge(0, 8, b), 0).is_none());
        assert!(keys.local(DEV + 1, 1, &sge(0, 8, c), 0).is_some());
    }

    /// A restarted hostd takes a region back under the keys its driver
    /// and peers hold, wherever they lie in the table, and hands out none
    /// of them afterwards; keys whose slot holds another region now, or
    /// that are malformed, are refused.
    #[test]
    fn restored_regions_keep_their_keys() {
        let (mem, _) = memory(&[(0, 8192)]);
        let mut before = KeyTable::new();
        for _ in 0..5 {
            register(&mut before, &mem, DEV, 0, &[(0, 0, 16)]);
        }
        let (lkey, rkey) = register(&mut before, &mem, DEV, 0x1000, &[(0, 0, 4096)]);

        let mut after = KeyTable::new();
        let region = reg(1, ALL, 0x1000, &[(0, 0, 4096)]);
        assert_eq!(
            after.restore(DEV, &region, &mem, (lkey, rkey)),
            Ok((lkey, rkey))
        );
        assert!(after.local(DEV, 1, &sge(0x1000, 16, lkey), 0).is_some());
        assert!(after
            .remote(DEV, 1, rkey, 0x1000, 16, access::REMOTE_WRITE)
            .is_some());
        // New regions fill the slots below and beyond, never these.
        for _ in 0..12 {
            let (l, r) = register(&mut after, &mem, DEV, 0, &[(0, 0, 16)]);
            for key in [l, r] {
                assert!(
                    index_of(key) != index_of(lkey) && index_of(key) != index_of(rkey),
                    "{key:#x}"
                );
            }
        }
        let (l, _) = register(&mut after, &mem, DEV, 0, &[(0, 0, 16)]);
        assert_eq!(
            after.restore(DEV, &region, &mem, (l, 0x1_0000)),
            Err(EngineError::KeyTaken(l))
        );
        assert_eq!(
            after.restore(DEV, &region, &mem, (0x12, 0x1_0000)),
            Err(EngineError::Invalid("restored keys")),
            "index 0 is no key"
        );
        assert_eq!(
            after.restore(DEV, &region, &mem, (0x7fff_0000, 0x1_0000)),
            Err(EngineError::Invalid("restored keys")),
            "far beyond the table"
        );
        after.deregister(DEV, lkey).expect("deregistered");
        assert!(after.local(DEV, 1, &sge(0x1000, 16, lkey), 0).is_none());
    }
}
