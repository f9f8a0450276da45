//! Latency, message rate and idle CPU of each completion mode (busy-poll, hybrid, event,
//! async), on two soft devices by default. `--help` lists the flags.

fn main() {
    erdma_tools::cq_modes::main()
}
