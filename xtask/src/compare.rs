//! `bench-compare`: the JSON of two builds' `bench-gpu` runs side by side.
//!
//! A kernel change is judged by running the benchmark of both builds in one device call,
//! alternated, and comparing row by row; this prints that comparison as the Markdown
//! table BENCHMARKS.md uses. Rows are matched by shape and kernel name; each side shows
//! every run's ratio to copy (and to its floor where the row has one that differs), or
//! past [`LISTED_RUNS`] runs their range and median, and the last column the change of
//! the median time (negative: the new build is faster).
//!
//! A file is one run (`"ms": 0.1`, the bench's `--json`) or several (`"ms": [0.1, ...]`
//! with `of_copy` and `of_floor` arrays of the same length: the per-build files kept
//! under `bench/results`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// One row of one run: its ratios and time.
#[derive(Clone, Debug, PartialEq)]
struct Sample {
    of_copy: f64,
    of_floor: Option<f64>,
    ms: f64,
}

/// Every row of a build's runs, in the order the first run listed them: (shape, kernel)
/// and that row's samples, one per run that has it (never none: a row enters with its
/// first sample).
#[derive(Debug, Default)]
struct Build {
    order: Vec<(String, String)>,
    rows: BTreeMap<(String, String), Vec<Sample>>,
    /// The bytes each row moves (the `bytes` of its first run that has one).
    bytes: BTreeMap<(String, String), u64>,
}

impl Build {
    /// The most runs any row has.
    fn most_runs(&self) -> usize {
        self.rows.values().map(Vec::len).max().unwrap_or(0)
    }

    fn add_run(&mut self, json: &str, path: &Path) -> Result<()> {
        let v: serde_json::Value =
            serde_json::from_str(json).with_context(|| format!("{}: not JSON", path.display()))?;
        let Some(rows) = v.get("rows").and_then(|r| r.as_array()) else {
            bail!(
                "{}: expected an object with a \"rows\" array (the output of a GPU bench's --json)",
                path.display()
            );
        };
        for (i, r) in rows.iter().enumerate() {
            let kernel = r
                .get("kernel")
                .and_then(|k| k.as_str())
                .with_context(|| format!("{}: row {i} has no string \"kernel\"", path.display()))?;
            let shape = r.get("shape").and_then(|s| s.as_str()).unwrap_or("");
            let key = (shape.to_owned(), kernel.to_owned());
            // One number per field, or one array per field with a number per run.
            let runs = r.get("ms").and_then(|m| m.as_array()).map_or(1, Vec::len);
            // A missing field or a null (a merged run without that field) is None.
            let field = |name: &str, run: usize| -> Result<Option<f64>> {
                let v = match r.get(name) {
                    None | Some(serde_json::Value::Null) => return Ok(None),
                    Some(serde_json::Value::Array(a)) => match a.get(run) {
                        Some(serde_json::Value::Null) => return Ok(None),
                        v => v,
                    },
                    Some(x) => Some(x),
                };
                match v.and_then(|x| x.as_f64()) {
                    Some(x) => Ok(Some(x)),
                    None => bail!(
                        "{}: row {i}'s \"{name}\" is not a number or an array of {runs} numbers",
                        path.display()
                    ),
                }
            };
            let needed = |name: &str, run: usize| -> Result<f64> {
                field(name, run)?.with_context(|| {
                    format!("{}: row {i} has no number \"{name}\"", path.display())
                })
            };
            if !self.rows.contains_key(&key) {
                self.order.push(key.clone());
            }
            if let Some(b) = r.get("bytes").and_then(|b| b.as_u64()) {
                self.bytes.entry(key.clone()).or_insert(b);
            }
            for run in 0..runs {
                let sample = Sample {
                    of_copy: needed("of_copy", run)?,
                    of_floor: field("of_floor", run)?,
                    ms: needed("ms", run)?,
                };
                self.rows.entry(key.clone()).or_default().push(sample);
            }
        }
        Ok(())
    }

