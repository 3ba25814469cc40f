//! One rank per process: the demo over a process group whose ranks are processes
//! (`--backend nccl`: one process per GPU, NCCL between them).
//!
//! Every process trains its rank on its group's device (tensors on the GPU, GEMMs
//! through cuBLAS); rank 0 also trains the reference on its device before, prints the
//! table and the summary, and writes the report. What the threads backend passes
//! through memory travels over the world group here, outside the counted traffic:
//!
//! - after each step an all-gather of every rank's loss part (8 bytes each), so rank 0
//!   prints each row as the step ends;
//! - at the end every rank's [`RankOutput`], encoded as bytes ([`encode`]) and gathered
//!   in two all-gathers (the lengths, then the bytes padded to the longest).
//!
//! NCCL adds a reduction's inputs in an order of its own (ring or tree, in chunks): for a
//! group of two ranks `a + b == b + a`, so the exact check holds at `--tp 2 --dp 2`; with
//! more ranks in a group the sums may round differently from the reference's rank
//! order, and `--reference-sums whole` holds the run to its bound instead.

use std::sync::Arc;
use std::time::Duration;

use tessera_collectives::ProcessGroup;
use tessera_core::{DType, Error, Result, Tensor};
use tessera_fsdp::{CommCounts, MemoryStats, OpCount};

use super::config::DemoConfig;
use super::rank::{RankOutput, StepEvent, run_rank};
use super::record::{BlockBytes, MaskRecord, Region, Traffic, TrafficKey};
use super::report::{self, Console, DemoReport};
use super::{DemoError, model};

/// Runs the demo as rank `world.rank()` of `world` on `world.device()`: `Some(report)`
/// on rank 0, `None` on the others. `cfg.tp · cfg.dp` must equal the group's size.
pub fn execute_in_group(
    cfg: &DemoConfig,
    world: Arc<dyn ProcessGroup>,
    console: &mut Console,
) -> Result<Option<DemoReport>, DemoError> {
    if world.size() != cfg.world() {
        return Err(DemoError::Usage(format!(
            "--tp {} × --dp {} = {} ranks, but the launcher started {} (WORLD_SIZE)",
            cfg.tp,
            cfg.dp,
            cfg.world(),
            world.size()
        )));
    }
    let mut cfg = cfg.clone();
    cfg.device = world.device();
    let cfg = &cfg;
    let lead = world.rank() == 0;
    if lead {
        console.intro(cfg)?;
    }
    let init = model::init(cfg).map_err(DemoError::tessera("initial weights"))?;

    let (ref_steps, ref_time) = if lead {
        let out = super::train_reference(cfg, &init, console)?;
        console.phase("distributed");
        out
    } else {
        (Vec::new(), Duration::ZERO)
    };
    let tolerance = report::Tolerance::new(cfg);
    let first_ref = ref_steps.first().map_or(0.0, |r| r.loss);
    if lead {
        console.table_header(&tolerance, first_ref)?;
    }

    let mut rows = Vec::with_capacity(cfg.steps);
    let group = world.clone();
    let mut on_step = |ev: StepEvent| -> Result<()> {
        let mine = Tensor::from_bytes(&ev.loss_sum.to_le_bytes(), [8], DType::U8, cfg.device)?;
        let all = group.all_gather(&mine)?.into_result()?.to_bytes()?;
        if !lead {
            return Ok(());
        }
        let parts: Vec<f64> = all
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("chunks of 8 bytes")))
            .collect();
        // Rank r is tensor-parallel rank r % tp of batch r / tp: a batch's parts are
        // consecutive and added in tensor-parallel order, as the threads backend adds them.
        let sums: Vec<f64> = parts
            .chunks(cfg.tp)
            .map(|c| c.iter().fold(0.0, |a, v| a + v))
            .collect();
        let row = report::StepRow::new(
            ev.step,
            model::step_loss(cfg, &sums),
            ref_steps[ev.step].loss,
            tolerance.bound(first_ref),
        );
        console
            .row(&row)
            .map_err(|e| Error::state("tessera demo", e.to_string()))?;
        console.tick();
        rows.push(row);
        Ok(())
    };
    let out = run_rank(world.clone(), cfg, &init, &mut on_step)
        .map_err(DemoError::tessera(format!("rank {}", world.rank())))?;
    if lead {
        console.done();
    }
    let outputs = gather_outputs(&*world, &out)
        .map_err(DemoError::tessera("gathering the ranks' records"))?;
    if !lead {
        return Ok(None);
    }
    let report = DemoReport::build(cfg, &tolerance, rows, &ref_steps, ref_time, &outputs);
    console.summary(&report)?;
    Ok(Some(report))
}

