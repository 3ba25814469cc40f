//! What the demo shows: the progress bar and per-step table while it trains, the checks,
//! the summary, and the JSON report.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use tessera_checkpoint::Mode;

use super::DemoError;
use super::config::{DemoConfig, format_name, format_recipe};
use super::rank::RankOutput;
use super::record::{BlockBytes, Region};
use super::reference::RefStep;
use crate::args::{Backend, ReferenceSums};

/// The unit roundoff of f32.
const U: f64 = 1.0 / (1u64 << 24) as f64;

/// The bound the loss difference is held to, and why (see the [demo's docs](super)).
#[derive(Debug, Clone, Serialize)]
pub struct Tolerance {
    /// The runs must agree bit for bit: no sum is split (`--tp 1`), or the reference
    /// splits its sums as the ranks do (`--reference-sums split`).
    pub exact: bool,
    /// Each sum whose order differs between the runs when the reference sums whole
    /// matrices, per block: what, and its length.
    pub terms: Vec<(String, usize)>,
    /// Blocks.
    pub layers: usize,
    /// `layers · Σ terms`.
    pub k: usize,
    /// The bound relative to the first loss: 0 when exact, else `4·u·K`.
    pub relative: f64,
    /// `4·u·K`: the bound whole sums are held to.
    pub whole_relative: f64,
}

impl Tolerance {
    /// The tolerance of a configuration.
    pub fn new(cfg: &DemoConfig) -> Tolerance {
        let (s, h, f, tp) = (cfg.seq, cfg.hidden, cfg.ffn, cfg.tp);
        let terms: Vec<(String, usize)> = if tp == 1 {
            Vec::new()
        } else {
            vec![
                (
                    "FC2 forward: ffn products, summed per rank then reduce-scattered".into(),
                    f + tp,
                ),
                (
                    "FC1 input gradient: ffn products, summed per rank then reduce-scattered"
                        .into(),
                    f + tp,
                ),
                (
                    "LayerNorm γ, β gradients: seq tokens, summed per shard then all-reduced"
                        .into(),
                    s + tp,
                ),
                (
                    "FC1 forward, FC2 input gradient: hidden products (GEMM blocking of other shapes)"
                        .into(),
                    2 * h,
                ),
                (
                    "FC1, FC2 weight gradients: seq products (GEMM blocking of other shapes)".into(),
                    2 * s,
                ),
            ]
        };
        let k = cfg.layers * terms.iter().map(|(_, n)| n).sum::<usize>();
        let exact = tp == 1 || cfg.reference_sums == ReferenceSums::Split;
        let whole_relative = 4.0 * U * k as f64;
        Tolerance {
            exact,
            terms,
            layers: cfg.layers,
            k,
            relative: if exact { 0.0 } else { whole_relative },
            whole_relative,
        }
    }

    /// The absolute bound for a run whose reference starts at loss `l0`.
    pub fn bound(&self, l0: f64) -> f64 {
        self.relative * l0.abs()
    }
}

/// One step of both runs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StepRow {
    /// 1-based.
    pub step: usize,
    /// The distributed run's loss.
    pub loss: f64,
    /// The reference's loss.
    pub reference: f64,
    /// `loss - reference`.
    pub difference: f64,
    /// The bound.
    pub tolerance: f64,
    /// `|difference| <= tolerance`.
    pub ok: bool,
}

impl StepRow {
    /// Step `step` (0-based) of both runs.
    pub fn new(step: usize, loss: f64, reference: f64, tolerance: f64) -> StepRow {
        let difference = loss - reference;
        StepRow {
            step: step + 1,
            loss,
            reference,
            difference,
            tolerance,
            ok: difference.abs() <= tolerance,
        }
    }
}

/// One named check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What is checked.
    pub name: String,
    /// Whether it held.
    pub passed: bool,
    /// The evidence.
    pub detail: String,
}

/// One collective, per rank.
#[derive(Debug, Clone, Serialize)]
pub struct CommRow {
    /// `tp`, `dp` or `world`.
    pub group: &'static str,
    /// What it moves.
    pub what: String,
    /// The format on the wire.
    pub format: String,
    /// Calls per kind, e.g. `all-gather 80, all-reduce 80`.
    pub calls: String,
    /// Bytes this rank handed to the collectives.
    pub bytes: u64,
    /// Bytes this rank transmits when the collectives run as rings.
    pub wire_bytes: u64,
    /// What the same tensors take in f32 (0 when not meaningful).
    pub f32_bytes: u64,
}

