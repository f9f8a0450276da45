//! The plugin's settings, read from the environment once per `init`, and the device selection.
//!
//! | variable | effect |
//! | --- | --- |
//! | `ERDMA_NCCL_DEVICES` | devices to use, in `NCCL_IB_HCA` syntax: `erdma_0,mlx5_1:1`, `^rxe` (all but), `=erdma_0` (exact names); soft devices by name (`soft:10.0.0.5`), or `soft` for the automatic one. Unset: `NCCL_IB_HCA` chooses among kernel devices |
//! | `ERDMA_NCCL_QPS` | queue pairs per connection (else `NCCL_IB_QPS_PER_CONNECTION`, else 8) |
//! | `ERDMA_NCCL_CHUNK` | smallest piece of a transfer given a queue pair of its own (bytes, `K`/`M` suffixes; 128K) |
//! | `ERDMA_NCCL_CM` | `1`: connect queue pairs through rdma_cm, `0`: never, `auto` (default): where the device's transport needs it (iWARP) |
//! | `ERDMA_NCCL_NOTICE` | `imm` or `send`: how transfers are signalled (default: `send` where the device lacks immediate data, siw among them; `imm` elsewhere) |
//! | `ERDMA_NCCL_GDR` | `1`/`0`: advertise GPU memory (`NCCL_PTR_CUDA`) or not; `auto` (default): where registering GPU memory can work |
//! | `ERDMA_NCCL_TIMEOUT` | seconds a connection may take to set up (60) |
//! | `ERDMA_NCCL_SOFT_BASE` | the address of local rank 0's automatic soft device (127.0.0.2) |
//! | `ERDMA_NCCL_INLINE_PROGRESS` | soft devices: `1` NCCL's progress thread receives itself, `0` the device's engine thread does (default: `1` with fewer than 4 CPUs per local rank) |
//! | `ERDMA_NCCL_SPEED` | the speed to report, in Mbit/s (default: the port's; 10000 for soft devices, as NCCL's socket transport assumes) |
//! | `ERDMA_NCCL_OOB_ADDR` | the address receivers listen on for the out-of-band exchange (default: the device's IPv4 address) |

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::proto::{MAX_QPS, NoticeMode};

/// A setting that is on, off, or left to the plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Decided per device.
    Auto,
    /// Forced on.
    On,
    /// Forced off.
    Off,
}

/// Everything the environment says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The device list, and the variable it came from.
    pub devices: Option<(String, &'static str)>,
    /// Queue pairs per connection.
    pub qps: usize,
    /// Smallest piece of a striped transfer.
    pub min_chunk: u64,
    /// rdma_cm for queue pairs.
    pub cm: Choice,
    /// Notice mode, when forced.
    pub notice: Option<NoticeMode>,
    /// GPU memory support.
    pub gdr: Choice,
    /// Connection setup limit.
    pub connect_timeout: Duration,
    /// Automatic soft devices start here.
    pub soft_base: Ipv4Addr,
    /// This process's rank on its host, from the launcher's variables.
    pub local_rank: Option<usize>,
    /// Processes on this host, from the launcher's variables.
    pub local_size: Option<usize>,
    /// Soft devices: whether polls receive.
    pub inline_progress: Choice,
    /// Reported speed.
    pub speed_mbps: Option<i32>,
    /// Out-of-band listen address.
    pub oob_addr: Option<IpAddr>,
}

/// Launcher variables that give a process's rank on its host, in the order they are read.
pub const LOCAL_RANK_VARS: [&str; 6] = [
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "PMI_LOCAL_RANK",
];

/// Launcher variables that give the number of processes on a host.
const LOCAL_SIZE_VARS: [&str; 4] = [
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "MPI_LOCALNRANKS",
];

fn var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

fn bad(name: &str, value: &str, want: &str) -> String {
    format!("{name}={value:?} is not valid: expected {want}")
}

fn choice(name: &str) -> Result<Choice, String> {
    match var(name).as_deref() {
        None => Ok(Choice::Auto),
        Some(v) if v.eq_ignore_ascii_case("auto") => Ok(Choice::Auto),
        Some("1" | "on" | "yes" | "true") => Ok(Choice::On),
        Some("0" | "off" | "no" | "false") => Ok(Choice::Off),
        Some(v) => Err(bad(name, v, "1, 0 or auto")),
    }
}

