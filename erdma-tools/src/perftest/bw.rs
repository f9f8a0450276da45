//! The bandwidth engine: the client posts a window of requests on every queue pair and times
//! their completions (perftest's peak and average); the server waits for the client's report,
//! keeping receives posted for SEND.

use std::time::{Duration, Instant};

use erdma::connect::compat::perftest::{BwReport, Keys, Role};
use erdma::{Completion, RawSendWr, RemoteMr, SendFlags, Sge, WrOpcode};

use super::oob::Channel;
use super::setup::{STALL, Side, await_peer, post_recvs, stalled};
use super::{Options, Verb};
use crate::report::{self, BwRow, BwUnit};

fn unit(o: &Options) -> BwUnit {
    if o.gbits { BwUnit::Gbps } else { BwUnit::MiBps }
}

/// A bandwidth test's phases after the queue pairs are armed, in either role.
pub(super) fn phases(
    o: &Options,
    s: &Side,
    mut ch: Box<dyn Channel>,
    role: Role,
    mine: &[Keys],
) -> erdma::Result<()> {
    let receiver = o.verb == Verb::Send && role == Role::Server;
    if receiver {
        // Before the client can send: it starts right after the exchanges below.
        for q in 0..s.qps.len() {
            post_recvs(s, q, s.qps[q].caps().max_recv_wr)?;
        }
    }
    // perftest: the keys again per queue pair, then one more exchange after the transition.
    for k in mine {
        ch.keys(k)?;
    }
    ch.keys(&mine[0])?;
    let u = unit(o);
    if !o.quiet {
        println!("{}", report::bw_header(u));
    }
    match role {
        Role::Server => {
            // The peer runs now; its end is the next exchange.
            let received = await_peer(s, o.port, &*ch, receiver)?;
            if receiver && received == 0 {
                return Err(erdma::Error::Protocol {
                    what: "the client ended its run without a single SEND: is it running a \
                           SEND bandwidth test?"
                        .into(),
                });
            }
            ch.keys(&mine[0])?;
            let theirs = ch.report(&BwReport::default())?;
            if !o.sizes().contains(&theirs.size) {
                return Err(erdma::Error::Protocol {
                    what: format!(
                        "the client measured {} B messages; this server was started for {}",
                        theirs.size,
                        size_list(o)
                    ),
                });
            }
            if !o.quiet {
                // The client measured; its numbers are in its unit, printed as perftest does.
                println!(
                    " {:<10} {:<10}       {:>10.2}         {:>10.2}\t\t   {:.6}",
                    theirs.size, theirs.iters, theirs.bw_peak, theirs.bw_avg, theirs.msg_rate
                );
                println!("{}", report::RULE);
            }
            ch.close(&mine[0])
        }
        Role::Client => {
            let sizes = o.sizes();
            let mut last = None;
            for (i, &size) in sizes.iter().enumerate() {
                if o.all && !o.quiet {
                    eprintln!("{}: size {size} ({}/{})", o.tool_name(), i + 1, sizes.len());
                }
                if o.verb != Verb::Send {
                    // perftest warms up before it measures WRITE and READ: one queue's worth.
                    let depth = s.qps[0].caps().max_send_wr.max(1) as u64;
                    bw_run(o, s, size, Some(depth.min(o.iters)))?;
                }
                let row = bw_run(o, s, size, None)?;
                if !o.quiet {
                    println!("{}", report::bw_line(&row, u));
                }
                last = Some(row);
            }
            if !o.quiet {
                println!("{}", report::RULE);
            }
            ch.keys(&mine[0])?;
            let row = last.unwrap_or(BwRow {
                bytes: o.size,
                iters: 0,
                peak: 0.0,
                avg: 0.0,
                msg_rate: 0.0,
            });
            ch.report(&BwReport {
                size: row.bytes,
                iters: row.iters,
                bw_peak: u.convert(row.peak),
                bw_avg: u.convert(row.avg),
                msg_rate: row.msg_rate / 1e6,
            })?;
            ch.close(&mine[0])
        }
    }
}

