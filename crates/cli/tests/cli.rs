//! End-to-end tests of the `tessera` binary: quantize → dequantize round trips for every
//! format, byte-equality with the library, metadata, error paths and `report`.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use half::{bf16, f16};
use npyz::WriterBuilder;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use tessera_core::{DType, Device, Tensor};
use tessera_quant::{
    BlockDim, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format, Mxfp8Quantizer,
    Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage,
};

// ---------------------------------------------------------------------------------------
// helpers

/// A fresh directory under the system temp dir, removed when dropped.
struct TestDir(PathBuf);

impl TestDir {
    fn new(name: &str) -> TestDir {
        let dir =
            std::env::temp_dir().join(format!("tessera-cli-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }

    /// The names of the files in the directory, sorted.
    fn files(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn run_tessera<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .output()
        .expect("the tessera binary runs")
}

/// Runs the binary with these arguments (strings or paths).
macro_rules! tessera {
    ($($a:expr),* $(,)?) => {
        run_tessera([$(std::ffi::OsString::from(AsRef::<std::ffi::OsStr>::as_ref(&$a))),*])
    };
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

#[track_caller]
fn assert_ok(o: &Output) {
    assert!(
        o.status.success(),
        "tessera failed ({}): {}",
        o.status,
        stderr(o)
    );
}

/// Asserts a failure with exit code `code` and exactly one `error: ...` line on stderr
/// containing every one of `needles`.
#[track_caller]
fn assert_fails(o: &Output, code: i32, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line expected: {err:?}");
    assert!(err.starts_with("error: "), "{err:?}");
    for n in needles {
        assert!(err.contains(n), "`{n}` not in {err:?}");
    }
    assert!(o.stdout.is_empty(), "stdout: {}", stdout(o));
}

/// Well-conditioned test values: magnitudes in [0.5, 2], mixed signs, so every format
/// quantizes them in its normal range.
fn values(n: usize, salt: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let t = ((i as f64 + 1.0) * 0.618_033_988_75 + f64::from(salt) * 0.414_213_56).fract();
            let mag = 0.5 + 1.5 * t;
            let sign = if (i * 7 + salt as usize).is_multiple_of(3) {
                -1.0
            } else {
                1.0
            };
            (sign * mag) as f32
        })
        .collect()
}

/// A host tensor of `dtype` from f32 values (rounded to nearest for bf16 and f16).
fn tensor(v: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_f32_values(v, shape, dtype, Device::Cpu).unwrap()
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F8E4M3 => Dtype::F8_E4M3,
        DType::F8E5M2 => Dtype::F8_E5M2,
        DType::E8M0 => Dtype::F8_E8M0,
        DType::F4E2M1x2 | DType::U8 => Dtype::U8,
        DType::I32 => Dtype::I32,
        other => panic!("no safetensors dtype for {other}"),
    }
}

/// Writes `(name, dtype, shape, bytes)` entries to a safetensors file.
fn write_raw_safetensors(path: &Path, entries: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(&str, TensorView<'_>)> = entries
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) {
    let entries: Vec<_> = tensors
        .iter()
        .map(|(n, t)| {
            (
                *n,
                st_dtype(t.dtype()),
                t.shape().dims().to_vec(),
                t.as_bytes().unwrap().to_vec(),
            )
        })
        .collect();
    write_raw_safetensors(path, &entries);
}

fn write_npy_f32(path: &Path, v: &[f32], shape: &[u64], order: npyz::Order) {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::<f32>::new()
        .default_dtype()
        .shape(shape)
        .order(order)
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    w.extend(v.iter().copied()).unwrap();
    w.finish().unwrap();
    fs::write(path, buf).unwrap();
}

fn write_npy_f16(path: &Path, v: &[f16], shape: &[u64]) {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::<f16>::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    w.extend(v.iter().copied()).unwrap();
    w.finish().unwrap();
    fs::write(path, buf).unwrap();
}

/// A safetensors file read back: its tensors (dtype, shape, bytes) and metadata.
struct StFile {
    tensors: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>,
    metadata: HashMap<String, String>,
}

fn read_safetensors(path: &Path) -> StFile {
    let bytes = fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    StFile {
        tensors: st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
            .collect(),
        metadata: meta.metadata().clone().unwrap_or_default(),
    }
}

/// The f32 values stored in a safetensors entry of a high-precision dtype.
fn entry_values(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
        other => panic!("not a float dtype: {other}"),
    }
}

/// Asserts `|x − y| ≤ rel·|x|` element by element, where `rel` is the format's relative
/// rounding bound plus that of writing the result in `out`.
#[track_caller]
fn assert_within(x: &[f32], y: &[f32], rel: f64, out: DType, what: &str) {
    let out_rel = match out {
        DType::F32 => 0.0,
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => unreachable!(),
    };
    let bound = rel + out_rel * (1.0 + rel);
    assert_eq!(x.len(), y.len(), "{what}");
    for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
        let err = (f64::from(a) - f64::from(b)).abs();
        assert!(
            err <= bound * f64::from(a).abs() * (1.0 + 1e-6),
            "{what}: element {i}: {a} dequantized to {b} (relative bound {bound})"
        );
    }
}

// ---------------------------------------------------------------------------------------
// the formats under test

/// One command line and the quantizer the library would use for it.
struct Case {
    args: &'static [&'static str],
    quantizer: fn() -> Box<dyn Quantizer>,
    /// Relative error bound of the format for values in its normal range.
    rel: f64,
    /// Metadata entries the output must have (besides per-tensor ones).
    metadata: &'static [(&'static str, &'static str)],
}

