//! The ICRC of a packet sent inside a UDP GSO message.
//!
//! When the kernel (or a NIC) cuts a GSO message into datagrams it numbers
//! their IPv4 IDs: the first keeps the message's ID (0: DF set, socket not
//! connected), segment `k` gets ID `k` (measured: `ip link set lo
//! gso_max_segs 1` and three 1000-byte segments arrive with IDs 0, 1, 2).
//! The ICRC covers the ID, and the engine builds every packet for ID 0, so
//! [`super::UdpIo`] sends segment `k`'s ICRC corrected for ID `k`: a CRC is
//! linear, so changing the ID by `k` changes the CRC by the CRC (from 0, no
//! final inversion) of `k` followed by as many zero bytes as the ICRC
//! covers after the ID field.

/// The reflected CRC-32 polynomial the ICRC uses.
const POLY: u32 = 0xEDB8_8320;

/// Bytes the ICRC covers after the IPv4 ID field and before the UDP
/// payload: the rest of the IPv4 header (bytes 6..20) and the UDP header.
const AFTER_ID: usize = 14 + 8;

/// The ICRC's length at the end of the UDP payload.
pub(super) const ICRC_LEN: usize = 4;

/// How many doublings of zero bytes [`ZEROS`] holds: up to 2^14 - 1
/// bytes, more than any packet.
const DOUBLINGS: usize = 14;

/// A linear map of a CRC register: entry `i` is the image of bit `i`.
type Matrix = [u32; 32];

const fn times(m: &Matrix, mut v: u32) -> u32 {
    let (mut out, mut i) = (0u32, 0usize);
    while v != 0 {
        if v & 1 != 0 {
            out ^= m[i];
        }
        v >>= 1;
        i += 1;
    }
    out
}

const fn square(m: &Matrix) -> Matrix {
    let mut out = [0u32; 32];
    let mut i = 0;
    while i < 32 {
        out[i] = times(m, m[i]);
        i += 1;
    }
    out
}

/// One bit into the register (a zero bit: data bits are XORed in first).
const fn bit_step(reg: u32) -> u32 {
    if reg & 1 != 0 {
        (reg >> 1) ^ POLY
    } else {
        reg >> 1
    }
}

/// `ZEROS[j]` feeds `2^j` zero bytes through a register.
static ZEROS: [Matrix; DOUBLINGS] = zero_operators();

const fn zero_operators() -> [Matrix; DOUBLINGS] {
    let mut byte = [0u32; 32];
    let mut i = 0;
    while i < 32 {
        let mut reg = 1u32 << i;
        let mut b = 0;
        while b < 8 {
            reg = bit_step(reg);
            b += 1;
        }
        byte[i] = reg;
        i += 1;
    }
    let mut ops = [[0u32; 32]; DOUBLINGS];
    ops[0] = byte;
    let mut j = 1;
    while j < DOUBLINGS {
        ops[j] = square(&ops[j - 1]);
        j += 1;
    }
    ops
}

/// `reg` after `n` zero bytes (`n` below 2^14).
fn feed_zeros(mut reg: u32, n: usize) -> u32 {
    debug_assert!(n < 1 << DOUBLINGS);
    for (j, op) in ZEROS.iter().enumerate() {
        if n & (1 << j) != 0 {
            reg = times(op, reg);
        }
    }
    reg
}

/// How the ICRC of a `udp_len`-byte UDP payload changes when its IPv4 ID
/// goes from 0 to `id`.
fn delta_for_id(id: u16, udp_len: usize) -> u32 {
    let mut reg = 0u32;
    for byte in id.to_be_bytes() {
        reg ^= u32::from(byte);
        for _ in 0..8 {
            reg = bit_step(reg);
        }
    }
    feed_zeros(reg, AFTER_ID + udp_len.saturating_sub(ICRC_LEN))
}

/// `icrc` (for IPv4 ID 0) changed by `delta`. Stored as the little-endian
/// bytes of the (inverted) CRC, like rxe; the inversion cancels in the
/// XOR.
fn apply(icrc: [u8; ICRC_LEN], delta: u32) -> [u8; ICRC_LEN] {
    (u32::from_le_bytes(icrc) ^ delta).to_le_bytes()
}

/// The ICRC bytes of a `udp_len`-byte UDP payload whose ICRC bytes (its
/// last four) are `icrc` for IPv4 ID 0, for IPv4 ID `id` instead.
pub(super) fn icrc_for_id(icrc: [u8; ICRC_LEN], id: u16, udp_len: usize) -> [u8; ICRC_LEN] {
    apply(icrc, delta_for_id(id, udp_len))
}

