//! How each buffer of a quantized tensor behaves under a first-dimension all-gather,
//! and the one generic gather built on that description.
//!
//! TransformerEngine's `distributed.py` has a separate gather per format. Here every
//! format describes its buffers instead ([`layout`]), and one algorithm serves all:
//!
//! 1. [`pack`]: each rank takes the valid region of each gathered buffer in compact
//!    layout (scale padding stripped, swizzled scales unswizzled) as a `[rows, cols]`
//!    matrix;
//! 2. the collective concatenates the ranks' matrices along dim 0;
//! 3. [`unpack`]: buffers whose rows follow M ([`Gather::Rows`]) are complete;
//!    buffers whose columns follow M ([`Gather::Columns`]: transposed data, M-inner
//!    scales) are interleaved with `swap_first_dims`; then padding is restored (zeros)
//!    and scales are swizzled again where the format asks for it. Per-tensor metadata
//!    ([`Gather::Replicated`]) is taken from the local rank — correct because every
//!    rank quantized with the same all-reduced amax (the collectives do that first).
//!
//! Steps 1 and 3 are byte moves, written down as [`CopyPlan`]s ([`pack_plans`],
//! [`unpack_plans`]): strided copies (valid regions out of padded buffers, rank blocks
//! side by side for Columns buffers, into zeroed padded buffers) and swizzles between
//! compact scale matrices and the GEMM layout. [`CopyPlan::run_host`] runs a plan on the
//! host; `tessera-collectives` runs the same plans with device copies on CUDA tensors
//! ([`pack_with`], [`unpack_with`], [`unpack_parts_with`] take the executor), so there is
//! one description of each format's wire layout and every executor gives the same bytes.
//!
//! [`gather_reference`] runs the three steps on a list of per-rank tensors in one
//! process; its result equals quantizing the concatenated input.

use std::collections::BTreeMap;

use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

use crate::layout::swizzled_index;
use crate::{BlockDim, BufferName, Kind, QuantizedTensor, block, buffer_specs, mxfp8, nvfp4};

/// How one buffer travels in a first-dimension all-gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gather {
    /// Its rows follow M: rank matrices are concatenated along dim 0 as they are.
    Rows,
    /// Its columns follow M: after concatenation, `swap_first_dims` makes each row the
    /// concatenation of that row across ranks.
    Columns,
    /// The same on every rank; not communicated.
    Replicated,
}

/// The wire description of one buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireBuffer {
    /// Which buffer.
    pub name: BufferName,
    /// Its dtype.
    pub dtype: DType,
    /// How it is gathered.
    pub gather: Gather,
    /// The valid region of the local buffer as a `[rows, cols]` matrix of elements, in
    /// compact layout (what [`pack`] produces).
    pub valid: [usize; 2],
}

/// The wire description of every buffer `qt` has.
pub fn layout(qt: &QuantizedTensor) -> Result<Vec<WireBuffer>> {
    let (m, k) = qt.shape().flat_2d();
    let kind = qt.kind();
    let specs = buffer_specs(&kind, qt.shape())?;
    let mut out = Vec::new();
    for (name, _) in qt.data_tensors() {
        let (gather, valid) = wire_buffer(kind, name, m, k)?;
        let dtype = specs
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.dtype)
            .unwrap_or(DType::U8);
        out.push(WireBuffer {
            name,
            dtype,
            gather,
            valid,
        });
    }
    Ok(out)
}

/// How buffer `name` of a `kind` tensor with flat shape `[m, k]` travels, and its valid
/// `[rows, cols]` region.
fn wire_buffer(kind: Kind, name: BufferName, m: usize, k: usize) -> Result<(Gather, [usize; 2])> {
    use BufferName::*;
    use Gather::*;
    Ok(match (kind, name) {
        (_, Amax | ColumnwiseAmax) | (Kind::Fp8 { .. }, ScaleInv) => (Replicated, [1, 1]),
        (Kind::Nvfp4 { .. }, Data) => (Rows, [m, k / 2]),
        (Kind::Nvfp4 { .. }, ColumnwiseData) => (Columns, [k, m / 2]),
        (Kind::Nvfp4 { .. }, ScaleInv) => (Rows, [m, k / nvfp4::BLOCK]),
        (Kind::Nvfp4 { .. }, ColumnwiseScaleInv) => (Columns, [k, m / nvfp4::BLOCK]),
        (Kind::Mxfp8 { .. }, Data | ColumnwiseData) => (Rows, [m, k]),
        (Kind::Mxfp8 { .. }, ScaleInv) => (Rows, [m, k / mxfp8::BLOCK]),
        (Kind::Mxfp8 { .. }, ColumnwiseScaleInv) => (Rows, [m / mxfp8::BLOCK, k]),
        (_, Data) => (Rows, [m, k]),
        (_, ColumnwiseData) => (Columns, [k, m]),
        (
            Kind::Fp8Block {
                block_dim: BlockDim::OneD,
                ..
            },
            ScaleInv,
        ) => (Columns, [k.div_ceil(block::BLOCK), m]),
        (
            Kind::Fp8Block {
                block_dim: BlockDim::OneD,
                ..
            },
            ColumnwiseScaleInv,
        ) => (Rows, [m.div_ceil(block::BLOCK), k]),
        (
            Kind::Fp8Block {
                block_dim: BlockDim::TwoD,
                ..
            },
            ScaleInv,
        ) => (Rows, [m.div_ceil(block::BLOCK), k.div_ceil(block::BLOCK)]),
        (
            Kind::Fp8Block {
                block_dim: BlockDim::TwoD,
                ..
            },
            ColumnwiseScaleInv,
        ) => (
            Columns,
            [k.div_ceil(block::BLOCK), m.div_ceil(block::BLOCK)],
        ),
        (Kind::Fp8 { .. }, ColumnwiseScaleInv) => {
            return Err(Error::invalid(
                "wire::layout",
                "per-tensor FP8 has no columnwise scale",
            ));
        }
    })
}

