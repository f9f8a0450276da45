//! What a device and its ports report: [`DeviceInfo`], [`DeviceAttr`], [`PortAttr`], [`Gid`] and
//! [`GidEntry`], [`Mtu`], as plain values.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use super::ParseError;

/// Which provider runs a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProviderKind {
    /// A kernel RDMA device reached through libibverbs (erdma, mlx5, rxe, …).
    Verbs,
    /// The userspace software device (RoCEv2 over UDP port 4791).
    Soft,
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProviderKind::Verbs => "verbs",
            ProviderKind::Soft => "soft",
        })
    }
}

/// The transport a device speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// InfiniBand transport (also RoCE).
    Ib,
    /// iWARP (eRDMA's default mode).
    Iwarp,
    /// Something else.
    Unknown(u32),
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transport::Ib => f.write_str("InfiniBand"),
            Transport::Iwarp => f.write_str("iWARP"),
            Transport::Unknown(n) => write!(f, "unknown ({n})"),
        }
    }
}

/// One entry of the device list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The name to open it by: `erdma_0`, `rxe0`, `soft:127.0.0.2`.
    pub name: String,
    /// Which provider runs it.
    pub provider: ProviderKind,
    /// Its transport.
    pub transport: Transport,
    /// Node GUID (0 where the device has none).
    pub node_guid: u64,
}

/// An IB MTU, as the verbs enum numbers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// Every MTU, smallest first.
    pub const ALL: [Mtu; 5] = [
        Mtu::Mtu256,
        Mtu::Mtu512,
        Mtu::Mtu1024,
        Mtu::Mtu2048,
        Mtu::Mtu4096,
    ];

    /// Bytes of payload per packet.
    pub const fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    /// The verbs enum value (`IBV_MTU_*`).
    pub const fn as_enum(self) -> u32 {
        self as u32
    }

    /// From the verbs enum value.
    pub fn from_enum(v: u32) -> Option<Mtu> {
        Mtu::ALL.iter().copied().find(|m| m.as_enum() == v)
    }

    /// From a byte count (256, 512, 1024, 2048, 4096).
    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        Mtu::ALL.iter().copied().find(|m| m.bytes() == bytes)
    }

    /// The largest IB MTU that fits a link of `link_mtu` bytes (RoCEv2 headers take up to 80
    /// bytes of it, as rxe and erdma compute it); `None` below 256 + 80.
    pub fn for_link_mtu(link_mtu: u32) -> Option<Mtu> {
        Mtu::ALL
            .iter()
            .rev()
            .copied()
            .find(|m| m.bytes() + 80 <= link_mtu)
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

impl FromStr for Mtu {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Mtu, ParseError> {
        s.trim()
            .parse::<u32>()
            .ok()
            .and_then(Mtu::from_bytes)
            .ok_or_else(|| ParseError::new("MTU", s, "256, 512, 1024, 2048 or 4096"))
    }
}

/// A 16-byte global identifier. On RoCEv2 it is an IPv6 address or an IPv4-mapped one
/// (`::ffff:a.b.c.d`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID.
    pub const ZERO: Gid = Gid([0; 16]);

    /// The IPv4-mapped GID of an address.
    pub fn from_ipv4(addr: Ipv4Addr) -> Gid {
        Gid(addr.to_ipv6_mapped().octets())
    }

    /// The GID of an IP address (IPv4 addresses map to `::ffff:a.b.c.d`).
    pub fn from_ip(addr: IpAddr) -> Gid {
        match addr {
            IpAddr::V4(v4) => Gid::from_ipv4(v4),
            IpAddr::V6(v6) => Gid(v6.octets()),
        }
    }

    /// The IPv4 address inside an IPv4-mapped GID.
    pub fn to_ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }

    /// The IP address this GID stands for on RoCEv2.
    pub fn to_ip(&self) -> IpAddr {
        match self.to_ipv4() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(self.0)),
        }
    }

    /// Whether this GID is `::ffff:a.b.c.d`.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.to_ipv4().is_some()
    }

    /// Whether this GID is an IPv6 link-local address (`fe80::/10`), index 0 on RoCE devices.
    pub fn is_link_local(&self) -> bool {
        self.0[0] == 0xfe && (self.0[1] & 0xc0) == 0x80
    }

    /// Whether every byte is zero (an empty table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The subnet prefix (first 8 bytes, big-endian).
    pub fn subnet_prefix(&self) -> u64 {
        u64::from_be_bytes(self.0[..8].try_into().unwrap_or_default())
    }

    /// The interface id (last 8 bytes, big-endian).
    pub fn interface_id(&self) -> u64 {
        u64::from_be_bytes(self.0[8..].try_into().unwrap_or_default())
    }
}

