//! Philox4x32-10, the counter-based generator behind every tessera random stream.

/// Multiplier applied to counter word 0 in each round.
const M0: u32 = 0xD251_1F53;
/// Multiplier applied to counter word 2 in each round.
const M1: u32 = 0xCD9E_8D57;
/// Key bump for key word 0 between rounds (the golden ratio).
const W0: u32 = 0x9E37_79B9;
/// Key bump for key word 1 between rounds (sqrt(3) - 1).
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds (Salmon et al., SC'11), as in Random123 and cuRAND.
///
/// `counter` is the 128-bit counter `[c0, c1, c2, c3]` and `key` the 64-bit key
/// `[k0, k1]`. Each round multiplies `c0` and `c2` into 64-bit products and mixes them
/// with the other words and the key; the key is bumped between rounds. The CUDA kernels
/// implement the same function, word for word.
///
/// ```
/// use tessera_rng::philox4x32_10;
/// assert_eq!(
///     philox4x32_10([0, 0, 0, 0], [0, 0]),
///     [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
/// );
/// ```
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let p0 = u64::from(M0) * u64::from(c0);
        let p1 = u64::from(M1) * u64::from(c2);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    }
    [c0, c1, c2, c3]
}

/// The four words of block `block` of the stream keyed by `seed` (`spec/rng.md`):
/// counter `[lo32(block), hi32(block), 0, 0]`, key `[lo32(seed), hi32(seed)]`.
#[inline]
pub(crate) fn stream_block(seed: u64, block: u64) -> [u32; 4] {
    philox4x32_10(
        [block as u32, (block >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The known-answer vectors of Random123 (`kat_vectors`), repeated in `spec/rng.md`.
    #[test]
    fn known_answers() {
        let cases = [
            (
                [0, 0, 0, 0],
                [0, 0],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (ctr, key, want) in cases {
            assert_eq!(
                philox4x32_10(ctr, key),
                want,
                "counter {ctr:08x?} key {key:08x?}"
            );
        }
    }

    #[test]
    fn stream_block_splits_seed_and_block_into_words() {
        let seed = 0x0123_4567_89ab_cdef_u64;
        let block = 0xfedc_ba98_7654_3210_u64;
        assert_eq!(
            stream_block(seed, block),
            philox4x32_10([0x7654_3210, 0xfedc_ba98, 0, 0], [0x89ab_cdef, 0x0123_4567])
        );
    }
}
