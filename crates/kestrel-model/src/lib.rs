//! Placeholder until this crate's work lands.