impl From<IpAddr> for Gid {
    fn from(addr: IpAddr) -> Gid {
        Gid::from_ip(addr)
    }
}

impl From<Ipv4Addr> for Gid {
    fn from(addr: Ipv4Addr) -> Gid {
        Gid::from_ipv4(addr)
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The verbs tools print GIDs as eight groups of four hex digits.
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

impl FromStr for Gid {
    type Err = ParseError;

    /// Parses an IPv6 address (`::ffff:10.0.0.1`, `fe80::1`), an IPv4 address (mapped), or 32 hex
    /// digits with optional colons.
    fn from_str(s: &str) -> Result<Gid, ParseError> {
        let s = s.trim();
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Gid::from_ip(ip));
        }
        let hex: String = s.chars().filter(|c| *c != ':').collect();
        if hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()) {
            let mut out = [0u8; 16];
            for (i, byte) in out.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                    .map_err(|_| ParseError::new("GID", s, "an IP address or 32 hex digits"))?;
            }
            return Ok(Gid(out));
        }
        Err(ParseError::new("GID", s, "an IP address or 32 hex digits"))
    }
}

/// What kind of address a GID table entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GidType {
    /// InfiniBand, or RoCE v1.
    IbRoceV1,
    /// RoCE v2 (UDP-encapsulated): what eRDMA, rxe and the soft device use.
    RoceV2,
    /// iWARP: the GID is the MAC address.
    Iwarp,
    /// A type this SDK does not know.
    Unknown(u32),
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GidType::IbRoceV1 => f.write_str("IB/RoCE v1"),
            GidType::RoceV2 => f.write_str("RoCE v2"),
            GidType::Iwarp => f.write_str("iWARP"),
            GidType::Unknown(n) => write!(f, "unknown ({n})"),
        }
    }
}

/// One populated entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index (what `sgid_index` takes).
    pub index: u8,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
}

/// Finds the RoCEv2 IPv4-mapped GID in a table, which is what eRDMA (compat/RoCEv2 modes), rxe and
/// the soft device need for routable traffic. It is usually at index 1, but that is never assumed.
pub fn find_ipv4_gid(table: &[GidEntry]) -> Option<GidEntry> {
    table
        .iter()
        .find(|e| e.gid_type == GidType::RoceV2 && e.gid.is_ipv4_mapped())
        .or_else(|| table.iter().find(|e| e.gid.is_ipv4_mapped()))
        .copied()
}

/// A port's logical state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortState {
    /// No link.
    Down,
    /// Link up, not yet configured.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready for traffic.
    Active,
    /// Active, deferred.
    ActiveDefer,
    /// Anything else (the verbs value).
    Other(u32),
}

impl PortState {
    /// From the verbs value.
    pub const fn from_raw(v: u32) -> PortState {
        match v {
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            n => PortState::Other(n),
        }
    }
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortState::Down => f.write_str("PORT_DOWN"),
            PortState::Init => f.write_str("PORT_INIT"),
            PortState::Armed => f.write_str("PORT_ARMED"),
            PortState::Active => f.write_str("PORT_ACTIVE"),
            PortState::ActiveDefer => f.write_str("PORT_ACTIVE_DEFER"),
            PortState::Other(n) => write!(f, "PORT_STATE({n})"),
        }
    }
}

/// A port's link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// Not reported (iWARP devices).
    Unspecified,
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE, eRDMA, the soft device).
    Ethernet,
    /// Anything else.
    Other(u8),
}

impl LinkLayer {
    /// From the verbs value.
    pub const fn from_raw(v: u8) -> LinkLayer {
        match v {
            0 => LinkLayer::Unspecified,
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            n => LinkLayer::Other(n),
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkLayer::Unspecified => f.write_str("Unspecified"),
            LinkLayer::InfiniBand => f.write_str("InfiniBand"),
            LinkLayer::Ethernet => f.write_str("Ethernet"),
            LinkLayer::Other(n) => write!(f, "Other({n})"),
        }
    }
}

