//! Which ranks of a job share a host, and how many CPUs they may run on between them.
//!
//! A rank at work keeps a CPU busy, and on a soft device so does the device's receive work.
//! Where the host has two CPUs for each of its ranks, both can run at once, and the ring's polls
//! leave the receiving to the device's engine thread. With fewer, they take turns, and a polling
//! thread does the receive work itself. Each rank
//! describes its host ([`Host::this`]) in the setup data the ranks swap, and [`share`] counts.

#![allow(unsafe_code)] // CPU affinity syscalls

use std::fmt;

/// Bytes of a host's identity: the kernel's boot id, a UUID that differs from machine to
/// machine and from boot to boot (containers on one machine share it, as they share its CPUs).
const ID_LEN: usize = 16;
/// CPUs a description can name, numbers 0 to 1023 (the size of glibc's `cpu_set_t`).
const MAX_CPUS: usize = 1024;

/// One rank's host: who it is, and the CPUs the rank may run on.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Host {
    /// All zeros: not known.
    id: [u8; ID_LEN],
    /// The rank's CPU affinity, bit `c % 8` of byte `c / 8` for CPU `c`; empty: not known.
    cpus: Vec<u8>,
}

impl fmt::Debug for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Host")
            .field("id", &format_args!("{:02x?}", self.id))
            .field("cpus", &self.cpu_count())
            .finish()
    }
}

impl Host {
    /// This process's host: the boot id, and the CPUs this thread may run on. What cannot be
    /// read stays unknown.
    pub(super) fn this() -> Host {
        let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .and_then(|s| parse_uuid(s.trim()))
            .unwrap_or([0; ID_LEN]);
        Host {
            id,
            cpus: affinity().unwrap_or_default(),
        }
    }

    #[cfg(test)]
    pub(super) fn new(id: [u8; ID_LEN], cpus: &[usize]) -> Host {
        let mut map = Vec::new();
        for &c in cpus {
            if map.len() <= c / 8 {
                map.resize(c / 8 + 1, 0);
            }
            map[c / 8] |= 1 << (c % 8);
        }
        Host { id, cpus: map }
    }

    fn known(&self) -> bool {
        self.id != [0; ID_LEN] && self.cpu_count() > 0
    }

    fn cpu_count(&self) -> usize {
        self.cpus.iter().map(|b| b.count_ones() as usize).sum()
    }

    /// Appends the description: the id, a 2-byte length, the CPU map.
    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id);
        out.extend_from_slice(&(self.cpus.len() as u16).to_be_bytes());
        out.extend_from_slice(&self.cpus);
    }

    /// Parses what [`Host::encode`] wrote, all of `b`.
    pub(super) fn decode(b: &[u8]) -> Result<Host, String> {
        if b.len() < ID_LEN + 2 {
            return Err(format!(
                "a host description of {} bytes is truncated",
                b.len()
            ));
        }
        let (id, rest) = b.split_at(ID_LEN);
        let n = u16::from_be_bytes([rest[0], rest[1]]) as usize;
        let cpus = &rest[2..];
        if n > MAX_CPUS / 8 || cpus.len() != n {
            return Err(format!(
                "a host description announces a {n}-byte CPU map and carries {} bytes (at most \
                 {})",
                cpus.len(),
                MAX_CPUS / 8
            ));
        }
        let mut host = Host {
            id: [0; ID_LEN],
            cpus: cpus.to_vec(),
        };
        host.id.copy_from_slice(id);
        Ok(host)
    }
}

/// How many ranks of a ring run on one rank's host, and how many CPUs they may run on between
/// them: the union of their affinities.
///
/// A container's CPU quota (its control group's `cpu.max`) is deliberately not counted: it bounds
/// CPU time, not how many threads run at once. Ranks held to one CPU of quota each, on a 16-CPU
/// host, ran 1.2–1.5× as fast with their devices receiving beside them than taking turns
/// (bench/results/log.md, "Ranks held to a CPU quota").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostShare {
    /// Ranks on the host, this one included.
    pub ranks: usize,
    /// CPUs those ranks may run on.
    pub cpus: usize,
}

impl HostShare {
    /// Whether the host has two CPUs for each of these ranks: one for the rank, one for its
    /// device's own work (a soft device's engine thread).
    pub fn two_cpus_per_rank(&self) -> bool {
        self.cpus >= 2 * self.ranks
    }
}

/// `me`'s share of its host among the ranks `all` (which includes `me`); `None` when a rank on
/// the host, or the host itself, cannot be told.
pub(super) fn share(me: &Host, all: &[Host]) -> Option<HostShare> {
    if !me.known() {
        return None;
    }
    let mut union = [0u8; MAX_CPUS / 8];
    let mut ranks = 0;
    for h in all.iter().filter(|h| h.id == me.id) {
        if !h.known() {
            return None;
        }
        ranks += 1;
        for (u, b) in union.iter_mut().zip(&h.cpus) {
            *u |= b;
        }
    }
    let cpus = union.iter().map(|b| b.count_ones() as usize).sum();
    Some(HostShare { ranks, cpus })
}