/// Every rank's output on rank 0 (in rank order); an empty list on the others.
fn gather_outputs(world: &dyn ProcessGroup, out: &RankOutput) -> Result<Vec<RankOutput>> {
    let device = world.device();
    let mut bytes = encode(out);
    let len = Tensor::from_bytes(&(bytes.len() as u64).to_le_bytes(), [8], DType::U8, device)?;
    let lens: Vec<usize> = world
        .all_gather(&len)?
        .into_result()?
        .to_bytes()?
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8 bytes")) as usize)
        .collect();
    let longest = lens.iter().copied().max().unwrap_or(0).max(1);
    bytes.resize(longest, 0);
    let padded = Tensor::from_bytes(&bytes, [longest], DType::U8, device)?;
    let all = world.all_gather(&padded)?.into_result()?.to_bytes()?;
    if world.rank() != 0 {
        return Ok(Vec::new());
    }
    all.chunks_exact(longest)
        .zip(&lens)
        .map(|(chunk, &n)| decode(&chunk[..n]))
        .collect()
}

/// A little-endian byte writer for [`encode`].
#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }
    fn str(&mut self, s: &str) {
        self.usize(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn op(&mut self, c: &OpCount) {
        self.u64(c.calls);
        self.u64(c.bytes);
        self.u64(c.wire_bytes);
    }
}

/// The reader of what [`Writer`] wrote; every read checks the length left.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(Error::invalid(
                "decoding a rank's record",
                format!("needed {n} more bytes, {} left", self.0.len()),
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?)
            .map_err(|_| Error::invalid("decoding a rank's record", "a count beyond usize"))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.usize()?;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| Error::invalid("decoding a rank's record", "a string that is not UTF-8"))
    }
    fn op(&mut self) -> Result<OpCount> {
        Ok(OpCount {
            calls: self.u64()?,
            bytes: self.u64()?,
            wire_bytes: self.u64()?,
        })
    }
}

/// The groups a traffic key can name (keys hold `&'static str`).
const GROUPS: [&str; 3] = ["tp", "dp", "world"];

/// `out` as bytes, for [`decode`] on another process.
pub(crate) fn encode(out: &RankOutput) -> Vec<u8> {
    let mut w = Writer::default();
    w.usize(out.tp_rank);
    w.usize(out.dp_rank);
    w.u64(out.mp_seed);
    let entries: Vec<_> = out.traffic.entries().collect();
    w.usize(entries.len());
    for (k, e) in entries {
        w.u64(u64::from(k.order));
        w.str(k.group);
        w.str(&k.what);
        w.str(&k.format);
        for c in [
            &e.counts.all_gather,
            &e.counts.reduce_scatter,
            &e.counts.all_reduce,
            &e.counts.broadcast,
        ] {
            w.op(c);
        }
        w.u64(e.f32_bytes);
    }
    w.usize(out.masks.len());
    for m in &out.masks {
        w.usize(m.step);
        w.usize(m.layer);
        w.usize(m.dp);
        w.usize(m.tp);
        w.u64(match m.region {
            Region::ModelParallel => 0,
            Region::DataParallel => 1,
        });
        w.u64(m.checksum);
    }
    w.usize(out.bytes.len());
    for b in &out.bytes {
        w.usize(b.input);
        w.usize(b.saved);
    }
    w.usize(out.peak_saved);
    w.usize(out.recomputes);
    for v in [
        out.fsdp.shard_bytes,
        out.fsdp.grad_bytes,
        out.fsdp.full_bytes,
        out.fsdp.peak_full_bytes,
    ] {
        w.usize(v);
    }
    w.str(&out.fsdp_wire);
    w.u64(out.elapsed.as_nanos().min(u128::from(u64::MAX)) as u64);
    w.0
}

