"""Helpers shared by the comparison scripts in bench/scripts/ (see scripts/bench-report).

Running commands with a bounded time and recording them, parsing the tools' perftest-layout
tables, and writing the `<name>.md` fragment and `<name>*.plot.json` files the report expects.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def quick():
    """Whether this is a short smoke run (ERDMA_BENCH_QUICK=1)."""
    return os.environ.get("ERDMA_BENCH_QUICK", "0") == "1"


def out_dir():
    d = os.environ.get("BENCH_OUT")
    if not d or not os.path.isdir(d):
        sys.exit("BENCH_OUT must name an existing directory")
    return d


class Recorder:
    """Runs commands from the repository root and remembers them for the fragment."""

    def __init__(self):
        self.commands = []

    def run(self, argv, timeout=300, env=None, record=True, check=True):
        """Runs `argv`, returns its stdout. Raises on a non-zero exit (when `check`) or timeout."""
        if record:
            self.commands.append(
                " ".join(f"{k}={v}" for k, v in (env or {}).items()) + (" " if env else "")
                + " ".join(shlex.quote(a) for a in argv))
        full_env = dict(os.environ)
        full_env.update(env or {})
        p = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise RuntimeError(f"timed out after {timeout}s: {' '.join(argv)}")
        sys.stderr.write(err)
        if check and p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}: {' '.join(argv)}\n{err[-2000:]}")
        return out

    def background(self, argv, record=True):
        """Starts a server-like command; stop it with `stop`."""
        if record:
            self.commands.append(" ".join(shlex.quote(a) for a in argv) + " &")
        p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(0.3)
        return p

    @staticmethod
    def stop(p):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def cargo_build(rec, *targets):
    """`cargo build --release` of the given `--example`/`--bin` arguments (recorded)."""
    rec.run(["cargo", "build", "--release", "--quiet", *targets], timeout=900)


def numeric_rows(text, min_fields):
    """Rows of whitespace-separated numbers (at least `min_fields`) in a tool's output."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < min_fields:
            continue
        try:
            rows.append([float(x) for x in parts])
        except ValueError:
            continue
    return rows


def bw_rows(text):
    """Bandwidth rows: dict bytes -> (peak, average, Mpps), in the unit the tool printed."""
    return {int(r[0]): (r[2], r[3], r[4]) for r in numeric_rows(text, 5) if len(r) == 5}


def lat_rows(text):
    """Latency rows: dict bytes -> dict of t_min, t_max, t_typical, t_avg, t_stdev, p99, p999."""
    keys = ["t_min", "t_max", "t_typical", "t_avg", "t_stdev", "p99", "p999"]
    return {int(r[0]): dict(zip(keys, r[2:9])) for r in numeric_rows(text, 9) if len(r) == 9}


def fmt(x, digits=2):
    if x is None:
        return "n/a"
    if isinstance(x, float) and x != x:
        return "n/a"
    return f"{x:.{digits}f}"


def table(header, rows):
    """A markdown table; numbers right-aligned."""
    out = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return out


def verdict(ok):
    return "**met**" if ok else "**missed**"


def write_fragment(name, lines):
    with open(os.path.join(out_dir(), f"{name}.md"), "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")


def write_plot(stem, title, xlabel, ylabel, series, xlog=True, ylog=False):
    """`<stem>.plot.json` in the contract's format; series with no points are left out."""
    series = {k: v for k, v in series.items() if v}
    if not series:
        return
    with open(os.path.join(out_dir(), f"{stem}.plot.json"), "w") as f:
        json.dump({"title": title, "xlabel": xlabel, "ylabel": ylabel, "xlog": xlog,
                   "ylog": ylog, "series": series}, f, indent=1)


def commands_block(rec):
    """The commands a script ran, each once: a command repeated in later rounds is listed where
    it first ran, with the servers started in the background just before it."""
    listed, shown, servers = set(), [], []
    for c in rec.commands:
        if c.endswith(" &"):
            servers.append(c)
            continue
        if c not in listed:
            listed.add(c)
            shown += servers + [c]
        servers = []
    shown += [c for c in servers if c not in shown]
    return ["Commands (from the repository root):", "", "```"] + shown + ["```"]