fn cases() -> Vec<Case> {
    use Fp8Format::{E4M3, E5M2};
    vec![
        Case {
            args: &["--format", "fp8-current"],
            quantizer: || Box::new(Fp8CurrentScaling::new(E4M3)),
            rel: 1.0 / 16.0,
            metadata: &[
                ("format", "fp8-current"),
                ("fp8", "e4m3"),
                ("scales", "fp32"),
                ("eps", "0"),
                ("usage", "both"),
            ],
        },
        Case {
            args: &[
                "--format",
                "fp8-current",
                "--fp8",
                "e5m2",
                "--scales",
                "pow2",
                "--usage",
                "rowwise",
            ],
            quantizer: || {
                Box::new(
                    Fp8CurrentScaling::new(E5M2)
                        .with_pow2_scales(true)
                        .with_usage(Usage::Rowwise),
                )
            },
            rel: 1.0 / 8.0,
            metadata: &[("fp8", "e5m2"), ("scales", "pow2"), ("usage", "rowwise")],
        },
        Case {
            args: &["--format", "fp8-delayed", "--scale", "0.5"],
            quantizer: || {
                Box::new(
                    Fp8DelayedScaling::new(E4M3, 1)
                        .unwrap()
                        .with_scale(0.5)
                        .unwrap(),
                )
            },
            rel: 1.0 / 16.0,
            metadata: &[("format", "fp8-delayed"), ("scale", "0.5"), ("fp8", "e4m3")],
        },
        Case {
            args: &["--format", "mxfp8"],
            quantizer: || Box::new(Mxfp8Quantizer::new(E4M3)),
            rel: 1.0 / 16.0,
            metadata: &[
                ("format", "mxfp8"),
                ("2d", "false"),
                ("swizzled", "false"),
                ("fp8", "e4m3"),
            ],
        },
        Case {
            args: &[
                "--format",
                "mxfp8",
                "--2d",
                "--swizzled",
                "--usage",
                "columnwise",
                "--fp8",
                "e5m2",
            ],
            quantizer: || {
                Box::new(
                    Mxfp8Quantizer::new(E5M2)
                        .with_2d(true)
                        .with_swizzled_scales(true)
                        .with_usage(Usage::Columnwise),
                )
            },
            rel: 1.0 / 8.0,
            metadata: &[
                ("2d", "true"),
                ("swizzled", "true"),
                ("usage", "columnwise"),
            ],
        },
        Case {
            args: &["--format", "nvfp4"],
            quantizer: || Box::new(Nvfp4Quantizer::new()),
            rel: 1.0 / 4.0,
            metadata: &[
                ("format", "nvfp4"),
                ("rht", "false"),
                ("stochastic_rounding", "false"),
            ],
        },
        Case {
            args: &[
                "--format",
                "nvfp4",
                "--2d",
                "--rht",
                "--swizzled",
                "--stochastic-rounding",
                "--seed",
                "7",
            ],
            quantizer: || {
                Box::new(
                    Nvfp4Quantizer::new()
                        .with_2d(true)
                        .with_rht(true)
                        .with_swizzled_scales(true)
                        .with_stochastic_rounding(Some(tessera_rng::Generator::new(7))),
                )
            },
            // Stochastic rounding picks either neighbour: up to a whole step.
            rel: 1.0 / 2.0,
            metadata: &[
                ("2d", "true"),
                ("rht", "true"),
                ("swizzled", "true"),
                ("stochastic_rounding", "true"),
                ("seed", "7"),
            ],
        },
        Case {
            args: &["--format", "fp8-block"],
            quantizer: || Box::new(Fp8BlockQuantizer::new(E4M3, BlockDim::OneD)),
            rel: 1.0 / 16.0,
            metadata: &[
                ("format", "fp8-block"),
                ("block_dim", "1"),
                ("scales", "pow2"),
            ],
        },
        Case {
            args: &[
                "--format",
                "fp8-block",
                "--block-dim",
                "2",
                "--scales",
                "fp32",
                "--eps",
                "0.000001",
            ],
            quantizer: || {
                Box::new(
                    Fp8BlockQuantizer::new(E4M3, BlockDim::TwoD)
                        .with_pow2_scales(false)
                        .with_amax_epsilon(1e-6),
                )
            },
            rel: 1.0 / 16.0,
            metadata: &[("block_dim", "2"), ("scales", "fp32"), ("eps", "0.000001")],
        },
    ]
}

/// Checks a quantized file against the library's tensors: exactly the buffers the
/// library produced, with their dtypes, shapes and bytes, and the per-tensor metadata.
#[track_caller]
fn assert_matches_library(file: &StFile, expected: &BTreeMap<String, QuantizedTensor>) {
    let mut want_entries = Vec::new();
    for (name, qt) in expected {
        for (b, t) in qt.data_tensors() {
            let key = format!("{name}.{}", b.name());
            let (dtype, shape, bytes) = file
                .tensors
                .get(&key)
                .unwrap_or_else(|| panic!("entry `{key}` missing"));
            assert_eq!(*dtype, st_dtype(t.dtype()), "{key}");
            assert_eq!(shape, t.shape().dims(), "{key}");
            assert!(bytes == t.as_bytes().unwrap(), "{key}: bytes differ");
            want_entries.push(key);
        }
        assert_eq!(
            file.metadata[&format!("{name}.shape")],
            qt.shape().to_string()
        );
        assert_eq!(
            file.metadata[&format!("{name}.dtype")],
            qt.source_dtype().name()
        );
    }
    want_entries.sort();
    assert_eq!(
        file.tensors.keys().cloned().collect::<Vec<_>>(),
        want_entries,
        "the file holds other entries"
    );
}