/// Parses a byte count with an optional `K`, `M` or `G` suffix (powers of 1024).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1u64 << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

impl Config {
    /// Reads the environment.
    ///
    /// # Errors
    /// A message naming the variable whose value makes no sense.
    pub fn from_env() -> Result<Config, String> {
        let devices = match var("ERDMA_NCCL_DEVICES") {
            Some(v) => Some((v, "ERDMA_NCCL_DEVICES")),
            None => var("NCCL_IB_HCA").map(|v| (v, "NCCL_IB_HCA")),
        };
        let qps = match var("ERDMA_NCCL_QPS")
            .map(|v| ("ERDMA_NCCL_QPS", v))
            .or_else(|| {
                var("NCCL_IB_QPS_PER_CONNECTION").map(|v| ("NCCL_IB_QPS_PER_CONNECTION", v))
            }) {
            None => 8,
            Some((name, v)) => match v.parse::<usize>() {
                Ok(n) if (1..=MAX_QPS).contains(&n) => n,
                _ => {
                    return Err(bad(
                        name,
                        &v,
                        &format!("a number of queue pairs, 1..={MAX_QPS}"),
                    ));
                }
            },
        };
        let min_chunk = match var("ERDMA_NCCL_CHUNK") {
            None => 128 << 10,
            Some(v) => match parse_bytes(&v) {
                Some(n) if (4096..=1 << 30).contains(&n) => n,
                _ => return Err(bad("ERDMA_NCCL_CHUNK", &v, "a size from 4K to 1G")),
            },
        };
        let notice = match var("ERDMA_NCCL_NOTICE").as_deref() {
            None | Some("auto") => None,
            Some("imm") => Some(NoticeMode::Imm),
            Some("send") => Some(NoticeMode::Send),
            Some(v) => return Err(bad("ERDMA_NCCL_NOTICE", v, "imm, send or auto")),
        };
        let connect_timeout = match var("ERDMA_NCCL_TIMEOUT") {
            None => Duration::from_secs(60),
            Some(v) => match v.parse::<u64>() {
                Ok(s) if s > 0 => Duration::from_secs(s),
                _ => return Err(bad("ERDMA_NCCL_TIMEOUT", &v, "a number of seconds")),
            },
        };
        let soft_base = match var("ERDMA_NCCL_SOFT_BASE") {
            None => Ipv4Addr::new(127, 0, 0, 2),
            Some(v) => v
                .parse()
                .map_err(|_| bad("ERDMA_NCCL_SOFT_BASE", &v, "an IPv4 address"))?,
        };
        let mut local_rank = None;
        for name in LOCAL_RANK_VARS {
            if let Some(v) = var(name) {
                local_rank = Some(
                    v.parse::<usize>()
                        .map_err(|_| bad(name, &v, "a local rank (a number)"))?,
                );
                break;
            }
        }
        let local_size = LOCAL_SIZE_VARS
            .iter()
            .find_map(|n| var(n).and_then(|v| v.parse::<usize>().ok()))
            .filter(|&n| n > 0);
        let speed_mbps = match var("ERDMA_NCCL_SPEED") {
            None => None,
            Some(v) => match v.parse::<i32>() {
                Ok(s) if s > 0 => Some(s),
                _ => return Err(bad("ERDMA_NCCL_SPEED", &v, "a speed in Mbit/s")),
            },
        };
        let oob_addr = match var("ERDMA_NCCL_OOB_ADDR") {
            None => None,
            Some(v) => Some(
                v.parse()
                    .map_err(|_| bad("ERDMA_NCCL_OOB_ADDR", &v, "an IP address"))?,
            ),
        };
        Ok(Config {
            devices,
            qps,
            min_chunk,
            cm: choice("ERDMA_NCCL_CM")?,
            notice,
            gdr: choice("ERDMA_NCCL_GDR")?,
            connect_timeout,
            soft_base,
            local_rank,
            local_size,
            inline_progress: choice("ERDMA_NCCL_INLINE_PROGRESS")?,
            speed_mbps,
            oob_addr,
        })
    }
}

/// One entry of an `NCCL_IB_HCA`-style list.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    name: String,
    port: Option<u8>,
}

/// An `NCCL_IB_HCA`-style device filter: `[^][=]name[:port],...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFilter {
    exclude: bool,
    exact: bool,
    entries: Vec<Entry>,
    /// Soft devices named in the list (`soft` alone: the automatic one, as `None`).
    pub soft: Vec<Option<Ipv4Addr>>,
}

