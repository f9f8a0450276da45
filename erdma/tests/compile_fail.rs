//! The programs in `tests/ui/` must not compile: each one tries to free, move or mutate memory
//! that a posted work request may still touch, or to send on a queue pair that is not ready.
//! Their expected compiler errors are in the `.stderr` files beside them.

#[test]
fn buffer_safety_is_enforced_at_compile_time() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}

/// The misuses the owned-buffer API (`AsyncQp`, `OwnedBuf`, `RecvPool`) rules out.
#[cfg(feature = "tokio")]
#[test]
fn owned_buffers_cannot_be_touched_in_flight() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui-async/*.rs");
}