/// Peak saved activations of one rank.
#[derive(Debug, Clone, Serialize)]
pub struct Activations {
    /// The run's checkpoint mode.
    pub mode: &'static str,
    /// Without checkpointing.
    pub without_checkpointing: u64,
    /// With checkpointing (either mode: both keep each block's input).
    pub with_checkpointing: u64,
    /// Which of the two the frames' meter measured; the other is computed from the same
    /// per-block byte counts.
    pub measured: &'static str,
    /// What the meter measured.
    pub meter_peak: u64,
    /// Per block: input bytes and everything its forward saves.
    pub per_block: Vec<BlockBytes>,
}

/// Time and tokens.
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// Tokens per step (all data-parallel batches).
    pub tokens_per_step: usize,
    /// Seconds of the distributed training loop (the slowest rank).
    pub distributed_seconds: f64,
    /// Tokens per second of the distributed run.
    pub distributed_tokens_per_s: f64,
    /// Seconds of the reference.
    pub reference_seconds: f64,
    /// Tokens per second of the reference.
    pub reference_tokens_per_s: f64,
}

/// The configuration, as run.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigSummary {
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Data-parallel ranks.
    pub dp: usize,
    /// Blocks.
    pub layers: usize,
    /// Residual width.
    pub hidden: usize,
    /// MLP width.
    pub ffn: usize,
    /// Tokens per batch.
    pub seq: usize,
    /// Steps.
    pub steps: usize,
    /// `--format`.
    pub format: &'static str,
    /// `--checkpoint`.
    pub checkpoint: &'static str,
    /// `--dropout`.
    pub dropout: f32,
    /// `--lr`.
    pub lr: f32,
    /// `--seed`.
    pub seed: u64,
    /// `--reference-sums`.
    pub reference_sums: &'static str,
    /// How FSDP gathers parameters.
    pub fsdp_wire: String,
    /// `--backend`: `threads` or `nccl`.
    pub backend: &'static str,
    /// Where rank 0's tensors lived, e.g. `cpu` or `cuda:0`.
    pub device: String,
}

/// Everything `tessera demo` found: `--report` writes it as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// The configuration.
    pub config: ConfigSummary,
    /// Both runs' losses, step by step.
    pub steps: Vec<StepRow>,
    /// The largest `|difference|`.
    pub max_abs_difference: f64,
    /// The largest `|difference| / |reference|`.
    pub max_rel_difference: f64,
    /// The tolerance and its terms.
    pub tolerance: Tolerance,
    /// The bound, absolute (`tolerance.relative · |L₀|`).
    pub tolerance_abs: f64,
    /// Time and tokens.
    pub throughput: Throughput,
    /// Rank 0's collectives.
    pub communication: Vec<CommRow>,
    /// Rank 0's saved activations.
    pub activations: Activations,
    /// Rank 0's parameter shards (f32, padding included).
    pub fsdp_shard_bytes: u64,
    /// Rank 0's most unsharded parameter bytes at once.
    pub fsdp_peak_unsharded_bytes: u64,
    /// Dropout masks compared.
    pub masks_checked: usize,
    /// Every check.
    pub checks: Vec<Check>,
    /// Whether every check passed.
    pub passed: bool,
}

/// `(step, block, data-parallel batch, region)`: the masks the TP ranks of one batch drew
/// at one place.
type MaskGroup = (usize, usize, usize, Region);

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Off => "none",
        Mode::Reentrant => "reentrant",
        Mode::NonReentrant => "non-reentrant",
    }
}

/// The peak a checkpointed run holds: every earlier block's input, then the block being
/// recomputed holds its input and all its recomputed activations at once.
fn checkpointed_peak(bytes: &[BlockBytes]) -> usize {
    let mut inputs = 0;
    let mut peak = 0;
    for b in bytes {
        inputs += b.input;
        peak = peak.max(inputs + b.saved);
    }
    peak
}