impl DeviceFilter {
    /// Parses a list.
    ///
    /// # Errors
    /// A message naming the entry that is malformed.
    pub fn parse(spec: &str) -> Result<DeviceFilter, String> {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let mut entries = Vec::new();
        let mut soft = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if item == "soft" || item == "soft:auto" {
                soft.push(None);
                continue;
            }
            if let Some(addr) = item.strip_prefix("soft:") {
                let a: Ipv4Addr = addr
                    .parse()
                    .map_err(|_| format!("{item:?}: a soft device is soft:<IPv4 address>"))?;
                soft.push(Some(a));
                continue;
            }
            let (name, port) = match item.rsplit_once(':') {
                Some((n, p)) => (
                    n,
                    Some(
                        p.parse::<u8>()
                            .map_err(|_| format!("{item:?}: the port after ':' is not a number"))?,
                    ),
                ),
                None => (item, None),
            };
            entries.push(Entry {
                name: name.to_string(),
                port,
            });
        }
        if exclude && !soft.is_empty() {
            soft.clear();
        }
        Ok(DeviceFilter {
            exclude,
            exact,
            entries,
            soft,
        })
    }

    /// Whether kernel device `name` (port 1) is selected.
    pub fn matches(&self, name: &str) -> bool {
        let hit = self.entries.iter().any(|e| {
            let name_ok = if self.exact {
                e.name == name
            } else {
                name.starts_with(&e.name)
            };
            name_ok && e.port.is_none_or(|p| p == 1)
        });
        if self.exclude { !hit } else { hit }
    }

    /// Whether the list names any kernel device at all (an include list of soft devices only
    /// selects no kernel device).
    pub fn names_kernel_devices(&self) -> bool {
        self.exclude || !self.entries.is_empty()
    }
}

/// What to open: kernel devices by name and soft devices (`None`: the automatic address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Kernel devices.
    pub kernel: Vec<String>,
    /// Soft devices.
    pub soft: Vec<Option<Ipv4Addr>>,
    /// How the choice was made, for the log.
    pub why: String,
}

