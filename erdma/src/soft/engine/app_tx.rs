//! An application thread's transmit state: the batch its posts fill, sent when the call
//! returns, or when the outermost [`coalesce_sends`] does.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use super::memory::DevMemory;
use super::{Engine, TxState};

/// An application thread's transmit state.
struct AppTx {
    tx: TxState,
    /// The device whose packets `tx.batch` holds back while the thread coalesces sends
    /// ([`coalesce_sends`]); `None` when the batch is empty.
    deferred: Option<Arc<Engine>>,
}

impl AppTx {
    /// See [`TxState::discard_stale_lent`]; a batch discarded had nothing left to defer.
    fn discard_stale_lent(&mut self) {
        if self.tx.discard_stale_lent() {
            self.deferred = None;
        }
    }
}

thread_local! {
    static APP_TX: RefCell<Option<AppTx>> = const { RefCell::new(None) };
    /// Nesting depth of [`coalesce_sends`] on this thread.
    pub(super) static COALESCING: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f`; packets that application calls inside it make sendable on a soft device wait and
/// leave together when the outermost call returns (or unwinds), or earlier when the thread's
/// batch fills up or a call on another soft device needs it. Packets of different queue pairs
/// to one peer then share GSO messages (see [`TxBatch`]).
pub(crate) fn coalesce_sends<R>(f: impl FnOnce() -> R) -> R {
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            let depth = COALESCING.with(|d| {
                d.set(d.get() - 1);
                d.get()
            });
            if depth == 0 {
                send_deferred();
            }
        }
    }
    COALESCING.with(|d| d.set(d.get() + 1));
    let _depth = Depth;
    f()
}

/// Whether this thread's transmit batch is destroyed (the thread is exiting).
#[cfg(test)]
pub(crate) fn app_tx_gone() -> bool {
    APP_TX.try_with(|_| ()).is_err()
}

/// Sends what this thread's batch holds back, then what the device's receive rounds held.
fn send_deferred() {
    // With this thread's locals gone, the calls sent their own batches (`with_app_tx`).
    let engine = APP_TX.try_with(|cell| {
        let mut slot = cell.borrow_mut();
        let app = slot.as_mut()?;
        app.discard_stale_lent();
        let engine = app.deferred.take()?;
        engine.flush_app(0, &mut app.tx.batch);
        engine.release(&mut app.tx);
        Some(engine)
    });
    let engine = engine.ok().flatten();
    if let Some(engine) = engine {
        engine.flush_held();
    }
}

impl Engine {
    /// Runs `f` with the region table read-locked and this thread's transmit batch, then sends
    /// what was queued (unless the thread coalesces sends: then it stays queued). For
    /// application threads working on a queue pair of lane `lane`.
    pub(super) fn with_app_tx<R>(
        self: &Arc<Engine>,
        lane: usize,
        f: impl FnOnce(&mut DevMemory<'_>, &mut TxState) -> R,
    ) -> R {
        let fresh = || AppTx {
            tx: TxState::new(self.io.gso()),
            deferred: None,
        };
        let mut f = Some(f);
        let mut run = |app: &mut AppTx| {
            app.discard_stale_lent();
            // The batch is this device's from here on: another device's packets go first.
            if let Some(other) = app.deferred.take_if(|c| !Arc::ptr_eq(c, self)) {
                other.flush(0, &mut app.tx.batch);
                other.release(&mut app.tx);
            }
            let tx = &mut app.tx;
            let before = tx.batch.sent();
            let out = self.with_memory(|mem| {
                let f = f.take().expect("run once");
                let out = f(mem, tx);
                // What stays queued (the thread coalesces sends) outlives the table lock.
                tx.batch.own_lent();
                out
            });
            // Also when a full batch went out midway and nothing followed: the queue pairs it
            // took stay owned until `send_deferred` releases them.
            if !tx.batch.is_empty() || !tx.owned.is_empty() {
                app.deferred = Some(self.clone());
            }
            (out, app.tx.batch.sent() != before)
        };
        let (out, sent) =
            match APP_TX.try_with(|cell| run(cell.borrow_mut().get_or_insert_with(fresh))) {
                Ok(r) => r,
                // This thread's locals are gone (a call from a thread-local destructor, or from an
                // exit handler: glibc destroys the main thread's before it runs those): a batch of
                // the call's own, sent before it returns.
                Err(_) => {
                    let mut app = fresh();
                    let (out, sent) = run(&mut app);
                    if let Some(engine) = app.deferred.take() {
                        engine.flush_app(0, &mut app.tx.batch);
                        engine.release(&mut app.tx);
                    }
                    (out, sent || app.tx.batch.sent() != 0)
                }
            };
        // The answers the last receive round held back leave after this thread's own packets,
        // off the path of the request the peer is waiting for. A call that sent nothing (a
        // receive re-posted before the reply is sent) leaves them held for the next call.
        if sent {
            self.flush_held_lane(lane);
        }
        out
    }
}
