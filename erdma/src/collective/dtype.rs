//! Element types and reduction operators: the arithmetic of a reduction, on plain byte slices.
//!
//! Owns the conversions between f32 and the two 16-bit float formats (round to nearest even,
//! NaN stays NaN, overflow gives infinity) and the kernels that fold one buffer into another.
//! Half-precision values are widened to f32, combined, and rounded once: every pairwise
//! reduction is correctly rounded. Knows nothing about queue pairs or ranks.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The type of the elements being reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32 (`float`).
    F32,
    /// IEEE 754 binary16 (`half`).
    F16,
    /// bfloat16: the upper half of a binary32 (`bfloat16`).
    Bf16,
    /// Two's-complement 32-bit integer (`int32`); sums wrap.
    I32,
}

impl DType {
    /// Every type, in the order tools list them.
    pub const ALL: [DType; 4] = [DType::F32, DType::F16, DType::Bf16, DType::I32];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// The name nccl-tests prints (`float`, `half`, `bfloat16`, `int32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F16 => "half",
            DType::Bf16 => "bfloat16",
            DType::I32 => "int32",
        }
    }

    /// Encodes `v` as one element (rounded to nearest even; integers saturate).
    pub fn encode(self, v: f64, out: &mut [u8]) {
        match self {
            DType::F32 => out[..4].copy_from_slice(&(v as f32).to_ne_bytes()),
            DType::F16 => out[..2].copy_from_slice(&f32_to_f16(v as f32).to_ne_bytes()),
            DType::Bf16 => out[..2].copy_from_slice(&f32_to_bf16(v as f32).to_ne_bytes()),
            DType::I32 => out[..4].copy_from_slice(&(v as i32).to_ne_bytes()),
        }
    }

    /// Decodes one element.
    pub fn decode(self, b: &[u8]) -> f64 {
        match self {
            DType::F32 => f32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
            DType::F16 => f16_to_f32(u16::from_ne_bytes([b[0], b[1]])) as f64,
            DType::Bf16 => bf16_to_f32(u16::from_ne_bytes([b[0], b[1]])) as f64,
            DType::I32 => i32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<DType> {
        match s.to_ascii_lowercase().as_str() {
            "float" | "f32" | "float32" => Ok(DType::F32),
            "half" | "f16" | "float16" => Ok(DType::F16),
            "bfloat16" | "bf16" => Ok(DType::Bf16),
            "int32" | "i32" | "int" => Ok(DType::I32),
            _ => Err(Error::invalid(format!(
                "unknown element type `{s}` (float, half, bfloat16, int32)"
            ))),
        }
    }
}

/// How elements are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Addition (integers wrap).
    Sum,
    /// Maximum (a NaN loses to a number).
    Max,
}

impl ReduceOp {
    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;

    fn from_str(s: &str) -> Result<ReduceOp> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "max" => Ok(ReduceOp::Max),
            _ => Err(Error::invalid(format!(
                "unknown reduction `{s}` (sum, max)"
            ))),
        }
    }
}

/// Folds `src` into `dst` element-wise: `dst[i] = op(dst[i], src[i])`.
///
/// # Errors
/// [`Error::InvalidArgument`] when the slices differ in length or are not whole elements.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) -> Result<()> {
    if dst.len() != src.len() || dst.len() % dtype.size() != 0 {
        return Err(Error::invalid(format!(
            "reducing {} bytes into {} bytes of {dtype}",
            src.len(),
            dst.len()
        )));
    }
    match (dtype, op) {
        (DType::F32, ReduceOp::Sum) => fold4(dst, src, |a, b| {
            (f32::from_bits(a) + f32::from_bits(b)).to_bits()
        }),
        (DType::F32, ReduceOp::Max) => fold4(dst, src, |a, b| {
            f32::from_bits(a).max(f32::from_bits(b)).to_bits()
        }),
        (DType::I32, ReduceOp::Sum) => {
            fold4(dst, src, |a, b| (a as i32).wrapping_add(b as i32) as u32)
        }
        (DType::I32, ReduceOp::Max) => fold4(dst, src, |a, b| (a as i32).max(b as i32) as u32),
        (DType::F16, ReduceOp::Sum) => {
            fold2(dst, src, |a, b| f32_to_f16(f16_to_f32(a) + f16_to_f32(b)))
        }
        (DType::F16, ReduceOp::Max) => fold2(dst, src, |a, b| {
            f32_to_f16(f16_to_f32(a).max(f16_to_f32(b)))
        }),
        (DType::Bf16, ReduceOp::Sum) => fold2(dst, src, |a, b| {
            f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b))
        }),
        (DType::Bf16, ReduceOp::Max) => fold2(dst, src, |a, b| {
            f32_to_bf16(bf16_to_f32(a).max(bf16_to_f32(b)))
        }),
    }
    Ok(())
}

fn fold4(dst: &mut [u8], src: &[u8], f: impl Fn(u32, u32) -> u32) {
    for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
        let a = u32::from_ne_bytes([d[0], d[1], d[2], d[3]]);
        let b = u32::from_ne_bytes([s[0], s[1], s[2], s[3]]);
        d.copy_from_slice(&f(a, b).to_ne_bytes());
    }
}