/// One bandwidth run at one size on every queue pair; the client side. `warm_up` replaces the
/// iteration count and duration (and quiets progress).
fn bw_run(o: &Options, s: &Side, size: u64, warm_up: Option<u64>) -> erdma::Result<BwRow> {
    let nq = s.qps.len();
    let depth = s.qps[0].caps().max_send_wr.max(1) as u64;
    let cq_mod = depth.min(100);
    let opcode = match o.verb {
        Verb::Write => WrOpcode::RdmaWrite,
        Verb::Send => WrOpcode::Send,
        Verb::Read => WrOpcode::RdmaRead,
    };
    let inline = opcode != WrOpcode::RdmaRead && size <= s.inline_max as u64;
    let sges: Vec<Sge> = (0..nq)
        .map(|q| Sge {
            addr: if opcode == WrOpcode::RdmaRead {
                s.target(q)
            } else {
                s.source(q)
            },
            length: size as u32,
            lkey: s.mr.lkey(),
        })
        .collect();
    let mut posted = vec![0u64; nq];
    let mut done = vec![0u64; nq];
    // With -D the target is fixed when time is up (rounded to the signalling interval).
    let duration = if warm_up.is_some() { None } else { o.duration };
    let iters = warm_up.unwrap_or(o.iters);
    let mut target: Vec<Option<u64>> = vec![duration.map_or(Some(iters), |_| None); nq];
    let start = Instant::now();
    let end = duration.map(|d| start + d);
    let mut idle = 0u32;
    // (when, messages completed so far) at each poll that completed some, and (when, messages
    // posted so far) at each post: the peak's windows run from a message's post to a later
    // one's completion. Both stop growing at `SAMPLES` entries (long `-D` runs).
    let mut samples: Vec<(Instant, u64)> = vec![(start, 0)];
    let mut posts: Vec<(Instant, u64)> = Vec::new();
    let mut last_done = start;
    let mut wcs = [Completion::default(); 64];
    let mut batch: Vec<RawSendWr<'_>> = Vec::with_capacity(cq_mod as usize);
    let mut last_progress = start;
    let mut next_report = start + Duration::from_secs(2);
    loop {
        if let Some(end) = end {
            if target[0].is_none() && Instant::now() >= end {
                for (q, t) in target.iter_mut().enumerate() {
                    if t.is_none() {
                        *t = Some(posted[q].div_ceil(cq_mod).max(1) * cq_mod);
                    }
                }
            }
        }
        // perftest's loop: each queue pair's window is filled, a post call at a time, before
        // the completion queue is polled (a poll between every two posts cost the soft device
        // a receive round per message: 0.74x perftest's rate at 4 KiB).
        for q in 0..nq {
            loop {
                let outstanding = posted[q] - done[q];
                let limit = target[q].unwrap_or(u64::MAX);
                let room = (depth - outstanding)
                    .min(limit - posted[q])
                    .min(o.post_list as u64);
                if room == 0 {
                    break;
                }
                batch.clear();
                for i in 0..room {
                    let seq = posted[q] + i;
                    let mut flags = SendFlags::empty();
                    if (seq + 1) % cq_mod == 0 || Some(seq + 1) == target[q] {
                        flags |= SendFlags::SIGNALED;
                    }
                    if inline {
                        flags |= SendFlags::INLINE;
                    }
                    let mut wr = RawSendWr::new(seq, opcode, std::slice::from_ref(&sges[q]));
                    wr.flags = flags;
                    wr.remote = RemoteMr {
                        addr: s.remotes[q].vaddr,
                        len: size,
                        rkey: s.remotes[q].rkey,
                    };
                    batch.push(wr);
                }
                // Sources are never written and READ targets never read by the CPU during the test.
                // SAFETY: the SGEs lie in `s.mr`, which outlives the queue pairs.
                unsafe { s.qps[q].post_send_raw(&batch)? };
                posted[q] += room;
                if posts.len() < SAMPLES {
                    posts.push((Instant::now(), posted.iter().sum()));
                }
            }
        }
        let n = s.cq.poll(&mut wcs)?;
        if n > 0 {
            let now = Instant::now();
            for c in &wcs[..n] {
                let c = c.ok()?;
                if let Some(q) = s.qp_index(c.qp_num) {
                    done[q] = done[q].max(c.wr_id + 1);
                }
            }
            last_progress = now;
            last_done = now;
            if samples.len() < SAMPLES {
                samples.push((now, done.iter().sum()));
            }
            if (duration.is_some() || o.all) && warm_up.is_none() && now >= next_report && !o.quiet
            {
                let total: u64 = done.iter().sum();
                let secs = now.duration_since(start).as_secs_f64();
                eprintln!(
                    "{}: {:.1} s, {} messages, {:.2} {}",
                    o.tool_name(),
                    secs,
                    total,
                    unit(o).convert(total as f64 * size as f64 / secs),
                    unit(o).label()
                );
                next_report = now + Duration::from_secs(2);
            }
        } else if {
            idle = idle.wrapping_add(1);
            idle % 1024 == 0
        } && last_progress.elapsed() > STALL
        {
            return Err(stalled(
                "the bandwidth run",
                done.iter().sum(),
                posted.iter().sum(),
            ));
        }
        let finished = (0..nq).all(|q| target[q].is_some_and(|t| done[q] >= t));
        if finished {
            break;
        }
    }
    let elapsed = last_done - start;
    let total: u64 = done.iter().sum();
    let secs = elapsed.as_secs_f64().max(1e-9);
    let avg = total as f64 * size as f64 / secs;
    let window = (total / 20).max(cq_mod);
    Ok(BwRow {
        bytes: size,
        iters: total,
        peak: peak_rate(&samples, &posts, size, window).max(avg),
        avg,
        msg_rate: total as f64 / secs,
    })
}

