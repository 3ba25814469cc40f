//! Frame mechanics on a small probe layer: bad input (typed errors), the determinism
//! check, user contexts, phases, lazy recompute and release-on-take accounting.

use std::sync::{Arc, Mutex};

use tessera_checkpoint::{
    Checkpoint, MemoryMeter, Mode, Phase, Recompute, Saved, Saver, context_fn, exactly,
};
use tessera_core::{Device, Error, Replay, Result, Tensor};
use tessera_quant::DelayedScalingState;
use tessera_rng::{Generator, get_rng_state, manual_seed, with_current_generator};

/// `y = 2x + noise`, where the noise comes from the layer's own generator (replayed),
/// from the CPU's current generator, or from a generator nobody replays.
struct Probe {
    rng: Generator,
    delayed: DelayedScalingState,
    /// Unreplayed randomness: a forward that draws from it is not reproducible.
    fresh: Option<Generator>,
    /// Draw the noise from the current CPU generator instead of `rng`.
    from_current: bool,
    /// How many of `[rng, delayed]` `replay_states` presents, and in which order.
    states: Vec<usize>,
    /// Outputs of the recompute (the forward returns one).
    recompute_outputs: usize,
    /// Extra tensors saved by the recompute.
    recompute_extra_saves: usize,
    /// The recompute saves `noise` with another shape.
    recompute_reshape: bool,
    /// Which saved tensors the backward takes, in order.
    takes: Vec<usize>,
    /// `(phase, checkpointed)` of every forward.
    phases: Vec<(Phase, bool)>,
    /// Frame bytes after each take.
    held: Vec<usize>,
    /// Log shared with the user context.
    log: Arc<Mutex<Vec<String>>>,
}