/// How a device supports atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AtomicCap {
    /// No atomics.
    None,
    /// Atomic with respect to this HCA only.
    Hca,
    /// Atomic with respect to the HCA and the CPU.
    Global,
}

impl fmt::Display for AtomicCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AtomicCap::None => "ATOMIC_NONE",
            AtomicCap::Hca => "ATOMIC_HCA",
            AtomicCap::Global => "ATOMIC_GLOB",
        })
    }
}

/// What `query_device` reports, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Firmware version.
    pub fw_ver: String,
    /// Node GUID.
    pub node_guid: u64,
    /// System image GUID.
    pub sys_image_guid: u64,
    /// Largest memory region, bytes.
    pub max_mr_size: u64,
    /// Supported page sizes (bit mask).
    pub page_size_cap: u64,
    /// PCI vendor id.
    pub vendor_id: u32,
    /// PCI part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Queue pairs.
    pub max_qp: u32,
    /// Work requests per queue.
    pub max_qp_wr: u32,
    /// Capability flags (`ibv_device_cap_flags`).
    pub device_cap_flags: u64,
    /// SGEs per work request.
    pub max_sge: u32,
    /// SGEs per RDMA READ.
    pub max_sge_rd: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Entries per completion queue.
    pub max_cqe: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Protection domains.
    pub max_pd: u32,
    /// Outstanding READ/atomics per QP as target.
    pub max_qp_rd_atom: u32,
    /// Outstanding READ/atomics per QP as initiator.
    pub max_qp_init_rd_atom: u32,
    /// Atomics support.
    pub atomic_cap: AtomicCap,
    /// Shared receive queues.
    pub max_srq: u32,
    /// Memory windows.
    pub max_mw: u32,
    /// Address handles.
    pub max_ah: u32,
    /// Physical ports.
    pub phys_port_cnt: u8,
}

/// What `query_port` reports, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortAttr {
    /// Logical state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use.
    pub active_mtu: Mtu,
    /// GID table length.
    pub gid_tbl_len: u32,
    /// Capability flags.
    pub port_cap_flags: u32,
    /// Largest message, bytes.
    pub max_msg_sz: u32,
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Active link width (verbs encoding).
    pub active_width: u8,
    /// Active link speed (verbs encoding).
    pub active_speed: u32,
}

/// A port's transport counters: cumulative values by name, as the device keeps them (from when
/// the device came up, across every queue pair, destroyed ones included).
///
/// Names follow the kernel's `hw_counters` (`/sys/class/infiniband/DEV/ports/N/hw_counters`,
/// what `rdma statistic` shows): a verbs device reports whatever its driver exports there and in
/// `counters/` (the kernel refreshes `hw_counters` at most every `lifespan` ms, 10 by default);
/// the soft device reports the [`crate::soft::counter`] names, live. Where rxe has a counter for the same
/// event the soft device uses its name, so one program can watch retries on either:
/// `sent_pkts`, `rcvd_pkts`, `duplicate_request`, `out_of_seq_request`, `rcvd_rnr_err`,
/// `send_rnr_err`, `completer_retry_err` (the soft device's exact rules are on each constant).
///
/// ```no_run
/// # fn main() -> erdma::Result<()> {
/// let ctx = erdma::Context::open("soft:127.0.0.1")?;
/// let before = ctx.port_counters(1)?;
/// // ... traffic ...
/// let delta = ctx.port_counters(1)?.since(&before);
/// println!("{} retries", delta.get(erdma::soft::counter::RETRIES).unwrap_or(0));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortCounters {
    /// Sorted by name, names unique.
    entries: Vec<(String, u64)>,
}

