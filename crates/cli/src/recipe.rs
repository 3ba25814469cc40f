//! A format and its options, checked: built from the command line, turned into a
//! quantizer, and written to and read from a file's `__metadata__`.
//!
//! # Metadata keys
//!
//! Every value is a string (safetensors allows nothing else).
//!
//! | key | value | written for |
//! |---|---|---|
//! | `producer` | `tessera <version>` | all |
//! | `format` | `fp8-current`, `fp8-delayed`, `mxfp8`, `nvfp4` or `fp8-block` | all |
//! | `usage` | `rowwise`, `columnwise` or `both` | all |
//! | `fp8` | `e4m3` or `e5m2` | all but nvfp4 |
//! | `scales` | `pow2` or `fp32` | fp8-current, fp8-block |
//! | `eps` | the amax floor, e.g. `0` | fp8-current, fp8-block |
//! | `scale` | the delayed scale, e.g. `1` | fp8-delayed |
//! | `2d` | `true` or `false` | mxfp8, nvfp4 |
//! | `swizzled` | `true` or `false` | mxfp8, nvfp4 |
//! | `rht` | `true` or `false` | nvfp4 |
//! | `stochastic_rounding` | `true` or `false` | nvfp4 |
//! | `seed` | the stochastic-rounding seed | nvfp4 with stochastic rounding |
//! | `block_dim` | `1` or `2` | fp8-block |
//! | `NAME.shape` | tensor `NAME`'s logical shape, e.g. `[64, 128]` | per tensor |
//! | `NAME.dtype` | tensor `NAME`'s source dtype: `f32`, `bf16` or `f16` | per tensor |

use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, anyhow, bail};
use tessera_core::{DType, Shape};
use tessera_quant::{
    BlockDim, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format, Kind,
    Mxfp8Quantizer, Nvfp4Quantizer, Quantizer, Usage,
};

use crate::UsageError;
use crate::args::{Format, Fp8Arg, QuantArgs, ScalesArg, UsageArg};

/// A format with every option it has, defaults filled in (TransformerEngine's recipe
/// defaults). Options the format does not have keep their defaults and are ignored.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    /// The format.
    pub format: Format,
    /// The FP8 element format (not nvfp4).
    pub fp8: Fp8Format,
    /// The orientations produced.
    pub usage: Usage,
    /// Power-of-two scales (fp8-current, fp8-block).
    pub pow2_scales: bool,
    /// The amax floor (fp8-current, fp8-block).
    pub eps: f32,
    /// The delayed scale (fp8-delayed).
    pub scale: f32,
    /// 2-D tiles (mxfp8, nvfp4).
    pub two_d: bool,
    /// Swizzled scales (mxfp8, nvfp4).
    pub swizzled: bool,
    /// The random Hadamard transform of the columnwise operand (nvfp4).
    pub rht: bool,
    /// The stochastic-rounding seed, if stochastic rounding is on (nvfp4).
    pub seed: Option<u64>,
    /// The block shape (fp8-block).
    pub block_dim: BlockDim,
}

/// Which formats each option applies to, for error messages and metadata.
fn applies(option: &str, format: Format) -> bool {
    use Format::*;
    match option {
        "fp8" => format != Nvfp4,
        "scale" => format == Fp8Delayed,
        "scales" | "eps" => matches!(format, Fp8Current | Fp8Block),
        "2d" | "swizzled" => matches!(format, Mxfp8 | Nvfp4),
        "rht" | "stochastic_rounding" | "seed" => format == Nvfp4,
        "block_dim" => format == Fp8Block,
        "usage" => true,
        _ => false,
    }
}

/// The formats `option` applies to, as `a, b or c`.
fn formats_of(option: &str) -> String {
    let names: Vec<&str> = Format::ALL
        .into_iter()
        .filter(|&f| applies(option, f))
        .map(Format::name)
        .collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        Some((last, _)) => (*last).to_owned(),
        None => "no format".to_owned(),
    }
}

impl Recipe {
    /// TransformerEngine's defaults for `format`: E4M3, both usages, float32 scales for
    /// fp8-current and power-of-two scales for fp8-block, epsilon 0, scale 1, 1-D blocks,
    /// compact scales, no RHT, round to nearest.
    pub fn defaults(format: Format) -> Recipe {
        Recipe {
            format,
            fp8: Fp8Format::E4M3,
            usage: Usage::Both,
            pow2_scales: format == Format::Fp8Block,
            eps: 0.0,
            scale: 1.0,
            two_d: false,
            swizzled: false,
            rht: false,
            seed: None,
            block_dim: BlockDim::OneD,
        }
    }

