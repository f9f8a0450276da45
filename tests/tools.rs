//! The tools in `examples/` as a user runs them, on soft devices: each with no arguments prints a
//! sane table; server and client as two processes; bad flags and mismatched or stopped clients
//! end in a clear error and a non-zero exit within a bounded time (bad devices, settings and
//! peers: `tools_bad_input.rs`).
//!
//! The tools are built in release mode on first use (they are measurement tools; the soft device
//! in a debug build is too slow for their default runs).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod tools_support;
use tools_support::*;

/// The numeric rows under a table header containing `#bytes`.
fn table_rows(stdout: &str) -> Vec<Vec<f64>> {
    let mut rows = Vec::new();
    let mut in_table = false;
    for line in stdout.lines() {
        if line.contains("#bytes") {
            in_table = true;
            continue;
        }
        if !in_table {
            continue;
        }
        let nums: Option<Vec<f64>> = line.split_whitespace().map(|w| w.parse().ok()).collect();
        match nums {
            Some(n) if !n.is_empty() => rows.push(n),
            _ => in_table = false,
        }
    }
    rows
}

fn check_bw_row(tool: &str, row: &[f64], size: f64) {
    assert_eq!(row.len(), 5, "{tool}: {row:?}");
    assert_eq!(row[0], size, "{tool}: size column");
    assert!(row[1] > 0.0, "{tool}: iterations");
    // Tiny messages round to 0.00 in the table's two decimals, as perftest's do.
    assert!(
        (row[3] > 0.0 || size < 4096.0) && row[2] >= row[3] * 0.999,
        "{tool}: peak/avg {row:?}"
    );
    assert!(row[4] > 0.0, "{tool}: message rate");
}

fn check_lat_row(tool: &str, row: &[f64], size: f64) {
    assert_eq!(row.len(), 9, "{tool}: {row:?}");
    assert_eq!(row[0], size, "{tool}: size column");
    assert!(row[1] > 0.0);
    let (min, max, typ, avg) = (row[2], row[3], row[4], row[5]);
    assert!(
        min > 0.0 && min <= typ && typ <= max && min <= avg && avg <= max,
        "{tool}: {row:?}"
    );
    assert!(
        row[7] <= row[8] && row[8] <= max,
        "{tool}: percentiles {row:?}"
    );
}

#[test]
fn every_perftest_tool_runs_with_no_arguments() {
    let _serial = serial();
    for tool in ["write_bw", "send_bw", "read_bw"] {
        let out = run_default(tool, &[], Duration::from_secs(180));
        let so = text(&out.stdout);
        assert!(out.status.success(), "{tool}: {}\n{so}", text(&out.stderr));
        let rows = table_rows(&so);
        assert_eq!(rows.len(), 1, "{tool}:\n{so}");
        check_bw_row(tool, &rows[0], 65536.0);
        assert_eq!(rows[0][1], 5000.0, "{tool}: perftest's default iterations");
    }
    for tool in ["write_lat", "send_lat", "read_lat"] {
        let out = run_default(tool, &[], Duration::from_secs(180));
        let so = text(&out.stdout);
        assert!(out.status.success(), "{tool}: {}\n{so}", text(&out.stderr));
        let rows = table_rows(&so);
        assert_eq!(rows.len(), 1, "{tool}:\n{so}");
        check_lat_row(tool, &rows[0], 2.0);
        assert_eq!(rows[0][1], 1000.0, "{tool}: perftest's default iterations");
    }
}

