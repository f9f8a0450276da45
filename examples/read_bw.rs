//! `ib_read_bw`'s counterpart: bandwidth of RDMA READ. Run with no arguments for a
//! loopback run on two soft devices; `--help` lists the flags.

fn main() -> std::process::ExitCode {
    erdma_tools::perftest::main(
        erdma_tools::perftest::Verb::Read,
        erdma_tools::perftest::Test::Bw,
    )
}
