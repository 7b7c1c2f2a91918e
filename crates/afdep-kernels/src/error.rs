//! Typed errors of afdep-kernels.

use std::path::PathBuf;

use afdep_core::RouteError;
use cudarc::driver::DriverError;

/// Everything that can go wrong in afdep-kernels.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// No usable NVIDIA driver: `libcuda` cannot be loaded, the driver cannot be initialised,
    /// or it sees no device. GPU tests skip on this error (and only on this one).
    #[error("no usable NVIDIA driver: {why}")]
    NoDriver {
        /// What was tried and what failed.
        why: String,
    },
    /// NVRTC (`libnvrtc.so`) cannot be loaded.
    #[error("NVRTC is not available: {why}")]
    NoNvrtc {
        /// What was tried and what failed.
        why: String,
    },
    /// No directory with the CUDA headers (`cuda_bf16.h`) was found.
    #[error(
        "CUDA headers not found (looked for cuda_bf16.h in: {}); set AFDEP_CUDA_INCLUDE to the \
         include directory (e.g. /usr/local/cuda/include or the nvidia-cuda-runtime wheel's \
         nvidia/cu13/include)",
        searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    NoHeaders {
        /// The directories searched.
        searched: Vec<PathBuf>,
    },
    /// NVRTC rejected a module; the log holds its diagnostics.
    #[error("NVRTC failed to compile {module} ({result}) with options {options:?}:\n{log}")]
    Compile {
        /// The module (source file and specialisation), e.g. `router E=64 K=8`.
        module: String,
        /// The kernels the module defines.
        kernels: Vec<String>,
        /// NVRTC's result code.
        result: String,
        /// The options passed to NVRTC.
        options: Vec<String>,
        /// The program log.
        log: String,
    },
    /// An NVRTC call other than the compilation failed.
    #[error("NVRTC {call} failed: {result}")]
    Nvrtc {
        /// The NVRTC function.
        call: &'static str,
        /// Its result code.
        result: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {what}: {source}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// A specialisation or argument outside what the kernels support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Buffers whose sizes do not fit the shape.
    #[error("bad shape: {0}")]
    Shape(String),
    /// The routes were rejected (device-side validation decoded from the error word).
    #[error(transparent)]
    Route(#[from] RouteError),
    /// The device wrote an error word that does not decode.
    #[error("the device wrote an unknown route error word {0:?}")]
    BadErrorWord([u32; afdep_core::error::ROUTE_ERROR_WORDS]),
    /// A kernel's bounded device wait ran out (the context's fault word, see
    /// [`GpuContext::take_fault`](crate::GpuContext::take_fault)); the outputs of the work
    /// queued since the last check are void.
    #[error(
        "device fault: {what} (block {block}, step {step}); outputs since the last check are void"
    )]
    DeviceFault {
        /// What timed out, e.g. `a GEMM's TMA stage wait`.
        what: String,
        /// The block that recorded it (`blockIdx.x`).
        block: u32,
        /// The kernel's step at the time (the GEMM's k-tile).
        step: u32,
    },
    /// A TMA tensor map could not be encoded (`cuTensorMapEncodeTiled`).
    #[error("encoding the tensor map of {what}: {result}")]
    TensorMap {
        /// The operand.
        what: String,
        /// The driver's result code.
        result: String,
    },
}

impl KernelError {
    /// Wraps a driver error with what was being done.
    pub fn driver(what: impl Into<String>) -> impl FnOnce(DriverError) -> KernelError {
        let what = what.into();
        move |source| KernelError::Driver { what, source }
    }

    /// The rejected route, when this is one.
    pub fn route(&self) -> Option<&RouteError> {
        match self {
            KernelError::Route(e) => Some(e),
            _ => None,
        }
    }

    /// Whether this is [`KernelError::NoDriver`].
    pub fn is_no_driver(&self) -> bool {
        matches!(self, KernelError::NoDriver { .. })
    }
}
