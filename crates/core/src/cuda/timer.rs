use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use super::{CudaDevice, CudaResultExt};
use crate::Result;

/// A pair of timing events on a device's tessera stream.
///
/// `start()`, queue work, `stop()`, then [`elapsed_ms`](EventTimer::elapsed_ms) waits
/// for the stop event and returns the GPU time between the two.
pub struct EventTimer {
    stream: Arc<CudaStream>,
    start: CudaEvent,
    stop: CudaEvent,
}

impl EventTimer {
    /// Two timing-enabled events on `device`'s stream.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let ctx = device.context();
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        Ok(EventTimer {
            stream: device.stream().clone(),
            start: ctx.new_event(flags).cuda_op("cuEventCreate")?,
            stop: ctx.new_event(flags).cuda_op("cuEventCreate")?,
        })
    }

    /// Records the start event.
    pub fn start(&self) -> Result<()> {
        self.start.record(&self.stream).cuda_op("cuEventRecord")
    }

    /// Records the stop event.
    pub fn stop(&self) -> Result<()> {
        self.stop.record(&self.stream).cuda_op("cuEventRecord")
    }

    /// Milliseconds between start and stop, after waiting for the stop event.
    pub fn elapsed_ms(&self) -> Result<f32> {
        self.stop.synchronize().cuda_op("cuEventSynchronize")?;
        self.start
            .elapsed_ms(&self.stop)
            .cuda_op("cuEventElapsedTime")
    }
}

impl EventTimer {
    /// The median milliseconds per run of `f` on `device`'s stream: `samples` timed
    /// batches of `batch` back-to-back runs, after one warm-up batch. Batching keeps the
    /// queue full, so the host's launch cost (which would sit between a start event and
    /// the first kernel) is hidden, as it is in a training step.
    pub fn median_ms(
        device: &CudaDevice,
        samples: usize,
        batch: usize,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        let batch = batch.max(1);
        for _ in 0..batch {
            f()?;
        }
        let timer = EventTimer::new(device)?;
        let mut ms = Vec::with_capacity(samples.max(1));
        for _ in 0..samples.max(1) {
            timer.start()?;
            for _ in 0..batch {
                f()?;
            }
            timer.stop()?;
            ms.push(f64::from(timer.elapsed_ms()?) / batch as f64);
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[ms.len() / 2])
    }
}

impl fmt::Debug for EventTimer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventTimer").finish_non_exhaustive()
    }
}
