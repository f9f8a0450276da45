//! CRC-32 (the reflected IEEE/zlib one `crc32fast` computes, which the ICRC uses) over bytes
//! reached only through a raw pointer: no reference is ever made to them, so memory a peer may
//! write while it is read (a region registered with remote write or atomic access) is hashed in
//! place rather than copied out first.
//!
//! On x86_64 with PCLMULQDQ (detected at run time; `std` caches the answer) the bulk is folded
//! with carry-less multiplication, the scheme of Intel's "Fast CRC Computation for Generic
//! Polynomials Using PCLMULQDQ Instruction" with its published constants for the reflected
//! polynomial 0xEDB88320: four accumulators of 64 bytes (AVX-512 VPCLMULQDQ), 32 bytes (AVX2
//! VPCLMULQDQ) or 16 bytes (PCLMULQDQ alone), the same kernels `crc32fast` picks for a slice, so
//! hashing in place costs what hashing a slice does. The folded 16-byte remainder and the last
//! bytes (fewer than 16) are copied to a small local array and finished by `crc32fast`.
//! Elsewhere, under Miri, and for inputs shorter than 64 bytes, the bytes are copied out 512 at
//! a time and hashed from the copy.
//!
//! The reads may race with a peer's writes. That is the race every RDMA device has: a peer
//! rewriting a request's source while it is sent puts some mix of old and new bytes on the wire.
//! The CRC covers exactly the bytes read here, while the bytes sent are read again when they are
//! sent; a packet whose bytes changed in between fails the receiver's ICRC check and is
//! retransmitted.

use crc32fast::Hasher;

/// Feeds the `len` bytes at `ptr` to `hasher`, as `hasher.update` over a slice of them would,
/// without making a reference to them.
///
/// # Safety
/// `len` bytes at `ptr` are readable (inside one live allocation) for the whole call. Others may
/// write them meanwhile; the CRC then covers some mix of old and new bytes (module docs).
pub(crate) unsafe fn update(hasher: &mut Hasher, ptr: *const u8, len: usize) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if len >= clmul::MIN_LEN && clmul::available() {
        let crc = hasher.clone().finalize();
        // SAFETY: `len` readable bytes at `ptr` for the call (this function's contract; racing
        // writes are accepted, module docs), `len >= MIN_LEN`, and `available`.
        let crc = unsafe { clmul::update(crc, ptr, len) };
        *hasher = Hasher::new_with_initial_len(crc, hasher.total_len() + len as u64);
        return;
    }
    // SAFETY: `len` readable bytes at `ptr` for the call (this function's contract).
    unsafe { chunked(hasher, ptr, len) }
}

/// [`update`] by copying the bytes out 512 at a time and hashing the copies.
///
/// # Safety
/// As [`update`].
unsafe fn chunked(hasher: &mut Hasher, ptr: *const u8, len: usize) {
    let mut chunk = [0u8; 512];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(chunk.len());
        // SAFETY: `n` bytes at `ptr + at` lie inside the `len` readable bytes at `ptr` (the
        // caller's guarantee; racing writes accepted, module docs); the destination is a distinct
        // local buffer of at least `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptr.add(at), chunk.as_mut_ptr(), n) };
        hasher.update(&chunk[..n]);
        at += n;
    }
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
mod clmul {
    // The crate's minimum Rust (1.85) has every intrinsic as an `unsafe fn` and no safe
    // `#[target_feature]` functions; newer compilers make the arithmetic intrinsics safe where
    // their features are enabled, which would leave those blocks unused.
    #![allow(unused_unsafe)]

    use std::arch::x86_64::{
        __m128i, _mm_clmulepi64_si128, _mm_cvtsi32_si128, _mm_loadu_si128, _mm_set_epi64x,
        _mm_storeu_si128, _mm_xor_si128,
    };
    #[cfg(erdma_vpclmulqdq)]
    use std::arch::x86_64::{
        __m256i, __m512i, _mm256_clmulepi64_epi128, _mm256_extracti128_si256, _mm256_loadu_si256,
        _mm256_set_epi64x, _mm256_xor_si256, _mm256_zextsi128_si256, _mm512_clmulepi64_epi128,
        _mm512_extracti32x4_epi32, _mm512_loadu_si512, _mm512_set_epi64, _mm512_xor_si512,
        _mm512_zextsi128_si512,
    };