#[test]
fn sweeps_queue_pairs_and_both_formats() {
    let _serial = serial();
    let out = run(
        "write_bw",
        &[
            "--loopback",
            "-d",
            DEV_A,
            "--peer-dev",
            DEV_B,
            "-a",
            "-n",
            "20",
            "--report_gbits",
            "-q",
            "2",
        ],
        Duration::from_secs(240),
    );
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}\n{so}", text(&out.stderr));
    assert!(so.contains("Gb/sec"));
    let rows = table_rows(&so);
    assert_eq!(rows.len(), 23, "{so}");
    for (i, r) in rows.iter().enumerate() {
        check_bw_row("write_bw -a", r, (2u64 << i) as f64);
        assert_eq!(r[1], 40.0, "20 iterations on each of 2 queue pairs");
    }
    assert!(text(&out.stderr).contains("size 8388608 (23/23)"));
    for tool in ["send_lat", "read_bw", "write_lat"] {
        let out = run(
            tool,
            &[
                "--loopback",
                "-d",
                DEV_A,
                "--peer-dev",
                DEV_B,
                "--oob",
                "erdma",
                "-s",
                "5000",
                "-n",
                "50",
            ],
            Duration::from_secs(120),
        );
        let so = text(&out.stdout);
        assert!(out.status.success(), "{tool}: {}\n{so}", text(&out.stderr));
        assert!(so.contains("Ethernet (erdma)"), "{so}");
        assert_eq!(table_rows(&so).len(), 1, "{so}");
    }
    // perftest's WRITE loop on the soft device (each side waits for its WRITE's completion,
    // then watches memory alone): every one of 500 rounds trips, none stalls.
    let out = run(
        "write_lat",
        &[
            "--loopback",
            "-d",
            DEV_A,
            "--peer-dev",
            DEV_B,
            "--perftest-loop",
            "-n",
            "500",
        ],
        Duration::from_secs(120),
    );
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}\n{so}", text(&out.stderr));
    let rows = table_rows(&so);
    assert_eq!(rows.len(), 1, "{so}");
    check_lat_row("write_lat --perftest-loop", &rows[0], 2.0);
    assert_eq!(rows[0][1], 500.0, "{so}");
    // A duration run, both sides following the client's clock.
    let t0 = Instant::now();
    let out = run(
        "send_lat",
        &["--loopback", "-d", DEV_A, "--peer-dev", DEV_B, "-D", "1"],
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(t0.elapsed() >= Duration::from_secs(1));
    assert_eq!(table_rows(&text(&out.stdout)).len(), 1);
}

#[test]
fn rc_pingpong_and_devinfo_with_no_arguments() {
    let _serial = serial();
    let out = run_default("rc_pingpong", &[], Duration::from_secs(120));
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}\n{so}", text(&out.stderr));
    // Both ends print ibv_rc_pingpong's two lines: 1000 x 4096 bytes each way.
    assert_eq!(so.matches("8192000 bytes in ").count(), 2, "{so}");
    assert_eq!(so.matches("1000 iters in ").count(), 2, "{so}");

    let out = run("devinfo", &["-l"], Duration::from_secs(30));
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("soft:127.0.0.1"));
    let out = run("devinfo", &["-d", DEV_A], Duration::from_secs(30));
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for want in [
        "hca_id:\tsoft:127.0.3.1",
        "PORT_ACTIVE",
        "limit profile:\t\teRDMA",
        "max_inline_data",
        "127.0.3.1, RoCE v2",
    ] {
        assert!(so.contains(want), "missing {want:?}:\n{so}");
    }
    assert!(!so.contains("counters:"), "counters only when asked:\n{so}");
    let out = run("devinfo", &["-d", DEV_A, "-c"], Duration::from_secs(30));
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for want in [
        "\tport 1 counters:\n",
        "sent_pkts:",
        "completer_retry_err:",
        "drop_bad_icrc:",
    ] {
        assert!(so.contains(want), "missing {want:?}:\n{so}");
    }
    // Watching events: nothing happens to an idle soft device, and the watch ends on time.
    let started = std::time::Instant::now();
    let out = run(
        "devinfo",
        &["-d", DEV_A, "-w", "1"],
        Duration::from_secs(30),
    );
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(so.contains("watching asynchronous events for 1 s"), "{so}");
    assert!(!so.contains("event:"), "{so}");
    assert!(started.elapsed() >= Duration::from_secs(1));
}

