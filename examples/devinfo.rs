//! `ibv_devinfo -v`'s counterpart for verbs and soft devices, with the limit profile in force.
//! `-d DEV` for one device, `-l` for the names only.

fn main() -> std::process::ExitCode {
    erdma_tools::devinfo::main()
}
