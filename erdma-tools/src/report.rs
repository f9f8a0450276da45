//! Result tables in perftest's and nccl-tests' formats, so numbers can be compared side by side
//! with the C tools.

use std::fmt::Write as _;

/// The dashed rule perftest prints between sections.
pub const RULE: &str =
    "---------------------------------------------------------------------------------------";

/// Bandwidth unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BwUnit {
    /// MiB/s (perftest's default "MB/sec", factor 2^20).
    MiBps,
    /// Gbit/s (`--report_gbits`, factor 10^9 bits).
    Gbps,
}

impl BwUnit {
    /// Converts bytes per second to this unit.
    pub fn convert(self, bytes_per_sec: f64) -> f64 {
        match self {
            BwUnit::MiBps => bytes_per_sec / (1u64 << 20) as f64,
            BwUnit::Gbps => bytes_per_sec * 8.0 / 1e9,
        }
    }

    /// The column label.
    pub fn label(self) -> &'static str {
        match self {
            BwUnit::MiBps => "MB/sec",
            BwUnit::Gbps => "Gb/sec",
        }
    }
}

/// One row of a bandwidth table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwRow {
    /// Message size.
    pub bytes: u64,
    /// Messages completed.
    pub iters: u64,
    /// Best bandwidth over a sampling window, bytes/s.
    pub peak: f64,
    /// Average bandwidth, bytes/s.
    pub avg: f64,
    /// Messages per second.
    pub msg_rate: f64,
}

/// The header of a bandwidth table.
pub fn bw_header(unit: BwUnit) -> String {
    format!(
        " #bytes     #iterations    BW peak[{u}]    BW average[{u}]   MsgRate[Mpps]",
        u = unit.label()
    )
}

/// One line of a bandwidth table.
pub fn bw_line(row: &BwRow, unit: BwUnit) -> String {
    format!(
        " {:<10} {:<10}       {:>10.2}         {:>10.2}\t\t   {:.6}",
        row.bytes,
        row.iters,
        unit.convert(row.peak),
        unit.convert(row.avg),
        row.msg_rate / 1e6
    )
}

/// Latency statistics over samples in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatStats {
    /// Message size.
    pub bytes: u64,
    /// Samples.
    pub iters: u64,
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
    /// Median (perftest's "typical").
    pub typical: f64,
    /// Mean.
    pub avg: f64,
    /// Standard deviation.
    pub stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl LatStats {
    /// Statistics of `samples` (microseconds); `None` when empty.
    pub fn from_samples(bytes: u64, samples: &mut [f64]) -> Option<LatStats> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_by(|a, b| a.total_cmp(b));
        let n = samples.len();
        let avg = samples.iter().sum::<f64>() / n as f64;
        let var = samples.iter().map(|s| (s - avg) * (s - avg)).sum::<f64>() / n as f64;
        let pct = |p: f64| samples[(((n as f64) * p).ceil() as usize).clamp(1, n) - 1];
        Some(LatStats {
            bytes,
            iters: n as u64,
            min: samples[0],
            max: samples[n - 1],
            typical: samples[n / 2],
            avg,
            stdev: var.sqrt(),
            p99: pct(0.99),
            p999: pct(0.999),
        })
    }
}

/// Latency samples of a run of any length, in bounded memory: the count, extremes, mean and
/// deviation are exact; the median and percentiles come from a uniform random sample of at most
/// `cap` values (reservoir sampling), which is every value while there are fewer. A `-D` run of
/// a day keeps `cap` values, not billions.
#[derive(Debug)]
pub struct LatSamples {
    kept: Vec<f64>,
    cap: usize,
    seen: u64,
    min: f64,
    max: f64,
    mean: f64,
    m2: f64,
    rng: u64,
}

impl LatSamples {
    /// Values kept for the percentiles (32 MiB).
    pub const CAP: usize = 1 << 22;

    /// Room for `expect` values up front (at most 2^20), keeping at most [`LatSamples::CAP`].
    pub fn new(expect: u64) -> LatSamples {
        LatSamples::with_cap(expect, LatSamples::CAP)
    }

