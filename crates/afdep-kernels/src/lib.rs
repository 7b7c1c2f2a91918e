//! afdep-kernels
