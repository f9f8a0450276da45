//! Support code shared by the perftest-style tools in `examples/`, the integration tests and the
//! benchmarks: command-line parsing and report tables.

pub mod cli;
pub mod report;
