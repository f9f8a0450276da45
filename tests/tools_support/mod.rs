//! What the tool tests share: building the tools, running them with a time limit, the
//! devices they use, a tool as a server on a port of the system's choosing.

#![allow(dead_code)] // each test file uses its own share

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub const TOOLS: [&str; 8] = [
    "write_bw",
    "write_lat",
    "send_bw",
    "send_lat",
    "read_bw",
    "read_lat",
    "rc_pingpong",
    "devinfo",
];

pub fn tool_path(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        let mut args = vec!["build", "--release", "--quiet", "--example", "allreduce"];
        args.extend(["--example", "cq_modes"]);
        for t in TOOLS {
            args.extend(["--example", t]);
        }
        let st = Command::new(env!("CARGO"))
            .args(&args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("running cargo");
        assert!(st.success(), "building the tools failed");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
        target.join("release").join("examples")
    });
    dir.join(name)
}

/// The soft device binds UDP port 4791 of its address, so the tests here take turns, and those that
/// name devices use addresses of their own (127.0.3.x) rather than the defaults.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub const DEV_A: &str = "soft:127.0.3.1";
pub const DEV_B: &str = "soft:127.0.3.2";

/// Runs a tool with no arguments (default soft devices 127.0.0.1 and .2), retrying while another
/// process on this machine holds those addresses' RoCE port.
pub fn run_default(name: &str, args: &[&str], limit: Duration) -> Output {
    let mut tries = 0;
    loop {
        let out = run(name, args, limit);
        tries += 1;
        if tries < 20 && text(&out.stderr).contains("Address already in use") {
            std::thread::sleep(Duration::from_millis(500));
            continue;
        }
        return out;
    }
}

pub fn spawn(name: &str, args: &[&str]) -> Child {
    Command::new(tool_path(name))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"))
}

/// Waits for a child, killing it (and failing) after `limit`.
pub fn finish(name: &str, mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("waiting").is_some() {
            return child.wait_with_output().expect("collecting output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collecting output");
            panic!(
                "{name} did not finish within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn run(name: &str, args: &[&str], limit: Duration) -> Output {
    finish(name, spawn(name, args), limit)
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A port nobody listens on: one the system picked and released.
pub fn unused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A tool running as a server on a port the system picked (`-p 0`).
pub struct Server {
    name: &'static str,
    child: Child,
    /// The port it printed.
    pub port: String,
    /// Its whole standard error, once it exits.
    stderr: std::thread::JoinHandle<String>,
}

/// Starts `name` as a server with `-p 0` and waits for the line that names its port; the server
/// listens from then on.
pub fn serve(name: &'static str, args: &[&str]) -> Server {
    let mut child = spawn(name, &[args, &["-p", "0"]].concat());
    let err = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if let Some((_, p)) = line.rsplit_once("waiting for a client on TCP port ") {
                let _ = tx.send(p.trim().to_string());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(port) => Server {
            name,
            child,
            port,
            stderr,
        },
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            let err = stderr.join().unwrap_or_default();
            panic!("{name} printed no port to listen on:\n{err}");
        }
    }
}

impl Server {
    /// Waits for the server as [`finish`] does, its standard error included.
    pub fn finish(self, limit: Duration) -> Output {
        let mut out = finish(self.name, self.child, limit);
        out.stderr = self.stderr.join().expect("stderr reader").into_bytes();
        out
    }
}
