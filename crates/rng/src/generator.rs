//! The generator: a `(seed, offset)` state and the fills that draw from it.

use half::{bf16, f16};
use tessera_core::{DType, Device, Error, Replay, Result, Snapshot, Tensor};

use crate::stream::{self, DropoutElement, PAR_THRESHOLD, Par, offset_increment};

/// The state of a generator: the Philox key and how many 32-bit words of its stream
/// have been used (`spec/rng.md`). `offset` is always a multiple of 4.
///
/// A state is a plain value: two generators with equal states draw equal numbers, on
/// any device and with any launch configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GeneratorState {
    /// The Philox key, `[lo32(seed), hi32(seed)]`.
    pub seed: u64,
    /// Words of the stream consumed so far (a multiple of 4).
    pub offset: u64,
}

impl GeneratorState {
    /// A fresh state: `seed` at offset 0.
    pub fn new(seed: u64) -> Self {
        GeneratorState { seed, offset: 0 }
    }

    /// Checks the offset invariant.
    pub fn validate(self) -> Result<Self> {
        if !self.offset.is_multiple_of(4) {
            return Err(Error::invalid(
                "GeneratorState",
                format!(
                    "offset {} is not a multiple of 4; offsets count whole 4-word Philox blocks",
                    self.offset
                ),
            ));
        }
        Ok(self)
    }
}

/// A Philox4x32-10 random generator with PyTorch-style `(seed, offset)` state.
///
/// Every fill draws the next words of the stream and advances the offset by the
/// words used, rounded up to a multiple of 4, so a fill of `n` values split into two
/// fills at a multiple of 4 gives the same values. Fills exist for host slices
/// (rayon-parallel above [`PAR_THRESHOLD`] elements) and for [`Tensor`]s on any
/// device, where CUDA tensors are filled by PTX kernels with the same bits.
///
/// | fill | words per value | bit-identical across devices |
/// |---|---|---|
/// | [`fill_u32`](Self::fill_u32) | 1 | yes |
/// | [`fill_uniform`](Self::fill_uniform): `(w >> 8) * 2^-24` | 1 | yes |
/// | [`dropout`](Self::dropout): keep iff uniform `>= p` | 1 | yes |
/// | [`fill_normal`](Self::fill_normal): Box–Muller | 1 (pairs) | within [`NORMAL_TOLERANCE`](crate::NORMAL_TOLERANCE) |
///
/// ```
/// use tessera_rng::Generator;
///
/// let mut a = Generator::new(42);
/// let mut whole = [0u32; 12];
/// a.fill_u32(&mut whole);
///
/// let mut b = Generator::new(42);
/// let (mut x, mut y) = ([0u32; 8], [0u32; 4]);
/// b.fill_u32(&mut x);
/// b.fill_u32(&mut y);
/// assert_eq!([&x[..], &y[..]].concat(), whole);
/// assert_eq!(b.offset(), 12);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generator {
    state: GeneratorState,
}

impl Generator {
    /// A generator seeded with `seed`, at offset 0.
    pub fn new(seed: u64) -> Self {
        Generator {
            state: GeneratorState::new(seed),
        }
    }

    /// A generator at `state` (the offset must be a multiple of 4).
    pub fn from_state(state: GeneratorState) -> Result<Self> {
        Ok(Generator {
            state: state.validate()?,
        })
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.state.seed
    }

    /// Words of the stream consumed so far.
    pub fn offset(&self) -> u64 {
        self.state.offset
    }

    /// The full state.
    pub fn state(&self) -> GeneratorState {
        self.state
    }

    /// Moves the generator to `state` (the offset must be a multiple of 4).
    pub fn set_state(&mut self, state: GeneratorState) -> Result<()> {
        self.state = state.validate()?;
        Ok(())
    }

    /// Reseeds at offset 0.
    pub fn manual_seed(&mut self, seed: u64) {
        self.state = GeneratorState::new(seed);
    }

    /// Reserves the words for `n` values: returns the state to draw them from and
    /// advances past them. The offset wraps modulo 2^64 words (after 2^64 words the
    /// stream repeats).
    pub fn advance(&mut self, n: usize) -> GeneratorState {
        let at = self.state;
        self.state.offset = at.offset.wrapping_add(offset_increment(n));
        at
    }