    /// As [`LatSamples::new`], keeping at most `cap` values (at least one).
    pub fn with_cap(expect: u64, cap: usize) -> LatSamples {
        let cap = cap.max(1);
        LatSamples {
            kept: Vec::with_capacity((expect.min(1 << 20) as usize).min(cap)),
            cap,
            seen: 0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            mean: 0.0,
            m2: 0.0,
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// Adds one value.
    pub fn push(&mut self, x: f64) {
        self.seen += 1;
        self.min = self.min.min(x);
        self.max = self.max.max(x);
        // Welford's running mean and sum of squared deviations.
        let d = x - self.mean;
        self.mean += d / self.seen as f64;
        self.m2 += d * (x - self.mean);
        if self.kept.len() < self.cap {
            self.kept.push(x);
            return;
        }
        // xorshift64: only needs to be uniform enough to pick which value a new one replaces.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let j = self.rng % self.seen;
        if (j as usize) < self.cap {
            self.kept[j as usize] = x;
        }
    }

    /// How many values were added.
    pub fn len(&self) -> u64 {
        self.seen
    }

    /// Whether none was.
    pub fn is_empty(&self) -> bool {
        self.seen == 0
    }

    /// The statistics of a row of `bytes`-byte messages; `None` without values.
    pub fn stats(mut self, bytes: u64) -> Option<LatStats> {
        let mut st = LatStats::from_samples(bytes, &mut self.kept)?;
        st.iters = self.seen;
        st.min = self.min;
        st.max = self.max;
        st.avg = self.mean;
        st.stdev = (self.m2 / self.seen as f64).sqrt();
        Some(st)
    }
}

/// The header of a latency table.
pub fn lat_header() -> String {
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
     t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
        .to_string()
}

/// One line of a latency table.
pub fn lat_line(s: &LatStats) -> String {
    format!(
        " {:<7} {:<10}     {:<10.2}     {:<10.2}   {:<10.2}         {:<10.2}     {:<10.2}      {:<10.2}             {:<10.2}",
        s.bytes, s.iters, s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999
    )
}

/// The banner perftest prints above its table.
pub fn banner(title: &str, fields: &[(&str, String)]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{RULE}");
    let _ = writeln!(out, "{:^87}", title);
    for pair in fields.chunks(2) {
        let left = format!(" {:<16}: {}", pair[0].0, pair[0].1);
        match pair.get(1) {
            Some((k, v)) => {
                let _ = writeln!(out, "{left:<40}{k:<15}: {v}");
            }
            None => {
                let _ = writeln!(out, "{left}");
            }
        }
    }
    let _ = write!(out, "{RULE}");
    out
}

/// One row of an nccl-tests style collective table (`all_reduce_perf`'s columns).
#[derive(Debug, Clone, PartialEq)]
pub struct CollRow {
    /// Bytes per rank.
    pub bytes: u64,
    /// Elements per rank.
    pub count: u64,
    /// Element type name (`float`, `half`, …).
    pub dtype: String,
    /// Reduction name (`sum`, `max`).
    pub redop: String,
    /// Average time of one operation, microseconds.
    pub time_us: f64,
    /// Ranks taking part.
    pub ranks: usize,
    /// Elements that differed from the reference (`None`: not checked, printed `N/A`).
    pub wrong: Option<u64>,
}

impl CollRow {
    /// Algorithm bandwidth: bytes / time, in GB/s (10^9 bytes).
    pub fn algbw(&self) -> f64 {
        if self.time_us > 0.0 {
            self.bytes as f64 / self.time_us / 1e3
        } else {
            0.0
        }
    }

    /// Bus bandwidth of an AllReduce: algbw × 2(n−1)/n, in GB/s.
    pub fn busbw(&self) -> f64 {
        let n = self.ranks.max(1) as f64;
        self.algbw() * 2.0 * (n - 1.0) / n
    }
}

/// The header of an nccl-tests style collective table (two lines).
pub fn coll_header() -> String {
    format!(
        "#{:>11} {:>12} {:>9} {:>6} {:>10} {:>8} {:>8} {:>7}\n#{:>11} {:>12} {:>9} {:>6} {:>10} {:>8} {:>8} {:>7}",
        "size",
        "count",
        "type",
        "redop",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "(B)",
        "(elements)",
        "",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        ""
    )
}

/// One line of an nccl-tests style collective table.
pub fn coll_line(r: &CollRow) -> String {
    let wrong = r.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
    format!(
        " {:>11} {:>12} {:>9} {:>6} {:>10.1} {:>8.2} {:>8.2} {:>7}",
        r.bytes,
        r.count,
        r.dtype,
        r.redop,
        r.time_us,
        r.algbw(),
        r.busbw(),
        wrong
    )
}

/// The port counters the AllReduce summary line reports (those a device lacks are left out).
pub const REPORTED: [&str; 5] = [
    erdma::soft::counter::COMPLETER_RETRY_ERR,
    erdma::soft::counter::RETRANSMITTED_PKTS,
    erdma::soft::counter::SOCKET_DROPS,
    erdma::soft::counter::DROPS,
    erdma::soft::counter::DROP_STALE,
];

/// One rank's share of the counters line: its device's name, then each of [`REPORTED`] as a
/// big-endian `u64` (`u64::MAX`: the device has no such counter).
pub fn counter_message(device: &str, c: &erdma::PortCounters) -> Vec<u8> {
    let mut m = Vec::with_capacity(2 + device.len() + 8 * REPORTED.len());
    m.extend_from_slice(&(device.len().min(u16::MAX as usize) as u16).to_be_bytes());
    m.extend_from_slice(&device.as_bytes()[..device.len().min(u16::MAX as usize)]);
    for name in REPORTED {
        m.extend_from_slice(&c.get(name).unwrap_or(u64::MAX).to_be_bytes());
    }
    m
}

/// `# Port counters ...` over every rank's message: ranks sharing a device count it once (the
/// largest growth any of them saw); `None` when no device has any of the counters, or a message
/// is malformed.
pub fn counters_line(all: &[Vec<u8>]) -> Option<String> {
    let mut per_device: std::collections::BTreeMap<&[u8], [Option<u64>; REPORTED.len()]> =
        Default::default();
    for m in all {
        let n = usize::from(u16::from_be_bytes(m.get(..2)?.try_into().ok()?));
        let name = m.get(2..2 + n)?;
        let rest = m.get(2 + n..)?;
        if rest.len() != 8 * REPORTED.len() {
            return None;
        }
        let entry = per_device.entry(name).or_default();
        for (i, v) in rest.chunks_exact(8).enumerate() {
            let v = u64::from_be_bytes(v.try_into().ok()?);
            if v != u64::MAX {
                entry[i] = Some(entry[i].map_or(v, |old: u64| old.max(v)));
            }
        }
    }
    let parts: Vec<String> = REPORTED
        .iter()
        .enumerate()
        .filter_map(|(i, name)| {
            let vals: Vec<u64> = per_device.values().filter_map(|e| e[i]).collect();
            (!vals.is_empty()).then(|| format!("{name} {}", vals.iter().sum::<u64>()))
        })
        .collect();
    (!parts.is_empty()).then(|| {
        format!(
            "# Port counters over the sweep ({} device(s)): {}",
            per_device.len(),
            parts.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Below the cap every value is kept and the statistics are the plain ones; above it, the
    /// count, extremes and mean stay exact, the memory stays at the cap, and the median of a
    /// uniform stream stays near its true value.
    #[test]
    fn latency_samples_keep_bounded_memory() {
        let mut few = LatSamples::with_cap(10, 100);
        let mut plain: Vec<f64> = (1..=9).map(f64::from).collect();
        for &x in &plain {
            few.push(x);
        }
        let a = few.stats(8).unwrap();
        let b = LatStats::from_samples(8, &mut plain).unwrap();
        assert_eq!(
            (a.iters, a.min, a.max, a.typical, a.p99),
            (9, 1.0, 9.0, 5.0, 9.0)
        );
        assert!((a.avg - b.avg).abs() < 1e-12 && (a.stdev - b.stdev).abs() < 1e-12);

        let mut many = LatSamples::with_cap(0, 1000);
        for i in 0..100_000u32 {
            // 0..1000 over and over, then one outlier.
            many.push(f64::from(i % 1000));
        }
        many.push(1e6);
        assert_eq!(many.len(), 100_001);
        assert!(many.kept.len() == 1000 && many.kept.capacity() < 2000);
        let st = many.stats(8).unwrap();
        assert_eq!((st.iters, st.min, st.max), (100_001, 0.0, 1e6));
        assert!((st.avg - (499.5 * 100_000.0 + 1e6) / 100_001.0).abs() < 1e-6);
        assert!(
            (400.0..600.0).contains(&st.typical),
            "median {}",
            st.typical
        );
    }

    #[test]
    fn counters_line_counts_a_shared_device_once_and_skips_missing_counters() {
        let soft = |retries, resent, drops| {
            erdma::PortCounters::from_pairs([
                ("completer_retry_err".to_string(), retries),
                ("retransmitted_pkts".to_string(), resent),
                ("socket_drops".to_string(), drops * 2),
                ("drops".to_string(), drops),
                ("drop_stale".to_string(), drops - 1),
            ])
        };
        // Two soft devices, and two ranks on one rxe device (which has no drop counters).
        let rxe = |retries| {
            erdma::PortCounters::from_pairs([("completer_retry_err".to_string(), retries)])
        };
        let all = vec![
            counter_message("soft:127.0.0.1", &soft(1, 10, 3)),
            counter_message("soft:127.0.0.2", &soft(2, 20, 4)),
            counter_message("rxe0", &rxe(5)),
            counter_message("rxe0", &rxe(7)),
        ];
        assert_eq!(
            counters_line(&all).unwrap(),
            "# Port counters over the sweep (3 device(s)): completer_retry_err 10, \
             retransmitted_pkts 30, socket_drops 14, drops 7, drop_stale 5"
        );
        // A device without any of them: no line. A truncated message: no line, no panic.
        let none = vec![counter_message("mlx5_0", &erdma::PortCounters::default())];
        assert_eq!(counters_line(&none), None);
        let mut cut = counter_message("soft:127.0.0.1", &soft(1, 1, 1));
        cut.pop();
        assert_eq!(counters_line(&[cut]), None);
        assert_eq!(counters_line(&[vec![0xFF]]), None);
    }

    #[test]
    fn units() {
        assert!((BwUnit::MiBps.convert(1048576.0) - 1.0).abs() < 1e-12);
        assert!((BwUnit::Gbps.convert(125_000_000.0) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn latency_statistics() {
        let mut s: Vec<f64> = (1..=1000).map(|x| x as f64).collect();
        let st = LatStats::from_samples(8, &mut s).unwrap();
        assert_eq!(st.min, 1.0);
        assert_eq!(st.max, 1000.0);
        assert_eq!(st.typical, 501.0);
        assert!((st.avg - 500.5).abs() < 1e-9);
        assert_eq!(st.p99, 990.0);
        assert_eq!(st.p999, 999.0);
        assert!(LatStats::from_samples(8, &mut []).is_none());
    }

    #[test]
    fn lines_carry_the_numbers() {
        let row = BwRow {
            bytes: 65536,
            iters: 5000,
            peak: 2.0 * 1048576.0,
            avg: 1048576.0,
            msg_rate: 16.0,
        };
        let line = bw_line(&row, BwUnit::MiBps);
        assert!(
            line.contains("65536")
                && line.contains("5000")
                && line.contains("2.00")
                && line.contains("1.00")
        );
        assert!(bw_header(BwUnit::Gbps).contains("Gb/sec"));
    }

    #[test]
    fn collective_rows_follow_nccl_tests() {
        let r = CollRow {
            bytes: 1 << 20,
            count: 1 << 18,
            dtype: "float".into(),
            redop: "sum".into(),
            time_us: 1000.0,
            ranks: 4,
            wrong: Some(0),
        };
        assert!((r.algbw() - 1.048576).abs() < 1e-9);
        assert!((r.busbw() - 1.048576 * 1.5).abs() < 1e-9);
        let line = coll_line(&r);
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "1048576", "262144", "float", "sum", "1000.0", "1.05", "1.57", "0"
            ]
        );
        assert!(coll_header().contains("busbw") && coll_header().contains("#wrong"));
        let unchecked = CollRow { wrong: None, ..r };
        assert!(coll_line(&unchecked).ends_with("N/A"));
    }
}
