//! `ib_send_lat`'s counterpart: latency of SEND. Run with no arguments for a
//! loopback run on two soft devices; `--help` lists the flags.

fn main() -> std::process::ExitCode {
    erdma_tools::perftest::main(
        erdma_tools::perftest::Verb::Send,
        erdma_tools::perftest::Test::Lat,
    )
}
