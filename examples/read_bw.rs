//! `ib_read_bw`'s counterpart: bandwidth of RDMA READ. Run with no arguments for a
//! loopback run on two soft devices; `--help` lists the flags.

fn main() -> std::process::ExitCode {
    erdma_suite::perftest::main(
        erdma_suite::perftest::Verb::Read,
        erdma_suite::perftest::Test::Bw,
    )
}