/// The [`RankOutput`] that [`encode`] wrote, or an error for bytes it did not write.
pub(crate) fn decode(bytes: &[u8]) -> Result<RankOutput> {
    const OP: &str = "decoding a rank's record";
    let mut r = Reader(bytes);
    let (tp_rank, dp_rank, mp_seed) = (r.usize()?, r.usize()?, r.u64()?);
    let mut traffic = Traffic::default();
    for _ in 0..r.usize()? {
        let order = u8::try_from(r.u64()?).map_err(|_| Error::invalid(OP, "an order past 255"))?;
        let group = r.string()?;
        let group = GROUPS
            .into_iter()
            .find(|g| *g == group)
            .ok_or_else(|| Error::invalid(OP, format!("unknown group `{group}`")))?;
        let key = TrafficKey {
            order,
            group,
            what: r.string()?,
            format: r.string()?,
        };
        let counts = CommCounts {
            all_gather: r.op()?,
            reduce_scatter: r.op()?,
            all_reduce: r.op()?,
            broadcast: r.op()?,
        };
        traffic.add(key, counts, r.u64()?);
    }
    let masks = (0..r.usize()?)
        .map(|_| {
            Ok(MaskRecord {
                step: r.usize()?,
                layer: r.usize()?,
                dp: r.usize()?,
                tp: r.usize()?,
                region: match r.u64()? {
                    0 => Region::ModelParallel,
                    1 => Region::DataParallel,
                    other => return Err(Error::invalid(OP, format!("unknown region {other}"))),
                },
                checksum: r.u64()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = (0..r.usize()?)
        .map(|_| {
            Ok(BlockBytes {
                input: r.usize()?,
                saved: r.usize()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let (peak_saved, recomputes) = (r.usize()?, r.usize()?);
    let fsdp = MemoryStats {
        shard_bytes: r.usize()?,
        grad_bytes: r.usize()?,
        full_bytes: r.usize()?,
        peak_full_bytes: r.usize()?,
    };
    let fsdp_wire = r.string()?;
    let elapsed = Duration::from_nanos(r.u64()?);
    if !r.0.is_empty() {
        return Err(Error::invalid(
            OP,
            format!("{} bytes left after the record", r.0.len()),
        ));
    }
    Ok(RankOutput {
        tp_rank,
        dp_rank,
        mp_seed,
        traffic,
        masks,
        bytes,
        peak_saved,
        recomputes,
        fsdp,
        fsdp_wire,
        elapsed,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use tessera_collectives::run_ranks;
    use tessera_fsdp::OpCount;

    use super::*;
    use crate::args::{Cli, Command};

    fn config(args: &[&str]) -> DemoConfig {
        let base = [
            "tessera", "demo", "--layers", "2", "--hidden", "64", "--seq", "64",
        ];
        let cli = Cli::try_parse_from(base.iter().chain(args)).unwrap();
        let Command::Demo(a) = cli.command else {
            unreachable!("parsed a demo command")
        };
        DemoConfig::from_args(&a).unwrap()
    }

    /// The report without its timings (the only part two runs may not share).
    fn comparable(r: &DemoReport) -> serde_json::Value {
        let mut v = serde_json::to_value(r).unwrap();
        v.as_object_mut().unwrap().remove("throughput");
        v
    }

    #[test]
    fn process_ranks_reproduce_the_thread_run() {
        for args in [
            [
                "--tp",
                "2",
                "--dp",
                "2",
                "--format",
                "mxfp8",
                "--checkpoint",
                "reentrant",
            ],
            [
                "--tp",
                "1",
                "--dp",
                "2",
                "--format",
                "fp8-delayed",
                "--checkpoint",
                "none",
            ],
            [
                "--tp",
                "2",
                "--dp",
                "1",
                "--format",
                "bf16",
                "--checkpoint",
                "non-reentrant",
            ],
        ] {
            let mut args = args.to_vec();
            args.extend(["--steps", "3"]);
            let cfg = config(&args);
            let threads = super::super::execute(&cfg, &mut Console::new(cfg.steps)).unwrap();
            assert!(threads.passed, "{args:?}");
            let reports = run_ranks(cfg.world(), |g| {
                execute_in_group(&cfg, Arc::new(g), &mut Console::new(cfg.steps))
                    .map_err(|e| Error::state("test", e.to_string()))
            })
            .unwrap();
            let mut reports = reports.into_iter().map(Result::unwrap);
            let lead = reports.next().unwrap().expect("rank 0 reports");
            assert!(reports.all(|r| r.is_none()), "only rank 0 reports");
            assert!(lead.passed, "{args:?}");
            assert_eq!(comparable(&lead), comparable(&threads), "{args:?}");
        }
    }

    #[test]
    fn a_group_of_another_size_is_a_usage_error() {
        let cfg = config(&["--tp", "2", "--dp", "2"]);
        let out = run_ranks(2, |g| -> Result<Option<(bool, String)>> {
            Ok(execute_in_group(&cfg, Arc::new(g), &mut Console::new(1))
                .err()
                .map(|e| (e.is_usage(), e.to_string())))
        })
        .unwrap();
        for r in out {
            let (usage, msg) = r.unwrap().expect("an error");
            assert!(usage && msg.contains("the launcher started 2"), "{msg}");
        }
    }

    #[test]
    fn records_round_trip_and_bad_bytes_are_errors() {
        let mut traffic = Traffic::default();
        let op = |calls, bytes| OpCount {
            calls,
            bytes,
            wire_bytes: 3 * bytes,
        };
        traffic.add(
            TrafficKey {
                order: 4,
                group: "dp",
                what: "FSDP all-gather: FC1, FC2 weights".into(),
                format: "mxfp8 ⋅ E4M3".into(),
            },
            CommCounts {
                all_gather: op(2, 1000),
                reduce_scatter: op(0, 0),
                all_reduce: op(1, 8),
                broadcast: op(5, 77),
            },
            4096,
        );
        let out = RankOutput {
            tp_rank: 1,
            dp_rank: 3,
            mp_seed: u64::MAX - 5,
            traffic,
            masks: vec![MaskRecord {
                step: 2,
                layer: 1,
                dp: 3,
                tp: 1,
                region: Region::DataParallel,
                checksum: 0xDEAD_BEEF_0123_4567,
            }],
            bytes: vec![BlockBytes {
                input: 10,
                saved: 99,
            }],
            peak_saved: 1234,
            recomputes: 6,
            fsdp: MemoryStats {
                shard_bytes: 1,
                grad_bytes: 2,
                full_bytes: 3,
                peak_full_bytes: 4,
            },
            fsdp_wire: "weights mxfp8, LayerNorm f32".into(),
            elapsed: Duration::from_micros(1_234_567),
        };
        let bytes = encode(&out);
        assert_eq!(format!("{:?}", decode(&bytes).unwrap()), format!("{out:?}"));
        assert!(decode(&bytes[..bytes.len() - 1]).is_err(), "truncated");
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_err(), "trailing bytes");
    }
}