    /// Fills `out` with the next words of the stream.
    pub fn fill_u32(&mut self, out: &mut [u32]) {
        let s = self.advance(out.len());
        stream::fill_u32(
            s.seed,
            s.offset,
            out,
            Par::for_len(out.len(), PAR_THRESHOLD),
        );
    }

    /// Fills `out` with uniform floats in `[0, 1)`: `(word >> 8) * 2^-24`.
    pub fn fill_uniform(&mut self, out: &mut [f32]) {
        let s = self.advance(out.len());
        stream::fill_uniform(
            s.seed,
            s.offset,
            out,
            Par::for_len(out.len(), PAR_THRESHOLD),
        );
    }

    /// Fills `out` with normals of mean `mean` and standard deviation `std` by
    /// Box–Muller on word pairs (`mean + std * z`, in f32).
    pub fn fill_normal(&mut self, out: &mut [f32], mean: f32, std: f32) {
        let s = self.advance(out.len());
        let par = Par::for_len(out.len(), PAR_THRESHOLD);
        stream::fill_normal(s.seed, s.offset, out, mean, std, par);
    }

    /// Dropout with drop probability `p` in `[0, 1]`: writes `out[i] = input[i] / (1 -
    /// p)` for kept elements and `+0` for dropped ones, and `mask[i]` = 1 (kept) or 0.
    /// Element `i` is kept iff its uniform is `>= p`.
    ///
    /// Fails when `p` is outside `[0, 1]` or NaN, or the slices differ in length; the
    /// generator does not advance then.
    pub fn dropout<T: DropoutElement>(
        &mut self,
        input: &[T],
        p: f32,
        out: &mut [T],
        mask: &mut [u8],
    ) -> Result<()> {
        check_probability(p)?;
        if out.len() != input.len() || mask.len() != input.len() {
            return Err(Error::shape(
                "Generator::dropout",
                format!(
                    "input, output and mask must have equal lengths, got {}, {} and {}",
                    input.len(),
                    out.len(),
                    mask.len()
                ),
            ));
        }
        let s = self.advance(input.len());
        let par = Par::for_len(input.len(), PAR_THRESHOLD);
        stream::dropout(s.seed, s.offset, p, input, out, mask, par);
        Ok(())
    }

    /// Fills a `u32` tensor on any device with the next words of the stream.
    pub fn fill_u32_tensor(&mut self, t: &mut Tensor) -> Result<()> {
        t.expect_dtype("Generator::fill_u32_tensor", DType::U32)?;
        self.fill_tensor(t, Fill::U32)
    }

    /// Fills an `f32` tensor on any device with uniform floats in `[0, 1)`.
    pub fn fill_uniform_tensor(&mut self, t: &mut Tensor) -> Result<()> {
        t.expect_dtype("Generator::fill_uniform_tensor", DType::F32)?;
        self.fill_tensor(t, Fill::Uniform)
    }

    /// Fills an `f32` tensor on any device with normals (`mean + std * z`).
    pub fn fill_normal_tensor(&mut self, t: &mut Tensor, mean: f32, std: f32) -> Result<()> {
        t.expect_dtype("Generator::fill_normal_tensor", DType::F32)?;
        self.fill_tensor(t, Fill::Normal { mean, std })
    }

    /// Dropout of a tensor on any device: returns `(output, mask)`, the output with the
    /// input's dtype (f32, bf16 or f16) and the mask as `u8` (1 = kept), both on the
    /// input's device.
    pub fn dropout_tensor(&mut self, input: &Tensor, p: f32) -> Result<(Tensor, Tensor)> {
        check_dropout_dtype("Generator::dropout_tensor", input.dtype())?;
        check_probability(p)?;
        let mut out = Tensor::empty(input.shape(), input.dtype(), input.device())?;
        let mut mask = Tensor::empty(input.shape(), DType::U8, input.device())?;
        self.dropout_into(input, p, &mut out, &mut mask)?;
        Ok((out, mask))
    }

