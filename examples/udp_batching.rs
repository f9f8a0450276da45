//! The Linux UDP batching interfaces (sendmmsg, io_uring, GSO, GRO) side by side on loopback at
//! RoCE packet sizes. `--help` lists the flags.

fn main() {
    erdma_tools::udp_batching::main()
}
