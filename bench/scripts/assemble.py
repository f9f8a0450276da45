"""Assembles BENCHMARKS.md from the fragments the comparison scripts wrote (used by
scripts/bench-report; see the contract there).

    python3 bench/scripts/assemble.py BENCH_OUT STATUS_TSV OUTPUT_MD PLOT_DIR

BENCH_OUT holds `<name>.md`, `<name>*.plot.json` and `<name>.log` per script; STATUS_TSV has one
line `name<TAB>exit status<TAB>seconds` per script run. Committed fragments in `bench/results/`
(results made on other machines) are included as they are. Every plot is rendered to PLOT_DIR/<stem>.png.
"""

import datetime
import glob
import json
import os
import platform
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# Results made elsewhere (a GPU machine), committed and included as they are; the log beside
# them (experiments that are not part of the report) is not included.
RESULTS = os.path.join(ROOT, "bench", "results")
LOG = "log.md"

# Targets the project set (issue tracker), with the script that measures each.
KNOWN_TARGETS = [
    ("soft-udp", "soft WRITE bandwidth ≥ 80% of raw UDP at 64 KiB"),
    ("soft-udp", "8 B latency ≤ 1.5× UDP ping-pong"),
    ("perftest", "SDK tools within 3% of perftest on the same device"),
    ("allreduce-mpi", "AllReduce busbw ≥ MPI over TCP at ≥ 1 MiB"),
    ("allreduce-mpi", "AllReduce ≥ Open MPI's shared memory at ≥ 1 MiB (same-host path)"),
    ("engines", "N = 2 engines not slower than N = 1 on this machine"),
    ("cq-modes", "hybrid completion latency within 10% of busy-poll at 8 B"),
    ("cq-modes", "async CPU use at idle ≈ 0"),
    ("gpu", "GPU-buffer WRITE bandwidth ≥ 70% of host buffers at every size"),
    ("nccl", "NCCL plugin all_reduce busbw ≥ 1.0× NCCL Socket at every size ≥ 16 MiB"),
    ("one-clean-stack", "structural rework no slower: paired A/B before/after"),
    ("async-read", "safe async READ 4 KiB within 10 % of the raw path"),
    ("dropin", "drop-in ib_write_bw ≥ 0.95 × write_bw, 4 KiB–1 MiB"),
    ("dropin", "drop-in ib_write_lat / ib_send_lat ≤ 1.05 × write_lat / send_lat"),
]
# Section order; scripts not listed follow alphabetically.
ORDER = ["soft-udp", "cq-modes", "perftest", "allreduce-mpi", "engines", "footprint", "micro",
         "udp-io"]

TARGET_LINE = re.compile(r"^\s*(?:[-*|]\s*)?\**Target\**\s*:?\s*(.*)$", re.IGNORECASE)
STATUS = re.compile(r"\*\*(met|missed|not met)\*\*", re.IGNORECASE)
# The other form in use: a bold verdict naming no target (`**Target met**: ...`).
BARE_VERDICT = re.compile(r"\*\*Target:? (met|missed|not met|not measured)\*\*",
                          re.IGNORECASE)


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except subprocess.SubprocessError:
        return ""


def loadavg():
    try:
        return open(os.path.join(sys.argv[1], "loadavg")).read().strip()
    except OSError:
        return "?"


