//! The one error type of tessera.
//!
//! Every fallible public function in the workspace returns [`Result<T>`]. Each variant
//! names the operation that failed and says what was wrong and what was expected, so
//! the message alone is enough to fix the call.

use crate::{DType, Device};

/// `Result` with tessera's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in tessera.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor had the wrong element type for the operation.
    #[error("{op}: expected a tensor of dtype {expected}, got {got}")]
    DType {
        /// The operation that rejected the tensor.
        op: &'static str,
        /// The dtype(s) the operation accepts, e.g. `"f32, bf16 or f16"`.
        expected: String,
        /// The dtype it was given.
        got: DType,
    },

    /// A tensor lived on the wrong device for the operation.
    #[error("{op}: expected a tensor on {expected}, got one on {got}")]
    Device {
        /// The operation that rejected the tensor.
        op: &'static str,
        /// The device (or kind of device) the operation needs.
        expected: String,
        /// The device the tensor is on.
        got: Device,
    },

    /// Shapes or lengths that do not fit together.
    #[error("{op}: {msg}")]
    Shape {
        /// The operation that rejected the shape.
        op: &'static str,
        /// What was wrong and what was expected.
        msg: String,
    },

    /// An argument outside its valid range.
    #[error("{op}: {msg}")]
    InvalidArgument {
        /// The operation that rejected the argument.
        op: &'static str,
        /// What was wrong and what was expected.
        msg: String,
    },

    /// A named item (an RNG state, a kernel, ...) that does not exist.
    #[error("{what} `{name}` does not exist (known: {known})")]
    NotFound {
        /// The kind of item, e.g. `"RNG tracker state"`.
        what: &'static str,
        /// The name that was asked for.
        name: String,
        /// The names that do exist, comma-separated, or `none`.
        known: String,
    },

    /// An item that may exist only once was added twice.
    #[error("{what} `{name}` already exists{detail}")]
    Duplicate {
        /// The kind of item, e.g. `"RNG tracker seed"`.
        what: &'static str,
        /// The repeated name or value.
        name: String,
        /// Extra context, starting with a separator, or empty.
        detail: String,
    },

    /// An operation that is not valid in the current state of an object.
    #[error("{op}: {msg}")]
    State {
        /// The operation that was refused.
        op: &'static str,
        /// Why it is not allowed now.
        msg: String,
    },

    /// A [`Snapshot`](crate::Snapshot) restored into an object of another kind.
    #[error("cannot restore a snapshot of {got} into {expected}")]
    SnapshotMismatch {
        /// The kind of state that was asked to restore.
        expected: &'static str,
        /// The kind of state the snapshot was taken from.
        got: &'static str,
    },

    /// CUDA cannot be used on this machine (no driver, no device, ...).
    #[error("CUDA is unavailable: {reason}")]
    CudaUnavailable {
        /// Why, as precisely as the driver said.
        reason: String,
    },

    /// A CUDA driver call failed.
    #[error("CUDA error in {op}: {msg}")]
    Cuda {
        /// The operation that issued the failing call.
        op: &'static str,
        /// The driver's message.
        msg: String,
    },

    /// The crate was built without a feature the call needs.
    #[error("{what} needs tessera to be built with the `{feature}` feature")]
    FeatureDisabled {
        /// The operation or object that needs the feature.
        what: String,
        /// The cargo feature to enable.
        feature: &'static str,
    },

    /// A file could not be read or written.
    #[error("{op}: {msg}")]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// What could not be done, with the path and the system's message.
        msg: String,
    },

    /// A kernel module is written for a newer GPU architecture than the device's.
    #[error(
        "{module}: its kernels need a GPU of compute capability {}.{} (sm_{}{}) or newer; \
         {device} has {}.{}",
        .needs.0, .needs.1, .needs.0, .needs.1, .has.0, .has.1
    )]
    UnsupportedDevice {
        /// The kernel module (`PtxModule::name`).
        module: &'static str,
        /// The device, e.g. `"device 0 (NVIDIA A100-SXM4-80GB)"`.
        device: String,
        /// The device's compute capability, `(major, minor)`.
        has: (u32, u32),
        /// The least compute capability the module runs on.
        needs: (u32, u32),
    },

    /// A compiled kernel (PTX) does not match its CUDA source.
    #[error("stale kernel {name}: {msg}")]
    StaleKernel {
        /// The kernel file.
        name: String,
        /// What does not match.
        msg: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Self::InvalidArgument {
            op,
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::Shape`].
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Self::Shape {
            op,
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::State`].
    pub fn state(op: &'static str, msg: impl Into<String>) -> Self {
        Self::State {
            op,
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::DType`].
    pub fn dtype(op: &'static str, expected: impl Into<String>, got: DType) -> Self {
        Self::DType {
            op,
            expected: expected.into(),
            got,
        }
    }

    /// Shorthand for [`Error::Device`].
    pub fn device(op: &'static str, expected: impl Into<String>, got: Device) -> Self {
        Self::Device {
            op,
            expected: expected.into(),
            got,
        }
    }

    /// Shorthand for [`Error::NotFound`]; `known` lists the names that do exist.
    pub fn not_found<I, S>(what: &'static str, name: impl Into<String>, known: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let known: Vec<String> = known.into_iter().map(|s| s.as_ref().to_owned()).collect();
        Self::NotFound {
            what,
            name: name.into(),
            known: if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            },
        }
    }

    /// The error for a CUDA operation in a build without the `cuda` feature.
    pub fn no_cuda_feature(what: impl Into<String>) -> Self {
        Self::FeatureDisabled {
            what: what.into(),
            feature: "cuda",
        }
    }
}
