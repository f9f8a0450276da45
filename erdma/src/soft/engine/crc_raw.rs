//! CRC-32 (the reflected IEEE/zlib one `crc32fast` computes, which the ICRC uses) over bytes
//! reached only through a raw pointer: no reference is ever made to them, so memory a peer may
//! write while it is read (a region registered with remote write or atomic access) is hashed in
//! place rather than copied out first.
//!
//! On x86_64 with PCLMULQDQ (detected at run time; `std` caches the answer) the bulk is folded
//! 64 bytes a step with carry-less multiplication, four 128-bit lanes at a time, the scheme of
//! Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction" with its
//! published constants for the reflected polynomial 0xEDB88320. The folded remainder and the
//! last bytes (fewer than 32) are copied to a small local array and finished by `crc32fast`.
//! Elsewhere, under Miri, and for inputs shorter than one fold, the bytes are copied out 512 at
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
        // writes are accepted, module docs), `len >= MIN_LEN`, and `available` found PCLMULQDQ.
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
    use std::arch::x86_64::{
        __m128i, _mm_clmulepi64_si128, _mm_cvtsi32_si128, _mm_loadu_si128, _mm_set_epi64x,
        _mm_storeu_si128, _mm_xor_si128,
    };

    use crc32fast::Hasher;

    /// The shortest input [`update`] takes: one fold step's four lanes.
    pub(super) const MIN_LEN: usize = 64;

    // Folding constants for the reflected polynomial 0xEDB88320 (Intel's white paper; the same
    // numbers are in zlib, Linux and crc32fast): bit-reflected x^e mod P(x), shifted left by one.
    /// e = 4·128 + 32: folds a lane's low half across 64 bytes.
    const K1: i64 = 0x1_5444_2bd4;
    /// e = 4·128 − 32: folds a lane's high half across 64 bytes.
    const K2: i64 = 0x1_c6e4_1596;
    /// e = 128 + 32: folds the low half across 16 bytes.
    const K3: i64 = 0x1_7519_97d0;
    /// e = 128 − 32: folds the high half across 16 bytes.
    const K4: i64 = 0x0_ccaa_009e;

    /// Whether this CPU has carry-less multiplication (SSE2, the rest used here, is part of
    /// x86_64). `std` caches the detection, so this is a load and a test.
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("pclmulqdq")
    }

    /// `a` carried 16 bytes (`k` = K3/K4) or 64 bytes (`k` = K1/K2) forward, added to `b`.
    #[inline]
    #[target_feature(enable = "pclmulqdq")]
    fn fold(a: __m128i, b: __m128i, k: __m128i) -> __m128i {
        let lo = _mm_clmulepi64_si128::<0x00>(a, k);
        let hi = _mm_clmulepi64_si128::<0x11>(a, k);
        _mm_xor_si128(_mm_xor_si128(b, lo), hi)
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

    /// The CRC-32 `crc` continued over the `len` bytes at `ptr` (zlib's `crc32(crc, buf, len)`).
    ///
    /// # Safety
    /// `len >= MIN_LEN`; `len` readable bytes at `ptr` for the call (others may write them
    /// meanwhile); the CPU has PCLMULQDQ.
    #[target_feature(enable = "pclmulqdq")]
    pub(super) unsafe fn update(crc: u32, ptr: *const u8, len: usize) -> u32 {
        debug_assert!(len >= MIN_LEN);
        // Every `load(ptr.add(at))` below has `at + 16 <= len`: the first four because
        // `len >= 64`, the loop's because it runs while `len - at >= 64` (or `>= 16`).
        // SAFETY: 64 of the `len >= 64` readable bytes at `ptr` (this function's contract).
        let mut x = unsafe {
            [
                load(ptr),
                load(ptr.add(16)),
                load(ptr.add(32)),
                load(ptr.add(48)),
            ]
        };
        // Starting from register `!crc` is starting from zero with `!crc` added to the first
        // four bytes (reflected: the low 32 bits of the first lane).
        x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128(!crc as i32));
        let mut at = 64;
        let k1k2 = _mm_set_epi64x(K2, K1);
        while len - at >= 64 {
            // SAFETY: `at + 64 <= len`: inside the readable bytes (this function's contract).
            let next = unsafe {
                [
                    load(ptr.add(at)),
                    load(ptr.add(at + 16)),
                    load(ptr.add(at + 32)),
                    load(ptr.add(at + 48)),
                ]
            };
            for (lane, next) in x.iter_mut().zip(next) {
                *lane = fold(*lane, next, k1k2);
            }
            at += 64;
        }
        let k3k4 = _mm_set_epi64x(K4, K3);
        let mut r = fold(x[0], x[1], k3k4);
        r = fold(r, x[2], k3k4);
        r = fold(r, x[3], k3k4);
        while len - at >= 16 {
            // SAFETY: `at + 16 <= len`: inside the readable bytes (this function's contract).
            r = fold(r, unsafe { load(ptr.add(at)) }, k3k4);
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
            let got = unsafe { clmul::update(init, src.as_ptr(), len) };
            assert_eq!(got, w, "clmul: length {len} at {at}, init {init:#x}");
        }
    }

    #[test]
    fn every_short_length_alignment_and_initial_value() {
        let max = if cfg!(miri) { 80 } else { 300 };
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