/// The rows of M a block of the format spans: a rank's share of M must be a multiple of
/// it, or blocks would straddle ranks.
fn m_granule(qt: &QuantizedTensor) -> usize {
    match qt.kind() {
        Kind::Fp8 { .. } => 1,
        Kind::Mxfp8 { .. } => mxfp8::BLOCK,
        Kind::Nvfp4 { .. } => nvfp4::BLOCK,
        Kind::Fp8Block { block_dim, .. } => {
            if block_dim == BlockDim::TwoD || qt.buffer(BufferName::ColumnwiseData).is_some() {
                block::BLOCK
            } else {
                1
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Copy plans: the byte moves of pack and unpack, run by the host or by a device

/// One step of a [`CopyPlan`]: bytes from one of the plan's inputs into its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyStep {
    /// `rows` runs of `row_bytes` bytes: run `i` goes from input `src` at
    /// `src_offset + i·src_pitch` to the output at `dst_offset + i·dst_pitch` — one
    /// `memcpy` per run on the host, one 2-D copy (`cuMemcpy2DAsync`, or a plain
    /// device-to-device copy when the runs are contiguous) on a device. Contiguous
    /// copies are written with `rows == 1`.
    Strided {
        /// Index of the input read.
        src: usize,
        /// Byte offset of the first run in the input.
        src_offset: usize,
        /// Bytes between the starts of consecutive runs in the input.
        src_pitch: usize,
        /// Byte offset of the first run in the output.
        dst_offset: usize,
        /// Bytes between the starts of consecutive runs in the output.
        dst_pitch: usize,
        /// Number of runs.
        rows: usize,
        /// Bytes per run (at most either pitch when `rows > 1`).
        row_bytes: usize,
    },
    /// Single bytes between a compact matrix and a GEMM-swizzled scale grid.
    Swizzle(SwizzleStep),
}

/// A [`CopyStep::Swizzle`]. Element `(i, j)` (`i < rows`, `j < cols`) of a compact
/// one-byte matrix — at `compact_offset + i·compact_pitch + j` — is byte
/// [`swizzled_index`]`(a, b, grid_cols)` of the grid,
/// where `(a, b)` is `(row0 + i, col0 + j)`, or `(col0 + j, row0 + i)` when `transposed`
/// (MXFP8's columnwise scales are swizzled as the transpose of their grid).
///
/// With `to_grid` the compact matrix is in input `src` and the grid is the whole
/// output (unpack); otherwise the grid is the whole input `src` and the compact matrix
/// is in the output (pack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwizzleStep {
    /// Index of the input read.
    pub src: usize,
    /// Compact to swizzled (unpack) rather than swizzled to compact (pack).
    pub to_grid: bool,
    /// Byte offset of the compact matrix.
    pub compact_offset: usize,
    /// Bytes between the compact matrix's rows.
    pub compact_pitch: usize,
    /// Rows of the compact matrix.
    pub rows: usize,
    /// Columns (bytes) of the compact matrix.
    pub cols: usize,
    /// The grid row (column when `transposed`) of compact row 0.
    pub row0: usize,
    /// The grid column (row when `transposed`) of compact column 0.
    pub col0: usize,
    /// Columns of the swizzled grid (a multiple of 4; its rows are a multiple of 128).
    pub grid_cols: usize,
    /// Compact `(i, j)` is grid `(col0 + j, row0 + i)`.
    pub transposed: bool,
}

impl SwizzleStep {
    /// The grid coordinates of compact element `(i, j)`.
    #[inline]
    pub fn grid_coords(&self, i: usize, j: usize) -> (usize, usize) {
        if self.transposed {
            (self.col0 + j, self.row0 + i)
        } else {
            (self.row0 + i, self.col0 + j)
        }
    }
}

/// How one output buffer of [`pack`] or [`unpack`] is made from input buffers: a list
/// of byte moves over a (zeroed, if asked) output, run on the host by
/// [`CopyPlan::run_host`] or on a device by an executor that issues device copies
/// (`tessera-collectives` does). Every executor must produce the same bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    /// The buffer made.
    pub name: BufferName,
    /// The output's dtype.
    pub dtype: DType,
    /// The output's shape.
    pub shape: Shape,
    /// The output starts as zeros (padding the steps do not write); otherwise the steps
    /// write every byte.
    pub zeroed: bool,
    /// The moves, in order (no two write the same byte).
    pub steps: Vec<CopyStep>,
}

/// One input of a [`CopyPlan`]: a tensor and the byte offset where the plan's view of
/// it starts (e.g. one rank's block of a gathered buffer).
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    /// The tensor read.
    pub tensor: &'a Tensor,
    /// Byte offset of the plan's view in the tensor.
    pub offset: usize,
}

