//! The words of a generator state and the distributions derived from them, on the CPU.
//!
//! Everything here is a pure function of `(seed, offset)` and the element index, so a
//! request can be split across threads (or devices) anywhere on a 4-word block
//! boundary without changing a single bit. These are the reference implementations the
//! CUDA kernels are checked against.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::philox::stream_block;

/// How CPU fills use threads: sequentially, or split across rayon's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Par {
    /// One thread.
    Seq,
    /// rayon's global pool.
    #[default]
    Rayon,
}

impl Par {
    /// Rayon for requests of at least `threshold` elements, sequential below.
    pub fn for_len(len: usize, threshold: usize) -> Par {
        if len >= threshold {
            Par::Rayon
        } else {
            Par::Seq
        }
    }
}

/// Elements at and above which the [`Generator`](crate::Generator) fills use rayon.
pub const PAR_THRESHOLD: usize = 1 << 16;

/// Philox blocks per rayon task (4 words each).
const BLOCKS_PER_TASK: usize = 2048;

/// `2^-24`, the spacing of the uniform grid.
const TWO_POW_M24: f32 = 1.0 / 16_777_216.0;

/// The uniform `f32` in `[0, 1)` of one word: `(word >> 8) * 2^-24`, exact.
#[inline]
pub fn uniform_from_word(word: u32) -> f32 {
    (word >> 8) as f32 * TWO_POW_M24
}

/// The two standard normals of a word pair by Box–Muller (`spec/rng.md`):
/// `u1 = ((a >> 8) + 1) * 2^-24` in `(0, 1]`, `u2 = (b >> 8) * 2^-24`,
/// `r = sqrt(-2 ln u1)`, `(r cos 2πu2, r sin 2πu2)`.
///
/// Evaluated in `f64` and rounded once, so the CPU values are within half an ulp of
/// the exact Box–Muller values of the two words.
#[inline]
pub fn normal_pair_from_words(a: u32, b: u32) -> (f32, f32) {
    let u1 = f64::from((a >> 8) + 1) * f64::from(TWO_POW_M24);
    let u2 = f64::from(b >> 8) * f64::from(TWO_POW_M24);
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (2.0 * std::f64::consts::PI * u2).sin_cos();
    ((r * c) as f32, (r * s) as f32)
}

/// Applies `f(block_index, words, chunk)` to consecutive chunks of `per_block` elements
/// of `out` (the last may be shorter), where chunk `i` uses block `first_block + i` of
/// the stream keyed by `seed`.
fn for_each_block<T: Send>(
    out: &mut [T],
    per_block: usize,
    seed: u64,
    first_block: u64,
    par: Par,
    f: impl Fn([u32; 4], &mut [T]) + Sync,
) {
    let run = |task: usize, chunk: &mut [T]| {
        let base = first_block.wrapping_add((task * BLOCKS_PER_TASK) as u64);
        for (i, c) in chunk.chunks_mut(per_block).enumerate() {
            f(stream_block(seed, base.wrapping_add(i as u64)), c);
        }
    };
    let task_len = per_block * BLOCKS_PER_TASK;
    match par {
        Par::Seq => out
            .chunks_mut(task_len)
            .enumerate()
            .for_each(|(t, c)| run(t, c)),
        Par::Rayon => out
            .par_chunks_mut(task_len)
            .enumerate()
            .for_each(|(t, c)| run(t, c)),
    }
}

/// Writes words `offset .. offset + out.len()` of the stream keyed by `seed`.
///
/// `offset` must be a multiple of 4 (generator offsets always are).
pub fn fill_u32(seed: u64, offset: u64, out: &mut [u32], par: Par) {
    debug_assert_eq!(offset % 4, 0);
    for_each_block(out, 4, seed, offset / 4, par, |w, c| {
        c.copy_from_slice(&w[..c.len()])
    });
}

/// Writes the uniform floats of words `offset ..` of the stream keyed by `seed`.
pub fn fill_uniform(seed: u64, offset: u64, out: &mut [f32], par: Par) {
    debug_assert_eq!(offset % 4, 0);
    for_each_block(out, 4, seed, offset / 4, par, |w, c| {
        for (o, &w) in c.iter_mut().zip(&w) {
            *o = uniform_from_word(w);
        }
    });
}

/// Writes `mean + std * z` for the standard normals `z` of word pairs `offset ..` of the
/// stream keyed by `seed` (one pair per two values; an odd tail draws a whole pair).
pub fn fill_normal(seed: u64, offset: u64, out: &mut [f32], mean: f32, std: f32, par: Par) {
    debug_assert_eq!(offset % 4, 0);
    for_each_block(out, 4, seed, offset / 4, par, |w, c| {
        let (z0, z1) = normal_pair_from_words(w[0], w[1]);
        let (z2, z3) = normal_pair_from_words(w[2], w[3]);
        for (o, z) in c.iter_mut().zip([z0, z1, z2, z3]) {
            *o = mean + std * z;
        }
    });
}