    /// Checks the command-line options against the format: an option the format does not
    /// have, a negative epsilon or a non-positive scale is a [`UsageError`].
    pub fn from_args(a: &QuantArgs) -> Result<Recipe, UsageError> {
        let f = a.format;
        let given = [
            ("fp8", "--fp8", a.fp8.is_some()),
            ("scale", "--scale", a.scale.is_some()),
            ("scales", "--scales", a.scales.is_some()),
            ("eps", "--eps", a.eps.is_some()),
            ("2d", "--2d", a.two_d),
            ("block_dim", "--block-dim", a.block_dim.is_some()),
            ("swizzled", "--swizzled", a.swizzled),
            ("rht", "--rht", a.rht),
            (
                "stochastic_rounding",
                "--stochastic-rounding",
                a.stochastic_rounding,
            ),
            ("seed", "--seed", a.seed.is_some()),
        ];
        for (key, flag, present) in given {
            if present && !applies(key, f) {
                return Err(UsageError(format!(
                    "{flag} does not apply to --format {}; it applies to {}",
                    f.name(),
                    formats_of(key)
                )));
            }
        }
        let mut r = Recipe::defaults(f);
        if let Some(fp8) = a.fp8 {
            r.fp8 = match fp8 {
                Fp8Arg::E4m3 => Fp8Format::E4M3,
                Fp8Arg::E5m2 => Fp8Format::E5M2,
            };
        }
        if let Some(s) = a.scale {
            if !(s.is_finite() && s > 0.0) {
                return Err(UsageError(format!(
                    "--scale must be finite and positive, got {s}"
                )));
            }
            r.scale = s;
        }
        if let Some(s) = a.scales {
            r.pow2_scales = s == ScalesArg::Pow2;
        }
        if let Some(e) = a.eps {
            if !(e.is_finite() && e >= 0.0) {
                return Err(UsageError(format!(
                    "--eps must be finite and not negative, got {e}"
                )));
            }
            r.eps = e;
        }
        if let Some(u) = a.usage {
            r.usage = match u {
                UsageArg::Rowwise => Usage::Rowwise,
                UsageArg::Columnwise => Usage::Columnwise,
                UsageArg::Both => Usage::Both,
            };
        }
        r.two_d = a.two_d;
        r.swizzled = a.swizzled;
        r.rht = a.rht;
        r.seed = if a.stochastic_rounding { a.seed } else { None };
        if a.block_dim == Some(2) {
            r.block_dim = BlockDim::TwoD;
        }
        Ok(r)
    }

    /// The quantizer for this recipe.
    pub fn quantizer(&self) -> anyhow::Result<Box<dyn Quantizer>> {
        Ok(match self.format {
            Format::Fp8Current => Box::new(
                Fp8CurrentScaling::new(self.fp8)
                    .with_pow2_scales(self.pow2_scales)
                    .with_amax_epsilon(self.eps)
                    .with_usage(self.usage),
            ),
            Format::Fp8Delayed => Box::new(
                Fp8DelayedScaling::new(self.fp8, 1)?
                    .with_scale(self.scale)?
                    .with_usage(self.usage),
            ),
            Format::Mxfp8 => Box::new(
                Mxfp8Quantizer::new(self.fp8)
                    .with_2d(self.two_d)
                    .with_swizzled_scales(self.swizzled)
                    .with_usage(self.usage),
            ),
            Format::Nvfp4 => Box::new(
                Nvfp4Quantizer::new()
                    .with_2d(self.two_d)
                    .with_rht(self.rht)
                    .with_swizzled_scales(self.swizzled)
                    .with_stochastic_rounding(self.seed.map(tessera_rng::Generator::new))
                    .with_usage(self.usage),
            ),
            Format::Fp8Block => Box::new(
                Fp8BlockQuantizer::new(self.fp8, self.block_dim)
                    .with_pow2_scales(self.pow2_scales)
                    .with_amax_epsilon(self.eps)
                    .with_usage(self.usage),
            ),
        })
    }

    /// The [`Kind`] of the tensors this recipe makes.
    pub fn kind(&self) -> Kind {
        match self.format {
            Format::Fp8Current | Format::Fp8Delayed => Kind::Fp8 { format: self.fp8 },
            Format::Mxfp8 => Kind::Mxfp8 {
                format: self.fp8,
                two_d: self.two_d,
                swizzled: self.swizzled,
            },
            Format::Nvfp4 => Kind::Nvfp4 {
                two_d: self.two_d,
                rht: self.rht,
                swizzled: self.swizzled,
            },
            Format::Fp8Block => Kind::Fp8Block {
                format: self.fp8,
                block_dim: self.block_dim,
            },
        }
    }