impl Probe {
    fn new() -> Probe {
        Probe {
            rng: Generator::new(3),
            delayed: DelayedScalingState::new(4).unwrap(),
            fresh: None,
            from_current: false,
            states: vec![0, 1],
            recompute_outputs: 1,
            recompute_extra_saves: 0,
            recompute_reshape: false,
            takes: vec![0, 1],
            phases: Vec::new(),
            held: Vec::new(),
            log: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn log(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
}

impl Recompute for Probe {
    fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>> {
        let [x] = exactly("Probe", inputs)?;
        let phase = saver.phase();
        self.phases.push((phase, saver.is_checkpointed()));
        self.log(format!("forward {phase}"));
        let n = x.numel();
        let mut noise = vec![0.0f32; n];
        match (&mut self.fresh, self.from_current) {
            (Some(g), _) => g.fill_uniform(&mut noise),
            (None, true) => with_current_generator(Device::Cpu, |g| g.fill_uniform(&mut noise))?,
            (None, false) => self.rng.fill_uniform(&mut noise),
        }
        self.delayed
            .record_amax(noise.iter().fold(0.0, |a: f32, &b| a.max(b)));
        let xs = x.as_slice::<f32>()?;
        let y: Vec<f32> = xs.iter().zip(&noise).map(|(a, b)| 2.0 * a + b).collect();
        let noise_shape = if phase.is_recompute() && self.recompute_reshape {
            vec![n]
        } else {
            x.shape().dims().to_vec()
        };
        saver.save_named("x", x);
        saver.save_named(
            "noise",
            &Tensor::from_slice(&noise, noise_shape, Device::Cpu)?,
        );
        let y = Tensor::from_slice(&y, x.shape(), Device::Cpu)?;
        if phase.is_recompute() {
            for _ in 0..self.recompute_extra_saves {
                saver.save(x);
            }
            return Ok(vec![y; self.recompute_outputs]);
        }
        Ok(vec![y])
    }

    fn backward(saved: &mut Saved<'_, Self>, grads: &[Tensor]) -> Result<Vec<Tensor>> {
        let [dy] = exactly("Probe::backward", grads)?;
        let takes = saved.layer().takes.clone();
        for i in takes {
            saved.take(i)?;
            let held = saved.held_bytes();
            saved.layer().held.push(held);
        }
        let dx: Vec<f32> = dy.as_slice::<f32>()?.iter().map(|g| 2.0 * g).collect();
        Ok(vec![Tensor::from_slice(&dx, dy.shape(), Device::Cpu)?])
    }

    fn replay_states(&mut self) -> Vec<&mut dyn Replay> {
        let mut all: [Option<&mut dyn Replay>; 2] = [Some(&mut self.rng), Some(&mut self.delayed)];
        self.states
            .iter()
            .filter_map(|&i| all.get_mut(i).and_then(Option::take))
            .collect()
    }
}

fn x() -> Tensor {
    Tensor::from_slice(&[1.0f32, -2.0, 3.0, 0.5, 0.25, -1.0], [2, 3], Device::Cpu).unwrap()
}

fn dy() -> Tensor {
    Tensor::from_slice(&[1.0f32; 6], [2, 3], Device::Cpu).unwrap()
}

const MODES: [Mode; 2] = [Mode::Reentrant, Mode::NonReentrant];

fn state_msg(e: &Error) -> &str {
    match e {
        Error::State { msg, .. } => msg,
        other => panic!("expected Error::State, got {other:?}"),
    }
}

#[test]
fn backward_twice_is_a_state_error() {
    for mode in [Mode::Off, Mode::Reentrant, Mode::NonReentrant] {
        let mut p = Probe::new();
        let (_, mut frame) = Checkpoint::new(mode).forward(&mut p, &[x()]).unwrap();
        frame.backward(&mut p, &[dy()]).unwrap();
        assert!(frame.is_consumed());
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        assert!(state_msg(&err).contains("backward already ran"), "{err}");
    }
}

#[test]
fn a_recompute_with_another_number_of_outputs_is_a_state_error() {
    for mode in MODES {
        let mut p = Probe::new();
        p.recompute_outputs = 2;
        let (_, mut frame) = Checkpoint::new(mode).forward(&mut p, &[x()]).unwrap();
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        assert!(
            state_msg(&err).contains("the recompute returned 2 outputs but the forward returned 1"),
            "{err}"
        );
    }
}

#[test]
fn a_recompute_that_saves_differently_is_a_state_error() {
    for mode in MODES {
        let mut p = Probe::new();
        p.recompute_extra_saves = 1;
        let (_, mut frame) = Checkpoint::new(mode).forward(&mut p, &[x()]).unwrap();
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        assert!(
            state_msg(&err).contains("saved 3 tensors but the forward saved 2"),
            "{err}"
        );

        // Shapes are always checked, without the determinism check.
        let mut p = Probe::new();
        p.recompute_reshape = true;
        let (_, mut frame) = Checkpoint::new(mode).forward(&mut p, &[x()]).unwrap();
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        assert!(
            state_msg(&err).contains(
                "saved tensor 1 (`noise`) differs: shape [2, 3] in the forward, [6] in the recompute"
            ),
            "{err}"
        );
    }
}

#[test]
fn a_missing_replay_state_is_a_typed_error_and_leaves_the_frame_usable() {
    for mode in MODES {
        let mut p = Probe::new();
        let (_, mut frame) = Checkpoint::new(mode).forward(&mut p, &[x()]).unwrap();
        p.states = vec![0];
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        let msg = state_msg(&err);
        assert!(
            msg.contains("the forward snapshotted 3 replay states")
                && msg.contains("missing: DelayedScalingState"),
            "{err}"
        );
        assert!(!frame.is_consumed());

        p.states = vec![1, 0];
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        assert_eq!(
            err,
            Error::SnapshotMismatch {
                expected: "DelayedScalingState",
                got: "Generator"
            },
            "{err}"
        );

        // A frame made without the current generators expects none.
        p.states = vec![0, 1];
        let ckpt = Checkpoint::new(mode).replay_current_generators([]);
        let (_, mut other) = ckpt.forward(&mut p, &[x()]).unwrap();
        assert!(other.backward(&mut p, &[dy()]).is_ok());

        // The right states: the backward runs, and replays the forward exactly.
        p.states = vec![0, 1];
        frame.backward(&mut p, &[dy()]).unwrap();
    }
}

#[test]
fn output_gradients_must_match_the_outputs() {
    let mut p = Probe::new();
    let (_, mut frame) = Checkpoint::reentrant().forward(&mut p, &[x()]).unwrap();
    let err = frame.backward(&mut p, &[dy(), dy()]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let err = frame
        .backward(&mut p, &[dy().reshape([6]).unwrap()])
        .unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    assert!(err.to_string().contains("output 0 has shape [6]"), "{err}");
    frame.backward(&mut p, &[dy()]).unwrap();
}

#[test]
fn taking_twice_or_out_of_range_is_an_error() {
    for mode in [Mode::Off, Mode::Reentrant, Mode::NonReentrant] {
        let mut p = Probe::new();
        p.takes = vec![1, 1];
        let (_, mut frame) = Checkpoint::new(mode).forward(&mut p, &[x()]).unwrap();
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        assert!(
            state_msg(&err).contains("saved tensor 1 (`noise`) was already taken"),
            "{err}"
        );

        let mut p = Probe::new();
        p.takes = vec![5];
        let (_, mut frame) = Checkpoint::new(mode).forward(&mut p, &[x()]).unwrap();
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        assert!(
            err.to_string()
                .contains("index 5 is out of range: the forward saved 2"),
            "{err}"
        );
    }
}

#[test]
fn the_determinism_check_catches_a_forward_that_draws_fresh_randomness() {
    for mode in MODES {
        let mut p = Probe::new();
        p.fresh = Some(Generator::new(11));
        let ckpt = Checkpoint::new(mode).determinism_check(true);
        let (_, mut frame) = ckpt.forward(&mut p, &[x()]).unwrap();
        let err = frame.backward(&mut p, &[dy()]).unwrap_err();
        let msg = state_msg(&err);
        assert!(
            msg.contains("saved tensor 1 (`noise`) differs: same shape [2, 3] and dtype f32 but different values"),
            "{err}"
        );
        assert!(msg.contains("register every Replay state"), "{err}");

        // Without the check the shapes agree and nothing is noticed.
        let mut p = Probe::new();
        p.fresh = Some(Generator::new(11));
        let (_, mut frame) = Checkpoint::new(mode).forward(&mut p, &[x()]).unwrap();
        frame.backward(&mut p, &[dy()]).unwrap();

        // Drawing from the current generator is fine while it is replayed, and fresh
        // randomness when it is not.
        for (devices, ok) in [(vec![Device::Cpu], true), (vec![], false)] {
            let mut p = Probe::new();
            p.from_current = true;
            let ckpt = Checkpoint::new(mode)
                .determinism_check(true)
                .replay_current_generators(devices);
            let (_, mut frame) = ckpt.forward(&mut p, &[x()]).unwrap();
            assert_eq!(frame.backward(&mut p, &[dy()]).is_ok(), ok);
        }
    }
}

#[test]
fn recompute_replays_and_then_restores_the_states() {
    for mode in MODES {
        manual_seed(Device::Cpu, 5).unwrap();
        let mut p = Probe::new();
        p.from_current = true;
        let ckpt = Checkpoint::new(mode).determinism_check(true);
        let (_, mut frame) = ckpt.forward(&mut p, &[x()]).unwrap();
        // Something else draws between the forward and the backward.
        with_current_generator(Device::Cpu, |g| g.fill_uniform(&mut [0.0; 8])).unwrap();
        p.delayed.record_amax(100.0);
        let (gen_before, delayed_before) = (get_rng_state(Device::Cpu).unwrap(), p.delayed.clone());
        frame.backward(&mut p, &[dy()]).unwrap();
        assert!(frame.is_recomputed());
        assert_eq!(get_rng_state(Device::Cpu).unwrap(), gen_before);
        assert_eq!(p.delayed, delayed_before);
    }
}

#[test]
fn user_contexts_run_around_the_forward_and_the_recompute() {
    let expect = |mode: Mode| -> Vec<&'static str> {
        match mode {
            Mode::Off => vec!["enter forward", "forward forward", "exit forward"],
            _ => vec![
                "enter forward",
                "forward forward",
                "exit forward",
                "backward starts",
                "enter recompute",
                "forward recompute",
                "exit recompute",
            ],
        }
    };
    for mode in [Mode::Off, Mode::Reentrant, Mode::NonReentrant] {
        let p = Probe::new();
        let (l1, l2) = (p.log.clone(), p.log.clone());
        let ctx = context_fn(
            move |ph: Phase| {
                l1.lock().unwrap().push(format!("enter {ph}"));
                Ok(())
            },
            move |ph: Phase| {
                l2.lock().unwrap().push(format!("exit {ph}"));
                Ok(())
            },
        );
        let mut p = p;
        let (_, mut frame) = Checkpoint::new(mode)
            .context(ctx)
            .forward(&mut p, &[x()])
            .unwrap();
        p.log("backward starts".into());
        frame.backward(&mut p, &[dy()]).unwrap();
        let mut log = p.log.lock().unwrap().clone();
        if mode == Mode::Off {
            log.retain(|l| l != "backward starts");
        }
        assert_eq!(log, expect(mode), "{mode:?}");
        let phases: Vec<Phase> = p.phases.iter().map(|(ph, _)| *ph).collect();
        let checkpointed: Vec<bool> = p.phases.iter().map(|(_, c)| *c).collect();
        match mode {
            Mode::Off => assert_eq!((phases, checkpointed), (vec![Phase::Forward], vec![false])),
            _ => assert_eq!(
                (phases, checkpointed),
                (vec![Phase::Forward, Phase::Recompute], vec![true, true])
            ),
        }
    }
}

#[test]
fn a_failing_context_stops_the_forward_and_exit_runs_after_a_failing_forward() {
    let p = Probe::new();
    let log = p.log.clone();
    let ctx = context_fn(
        |_| Err(Error::state("test context", "refused")),
        move |_| {
            log.lock().unwrap().push("exit".into());
            Ok(())
        },
    );
    let mut p = p;
    let err = Checkpoint::reentrant()
        .context(ctx)
        .forward(&mut p, &[x()])
        .unwrap_err();
    assert!(err.to_string().contains("refused"));
    assert!(p.phases.is_empty() && p.log.lock().unwrap().is_empty());

    let log = p.log.clone();
    let ctx = context_fn(
        |_| Ok(()),
        move |ph| {
            log.lock().unwrap().push(format!("exit {ph}"));
            Ok(())
        },
    );
    // Two inputs: the forward fails.
    let err = Checkpoint::reentrant()
        .context(ctx)
        .forward(&mut p, &[x(), x()])
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_eq!(*p.log.lock().unwrap(), ["exit forward"]);
}

#[test]
fn non_reentrant_recomputes_lazily_and_releases_each_activation_when_taken() {
    let meter = MemoryMeter::new();
    let x_bytes = 24;
    // Takes nothing: nothing is recomputed.
    let mut p = Probe::new();
    p.takes = vec![];
    let (_, mut frame) = Checkpoint::non_reentrant().forward(&mut p, &[x()]).unwrap();
    frame.backward(&mut p, &[dy()]).unwrap();
    assert_eq!(p.phases.len(), 1);
    assert!(!frame.is_recomputed());

    for mode in [Mode::Off, Mode::Reentrant, Mode::NonReentrant] {
        let mut p = Probe::new();
        let ckpt = Checkpoint::new(mode).meter(meter.clone());
        meter.reset_peak();
        let (_, mut frame) = ckpt.forward(&mut p, &[x()]).unwrap();
        let after_forward = frame.saved_bytes();
        assert_eq!(meter.current(), after_forward);
        frame.backward(&mut p, &[dy()]).unwrap();
        assert_eq!(frame.saved_bytes(), 0);
        assert_eq!(meter.current(), 0);
        match mode {
            // x and noise saved.
            Mode::Off => assert_eq!(after_forward, 2 * x_bytes),
            // Only the input.
            _ => assert_eq!(after_forward, x_bytes),
        }
        // The recompute adds both activations while the input is still held; the input
        // goes once the recompute is done, each activation when it is taken.
        assert_eq!(p.held, [x_bytes, 0], "{mode:?}");
        let peak = if mode == Mode::Off {
            2 * x_bytes
        } else {
            3 * x_bytes
        };
        assert_eq!(
            (frame.peak_saved_bytes(), meter.peak()),
            (peak, peak),
            "{mode:?}"
        );
    }

    // A frame dropped without backward gives its bytes back.
    let mut p = Probe::new();
    let (_, frame) = Checkpoint::off()
        .meter(meter.clone())
        .forward(&mut p, &[x()])
        .unwrap();
    assert_eq!(meter.current(), 2 * x_bytes);
    drop(frame);
    assert_eq!(meter.current(), 0);
}

#[test]
fn a_failed_recompute_is_reported_to_every_later_take() {
    // The backward ignores the first failure and takes again: the same error.
    struct Retry(Probe);
    impl Recompute for Retry {
        fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>> {
            self.0.forward(inputs, saver)
        }
        fn backward(saved: &mut Saved<'_, Self>, _: &[Tensor]) -> Result<Vec<Tensor>> {
            let first = saved.take(0).unwrap_err();
            let second = saved.take(1).unwrap_err();
            assert_eq!(first, second);
            Err(first)
        }
        fn replay_states(&mut self) -> Vec<&mut dyn Replay> {
            self.0.replay_states()
        }
    }
    let mut p = Probe::new();
    p.recompute_outputs = 0;
    let mut r = Retry(p);
    let (_, mut frame) = Checkpoint::non_reentrant().forward(&mut r, &[x()]).unwrap();
    let err = frame.backward(&mut r, &[dy()]).unwrap_err();
    assert!(state_msg(&err).contains("returned 0 outputs"), "{err}");
    assert_eq!(r.0.phases.len(), 2, "recomputed once");
}