#[test]
fn server_and_client_as_two_processes() {
    let _serial = serial();
    for (tool, extra) in [
        ("write_bw", &["-n", "300"][..]),
        ("send_lat", &["-n", "300", "--oob", "erdma"][..]),
        ("read_lat", &["-n", "300"][..]),
        ("send_bw", &["-n", "300", "-q", "2"][..]),
    ] {
        let mut sargs = vec!["-d", DEV_B];
        sargs.extend_from_slice(extra);
        let server = serve(tool, &sargs);
        let port = server.port.clone();
        let mut cargs = vec!["-d", DEV_A, "-p", &port];
        cargs.extend_from_slice(extra);
        cargs.push("127.0.0.1");
        let client = run(tool, &cargs, Duration::from_secs(120));
        let server = server.finish(Duration::from_secs(60));
        let (co, so) = (text(&client.stdout), text(&server.stdout));
        assert!(
            client.status.success(),
            "{tool} client: {}",
            text(&client.stderr)
        );
        assert!(
            server.status.success(),
            "{tool} server: {}",
            text(&server.stderr)
        );
        let rows = table_rows(&co);
        assert_eq!(rows.len(), 1, "{tool} client:\n{co}");
        if tool.ends_with("_bw") {
            check_bw_row(tool, &rows[0], 65536.0);
            // The server prints the client's report, as perftest's does.
            let srows = table_rows(&so);
            assert_eq!(srows.len(), 1, "{tool} server:\n{so}");
            assert_eq!(srows[0][0], 65536.0);
            assert_eq!(srows[0][1], rows[0][1]);
        } else {
            check_lat_row(tool, &rows[0], 2.0);
        }
    }

    let server = serve("rc_pingpong", &["-d", DEV_B, "-n", "200"]);
    let client = run(
        "rc_pingpong",
        &["-d", DEV_A, "-p", &server.port, "-n", "200", "127.0.0.1"],
        Duration::from_secs(60),
    );
    let server = server.finish(Duration::from_secs(30));
    assert!(client.status.success(), "{}", text(&client.stderr));
    assert!(server.status.success(), "{}", text(&server.stderr));
    for o in [&client, &server] {
        assert!(
            text(&o.stdout).contains("200 iters in "),
            "{}",
            text(&o.stdout)
        );
    }
}