// ---------------------------------------------------------------------------------------
// round trips

#[test]
fn safetensors_round_trip_every_format() {
    let dir = TestDir::new("st-round-trip");
    let input = dir.path("model.safetensors");
    // Name order: "layer.proj" (f32, 3-D) before "layer.weight" (bf16).
    let proj = tensor(&values(2 * 16 * 32, 1), &[2, 16, 32], DType::F32);
    let weight = tensor(&values(64 * 96, 2), &[64, 96], DType::BF16);
    write_safetensors(&input, &[("layer.weight", &weight), ("layer.proj", &proj)]);
    let sources = BTreeMap::from([
        ("layer.proj".to_owned(), proj.clone()),
        ("layer.weight".to_owned(), weight.clone()),
    ]);

    for (i, case) in cases().iter().enumerate() {
        let q = dir.path(&format!("q{i}.safetensors"));
        let mut args: Vec<std::ffi::OsString> = vec!["quantize".into()];
        args.extend(case.args.iter().map(Into::into));
        args.extend([input.clone().into(), q.clone().into()]);
        let out = run_tessera(&args);
        assert_ok(&out);
        assert!(out.stdout.is_empty() && out.stderr.is_empty());

        // The library on the same tensors, in name order, with one quantizer.
        let mut quantizer = (case.quantizer)();
        let expected: BTreeMap<String, QuantizedTensor> = sources
            .iter()
            .map(|(n, t)| (n.clone(), quantizer.quantize(t).unwrap()))
            .collect();
        let file = read_safetensors(&q);
        assert_matches_library(&file, &expected);
        for (k, v) in case.metadata {
            assert_eq!(
                file.metadata.get(*k).map(String::as_str),
                Some(*v),
                "{:?}: metadata `{k}`",
                case.args
            );
        }
        assert!(file.metadata["producer"].starts_with("tessera "));
        // Exactly the options the format has, plus the per-tensor entries.
        let mut keys: Vec<&str> = file
            .metadata
            .keys()
            .map(String::as_str)
            .filter(|k| !k.starts_with("layer."))
            .collect();
        keys.sort_unstable();
        let mut want: Vec<&str> = match case.args[1] {
            "fp8-current" => vec!["eps", "fp8", "scales"],
            "fp8-delayed" => vec!["fp8", "scale"],
            "mxfp8" => vec!["2d", "fp8", "swizzled"],
            "nvfp4" => vec!["2d", "rht", "stochastic_rounding", "swizzled"],
            "fp8-block" => vec!["block_dim", "eps", "fp8", "scales"],
            other => panic!("{other}"),
        };
        if case.args.contains(&"--seed") {
            want.push("seed");
        }
        want.extend(["format", "producer", "usage"]);
        want.sort_unstable();
        assert_eq!(keys, want, "{:?}", case.args);
        assert_eq!(
            file.metadata.len(),
            want.len() + 4,
            "two entries per tensor"
        );

        // Dequantize: source dtypes and shapes, the library's values, within the bound.
        let d = dir.path(&format!("d{i}.safetensors"));
        assert_ok(&tessera!("dequantize", q, d));
        let deq = read_safetensors(&d);
        assert_eq!(deq.tensors.len(), 2);
        for (name, src) in &sources {
            let (dtype, shape, bytes) = &deq.tensors[name];
            assert_eq!(*dtype, st_dtype(src.dtype()), "{name}");
            assert_eq!(shape, src.shape().dims(), "{name}");
            let lib = expected[name].dequantize(src.dtype()).unwrap();
            assert!(bytes == lib.as_bytes().unwrap(), "{name}: values differ");
            assert_within(
                &src.to_f32_vec().unwrap(),
                &entry_values(*dtype, bytes),
                case.rel,
                src.dtype(),
                &format!("{:?} {name}", case.args),
            );
        }

        // Two tensors do not fit in a .npy file.
        let npy = dir.path(&format!("d{i}.npy"));
        let out = tessera!("dequantize", q, npy);
        assert_fails(&out, 1, &["a .npy file holds one tensor", "has 2"]);
        assert!(!npy.exists());
    }
}

#[test]
fn npy_round_trip_every_format() {
    let dir = TestDir::new("npy-round-trip");
    let input = dir.path("act.npy");
    let v = values(32 * 64, 3);
    write_npy_f32(&input, &v, &[32, 64], npyz::Order::C);
    let x = tensor(&v, &[32, 64], DType::F32);

    for (i, case) in cases().iter().enumerate() {
        let q = dir.path(&format!("q{i}.safetensors"));
        let mut args: Vec<std::ffi::OsString> = vec!["quantize".into()];
        args.extend(case.args.iter().map(Into::into));
        args.extend([input.clone().into(), q.clone().into()]);
        assert_ok(&run_tessera(&args));

        let expected =
            BTreeMap::from([("act".to_owned(), (case.quantizer)().quantize(&x).unwrap())]);
        let file = read_safetensors(&q);
        assert_matches_library(&file, &expected);
        assert_eq!(file.metadata["act.shape"], "[32, 64]");
        assert_eq!(file.metadata["act.dtype"], "f32");

        let d = dir.path(&format!("d{i}.npy"));
        assert_ok(&tessera!("dequantize", q, d));
        let npy = npyz::NpyFile::new(std::io::Cursor::new(fs::read(&d).unwrap())).unwrap();
        assert_eq!(npy.shape(), &[32, 64]);
        let y: Vec<f32> = npy.into_vec().unwrap();
        let lib = expected["act"].dequantize(DType::F32).unwrap();
        assert_eq!(y, lib.to_vec::<f32>().unwrap(), "{:?}", case.args);
        assert_within(&v, &y, case.rel, DType::F32, &format!("{:?}", case.args));
    }
}