impl DemoReport {
    /// The report of a finished run.
    pub(crate) fn build(
        cfg: &DemoConfig,
        tolerance: &Tolerance,
        steps: Vec<StepRow>,
        reference: &[RefStep],
        reference_time: Duration,
        ranks: &[RankOutput],
    ) -> DemoReport {
        let l0 = reference.first().map_or(0.0, |r| r.loss);
        let max_abs = steps.iter().map(|r| r.difference.abs()).fold(0.0, f64::max);
        let max_rel = steps
            .iter()
            .map(|r| r.difference.abs() / r.reference.abs().max(f64::MIN_POSITIVE))
            .fold(0.0, f64::max);
        let mut checks = Vec::new();

        // The loss.
        let bad: Vec<usize> = steps.iter().filter(|r| !r.ok).map(|r| r.step).collect();
        let complete = steps.len() == cfg.steps;
        checks.push(Check {
            name: if tolerance.exact {
                "losses equal bit for bit".into()
            } else {
                "loss difference within tolerance".into()
            },
            passed: bad.is_empty() && complete,
            detail: if !complete {
                format!("only {} of {} steps reported", steps.len(), cfg.steps)
            } else if bad.is_empty() {
                format!(
                    "max |difference| {max_abs:.3e} over {} steps, tolerance {:.3e}",
                    steps.len(),
                    tolerance.bound(l0)
                )
            } else {
                format!("steps {bad:?} exceed {:.3e}", tolerance.bound(l0))
            },
        });

        // The masks.
        let mut groups: BTreeMap<MaskGroup, Vec<(usize, u64)>> = BTreeMap::new();
        for m in ranks.iter().flat_map(|o| &o.masks) {
            groups
                .entry((m.step, m.layer, m.dp, m.region))
                .or_default()
                .push((m.tp, m.checksum));
        }
        let reference_masks: BTreeMap<(usize, usize, usize, Region, usize), u64> = reference
            .iter()
            .flat_map(|r| &r.masks)
            .map(|m| ((m.step, m.layer, m.dp, m.region, m.tp), m.checksum))
            .collect();
        // Two independent masks of n elements agree with probability (p² + (1-p)²)ⁿ; a
        // group whose masks could agree by chance says nothing about their streams.
        let p = f64::from(cfg.dropout);
        let n_mp = (cfg.seq * cfg.local_ffn()) as f64;
        let informative = (p * p + (1.0 - p) * (1.0 - p)).powf(n_mp) < 1e-9;
        let (mut dp_groups, mut dp_bad, mut mp_groups, mut mp_bad) = (0, 0, 0, 0);
        let (mut masks_checked, mut not_reproduced) = (0, 0);
        for ((step, layer, dp, region), v) in &groups {
            match region {
                Region::DataParallel => {
                    dp_groups += 1;
                    dp_bad += usize::from(v.iter().any(|(_, c)| *c != v[0].1));
                }
                Region::ModelParallel => {
                    mp_groups += 1;
                    let mut c: Vec<u64> = v.iter().map(|(_, c)| *c).collect();
                    c.sort_unstable();
                    c.dedup();
                    mp_bad += usize::from(informative && c.len() != v.len());
                }
            }
            for (tp, c) in v {
                let t = if *region == Region::ModelParallel {
                    *tp
                } else {
                    0
                };
                masks_checked += 1;
                if reference_masks.get(&(*step, *layer, *dp, *region, t)) != Some(c) {
                    not_reproduced += 1;
                }
            }
        }
        // The model-parallel streams themselves: one seed per TP rank, the same on every
        // data-parallel replica.
        let mut seeds: Vec<(usize, u64)> = ranks.iter().map(|o| (o.tp_rank, o.mp_seed)).collect();
        seeds.sort_unstable();
        seeds.dedup();
        let mut distinct: Vec<u64> = seeds.iter().map(|s| s.1).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let seeds_ok = seeds.len() == cfg.tp && distinct.len() == cfg.tp;
        let expected_masks = cfg.steps * cfg.layers * cfg.dp * cfg.tp * 2;
        checks.push(Check {
            name: "data-parallel-region dropout masks identical across TP ranks".into(),
            passed: dp_bad == 0 && dp_groups > 0,
            detail: format!(
                "{} of {dp_groups} (step, block, batch) groups of {} ranks agree",
                dp_groups - dp_bad,
                cfg.tp
            ),
        });
        checks.push(Check {
            name: "model-parallel-region dropout masks differ across TP ranks".into(),
            passed: mp_bad == 0 && mp_groups > 0 && seeds_ok,
            detail: if cfg.tp == 1 {
                "one TP rank: nothing to differ from".into()
            } else if !seeds_ok {
                format!("the TP ranks' model-parallel seeds are not one distinct seed per rank: {seeds:?}")
            } else if informative {
                format!(
                    "{} seeds, one per TP rank; {} of {mp_groups} (step, block, batch) groups of {} \
                     masks pairwise different",
                    cfg.tp,
                    mp_groups - mp_bad,
                    cfg.tp
                )
            } else {
                format!(
                    "{} seeds, one per TP rank; masks of {n_mp} elements at p = {} can agree by \
                     chance, so they were not compared",
                    cfg.tp, cfg.dropout
                )
            },
        });
        checks.push(Check {
            name: "every dropout mask equals the reference's".into(),
            passed: not_reproduced == 0 && masks_checked == expected_masks,
            detail: format!(
                "{} of {masks_checked} masks equal (expected {expected_masks})",
                masks_checked - not_reproduced
            ),
        });

        // Activations (rank 0).
        let rank0 = ranks.iter().find(|o| o.tp_rank == 0 && o.dp_rank == 0);
        let per_block = rank0.map(|o| o.bytes.clone()).unwrap_or_default();
        let without = per_block.iter().map(|b| b.saved).sum::<usize>();
        let with = checkpointed_peak(&per_block);
        let meter_peak = rank0.map_or(0, |o| o.peak_saved);
        let checkpointed = cfg.checkpoint != Mode::Off;
        let computed_for_mode = if checkpointed { with } else { without };
        checks.push(Check {
            name: "saved-activation meter matches the blocks' byte counts".into(),
            passed: meter_peak == computed_for_mode && meter_peak > 0,
            detail: format!(
                "meter peak {meter_peak} B, computed {computed_for_mode} B ({})",
                if checkpointed {
                    "inputs of every block + one block's recomputed activations"
                } else {
                    "everything every block saved"
                }
            ),
        });
        if checkpointed {
            let want = cfg.steps * cfg.layers;
            let short: Vec<String> = ranks
                .iter()
                .filter(|o| o.recomputes != want)
                .map(|o| format!("rank {}: {}", o.dp_rank * cfg.tp + o.tp_rank, o.recomputes))
                .collect();
            checks.push(Check {
                name: "every checkpointed block recomputed, replaying its RNG".into(),
                passed: short.is_empty(),
                detail: if short.is_empty() {
                    format!(
                        "{want} recomputes per rank; the determinism check compared every \
                         saved tensor (masks included) with its forward"
                    )
                } else {
                    format!(
                        "expected {want} recomputes per rank, got {}",
                        short.join(", ")
                    )
                },
            });
        }

        let communication = rank0
            .map(|o| {
                o.traffic
                    .entries()
                    .map(|(k, e)| {
                        let c = &e.counts;
                        let kinds = [
                            ("all-gather", c.all_gather.calls),
                            ("reduce-scatter", c.reduce_scatter.calls),
                            ("all-reduce", c.all_reduce.calls),
                            ("broadcast", c.broadcast.calls),
                        ]
                        .into_iter()
                        .filter(|(_, n)| *n > 0)
                        .map(|(k, n)| format!("{k} {n}"))
                        .collect::<Vec<_>>()
                        .join(", ");
                        CommRow {
                            group: k.group,
                            what: k.what.clone(),
                            format: k.format.clone(),
                            calls: kinds,
                            bytes: e.total().bytes,
                            wire_bytes: e.total().wire_bytes,
                            f32_bytes: e.f32_bytes,
                        }
                    })
                    .filter(|r| r.bytes > 0)
                    .collect()
            })
            .unwrap_or_default();

        let secs = ranks
            .iter()
            .map(|o| o.elapsed.as_secs_f64())
            .fold(0.0, f64::max);
        let tokens = cfg.tokens_per_step() * cfg.steps;
        let per_s = |t: f64| if t > 0.0 { tokens as f64 / t } else { 0.0 };
        let passed = checks.iter().all(|c| c.passed);
        DemoReport {
            config: ConfigSummary {
                tp: cfg.tp,
                dp: cfg.dp,
                layers: cfg.layers,
                hidden: cfg.hidden,
                ffn: cfg.ffn,
                seq: cfg.seq,
                steps: cfg.steps,
                format: format_name(cfg.format),
                checkpoint: mode_name(cfg.checkpoint),
                dropout: cfg.dropout,
                lr: cfg.lr,
                seed: cfg.seed,
                reference_sums: match cfg.reference_sums {
                    ReferenceSums::Split => "split",
                    ReferenceSums::Whole => "whole",
                },
                fsdp_wire: rank0.map(|o| o.fsdp_wire.clone()).unwrap_or_default(),
                backend: match cfg.backend {
                    Backend::Threads => "threads",
                    Backend::Nccl => "nccl",
                },
                device: cfg.device.to_string(),
            },
            steps,
            max_abs_difference: max_abs,
            max_rel_difference: max_rel,
            tolerance: tolerance.clone(),
            tolerance_abs: tolerance.bound(l0),
            throughput: Throughput {
                tokens_per_step: cfg.tokens_per_step(),
                distributed_seconds: secs,
                distributed_tokens_per_s: per_s(secs),
                reference_seconds: reference_time.as_secs_f64(),
                reference_tokens_per_s: per_s(reference_time.as_secs_f64()),
            },
            communication,
            activations: Activations {
                mode: mode_name(cfg.checkpoint),
                without_checkpointing: without as u64,
                with_checkpointing: with as u64,
                measured: if checkpointed {
                    "with checkpointing"
                } else {
                    "without checkpointing"
                },
                meter_peak: meter_peak as u64,
                per_block,
            },
            fsdp_shard_bytes: rank0.map_or(0, |o| o.fsdp.shard_bytes as u64),
            fsdp_peak_unsharded_bytes: rank0.map_or(0, |o| o.fsdp.peak_full_bytes as u64),
            masks_checked,
            checks,
            passed,
        }
    }

