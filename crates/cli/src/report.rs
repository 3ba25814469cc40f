//! `tessera report`: quantize every tensor of a model in memory and measure the error.

use std::io::Write;

use anyhow::Context;
use tessera_core::{DType, Tensor};
use tessera_quant::{QuantizedTensor, Usage};

use crate::args::ReportArgs;
use crate::io::{Input, InputDtype};
use crate::progress;
use crate::recipe::{self, Recipe};

/// Runs `tessera report`, printing to stdout.
pub fn run(a: &ReportArgs) -> anyhow::Result<()> {
    let recipe = Recipe::from_args(&a.quant)?;
    let input = Input::read(&a.model)?;
    let mut out = std::io::stdout().lock();
    report(&input, &recipe, &mut out)?;
    out.flush()?;
    Ok(())
}

/// The error one quantized tensor makes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorStats {
    /// The largest `|x − x̂|`.
    pub max_abs: f64,
    /// `10·log10(Σx² / Σ(x − x̂)²)` in dB; `+inf` when `x̂ = x`.
    pub snr_db: f64,
}

impl ErrorStats {
    /// The error of `y` as an approximation of `x` (same length), summed in f64.
    pub fn of(x: &[f32], y: &[f32]) -> ErrorStats {
        let (mut signal, mut noise, mut max_abs) = (0f64, 0f64, 0f64);
        for (&a, &b) in x.iter().zip(y) {
            let (a, b) = (f64::from(a), f64::from(b));
            let d = a - b;
            signal += a * a;
            noise += d * d;
            // NaN must win, and `f64::max` ignores it.
            if d.is_nan() || d.abs() > max_abs {
                max_abs = d.abs();
            }
        }
        let snr_db = if noise == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (signal / noise).log10()
        };
        ErrorStats { max_abs, snr_db }
    }

    /// The worse of two errors (larger maximum, smaller SNR).
    fn worst(self, o: ErrorStats) -> ErrorStats {
        ErrorStats {
            max_abs: if o.max_abs.is_nan() {
                o.max_abs
            } else {
                self.max_abs.max(o.max_abs)
            },
            snr_db: if o.snr_db.is_nan() {
                o.snr_db
            } else {
                self.snr_db.min(o.snr_db)
            },
        }
    }
}

/// The error of `qt` against the tensor `x` it was quantized from: of each orientation
/// it has, the worse.
pub fn measure(x: &Tensor, qt: &QuantizedTensor) -> anyhow::Result<ErrorStats> {
    let xv = x.to_f32_vec()?;
    let usages: &[Usage] = match qt.usage() {
        Usage::Both => &[Usage::Rowwise, Usage::Columnwise],
        Usage::Rowwise => &[Usage::Rowwise],
        Usage::Columnwise => &[Usage::Columnwise],
    };
    let mut worst: Option<ErrorStats> = None;
    for &u in usages {
        let y = qt.dequantize_usage(u, DType::F32)?;
        let e = ErrorStats::of(&xv, y.as_slice::<f32>()?);
        worst = Some(worst.map_or(e, |w| w.worst(e)));
    }
    Ok(worst.expect("a quantized tensor has at least one orientation"))
}

/// `+inf`, or the value with two decimals.
fn fmt_snr(snr: f64) -> String {
    if snr == f64::INFINITY {
        "+inf".to_owned()
    } else {
        format!("{snr:.2}")
    }
}