#[test]
fn npy_f16_and_fortran_order() {
    let dir = TestDir::new("npy-f16-fortran");
    let v = values(32 * 32, 4);

    // f16 in, f16 out.
    let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
    let input = dir.path("half.npy");
    write_npy_f16(&input, &h, &[32, 32]);
    let q = dir.path("half.safetensors");
    assert_ok(&tessera!("quantize", "--format", "mxfp8", input, q));
    let x = Tensor::from_slice(&h, [32, 32], Device::Cpu).unwrap();
    let qt = Mxfp8Quantizer::new(Fp8Format::E4M3).quantize(&x).unwrap();
    assert_matches_library(
        &read_safetensors(&q),
        &BTreeMap::from([("half".to_owned(), qt.clone())]),
    );
    let d = dir.path("half-out.npy");
    assert_ok(&tessera!("dequantize", q, d));
    let npy = npyz::NpyFile::new(std::io::Cursor::new(fs::read(&d).unwrap())).unwrap();
    assert_eq!(npy.dtype().descr(), "'<f2'");
    let y: Vec<f16> = npy.into_vec().unwrap();
    assert_eq!(
        y,
        qt.dequantize(DType::F16).unwrap().to_vec::<f16>().unwrap()
    );

    // A Fortran-order array is read in logical (row-major) order.
    let input = dir.path("fortran.npy");
    let (m, k) = (32usize, 64usize);
    let row_major = values(m * k, 8);
    let mut col_major = vec![0f32; m * k];
    for i in 0..m {
        for j in 0..k {
            col_major[j * m + i] = row_major[i * k + j];
        }
    }
    write_npy_f32(
        &input,
        &col_major,
        &[m as u64, k as u64],
        npyz::Order::Fortran,
    );
    let q = dir.path("fortran.safetensors");
    assert_ok(&tessera!("quantize", "--format", "fp8-current", input, q));
    let x = Tensor::from_slice(&row_major, [m, k], Device::Cpu).unwrap();
    let qt = Fp8CurrentScaling::new(Fp8Format::E4M3)
        .quantize(&x)
        .unwrap();
    assert_matches_library(
        &read_safetensors(&q),
        &BTreeMap::from([("fortran".to_owned(), qt)]),
    );
}

#[test]
fn bf16_to_npy_is_widened_to_f32() {
    let dir = TestDir::new("bf16-npy");
    let input = dir.path("w.safetensors");
    let w = tensor(&values(32 * 32, 5), &[32, 32], DType::BF16);
    write_safetensors(&input, &[("w", &w)]);
    let q = dir.path("q.safetensors");
    let d = dir.path("w.npy");
    assert_ok(&tessera!("quantize", "--format", "nvfp4", input, q));
    assert_ok(&tessera!("dequantize", q, d));
    let npy = npyz::NpyFile::new(std::io::Cursor::new(fs::read(&d).unwrap())).unwrap();
    assert_eq!(npy.dtype().descr(), "'<f4'");
    let y: Vec<f32> = npy.into_vec().unwrap();
    let qt = Nvfp4Quantizer::new().quantize(&w).unwrap();
    let lib: Vec<f32> = qt.dequantize(DType::BF16).unwrap().to_f32_vec().unwrap();
    assert_eq!(y, lib, "the bf16 values, widened exactly");
}

#[test]
fn nvfp4_data_is_stored_as_u8_pairs() {
    let dir = TestDir::new("nvfp4-u8");
    let input = dir.path("x.npy");
    write_npy_f32(&input, &values(32 * 64, 6), &[32, 64], npyz::Order::C);
    let q = dir.path("q.safetensors");
    assert_ok(&tessera!("quantize", "--format", "nvfp4", input, q));
    let f = read_safetensors(&q);
    let dt = |k: &str| (f.tensors[k].0, f.tensors[k].1.clone());
    assert_eq!(dt("x.data"), (Dtype::U8, vec![32, 32]));
    assert_eq!(dt("x.columnwise_data"), (Dtype::U8, vec![64, 16]));
    assert_eq!(dt("x.scale_inv").0, Dtype::F8_E4M3);
    assert_eq!(dt("x.amax"), (Dtype::F32, vec![1]));
    assert_eq!(dt("x.columnwise_amax"), (Dtype::F32, vec![1]));
    assert!(!f.metadata.contains_key("fp8"));

    // MXFP8 scales are E8M0.
    let q = dir.path("mx.safetensors");
    assert_ok(&tessera!(
        "quantize",
        "--format",
        "mxfp8",
        "--usage",
        "rowwise",
        dir.path("x.npy"),
        q,
    ));
    let f = read_safetensors(&q);
    assert_eq!(f.tensors["x.scale_inv"].0, Dtype::F8_E8M0);
    assert_eq!(f.tensors["x.data"].0, Dtype::F8_E4M3);
    assert_eq!(
        f.tensors.keys().collect::<Vec<_>>(),
        ["x.data", "x.scale_inv"]
    );
}

// ---------------------------------------------------------------------------------------
// errors