    /// The options the format has, as `(key, value)` pairs in the order of the table in
    /// the module docs (without `producer` and `format`).
    pub fn options(&self) -> Vec<(&'static str, String)> {
        let f = self.format;
        let mut v = vec![("usage", self.usage.name().to_owned())];
        let all = [
            ("fp8", self.fp8.name().to_owned()),
            (
                "scales",
                if self.pow2_scales { "pow2" } else { "fp32" }.to_owned(),
            ),
            ("eps", self.eps.to_string()),
            ("scale", self.scale.to_string()),
            ("2d", self.two_d.to_string()),
            ("swizzled", self.swizzled.to_string()),
            ("rht", self.rht.to_string()),
            ("stochastic_rounding", self.seed.is_some().to_string()),
            (
                "block_dim",
                match self.block_dim {
                    BlockDim::OneD => "1",
                    BlockDim::TwoD => "2",
                }
                .to_owned(),
            ),
        ];
        v.extend(all.into_iter().filter(|(k, _)| applies(k, f)));
        if let Some(seed) = self.seed {
            v.push(("seed", seed.to_string()));
        }
        v
    }

    /// One line for humans: `mxfp8 (usage both, fp8 e4m3, 2d false, swizzled false)`.
    pub fn describe(&self) -> String {
        let opts: Vec<String> = self
            .options()
            .into_iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        format!("{} ({})", self.format.name(), opts.join(", "))
    }

    /// The file-level metadata entries: `producer`, `format` and [`options`](Self::options).
    pub fn to_metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert(
            "producer".to_owned(),
            format!("tessera {}", env!("CARGO_PKG_VERSION")),
        );
        m.insert("format".to_owned(), self.format.name().to_owned());
        for (k, v) in self.options() {
            m.insert(k.to_owned(), v);
        }
        m
    }

    /// Reads back what [`to_metadata`](Self::to_metadata) wrote; every key the format
    /// has must be present and valid.
    pub fn from_metadata(meta: &HashMap<String, String>) -> anyhow::Result<Recipe> {
        let format_name = meta.get("format").ok_or_else(|| {
            anyhow!(
                "its metadata has no `format` entry; only files written by `tessera quantize` can be dequantized"
            )
        })?;
        let format = Format::ALL
            .into_iter()
            .find(|f| f.name() == format_name)
            .ok_or_else(|| {
                anyhow!(
                    "its metadata names an unknown format `{format_name}`; expected one of {}",
                    Format::ALL.map(Format::name).join(", ")
                )
            })?;
        let get = |key: &str| -> anyhow::Result<&str> {
            meta.get(key).map(String::as_str).ok_or_else(|| {
                anyhow!("its metadata lacks `{key}`, which a {format_name} file must have")
            })
        };
        let bad =
            |key: &str, v: &str, want: &str| anyhow!("metadata `{key}` is `{v}`; expected {want}");
        let flag = |key: &str| -> anyhow::Result<bool> {
            match get(key)? {
                "true" => Ok(true),
                "false" => Ok(false),
                v => Err(bad(key, v, "true or false")),
            }
        };
        let float = |key: &str| -> anyhow::Result<f32> {
            let v = get(key)?;
            v.parse::<f32>()
                .ok()
                .filter(|x| x.is_finite())
                .ok_or_else(|| bad(key, v, "a finite number"))
        };
        let mut r = Recipe::defaults(format);
        r.usage = {
            let v = get("usage")?;
            v.parse()
                .map_err(|_| bad("usage", v, "rowwise, columnwise or both"))?
        };
        if applies("fp8", format) {
            let v = get("fp8")?;
            r.fp8 = v.parse().map_err(|_| bad("fp8", v, "e4m3 or e5m2"))?;
        }
        if applies("scales", format) {
            r.pow2_scales = match get("scales")? {
                "pow2" => true,
                "fp32" => false,
                v => return Err(bad("scales", v, "pow2 or fp32")),
            };
            r.eps = float("eps")?;
        }
        if applies("scale", format) {
            r.scale = float("scale")?;
        }
        if applies("2d", format) {
            r.two_d = flag("2d")?;
            r.swizzled = flag("swizzled")?;
        }
        if applies("rht", format) {
            r.rht = flag("rht")?;
            if flag("stochastic_rounding")? {
                let v = get("seed")?;
                r.seed = Some(v.parse().map_err(|_| bad("seed", v, "an integer"))?);
            }
        }
        if applies("block_dim", format) {
            r.block_dim = match get("block_dim")? {
                "1" => BlockDim::OneD,
                "2" => BlockDim::TwoD,
                v => return Err(bad("block_dim", v, "1 or 2")),
            };
        }
        Ok(r)
    }
}

