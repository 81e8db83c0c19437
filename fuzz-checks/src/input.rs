//! Fuzzer bytes read as a stream of small values; reads past the end give
//! zeros, so every input is a valid (if short) program.

/// A cursor over fuzzer bytes.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// Whether every byte was consumed.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Up to `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        head
    }

    /// `N` bytes, zero-padded at the end of the input.
    pub fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let got = self.bytes(N);
        out[..got.len()].copy_from_slice(got);
        out
    }

    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 != 0
    }

    /// One of `items`, `None` if there are none.
    pub fn pick<'b, T>(&mut self, items: &'b [T]) -> Option<&'b T> {
        if items.is_empty() {
            return None;
        }
        items.get(usize::from(self.u8()) % items.len())
    }
}
