//! `ibv_rc_pingpong`'s counterpart, which talks to it in either role. Run with no arguments for
//! both ends on two soft devices; `--help` lists the flags.

fn main() -> std::process::ExitCode {
    erdma_tools::rc_pingpong::main()
}