impl PortCounters {
    /// Counters from `(name, value)` pairs; a repeated name keeps its last value.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (String, u64)>) -> PortCounters {
        let mut entries: Vec<(String, u64)> = pairs.into_iter().collect();
        // Stable: among equal names the last one given stays last, and survives the dedup below.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out: Vec<(String, u64)> = Vec::with_capacity(entries.len());
        for (name, v) in entries {
            match out.last_mut() {
                Some(last) if last.0 == name => last.1 = v,
                _ => out.push((name, v)),
            }
        }
        PortCounters { entries: out }
    }

    /// The counter called `name`, if the device has it.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.entries
            .binary_search_by(|(n, _)| n.as_str().cmp(name))
            .ok()
            .map(|i| self.entries[i].1)
    }

    /// Every counter, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.entries.iter().map(|(n, v)| (n.as_str(), *v))
    }

    /// Number of counters.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the device reports no counters at all.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What each counter grew by since `earlier` (a counter `earlier` lacks counts from 0; one
    /// that went down, as a driver reset does, reads 0).
    pub fn since(&self, earlier: &PortCounters) -> PortCounters {
        PortCounters {
            entries: self
                .entries
                .iter()
                .map(|(n, v)| (n.clone(), v.saturating_sub(earlier.get(n).unwrap_or(0))))
                .collect(),
        }
    }
}

impl std::fmt::Display for PortCounters {
    /// One `name value` per line, by name.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (n, v) in &self.entries {
            writeln!(f, "{n} {v}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_numbers() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::Mtu1024.as_enum(), 3);
        assert_eq!(Mtu::from_enum(5), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::from_enum(6), None);
        assert_eq!(Mtu::for_link_mtu(1500), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::for_link_mtu(9000), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::for_link_mtu(1400), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::for_link_mtu(300), None);
        assert_eq!("2048".parse::<Mtu>().unwrap(), Mtu::Mtu2048);
        assert!("1500".parse::<Mtu>().is_err());
    }

    #[test]
    fn port_counters_look_up_by_name_and_subtract() {
        let a = PortCounters::from_pairs([
            ("sent_pkts".to_string(), 10),
            ("drops".to_string(), 3),
            ("sent_pkts".to_string(), 12),
        ]);
        assert_eq!(a.len(), 2);
        assert_eq!(a.get("sent_pkts"), Some(12));
        assert_eq!(a.get("drops"), Some(3));
        assert_eq!(a.get("rcvd_pkts"), None);
        let names: Vec<&str> = a.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["drops", "sent_pkts"]);
        let b = PortCounters::from_pairs([
            ("sent_pkts".to_string(), 20),
            ("drops".to_string(), 1),
            ("acks_sent".to_string(), 4),
        ]);
        let d = b.since(&a);
        assert_eq!(d.get("sent_pkts"), Some(8));
        // Went down (a reset): 0, not a wrapped huge number.
        assert_eq!(d.get("drops"), Some(0));
        // New since: counts from 0.
        assert_eq!(d.get("acks_sent"), Some(4));
        assert_eq!(b.to_string(), "acks_sent 4\ndrops 1\nsent_pkts 20\n");
        assert!(PortCounters::default().is_empty());
    }

    #[test]
    fn gid_forms() {
        let g = Gid::from_ipv4(Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(g.to_string(), "0000:0000:0000:0000:0000:ffff:0a4d:0001");
        assert_eq!(g.to_ipv4(), Some(Ipv4Addr::new(10, 77, 0, 1)));
        assert_eq!("::ffff:10.77.0.1".parse::<Gid>().unwrap(), g);
        assert_eq!("10.77.0.1".parse::<Gid>().unwrap(), g);
        assert_eq!(
            "00000000000000000000ffff0a4d0001".parse::<Gid>().unwrap(),
            g
        );
        assert_eq!(g.to_string().parse::<Gid>().unwrap(), g);
        let ll: Gid = "fe80::1".parse().unwrap();
        assert!(ll.is_link_local() && !ll.is_ipv4_mapped());
        assert!("zz".parse::<Gid>().is_err());
    }

    #[test]
    fn ipv4_gid_is_found_wherever_it_is() {
        let ll = GidEntry {
            index: 0,
            gid: "fe80::1".parse().unwrap(),
            gid_type: GidType::RoceV2,
        };
        let v4 = GidEntry {
            index: 2,
            gid: "::ffff:192.168.1.7".parse().unwrap(),
            gid_type: GidType::RoceV2,
        };
        let v6 = GidEntry {
            index: 1,
            gid: "2001:db8::7".parse().unwrap(),
            gid_type: GidType::RoceV2,
        };
        assert_eq!(find_ipv4_gid(&[ll, v6, v4]), Some(v4));
        assert_eq!(find_ipv4_gid(&[ll, v6]), None);
    }
}