    use crc32fast::Hasher;

    /// The shortest input [`update`] and [`sse`] take: one step's four 16-byte lanes.
    pub(super) const MIN_LEN: usize = 64;
    /// The shortest input [`avx2`] takes: one step's four 32-byte lanes.
    #[cfg(erdma_vpclmulqdq)]
    pub(super) const AVX2_MIN_LEN: usize = 128;
    /// The shortest input [`avx512`] takes: one step's four 64-byte lanes.
    #[cfg(erdma_vpclmulqdq)]
    pub(super) const AVX512_MIN_LEN: usize = 256;

    // Folding constants for the reflected polynomial 0xEDB88320 (Intel's white paper; the same
    // numbers are in zlib, Linux and crc32fast, and the unit tests check them against
    // `crc32fast`): bit-reflected x^e mod P(x), shifted left by one. A 128-bit lane's low half
    // is multiplied by the first of a pair, its high half by the second.
    /// e = 2048 ± 32: carries a lane 256 bytes forward (the AVX-512 loop's step).
    #[cfg(erdma_vpclmulqdq)]
    const K_256_BYTES: (i64, i64) = (0x1_1542_778a, 0x1_322d_1430);
    /// e = 1024 ± 32: carries a lane 128 bytes forward (the AVX2 loop's step).
    #[cfg(erdma_vpclmulqdq)]
    const K_128_BYTES: (i64, i64) = (0x1_e88e_f372, 0x1_4a7f_e880);
    /// e = 512 ± 32: carries a lane 64 bytes forward.
    const K_64_BYTES: (i64, i64) = (0x1_5444_2bd4, 0x1_c6e4_1596);
    /// e = 128 ± 32: carries a lane 16 bytes forward.
    const K_16_BYTES: (i64, i64) = (0x1_7519_97d0, 0x0_ccaa_009e);

