//! Delayed scaling (`spec/formats.md` §3.3): the fused amax-and-scale update against a
//! straightforward re-implementation of the spec's five steps, on random sequences of
//! recorded amaxes and updates; and Replay snapshots of the state.

use proptest::prelude::*;
use tessera_core::{Device, Error, Replay, Tensor};
use tessera_quant::cast::encode_e5m2;
use tessera_quant::{
    AmaxComputeAlgo, BufferName, DelayedScalingState, Fp8DelayedScaling, Fp8Format, Quantizer,
};
use tessera_rng::Generator;

/// CUDA's `fmaxf`: a NaN operand loses.
fn fmaxf(a: f32, b: f32) -> f32 {
    if a.is_nan() {
        b
    } else if b.is_nan() || a >= b {
        a
    } else {
        b
    }
}

/// The spec's model of one quantizer's state.
#[derive(Debug, Clone)]
struct Model {
    history: Vec<f32>,
    scale: f32,
}

impl Model {
    fn record(&mut self, amax: f32) {
        self.history[0] = fmaxf(self.history[0], amax);
    }

    /// §3.3, `kernel_bulk`, one quantizer.
    fn update(&mut self, reduced: Option<f32>, fp8_max: f32, margin: i32, algo: AmaxComputeAlgo) {
        let l = self.history.len();
        // 1. the reduced amax if non-zero, else history[0].
        let last = match reduced {
            Some(r) if r != 0.0 => r,
            _ => self.history[0],
        };
        // 2. nothing happens for a zero newest amax.
        if last == 0.0 {
            return;
        }
        // 3. amax over the old history[1..L-1] and last; then roll.
        let amax = match algo {
            AmaxComputeAlgo::Max => {
                let mut a = last;
                for i in 1..l {
                    a = fmaxf(a, self.history[i]);
                }
                a
            }
            AmaxComputeAlgo::MostRecent => last,
        };
        let mut new = vec![0.0f32; l];
        // new[i] = history[i + 1] for 0 <= i < L - 1
        new[..l - 1].copy_from_slice(&self.history[1..]);
        new[l - 1] = last;
        new[0] = 0.0;
        self.history = new;
        // 4. scale = scaled_max / amax when amax is finite and positive; FLT_MAX for +Inf.
        let scaled_max = fp8_max * 2f32.powi(-margin);
        if amax.is_finite() && amax > 0.0 {
            let s = scaled_max / amax;
            self.scale = if s == f32::INFINITY { f32::MAX } else { s };
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Record(f32),
    Update(Option<f32>),
}

/// Amax-like values, special ones included.
fn amax_value() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => 1e-3f32..1e3,
        1 => Just(0.0f32),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NAN),
        1 => Just(f32::MAX),
        1 => Just(1e-42f32),
        1 => (0u32..0x7F80_0000).prop_map(f32::from_bits),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => amax_value().prop_map(Op::Record),
        1 => prop::option::of(amax_value()).prop_map(Op::Update),
    ]
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fused_update_matches_the_spec(
        len in 1usize..=6,
        e5m2 in any::<bool>(),
        margin in -3i32..=4,
        most_recent in any::<bool>(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let f = if e5m2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
        let algo = if most_recent { AmaxComputeAlgo::MostRecent } else { AmaxComputeAlgo::Max };
        let mut s = DelayedScalingState::new(len).unwrap();
        let mut m = Model { history: vec![0.0; len], scale: 1.0 };
        prop_assert!(same_bits(s.history(), &m.history));
        prop_assert_eq!(s.scale(), 1.0);
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Record(a) => {
                    s.record_amax(a);
                    m.record(a);
                }
                Op::Update(r) => {
                    s.update(r, f, margin, algo);
                    m.update(r, f.max(), margin, algo);
                }
            }
            prop_assert!(
                same_bits(s.history(), &m.history),
                "step {} {:?}: history {:?}, spec {:?}", i, op, s.history(), m.history
            );
            prop_assert_eq!(
                s.scale().to_bits(), m.scale.to_bits(),
                "step {} {:?}: scale {} spec {}", i, op, s.scale(), m.scale
            );
        }
    }

    #[test]
    fn quantizer_update_uses_its_margin_and_algo(
        amaxes in prop::collection::vec(1e-3f32..1e3, 1..6),
        margin in 0i32..=3,
        most_recent in any::<bool>(),
    ) {
        let algo = if most_recent { AmaxComputeAlgo::MostRecent } else { AmaxComputeAlgo::Max };
        let mut q = Fp8DelayedScaling::new(Fp8Format::E4M3, 3)
            .unwrap()
            .with_margin(margin)
            .with_algo(algo);
        let mut m = Model { history: vec![0.0; 3], scale: 1.0 };
        for &a in &amaxes {
            // A cast records the amax; the next cast uses the scale of the update.
            let x = Tensor::from_slice(&[a, -a / 2.0], [2], Device::Cpu).unwrap();
            let t = q.quantize(&x).unwrap();
            let si = t.buffer(BufferName::ScaleInv).unwrap().to_vec::<f32>().unwrap()[0];
            prop_assert_eq!(si.to_bits(), (1.0 / m.scale).to_bits());
            m.record(a);
            q.update(None);
            m.update(None, 448.0, margin, algo);
            prop_assert!(same_bits(q.state().history(), &m.history));
            prop_assert_eq!(q.state().scale().to_bits(), m.scale.to_bits());
        }
    }
}