#[test]
fn bad_flags_are_exit_code_2_and_help_lists_flags() {
    let _serial = serial();
    for tool in TOOLS {
        let out = run(tool, &["--no-such-flag"], Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(2), "{tool}");
        assert!(text(&out.stderr).contains("--no-such-flag"), "{tool}");
        let out = run(tool, &["--help"], Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(0), "{tool}");
        let help = text(&out.stdout);
        assert!(
            help.contains("--ib-dev <dev>") && help.contains("--help"),
            "{tool}: {help}"
        );
    }
    for (tool, args, names) in [
        ("write_bw", &["-s", "lots"][..], "--size"),
        ("send_lat", &["-q", "2"][..], "--qp"),
        ("read_bw", &["-m", "1500"][..], "--mtu"),
        ("write_lat", &["--oob", "json"][..], "--oob"),
        ("rc_pingpong", &["-n", "0"][..], "--iters"),
        ("rc_pingpong", &["a", "b"][..], "`b`"),
        ("devinfo", &["-i", "x"][..], "--ib-port"),
        ("devinfo", &["-w", "604801"][..], "--watch"),
        ("devinfo", &["--watch", "-1"][..], "--watch"),
        // Port 0 lets a server pick one; a client has nothing to dial.
        (
            "send_bw",
            &["-p", "0", "127.0.0.1"][..],
            "0 only lets a server",
        ),
        (
            "rc_pingpong",
            &["-p", "0", "127.0.0.1"][..],
            "0 only lets a server",
        ),
        // Counts that would wrap a sum or ask for terabytes of samples.
        (
            "cq_modes",
            &["--warmup", "18446744073709551615"][..],
            "--warmup",
        ),
        ("cq_modes", &["-n", "1000000000000"][..], "--iters"),
        // The server side's device means something only where this process runs both sides.
        (
            "write_bw",
            &["--peer-dev", "soft:127.0.0.2"][..],
            "--peer-dev",
        ),
        (
            "rc_pingpong",
            &["--peer-dev", "soft:127.0.0.2"][..],
            "--peer-dev",
        ),
    ] {
        let out = run(tool, args, Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(2), "{tool} {args:?}");
        assert!(
            text(&out.stderr).contains(names),
            "{tool} {args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// A server and a client that disagree fail, and the server says why: a SEND bandwidth server
/// facing a WRITE client (no SEND ever arrives), sizes that differ, and (in the project's own
/// format, which carries them) queue-pair counts that differ. A client that stops
/// mid-run leaves the server to fail once no traffic has come for 10 s, with no fixed deadline
/// on a run that goes on.
#[test]
fn mismatched_or_stopped_clients_fail_the_server_with_a_reason() {
    let _serial = serial();
    for (tool, sargs, cargs, why) in [
        (
            "send_bw",
            &["-n", "200"][..],
            ("write_bw", &["-n", "200"][..]),
            "without a single SEND",
        ),
        (
            "write_bw",
            &["-n", "200", "-s", "4096"][..],
            ("write_bw", &["-n", "200", "-s", "1024"][..]),
            "measured 1024 B messages; this server was started for 4096 B",
        ),
        // The project's own format carries the flags both ends must share.
        (
            "send_bw",
            &["-n", "200", "-q", "1", "--oob", "erdma"][..],
            ("send_bw", &["-n", "200", "-q", "4", "--oob", "erdma"][..]),
            "the peer runs with -q 4, this side with -q 1",
        ),
    ] {
        let server = serve(tool, &[&["-d", DEV_B][..], sargs].concat());
        let port = server.port.clone();
        let (ctool, cextra) = cargs;
        let client_args = [&["-d", DEV_A, "-p", &port][..], cextra, &["127.0.0.1"]].concat();
        let _ = run(ctool, &client_args, Duration::from_secs(60));
        let out = server.finish(Duration::from_secs(60));
        assert_eq!(out.status.code(), Some(1), "{tool}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains(why),
            "{tool}: {}",
            text(&out.stderr)
        );
    }
    for tool in ["send_bw", "write_bw"] {
        let server = serve(tool, &["-d", DEV_B]);
        let client = spawn(
            tool,
            &["-d", DEV_A, "-p", &server.port, "-D", "120", "127.0.0.1"],
        );
        std::thread::sleep(Duration::from_secs(2));
        // SAFETY: kill only sends a signal to the child this test started.
        unsafe { libc::kill(client.id() as libc::pid_t, libc::SIGSTOP) };
        let out = server.finish(Duration::from_secs(60));
        // SAFETY: as above.
        unsafe { libc::kill(client.id() as libc::pid_t, libc::SIGKILL) };
        let _ = finish(tool, client, Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(1), "{tool}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("no traffic for 10 s"),
            "{tool}: {}",
            text(&out.stderr)
        );
    }
}

/// The rows of an allreduce table: the lines of eight columns that are not comments.
fn allreduce_rows(stdout: &str) -> Vec<Vec<&str>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().collect())
        .filter(|c: &Vec<&str>| c.len() == 8)
        .collect()
}

/// The AllReduce tool with no arguments: four ranks on soft devices 127.0.0.1-4, the sweep of
/// nccl-tests' defaults here (1 KiB to 16 MiB by 4), every iteration checked; its bad flags;
/// and the ring's defaults as its help states them, which must be `RingConfig::default()`'s.
#[test]
fn allreduce_with_no_arguments_bad_flags_and_help() {
    let _serial = serial();
    let out = run_default("allreduce", &[], Duration::from_secs(240));
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}\n{so}", text(&out.stderr));
    let rows = allreduce_rows(&so);
    let sizes: Vec<&str> = rows.iter().map(|c| c[0]).collect();
    assert_eq!(
        sizes,
        [
            "1024", "4096", "16384", "65536", "262144", "1048576", "4194304", "16777216"
        ],
        "{so}"
    );
    for c in &rows {
        assert_eq!((c[2], c[3], c[7]), ("float", "sum", "0"), "{c:?}");
        let bytes: f64 = c[0].parse().unwrap();
        assert_eq!(c[1].parse::<f64>().unwrap(), bytes / 4.0, "{c:?}");
        let busbw: f64 = c[6].parse().unwrap();
        let algbw: f64 = c[5].parse().unwrap();
        // busbw = algbw × 2(n−1)/n with n = 4, both printed to two decimals.
        assert!((busbw - algbw * 1.5).abs() <= 0.02, "{c:?}");
    }
    assert!(so.contains("# Wrong elements : 0 OK"), "{so}");
    for r in 0..4 {
        assert!(
            so.contains(&format!(
                "#  Rank {r:2} device soft:127.0.0.{}, host: 4 ranks of the ring on ",
                r + 1
            )),
            "{so}"
        );
    }

    for (args, names) in [
        (&["--no-such-flag"][..], "--no-such-flag"),
        (&["-d", "float64"][..], "--dtype"),
        (&["-o", "min"][..], "--op"),
        (&["-b", "2M", "-e", "1M"][..], "--minbytes"),
        (&["--ranks", "0"][..], "--ranks"),
        (&["-c", "2"][..], "--check"),
        (&["--gpu-device", "1"][..], "--gpu"),
        (&["--timeout", "0"][..], "--timeout"),
        (&["--timeout", "18446744073709551615"][..], "--timeout"),
        (&["--soft-base", "255.255.255.254"][..], "--soft-base"),
    ] {
        let out = run("allreduce", args, Duration::from_secs(20));
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(names),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }

    // A size below one element runs one element, in a buffer that holds it.
    let args: Vec<&str> = "--ranks 2 --soft-base 127.0.3.21 -b 1 -e 3 -n 2"
        .split(' ')
        .collect();
    let out = run("allreduce", &args, Duration::from_secs(60));
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}\n{so}", text(&out.stderr));
    let rows = allreduce_rows(&so);
    assert_eq!(rows.len(), 1, "{so}");
    assert_eq!(
        (rows[0][0], rows[0][1], rows[0][7]),
        ("4", "1", "0"),
        "{so}"
    );

    let out = run("allreduce", &["--help"], Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    let d = erdma::collective::RingConfig::default();
    let default_of = |flag: &str| -> u64 {
        let line = help
            .lines()
            .find(|l| l.contains(&format!("{flag} <")))
            .unwrap_or_else(|| panic!("no {flag} in the help:\n{help}"));
        let v = line
            .rsplit_once("(default ")
            .and_then(|(_, v)| v.strip_suffix(')'))
            .unwrap_or_else(|| panic!("no default on {line:?}"));
        v.parse()
            .ok()
            .or_else(|| erdma_tools::cli::parse_size(v))
            .unwrap_or_else(|| panic!("{flag}: default {v:?} is not a number"))
    };
    for (flag, want) in [
        ("--qps-per-connection", d.qps_per_connection as u64),
        ("--chunk", d.chunk_bytes as u64),
        ("--slots", d.slots as u64),
        ("--min-chunk", d.min_chunk_bytes as u64),
        ("--window", d.window_bytes as u64),
        ("--timeout", d.timeout.as_secs()),
        ("--spin-us", d.spin.as_micros() as u64),
        ("--spin-max", d.spin_max_bytes as u64),
    ] {
        assert_eq!(
            default_of(flag),
            want,
            "{flag}: the help and RingConfig disagree"
        );
    }
}

