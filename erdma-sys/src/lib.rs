//! FFI bindings to libibverbs, librdmacm and the erdma provider ABI, loaded at run time.