#[test]
fn missing_input_file() {
    let dir = TestDir::new("missing");
    let out_path = dir.path("out.safetensors");
    let o = tessera!(
        "quantize",
        "--format",
        "mxfp8",
        dir.path("nope.safetensors"),
        out_path,
    );
    assert_fails(&o, 1, &["cannot read", "nope.safetensors", "No such file"]);
    assert!(dir.files().is_empty());

    let o = tessera!(
        "dequantize",
        dir.path("nope.safetensors"),
        dir.path("out.npy"),
    );
    assert_fails(&o, 1, &["cannot read", "nope.safetensors"]);
    let o = tessera!("report", "--format", "nvfp4", dir.path("nope.safetensors"));
    assert_fails(&o, 1, &["cannot read"]);
    assert!(dir.files().is_empty());
}

#[test]
fn corrupt_safetensors_header() {
    let dir = TestDir::new("corrupt");
    // A header length far beyond the file.
    let bad_len = dir.path("bad-len.safetensors");
    let mut b = 1000u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    fs::write(&bad_len, b).unwrap();
    // A header that is not JSON.
    let bad_json = dir.path("bad-json.safetensors");
    let mut b = 8u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{not js}");
    fs::write(&bad_json, b).unwrap();
    // Too short to have a header at all.
    let short = dir.path("short.safetensors");
    fs::write(&short, b"abc").unwrap();

    for (input, why) in [
        (&bad_len, "invalid header length"),
        (&bad_json, "invalid JSON in header"),
        (&short, "header too small"),
    ] {
        let out = dir.path("out.safetensors");
        let o = tessera!("quantize", "--format", "fp8-current", input, out);
        assert_fails(&o, 1, &["is not a readable .safetensors file", why]);
        assert!(!out.exists());
        let o = tessera!("dequantize", input, out);
        assert_fails(&o, 1, &["is not a readable .safetensors file", why]);
        assert!(!out.exists());
    }

    // A corrupt .npy header.
    let npy = dir.path("bad.npy");
    fs::write(&npy, b"\x93NUMPY\x01\x00garbage").unwrap();
    let out = dir.path("out.safetensors");
    let o = tessera!("quantize", "--format", "fp8-current", npy, out);
    assert_fails(&o, 1, &["`", "bad.npy` is not a readable .npy file"]);
    assert!(!out.exists());
}

#[test]
fn unsupported_input_dtype() {
    let dir = TestDir::new("dtype");
    let input = dir.path("ints.safetensors");
    let w = tensor(&values(32 * 32, 1), &[32, 32], DType::F32);
    let ints: Vec<u8> = (0..32 * 32i32).flat_map(|i| i.to_le_bytes()).collect();
    write_raw_safetensors(
        &input,
        &[
            (
                "a",
                Dtype::F32,
                vec![32, 32],
                w.as_bytes().unwrap().to_vec(),
            ),
            ("ids", Dtype::I32, vec![32, 32], ints),
        ],
    );
    let out = dir.path("out.safetensors");
    let o = tessera!("quantize", "--format", "mxfp8", input, out);
    assert_fails(
        &o,
        1,
        &[
            "tensor `ids`",
            "dtype I32 is not supported",
            "F32, BF16 or F16",
        ],
    );
    assert_eq!(dir.files(), ["ints.safetensors"]);

    // An f64 .npy.
    let npy = dir.path("f64.npy");
    let mut buf = Vec::new();
    let mut wr = npyz::WriteOptions::<f64>::new()
        .default_dtype()
        .shape(&[2, 2])
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    wr.extend([1.0, 2.0, 3.0, 4.0]).unwrap();
    wr.finish().unwrap();
    fs::write(&npy, buf).unwrap();
    let o = tessera!("quantize", "--format", "fp8-current", npy, out);
    assert_fails(&o, 1, &["tensor `f64`", "dtype <f8 is not supported"]);
    assert!(!out.exists());
    // report lists it as skipped, with its size.
    let o = tessera!("report", "--format", "fp8-current", npy);
    assert_ok(&o);
    let out = stdout(&o);
    let row = out.lines().nth(2).unwrap();
    assert_eq!(
        row.split_whitespace().take(8).collect::<Vec<_>>(),
        ["f64", "[2,", "2]", "<f8", "32", "-", "-", "-"]
    );
    assert!(
        row.ends_with(
            "skipped: dtype <f8 is not supported; tessera quantizes f32 or f16 .npy arrays"
        ),
        "{row}"
    );
}

#[test]
fn shape_the_format_cannot_hold() {
    let dir = TestDir::new("shape");
    let input = dir.path("odd.safetensors");
    let good = tensor(&values(32 * 32, 1), &[32, 32], DType::F32);
    let odd = tensor(&values(15, 2), &[3, 5], DType::F32);
    write_safetensors(&input, &[("good", &good), ("odd", &odd)]);
    let out = dir.path("out.safetensors");
    // An output that exists already is left as it was.
    fs::write(&out, b"old").unwrap();
    let o = tessera!("quantize", "--format", "mxfp8", input, out);
    assert_fails(
        &o,
        1,
        &[
            "tensor `odd` of shape [3, 5] cannot be quantized as mxfp8",
            "multiples of 32",
        ],
    );
    assert_eq!(fs::read(&out).unwrap(), b"old");
    assert_eq!(dir.files(), ["odd.safetensors", "out.safetensors"]);

    // NVFP4 needs multiples of 16; fp8-block takes any shape.
    let o = tessera!("quantize", "--format", "nvfp4", input, out);
    assert_fails(&o, 1, &["multiples of 16"]);
    assert_ok(&tessera!("quantize", "--format", "fp8-block", input, out));
    assert_eq!(read_safetensors(&out).metadata["odd.shape"], "[3, 5]");
}