    /// Writes the report as pretty-printed JSON.
    pub fn write_json(&self, path: &Path) -> Result<(), DemoError> {
        let io = |source| DemoError::Io {
            what: path.display().to_string(),
            source,
        };
        let json = serde_json::to_vec_pretty(self).map_err(|e| io(e.into()))?;
        std::fs::write(path, json).map_err(io)
    }

    /// `Ok` when every check passed, else [`DemoError::ChecksFailed`].
    pub fn result(&self) -> Result<(), DemoError> {
        let failed: Vec<&str> = self
            .checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.name.as_str())
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(DemoError::ChecksFailed {
                failed: failed.len(),
                total: self.checks.len(),
                names: failed.join("; "),
            })
        }
    }
}

/// `1.5 MiB`, `12.0 KiB`, `512 B`.
pub(crate) fn human_bytes(b: u64) -> String {
    const K: f64 = 1024.0;
    let f = b as f64;
    if f >= K * K * K {
        format!("{:.2} GiB", f / (K * K * K))
    } else if f >= K * K {
        format!("{:.2} MiB", f / (K * K))
    } else if f >= K {
        format!("{:.1} KiB", f / K)
    } else {
        format!("{b} B")
    }
}

/// Rows of cells as aligned columns, each line starting with `indent`.
fn table(rows: &[Vec<String>], right: &[bool], indent: &str) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        out += indent;
        for (c, cell) in r.iter().enumerate() {
            let pad = " ".repeat(width[c] - cell.chars().count());
            if c > 0 {
                out += "  ";
            }
            if right.get(c).copied().unwrap_or(false) {
                out += &pad;
                out += cell;
            } else {
                out += cell;
                if c + 1 < r.len() {
                    out += &pad;
                }
            }
        }
        out += "\n";
    }
    out
}

