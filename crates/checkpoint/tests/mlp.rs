//! The MLP block (dropout from a forked tracker state, FP8 current and delayed scaling)
//! trained with and without checkpointing: gradients, weights, amax histories and RNG
//! states are bit-identical, on one rank and with `distribute_saved_activations` on
//! thread groups of 2 and 4 ranks.

use std::sync::Arc;

use tessera_checkpoint::Checkpoint;
use tessera_checkpoint::mlp::{Mlp, Step, train_step};
use tessera_collectives::{ProcessGroup, run_ranks};
use tessera_core::{Device, Error, Result, Tensor};
use tessera_rng::tp::model_parallel_manual_seed;
use tessera_rng::{Generator, GeneratorState, RngTracker, get_rng_state};

const LR: f32 = 0.5;

struct Run {
    steps: Vec<Step>,
    blocks: Vec<Mlp>,
    tracker: RngTracker,
    current: GeneratorState,
    /// Tracker state after each step.
    trackers: Vec<RngTracker>,
}

#[derive(Clone, Copy)]
struct Setup {
    tokens: usize,
    d_model: usize,
    d_ffn: usize,
    blocks: usize,
    steps: usize,
    /// Tensor-parallel rank the tracker's model-parallel seed is derived from.
    tp_rank: u64,
    replay_delayed: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            tokens: 6,
            d_model: 16,
            d_ffn: 32,
            blocks: 2,
            steps: 3,
            tp_rank: 0,
            replay_delayed: true,
        }
    }
}

fn input(tokens: usize, d: usize) -> Tensor {
    let mut v = vec![0.0f32; tokens * d];
    Generator::new(99).fill_normal(&mut v, 0.0, 1.0);
    Tensor::from_slice(&v, [tokens, d], Device::Cpu).unwrap()
}

fn train(s: &Setup, ckpt: &Checkpoint) -> Result<Run> {
    let mut tracker = RngTracker::new(Device::Cpu);
    model_parallel_manual_seed(&mut tracker, 1234, s.tp_rank, 0)?;
    let mut blocks = (0..s.blocks)
        .map(|i| {
            Mlp::new(s.d_model, s.d_ffn, 0.2, 10 + i as u64)
                .map(|m| m.with_delayed_scaling_replay(s.replay_delayed))
        })
        .collect::<Result<Vec<_>>>()?;
    let x = input(s.tokens, s.d_model);
    let mut steps = Vec::new();
    let mut trackers = Vec::new();
    for _ in 0..s.steps {
        steps.push(train_step(&mut blocks, &mut tracker, &x, ckpt, LR)?);
        trackers.push(tracker.clone());
    }
    Ok(Run {
        steps,
        blocks,
        current: get_rng_state(Device::Cpu)?,
        tracker,
        trackers,
    })
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.to_bytes().unwrap()
}

fn assert_identical(base: &Run, other: &Run, what: &str) {
    for (i, (a, b)) in base.steps.iter().zip(&other.steps).enumerate() {
        assert!(
            a.loss.is_finite() && a.loss > 0.0,
            "{what}: loss {}",
            a.loss
        );
        assert_eq!(
            a.loss.to_bits(),
            b.loss.to_bits(),
            "{what}: loss of step {i}"
        );
        assert_eq!(
            bytes(&a.dx),
            bytes(&b.dx),
            "{what}: input gradient of step {i}"
        );
    }
    for (i, (a, b)) in base.blocks.iter().zip(&other.blocks).enumerate() {
        let (ga, gb) = (a.grads().unwrap(), b.grads().unwrap());
        assert_eq!(bytes(ga.0), bytes(gb.0), "{what}: block {i} grad w1");
        assert_eq!(bytes(ga.1), bytes(gb.1), "{what}: block {i} grad w2");
        assert_eq!(
            bytes(a.weights().0),
            bytes(b.weights().0),
            "{what}: block {i} w1"
        );
        assert_eq!(
            bytes(a.weights().1),
            bytes(b.weights().1),
            "{what}: block {i} w2"
        );
        assert_eq!(
            a.delayed_scaling(),
            b.delayed_scaling(),
            "{what}: block {i} amax history and scale"
        );
    }
    assert_eq!(
        base.trackers, other.trackers,
        "{what}: tracker after each step"
    );
    assert_eq!(base.tracker, other.tracker, "{what}: tracker");
    assert_eq!(base.current, other.current, "{what}: current CPU generator");
}

#[test]
fn checkpointed_gradients_are_bit_identical_to_the_baseline() {
    let s = Setup::default();
    let base = train(&s, &Checkpoint::off()).unwrap();
    for ckpt in [Checkpoint::reentrant(), Checkpoint::non_reentrant()] {
        let run = train(&s, &ckpt).unwrap();
        assert_identical(&base, &run, ckpt.mode().name());
        let run = train(&s, &ckpt.clone().determinism_check(true)).unwrap();
        assert_identical(&base, &run, "with the determinism check");
    }
}

