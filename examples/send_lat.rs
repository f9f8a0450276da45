//! `ib_send_lat`'s counterpart: latency of SEND. Run with no arguments for a
//! loopback run on two soft devices; `--help` lists the flags.

fn main() -> std::process::ExitCode {
    erdma_suite::perftest::main(
        erdma_suite::perftest::Verb::Send,
        erdma_suite::perftest::Test::Lat,
    )
}
