//! Focused protocol tests.
