//! Sharded checkpoints: save at 4 ranks, load at 2, 1 (and 3), consolidate; hybrid
//! saves; bad checkpoints are typed errors.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use safetensors::SafeTensors;
use tessera_collectives::{ProcessGroup, ThreadGroup, run_ranks};
use tessera_core::{Error, Result, Tensor};
use tessera_fsdp::mlp::{Activations, MlpSpec, batch, rows, train_step};
use tessera_fsdp::sharded::{INDEX_FILE, read_index, shard_file_name};
use tessera_fsdp::{Fsdp, FsdpConfig, WeightFormat, consolidate, thread_hybrid_groups};

const SPEC: MlpSpec = MlpSpec {
    d_model: 24,
    d_ffn: 40,
    layers: 2,
    seed: 17,
};

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("tessera-fsdp-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

type Params = Vec<(String, Vec<u8>)>;

fn bytes(p: Vec<(String, Tensor)>) -> Params {
    p.into_iter()
        .map(|(n, t)| (n, t.to_bytes().unwrap()))
        .collect()
}

/// Trains 2 steps at `world` ranks and saves; returns the gathered parameters.
fn train_and_save(world: usize, dir: &Path, config: FsdpConfig) -> Params {
    let x = batch(world * 2, SPEC.d_model, 3).unwrap();
    let out = run_ranks(world, |g| -> Result<Params> {
        let r = g.rank();
        let mut fsdp = Fsdp::new(Arc::new(g), config)?;
        SPEC.build(&mut fsdp)?;
        let mine = rows(&x, 2 * r..2 * r + 2)?;
        for _ in 0..2 {
            train_step(&mut fsdp, &mine, 0.3, Activations::Keep)?;
        }
        fsdp.save_sharded(dir)?;
        Ok(bytes(fsdp.gather_full_parameters()?))
    })
    .unwrap();
    let mut v: Vec<Params> = out.into_iter().map(Result::unwrap).collect();
    v.remove(0)
}

/// Loads at `world` ranks into an engine built from shapes only; returns the gathered
/// parameters (checked equal on every rank) and each rank's shards.
fn load(world: usize, dir: &Path, config: FsdpConfig) -> Result<Params> {
    let out = run_ranks(world, |g| -> Result<Params> {
        let mut fsdp = Fsdp::new(Arc::new(g), config)?;
        for (l, params) in SPEC.init()?.into_iter().enumerate() {
            fsdp.add_unit_shapes(
                &format!("layer{l}"),
                params
                    .into_iter()
                    .map(|(n, t)| (n, t.shape().clone()))
                    .collect(),
            )?;
        }
        fsdp.load_sharded(dir)?;
        Ok(bytes(fsdp.gather_full_parameters()?))
    })?;
    let mut v = out.into_iter().collect::<Result<Vec<_>>>()?;
    assert!(v.iter().all(|p| *p == v[0]));
    Ok(v.remove(0))
}

#[test]
fn save_at_4_load_at_2_1_and_3_gives_identical_parameters() {
    let dir = TempDir::new("save4");
    let saved = train_and_save(4, &dir.0, FsdpConfig::default());
    let index = read_index(&dir.0).unwrap();
    assert_eq!(index.world_size, 4);
    assert_eq!(index.params.len(), 4);
    let mut names: Vec<String> = fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want: Vec<String> = (0..4).map(|r| shard_file_name(r, 4)).collect();
    want.push(INDEX_FILE.to_owned());
    want.sort();
    assert_eq!(names, want, "no temporary files are left behind");
    // Rank 3 holds rows 18..24 of w1 (24 rows over 4 ranks) and 30..40 of w2.
    let f = fs::read(dir.0.join(shard_file_name(3, 4))).unwrap();
    let st = SafeTensors::deserialize(&f).unwrap();
    assert_eq!(st.tensor("layer0.w1").unwrap().shape(), [6, 40]);
    assert_eq!(st.tensor("layer1.w2").unwrap().shape(), [10, 24]);
    for world in [2, 1, 3, 4, 8] {
        assert_eq!(
            load(world, &dir.0, FsdpConfig::default()).unwrap(),
            saved,
            "load at {world}"
        );
    }
    // Into a layout padded for MXFP8 (32-row shards).
    let mx = FsdpConfig::default().weight_format(WeightFormat::Mxfp8);
    assert_eq!(load(2, &dir.0, mx).unwrap(), saved);
    // Consolidated into one file.
    let out = dir.0.join("model.safetensors");
    let c = consolidate(&dir.0, &out).unwrap();
    assert_eq!(
        (c.world_size, c.params.len(), c.bytes),
        (4, 4, SPEC.param_bytes())
    );
    let f = fs::read(&out).unwrap();
    let st = SafeTensors::deserialize(&f).unwrap();
    for (name, b) in &saved {
        assert_eq!(st.tensor(name).unwrap().data(), &b[..], "{name}");
    }
}

#[test]
fn a_loaded_checkpoint_trains_on_exactly_like_the_original() {
    let dir = TempDir::new("resume");
    train_and_save(2, &dir.0, FsdpConfig::default());
    let x = batch(4, SPEC.d_model, 99).unwrap();
    let step = |from_checkpoint: bool| -> Vec<f64> {
        run_ranks(2, |g| -> Result<f64> {
            let r = g.rank();
            let mut fsdp = Fsdp::new(Arc::new(g), FsdpConfig::default())?;
            SPEC.build(&mut fsdp)?;
            if from_checkpoint {
                fsdp.load_sharded(&dir.0)?;
            }
            Ok(train_step(
                &mut fsdp,
                &rows(&x, 2 * r..2 * r + 2)?,
                0.3,
                Activations::Keep,
            )?
            .loss)
        })
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect()
    };
    let fresh = step(false);
    let resumed = step(true);
    assert_ne!(fresh, resumed, "the checkpoint holds trained weights");
    assert_eq!(resumed, step(true));
}

#[test]
fn hybrid_sharding_saves_one_replica() {
    let dir = TempDir::new("hybrid");
    // 4 ranks: shards over {0,1} and {2,3}, replicated across {0,2} and {1,3}.
    let handles: Vec<Mutex<Option<(ThreadGroup, ThreadGroup)>>> = thread_hybrid_groups(4, 2)
        .unwrap()
        .into_iter()
        .map(|p| Mutex::new(Some(p)))
        .collect();
    let x = batch(8, SPEC.d_model, 3).unwrap();
    let out = run_ranks(4, |g| -> Result<Params> {
        let r = g.rank();
        let (s, rep) = handles[r].lock().unwrap().take().unwrap();
        let rep: Arc<dyn ProcessGroup> = Arc::new(rep);
        let mut fsdp = Fsdp::with_groups(Arc::new(s), Some(rep), FsdpConfig::default())?;
        SPEC.build(&mut fsdp)?;
        train_step(
            &mut fsdp,
            &rows(&x, 2 * r..2 * r + 2)?,
            0.3,
            Activations::Keep,
        )?;
        fsdp.save_sharded(&dir.0)?;
        Ok(bytes(fsdp.gather_full_parameters()?))
    })
    .unwrap();
    let params: Vec<Params> = out.into_iter().map(Result::unwrap).collect();
    assert!(params.iter().all(|p| *p == params[0]));
    assert_eq!(read_index(&dir.0).unwrap().world_size, 2);
    assert_eq!(fs::read_dir(&dir.0).unwrap().count(), 3);
    assert_eq!(load(1, &dir.0, FsdpConfig::default()).unwrap(), params[0]);
}

#[test]
fn bad_checkpoints_are_typed_errors() {
    let dir = TempDir::new("bad");
    let e = load(2, &dir.0, FsdpConfig::default()).unwrap_err();
    assert!(
        matches!(e, Error::State { .. }) && e.to_string().contains("index.json"),
        "{e}"
    );
    train_and_save(2, &dir.0, FsdpConfig::default());
    let index_path = dir.0.join(INDEX_FILE);
    let good = fs::read_to_string(&index_path).unwrap();

    // A parameter with another shape.
    fs::write(&index_path, good.replacen("40", "41", 1)).unwrap();
    let e = load(1, &dir.0, FsdpConfig::default()).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    // A missing parameter.
    fs::write(&index_path, good.replace("layer1.w2", "layer1.w3")).unwrap();
    let e = load(1, &dir.0, FsdpConfig::default()).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    // Rows no shard holds.
    let index: tessera_fsdp::ShardIndex = serde_json::from_str(&good).unwrap();
    let mut holes = index.clone();
    holes.params[0].shards.pop();
    fs::write(&index_path, serde_json::to_string(&holes).unwrap()).unwrap();
    let e = load(1, &dir.0, FsdpConfig::default()).unwrap_err();
    assert!(
        e.to_string()
            .contains("each row must be in exactly one shard"),
        "{e}"
    );
    // A file outside the directory.
    let mut outside = index.clone();
    outside.params[0].shards[0].file = "../x.safetensors".into();
    fs::write(&index_path, serde_json::to_string(&outside).unwrap()).unwrap();
    assert!(load(1, &dir.0, FsdpConfig::default()).is_err());
    // Another format, and not JSON at all.
    fs::write(&index_path, good.replace("tessera-fsdp-sharded", "other")).unwrap();
    let e = load(1, &dir.0, FsdpConfig::default()).unwrap_err();
    assert!(
        e.to_string().contains("expected `tessera-fsdp-sharded`"),
        "{e}"
    );
    fs::write(&index_path, "{").unwrap();
    assert!(matches!(
        load(1, &dir.0, FsdpConfig::default()).unwrap_err(),
        Error::InvalidArgument { .. }
    ));
    // A truncated shard file.
    fs::write(&index_path, &good).unwrap();
    let shard = dir.0.join(shard_file_name(1, 2));
    let b = fs::read(&shard).unwrap();
    fs::write(&shard, &b[..b.len() / 2]).unwrap();
    let e = load(1, &dir.0, FsdpConfig::default()).unwrap_err();
    assert!(
        e.to_string().contains("not a readable .safetensors file"),
        "{e}"
    );
    assert!(consolidate(&dir.0, &dir.0.join("out.safetensors")).is_err());
    assert!(!dir.0.join("out.safetensors").exists());
}