#[test]
fn spec_worked_example() {
    // §3.5: L = 3, history [3, 2, 5] (3 newest), scale 1 → [0, 5, 3];
    // "max" → 89.6, "most_recent" → 448/3, margin 1 → 44.8.
    let build = || {
        let mut s = DelayedScalingState::new(3).unwrap();
        // Reach history [3, 2, 5] through the public API: record 2, update (→ [0, 0, 2]);
        // record 5, update (→ [0, 2, 5]); record 3.
        for a in [2.0, 5.0] {
            s.record_amax(a);
            s.update(None, Fp8Format::E4M3, 0, AmaxComputeAlgo::MostRecent);
        }
        s.record_amax(3.0);
        assert_eq!(s.history(), [3.0, 2.0, 5.0]);
        s
    };
    let mut s = build();
    s.update(None, Fp8Format::E4M3, 0, AmaxComputeAlgo::Max);
    assert_eq!(s.history(), [0.0, 5.0, 3.0]);
    assert_eq!(s.scale(), 89.6);
    let mut s = build();
    s.update(None, Fp8Format::E4M3, 0, AmaxComputeAlgo::MostRecent);
    assert_eq!(s.scale(), 149.333_33);
    let mut s = build();
    s.update(None, Fp8Format::E4M3, 1, AmaxComputeAlgo::Max);
    assert_eq!(s.scale(), 44.8);
    // A zero newest amax: no roll, scale kept.
    let mut s = build();
    s.update(Some(0.0), Fp8Format::E4M3, 0, AmaxComputeAlgo::Max);
    assert_eq!(s.history(), [0.0, 5.0, 3.0]);
    let before = s.clone();
    s.update(None, Fp8Format::E4M3, 0, AmaxComputeAlgo::Max);
    assert_eq!(s, before);
    // A tiny amax overflows the division: FLT_MAX.
    let mut s = DelayedScalingState::new(1).unwrap();
    s.record_amax(1e-44);
    s.update(None, Fp8Format::E5M2, 0, AmaxComputeAlgo::Max);
    assert_eq!(s.scale(), f32::MAX);
    assert_eq!(s.history(), [0.0]);
}

#[test]
fn delayed_cast_uses_the_updated_scale() {
    let mut q = Fp8DelayedScaling::new(Fp8Format::E5M2, 2).unwrap();
    let x = Tensor::from_slice(&[1.0f32, -3.0, 0.5, 2.0], [2, 2], Device::Cpu).unwrap();
    q.quantize(&x).unwrap();
    q.update(None);
    let s = 57344.0f32 / 3.0;
    assert_eq!(q.state().scale(), s);
    let t = q.quantize(&x).unwrap();
    let want: Vec<u8> = [1.0f32, -3.0, 0.5, 2.0]
        .iter()
        .map(|&v| encode_e5m2(v * s))
        .collect();
    assert_eq!(
        t.buffer(BufferName::Data).unwrap().to_bytes().unwrap(),
        want
    );
    assert_eq!(
        t.buffer(BufferName::ScaleInv)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        [1.0 / s]
    );
    // A reduced amax overrides the local one.
    q.update(Some(100.0));
    assert_eq!(q.state().scale(), 57344.0 / 100.0);
}

#[test]
fn snapshots_restore_the_history_and_scale() {
    let mut q = Fp8DelayedScaling::new(Fp8Format::E4M3, 4).unwrap();
    let x = Tensor::from_slice(&[7.0f32, -1.0], [2], Device::Cpu).unwrap();
    q.quantize(&x).unwrap();
    let snap = q.state().snapshot();
    assert_eq!(snap.kind(), "DelayedScalingState");
    let saved = q.state().clone();
    q.update(None);
    q.quantize(&x).unwrap();
    q.update(Some(50.0));
    assert_ne!(q.state(), &saved);
    let after = q.state().clone();
    q.state_mut().restore(&snap).unwrap();
    assert_eq!(q.state(), &saved);
    // Restoring twice replays the same state.
    q.update(None);
    q.state_mut().restore(&snap).unwrap();
    assert_eq!(q.state(), &saved);
    // A later snapshot restores the later state.
    let mut other = DelayedScalingState::new(4).unwrap();
    other.restore(&after.snapshot()).unwrap();
    assert_eq!(other, after);
    // A snapshot of another kind of state is refused and leaves the state alone.
    let g = Generator::new(1).snapshot();
    let e = q.state_mut().restore(&g).unwrap_err();
    assert!(matches!(e, Error::SnapshotMismatch { .. }), "{e:?}");
    assert_eq!(q.state(), &saved);
    // Through the Replay trait object, as a checkpoint frame holds it.
    let r: &mut dyn Replay = q.state_mut();
    let s2 = r.snapshot();
    r.restore(&s2).unwrap();
}

