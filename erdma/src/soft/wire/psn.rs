//! Packet sequence numbers: 24-bit values that wrap, compared as serial numbers.
//!
//! Owns PSN arithmetic. A PSN is never handled as a bare `u32` outside this type: mixing a
//! wrapped and an unwrapped value is the classic sequence-number bug.

use core::cmp::Ordering;
use core::fmt;
use core::ops::{Add, AddAssign, Sub};

/// A 24-bit packet sequence number.
///
/// Ordering is the sign of the 24-bit difference (`a < b` when `b - a` mod 2²⁴ lies in
/// `1..2²³`), as RoCE implementations compare PSNs. Two PSNs exactly 2²³ apart compare as "before"
/// both ways; the protocol keeps every compared pair far closer than that.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// The 24 bits a PSN has.
    pub const MASK: u32 = 0x00FF_FFFF;
    /// Number of distinct PSNs (2²⁴).
    pub const MODULUS: u32 = 1 << 24;
    /// PSN 0.
    pub const ZERO: Psn = Psn(0);

    /// A PSN from the low 24 bits of `v` (higher bits are discarded).
    #[inline]
    pub const fn new(v: u32) -> Psn {
        Psn(v & Self::MASK)
    }

    /// The 24-bit value.
    #[inline]
    pub const fn value(self) -> u32 {
        self.0
    }

    /// `self + n`, wrapping at 2²⁴.
    #[inline]
    pub const fn wrapping_add(self, n: u32) -> Psn {
        Psn(self.0.wrapping_add(n) & Self::MASK)
    }

    /// `self - n`, wrapping at 2²⁴.
    #[inline]
    pub const fn wrapping_sub(self, n: u32) -> Psn {
        Psn(self.0.wrapping_sub(n) & Self::MASK)
    }

    /// The signed distance `self - other` interpreted as a 24-bit two's-complement value
    /// (range `-2²³ ..= 2²³-1`). Positive means `self` is after `other`.
    #[inline]
    pub const fn diff(self, other: Psn) -> i32 {
        ((self.0.wrapping_sub(other.0) << 8) as i32) >> 8
    }

    /// How far `self` lies ahead of `earlier`, counting forward with wrap (`0 ..= 2²⁴-1`).
    #[inline]
    pub const fn distance_from(self, earlier: Psn) -> u32 {
        self.0.wrapping_sub(earlier.0) & Self::MASK
    }

    /// Serial-number comparison (the sign of [`Psn::diff`]).
    #[inline]
    pub const fn compare(self, other: Psn) -> Ordering {
        let d = self.diff(other);
        if d < 0 {
            Ordering::Less
        } else if d > 0 {
            Ordering::Greater
        } else {
            Ordering::Equal
        }
    }

    /// Whether `self` comes strictly before `other`.
    #[inline]
    pub const fn before(self, other: Psn) -> bool {
        self.diff(other) < 0
    }

    /// Whether `self` comes strictly after `other`.
    #[inline]
    pub const fn after(self, other: Psn) -> bool {
        self.diff(other) > 0
    }

    /// Whether `self` lies in the inclusive range `first ..= last` (with wrap).
    #[inline]
    pub const fn within(self, first: Psn, last: Psn) -> bool {
        self.distance_from(first) <= last.distance_from(first)
    }

    /// The later of two PSNs.
    #[inline]
    pub const fn later(self, other: Psn) -> Psn {
        if other.after(self) { other } else { self }
    }
}

impl From<Psn> for u32 {
    fn from(p: Psn) -> u32 {
        p.value()
    }
}

impl PartialOrd for Psn {
    #[inline]
    fn partial_cmp(&self, other: &Psn) -> Option<Ordering> {
        Some(self.compare(*other))
    }
}

impl Add<u32> for Psn {
    type Output = Psn;
    #[inline]
    fn add(self, n: u32) -> Psn {
        self.wrapping_add(n)
    }
}

impl AddAssign<u32> for Psn {
    #[inline]
    fn add_assign(&mut self, n: u32) {
        *self = self.wrapping_add(n);
    }
}

impl Sub<u32> for Psn {
    type Output = Psn;
    #[inline]
    fn sub(self, n: u32) -> Psn {
        self.wrapping_sub(n)
    }
}

impl Sub<Psn> for Psn {
    type Output = i32;
    /// The signed 24-bit difference, as [`Psn::diff`].
    #[inline]
    fn sub(self, other: Psn) -> i32 {
        self.diff(other)
    }
}

impl fmt::Debug for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psn({:#08x})", self.0)
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_to_24_bits() {
        assert_eq!(Psn::new(0x1234_5678).value(), 0x34_5678);
        assert_eq!(Psn::new(0xFF_FFFF) + 1, Psn::ZERO);
        assert_eq!(Psn::ZERO - 1, Psn::new(0xFF_FFFF));
        let mut p = Psn::new(0xFF_FFFE);
        p += 5;
        assert_eq!(p, Psn::new(3));
    }

    #[test]
    fn compares_across_the_wrap() {
        let a = Psn::new(0xFF_FFF0);
        let b = Psn::new(0x10);
        assert!(a < b);
        assert!(
            b > a,
            "the comparison is antisymmetric away from the half-way point"
        );
        assert_eq!(b - a, 0x20);
        assert_eq!(a - b, -0x20);
        assert_eq!(b.distance_from(a), 0x20);
        assert_eq!(a.distance_from(b), Psn::MODULUS - 0x20);
        assert!(Psn::new(5).within(a, b) && a.within(a, b) && b.within(a, b));
        assert!(!Psn::new(0x11).within(a, b) && !Psn::new(0xFF_FFEF).within(a, b));
        assert_eq!(a.later(b), b);
        assert_eq!(b.later(a), b);
    }

    #[test]
    fn diff_matches_the_kernel_formula() {
        // psn_compare(a, b) = (s32)((a - b) << 8), whose sign the diff must share.
        let cases = [
            (0u32, 0u32),
            (1, 0),
            (0, 1),
            (0x80_0000, 0),
            (0, 0x80_0000),
            (0x7F_FFFF, 0),
        ];
        for (a, b) in cases {
            let kernel = (a.wrapping_sub(b) << 8) as i32;
            let ours = Psn::new(a).diff(Psn::new(b));
            assert_eq!(kernel.signum(), ours.signum(), "{a:#x} vs {b:#x}");
        }
        // Exactly half the space apart: "before" both ways, as the kernel has it.
        assert!(Psn::new(0x80_0000).before(Psn::ZERO));
        assert!(Psn::ZERO.before(Psn::new(0x80_0000)));
    }
}
