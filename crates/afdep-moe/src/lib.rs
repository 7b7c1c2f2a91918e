//! afdep-moe
