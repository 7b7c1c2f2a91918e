//! The AFD exchange reference.
