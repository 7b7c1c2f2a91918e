//! afdep-transport
