//! The async examples run as a user runs them: alone, each starts its other end as a second
//! process on soft devices, checks every byte it moves, and exits 0 within a bounded time.
//!
//! `cargo test` builds the examples beside this test (`target/<profile>/examples/`).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --example {name}`",
        path.display()
    );
    path
}

/// Runs an example alone (both ends), failing on a non-zero exit or after `limit`.
fn run(name: &str, expect: &str, limit: Duration) {
    let mut child = Command::new(example(name))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(expect),
        "{name}: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

// The examples use the default soft devices 127.0.0.1 and .2: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn async_echo_echoes_every_message() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run("async_echo", "200 echoes", Duration::from_secs(120));
}

#[test]
fn async_rdma_reads_and_writes_a_granted_region() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(
        "async_rdma",
        "the client's WRITE landed",
        Duration::from_secs(120),
    );
}

#[test]
fn async_recv_pool_takes_every_message_in_place() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(
        "async_recv_pool",
        "received 1000 messages",
        Duration::from_secs(120),
    );
}

#[test]
fn async_peer_death_fails_the_waiting_receives_within_the_bound() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The example itself fails (non-zero) when the flush comes late, does not name the lost
    // peer, or an answer arrives.
    run(
        "async_peer_death",
        "peer death noticed within",
        Duration::from_secs(120),
    );
}
