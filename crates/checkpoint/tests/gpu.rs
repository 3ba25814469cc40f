//! GPU tests: a layer on a CUDA device that draws its dropout mask from that device's
//! current generator is recomputed exactly by a default [`Checkpoint`] — the frame
//! replays the generators of the devices its inputs live on without being told. Run
//! with `cargo xtask test-gpu`.
#![cfg(feature = "cuda")]

use tessera_checkpoint::{Checkpoint, Recompute, Saved, Saver, exactly};
use tessera_core::cuda::is_available;
use tessera_core::{Device, Error, Result, Tensor};
use tessera_rng::stream::dropout_scale;
use tessera_rng::{Generator, get_rng_state, manual_seed, with_current_generator};

const GPU: Device = Device::Cuda(0);
const P: f32 = 0.25;

fn require_gpu() {
    assert!(
        is_available(),
        "these tests need a CUDA GPU and driver; run them with `cargo xtask test-gpu` on one"
    );
}

/// `y = dropout(x)` with the mask drawn from the current generator of `x`'s device.
struct GpuDropout;

impl Recompute for GpuDropout {
    fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>> {
        let [x] = exactly("GpuDropout", inputs)?;
        let (y, mask) = with_current_generator(x.device(), |g| g.dropout_tensor(x, P))??;
        saver.save_named("mask", &mask);
        Ok(vec![y])
    }

    fn backward(saved: &mut Saved<'_, Self>, grads: &[Tensor]) -> Result<Vec<Tensor>> {
        let [dy] = exactly("GpuDropout::backward", grads)?;
        let mask = saved.take(0)?.to_vec::<u8>()?;
        let s = dropout_scale(P);
        let dx: Vec<f32> = dy
            .to_vec::<f32>()?
            .iter()
            .zip(&mask)
            .map(|(g, &m)| if m == 1 { g * s } else { 0.0 })
            .collect();
        Tensor::from_slice(&dx, dy.shape(), dy.device()).map(|t| vec![t])
    }
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    Generator::new(seed).fill_uniform(&mut v);
    v
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn a_default_frame_replays_the_generator_of_its_inputs_device() {
    require_gpu();
    let shape = [96, 257];
    let n = shape[0] * shape[1];
    let x = Tensor::from_slice(&random(n, 1), shape, GPU).unwrap();
    let dy = Tensor::from_slice(&random(n, 2), shape, GPU).unwrap();
    let mut dxs = Vec::new();
    for ckpt in [
        Checkpoint::off(),
        Checkpoint::reentrant(),
        Checkpoint::non_reentrant(),
    ] {
        let ckpt = ckpt.determinism_check(true);
        manual_seed(GPU, 0x5eed).unwrap();
        // Draws in between must not leak into the recompute, nor be undone by it.
        let (_, mut frame) = ckpt
            .forward(&mut GpuDropout, std::slice::from_ref(&x))
            .unwrap();
        with_current_generator(GPU, |g| g.advance(1000)).unwrap();
        let before_backward = get_rng_state(GPU).unwrap();
        let dx = frame
            .backward(&mut GpuDropout, std::slice::from_ref(&dy))
            .unwrap();
        assert_eq!(get_rng_state(GPU).unwrap(), before_backward, "{ckpt:?}");
        dxs.push(dx[0].to_vec::<f32>().unwrap());
    }
    assert!(dxs[0].contains(&0.0) && dxs[0].iter().any(|&v| v != 0.0));
    assert_eq!(dxs[0], dxs[1], "reentrant recompute drew another mask");
    assert_eq!(dxs[0], dxs[2], "non-reentrant recompute drew another mask");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn replaying_only_the_cpu_generator_is_caught_by_the_determinism_check() {
    require_gpu();
    let x = Tensor::from_slice(&random(4096, 3), [64, 64], GPU).unwrap();
    let dy = Tensor::from_slice(&random(4096, 4), [64, 64], GPU).unwrap();
    for ckpt in [Checkpoint::reentrant(), Checkpoint::non_reentrant()] {
        let ckpt = ckpt
            .determinism_check(true)
            .replay_current_generators([Device::Cpu]);
        let (_, mut frame) = ckpt
            .forward(&mut GpuDropout, std::slice::from_ref(&x))
            .unwrap();
        let err = frame
            .backward(&mut GpuDropout, std::slice::from_ref(&dy))
            .unwrap_err();
        assert!(
            matches!(err, Error::State { .. })
                && err.to_string().contains("saved tensor 0 (`mask`) differs"),
            "{err}"
        );
    }
}
