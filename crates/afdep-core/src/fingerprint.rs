//! Config fingerprint.