/// `12,345`.
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Where the demo prints: the table and summary on stdout, a progress bar on stderr
/// (drawn only when stderr is a terminal).
#[derive(Debug)]
pub struct Console {
    bar: ProgressBar,
}

fn io_err(source: std::io::Error) -> DemoError {
    DemoError::Io {
        what: "standard output".into(),
        source,
    }
}

impl Console {
    /// A console for a run of `steps` steps.
    pub fn new(steps: usize) -> Console {
        let style = ProgressStyle::with_template(
            "{prefix:>11} {bar:32} {pos}/{len} steps  {elapsed_precise}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        let bar = ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stderr())
            .with_style(style);
        Console { bar }
    }

    fn print(&self, text: &str) -> Result<(), DemoError> {
        self.bar
            .suspend(|| {
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes())?;
                out.flush()
            })
            .map_err(io_err)
    }

    pub(crate) fn intro(&self, cfg: &DemoConfig) -> Result<(), DemoError> {
        self.print(&format!(
            "tessera demo: {} blocks (hidden {}, ffn {}), {} tokens per batch, {} steps\n  \
             ranks   tp {} × dp {} = {} {}; {} tokens per TP rank between blocks\n  \
             recipe  {}: {}\n  \
             recompute {}\n\n",
            cfg.layers,
            cfg.hidden,
            cfg.ffn,
            cfg.seq,
            cfg.steps,
            cfg.tp,
            cfg.dp,
            cfg.world(),
            match cfg.backend {
                Backend::Threads => "thread ranks",
                Backend::Nccl => "processes over NCCL, one GPU each",
            },
            cfg.local_tokens(),
            format_name(cfg.format),
            format_recipe(cfg.format),
            match cfg.checkpoint {
                Mode::Off => "off (--checkpoint none)",
                Mode::Reentrant => "reentrant checkpointing of every block",
                Mode::NonReentrant => "non-reentrant checkpointing of every block",
            },
        ))
    }

