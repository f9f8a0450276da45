//! Link options of the plugin library.
//!
//! `-z nodelete`: NCCL unloads a plugin (`dlclose`) when its last communicator is finalised, and
//! may load it again later. The soft device's engine threads and the SDK's process-wide state
//! (the `atexit` flush, thread-locals) must never outlive the library's code, so the library
//! stays mapped once loaded. The soname is the file name NCCL looks for.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl-net-erdma.so");
    println!("cargo:rerun-if-changed=build.rs");
}