/// The ICRC changes of the segments of one run, all `udp_len` bytes long:
/// the change is linear in the ID, so the change for ID `k` is the XOR of
/// the changes for `k`'s bits, each computed once per run (a run of 64
/// small packets costs 6 of [`icrc_for_id`]'s computations, not 63).
pub(super) struct IdDeltas {
    bits: [u32; 16],
}

impl IdDeltas {
    /// The changes for IDs up to `max_id` of `udp_len`-byte payloads.
    pub(super) fn new(udp_len: usize, max_id: u16) -> IdDeltas {
        let mut bits = [0u32; 16];
        let used = 16 - max_id.leading_zeros() as usize;
        for (b, delta) in bits.iter_mut().enumerate().take(used) {
            *delta = delta_for_id(1 << b, udp_len);
        }
        IdDeltas { bits }
    }

    /// `icrc` (for ID 0) for ID `id` (at most the `max_id` given).
    pub(super) fn icrc_for(&self, icrc: [u8; ICRC_LEN], id: u16) -> [u8; ICRC_LEN] {
        let delta = (0..16)
            .filter(|b| id & (1 << b) != 0)
            .fold(0, |d, b| d ^ self.bits[b]);
        apply(icrc, delta)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The ICRC of a packet from IPv4 ID `id`, straight from its
    /// definition (bit by bit): 8 bytes of ones for the LRH, the IPv4 header
    /// with TOS, TTL and checksum all ones, the UDP header with checksum all
    /// ones, the UDP payload with the BTH's reserved byte all ones, up to the
    /// ICRC; inverted, stored little-endian.
    pub(crate) fn reference_icrc(id: u16, udp_payload_without_icrc: &[u8]) -> [u8; 4] {
        let mut ip = [0x45u8, 0xff, 0, 0, 0, 0, 0x40, 0, 0xff, 17, 0xff, 0xff];
        ip[4..6].copy_from_slice(&id.to_be_bytes());
        let total = (20 + 8 + udp_payload_without_icrc.len() + 4) as u16;
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        let mut data = vec![0xffu8; 8];
        data.extend_from_slice(&ip);
        data.extend_from_slice(&[10, 201, 0, 1, 10, 201, 0, 2]);
        let udp_len = total - 20;
        data.extend_from_slice(&[0x12, 0xb7, 0x12, 0xb7]);
        data.extend_from_slice(&udp_len.to_be_bytes());
        data.extend_from_slice(&[0xff, 0xff]);
        let mut payload = udp_payload_without_icrc.to_vec();
        if payload.len() > 4 {
            payload[4] = 0xff;
        }
        data.extend_from_slice(&payload);
        let mut reg = 0xffff_ffffu32;
        for byte in data {
            reg ^= u32::from(byte);
            for _ in 0..8 {
                reg = bit_step(reg);
            }
        }
        (!reg).to_le_bytes()
    }

    #[test]
    fn the_corrected_icrc_is_the_icrc_computed_for_that_id() {
        for len in [4usize, 5, 12, 64, 1000, 1500, 4096 + 60] {
            let payload: Vec<u8> = (0..len - 4).map(|i| (i * 7 + len) as u8).collect();
            let at0 = reference_icrc(0, &payload);
            for id in [1u16, 2, 3, 17, 63, 255, 256, 0xffff] {
                assert_eq!(
                    icrc_for_id(at0, id, len),
                    reference_icrc(id, &payload),
                    "len {len} id {id}"
                );
            }
            assert_eq!(icrc_for_id(at0, 0, len), at0);
            let deltas = IdDeltas::new(len, 0xffff);
            for id in [0u16, 1, 5, 63, 64, 1000, 0xffff] {
                assert_eq!(
                    deltas.icrc_for(at0, id),
                    icrc_for_id(at0, id, len),
                    "len {len} id {id}"
                );
            }
            let small = IdDeltas::new(len, 63);
            for id in 0..64u16 {
                assert_eq!(
                    small.icrc_for(at0, id),
                    icrc_for_id(at0, id, len),
                    "len {len} id {id}"
                );
            }
        }
    }

    #[test]
    fn the_zero_operators_match_feeding_zeros_bit_by_bit() {
        for n in [0usize, 1, 2, 3, 100, 4321] {
            let mut slow = 0x1234_5678u32;
            for _ in 0..n * 8 {
                slow = bit_step(slow);
            }
            assert_eq!(feed_zeros(0x1234_5678, n), slow, "{n}");
        }
    }
}
