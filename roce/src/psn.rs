//! 24-bit packet sequence numbers.

/// The PSN field's width mask.
pub const PSN_MASK: u32 = 0x00ff_ffff;

/// A 24-bit packet sequence number: arithmetic wraps at 2^24, and
/// comparisons go through [`Psn::diff`] (a window of 2^23 on either side),
/// as IBA 9.7.1 orders PSNs.
///
/// The field is public for pattern matching; make values with
/// [`Psn::new`], which masks to 24 bits (`build` refuses a wider value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(pub u32);

impl Psn {
    /// The PSN of the low 24 bits of `v`.
    pub const fn new(v: u32) -> Psn {
        Psn(v & PSN_MASK)
    }

    /// The value, in 0..2^24.
    pub const fn get(self) -> u32 {
        self.0 & PSN_MASK
    }

    /// `self + n`, wrapping at 2^24.
    #[allow(clippy::should_implement_trait)] // PSNs are not numbers: no `+`.
    pub const fn add(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_add(n))
    }

    /// `self - n`, wrapping at 2^24.
    #[allow(clippy::should_implement_trait)]
    pub const fn sub(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_sub(n))
    }

    /// The signed distance `self - other` in (-2^23, 2^23]: positive when
    /// `self` is after `other`. Exactly 2^23 apart is ambiguous and reads as
    /// "after" (+2^23).
    pub const fn diff(self, other: Psn) -> i32 {
        // Shift the 24-bit difference into the top of a 32-bit word and
        // back: two's complement sign-extends it.
        let d = (self.0.wrapping_sub(other.0) << 8) as i32 >> 8;
        if d == -(1 << 23) {
            1 << 23
        } else {
            d
        }
    }

    /// Whether `self` comes strictly after `other` in the window.
    pub const fn is_after(self, other: Psn) -> bool {
        self.diff(other) > 0
    }
}

impl std::fmt::Display for Psn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wraps_at_24_bits() {
        let max = Psn::new(PSN_MASK);
        assert_eq!(max.add(1), Psn(0));
        assert_eq!(max.add(2), Psn(1));
        assert_eq!(Psn(0).sub(1), max);
        assert_eq!(Psn(5).sub(7), Psn(PSN_MASK - 1));
        assert_eq!(Psn::new(0x1_23_45_67), Psn(0x23_45_67));
        assert_eq!(Psn(0xffff_ffff).get(), PSN_MASK);
        assert_eq!(Psn(10).add(u32::MAX), Psn(9));
    }

    #[test]
    fn diff_across_the_wrap() {
        let max = Psn::new(PSN_MASK);
        assert_eq!(Psn(0).diff(max), 1);
        assert_eq!(max.diff(Psn(0)), -1);
        assert_eq!(Psn(3).diff(Psn(PSN_MASK - 2)), 6);
        assert_eq!(Psn(PSN_MASK - 2).diff(Psn(3)), -6);
        assert_eq!(Psn(7).diff(Psn(7)), 0);
        // The half-way point is "after" from either side.
        assert_eq!(Psn(1 << 23).diff(Psn(0)), 1 << 23);
        assert_eq!(Psn(0).diff(Psn(1 << 23)), 1 << 23);
        assert_eq!(Psn((1 << 23) + 1).diff(Psn(0)), -((1 << 23) - 1));
        assert!(Psn(0).is_after(max));
        assert!(!max.is_after(Psn(0)));
    }

    proptest! {
        #[test]
        fn add_then_diff(a in 0u32..=PSN_MASK, n in 0u32..(1 << 23)) {
            let a = Psn(a);
            let b = a.add(n);
            prop_assert_eq!(b.diff(a), n as i32);
            prop_assert_eq!(a.diff(b), -(n as i32));
            prop_assert_eq!(b.sub(n), a);
            prop_assert!(b.get() <= PSN_MASK);
        }

        #[test]
        fn diff_is_in_range(a in any::<u32>(), b in any::<u32>()) {
            let d = Psn::new(a).diff(Psn::new(b));
            prop_assert!(d > -(1 << 23) && d <= 1 << 23);
            prop_assert_eq!(Psn::new(b).add(d as u32), Psn::new(a));
        }
    }
}
