//! Rings of soft devices in one process: what the remote side may and may not do, and the
//! staging of memory beside the ring.

use std::time::Duration;

use super::super::bootstrap::tests::{join, master};
use super::*;
use crate::collective::buffer::Overlap;
use crate::error::Result;

/// Staging that loads a unit only when the ring waits for it (until then the host bytes
/// are poison, so a read before the wait gives a wrong sum) and stores at once (a store of
/// a chunk before its result is final leaves a wrong value in the memory).
struct LazyStaging {
    /// The memory being reduced ("device" memory).
    mem: Vec<u8>,
    host: *mut u8,
    host_len: usize,
    loads: Vec<Option<(usize, usize)>>,
    stored: Vec<(usize, usize)>,
}

impl Overlap for LazyStaging {
    unsafe fn load(&mut self, unit: usize, off: usize, len: usize) -> Result<()> {
        assert!(off + len <= self.mem.len() && off + len <= self.host_len);
        // SAFETY: in bounds of the host buffer (asserted); the ring leaves it alone.
        unsafe { std::ptr::write_bytes(self.host.add(off), 0xA5, len) };
        if self.loads.len() <= unit {
            self.loads.resize(unit + 1, None);
        }
        assert!(self.loads[unit].is_none(), "unit {unit} loaded twice");
        self.loads[unit] = Some((off, len));
        Ok(())
    }

    fn loaded(&mut self, unit: usize) -> Result<()> {
        let (off, len) = self.loads[unit]
            .take()
            .unwrap_or_else(|| panic!("unit {unit} waited for twice"));
        let src = &self.mem[off..off + len];
        // SAFETY: in bounds (asserted at load); the ring waits here before touching it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.host.add(off), len) };
        Ok(())
    }