/// The quantizer itself is a replay state (what a checkpoint frame registers): its
/// snapshot restores the history and scale the casts and updates changed since, twice
/// over, and refuses snapshots of other kinds and of other history lengths, leaving the
/// state alone.
#[test]
fn the_quantizer_replays_its_state() {
    let mut q = Fp8DelayedScaling::new(Fp8Format::E5M2, 3).unwrap();
    let x = Tensor::from_slice(&[3.0f32, -9.0, 0.25], [3], Device::Cpu).unwrap();
    q.quantize(&x).unwrap();
    q.update(None);
    let snap = q.snapshot();
    assert_eq!(snap.kind(), "Fp8DelayedScaling");
    let saved = q.state().clone();
    assert_eq!(saved.history(), &[0.0, 0.0, 9.0]);
    let cast_then = q.quantize(&x).unwrap();
    for _ in 0..2 {
        q.quantize(&(Tensor::from_slice(&[100.0f32], [1], Device::Cpu).unwrap()))
            .unwrap();
        q.update(Some(200.0));
        assert_ne!(q.state(), &saved);
        q.restore(&snap).unwrap();
        assert_eq!(q.state(), &saved);
        // The restored scale is the one the cast after the snapshot used.
        let again = q.quantize(&x).unwrap();
        assert_eq!(
            again.buffer(BufferName::Data).unwrap().to_bytes().unwrap(),
            cast_then
                .buffer(BufferName::Data)
                .unwrap()
                .to_bytes()
                .unwrap()
        );
        q.restore(&snap).unwrap();
    }
    // Snapshots of another kind, of the bare state and of another history length.
    let now = q.state().clone();
    for other in [
        Generator::new(1).snapshot(),
        q.state().snapshot(),
        Fp8DelayedScaling::new(Fp8Format::E5M2, 4)
            .unwrap()
            .snapshot(),
    ] {
        assert!(q.restore(&other).is_err(), "{}", other.kind());
        assert_eq!(q.state(), &now);
    }
    let e = q.restore(&Generator::new(1).snapshot()).unwrap_err();
    assert!(matches!(e, Error::SnapshotMismatch { .. }), "{e:?}");
    let e = q
        .restore(
            &Fp8DelayedScaling::new(Fp8Format::E5M2, 4)
                .unwrap()
                .snapshot(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("4 slots"), "{e}");
}

/// While the state is on the host, the device-side calls say so instead of acting:
/// `update_on_device` is a typed error naming `to_device`, there is no device slot 0,
/// `fetch_state` is the host state, and a CPU "device" is refused. Without a GPU (CI),
/// moving to a CUDA device fails cleanly and leaves a working host quantizer.
#[test]
fn device_side_calls_on_a_host_state() {
    let mut q = Fp8DelayedScaling::new(Fp8Format::E4M3, 3)
        .unwrap()
        .with_scale(2.0)
        .unwrap();
    let x = Tensor::from_slice(&[1.0f32, -4.0, 0.5, 3.0], [2, 2], Device::Cpu).unwrap();
    q.quantize(&x).unwrap();
    assert_eq!(q.state_device(), None);
    assert!(q.device_amax_mut().is_none());
    let e = q.update_on_device().unwrap_err();
    let on_host = matches!(e, Error::State { .. }) && e.to_string().contains("to_device");
    assert!(on_host || matches!(e, Error::FeatureDisabled { .. }), "{e}");
    assert_eq!(&q.fetch_state().unwrap(), q.state());
    assert_eq!(q.state().history(), &[4.0, 0.0, 0.0]);
    let e = q.to_device(Device::Cpu).unwrap_err();
    assert!(
        matches!(e, Error::Device { .. } | Error::FeatureDisabled { .. }),
        "{e}"
    );
    #[cfg(feature = "cuda")]
    if !tessera_core::cuda::is_available() {
        assert!(q.to_device(Device::Cuda(0)).is_err());
    }
    assert_eq!(q.state_device(), None);
    q.update(None);
    assert_eq!(q.state().history(), &[0.0, 0.0, 4.0]);
    assert_eq!(q.state().scale(), 448.0 / 4.0);
}
