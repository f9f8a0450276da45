//! `ib_write_lat`'s counterpart: latency of RDMA WRITE. Run with no arguments for a
//! loopback run on two soft devices; `--help` lists the flags.

fn main() -> std::process::ExitCode {
    erdma_tools::perftest::main(
        erdma_tools::perftest::Verb::Write,
        erdma_tools::perftest::Test::Lat,
    )
}