/// Chooses devices from the configuration and the kernel devices present.
///
/// # Errors
/// A message when an explicit list selects nothing.
pub fn select(config: &Config, kernel: &[String]) -> Result<Selection, String> {
    match &config.devices {
        Some((spec, "ERDMA_NCCL_DEVICES")) => {
            let f = DeviceFilter::parse(spec).map_err(|e| format!("ERDMA_NCCL_DEVICES: {e}"))?;
            let chosen: Vec<String> = if f.names_kernel_devices() {
                kernel.iter().filter(|n| f.matches(n)).cloned().collect()
            } else {
                Vec::new()
            };
            if chosen.is_empty() && f.soft.is_empty() {
                return Err(format!(
                    "ERDMA_NCCL_DEVICES={spec:?} selects no device (kernel devices here: {})",
                    list_or_none(kernel)
                ));
            }
            Ok(Selection {
                kernel: chosen,
                soft: f.soft,
                why: format!("ERDMA_NCCL_DEVICES={spec}"),
            })
        }
        Some((spec, var)) => {
            let f = DeviceFilter::parse(spec).map_err(|e| format!("{var}: {e}"))?;
            let chosen: Vec<String> = kernel.iter().filter(|n| f.matches(n)).cloned().collect();
            if !chosen.is_empty() || !f.soft.is_empty() {
                return Ok(Selection {
                    kernel: chosen,
                    soft: f.soft,
                    why: format!("{var}={spec}"),
                });
            }
            if kernel.is_empty() {
                return Ok(Selection {
                    kernel: Vec::new(),
                    soft: vec![None],
                    why: format!("{var}={spec} but no kernel RDMA device: the soft device"),
                });
            }
            Err(format!(
                "{var}={spec:?} selects none of the kernel devices here ({})",
                list_or_none(kernel)
            ))
        }
        None if !kernel.is_empty() => Ok(Selection {
            kernel: kernel.to_vec(),
            soft: Vec::new(),
            why: "every kernel RDMA device".into(),
        }),
        None => Ok(Selection {
            kernel: Vec::new(),
            soft: vec![None],
            why: "no kernel RDMA device: the soft device".into(),
        }),
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// The address of the automatic soft device's `attempt`-th candidate: the base plus the local
/// rank plus `attempt` (the next addresses are tried when one is taken).
pub fn soft_address(base: Ipv4Addr, local_rank: Option<usize>, attempt: usize) -> Option<Ipv4Addr> {
    let n = u32::from(base).checked_add((local_rank.unwrap_or(0) + attempt) as u32)?;
    let a = Ipv4Addr::from(n);
    // Stay inside the base's /8 when it is loopback: other addresses are not this host's.
    (!base.is_loopback() || a.is_loopback()).then_some(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn cfg(devices: Option<(&str, &'static str)>) -> Config {
        Config {
            devices: devices.map(|(s, v)| (s.to_string(), v)),
            qps: 8,
            min_chunk: 1,
            cm: Choice::Auto,
            notice: None,
            gdr: Choice::Auto,
            connect_timeout: Duration::from_secs(1),
            soft_base: Ipv4Addr::new(127, 0, 0, 2),
            local_rank: None,
            local_size: None,
            inline_progress: Choice::Auto,
            speed_mbps: None,
            oob_addr: None,
        }
    }

    #[test]
    fn nccl_ib_hca_syntax() {
        let f = DeviceFilter::parse("mlx5_0:1,erdma").unwrap();
        assert!(f.matches("mlx5_0") && f.matches("erdma_1") && !f.matches("rxe0"));
        let f = DeviceFilter::parse("^rxe").unwrap();
        assert!(!f.matches("rxe0") && f.matches("erdma_0"));
        let f = DeviceFilter::parse("=erdma_0").unwrap();
        assert!(f.matches("erdma_0") && !f.matches("erdma_01"));
        let f = DeviceFilter::parse("mlx5_0:2").unwrap();
        assert!(!f.matches("mlx5_0"));
        let f = DeviceFilter::parse("soft:10.0.0.5,soft").unwrap();
        assert_eq!(f.soft, vec![Some(Ipv4Addr::new(10, 0, 0, 5)), None]);
        assert!(!f.names_kernel_devices());
        assert!(DeviceFilter::parse("soft:nope").is_err());
        assert!(DeviceFilter::parse("mlx5_0:x").is_err());
    }

    #[test]
    fn selection_rules() {
        let k = names(&["erdma_0", "erdma_1", "rxe0"]);
        let s = select(&cfg(None), &k).unwrap();
        assert_eq!(s.kernel, k);
        let s = select(&cfg(None), &[]).unwrap();
        assert_eq!(s.soft, vec![None]);
        let s = select(&cfg(Some(("erdma", "NCCL_IB_HCA"))), &k).unwrap();
        assert_eq!(s.kernel, names(&["erdma_0", "erdma_1"]));
        // NCCL_IB_HCA inherited on a machine with no RDMA device: the soft device.
        let s = select(&cfg(Some(("erdma", "NCCL_IB_HCA"))), &[]).unwrap();
        assert_eq!(s.soft, vec![None]);
        assert!(
            select(&cfg(Some(("mlx5", "NCCL_IB_HCA"))), &k)
                .unwrap_err()
                .contains("selects none")
        );
        // The plugin's own variable is strict.
        assert!(
            select(&cfg(Some(("erdma", "ERDMA_NCCL_DEVICES"))), &[])
                .unwrap_err()
                .contains("selects no device")
        );
        let s = select(&cfg(Some(("soft,rxe0", "ERDMA_NCCL_DEVICES"))), &k).unwrap();
        assert_eq!((s.kernel, s.soft), (names(&["rxe0"]), vec![None]));
    }

    #[test]
    fn automatic_soft_addresses_follow_the_local_rank() {
        let base = Ipv4Addr::new(127, 0, 0, 2);
        assert_eq!(soft_address(base, None, 0), Some(base));
        assert_eq!(
            soft_address(base, Some(3), 0),
            Some(Ipv4Addr::new(127, 0, 0, 5))
        );
        assert_eq!(
            soft_address(base, Some(3), 2),
            Some(Ipv4Addr::new(127, 0, 0, 7))
        );
        assert_eq!(
            soft_address(Ipv4Addr::new(127, 255, 255, 255), Some(1), 0),
            None
        );
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("128K"), Some(128 << 10));
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("2m"), Some(2 << 20));
        assert_eq!(parse_bytes("x"), None);
    }
}
