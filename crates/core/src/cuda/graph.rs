use std::fmt;

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::{CudaDevice, CudaResultExt};
use crate::{Error, Result};

/// An instantiated CUDA graph captured from a device's tessera stream.
pub struct Graph {
    graph: CudaGraph,
}

impl Graph {
    /// Captures the work `record` queues on `device`'s stream into a graph, without
    /// running it.
    ///
    /// Capture uses thread-local mode: other threads may keep using CUDA meanwhile.
    /// When `record` fails, capture is ended, the partial graph is dropped and the
    /// error returned.
    pub fn capture(device: &CudaDevice, record: impl FnOnce() -> Result<()>) -> Result<Graph> {
        let stream = device.stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .cuda_op("cuStreamBeginCapture")?;
        let recorded = record();
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        recorded?;
        let graph = ended.cuda_op("cuStreamEndCapture")?;
        graph
            .map(|graph| Graph { graph })
            .ok_or_else(|| Error::state("Graph::capture", "the captured region queued no work"))
    }

    /// Queues one replay of the graph on the stream it was captured from.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().cuda_op("cuGraphLaunch")
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph").finish_non_exhaustive()
    }
}