    unsafe fn store(&mut self, off: usize, len: usize) -> Result<()> {
        let dst = &mut self.mem[off..off + len];
        // In bounds of both: the slice above, and the host buffer as the ring's own chunk.
        // SAFETY: both ranges are in bounds (above).
        unsafe { std::ptr::copy_nonoverlapping(self.host.add(off), dst.as_mut_ptr(), len) };
        self.stored.push((off, len));
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

fn input(rank: usize, i: usize, call: usize) -> i32 {
    (i as i32 % 1000) * (rank as i32 + 1) - 37 * call as i32
}

/// The queue pairs a rank credits its successor on grant that successor nothing: a WRITE
/// sent back through them into this rank's buffer is refused and changes no byte, while the
/// ring itself still runs.
#[test]
fn the_successor_cannot_write_through_the_credit_queue_pairs() {
    let (l, port) = master();
    let mut l = Some(l);
    let (wrote, written) = std::sync::mpsc::channel::<()>();
    // Rank 1 tries the WRITE and says so; rank 0 then looks at its buffer.
    let mut wrote = Some(wrote);
    let mut written = Some(written);
    let handles: Vec<_> = (0..2usize)
        .map(|rank| {
            let mine = if rank == 0 { l.take() } else { None };
            let (done_tx, done_rx) = if rank == 1 {
                (wrote.take(), None)
            } else {
                (None, written.take())
            };
            std::thread::spawn(move || {
                let ctx = crate::Context::open(&format!("soft:127.75.9.{}", rank + 1)).unwrap();
                let mut boot = join(rank, 2, mine, port, Duration::from_secs(30)).unwrap();
                let cfg = RingConfig {
                    qps_per_connection: 2,
                    chunk_bytes: 4096,
                    min_chunk_bytes: 4096,
                    slots: 2,
                    max_bytes: 1 << 16,
                    ..RingConfig::default()
                };
                let mut comm = Communicator::new(&ctx, &mut boot, cfg).unwrap();
                comm.buffer_mut()[..4096].fill(rank as u8 + 1);
                comm.all_reduce_in_place(1024, DType::I32, ReduceOp::Sum)
                    .unwrap();
                let sum = i32::from_ne_bytes([3; 4]);
                let first = i32::from_ne_bytes(comm.buffer()[..4].try_into().unwrap());
                assert_eq!(first, sum, "rank {rank}: the ring runs");
                boot.barrier().unwrap();
                if rank == 1 {
                    // Rank 1's receiving queue pairs are connected to rank 0's crediting
                    // ones; in a ring of two, rank 0's buffer is `peer_work` here.
                    let target = comm.peer_work.slice(0, 8).unwrap();
                    let wr = crate::SendWr::write_inline(0xbad, &[0xee; 8], target).signaled();
                    comm.rx.qp(0).post_send(wr).unwrap();
                    // The queue pair's receives are flushed as it breaks: look past them.
                    let wc = loop {
                        let wc = comm.cq.wait_one(Duration::from_secs(10)).unwrap();
                        if wc.wr_id == 0xbad {
                            break wc;
                        }
                        assert_eq!(wc.status, crate::WcStatus::WrFlushErr, "{wc:?}");
                    };
                    // The peer refuses an operation its queue pair does not allow with
                    // NAK "invalid request", as rxe does.
                    assert_eq!(wc.status, crate::WcStatus::RemInvReqErr, "{wc:?}");
                    done_tx.unwrap().send(()).unwrap();
                } else {
                    done_rx.unwrap().recv().unwrap();
                    let head = i32::from_ne_bytes(comm.buffer()[..4].try_into().unwrap());
                    assert_eq!(head, sum, "rank 0's buffer was written by its successor");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a rank failed");
    }
}

/// Loads and stores beside the ring: every unit is waited for before its bytes are read,
/// every byte is stored once and only when final, for 2-4 ranks and counts that divide by
/// nothing (several units per segment with 4 KiB chunks).
#[test]
fn staged_loads_precede_reads_and_stores_follow_results() {
    for world in [2usize, 3, 4] {
        let (l, port) = master();
        let mut l = Some(l);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let mine = if rank == 0 { l.take() } else { None };
                std::thread::spawn(move || {
                    let dev = format!("soft:127.75.{world}.{}", rank + 1);
                    let ctx = crate::Context::open(&dev).unwrap();
                    let t = Duration::from_secs(30);
                    let mut boot = join(rank, world, mine, port, t).unwrap();
                    let cfg = RingConfig {
                        qps_per_connection: 3,
                        chunk_bytes: 4096,
                        min_chunk_bytes: 4096,
                        slots: 2,
                        window_bytes: 5 * 4096,
                        max_bytes: 1 << 20,
                        ..RingConfig::default()
                    };
                    let mut comm = Communicator::new(&ctx, &mut boot, cfg).unwrap();
                    // Every rank runs on this host: each counts them all.
                    let share = comm.host_share().unwrap();
                    assert_eq!(share.ranks, world);
                    for (call, count) in [1usize, 7, 3001, 65_537, 40_000].into_iter().enumerate() {
                        let mut st = LazyStaging {
                            mem: (0..count)
                                .flat_map(|i| input(rank, i, call).to_ne_bytes())
                                .collect(),
                            host: comm.work.as_mut_ptr(),
                            host_len: comm.work.len(),
                            loads: Vec::new(),
                            stored: Vec::new(),
                        };
                        comm.reduce(count, DType::I32, ReduceOp::Sum, Some(&mut st))
                            .unwrap();
                        let what = format!("rank {rank} of {world}, {count} elements");
                        assert!(
                            st.loads.iter().all(Option::is_none),
                            "{what}: a unit was never waited for"
                        );
                        for i in 0..count {
                            let got =
                                i32::from_ne_bytes(st.mem[i * 4..i * 4 + 4].try_into().unwrap());
                            let want: i32 = (0..world).map(|r| input(r, i, call)).sum();
                            assert_eq!(got, want, "{what}: element {i}");
                        }
                        st.stored.sort_unstable();
                        let mut at = 0;
                        for &(off, len) in &st.stored {
                            assert_eq!(off, at, "{what}: stores {:?}", st.stored);
                            at += len;
                        }
                        assert_eq!(at, count * 4, "{what}: every byte stored once");
                    }
                    // Small calls: their polls did the receive work unless there were two
                    // CPUs for each rank.
                    assert_eq!(comm.cq.inline_progress(), !share.two_cpus_per_rank());
                })
            })
            .collect();
        for h in handles {
            h.join().expect("a rank failed");
        }
    }
}