/// Entries a bandwidth run keeps of its posts and completions, each (16 bytes an entry).
const SAMPLES: usize = 1 << 20;

/// The best bandwidth over windows of at least `window` messages, each timed from the post of
/// its first message to the completion of its last, as perftest times them.
///
/// `done` holds (when, messages completed so far) per completing poll; `posts` (when, messages
/// posted so far) per post. Timing a window from the completion before it instead counted the
/// messages of several queue pairs completing together as if they had taken microseconds.
fn peak_rate(done: &[(Instant, u64)], posts: &[(Instant, u64)], size: u64, window: u64) -> f64 {
    // When message number `n` (0-based, in posting order) was posted.
    let posted_at = |n: u64| -> Option<Instant> {
        let i = posts.partition_point(|p| p.1 <= n);
        posts.get(i).map(|p| p.0)
    };
    let mut best = 0.0f64;
    let mut from = 0;
    for to in 1..done.len() {
        while from + 1 < to && done[to].1 - done[from + 1].1 >= window {
            from += 1;
        }
        let msgs = done[to].1 - done[from].1;
        let Some(first_posted) = posted_at(done[from].1) else {
            continue;
        };
        let dt = done[to]
            .0
            .saturating_duration_since(first_posted)
            .as_secs_f64();
        if msgs >= window && dt > 0.0 {
            best = best.max(msgs as f64 * size as f64 / dt);
        }
    }
    best
}

/// The sizes a run was started for, in words.
fn size_list(o: &Options) -> String {
    match o.sizes().as_slice() {
        [one] => format!("{one} B"),
        [first, .., last] => format!("{first}..={last} B"),
        [] => "no size".into(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn peak_over_windows() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let done = [(t0, 0), (ms(10), 100), (ms(15), 200), (ms(40), 300)];
        // Each 100 posted 4 ms before the previous hundred completed.
        let posts = [(t0, 100), (ms(6), 200), (ms(11), 300)];
        // Messages 100..200: posted at 6 ms, all complete at 15 ms: 100 of 1000 B in 9 ms is
        // the best window of >= 100 messages.
        let p = peak_rate(&done, &posts, 1000, 100);
        assert!((p - 100.0 * 1000.0 / 0.009).abs() < 1.0, "{p}");
    }

    /// Several queue pairs' completions land microseconds apart; timed from the completion
    /// before them, 200 messages looked like they took 2 µs. Timed from their posts, they took
    /// what the link needed.
    #[test]
    fn a_burst_of_completions_is_not_a_peak() {
        let t0 = Instant::now();
        let us = |n| t0 + Duration::from_micros(n);
        // 400 messages posted at once; 200 complete at 3.998 ms, the other 200 in a burst 2 µs
        // later.
        let posts = [(t0, 400)];
        let done = [(t0, 0), (us(3998), 200), (us(4000), 400)];
        let p = peak_rate(&done, &posts, 1000, 200);
        // No window beats 400 messages in 4 ms; the burst alone would say 200 in 2 µs.
        assert!(p <= 400.0 * 1000.0 / 0.004 + 1.0, "{p}");
        assert!(p >= 200.0 * 1000.0 / 0.004 - 1.0, "{p}");
    }
}