fn fold2(dst: &mut [u8], src: &[u8], f: impl Fn(u16, u16) -> u16) {
    for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
        let a = u16::from_ne_bytes([d[0], d[1]]);
        let b = u16::from_ne_bytes([s[0], s[1]]);
        d.copy_from_slice(&f(a, b).to_ne_bytes());
    }
}

/// Rounds an f32 to binary16 (nearest, ties to even).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        // Infinity stays infinity; a NaN stays a (quiet) NaN.
        let nan = if man != 0 {
            0x200 | (man >> 13) as u16
        } else {
            0
        };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // A binary16 subnormal (or zero): count units of 2^-24.
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        return sign | round_shift(m, shift) as u16;
    }
    let q = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    let up = rem > 0x1000 || (rem == 0x1000 && q & 1 == 1);
    // A carry out of the mantissa correctly bumps the exponent (up to infinity).
    sign | (q + up as u32) as u16
}

fn round_shift(m: u32, shift: u32) -> u32 {
    let q = m >> shift;
    let rem = m & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// Widens a binary16 to f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    if exp == 0 {
        let mag = man as f32 * f32::from_bits(0x3380_0000); // 2^-24
        return f32::from_bits(sign | mag.to_bits());
    }
    if exp == 0x1f {
        return f32::from_bits(sign | 0x7f80_0000 | (man << 13));
    }
    f32::from_bits(sign | ((exp + 112) << 23) | (man << 13))
}

/// Rounds an f32 to bfloat16 (nearest, ties to even; NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let bias = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(bias) >> 16) as u16
}

/// Widens a bfloat16 to f32 (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_round_trips_every_value() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan());
            } else {
                assert_eq!(f32_to_f16(f), h, "{h:#06x} -> {f}");
            }
            let g = bf16_to_f32(h);
            if g.is_nan() {
                assert!(bf16_to_f32(f32_to_bf16(g)).is_nan());
            } else {
                assert_eq!(f32_to_bf16(g), h, "{h:#06x} -> {g}");
            }
        }
    }

    #[test]
    fn half_rounds_to_nearest_even() {
        // 1 + 2^-11 lies halfway between 1 and the next binary16 (1 + 2^-10): ties to even (1).
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        // 1 + 3 * 2^-11 lies halfway between 1 + 2^-10 and 1 + 2^-9: ties to even (up).
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11) + 2f32.powi(-20)), 0x3c01);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds to infinity
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(2f32.powi(-24)), 0x0001);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000); // tie to even: zero
        assert_eq!(f32_to_f16(1.5 * 2f32.powi(-25)), 0x0001);
        assert_eq!(f32_to_f16(-0.0), 0x8000);
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80); // tie to even
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    }

    #[test]
    fn kernels_combine_elementwise() {
        let enc = |t: DType, v: &[f64]| {
            let mut out = vec![0u8; v.len() * t.size()];
            for (i, x) in v.iter().enumerate() {
                t.encode(*x, &mut out[i * t.size()..]);
            }
            out
        };
        for t in DType::ALL {
            let mut a = enc(t, &[1.0, -2.0, 3.0, 100.0]);
            let b = enc(t, &[4.0, 5.0, -6.0, -100.0]);
            reduce_into(t, ReduceOp::Sum, &mut a, &b).unwrap();
            let got: Vec<f64> = a.chunks(t.size()).map(|c| t.decode(c)).collect();
            assert_eq!(got, [5.0, 3.0, -3.0, 0.0], "{t}");
            let mut a = enc(t, &[1.0, -2.0, 3.0, 100.0]);
            reduce_into(t, ReduceOp::Max, &mut a, &b).unwrap();
            let got: Vec<f64> = a.chunks(t.size()).map(|c| t.decode(c)).collect();
            assert_eq!(got, [4.0, 5.0, 3.0, 100.0], "{t}");
        }
        let mut a = enc(DType::I32, &[i32::MAX as f64]);
        reduce_into(DType::I32, ReduceOp::Sum, &mut a, &enc(DType::I32, &[1.0])).unwrap();
        assert_eq!(DType::I32.decode(&a), i32::MIN as f64);
        assert!(reduce_into(DType::F32, ReduceOp::Sum, &mut [0u8; 4], &[0u8; 8]).is_err());
        assert!(reduce_into(DType::F32, ReduceOp::Sum, &mut [0u8; 6], &[0u8; 6]).is_err());
    }

    #[test]
    fn names_parse() {
        for t in DType::ALL {
            assert_eq!(t.name().parse::<DType>().unwrap(), t);
        }
        assert_eq!("bf16".parse::<DType>().unwrap(), DType::Bf16);
        assert!("f64".parse::<DType>().is_err());
        assert_eq!("MAX".parse::<ReduceOp>().unwrap(), ReduceOp::Max);
        assert!("prod".parse::<ReduceOp>().is_err());
    }
}