def machine():
    lscpu = {}
    for line in sh("LC_ALL=C lscpu").splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            lscpu[k.strip()] = v.strip()
    mem = sh("LC_ALL=C free -h | awk '/^Mem:/ {print $2}'")
    commit = sh(f"git -C {ROOT} rev-parse --short HEAD")
    # The report's own output does not count as a local change.
    dirty = sh(f"git -C {ROOT} status --porcelain --untracked-files=no -- . "
               "':!BENCHMARKS.md' ':!bench/plots'")
    rows = [
        ("assembled (UTC)", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")),
        ("CPU", lscpu.get("Model name", platform.processor() or "?")),
        ("CPUs", f"{lscpu.get('CPU(s)', '?')} ({lscpu.get('Thread(s) per core', '?')} thread(s) "
                 f"per core, {lscpu.get('Socket(s)', '?')} socket(s))"),
        ("hypervisor", lscpu.get("Hypervisor vendor", "none reported")),
        ("caches", ", ".join(f"{k.split()[0]} {lscpu[k]}" for k in
                             ("L1d cache", "L2 cache", "L3 cache") if k in lscpu) or "?"),
        ("memory", mem or "?"),
        ("kernel", platform.release()),
        ("OS", sh(". /etc/os-release && echo $PRETTY_NAME") or "?"),
        ("Rust", sh("rustc -V")),
        ("commit when assembled", commit + (" (with local changes)" if dirty else "")),
        ("load average (start of the last run)", loadavg()),
    ]
    out = ["| | |", "| --- | --- |"]
    out += [f"| {k} | {v} |" for k, v in rows]
    return out


def render(plot_json, png):
    """Renders one plot; returns its title, or None when matplotlib is missing or it fails."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    try:
        spec = json.load(open(plot_json))
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for label, pts in spec["series"].items():
            pts = [p for p in pts if p[1] is not None]
            if not pts:
                continue
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=label)
        if spec.get("xlog"):
            ax.set_xscale("log", base=2)
        if spec.get("ylog"):
            ax.set_yscale("log")
        ax.set_title(spec.get("title", ""))
        ax.set_xlabel(spec.get("xlabel", ""))
        ax.set_ylabel(spec.get("ylabel", ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(png)
        plt.close(fig)
        return spec.get("title", os.path.basename(png))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"assemble: cannot render {plot_json}: {e}", file=sys.stderr)
        return None


def targets_in(text):
    """(target, status, figures) for each line of a fragment that states a target and met/missed.

    The figures are what the line says between the target and its verdict (`- Target: <what> —
    <figures>: **met**`), or the sentence after a bare verdict (`**Target missed** <figures>.`).
    """
    found = []
    for line in text.splitlines():
        b = BARE_VERDICT.search(line)
        if b:
            v = b.group(1).lower()
            figures = line[b.end():].strip().split(". ")[0].rstrip(".")
            found.append((None, {"met": "met", "not measured": "not measured (see the section)"}
                          .get(v, "missed"), figures))
            continue
        m = TARGET_LINE.match(line)
        if not m:
            continue
        s = STATUS.search(line)
        if not s:
            continue
        what, _, rest = m.group(1).partition(" — ")
        what = what.split(": **")[0].strip()
        figures = rest.split(": **")[0].split("**")[0].strip()
        found.append((what, "met" if s.group(1).lower() == "met" else "missed", figures))
    return found


def nest(text):
    """A committed result is a document of its own (`# Title`, `## Part`): one level down, so
    that it is one section of the report and its title names the section."""
    if not text.startswith("# "):
        return text
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" + line if not fenced and re.match(r"#+ ", line) else line)
    return "\n".join(out)


def section_title(text, fallback):
    for line in text.splitlines():
        if line.startswith("## "):
            return line[3:].strip()
    return fallback


def main():
    bench_out, status_tsv, output, plot_dir = sys.argv[1:5]
    os.makedirs(plot_dir, exist_ok=True)
    status = {}
    if os.path.exists(status_tsv):
        for line in open(status_tsv):
            parts = line.rstrip("\n").split("\t")
            # name, exit status, seconds; then (so that a section rerun alone with --only says
            # so) when it started and the commit it measured.
            if len(parts) in (3, 5):
                status[parts[0]] = (int(parts[1]), float(parts[2]),
                                    f", run {parts[3]} at {parts[4]}" if len(parts) == 5 else "")

    names = sorted(status, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    sections = []  # (name, markdown, plot files, origin)
    for name in names:
        rc, secs, started = status[name]
        frag = os.path.join(bench_out, f"{name}.md")
        plots = sorted(glob.glob(os.path.join(bench_out, f"{name}.plot.json"))
                       + glob.glob(os.path.join(bench_out, f"{name}-*.plot.json")))
        if rc == 0 and os.path.exists(frag):
            text = open(frag).read().strip()
            sections.append((name, text, plots, f"`bench/scripts/{name}`, {secs:.0f} s{started}"))
        else:
            log = os.path.join(bench_out, f"{name}.log")
            tail = open(log, errors="replace").read().splitlines()[-25:] if \
                os.path.exists(log) else []
            why = f"exit status {rc}" if rc != 0 else "it wrote no fragment"
            text = "\n".join([f"## {name}: not measured", "",
                              f"`bench/scripts/{name}` could not measure ({why}). The end of its "
                              "output:", "", "```"] + tail + ["```"])
            sections.append((name, text, [], f"`bench/scripts/{name}`, {secs:.0f} s"))
    for frag in sorted(glob.glob(os.path.join(RESULTS, "*.md"))):
        if os.path.basename(frag) == LOG:
            continue
        name = os.path.basename(frag)[:-3]
        plots = sorted(glob.glob(os.path.join(RESULTS, f"{name}.plot.json"))
                       + glob.glob(os.path.join(RESULTS, f"{name}-*.plot.json")))
        sections.append((name, nest(open(frag).read().strip()), plots,
                         f"committed result `bench/results/{name}.md`"))

    # Summary of targets.
    rows = []
    covered = set()
    for name, text, _, _ in sections:
        found = targets_in(text)
        known = [w for owner, w in KNOWN_TARGETS if owner == name]
        for what, st, figures in found:
            if what is None:
                what = known[0] if len(known) == 1 else f"the target of “{section_title(text, name)}”"
            rows.append((what, st, figures, name))
        if found:
            covered.add(name)
    for owner, what in KNOWN_TARGETS:
        if owner in covered:
            continue
        sec = next((s for s in sections if s[0] == owner), None)
        if sec is None and os.access(os.path.join(ROOT, "bench", "scripts", owner), os.X_OK):
            st = f"not measured in this run (`scripts/bench-report --only {owner}` adds it)"
        elif sec is None:
            st = "not measured (no `bench/scripts/%s` or `bench/results/%s.md` here)" % (owner, owner)
        elif "not measured" in sec[1].splitlines()[0]:
            st = "not measured (the script failed; see its section)"
        else:
            st = "see the section (no met/missed line in it)"
        rows.append((what, st, "", owner))

    md = ["# Benchmarks", "",
          "Every figure here comes from one command, `scripts/bench-report`, run on the machine "
          "described below (sections from `bench/results/` were measured elsewhere and say "
          "where); each comparison puts the project's number next to an anchor "
          "measured in the same run, on the same machine. The machine is shared and noisy: the "
          "ratios are the claims, absolute numbers are context. `ERDMA_BENCH_QUICK=1 "
          "scripts/bench-report` is a short smoke run; `scripts/bench-report --only NAME` "
          "reruns one comparison and keeps the others; each section's source line says when "
          "it ran and which commit it measured. Experiments that are not part of the report "
          "(settings tried, builds not kept, runs on other hosts, earlier runs' figures) are in "
          "the dated log, [`bench/results/log.md`](bench/results/log.md).", "",
          "## Machine", ""] + machine() + ["",
          "## Targets", "",
          "| target | status | ours against the anchor | where |", "| --- | --- | --- | --- |"]
    for what, st, figures, name in rows:
        shown = {"met": "**met**", "missed": "**missed**"}.get(st, st)
        where = (f"[{name}](#{anchor(sections, name)})"
                 if any(sec[0] == name for sec in sections) else f"`{name}`")
        md.append(f"| {what} | {shown} | {figures} | {where} |")
    md.append("")
    if os.environ.get("ERDMA_BENCH_QUICK") == "1":
        md += ["> This is a quick smoke run (`ERDMA_BENCH_QUICK=1`): short measurements, "
               "fewer sizes.", ""]

    for old in glob.glob(os.path.join(plot_dir, "*.png")):
        os.remove(old)
    for name, text, plots, origin in sections:
        md.append(text)
        md.append("")
        for p in plots:
            stem = os.path.basename(p)[: -len(".plot.json")]
            png = os.path.join(plot_dir, f"{stem}.png")
            title = render(p, png)
            if title:
                rel = os.path.relpath(png, os.path.dirname(os.path.abspath(output)))
                md.append(f"![{title}]({rel})")
                md.append("")
        md.append(f"<sub>Source: {origin}.</sub>")
        md.append("")
    with open(output, "w") as f:
        f.write("\n".join(md).rstrip() + "\n")


def anchor(sections, name):
    sec = next((s for s in sections if s[0] == name), None)
    title = section_title(sec[1], name) if sec else name
    a = re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")
    return a


if __name__ == "__main__":
    main()
