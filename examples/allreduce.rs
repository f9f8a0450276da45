//! A ring AllReduce over RC queue pairs in nccl-tests' columns: with no arguments, four ranks on
//! soft devices; as one rank of a job under `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`.
//! `--help` lists the flags.

fn main() -> std::process::ExitCode {
    erdma_tools::allreduce::main()
}