    pub(crate) fn phase(&self, name: &str) {
        self.bar.reset();
        self.bar.set_prefix(name.to_string());
    }

    pub(crate) fn tick(&self) {
        self.bar.inc(1);
    }

    pub(crate) fn done(&self) {
        self.bar.finish_and_clear();
    }

    pub(crate) fn table_header(&self, tol: &Tolerance, l0: f64) -> Result<(), DemoError> {
        let bound = if tol.exact {
            "0 (bit for bit)".to_string()
        } else {
            format!("{:.3e}", tol.bound(l0))
        };
        self.print(&format!(
            "{:>5}  {:>18}  {:>18}  {:>11}   tolerance {bound}\n",
            "step", "distributed loss", "reference loss", "difference"
        ))
    }

    pub(crate) fn row(&self, r: &StepRow) -> Result<(), DemoError> {
        self.print(&format!(
            "{:>5}  {:>18.12}  {:>18.12}  {:>+11.3e}   {}\n",
            r.step,
            r.loss,
            r.reference,
            r.difference,
            if r.ok { "ok" } else { "EXCEEDS" }
        ))
    }

    /// Prints the summary block.
    pub(crate) fn summary(&self, r: &DemoReport) -> Result<(), DemoError> {
        let mut s = String::from("\nsummary\n");
        let t = &r.tolerance;
        let l0 = r.steps.first().map_or(0.0, |x| x.reference);
        if t.exact {
            s += &format!(
                "  loss         max |difference| {:.3e} over {} steps; held to 0 (bit for bit): {}\n",
                r.max_abs_difference,
                r.steps.len(),
                if r.config.tp == 1 {
                    "with --tp 1 no sum is split, so both runs add every product in the same order"
                } else {
                    "the reference adds the ranks' partial\n               products (FC2, FC1's \
                     input gradient) in rank order and LayerNorm's gradients per sequence shard,\n               \
                     each product with a rank's shape, so both runs make the same float additions \
                     in the same order"
                }
            );
            if !t.terms.is_empty() {
                s += &format!(
                    "               (--reference-sums whole multiplies whole matrices; the bound is then \
                     4·u·K·L₀ = {:.3e}, K = {})\n",
                    t.whole_relative * l0.abs(),
                    grouped(t.k as u64)
                );
            }
        } else {
            s += &format!(
                "  loss         max |difference| {:.3e} (relative {:.3e}) over {} steps; tolerance \
                 {:.3e} = 4·u·K·L₀\n",
                r.max_abs_difference,
                r.max_rel_difference,
                r.steps.len(),
                r.tolerance_abs
            );
            s += &format!(
                "               u = 2⁻²⁴ (f32), L₀ = {l0:.6} (reference, step 1), K = {} = {} blocks × \
                 the sums added in another order:\n",
                grouped(t.k as u64),
                t.layers
            );
            for (what, n) in &t.terms {
                s += &format!("{:>21}  {what}\n", grouped(*n as u64));
            }
            s += "               any order of a K-term sum is within K·u of the exact sum, so two \
                  orders differ by ≤ 2·K·u,\n               doubled for the quadratic loss; later \
                  steps' weight differences add at most that of the loss decrease.\n               \
                  A first-order f32 bound: a rounding difference that moves an element across a \
                  step of\n               the format grows further (--reference-sums split checks \
                  bit for bit)\n";
        }
        let th = &r.throughput;
        s += &format!(
            "  throughput   distributed {} tokens/s ({} steps × {} tokens in {:.2} s on {} {} \
             on {}); reference {} tokens/s (1 rank, {:.2} s)\n",
            grouped(th.distributed_tokens_per_s as u64),
            r.config.steps,
            th.tokens_per_step,
            th.distributed_seconds,
            r.config.tp * r.config.dp,
            if r.config.backend == "nccl" {
                "processes"
            } else {
                "thread ranks"
            },
            r.config.device,
            grouped(th.reference_tokens_per_s as u64),
            th.reference_seconds
        );
        s += &format!(
            "  communicated by rank 0 over {} steps (bytes it sent; 'vs f32' = bytes / the same \
             tensors in f32)\n",
            r.config.steps
        );
        let mut rows = vec![
            ["group", "collective", "format", "calls", "bytes", "vs f32"]
                .map(String::from)
                .to_vec(),
        ];
        for c in &r.communication {
            let ratio = if c.f32_bytes > 0 {
                format!("{:.3}", c.bytes as f64 / c.f32_bytes as f64)
            } else {
                "-".into()
            };
            rows.push(vec![
                c.group.to_string(),
                c.what.clone(),
                c.format.clone(),
                c.calls.clone(),
                human_bytes(c.bytes),
                ratio,
            ]);
        }
        s += &table(&rows, &[false, false, false, true, true, true], "    ");
        if r.communication.iter().any(|c| c.format.contains(", then ")) {
            s += "    (f32, then F: the shard cannot travel in F — its blocks would straddle \
                  ranks — so it travels in f32\n     and the gathered tensor is quantized)\n";
        }
        if r.communication.is_empty() {
            s += "    (nothing: a single rank)\n";
        }
        let a = &r.activations;
        let (m_without, m_with) = if a.measured == "with checkpointing" {
            ("computed", "measured")
        } else {
            ("measured", "computed")
        };
        s += &format!(
            "  activations  peak saved per rank: {} without checkpointing ({m_without}), {} with \
             checkpointing ({m_with}; {:.1}×)\n               the frames' meter measures the run's \
             mode; the other comes from the same per-block byte counts\n",
            human_bytes(a.without_checkpointing),
            human_bytes(a.with_checkpointing),
            a.without_checkpointing as f64 / a.with_checkpointing.max(1) as f64
        );
        s += &format!(
            "  fsdp         parameter shards {} per rank ({}); peak unsharded {}\n",
            human_bytes(r.fsdp_shard_bytes),
            r.config.fsdp_wire,
            human_bytes(r.fsdp_peak_unsharded_bytes)
        );
        s += &format!(
            "  rng          {} dropout masks compared\n",
            grouped(r.masks_checked as u64)
        );
        s += "  checks\n";
        for c in &r.checks {
            s += &format!(
                "    {} {}: {}\n",
                if c.passed { "ok  " } else { "FAIL" },
                c.name,
                c.detail
            );
        }
        let passed = r.checks.iter().filter(|c| c.passed).count();
        s += &format!(
            "  result       {} ({passed} of {} checks passed)\n",
            if r.passed { "PASSED" } else { "FAILED" },
            r.checks.len()
        );
        self.print(&s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpointed_peak_is_inputs_plus_one_block() {
        let b = |input, saved| BlockBytes { input, saved };
        assert_eq!(
            checkpointed_peak(&[b(10, 100), b(10, 100), b(10, 100)]),
            130
        );
        assert_eq!(checkpointed_peak(&[b(10, 500), b(10, 100)]), 510);
        assert_eq!(checkpointed_peak(&[]), 0);
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(grouped(1234567), "1,234,567");
        assert_eq!(grouped(12), "12");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 20), "3.00 MiB");
    }
}