    /// Whether this CPU has carry-less multiplication (SSE2, the rest [`sse`] uses, is part of
    /// x86_64). `std` caches the detection, so this is a load and a test.
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("pclmulqdq")
    }

    /// Whether this CPU runs [`avx2`] (cached by `std` as [`available`] is).
    #[cfg(erdma_vpclmulqdq)]
    pub(super) fn avx2_available() -> bool {
        available()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
    }

    /// Whether this CPU runs [`avx512`] (cached by `std` as [`available`] is).
    #[cfg(erdma_vpclmulqdq)]
    pub(super) fn avx512_available() -> bool {
        available()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
    }

    /// The CRC-32 `crc` continued over the `len` bytes at `ptr` (zlib's `crc32(crc, buf, len)`),
    /// by the widest kernel this CPU and `len` allow.
    ///
    /// # Safety
    /// `len >= MIN_LEN`; `len` readable bytes at `ptr` for the call (others may write them
    /// meanwhile); [`available`].
    pub(super) unsafe fn update(crc: u32, ptr: *const u8, len: usize) -> u32 {
        #[cfg(erdma_vpclmulqdq)]
        if len >= AVX512_MIN_LEN && avx512_available() {
            // SAFETY: this function's contract, `len >= AVX512_MIN_LEN`, and the CPU features
            // `avx512_available` found.
            return unsafe { avx512(crc, ptr, len) };
        }
        #[cfg(erdma_vpclmulqdq)]
        if len >= AVX2_MIN_LEN && avx2_available() {
            // SAFETY: this function's contract, `len >= AVX2_MIN_LEN`, and the CPU features
            // `avx2_available` found.
            return unsafe { avx2(crc, ptr, len) };
        }
        // SAFETY: this function's contract (`len >= MIN_LEN`, PCLMULQDQ).
        unsafe { sse(crc, ptr, len) }
    }

    /// `a` carried forward by the distance of `k` (a pair of the constants above), added to `b`.
    ///
    /// # Safety
    /// The CPU has PCLMULQDQ.
    #[inline]
    #[target_feature(enable = "pclmulqdq")]
    unsafe fn fold(a: __m128i, b: __m128i, k: __m128i) -> __m128i {
        // SAFETY: register arithmetic; PCLMULQDQ (this function's contract), SSE2 (x86_64).
        unsafe {
            let lo = _mm_clmulepi64_si128::<0x00>(a, k);
            let hi = _mm_clmulepi64_si128::<0x11>(a, k);
            _mm_xor_si128(_mm_xor_si128(b, lo), hi)
        }
    }

    /// [`fold`] on each of two 128-bit lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 and VPCLMULQDQ.
    #[cfg(erdma_vpclmulqdq)]
    #[clippy::msrv = "1.89"] // compiled only by compilers that have it (build.rs)
    #[inline]
    #[target_feature(enable = "avx2,vpclmulqdq")]
    unsafe fn fold2(a: __m256i, b: __m256i, k: __m256i) -> __m256i {
        // SAFETY: register arithmetic; AVX2 and VPCLMULQDQ (this function's contract).
        unsafe {
            let lo = _mm256_clmulepi64_epi128::<0x00>(a, k);
            let hi = _mm256_clmulepi64_epi128::<0x11>(a, k);
            _mm256_xor_si256(_mm256_xor_si256(b, lo), hi)
        }
    }

    /// [`fold`] on each of four 128-bit lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F and VPCLMULQDQ.
    #[cfg(erdma_vpclmulqdq)]
    #[clippy::msrv = "1.89"] // compiled only by compilers that have it (build.rs)
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    unsafe fn fold4(a: __m512i, b: __m512i, k: __m512i) -> __m512i {
        // SAFETY: register arithmetic; AVX-512F and VPCLMULQDQ (this function's contract).
        unsafe {
            let lo = _mm512_clmulepi64_epi128::<0x00>(a, k);
            let hi = _mm512_clmulepi64_epi128::<0x11>(a, k);
            _mm512_xor_si512(_mm512_xor_si512(b, lo), hi)
        }
    }

    /// The 16 bytes at `p`, unaligned.
    ///
    /// # Safety
    /// 16 readable bytes at `p` for the call (others may write them meanwhile).
    #[inline]
    unsafe fn load(p: *const u8) -> __m128i {
        // SAFETY: 16 readable bytes at `p` (this function's contract); `_mm_loadu_si128` needs
        // no alignment and makes no reference, and SSE2 is part of x86_64.
        unsafe { _mm_loadu_si128(p.cast::<__m128i>()) }
    }

    /// The 32 bytes at `p`, unaligned.
    ///
    /// # Safety
    /// 32 readable bytes at `p` for the call (others may write them meanwhile); AVX.
    #[cfg(erdma_vpclmulqdq)]
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn load32(p: *const u8) -> __m256i {
        // SAFETY: 32 readable bytes at `p` (this function's contract); `_mm256_loadu_si256`
        // needs no alignment and makes no reference; AVX (this function's contract).
        unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) }
    }

    /// The 64 bytes at `p`, unaligned.
    ///
    /// # Safety
    /// 64 readable bytes at `p` for the call (others may write them meanwhile); AVX-512F.
    #[cfg(erdma_vpclmulqdq)]
    #[clippy::msrv = "1.89"] // compiled only by compilers that have it (build.rs)
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load64(p: *const u8) -> __m512i {
        // SAFETY: 64 readable bytes at `p` (this function's contract); `_mm512_loadu_si512`
        // needs no alignment and makes no reference; AVX-512F (this function's contract).
        unsafe { _mm512_loadu_si512(p.cast()) }
    }

    /// [`update`] with PCLMULQDQ alone, 64 bytes a step.
    ///
    /// # Safety
    /// `len >= MIN_LEN`; `len` readable bytes at `ptr` for the call (others may write them
    /// meanwhile); the CPU has PCLMULQDQ.
    #[target_feature(enable = "pclmulqdq")]
    pub(super) unsafe fn sse(crc: u32, ptr: *const u8, len: usize) -> u32 {
        debug_assert!(len >= MIN_LEN);
        // SAFETY: 64 of the `len >= 64` readable bytes at `ptr` (this function's contract). The
        // rest is register arithmetic on SSE2 (x86_64).
        let x = unsafe {
            // Starting from register `!crc` is starting from zero with `!crc` added to the first
            // four bytes (reflected: the low 32 bits of the first lane).
            let first = _mm_xor_si128(load(ptr), _mm_cvtsi32_si128(!crc as i32));
            [
                first,
                load(ptr.add(16)),
                load(ptr.add(32)),
                load(ptr.add(48)),
            ]
        };
        // SAFETY: `64 <= len` readable bytes at `ptr` (this function's contract); PCLMULQDQ.
        unsafe { finish(x, ptr, 64, len) }
    }

    /// [`update`] for `len >= AVX2_MIN_LEN`, 128 bytes a step with AVX2 VPCLMULQDQ (the kernel
    /// `crc32fast` itself picks on such CPUs without AVX-512).
    ///
    /// # Safety
    /// `len >= AVX2_MIN_LEN`; `len` readable bytes at `ptr` for the call (others may write them
    /// meanwhile); the CPU has AVX2, VPCLMULQDQ and PCLMULQDQ.
    #[cfg(erdma_vpclmulqdq)]
    #[clippy::msrv = "1.89"] // compiled only by compilers that have it (build.rs)
    #[target_feature(enable = "pclmulqdq,avx2,vpclmulqdq")]
    pub(super) unsafe fn avx2(crc: u32, ptr: *const u8, len: usize) -> u32 {
        debug_assert!(len >= AVX2_MIN_LEN);
        // Every `load32(ptr.add(at))` below has `at + 32 <= len`: the first four because
        // `len >= 128`, the loop's because it runs while `len - at >= 128`.
        // SAFETY: 128 of the `len >= 128` readable bytes at `ptr` (this function's contract);
        // the rest is register arithmetic on the CPU features of this function's contract.
        let (mut v, k) = unsafe {
            // As in `sse`; the zero extension keeps the other 224 bits zero.
            let init = _mm256_zextsi128_si256(_mm_cvtsi32_si128(!crc as i32));
            let v = [
                _mm256_xor_si256(load32(ptr), init),
                load32(ptr.add(32)),
                load32(ptr.add(64)),
                load32(ptr.add(96)),
            ];
            let (lo, hi) = K_128_BYTES;
            (v, _mm256_set_epi64x(hi, lo, hi, lo))
        };
        let mut at = 128;
        while len - at >= 128 {
            // SAFETY: `at + 128 <= len`: inside the readable bytes (this function's contract);
            // the folds need AVX2 and VPCLMULQDQ (this function's contract).
            unsafe {
                for (i, lane) in v.iter_mut().enumerate() {
                    *lane = fold2(*lane, load32(ptr.add(at + 32 * i)), k);
                }
            }
            at += 128;
        }
        // SAFETY: register arithmetic on the CPU features of this function's contract.
        let x = unsafe {
            // The first 64 bytes carried onto the last 64: four 16-byte lanes in order.
            let (lo, hi) = K_64_BYTES;
            let k = _mm256_set_epi64x(hi, lo, hi, lo);
            let a = fold2(v[0], v[2], k);
            let b = fold2(v[1], v[3], k);
            [
                _mm256_extracti128_si256::<0>(a),
                _mm256_extracti128_si256::<1>(a),
                _mm256_extracti128_si256::<0>(b),
                _mm256_extracti128_si256::<1>(b),
            ]
        };
        // SAFETY: `at <= len` readable bytes at `ptr` (this function's contract); PCLMULQDQ.
        unsafe { finish(x, ptr, at, len) }
    }

    /// [`update`] for `len >= AVX512_MIN_LEN`, 256 bytes a step with AVX-512 VPCLMULQDQ (the
    /// kernel `crc32fast` itself picks on such CPUs).
    ///
    /// # Safety
    /// `len >= AVX512_MIN_LEN`; `len` readable bytes at `ptr` for the call (others may write
    /// them meanwhile); the CPU has AVX-512F, VPCLMULQDQ and PCLMULQDQ.
    #[cfg(erdma_vpclmulqdq)]
    #[clippy::msrv = "1.89"] // compiled only by compilers that have it (build.rs)
    #[target_feature(enable = "pclmulqdq,avx512f,vpclmulqdq")]
    pub(super) unsafe fn avx512(crc: u32, ptr: *const u8, len: usize) -> u32 {
        debug_assert!(len >= AVX512_MIN_LEN);
        // Every `load64(ptr.add(at))` below has `at + 64 <= len`: the first four because
        // `len >= 256`, the loop's because it runs while `len - at >= 256`.
        // SAFETY: 256 of the `len >= 256` readable bytes at `ptr` (this function's contract);
        // the rest is register arithmetic on the CPU features of this function's contract.
        let (mut v, k) = unsafe {
            // As in `sse`; the zero extension keeps the other 480 bits zero.
            let init = _mm512_zextsi128_si512(_mm_cvtsi32_si128(!crc as i32));
            let v = [
                _mm512_xor_si512(load64(ptr), init),
                load64(ptr.add(64)),
                load64(ptr.add(128)),
                load64(ptr.add(192)),
            ];
            let (lo, hi) = K_256_BYTES;
            (v, _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo))
        };
        let mut at = 256;
        while len - at >= 256 {
            // SAFETY: `at + 256 <= len`: inside the readable bytes (this function's contract);
            // the folds need AVX-512F and VPCLMULQDQ (this function's contract).
            unsafe {
                for (i, lane) in v.iter_mut().enumerate() {
                    *lane = fold4(*lane, load64(ptr.add(at + 64 * i)), k);
                }
            }
            at += 256;
        }
        // SAFETY: register arithmetic on the CPU features of this function's contract.
        let x = unsafe {
            // The four 64-byte accumulators into one, which holds four 16-byte lanes in order.
            let (lo, hi) = K_64_BYTES;
            let k = _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
            let r = fold4(fold4(fold4(v[0], v[1], k), v[2], k), v[3], k);
            [
                _mm512_extracti32x4_epi32::<0>(r),
                _mm512_extracti32x4_epi32::<1>(r),
                _mm512_extracti32x4_epi32::<2>(r),
                _mm512_extracti32x4_epi32::<3>(r),
            ]
        };
        // SAFETY: `at <= len` readable bytes at `ptr` (this function's contract); PCLMULQDQ.
        unsafe { finish(x, ptr, at, len) }
    }

    /// Finishes a CRC whose first `at` bytes are folded into the four 16-byte lanes `x` (the 64
    /// bytes of `x`, hashed from a zero register, leave the register those `at` bytes leave).
    ///
    /// # Safety
    /// `at <= len`; `len` readable bytes at `ptr` for the call (others may write them
    /// meanwhile); the CPU has PCLMULQDQ.
    #[inline]
    #[target_feature(enable = "pclmulqdq")]
    unsafe fn finish(mut x: [__m128i; 4], ptr: *const u8, mut at: usize, len: usize) -> u32 {
        // Every `load(ptr.add(at))` below has `at + 16 <= len`: the loops run while
        // `len - at >= 64` (or `>= 16`).
        // SAFETY: SSE2 (x86_64).
        let k = unsafe { _mm_set_epi64x(K_64_BYTES.1, K_64_BYTES.0) };
        while len - at >= 64 {
            // SAFETY: `at + 64 <= len`: inside the readable bytes (this function's contract);
            // the folds need PCLMULQDQ (this function's contract).
            unsafe {
                for (i, lane) in x.iter_mut().enumerate() {
                    *lane = fold(*lane, load(ptr.add(at + 16 * i)), k);
                }
            }
            at += 64;
        }
        // SAFETY: register arithmetic; PCLMULQDQ (this function's contract), SSE2 (x86_64).
        let (mut r, k) = unsafe {
            let k = _mm_set_epi64x(K_16_BYTES.1, K_16_BYTES.0);
            (fold(fold(fold(x[0], x[1], k), x[2], k), x[3], k), k)
        };
        while len - at >= 16 {
            // SAFETY: `at + 16 <= len`: inside the readable bytes (this function's contract);
            // PCLMULQDQ (this function's contract).
            r = unsafe { fold(r, load(ptr.add(at)), k) };
            at += 16;
        }
        // Everything read so far, run from a zero register, leaves the register that the 16
        // bytes of `r` leave from a zero register. Those and the last `< 16` bytes are finished
        // from a local copy: a zero register is `crc32fast`'s initial value `!0`.
        let rest = len - at;
        let mut tail = [0u8; 32];
        // SAFETY: `tail` is a local buffer of 32 writable bytes; the store needs no alignment.
        unsafe { _mm_storeu_si128(tail.as_mut_ptr().cast::<__m128i>(), r) };
        // SAFETY: `rest < 16` bytes at `ptr + at` end at `ptr + len`, inside the readable bytes
        // (this function's contract); the destination is `tail[16..]`, distinct and long enough.
        unsafe { std::ptr::copy_nonoverlapping(ptr.add(at), tail.as_mut_ptr().add(16), rest) };
        let mut h = Hasher::new_with_initial(!0);
        h.update(&tail[..16 + rest]);
        h.finalize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(init: u32, bytes: &[u8]) -> u32 {
        let mut h = Hasher::new_with_initial(init);
        h.update(bytes);
        h.finalize()
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    const INITS: [u32; 4] = [0, !0, 0x1234_5678, 0xdead_beef];

    /// Checks every path against `crc32fast` over `buf[at..at + len]`.
    fn check(buf: &[u8], at: usize, len: usize, init: u32) {
        let src = &buf[at..at + len];
        let w = want(init, src);
        let mut h = Hasher::new_with_initial_len(init, 7);
        // SAFETY: `len` readable bytes at `src`, which nothing writes during the call.
        unsafe { update(&mut h, src.as_ptr(), len) };
        assert_eq!(h.total_len(), 7 + len as u64, "length {len} at {at}");
        assert_eq!(
            h.finalize(),
            w,
            "update: length {len} at {at}, init {init:#x}"
        );
        let mut h = Hasher::new_with_initial(init);
        // SAFETY: as above.
        unsafe { chunked(&mut h, src.as_ptr(), len) };
        assert_eq!(
            h.finalize(),
            w,
            "chunked: length {len} at {at}, init {init:#x}"
        );
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if len >= clmul::MIN_LEN && clmul::available() {
            // SAFETY: as above; the length and the CPU were checked.
            let got = unsafe { clmul::sse(init, src.as_ptr(), len) };
            assert_eq!(got, w, "sse: length {len} at {at}, init {init:#x}");
        }
        #[cfg(all(target_arch = "x86_64", not(miri), erdma_vpclmulqdq))]
        if len >= clmul::AVX2_MIN_LEN && clmul::avx2_available() {
            // SAFETY: as above; the length and the CPU were checked.
            let got = unsafe { clmul::avx2(init, src.as_ptr(), len) };
            assert_eq!(got, w, "avx2: length {len} at {at}, init {init:#x}");
        }
        #[cfg(all(target_arch = "x86_64", not(miri), erdma_vpclmulqdq))]
        if len >= clmul::AVX512_MIN_LEN && clmul::avx512_available() {
            // SAFETY: as above; the length and the CPU were checked.
            let got = unsafe { clmul::avx512(init, src.as_ptr(), len) };
            assert_eq!(got, w, "avx512: length {len} at {at}, init {init:#x}");
        }
    }

    #[test]
    fn every_short_length_alignment_and_initial_value() {
        let max = if cfg!(miri) { 80 } else { 600 };
        let buf = bytes(max + 16, 1);
        for len in 0..=max {
            for at in 0..16 {
                for init in INITS {
                    check(&buf, at, len, init);
                }
            }
        }
    }

    #[test]
    fn random_lengths_to_64_kib() {
        let buf = bytes(64 * 1024 + 16, 2);
        let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
        let rounds = if cfg!(miri) { 2 } else { 200 };
        for i in 0..rounds {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let len = match i {
                0 => 64 * 1024,
                1 => 4096,
                _ => (s % (64 * 1024 + 1)) as usize,
            };
            let at = ((s >> 32) % 16) as usize;
            check(&buf, at, len, INITS[i % INITS.len()]);
        }
    }

    #[test]
    fn known_answer() {
        let mut h = Hasher::new();
        let msg = b"123456789".repeat(16);
        // SAFETY: `msg.len()` readable bytes at `msg`, unchanged during the call.
        unsafe { update(&mut h, msg[..9].as_ptr(), 9) };
        assert_eq!(h.finalize(), 0xcbf4_3926);
        let mut h = Hasher::new();
        // SAFETY: as above.
        unsafe { update(&mut h, msg.as_ptr(), msg.len()) };
        assert_eq!(h.finalize(), crc32fast::hash(&msg));
    }
}
