//! The host's IPv4 interfaces as soft devices see them: the addresses a device can bind, the
//! MTU of the link holding one, and the devices this host offers.

#![allow(unsafe_code)] // getifaddrs

use std::net::Ipv4Addr;

use crate::vocab::{DeviceInfo, ProviderKind, Transport};

/// The MTU of the interface holding `addr`, from sysfs.
pub(crate) fn link_mtu(addr: Ipv4Addr) -> Option<u32> {
    if addr.is_loopback() {
        return std::fs::read_to_string("/sys/class/net/lo/mtu")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .or(Some(65536));
    }
    let ifname = interface_of(addr)?;
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Every local IPv4 address with its interface name.
fn local_ipv4() -> Vec<(String, Ipv4Addr)> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `ifap` is a valid out-parameter; the list is freed below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return out;
    }
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // The sockaddr_in is read only for AF_INET.
            // SAFETY: `ifa_addr` is non-null and points at a sockaddr at least its family's size.
            let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
            if family == libc::AF_INET {
                // SAFETY: AF_INET addresses are sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                // SAFETY: `ifa_name` is a NUL-terminated string owned by the list.
                let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
                    .to_string_lossy()
                    .into_owned();
                out.push((name, ip));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: frees the list getifaddrs returned, once.
    unsafe { libc::freeifaddrs(ifap) };
    out
}

fn interface_of(addr: Ipv4Addr) -> Option<String> {
    local_ipv4()
        .into_iter()
        .find(|(_, a)| *a == addr)
        .map(|(n, _)| n)
}

/// Soft devices that can be opened here: one per local IPv4 address (any 127.x.y.z works too).
pub(crate) fn list_devices() -> Vec<DeviceInfo> {
    let mut addrs: Vec<Ipv4Addr> = local_ipv4().into_iter().map(|(_, a)| a).collect();
    if !addrs.contains(&Ipv4Addr::LOCALHOST) {
        addrs.insert(0, Ipv4Addr::LOCALHOST);
    }
    addrs.sort_by_key(|a| (!a.is_loopback(), *a));
    addrs.dedup();
    addrs
        .into_iter()
        .map(|a| DeviceInfo {
            name: format!("soft:{a}"),
            provider: ProviderKind::Soft,
            transport: Transport::Ib,
            node_guid: node_guid(a),
        })
        .collect()
}

pub(crate) fn node_guid(addr: Ipv4Addr) -> u64 {
    let o = addr.octets();
    u64::from_be_bytes([0x02, 0x1d, 0xed, 0xff, o[0], o[1], o[2], o[3]])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::Mtu;

    #[test]
    fn guid_and_listing() {
        let list = list_devices();
        assert!(list.iter().any(|d| d.name == "soft:127.0.0.1"));
        assert_eq!(
            node_guid(Ipv4Addr::new(10, 0, 0, 1)) & 0xffff_ffff,
            0x0a00_0001
        );
    }

    #[test]
    fn loopback_mtu_allows_4096() {
        assert_eq!(
            link_mtu(Ipv4Addr::LOCALHOST).and_then(Mtu::for_link_mtu),
            Some(Mtu::Mtu4096)
        );
    }
}