impl<'a> PlanInput<'a> {
    /// The whole of `tensor`.
    pub fn whole(tensor: &'a Tensor) -> Self {
        PlanInput { tensor, offset: 0 }
    }
}

/// Something that runs copy plans: [`CopyPlan::run_host`], or a device-dispatching
/// executor.
pub type Executor<'e> = &'e dyn Fn(&CopyPlan, &[PlanInput<'_>]) -> Result<Tensor>;

impl CopyPlan {
    /// Bytes of the output.
    pub fn output_bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size_in_bytes()
    }

    /// Appends a strided step, written as one contiguous run when its runs are
    /// contiguous and merged with the previous step when it continues it in both the
    /// input and the output (so a concatenation of adjacent blocks is one copy).
    pub fn push_strided(
        &mut self,
        src: usize,
        [src_offset, src_pitch]: [usize; 2],
        [dst_offset, dst_pitch]: [usize; 2],
        rows: usize,
        row_bytes: usize,
    ) {
        if rows == 0 || row_bytes == 0 {
            return;
        }
        let contiguous = rows == 1 || (src_pitch == row_bytes && dst_pitch == row_bytes);
        let step = if contiguous {
            let n = rows * row_bytes;
            if let Some(CopyStep::Strided {
                src: ps,
                src_offset: pso,
                dst_offset: pdo,
                rows: 1,
                row_bytes: pn,
                src_pitch,
                dst_pitch,
            }) = self.steps.last_mut()
                && *ps == src
                && *pso + *pn == src_offset
                && *pdo + *pn == dst_offset
            {
                *pn += n;
                *src_pitch = *pn;
                *dst_pitch = *pn;
                return;
            }
            CopyStep::Strided {
                src,
                src_offset,
                src_pitch: n,
                dst_offset,
                dst_pitch: n,
                rows: 1,
                row_bytes: n,
            }
        } else {
            CopyStep::Strided {
                src,
                src_offset,
                src_pitch,
                dst_offset,
                dst_pitch,
                rows,
                row_bytes,
            }
        };
        self.steps.push(step);
    }

    /// Checks every step against the inputs' sizes and the output's, so an executor
    /// never reads or writes out of bounds: a typed error instead.
    pub fn check(&self, inputs: &[PlanInput<'_>]) -> Result<()> {
        const OP: &str = "wire::CopyPlan";
        let out_len = self.output_bytes();
        let input_len = |src: usize| -> Result<usize> {
            let i = inputs.get(src).ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!(
                        "`{}`: a step reads input {src} of {}",
                        self.name,
                        inputs.len()
                    ),
                )
            })?;
            i.tensor
                .size_in_bytes()
                .checked_sub(i.offset)
                .ok_or_else(|| {
                    Error::shape(
                        OP,
                        format!(
                            "`{}`: input {src} starts at byte {} of a {}-byte tensor",
                            self.name,
                            i.offset,
                            i.tensor.size_in_bytes()
                        ),
                    )
                })
        };
        let out_of_bounds = |what: &str, end: Option<usize>, len: usize| -> Result<()> {
            match end {
                Some(e) if e <= len => Ok(()),
                _ => Err(Error::shape(
                    OP,
                    format!("`{}`: a step's {what} ends past its {len} bytes", self.name),
                )),
            }
        };
        // The end of `rows` runs of `width` bytes `pitch` apart from `offset`.
        let span = |offset: usize, pitch: usize, rows: usize, width: usize| {
            (rows - 1)
                .checked_mul(pitch)
                .and_then(|x| x.checked_add(width))
                .and_then(|x| x.checked_add(offset))
        };
        for step in &self.steps {
            match *step {
                CopyStep::Strided {
                    src,
                    src_offset,
                    src_pitch,
                    dst_offset,
                    dst_pitch,
                    rows,
                    row_bytes,
                } => {
                    let len = input_len(src)?;
                    if rows == 0 || row_bytes == 0 {
                        continue;
                    }
                    if rows > 1 && (row_bytes > src_pitch || row_bytes > dst_pitch) {
                        return Err(Error::shape(
                            OP,
                            format!(
                                "`{}`: runs of {row_bytes} bytes overlap at pitches {src_pitch} / {dst_pitch}",
                                self.name
                            ),
                        ));
                    }
                    out_of_bounds("input", span(src_offset, src_pitch, rows, row_bytes), len)?;
                    out_of_bounds(
                        "output",
                        span(dst_offset, dst_pitch, rows, row_bytes),
                        out_len,
                    )?;
                }
                CopyStep::Swizzle(s) => {
                    let len = input_len(s.src)?;
                    if s.rows == 0 || s.cols == 0 {
                        continue;
                    }
                    let grid_len = if s.to_grid { out_len } else { len };
                    let compact_len = if s.to_grid { len } else { out_len };
                    let grid_rows = grid_len.checked_div(s.grid_cols).unwrap_or(0);
                    if self.dtype.size_in_bytes() != 1
                        || s.grid_cols % 4 != 0
                        || grid_rows * s.grid_cols != grid_len
                        || grid_rows % 128 != 0
                    {
                        return Err(Error::shape(
                            OP,
                            format!(
                                "`{}`: {grid_len} bytes of {} are not a swizzled grid with {} columns",
                                self.name, self.dtype, s.grid_cols
                            ),
                        ));
                    }
                    let (a, b) = s.grid_coords(s.rows - 1, s.cols - 1);
                    if a >= grid_rows || b >= s.grid_cols {
                        return Err(Error::shape(
                            OP,
                            format!(
                                "`{}`: grid element ({a}, {b}) lies outside the {grid_rows}x{} grid",
                                self.name, s.grid_cols
                            ),
                        ));
                    }
                    if s.rows > 1 && s.cols > s.compact_pitch {
                        return Err(Error::shape(
                            OP,
                            format!(
                                "`{}`: compact rows of {} bytes overlap at pitch {}",
                                self.name, s.cols, s.compact_pitch
                            ),
                        ));
                    }
                    out_of_bounds(
                        "compact matrix",
                        span(s.compact_offset, s.compact_pitch, s.rows, s.cols),
                        compact_len,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The input itself, reshaped, when the plan copies one whole input unchanged (no
    /// bytes move: e.g. FP8 data, whose packed form is the buffer).
    pub fn passthrough<'a>(&self, inputs: &[PlanInput<'a>]) -> Option<&'a Tensor> {
        match self.steps.as_slice() {
            [
                CopyStep::Strided {
                    src,
                    src_offset: 0,
                    dst_offset: 0,
                    rows: 1,
                    row_bytes,
                    ..
                },
            ] if !self.zeroed && *row_bytes == self.output_bytes() => {
                let i = inputs.get(*src)?;
                (i.offset == 0
                    && i.tensor.dtype() == self.dtype
                    && i.tensor.size_in_bytes() == *row_bytes)
                    .then_some(i.tensor)
            }
            _ => None,
        }
    }

    /// Runs the plan on the host: `inputs` must be host tensors. The output is a new
    /// host tensor (or an input itself, see [`passthrough`](Self::passthrough)).
    pub fn run_host(&self, inputs: &[PlanInput<'_>]) -> Result<Tensor> {
        self.check(inputs)?;
        if let Some(t) = self.passthrough(inputs)
            && t.device().is_cpu()
        {
            return t.reshape(self.shape.clone());
        }
        let srcs = inputs
            .iter()
            .map(|i| Ok(&i.tensor.as_bytes()?[i.offset..]))
            .collect::<Result<Vec<&[u8]>>>()?;
        // Host memory comes zeroed, so `zeroed` needs no pass.
        let mut out = Tensor::zeros(self.shape.clone(), self.dtype, Device::Cpu)?;
        let dst = out.as_bytes_mut()?;
        for step in &self.steps {
            match *step {
                CopyStep::Strided {
                    src,
                    src_offset,
                    src_pitch,
                    dst_offset,
                    dst_pitch,
                    rows,
                    row_bytes,
                } => {
                    let s = srcs[src];
                    for r in 0..rows {
                        dst[dst_offset + r * dst_pitch..][..row_bytes]
                            .copy_from_slice(&s[src_offset + r * src_pitch..][..row_bytes]);
                    }
                }
                CopyStep::Swizzle(sw) => {
                    let s = srcs[sw.src];
                    for i in 0..sw.rows {
                        let c = sw.compact_offset + i * sw.compact_pitch;
                        for j in 0..sw.cols {
                            let (a, b) = sw.grid_coords(i, j);
                            let g = swizzled_index(a, b, sw.grid_cols);
                            if sw.to_grid {
                                dst[g] = s[c + j];
                            } else {
                                dst[c + j] = s[g];
                            }
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Where one rank's packed buffer lies among an unpack plan's inputs: a `[rows, cols]`
/// matrix (`dims`) at byte `offset` of input `input`, its rows `pitch` elements apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartLayout {
    /// Index of the input holding the part.
    pub input: usize,
    /// Byte offset of the part in that input.
    pub offset: usize,
    /// `[rows, cols]` in elements.
    pub dims: [usize; 2],
    /// Elements between row starts (at least `dims[1]`).
    pub pitch: usize,
}

/// The plans of [`unpack_parts`]: one [`CopyPlan`] per gathered buffer, whose inputs
/// are what the part layouts name, and the buffers taken from the local tensor.
#[derive(Debug, Clone)]
pub struct UnpackPlan {
    /// The format.
    pub kind: Kind,
    /// The gathered tensor's logical shape.
    pub shape: Shape,
    /// The gathered buffers' plans.
    pub buffers: Vec<CopyPlan>,
    /// The per-tensor buffers, copied from the local tensor.
    pub replicated: Vec<BufferName>,
}

impl UnpackPlan {
    /// Runs the plans with `exec` (`inputs(name)`: the inputs of buffer `name`'s plan)
    /// and assembles the gathered tensor, its replicated buffers taken from `local` and
    /// moved to the gathered buffers' device.
    pub fn run<'a>(
        &self,
        local: &QuantizedTensor,
        inputs: &dyn Fn(BufferName) -> Result<Vec<PlanInput<'a>>>,
        exec: Executor<'_>,
    ) -> Result<QuantizedTensor> {
        let mut buffers = BTreeMap::new();
        for plan in &self.buffers {
            buffers.insert(plan.name, exec(plan, &inputs(plan.name)?)?);
        }
        let device = buffers
            .values()
            .next()
            .map_or(local.device(), Tensor::device);
        for &name in &self.replicated {
            let t = local.buffer(name).ok_or_else(|| {
                Error::invalid("wire::unpack", format!("the local tensor lacks `{name}`"))
            })?;
            buffers.insert(name, t.to_device(device)?);
        }
        QuantizedTensor::from_buffers(self.kind, self.shape.clone(), local.source_dtype(), buffers)
    }
}

/// Checks that a tensor can be packed: rank 2 or more, and M a multiple of the
/// format's block height.
fn check_packable(qt: &QuantizedTensor) -> Result<()> {
    const OP: &str = "wire::pack";
    if qt.shape().rank() < 2 {
        // The first dimension of a rank-1 tensor is its last (K): blocks and transposes
        // would be split across ranks.
        return Err(Error::shape(
            OP,
            format!(
                "a rank-1 shard {} cannot be gathered in a quantized format; gather it in high precision",
                qt.shape()
            ),
        ));
    }
    let (m, _) = qt.shape().flat_2d();
    let g = m_granule(qt);
    if m % g != 0 {
        return Err(Error::shape(
            OP,
            format!(
                "a rank's {} tensor of shape {} has M = {m}, not a multiple of its {g}-row blocks",
                qt.kind().name(),
                qt.shape()
            ),
        ));
    }
    Ok(())
}

/// The plans of step 1: for every gathered buffer of `qt`, the moves that take its
/// compact valid region (scale padding stripped, swizzled scales unswizzled) into a
/// `[rows, cols]` send buffer. Input 0 of each plan is `qt`'s buffer of that name; the
/// plans depend only on the shape and format, so they serve a tensor on any device.
pub fn pack_plans(qt: &QuantizedTensor) -> Result<Vec<CopyPlan>> {
    check_packable(qt)?;
    let mut plans = Vec::new();
    for w in layout(qt)?
        .into_iter()
        .filter(|w| w.gather != Gather::Replicated)
    {
        let t = qt.buffer(w.name).expect("layout lists present buffers");
        let dims = t.shape().dims();
        let elem = w.dtype.size_in_bytes();
        let [rows, cols] = w.valid;
        let mut plan = CopyPlan {
            name: w.name,
            dtype: w.dtype,
            shape: Shape::new(w.valid),
            zeroed: false,
            steps: Vec::new(),
        };
        // The swizzled grid's columns, and whether it is the transpose (MXFP8
        // columnwise scales) — for swizzled scale buffers only.
        let grid = match (qt.kind(), w.name) {
            (Kind::Mxfp8 { swizzled: true, .. }, BufferName::ScaleInv)
            | (
                Kind::Nvfp4 { swizzled: true, .. },
                BufferName::ScaleInv | BufferName::ColumnwiseScaleInv,
            ) => Some((dims[1], false)),
            (Kind::Mxfp8 { swizzled: true, .. }, BufferName::ColumnwiseScaleInv) => {
                Some((dims[0], true))
            }
            _ => None,
        };
        match grid {
            Some((grid_cols, transposed)) => plan.steps.push(CopyStep::Swizzle(SwizzleStep {
                src: 0,
                to_grid: false,
                compact_offset: 0,
                compact_pitch: cols,
                rows,
                cols,
                row0: 0,
                col0: 0,
                grid_cols,
                transposed,
            })),
            None => {
                // Padded 2-D buffers (scales) have more columns than their valid region.
                let total_cols = if t.shape().rank() == 2 { dims[1] } else { cols };
                plan.push_strided(
                    0,
                    [0, total_cols * elem],
                    [0, cols * elem],
                    rows,
                    cols * elem,
                );
            }
        }
        plans.push(plan);
    }
    Ok(plans)
}

/// Step 1 with `exec` running the plans of [`pack_plans`]: the send buffers where
/// `exec` puts them (the host executor wants a host tensor).
pub fn pack_with(qt: &QuantizedTensor, exec: Executor<'_>) -> Result<Vec<(BufferName, Tensor)>> {
    pack_plans(qt)?
        .iter()
        .map(|plan| {
            let t = qt.buffer(plan.name).expect("planned buffers exist");
            Ok((plan.name, exec(plan, &[PlanInput::whole(t)])?))
        })
        .collect()
}

/// Step 1: the send buffers of a tensor, on the host — for every gathered buffer, its
/// compact valid region as a `[rows, cols]` tensor. Fails when the tensor's share of M
/// is not a multiple of the format's block height (blocks would straddle ranks).
pub fn pack(qt: &QuantizedTensor) -> Result<Vec<(BufferName, Tensor)>> {
    check_packable(qt)?;
    pack_with(&qt.to_device(Device::Cpu)?, &CopyPlan::run_host)
}

/// The logical shape of `world` ranks' shards of `shape` gathered along dim 0.
pub fn gathered_shape(shape: &Shape, world: usize) -> Shape {
    let mut d = shape.dims().to_vec();
    if let Some(d0) = d.first_mut() {
        *d0 *= world;
    }
    Shape::new(d)
}

/// Step 3: the gathered tensor from the concatenated send buffers (`gathered`, each
/// `[world·rows, cols]`, on any device) and the local tensor (for the replicated buffers
/// and the format), on the host. Every rank sent a shard of the local tensor's shape.
pub fn unpack(
    local: &QuantizedTensor,
    world: usize,
    gathered: BTreeMap<BufferName, Tensor>,
) -> Result<QuantizedTensor> {
    let host = gathered
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(Device::Cpu)?)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    unpack_with(local, world, &host, &CopyPlan::run_host)
}

/// [`unpack`] with `exec` running the plans, on the gathered buffers' device.
pub fn unpack_with(
    local: &QuantizedTensor,
    world: usize,
    gathered: &BTreeMap<BufferName, Tensor>,
    exec: Executor<'_>,
) -> Result<QuantizedTensor> {
    const OP: &str = "wire::unpack";
    if world == 0 {
        return Err(Error::invalid(OP, "a gather needs at least one rank"));
    }
    let get = |name: BufferName| {
        gathered
            .get(&name)
            .ok_or_else(|| Error::invalid(OP, format!("the gathered buffers lack `{name}`")))
    };
    let d0 = local.shape().dims().first().copied().unwrap_or(1);
    let plan = unpack_plans(local, &vec![d0; world], &mut |r, w| {
        let g = get(w.name)?;
        let want = [world * w.valid[0], w.valid[1]];
        if g.shape().dims() != want || g.dtype() != w.dtype {
            return Err(Error::shape(
                OP,
                format!(
                    "gathered `{}` must be {} {:?}, got {} {}",
                    w.name,
                    w.dtype,
                    want,
                    g.dtype(),
                    g.shape()
                ),
            ));
        }
        Ok(PartLayout {
            input: 0,
            offset: r * w.valid[0] * w.valid[1] * w.dtype.size_in_bytes(),
            dims: w.valid,
            pitch: w.valid[1],
        })
    })?;
    plan.run(local, &|name| Ok(vec![PlanInput::whole(get(name)?)]), exec)
}

/// Step 3 for shards of different first dimensions: `parts[r]` holds rank `r`'s packed
/// buffers (what [`pack`] made on that rank) and `rank_d0[r]` its first dimension. Rows
/// buffers are concatenated in rank order; for Columns buffers each row is the
/// concatenation of that row across ranks (what `swap_first_dims` does when the shards
/// are equal). Padding is restored and scales are swizzled where the format asks. The
/// result is on the host.
pub fn unpack_parts(
    local: &QuantizedTensor,
    parts: &[BTreeMap<BufferName, Tensor>],
    rank_d0: &[usize],
) -> Result<QuantizedTensor> {
    let host = parts
        .iter()
        .map(|p| {
            p.iter()
                .map(|(n, t)| Ok((*n, t.to_device(Device::Cpu)?)))
                .collect::<Result<BTreeMap<_, _>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    unpack_parts_with(local, &host, rank_d0, &CopyPlan::run_host)
}

/// [`unpack_parts`] with `exec` running the plans, on the parts' device.
pub fn unpack_parts_with(
    local: &QuantizedTensor,
    parts: &[BTreeMap<BufferName, Tensor>],
    rank_d0: &[usize],
    exec: Executor<'_>,
) -> Result<QuantizedTensor> {
    const OP: &str = "wire::unpack";
    if parts.len() != rank_d0.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "{} ranks' buffers but {} first dimensions",
                parts.len(),
                rank_d0.len()
            ),
        ));
    }
    let get = |r: usize, name: BufferName| {
        parts[r]
            .get(&name)
            .ok_or_else(|| Error::invalid(OP, format!("rank {r}'s buffers lack `{name}`")))
    };
    let plan = unpack_plans(local, rank_d0, &mut |r, w| {
        let t = get(r, w.name)?;
        let d = t.shape().dims();
        if d.len() != 2 || t.dtype() != w.dtype {
            return Err(Error::shape(
                OP,
                format!(
                    "rank {r}'s `{}` must be a 2-D {} matrix, got {} {}",
                    w.name,
                    w.dtype,
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        Ok(PartLayout {
            input: r,
            offset: 0,
            dims: [d[0], d[1]],
            pitch: d[1],
        })
    })?;
    plan.run(
        local,
        &|name| {
            (0..parts.len())
                .map(|r| Ok(PlanInput::whole(get(r, name)?)))
                .collect()
        },
        exec,
    )
}

/// The plans of step 3 for ranks with first dimensions `rank_d0`: `part(r, w)` says
/// where rank `r`'s packed buffer `w` lies among the inputs of `w`'s plan. Rows buffers
/// are concatenated in rank order, Columns buffers side by side; the result is padded
/// (zeros) and swizzled as the format's buffers are. Checks that the parts fit
/// together and make the buffers of the gathered shape.
pub fn unpack_plans(
    local: &QuantizedTensor,
    rank_d0: &[usize],
    part: &mut dyn FnMut(usize, &WireBuffer) -> Result<PartLayout>,
) -> Result<UnpackPlan> {
    const OP: &str = "wire::unpack";
    if rank_d0.is_empty() {
        return Err(Error::invalid(OP, "a gather needs at least one rank"));
    }
    if local.shape().rank() == 0 {
        return Err(Error::shape(OP, "a rank-0 tensor has no first dimension"));
    }
    let mut dims = local.shape().dims().to_vec();
    dims[0] = rank_d0.iter().sum();
    let shape = Shape::new(dims);
    let (m, k) = shape.flat_2d();
    let kind = local.kind();
    let specs = buffer_specs(&kind, &shape)?;
    let mut buffers = Vec::new();
    let mut replicated = Vec::new();
    for w in layout(local)? {
        if w.gather == Gather::Replicated {
            replicated.push(w.name);
            continue;
        }
        let spec = specs
            .iter()
            .find(|s| s.name == w.name)
            .expect("same format");
        let elem = w.dtype.size_in_bytes();
        let parts = (0..rank_d0.len())
            .map(|r| {
                let p = part(r, &w)?;
                if p.pitch < p.dims[1] {
                    return Err(Error::shape(
                        OP,
                        format!(
                            "rank {r}'s `{}` has rows of {} elements {} apart",
                            w.name, p.dims[1], p.pitch
                        ),
                    ));
                }
                Ok(p)
            })
            .collect::<Result<Vec<_>>>()?;
        // The joined compact matrix, and where each part's (0, 0) lands in it: the
        // parts follow each other along `axis` and share their extent across it.
        let axis = match w.gather {
            Gather::Rows => 0,
            Gather::Columns => 1,
            Gather::Replicated => unreachable!("handled above"),
        };
        let across = parts[0].dims[1 - axis];
        if let Some(r) = parts.iter().position(|p| p.dims[1 - axis] != across) {
            return Err(Error::shape(
                OP,
                format!(
                    "rank {r}'s `{}` has {} {}, rank 0's {across}",
                    w.name,
                    parts[r].dims[1 - axis],
                    ["columns", "rows"][axis]
                ),
            ));
        }
        let mut at = 0;
        let origins: Vec<[usize; 2]> = parts
            .iter()
            .map(|p| {
                let mut origin = [0; 2];
                origin[axis] = at;
                at += p.dims[axis];
                origin
            })
            .collect();
        let mut valid = [across; 2];
        valid[axis] = at;
        let (_, want) = wire_buffer(kind, w.name, m, k)?;
        if valid != want {
            return Err(Error::shape(
                OP,
                format!(
                    "the ranks' `{}` join to {valid:?}, a {} tensor of shape {shape} needs {want:?}",
                    w.name,
                    kind.name()
                ),
            ));
        }
        let sd = spec.shape.dims();
        let is_scale = matches!(
            w.name,
            BufferName::ScaleInv | BufferName::ColumnwiseScaleInv
        );
        // Where the joined matrix goes: a swizzled grid (its columns, transposed or
        // not), or row-major with `dst_cols` columns (padded scales, or compact).
        let grid = match (kind, w.name) {
            (Kind::Mxfp8 { swizzled: true, .. }, BufferName::ScaleInv)
            | (
                Kind::Nvfp4 { swizzled: true, .. },
                BufferName::ScaleInv | BufferName::ColumnwiseScaleInv,
            ) => Some((sd[1], false)),
            (Kind::Mxfp8 { swizzled: true, .. }, BufferName::ColumnwiseScaleInv) => {
                Some((sd[0], true))
            }
            _ => None,
        };
        let dst_cols = if spec.shape.rank() == 2 && is_scale {
            sd[1]
        } else {
            valid[1]
        };
        let mut plan = CopyPlan {
            name: w.name,
            dtype: spec.dtype,
            shape: spec.shape.clone(),
            zeroed: spec.shape.numel() != valid[0] * valid[1],
            steps: Vec::new(),
        };
        for (p, [row0, col0]) in parts.iter().zip(origins) {
            match grid {
                Some((grid_cols, transposed)) => plan.steps.push(CopyStep::Swizzle(SwizzleStep {
                    src: p.input,
                    to_grid: true,
                    compact_offset: p.offset,
                    compact_pitch: p.pitch * elem,
                    rows: p.dims[0],
                    cols: p.dims[1],
                    row0,
                    col0,
                    grid_cols,
                    transposed,
                })),
                None => plan.push_strided(
                    p.input,
                    [p.offset, p.pitch * elem],
                    [(row0 * dst_cols + col0) * elem, dst_cols * elem],
                    p.dims[0],
                    p.dims[1] * elem,
                ),
            }
        }
        buffers.push(plan);
    }
    Ok(UnpackPlan {
        kind,
        shape,
        buffers,
        replicated,
    })
}

/// A `[rows, cols]` matrix of `dtype` placed top-left in a zeroed `[total[0], total[1]]`
/// one (input 0 at offset 0, compact): the padding of uneven gathers' send buffers.
pub fn pad_plan(name: BufferName, dtype: DType, valid: [usize; 2], total: [usize; 2]) -> CopyPlan {
    let elem = dtype.size_in_bytes();
    let mut plan = CopyPlan {
        name,
        dtype,
        shape: Shape::new(total),
        zeroed: valid != total,
        steps: Vec::new(),
    };
    plan.push_strided(
        0,
        [0, valid[1] * elem],
        [0, total[1] * elem],
        valid[0],
        valid[1] * elem,
    );
    plan
}

/// The whole gather on one process: `parts[r]` is rank `r`'s tensor. The shards may
/// differ in their first dimension (beyond TE, which needs equal shards); everything
/// else — format, trailing dimensions, usage and replicated metadata — must agree (a
/// rank that quantized with its own per-tensor scale would make the gathered bytes
/// inconsistent).
pub fn gather_reference(parts: &[QuantizedTensor]) -> Result<QuantizedTensor> {
    const OP: &str = "wire::gather_reference";
    let first = parts
        .first()
        .ok_or_else(|| Error::invalid(OP, "no parts to gather"))?;
    let trailing = |q: &QuantizedTensor| q.shape().dims().get(1..).map(<[usize]>::to_vec);
    let mut packed = Vec::with_capacity(parts.len());
    let mut rank_d0 = Vec::with_capacity(parts.len());
    for (r, p) in parts.iter().enumerate() {
        if p.kind() != first.kind() || trailing(p) != trailing(first) || p.usage() != first.usage()
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "rank {r} holds a {:?} {} ({:?}), rank 0 a {:?} {} ({:?})",
                    p.kind(),
                    p.shape(),
                    p.usage(),
                    first.kind(),
                    first.shape(),
                    first.usage()
                ),
            ));
        }
        for w in layout(p)?.iter().filter(|w| w.gather == Gather::Replicated) {
            if p.buffer(w.name).map(Tensor::to_bytes).transpose()?
                != first.buffer(w.name).map(Tensor::to_bytes).transpose()?
            {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "rank {r}'s `{}` differs from rank 0's: quantize with an all-reduced amax before gathering",
                        w.name
                    ),
                ));
            }
        }
        packed.push(pack(p)?.into_iter().collect::<BTreeMap<_, _>>());
        rank_d0.push(p.shape().dims()[0]);
    }
    unpack_parts(first, &packed, &rank_d0)
}