/// A control group of its own for a test's processes, held to one CPU of quota; removed on drop.
struct QuotaGroup(PathBuf);

impl QuotaGroup {
    /// A child of the `cpu` controller's root (cgroup v1, or v2 with the controller enabled
    /// below its root) allowed 100 ms of CPU time per 100 ms; `None` where this process may not
    /// make one.
    fn one_cpu() -> Option<QuotaGroup> {
        let name = format!("erdma-test-{}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        let v2 = Path::new("/sys/fs/cgroup");
        let (dir, file, value) = if v1.join("cpu.cfs_quota_us").exists() {
            (v1.join(&name), "cpu.cfs_quota_us", "100000")
        } else if std::fs::read_to_string(v2.join("cgroup.subtree_control"))
            .is_ok_and(|s| s.split_whitespace().any(|c| c == "cpu"))
        {
            (v2.join(&name), "cpu.max", "100000 100000")
        } else {
            return None;
        };
        std::fs::create_dir(&dir).ok()?;
        let group = QuotaGroup(dir);
        std::fs::write(group.0.join(file), value).ok()?;
        Some(group)
    }
}

impl Drop for QuotaGroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A CPU quota (a control group's, as `docker --cpus 1` or a Kubernetes limit sets) bounds CPU
/// time, not how many threads run at once: ranks held to one CPU of quota count the CPUs they
/// may run on, as without it, and keep their policy (bench/results/log.md, section "Ranks held to
/// a CPU quota": counting the quota made the ring 0.68-0.85x as fast).
#[test]
fn allreduce_ignores_a_cpu_quota() {
    let _serial = serial();
    let Some(group) = QuotaGroup::one_cpu() else {
        eprintln!("skipped: no CPU control group can be made here (needs root and cgroupfs)");
        return;
    };
    let tool = tool_path("allreduce");
    let hosts = |join: &str| {
        let script = format!(
            "{join}exec '{}' --ranks 4 --soft-base 127.0.3.11 -b 4K -e 4K -n 2 -w 0",
            tool.display()
        );
        let child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting sh");
        let out = finish("allreduce", child, Duration::from_secs(120));
        let so = text(&out.stdout);
        assert!(out.status.success(), "{}\n{so}", text(&out.stderr));
        assert!(so.contains("# Wrong elements : 0 OK"), "{so}");
        let lines: Vec<String> = so
            .lines()
            .filter(|l| l.starts_with("#  Rank "))
            .map(str::to_string)
            .collect();
        assert_eq!(lines.len(), 4, "{so}");
        assert!(
            lines
                .iter()
                .all(|l| l.contains(", host: 4 ranks of the ring on ")),
            "{so}"
        );
        lines
    };
    let free = hosts("");
    let held = hosts(&format!(
        "echo $$ > '{}/cgroup.procs' && ",
        group.0.display()
    ));
    assert_eq!(held, free);
}