#[test]
fn options_that_do_not_apply() {
    let dir = TestDir::new("options");
    let input = dir.path("x.npy");
    write_npy_f32(&input, &values(32 * 32, 1), &[32, 32], npyz::Order::C);
    let out = dir.path("out.safetensors");
    for (args, needles) in [
        (
            &["--format", "mxfp8", "--rht"][..],
            &[
                "--rht does not apply to --format mxfp8",
                "it applies to nvfp4",
            ][..],
        ),
        (
            &["--format", "nvfp4", "--fp8", "e5m2"],
            &["--fp8 does not apply to --format nvfp4"],
        ),
        (
            &["--format", "fp8-current", "--block-dim", "2"],
            &[
                "--block-dim does not apply to --format fp8-current",
                "fp8-block",
            ],
        ),
        (
            &["--format", "fp8-block", "--2d"],
            &[
                "--2d does not apply to --format fp8-block",
                "mxfp8 or nvfp4",
            ],
        ),
        (
            &["--format", "mxfp8", "--scale", "2"],
            &["--scale does not apply to --format mxfp8", "fp8-delayed"],
        ),
        (
            &["--format", "fp8-delayed", "--scales", "pow2"],
            &["--scales does not apply", "fp8-current or fp8-block"],
        ),
        (
            &["--format", "mxfp8", "--stochastic-rounding", "--seed", "1"],
            &["--stochastic-rounding does not apply to --format mxfp8"],
        ),
        (
            &["--format", "fp8-delayed", "--scale", "0"],
            &["--scale must be finite and positive"],
        ),
        (
            &["--format", "fp8-block", "--eps", "-1"],
            &["--eps must be finite and not negative"],
        ),
    ] {
        let mut a: Vec<std::ffi::OsString> = vec!["quantize".into()];
        a.extend(args.iter().map(Into::into));
        a.extend([input.clone().into(), out.clone().into()]);
        assert_fails(&run_tessera(&a), 2, needles);
        assert!(!out.exists());
        // report takes the same options.
        let mut a: Vec<std::ffi::OsString> = vec!["report".into()];
        a.extend(args.iter().map(Into::into));
        a.push(input.clone().into());
        assert_fails(&run_tessera(&a), 2, needles);
    }

    // clap's own usage errors keep its exit code 2.
    let o = tessera!(
        "quantize",
        "--format",
        "nvfp4",
        "--stochastic-rounding",
        input,
        out,
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--seed"), "{}", stderr(&o));
    let o = tessera!(
        "quantize",
        "--format",
        "fp8-block",
        "--block-dim",
        "3",
        input,
        out,
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(!out.exists());
    assert_eq!(dir.files(), ["x.npy"]);
}

#[test]
fn output_must_be_safetensors() {
    let dir = TestDir::new("out-ext");
    let input = dir.path("x.npy");
    write_npy_f32(&input, &values(32 * 32, 1), &[32, 32], npyz::Order::C);
    let out = dir.path("out.npy");
    let o = tessera!("quantize", "--format", "mxfp8", input, out);
    assert_fails(&o, 1, &["the output must be a .safetensors file"]);
    assert!(!out.exists());
    // A directory that does not exist.
    let o = tessera!(
        "quantize",
        "--format",
        "mxfp8",
        input,
        dir.path("no/such/dir/out.safetensors"),
    );
    assert_fails(&o, 1, &["cannot create a temporary file"]);
    assert_eq!(dir.files(), ["x.npy"]);
}

#[test]
fn dequantize_rejects_files_it_cannot_rebuild() {
    let dir = TestDir::new("deq-errors");
    let out = dir.path("out.safetensors");

    // A plain model, not written by `tessera quantize`.
    let plain = dir.path("plain.safetensors");
    let w = tensor(&values(32 * 32, 1), &[32, 32], DType::F32);
    write_safetensors(&plain, &[("w", &w)]);
    let o = tessera!("dequantize", plain, out);
    assert_fails(&o, 1, &["plain.safetensors", "no `format` entry"]);

    // A quantized file whose buffer was replaced by one of the wrong shape.
    let input = dir.path("x.npy");
    write_npy_f32(&input, &values(32 * 64, 1), &[32, 64], npyz::Order::C);
    let q = dir.path("q.safetensors");
    assert_ok(&tessera!("quantize", "--format", "mxfp8", input, q));
    let file = read_safetensors(&q);
    // Rewrites the file with entry `key` given another dtype or shape (same bytes).
    let rewrite = |path: &Path, key: &str, dtype: Option<Dtype>, shape: Option<Vec<usize>>| {
        let views: Vec<(&str, TensorView<'_>)> = file
            .tensors
            .iter()
            .map(|(n, (d, s, b))| {
                let (d, s) = if n == key {
                    (dtype.unwrap_or(*d), shape.clone().unwrap_or(s.clone()))
                } else {
                    (*d, s.clone())
                };
                (n.as_str(), TensorView::new(d, s, b).unwrap())
            })
            .collect();
        fs::write(
            path,
            safetensors::serialize(views, Some(file.metadata.clone())).unwrap(),
        )
        .unwrap();
    };
    let bad_shape = dir.path("bad-shape.safetensors");
    rewrite(&bad_shape, "x.data", None, Some(vec![64, 32]));
    let o = tessera!("dequantize", bad_shape, out);
    assert_fails(
        &o,
        1,
        &["tensor `x`", "buffer `data`", "[32, 64]", "[64, 32]"],
    );

    let bad_dtype = dir.path("bad-dtype.safetensors");
    rewrite(&bad_dtype, "x.scale_inv", Some(Dtype::U8), None);
    let o = tessera!("dequantize", bad_dtype, out);
    assert_fails(&o, 1, &["entry `x.scale_inv` is U8", "as F8_E8M0"]);

    // A missing buffer: the usage says both, the file has rowwise only.
    let partial = dir.path("partial.safetensors");
    let mut meta = file.metadata.clone();
    meta.insert("usage".into(), "both".into());
    let entries: Vec<(&str, TensorView<'_>)> = file
        .tensors
        .iter()
        .filter(|(n, _)| !n.starts_with("x.columnwise"))
        .map(|(n, (d, s, b))| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    fs::write(
        &partial,
        safetensors::serialize(entries, Some(meta)).unwrap(),
    )
    .unwrap();
    let o = tessera!("dequantize", partial, out);
    assert_fails(&o, 1, &["tensor `x` has rowwise buffers", "usage both"]);
    assert!(!out.exists());
}

// ---------------------------------------------------------------------------------------
// report

#[test]
fn report_lists_tensors_skips_and_a_summary() {
    let dir = TestDir::new("report");
    let input = dir.path("model.safetensors");
    let w = tensor(&values(64 * 96, 1), &[64, 96], DType::BF16);
    let odd = tensor(&values(15, 2), &[3, 5], DType::F32);
    let ints: Vec<u8> = (0..4i32).flat_map(|i| i.to_le_bytes()).collect();
    write_raw_safetensors(
        &input,
        &[
            (
                "a.weight",
                Dtype::BF16,
                vec![64, 96],
                w.as_bytes().unwrap().to_vec(),
            ),
            (
                "b.odd",
                Dtype::F32,
                vec![3, 5],
                odd.as_bytes().unwrap().to_vec(),
            ),
            ("c.ids", Dtype::I32, vec![4], ints),
        ],
    );
    let o = tessera!("report", "--format", "mxfp8", input);
    assert_ok(&o);
    assert!(o.stderr.is_empty(), "no progress bar off a terminal");
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "{out}");
    assert!(
        lines[0].starts_with("tessera report of `")
            && lines[0].ends_with(
                "model.safetensors` as mxfp8 (usage both, fp8 e4m3, 2d false, swizzled false)"
            ),
        "{}",
        lines[0]
    );
    let header: Vec<&str> = lines[1]
        .split("  ")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(
        header,
        [
            "tensor",
            "shape",
            "dtype",
            "bytes",
            "quantized",
            "max abs err",
            "SNR (dB)"
        ]
    );

    // The library's numbers for `a.weight`.
    let qt = Mxfp8Quantizer::new(Fp8Format::E4M3).quantize(&w).unwrap();
    let x = w.to_f32_vec().unwrap();
    let (mut max_abs, mut snr) = (0f64, f64::INFINITY);
    for u in [Usage::Rowwise, Usage::Columnwise] {
        let y = qt
            .dequantize_usage(u, DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (mut s, mut n) = (0f64, 0f64);
        for (&a, &b) in x.iter().zip(&y) {
            let d = f64::from(a) - f64::from(b);
            s += f64::from(a).powi(2);
            n += d * d;
            max_abs = max_abs.max(d.abs());
        }
        snr = snr.min(10.0 * (s / n).log10());
    }
    let row: Vec<&str> = lines[2].split_whitespace().collect();
    let after = qt.size_in_bytes();
    assert_eq!(
        row,
        [
            "a.weight",
            "[64,",
            "96]",
            "bf16",
            "12288",
            &after.to_string(),
            &format!("{max_abs:.3e}"),
            &format!("{snr:.2}"),
        ]
    );
    assert!(snr > 25.0, "{snr}");

    assert!(lines[3].starts_with("b.odd"), "{}", lines[3]);
    assert!(
        lines[3].contains("[3, 5]")
            && lines[3]
                .contains("skipped: MXFP8 needs both flattened dimensions to be multiples of 32"),
        "{}",
        lines[3]
    );
    assert!(lines[4].starts_with("c.ids"), "{}", lines[4]);
    assert!(
        lines[4].contains(" I32 ") && lines[4].contains("skipped: dtype I32 is not supported"),
        "{}",
        lines[4]
    );
    assert_eq!(
        lines[5],
        format!(
            "total: 1 tensor quantized, 2 skipped; 12288 -> {after} bytes (ratio {:.2}:1); worst SNR {snr:.2} dB (`a.weight`)",
            12288.0 / after as f64
        )
    );
    // The columns line up: every row starts its shape where the header does.
    let col = lines[1].find("shape").unwrap();
    for l in &lines[2..5] {
        assert_eq!(l.find('['), Some(col), "{l}");
    }
}

#[test]
fn report_exact_tensor_has_infinite_snr() {
    let dir = TestDir::new("report-exact");
    let input = dir.path("exact.npy");
    // Current scaling maps the amax 448 to 448: scale 1, and all values are E4M3 codes.
    write_npy_f32(&input, &[448.0, -1.0, 0.5, 2.0], &[1, 4], npyz::Order::C);
    let o = tessera!("report", "--format", "fp8-current", input);
    assert_ok(&o);
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    // 16 bytes of f32 -> 4 + 4 bytes of FP8 and one f32 scale.
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        ["exact", "[1,", "4]", "f32", "16", "12", "0.000e0", "+inf"]
    );
    assert_eq!(
        lines[3],
        "total: 1 tensor quantized, 0 skipped; 16 -> 12 bytes (ratio 1.33:1); worst SNR +inf dB (`exact`)"
    );
}

#[test]
fn report_with_nothing_to_quantize() {
    let dir = TestDir::new("report-none");
    let input = dir.path("odd.npy");
    write_npy_f32(&input, &[1.0; 15], &[3, 5], npyz::Order::C);
    let o = tessera!("report", "--format", "nvfp4", "--rht", input);
    assert_ok(&o);
    let out = stdout(&o);
    assert!(out.contains("skipped: NVFP4 needs both flattened dimensions to be multiples of 16"));
    assert_eq!(
        out.lines().last(),
        Some("total: 0 tensors quantized, 1 skipped")
    );
}

#[test]
fn dequantize_a_file_assembled_by_hand() {
    // A file assembled directly from library buffers (not by `tessera quantize`) with the
    // documented metadata keys dequantizes too: the format is the documented one.
    let dir = TestDir::new("by-hand");
    let x = tensor(&values(16 * 32, 9), &[16, 32], DType::F16);
    let qt = Nvfp4Quantizer::new()
        .with_usage(Usage::Rowwise)
        .quantize(&x)
        .unwrap();
    let mut entries = Vec::new();
    for (b, t) in qt.data_tensors() {
        entries.push((
            format!("t.{}", b.name()),
            st_dtype(t.dtype()),
            t.shape().dims().to_vec(),
            t.as_bytes().unwrap().to_vec(),
        ));
    }
    let meta: HashMap<String, String> = [
        ("format", "nvfp4"),
        ("usage", "rowwise"),
        ("2d", "false"),
        ("swizzled", "false"),
        ("rht", "false"),
        ("stochastic_rounding", "false"),
        ("t.shape", "[16, 32]"),
        ("t.dtype", "f16"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let views: Vec<(&str, TensorView<'_>)> = entries
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let q = dir.path("q.safetensors");
    fs::write(&q, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
    let d = dir.path("d.safetensors");
    assert_ok(&tessera!("dequantize", q, d));
    let f = read_safetensors(&d);
    let (dtype, shape, bytes) = &f.tensors["t"];
    assert_eq!((*dtype, shape.clone()), (Dtype::F16, vec![16, 32]));
    assert!(bytes == qt.dequantize(DType::F16).unwrap().as_bytes().unwrap());
}

// ---------------------------------------------------------------------------------------
// tessera gather

#[test]
fn gather_equals_quantizing_the_whole_file() {
    let dir = TestDir::new("gather");
    let input = dir.path("model.safetensors");
    let w = tensor(&values(256 * 128, 7), &[256, 128], DType::BF16);
    let b = tensor(&values(64 * 32, 8), &[4, 16, 32], DType::F32);
    write_safetensors(&input, &[("w", &w), ("b", &b)]);
    for (world, format) in [
        (4, "mxfp8"),
        (2, "fp8-current"),
        (2, "nvfp4"),
        (2, "fp8-block"),
        (1, "mxfp8"),
    ] {
        let gathered = dir.path(&format!("g-{world}-{format}.safetensors"));
        let whole = dir.path(&format!("q-{format}.safetensors"));
        let o = run_tessera([
            "gather",
            "--world",
            &world.to_string(),
            "--format",
            format,
            input.to_str().unwrap(),
            gathered.to_str().unwrap(),
        ]);
        assert_ok(&o);
        assert!(stdout(&o).contains("sent per rank"), "{}", stdout(&o));
        assert_ok(&run_tessera([
            "quantize",
            "--format",
            format,
            input.to_str().unwrap(),
            whole.to_str().unwrap(),
        ]));
        let (g, q) = (read_safetensors(&gathered), read_safetensors(&whole));
        assert_eq!(
            g.tensors, q.tensors,
            "world {world} {format}: gathered bytes differ from quantizing the whole file"
        );
        assert_eq!(
            g.metadata.get("gathered_from_ranks").map(String::as_str),
            Some(world.to_string().as_str())
        );
    }
    // MXFP8 shards of 32 / 8 = 4 rows cannot travel quantized: high precision, same bytes.
    let small = dir.path("small.safetensors");
    write_safetensors(
        &small,
        &[("x", &tensor(&values(32 * 64, 3), &[32, 64], DType::F32))],
    );
    let g = dir.path("g8.safetensors");
    let o = run_tessera([
        "gather",
        "--world",
        "8",
        "--format",
        "mxfp8",
        small.to_str().unwrap(),
        g.to_str().unwrap(),
    ]);
    assert_ok(&o);
    assert!(stdout(&o).contains("high prec."), "{}", stdout(&o));
}

#[test]
fn gather_errors() {
    let dir = TestDir::new("gather-errors");
    let input = dir.path("m.safetensors");
    write_safetensors(
        &input,
        &[("x", &tensor(&values(6 * 32, 1), &[6, 32], DType::F32))],
    );
    let out = dir.path("o.safetensors");
    let o = run_tessera([
        "gather",
        "--world",
        "4",
        "--format",
        "fp8-current",
        input.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert_fails(&o, 1, &["first dimension 6 is not divisible by --world 4"]);
    let o = run_tessera([
        "gather",
        "--world",
        "2",
        "--backend",
        "nccl",
        "--format",
        "fp8-current",
        input.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert_fails(&o, 1, &["--backend nccl"]);
    assert!(!out.exists(), "a failed gather must not write its output");
}