/// `8-4-4-4-12` hex digits to 16 bytes.
fn parse_uuid(s: &str) -> Option<[u8; ID_LEN]> {
    let hex: Vec<u8> = s.bytes().filter(|&c| c != b'-').collect();
    if hex.len() != 2 * ID_LEN || s.len() != 2 * ID_LEN + 4 {
        return None;
    }
    let mut id = [0; ID_LEN];
    for (i, pair) in hex.chunks(2).enumerate() {
        let pair = std::str::from_utf8(pair).ok()?;
        id[i] = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(id)
}

/// The calling thread's CPU affinity as a CPU map; `None` if the kernel will not say.
fn affinity() -> Option<Vec<u8>> {
    // SAFETY: `cpu_set_t` is plain bits, valid all zero; the kernel writes at most its size.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        set
    };
    let mut map = vec![0u8; MAX_CPUS / 8];
    for c in 0..MAX_CPUS {
        // SAFETY: `c` is below the set's size (`CPU_SETSIZE`), as `CPU_ISSET` requires.
        if unsafe { libc::CPU_ISSET(c, &set) } {
            map[c / 8] |= 1 << (c % 8);
        }
    }
    let used = map.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    map.truncate(used);
    Some(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: [u8; 16] = [1; 16];
    const B: [u8; 16] = [2; 16];

    #[test]
    fn this_host_is_known_and_round_trips() {
        let me = Host::this();
        assert!(me.known(), "boot id and affinity readable on Linux: {me:?}");
        assert!(me.cpu_count() >= 1);
        let mut bytes = Vec::new();
        me.encode(&mut bytes);
        assert_eq!(Host::decode(&bytes).unwrap(), me);
        // A boot id is what the kernel prints.
        assert_eq!(
            parse_uuid("0123abcd-4567-89ef-0123-456789abcdef").map(|id| id[..3].to_vec()),
            Some(vec![0x01, 0x23, 0xab])
        );
        assert_eq!(parse_uuid("0123abcd456789ef0123456789abcdef"), None);
        assert_eq!(parse_uuid("0123abcd-4567-89ef-0123-456789abcdeg"), None);
    }

    #[test]
    fn bad_descriptions_are_refused() {
        let mut bytes = Vec::new();
        Host::new(A, &[0, 9]).encode(&mut bytes);
        assert!(
            Host::decode(&bytes[..17])
                .unwrap_err()
                .contains("truncated")
        );
        assert!(Host::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut long = bytes.clone();
        long.push(0);
        assert!(Host::decode(&long).is_err());
        let mut huge = A.to_vec();
        huge.extend_from_slice(&200u16.to_be_bytes());
        huge.extend_from_slice(&[0xff; 200]);
        assert!(Host::decode(&huge).unwrap_err().contains("at most 128"));
    }

    #[test]
    fn ranks_and_cpus_are_counted_per_host() {
        let two = [0, 1];
        // Four ranks free to run on the same two CPUs.
        let all = vec![Host::new(A, &two); 4];
        let s = share(&all[0], &all).unwrap();
        assert_eq!(s, HostShare { ranks: 4, cpus: 2 });
        assert!(!s.two_cpus_per_rank());
        // One of them alone has two.
        assert!(share(&all[0], &all[..1]).unwrap().two_cpus_per_rank());
        // Four ranks bound to a CPU each: the union counts.
        let bound: Vec<Host> = (0..4).map(|c| Host::new(A, &[c])).collect();
        assert_eq!(
            share(&bound[2], &bound),
            Some(HostShare { ranks: 4, cpus: 4 })
        );
        // Ranks on another host do not count against this one.
        let mixed = vec![
            Host::new(A, &two),
            Host::new(B, &two),
            Host::new(B, &two),
            Host::new(B, &two),
        ];
        assert_eq!(
            share(&mixed[0], &mixed),
            Some(HostShare { ranks: 1, cpus: 2 })
        );
        assert_eq!(
            share(&mixed[1], &mixed),
            Some(HostShare { ranks: 3, cpus: 2 })
        );
        // Two ranks over four CPUs: two each.
        let four = [0, 1, 2, 3];
        let roomy = vec![Host::new(A, &four), Host::new(A, &four)];
        assert!(share(&roomy[1], &roomy).unwrap().two_cpus_per_rank());
        // Unknown: this host, or a rank's CPUs on it.
        let unknown = Host::new([0; 16], &two);
        assert_eq!(share(&unknown, std::slice::from_ref(&unknown)), None);
        let blind = vec![Host::new(A, &two), Host::new(A, &[])];
        assert_eq!(share(&blind[0], &blind), None);
        // A blind rank elsewhere does not matter.
        let elsewhere = vec![Host::new(A, &two), Host::new(B, &[])];
        assert_eq!(
            share(&elsewhere[0], &elsewhere),
            Some(HostShare { ranks: 1, cpus: 2 })
        );
    }
}