/// Why `quantizer` cannot hold a tensor of `shape`, or `None` when it can.
pub fn shape_problem(quantizer: &dyn Quantizer, shape: &Shape) -> Option<String> {
    quantizer.check_shape(shape).err().map(|e| match e {
        tessera_core::Error::Shape { msg, .. } => msg,
        e => e.to_string(),
    })
}

/// The metadata entries describing tensor `name`: its logical shape and source dtype.
pub fn tensor_metadata(name: &str, shape: &Shape, dtype: DType) -> [(String, String); 2] {
    [
        (format!("{name}.shape"), shape.to_string()),
        (format!("{name}.dtype"), dtype.name().to_owned()),
    ]
}

/// The tensors the metadata describes, in name order, with their logical shape and
/// source dtype.
pub fn tensors_from_metadata(
    meta: &HashMap<String, String>,
) -> anyhow::Result<BTreeMap<String, (Shape, DType)>> {
    let mut out = BTreeMap::new();
    for (key, value) in meta {
        let Some(name) = key.strip_suffix(".shape") else {
            continue;
        };
        let shape = parse_shape(value)
            .with_context(|| format!("metadata `{key}` is `{value}`, not a shape like [2, 64]"))?;
        let dkey = format!("{name}.dtype");
        let dvalue = meta
            .get(&dkey)
            .ok_or_else(|| anyhow!("its metadata has `{key}` but no `{dkey}`"))?;
        let dtype: DType = dvalue
            .parse()
            .ok()
            .filter(|d: &DType| d.is_high_precision_float())
            .ok_or_else(|| anyhow!("metadata `{dkey}` is `{dvalue}`; expected f32, bf16 or f16"))?;
        out.insert(name.to_owned(), (shape, dtype));
    }
    Ok(out)
}

/// Parses `[2, 64]` (or `[]`).
fn parse_shape(s: &str) -> anyhow::Result<Shape> {
    let inner = s
        .trim()
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .ok_or_else(|| anyhow!("no brackets"))?
        .trim();
    if inner.is_empty() {
        return Ok(Shape::new([]));
    }
    let dims = inner
        .split(',')
        .map(|d| d.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!("{e}"))?;
    if dims.is_empty() {
        bail!("no dimensions");
    }
    Ok(Shape::new(dims))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_for_every_format() {
        for format in Format::ALL {
            let mut r = Recipe::defaults(format);
            r.usage = Usage::Rowwise;
            if applies("fp8", format) {
                r.fp8 = Fp8Format::E5M2;
            }
            if applies("2d", format) {
                r.two_d = true;
                r.swizzled = true;
            }
            if applies("rht", format) {
                r.rht = true;
                r.seed = Some(7);
            }
            if applies("block_dim", format) {
                r.block_dim = BlockDim::TwoD;
            }
            if applies("eps", format) {
                r.eps = 1e-12;
                r.pow2_scales = !r.pow2_scales;
            }
            if applies("scale", format) {
                r.scale = 0.1;
            }
            let meta: HashMap<String, String> = r.to_metadata().into_iter().collect();
            assert_eq!(Recipe::from_metadata(&meta).unwrap(), r, "{format:?}");
        }
    }

    #[test]
    fn shapes_parse() {
        assert_eq!(parse_shape("[2, 64]").unwrap(), Shape::new([2, 64]));
        assert_eq!(parse_shape("[]").unwrap(), Shape::new([]));
        assert_eq!(
            parse_shape(&Shape::new([3, 1, 7]).to_string()).unwrap(),
            Shape::new([3, 1, 7])
        );
        assert!(parse_shape("2, 64").is_err());
        assert!(parse_shape("[2, x]").is_err());
        assert!(parse_shape("[2,]").is_err());
    }

    #[test]
    fn tensor_names_may_contain_dots() {
        let mut meta = HashMap::new();
        for name in ["model.layers.0.weight", "x.shape"] {
            for (k, v) in tensor_metadata(name, &Shape::new([32, 32]), DType::BF16) {
                meta.insert(k, v);
            }
        }
        let t = tensors_from_metadata(&meta).unwrap();
        assert_eq!(
            t.keys().collect::<Vec<_>>(),
            ["model.layers.0.weight", "x.shape"]
        );
    }

    #[test]
    fn formats_of_lists_the_formats() {
        assert_eq!(formats_of("rht"), "nvfp4");
        assert_eq!(formats_of("2d"), "mxfp8 or nvfp4");
        assert_eq!(
            formats_of("fp8"),
            "fp8-current, fp8-delayed, mxfp8 or fp8-block"
        );
    }
}
