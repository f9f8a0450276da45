//! Faults on demand: `ERDMA_SOFT_FAULTS="loss=1%,reorder=2%,dup=0.5%,corrupt=0.1%,seed=7"` makes
//! a soft device lose, reorder, duplicate or corrupt a seeded share of the datagrams it sends,
//! so that any program's behaviour under loss is testable without root or netem.
//!
//! Applied in the driver's transmit path, after the engine built the datagrams: each is decided
//! on alone, from a per-device random sequence (the seed mixed with the device's address, so
//! two devices of one run differ and each run repeats). Reordering holds a datagram back and
//! sends it after the next one (which may come with a later send). Corruption flips one byte,
//! which the receiver's ICRC check catches. With faults on, datagrams go out one `sendto` each.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::socket::UdpSock;
use crate::soft::engine::batch::TxBatch;

/// The environment variable.
pub(crate) const ENV: &str = "ERDMA_SOFT_FAULTS";

/// Shares per million datagrams, and the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct FaultSpec {
    pub loss: u32,
    pub reorder: u32,
    pub dup: u32,
    pub corrupt: u32,
    pub seed: u64,
}

impl FaultSpec {
    /// Parses `loss=1%,reorder=2%,dup=0.5%,corrupt=0.1%,seed=7` (every key optional; a share is
    /// a percentage, `%` optional).
    pub(crate) fn parse(s: &str) -> Result<FaultSpec, String> {
        let mut f = FaultSpec::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}`: expected key=value"))?;
            let v = v.trim();
            if k.trim() == "seed" {
                f.seed = v.parse().map_err(|_| format!("seed `{v}`: not a number"))?;
                continue;
            }
            let pct: f64 = v
                .trim_end_matches('%')
                .parse()
                .map_err(|_| format!("{k} `{v}`: not a percentage"))?;
            if !(0.0..=100.0).contains(&pct) {
                return Err(format!("{k} `{v}`: not between 0% and 100%"));
            }
            let ppm = (pct * 10_000.0).round() as u32;
            match k.trim() {
                "loss" => f.loss = ppm,
                "reorder" => f.reorder = ppm,
                "dup" => f.dup = ppm,
                "corrupt" => f.corrupt = ppm,
                other => {
                    return Err(format!(
                        "unknown fault `{other}` (loss, reorder, dup, corrupt, seed)"
                    ));
                }
            }
        }
        Ok(f)
    }

    /// The spec in `ERDMA_SOFT_FAULTS`, if set and not empty.
    pub(crate) fn from_env() -> Result<Option<FaultSpec>, String> {
        match std::env::var(ENV) {
            Ok(s) if !s.trim().is_empty() => FaultSpec::parse(&s)
                .map(Some)
                .map_err(|e| format!("{ENV}: {e}")),
            _ => Ok(None),
        }
    }
}

/// What one datagram gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Send,
    Lose,
    Corrupt(usize),
    Duplicate,
    HoldBack,
}

/// A device's fault injector.
#[derive(Debug)]
pub(crate) struct Faults {
    spec: FaultSpec,
    state: Mutex<InjectorState>,
    pub(crate) counts: FaultCounts,
}

#[derive(Debug)]
struct InjectorState {
    rng: u64,
    held: Option<(SocketAddrV4, Vec<u8>)>,
}

/// What was done, for the report at close.
#[derive(Debug, Default)]
pub(crate) struct FaultCounts {
    pub datagrams: AtomicU64,
    pub lost: AtomicU64,
    pub reordered: AtomicU64,
    pub duplicated: AtomicU64,
    pub corrupted: AtomicU64,
}

impl Faults {
    pub(crate) fn new(spec: FaultSpec, addr: Ipv4Addr) -> Faults {
        let rng = spec.seed ^ (u64::from(u32::from(addr)) << 17) ^ 0x9e37_79b9_7f4a_7c15;
        Faults {
            spec,
            state: Mutex::new(InjectorState {
                rng: rng | 1,
                held: None,
            }),
            counts: FaultCounts::default(),
        }
    }

    /// Sends every datagram of `batches` through `sock`, each meeting its fate; empties them.
    pub(crate) fn send(&self, sock: &UdpSock, batches: &mut [&mut TxBatch]) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let held = st.held.take();
        let c = &self.counts;
        for b in batches.iter_mut() {
            b.drain_datagrams(|dst, bytes, _| {
                c.datagrams.fetch_add(1, Ordering::Relaxed);
                match fate(&self.spec, &mut st.rng, bytes.len()) {
                    Fate::Send => send_one(sock, dst, bytes),
                    Fate::Lose => {
                        c.lost.fetch_add(1, Ordering::Relaxed);
                    }
                    Fate::Corrupt(at) => {
                        c.corrupted.fetch_add(1, Ordering::Relaxed);
                        let mut v = bytes.to_vec();
                        v[at] ^= 0x5a;
                        send_one(sock, dst, &v);
                    }
                    Fate::Duplicate => {
                        c.duplicated.fetch_add(1, Ordering::Relaxed);
                        send_one(sock, dst, bytes);
                        send_one(sock, dst, bytes);
                    }
                    Fate::HoldBack => {
                        c.reordered.fetch_add(1, Ordering::Relaxed);
                        if let Some((d, v)) = st.held.replace((dst, bytes.to_vec())) {
                            send_one(sock, d, &v);
                        }
                    }
                }
            });
        }
        // A datagram held back by an earlier send goes out after this send's datagrams.
        if let Some((d, v)) = held {
            send_one(sock, d, &v);
        }
        Ok(())
    }

    /// One line for stderr: what was injected.
    pub(crate) fn report(&self) -> String {
        let c = &self.counts;
        format!(
            "{} datagrams sent: {} lost, {} reordered, {} duplicated, {} corrupted",
            c.datagrams.load(Ordering::Relaxed),
            c.lost.load(Ordering::Relaxed),
            c.reordered.load(Ordering::Relaxed),
            c.duplicated.load(Ordering::Relaxed),
            c.corrupted.load(Ordering::Relaxed),
        )
    }
}

fn next(rng: &mut u64) -> u64 {
    // xorshift64*
    *rng ^= *rng >> 12;
    *rng ^= *rng << 25;
    *rng ^= *rng >> 27;
    rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn fate(s: &FaultSpec, rng: &mut u64, len: usize) -> Fate {
    let r = (next(rng) % 1_000_000) as u32;
    let mut edge = s.loss;
    if r < edge {
        return Fate::Lose;
    }
    edge += s.corrupt;
    if r < edge && len > 0 {
        return Fate::Corrupt((next(rng) % len as u64) as usize);
    }
    edge += s.dup;
    if r < edge {
        return Fate::Duplicate;
    }
    edge += s.reorder;
    if r < edge {
        return Fate::HoldBack;
    }
    Fate::Send
}

/// Sends one datagram; a failure is one more lost datagram (as on a network).
pub(super) fn send_one(sock: &UdpSock, dst: SocketAddrV4, bytes: &[u8]) {
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: dst.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*dst.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `bytes` and `sa` are valid for the call; the socket is the device's own.
    unsafe {
        libc::sendto(
            sock.raw_fd(),
            bytes.as_ptr().cast(),
            bytes.len(),
            0,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_form_and_rejects_nonsense() {
        let f = FaultSpec::parse("loss=1%,reorder=2%,dup=0.5%,corrupt=0.1%,seed=7").unwrap();
        assert_eq!(
            f,
            FaultSpec {
                loss: 10_000,
                reorder: 20_000,
                dup: 5_000,
                corrupt: 1_000,
                seed: 7
            }
        );
        assert_eq!(FaultSpec::parse("loss=3").unwrap().loss, 30_000);
        assert!(FaultSpec::parse("loss=101%").is_err());
        assert!(FaultSpec::parse("drop=1%").is_err());
        assert!(FaultSpec::parse("loss").is_err());
        assert!(FaultSpec::parse("seed=x").is_err());
    }

    #[test]
    fn fates_follow_the_shares_and_the_seed() {
        let spec = FaultSpec::parse("loss=10%,dup=5%,reorder=5%,corrupt=5%,seed=1").unwrap();
        let run = |seed_addr: Ipv4Addr| {
            let f = Faults::new(spec, seed_addr);
            let mut st = f.state.lock().unwrap();
            (0..100_000)
                .map(|_| fate(&spec, &mut st.rng, 100))
                .collect::<Vec<_>>()
        };
        let a = run(Ipv4Addr::new(127, 0, 0, 1));
        assert_eq!(a, run(Ipv4Addr::new(127, 0, 0, 1)), "a seed repeats");
        assert_ne!(a, run(Ipv4Addr::new(127, 0, 0, 2)), "devices differ");
        let share = |want: fn(&Fate) -> bool| a.iter().filter(|f| want(f)).count();
        let lost = share(|f| *f == Fate::Lose);
        let dup = share(|f| *f == Fate::Duplicate);
        let corrupt = share(|f| matches!(f, Fate::Corrupt(_)));
        assert!((9_000..11_000).contains(&lost), "{lost}");
        assert!((4_000..6_000).contains(&dup), "{dup}");
        assert!((4_000..6_000).contains(&corrupt), "{corrupt}");
        let none = FaultSpec::default();
        let mut rng = 5;
        assert!((0..10_000).all(|_| fate(&none, &mut rng, 10) == Fate::Send));
    }
}
