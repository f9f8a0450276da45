//! Support code shared by the perftest-style tools in `examples/`, the integration tests and the
//! benchmarks: command-line parsing, report tables, and the tools' engines.

pub mod cli;
pub mod devinfo;
pub mod perftest;
pub mod rc_pingpong;
pub mod report;
pub mod tool;