#[test]
fn saved_bytes_fall_to_the_inputs_alone() {
    let s = Setup::default();
    let x_bytes = s.tokens * s.d_model * 4;
    let per_block = x_bytes + s.tokens * s.d_ffn * (4 + 1 + 4);
    let base = train(&s, &Checkpoint::off()).unwrap();
    assert!(
        base.steps
            .iter()
            .all(|st| st.saved_after_forward == s.blocks * per_block)
    );
    for ckpt in [Checkpoint::reentrant(), Checkpoint::non_reentrant()] {
        let run = train(&s, &ckpt).unwrap();
        for st in &run.steps {
            assert_eq!(
                st.saved_after_forward,
                s.blocks * x_bytes,
                "{:?}",
                ckpt.mode()
            );
        }
    }
}

#[test]
fn amax_history_advances_exactly_once_per_step() {
    for steps in [1, 2, 5] {
        let s = Setup {
            steps,
            ..Setup::default()
        };
        let base = train(&s, &Checkpoint::off()).unwrap();
        for ckpt in [Checkpoint::reentrant(), Checkpoint::non_reentrant()] {
            let run = train(&s, &ckpt).unwrap();
            for b in &run.blocks {
                let h = b.delayed_scaling().history();
                // Each forward rolls the previous step's amax into the history once, and
                // records this step's amax in slot 0.
                let rolled = h[1..].iter().filter(|&&v| v != 0.0).count();
                assert_eq!(rolled, steps - 1, "{:?}: {h:?}", ckpt.mode());
                assert!(h[0] > 0.0);
            }
            assert_identical(&base, &run, ckpt.mode().name());
        }
    }
}

#[test]
fn unreplayed_delayed_scaling_uses_the_phase_instead() {
    let base = train(&Setup::default(), &Checkpoint::off()).unwrap();
    let s = Setup {
        replay_delayed: false,
        ..Setup::default()
    };
    for ckpt in [Checkpoint::reentrant(), Checkpoint::non_reentrant()] {
        let run = train(&s, &ckpt).unwrap();
        assert_identical(&base, &run, "phase-gated delayed scaling");
    }
}

#[test]
fn fork_state_after_backward_equals_the_state_without_checkpointing() {
    // Three blocks share one tracker: by the time block 0 recomputes, blocks 1 and 2
    // have advanced the model-parallel state; the recompute must replay block 0's
    // draws and then put the advanced state back.
    let s = Setup {
        blocks: 3,
        steps: 2,
        ..Setup::default()
    };
    let base = train(&s, &Checkpoint::off()).unwrap();
    let fresh = {
        let mut t = RngTracker::new(Device::Cpu);
        model_parallel_manual_seed(&mut t, 1234, 0, 0).unwrap();
        t
    };
    assert_ne!(base.trackers[0], fresh, "the dropout advanced the tracker");
    for ckpt in [Checkpoint::reentrant(), Checkpoint::non_reentrant()] {
        let run = train(&s, &ckpt).unwrap();
        assert_eq!(run.trackers, base.trackers);
        assert_eq!(run.current, base.current);
    }
}

fn distributed(world: usize, s: Setup) {
    let results = run_ranks(world, |g| -> Result<()> {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let rank = group.rank() as u64;
        let s = Setup {
            tp_rank: if s.tp_rank == u64::MAX {
                rank
            } else {
                s.tp_rank
            },
            ..s
        };
        let base = train(&s, &Checkpoint::off())?;
        let shard = (s.tokens * s.d_model).div_ceil(world) * 4;
        for ckpt in [Checkpoint::reentrant(), Checkpoint::non_reentrant()] {
            for check in [false, true] {
                let ckpt = ckpt
                    .clone()
                    .distribute_saved_activations(group.clone())
                    .determinism_check(check);
                let run = train(&s, &ckpt)?;
                assert_identical(&base, &run, &format!("rank {rank} of {world}, {ckpt:?}"));
                for st in &run.steps {
                    assert_eq!(st.saved_after_forward, s.blocks * shard);
                }
            }
        }
        Ok(())
    })
    .unwrap();
    for r in results {
        r.unwrap();
    }
}

#[test]
fn distributed_saved_activations_on_2_and_4_ranks() {
    for world in [2, 4] {
        // 5 × 13 = 65 elements: not divisible by 2 or 4.
        // One block with per-rank dropout (the input is replicated, the masks differ) ...
        distributed(
            world,
            Setup {
                tokens: 5,
                d_model: 13,
                blocks: 1,
                tp_rank: u64::MAX,
                ..Setup::default()
            },
        );
        // ... and a stack whose activations stay replicated (same seeds on every rank).
        distributed(
            world,
            Setup {
                tokens: 5,
                d_model: 13,
                blocks: 3,
                ..Setup::default()
            },
        );
    }
}

#[test]
fn a_first_input_that_is_not_replicated_is_caught_by_the_determinism_check() {
    // With per-rank dropout, block 1's input differs between ranks, so the gathered
    // shards do not rebuild it.
    let results = run_ranks(2, |g| -> Result<()> {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let s = Setup {
            blocks: 2,
            steps: 1,
            tp_rank: group.rank() as u64,
            ..Setup::default()
        };
        let ckpt = Checkpoint::reentrant()
            .distribute_saved_activations(group.clone())
            .determinism_check(true);
        match train(&s, &ckpt) {
            Err(Error::State { msg, .. }) if msg.contains("replicated on every rank") => Ok(()),
            other => panic!("expected the replication error, got {:?}", other.err()),
        }
    })
    .unwrap();
    for r in results {
        r.unwrap();
    }
}