    /// Dropout into preallocated `out` (the input's dtype) and `mask` (`u8`) tensors on
    /// the input's device, with the input's shape.
    pub fn dropout_into(
        &mut self,
        input: &Tensor,
        p: f32,
        out: &mut Tensor,
        mask: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "Generator::dropout_into";
        check_dropout_dtype(OP, input.dtype())?;
        check_probability(p)?;
        check_dropout_outputs(OP, input, out, mask)?;
        match input.device() {
            Device::Cpu => {
                let s = self.advance(input.numel());
                let par = Par::for_len(input.numel(), PAR_THRESHOLD);
                let mask = mask.as_mut_slice::<u8>()?;
                match input.dtype() {
                    DType::F32 => dropout_host::<f32>(s, p, input, out, mask, par),
                    DType::BF16 => dropout_host::<bf16>(s, p, input, out, mask, par),
                    DType::F16 => dropout_host::<f16>(s, p, input, out, mask, par),
                    other => unreachable!("dtype {other} was checked above"),
                }
            }
            Device::Cuda(_) => {
                #[cfg(feature = "cuda")]
                {
                    let s = self.state;
                    crate::cuda::dropout(crate::cuda::Draw::At(s), p, input, out, mask)?;
                    self.advance(input.numel());
                    Ok(())
                }
                #[cfg(not(feature = "cuda"))]
                Err(Error::no_cuda_feature("dropout on a CUDA tensor"))
            }
        }
    }

    fn fill_tensor(&mut self, t: &mut Tensor, fill: Fill) -> Result<()> {
        let n = t.numel();
        match t.device() {
            Device::Cpu => {
                let s = self.advance(n);
                let par = Par::for_len(n, PAR_THRESHOLD);
                match fill {
                    Fill::U32 => stream::fill_u32(s.seed, s.offset, t.as_mut_slice()?, par),
                    Fill::Uniform => stream::fill_uniform(s.seed, s.offset, t.as_mut_slice()?, par),
                    Fill::Normal { mean, std } => {
                        stream::fill_normal(s.seed, s.offset, t.as_mut_slice()?, mean, std, par)
                    }
                }
                Ok(())
            }
            Device::Cuda(_) => {
                #[cfg(feature = "cuda")]
                {
                    crate::cuda::fill(crate::cuda::Draw::At(self.state), fill, t)?;
                    self.advance(n);
                    Ok(())
                }
                #[cfg(not(feature = "cuda"))]
                Err(Error::no_cuda_feature("a random fill of a CUDA tensor"))
            }
        }
    }
}

/// What a tensor fill draws.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fill {
    U32,
    Uniform,
    Normal { mean: f32, std: f32 },
}

fn dropout_host<T: DropoutElement + tessera_core::Element>(
    s: GeneratorState,
    p: f32,
    input: &Tensor,
    out: &mut Tensor,
    mask: &mut [u8],
    par: Par,
) -> Result<()> {
    let out = out.as_mut_slice::<T>()?;
    stream::dropout(s.seed, s.offset, p, input.as_slice::<T>()?, out, mask, par);
    Ok(())
}

pub(crate) fn check_probability(p: f32) -> Result<()> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(Error::invalid(
            "dropout",
            format!("drop probability {p} is outside [0, 1]"),
        ))
    }
}

pub(crate) fn check_dropout_dtype(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_high_precision_float() {
        Ok(())
    } else {
        Err(Error::dtype(op, "f32, bf16 or f16", dtype))
    }
}

pub(crate) fn check_dropout_outputs(
    op: &'static str,
    input: &Tensor,
    out: &Tensor,
    mask: &Tensor,
) -> Result<()> {
    out.expect_dtype(op, input.dtype())?;
    mask.expect_dtype(op, DType::U8)?;
    for (what, t) in [("output", out), ("mask", mask)] {
        if t.device() != input.device() {
            return Err(Error::device(op, input.device().to_string(), t.device()));
        }
        if t.shape() != input.shape() {
            return Err(Error::shape(
                op,
                format!(
                    "the {what} has shape {}, the input {}",
                    t.shape(),
                    input.shape()
                ),
            ));
        }
    }
    Ok(())
}

/// The snapshot kind of a [`Generator`].
const GENERATOR_KIND: &str = "Generator";

impl Replay for Generator {
    fn snapshot(&self) -> Snapshot {
        Snapshot::new(GENERATOR_KIND, self.state)
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        self.state = *snapshot.get::<GeneratorState>(GENERATOR_KIND)?;
        Ok(())
    }
}