/// Writes the report of quantizing every tensor of `input` with `recipe` to `out`: a
/// title line, a header line, one line per tensor, and a summary line. Tensors whose
/// dtype or shape the format cannot hold are listed as skipped, with the reason.
pub fn report(input: &Input, recipe: &Recipe, out: &mut dyn Write) -> anyhow::Result<()> {
    let mut quantizer = recipe.quantizer()?;
    let name_w = input
        .entries
        .iter()
        .map(|e| e.name.len())
        .max()
        .unwrap_or(0)
        .max("tensor".len());
    let shape_w = input
        .entries
        .iter()
        .map(|e| e.shape.to_string().len())
        .max()
        .unwrap_or(0)
        .max("shape".len());
    writeln!(
        out,
        "tessera report of `{}` as {}",
        input.path.display(),
        recipe.describe()
    )?;
    writeln!(
        out,
        "{:name_w$}  {:shape_w$}  {:5}  {:>12}  {:>12}  {:>11}  {:>8}",
        "tensor", "shape", "dtype", "bytes", "quantized", "max abs err", "SNR (dB)"
    )?;
    let bar = progress::bar(input.total_bytes());
    let (mut before, mut after, mut quantized, mut skipped) = (0u64, 0u64, 0usize, 0usize);
    let mut worst: Option<(f64, &str)> = None;
    for e in &input.entries {
        bar.set_message(e.name.clone());
        let dtype = match &e.dtype {
            InputDtype::Float(d) => d.name().to_owned(),
            InputDtype::Unsupported(d) => d.clone(),
        };
        let skip = e
            .unsupported_reason(input.kind)
            .or_else(|| recipe::shape_problem(quantizer.as_ref(), &e.shape));
        let line = match skip {
            Some(why) => {
                skipped += 1;
                format!(
                    "{:name_w$}  {:shape_w$}  {dtype:5}  {:>12}  {:>12}  {:>11}  {:>8}  skipped: {why}",
                    e.name,
                    e.shape.to_string(),
                    e.size_in_bytes(),
                    "-",
                    "-",
                    "-"
                )
            }
            None => {
                let x = input.tensor(e)?;
                let qt = quantizer
                    .quantize(&x)
                    .with_context(|| format!("tensor `{}`", e.name))?;
                let err = measure(&x, &qt).with_context(|| format!("tensor `{}`", e.name))?;
                quantized += 1;
                before += e.size_in_bytes() as u64;
                after += qt.size_in_bytes() as u64;
                if worst.is_none_or(|(w, _)| err.snr_db < w || err.snr_db.is_nan()) {
                    worst = Some((err.snr_db, &e.name));
                }
                format!(
                    "{:name_w$}  {:shape_w$}  {dtype:5}  {:>12}  {:>12}  {:>11.3e}  {:>8}",
                    e.name,
                    e.shape.to_string(),
                    e.size_in_bytes(),
                    qt.size_in_bytes(),
                    err.max_abs,
                    fmt_snr(err.snr_db)
                )
            }
        };
        bar.suspend(|| writeln!(out, "{line}"))?;
        bar.inc(e.size_in_bytes() as u64);
    }
    bar.finish_and_clear();
    let plural = |n: usize| if n == 1 { "tensor" } else { "tensors" };
    write!(
        out,
        "total: {quantized} {} quantized, {skipped} skipped",
        plural(quantized)
    )?;
    if let Some((snr, name)) = worst {
        let ratio = if after == 0 {
            f64::INFINITY
        } else {
            before as f64 / after as f64
        };
        write!(
            out,
            "; {before} -> {after} bytes (ratio {ratio:.2}:1); worst SNR {} dB (`{name}`)",
            fmt_snr(snr)
        )?;
    }
    writeln!(out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_of_exact_and_noisy_values() {
        let e = ErrorStats::of(&[1.0, -2.0], &[1.0, -2.0]);
        assert_eq!(e.max_abs, 0.0);
        assert_eq!(e.snr_db, f64::INFINITY);
        // Σx² = 100, Σd² = 1: 20 dB.
        let e = ErrorStats::of(&[6.0, 8.0], &[6.0, 9.0]);
        assert_eq!(e.max_abs, 1.0);
        assert!((e.snr_db - 20.0).abs() < 1e-12);
        let e = ErrorStats::of(&[0.0], &[1.0]);
        assert_eq!(e.snr_db, f64::NEG_INFINITY);
        let e = ErrorStats::of(&[1.0, 1.0], &[f32::NAN, 1.0]);
        assert!(e.max_abs.is_nan() && e.snr_db.is_nan());
    }

    #[test]
    fn worst_takes_the_larger_error() {
        let a = ErrorStats {
            max_abs: 1.0,
            snr_db: 30.0,
        };
        let b = ErrorStats {
            max_abs: 0.5,
            snr_db: 20.0,
        };
        assert_eq!(
            a.worst(b),
            ErrorStats {
                max_abs: 1.0,
                snr_db: 20.0
            }
        );
    }

    #[test]
    fn snr_formats() {
        assert_eq!(fmt_snr(f64::INFINITY), "+inf");
        assert_eq!(fmt_snr(31.456), "31.46");
    }
}