    fn read(paths: &[PathBuf]) -> Result<Self> {
        let mut b = Build::default();
        for p in paths {
            let json =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            b.add_run(&json, p)?;
        }
        Ok(b)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The most runs a cell lists one by one; past it, a cell gives their range and median.
const LISTED_RUNS: usize = 6;

/// A side's cell: the runs' ratios to copy, then to floor where any run's floor differs
/// from its copy ratio (the two-pass rows), or "-" for a row the build lacks. Past
/// [`LISTED_RUNS`] runs: `min-max, median m`, with the number of runs at the end.
fn cell(samples: Option<&Vec<Sample>>) -> String {
    let Some(s) = samples else {
        return "-".into();
    };
    let join = |f: &dyn Fn(&Sample) -> f64| {
        let v: Vec<f64> = s.iter().map(f).collect();
        if v.len() > LISTED_RUNS {
            let (lo, hi) = v
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
                    (lo.min(x), hi.max(x))
                });
            return format!("{lo:.3}-{hi:.3}, median {:.3}", median(v));
        }
        v.iter()
            .map(|x| format!("{x:.3}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let mut out = join(&|x| x.of_copy);
    if s.iter()
        .any(|x| x.of_floor.is_some_and(|f| (f - x.of_copy).abs() > 5e-4))
    {
        write!(
            out,
            " (floor {})",
            join(&|x| x.of_floor.unwrap_or(f64::NAN))
        )
        .unwrap();
    }
    if s.len() > LISTED_RUNS {
        write!(out, " ({} runs)", s.len()).unwrap();
    }
    out
}

/// The comparison table of `base` against `new`; rows whose median time changed by
/// less than `min_change` (a fraction) are left out, rows of one side only never are.
fn table(base: &Build, new: &Build, min_change: f64) -> String {
    let mut keys = base.order.clone();
    keys.extend(
        new.order
            .iter()
            .filter(|k| !base.rows.contains_key(*k))
            .cloned(),
    );
    let mut out = String::from(
        "| shape | kernel | base | new | median ms change |\n|---|---|---:|---:|---:|\n",
    );
    for key in keys {
        let (b, n) = (base.rows.get(&key), new.rows.get(&key));
        let change = match (b, n) {
            (Some(b), Some(n)) => {
                let mb = median(b.iter().map(|s| s.ms).collect());
                let mn = median(n.iter().map(|s| s.ms).collect());
                Some(mn / mb - 1.0)
            }
            _ => None,
        };
        if change.is_some_and(|c| c.abs() < min_change) {
            continue;
        }
        let change = change.map_or("-".into(), |c| format!("{:+.1}%", 100.0 * c));
        writeln!(
            out,
            "| {} | {} | {} | {} | {change} |",
            key.0,
            key.1,
            cell(b),
            cell(n)
        )
        .unwrap();
    }
    out
}

/// Prints the table of the `base` runs against the `new` runs.
pub(crate) fn run(base: &[PathBuf], new: &[PathBuf], min_change: f64) -> Result<()> {
    if !(0.0..1.0).contains(&min_change) {
        bail!("--min-change {min_change}: expected a fraction in [0, 1), e.g. 0.01 for 1%");
    }
    let (b, n) = (Build::read(base)?, Build::read(new)?);
    print!("{}", table(&b, &n, min_change));
    Ok(())
}

/// `build`'s runs as one file of many runs: per row its shape, kernel and bytes, and
/// one array per field with an entry per run (`of_floor`'s entry null for a run without
/// one), `runs` the most runs of any row, and `label` (the build and card) as `build`.
fn merged(build: &Build, label: Option<&str>) -> serde_json::Value {
    use serde_json::{Value, json};
    let rows: Vec<Value> = build
        .order
        .iter()
        .map(|key| {
            let s = &build.rows[key];
            let mut row = json!({
                "shape": key.0,
                "kernel": key.1,
                "ms": s.iter().map(|x| x.ms).collect::<Vec<_>>(),
                "of_copy": s.iter().map(|x| x.of_copy).collect::<Vec<_>>(),
            });
            if s.iter().any(|x| x.of_floor.is_some()) {
                row["of_floor"] = json!(s.iter().map(|x| x.of_floor).collect::<Vec<_>>());
            }
            if let Some(b) = build.bytes.get(key) {
                row["bytes"] = json!(b);
            }
            row
        })
        .collect();
    let mut out = json!({ "runs": build.most_runs(), "rows": rows });
    if let Some(l) = label {
        out["build"] = json!(l);
    }
    out
}

/// Writes the runs in `runs` (files of one run or of many, in order) as one file of
/// many runs at `out`.
pub(crate) fn run_merge(runs: &[PathBuf], out: &Path, label: Option<&str>) -> Result<()> {
    let b = Build::read(runs)?;
    let text = serde_json::to_string(&merged(&b, label))?;
    std::fs::write(out, text + "\n").with_context(|| format!("writing {}", out.display()))?;
    println!(
        "{} rows of {} runs into {}",
        b.order.len(),
        b.most_runs(),
        out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(runs: &[&str]) -> Build {
        let mut b = Build::default();
        for r in runs {
            b.add_run(r, Path::new("run.json")).unwrap();
        }
        b
    }

    const BASE_1: &str = r#"{"rows": [
        {"shape": "[4, 4]", "kernel": "copy", "ms": 1.0, "of_copy": 1.0, "of_floor": 1.0},
        {"shape": "[4, 4]", "kernel": "two-pass", "ms": 2.0, "of_copy": 0.5, "of_floor": 0.9}
    ]}"#;
    const BASE_2: &str = r#"{"rows": [
        {"shape": "[4, 4]", "kernel": "copy", "ms": 1.0, "of_copy": 1.0, "of_floor": 1.0},
        {"shape": "[4, 4]", "kernel": "two-pass", "ms": 2.2, "of_copy": 0.45, "of_floor": 0.8}
    ]}"#;
    const NEW_1: &str = r#"{"rows": [
        {"shape": "[4, 4]", "kernel": "copy", "ms": 1.0, "of_copy": 1.0, "of_floor": 1.0},
        {"shape": "[4, 4]", "kernel": "two-pass", "ms": 1.0, "of_copy": 1.0, "of_floor": 1.8},
        {"kernel": "only new", "ms": 3.0, "of_copy": 0.3}
    ]}"#;

    #[test]
    fn rows_pair_by_shape_and_kernel_with_every_run_and_the_median_change() {
        let t = table(&build(&[BASE_1, BASE_2]), &build(&[NEW_1]), 0.0);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5, "{t}");
        assert_eq!(
            lines[2],
            "| [4, 4] | copy | 1.000 / 1.000 | 1.000 | +0.0% |"
        );
        // median of 2.0 and 2.2 is 2.1; 1.0 / 2.1 - 1 = -52.4%
        assert_eq!(
            lines[3],
            "| [4, 4] | two-pass | 0.500 / 0.450 (floor 0.900 / 0.800) | 1.000 (floor 1.800) | -52.4% |"
        );
        assert_eq!(lines[4], "|  | only new | - | 0.300 | - |");
    }

    #[test]
    fn min_change_leaves_out_unchanged_rows_but_not_one_sided_ones() {
        let t = table(&build(&[BASE_1]), &build(&[NEW_1]), 0.01);
        assert!(!t.contains("| copy |"), "{t}");
        assert!(t.contains("| two-pass |"), "{t}");
        assert!(t.contains("| only new |"), "{t}");
    }

    #[test]
    fn malformed_runs_are_errors_that_name_the_file_and_what_was_expected() {
        let mut b = Build::default();
        let e = b.add_run("[1, 2]", Path::new("a.json")).unwrap_err();
        assert!(
            e.to_string().contains("a.json") && e.to_string().contains("\"rows\""),
            "{e}"
        );
        let e = b
            .add_run(
                r#"{"rows": [{"kernel": "k", "ms": 1.0}]}"#,
                Path::new("b.json"),
            )
            .unwrap_err();
        assert!(
            e.to_string().contains("b.json") && e.to_string().contains("of_copy"),
            "{e}"
        );
        assert!(b.add_run("not json", Path::new("c.json")).is_err());
    }

    #[test]
    fn files_of_several_runs_count_each_run_and_long_lists_become_ranges() {
        // Seven runs in one file (the per-build files under bench/results), one in another.
        let seven = r#"{"rows": [{"shape": "[4, 4]", "kernel": "k",
            "ms": [1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 0.8],
            "of_copy": [0.5, 0.45, 0.55, 0.5, 0.4, 0.5, 0.6],
            "of_floor": [0.5, 0.45, 0.55, 0.5, 0.4, 0.5, 0.6]}]}"#;
        let one = r#"{"rows": [{"shape": "[4, 4]", "kernel": "k", "ms": 0.5, "of_copy": 1.0}]}"#;
        let t = table(&build(&[seven]), &build(&[one]), 0.0);
        // The median of the seven times is 1.0: 0.5 / 1.0 - 1 = -50%.
        assert!(
            t.contains("| [4, 4] | k | 0.400-0.600, median 0.500 (7 runs) | 1.000 | -50.0% |"),
            "{t}"
        );
        // Arrays of another length, or of non-numbers, are errors that name the file.
        let mut b = Build::default();
        let short = r#"{"rows": [{"kernel": "k", "ms": [1.0, 2.0], "of_copy": [1.0]}]}"#;
        let e = b.add_run(short, Path::new("d.json")).unwrap_err();
        assert!(
            e.to_string().contains("d.json") && e.to_string().contains("array of 2 numbers"),
            "{e}"
        );
    }

    #[test]
    fn merged_runs_read_back_as_the_same_samples() {
        let runs = build(&[BASE_1, BASE_2, NEW_1]);
        let text = merged(&runs, Some("test build")).to_string();
        let mut back = Build::default();
        back.add_run(&text, Path::new("merged.json")).unwrap();
        assert_eq!(back.order, runs.order);
        assert_eq!(back.rows, runs.rows);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["build"], "test build");
        assert_eq!(v["runs"], 3);
        // "only new" has one run and no floor: arrays of one, no of_floor field.
        let only = &v["rows"][2];
        assert_eq!(only["kernel"], "only new");
        assert_eq!(only["ms"], serde_json::json!([3.0]));
        assert!(only.get("of_floor").is_none(), "{only}");
    }

    #[test]
    fn a_fraction_outside_0_1_is_refused() {
        let e = run(&[], &[], 1.5).unwrap_err();
        assert!(e.to_string().contains("--min-change"), "{e}");
    }
}
