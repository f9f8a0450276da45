//! Support code shared by the perftest-style tools in `examples/`, the integration tests and the
//! benchmarks: command-line parsing, report tables and process launching.