/// A floating-point element dropout works on: `f32`, `bf16` or `f16`.
///
/// The kept value is `x * scale` computed in `f32` and rounded to nearest-even into the
/// element type; a NaN result is written as the canonical NaN a CUDA GPU produces
/// (`0x7FFFFFFF` for f32, `0x7FFF` for bf16 and f16), so CPU and GPU bytes agree even
/// for NaN inputs. Dropped elements are `+0`.
pub trait DropoutElement: Copy + Send + Sync + bytemuck::Pod + private::Sealed {
    /// The corresponding tensor dtype.
    const DTYPE: tessera_core::DType;
    /// `x * scale` in f32, rounded into `Self`, NaN canonicalised.
    fn scaled(self, scale: f32) -> Self;
    /// Positive zero.
    const ZERO: Self;
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

impl DropoutElement for f32 {
    const DTYPE: tessera_core::DType = tessera_core::DType::F32;
    const ZERO: Self = 0.0;
    #[inline]
    fn scaled(self, scale: f32) -> Self {
        let y = self * scale;
        if y.is_nan() {
            f32::from_bits(0x7FFF_FFFF)
        } else {
            y
        }
    }
}

impl DropoutElement for bf16 {
    const DTYPE: tessera_core::DType = tessera_core::DType::BF16;
    const ZERO: Self = bf16::ZERO;
    #[inline]
    fn scaled(self, scale: f32) -> Self {
        let y = self.to_f32() * scale;
        if y.is_nan() {
            bf16::from_bits(0x7FFF)
        } else {
            bf16::from_f32(y)
        }
    }
}

impl DropoutElement for f16 {
    const DTYPE: tessera_core::DType = tessera_core::DType::F16;
    const ZERO: Self = f16::ZERO;
    #[inline]
    fn scaled(self, scale: f32) -> Self {
        let y = self.to_f32() * scale;
        if y.is_nan() {
            f16::from_bits(0x7FFF)
        } else {
            f16::from_f32(y)
        }
    }
}

/// The scale kept elements are multiplied by: `1 / (1 - p)` in f32 (1 for `p == 1`,
/// where nothing is kept).
pub fn dropout_scale(p: f32) -> f32 {
    if p >= 1.0 { 1.0 } else { 1.0 / (1.0 - p) }
}

/// Dropout with drop probability `p` over words `offset ..` of the stream keyed by
/// `seed`: element `i` is kept iff `uniform_i >= p`; `out[i]` is `input[i] * scale` when
/// kept and `+0` when dropped, and `mask[i]` is 1 when kept and 0 when dropped.
///
/// The three slices must have equal lengths (checked by the callers).
pub fn dropout<T: DropoutElement>(
    seed: u64,
    offset: u64,
    p: f32,
    input: &[T],
    out: &mut [T],
    mask: &mut [u8],
    par: Par,
) {
    debug_assert_eq!(offset % 4, 0);
    debug_assert!(input.len() == out.len() && out.len() == mask.len());
    let scale = dropout_scale(p);
    let first_block = offset / 4;
    let run = |task: usize, (inp, (o, m)): (&[T], (&mut [T], &mut [u8]))| {
        let base = first_block.wrapping_add((task * BLOCKS_PER_TASK) as u64);
        for (i, ((inp, o), m)) in inp
            .chunks(4)
            .zip(o.chunks_mut(4))
            .zip(m.chunks_mut(4))
            .enumerate()
        {
            let w = stream_block(seed, base.wrapping_add(i as u64));
            for j in 0..inp.len() {
                let keep = uniform_from_word(w[j]) >= p;
                m[j] = u8::from(keep);
                o[j] = if keep { inp[j].scaled(scale) } else { T::ZERO };
            }
        }
    };
    let task = 4 * BLOCKS_PER_TASK;
    match par {
        Par::Seq => input
            .chunks(task)
            .zip(out.chunks_mut(task).zip(mask.chunks_mut(task)))
            .enumerate()
            .for_each(|(t, c)| run(t, c)),
        Par::Rayon => input
            .par_chunks(task)
            .zip(out.par_chunks_mut(task).zip(mask.par_chunks_mut(task)))
            .enumerate()
            .for_each(|(t, c)| run(t, c)),
    }
}

/// Words a request for `n` values consumes, rounded up to whole 4-word blocks: the
/// amount the generator offset advances by.
#[inline]
pub fn offset_increment(n: usize) -> u64 {
    4 * (n as u64).div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_grid_is_exact() {
        assert_eq!(uniform_from_word(0), 0.0);
        assert_eq!(uniform_from_word(u32::MAX), 1.0 - TWO_POW_M24);
        assert_eq!(uniform_from_word(0x100), TWO_POW_M24);
        assert_eq!(uniform_from_word(0xFF), 0.0);
    }

    #[test]
    fn normal_pair_edges_are_finite() {
        // u1 = 2^-24 is the smallest radius argument: r = sqrt(48 ln 2) ≈ 5.77.
        let (z0, z1) = normal_pair_from_words(0, 0);
        assert!((z0 - (48.0f64 * std::f64::consts::LN_2).sqrt() as f32).abs() < 1e-6);
        assert_eq!(z1, 0.0);
        // u1 = 1 gives r = 0.
        assert_eq!(normal_pair_from_words(u32::MAX, 12345), (0.0, 0.0));
    }

    #[test]
    fn nan_is_canonicalised_like_cuda() {
        assert_eq!(f32::NAN.scaled(2.0).to_bits(), 0x7FFF_FFFF);
        assert_eq!(bf16::from_bits(0xFFC1).scaled(2.0).to_bits(), 0x7FFF);
        assert_eq!(f16::from_bits(0xFE01).scaled(2.0).to_bits(), 0x7FFF);
        assert_eq!(bf16::from_f32(1.5).scaled(2.0), bf16::from_f32(3.0));
    }

    #[test]
    fn offsets_advance_in_whole_blocks() {
        assert_eq!(offset_increment(0), 0);
        assert_eq!(offset_increment(1), 4);
        assert_eq!(offset_increment(4), 4);
        assert_eq!(offset_increment(5), 8);
    }
}
