//! Devices: the list, names, and the typed attributes a device and its ports report.
//!
//! The attributes are plain values ([`DeviceInfo`], [`DeviceAttr`], [`PortAttr`], [`Gid`] and
//! [`GidEntry`], [`Mtu`]); opening a device is [`crate::Context::open`].

use crate::error::Result;
pub use crate::soft::counter;
pub use crate::vocab::{
    AtomicCap, DeviceAttr, DeviceInfo, Gid, GidEntry, GidType, LinkLayer, Mtu, PortAttr,
    PortCounters, PortState, ProviderKind, Transport, find_ipv4_gid,
};

/// Lists every device this machine can use: kernel devices first, then the soft devices that
/// can be opened on this host's loopback addresses.
///
/// Without libibverbs (or without kernel devices) the list holds only soft devices; the soft device
/// can always be opened on any local IPv4 address, so the list shows `soft:127.0.0.1` as the
/// default.
///
/// # Errors
/// Never fails for a missing libibverbs (the verbs part of the list is then empty); fails only when
/// libibverbs is present and listing its devices fails.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    Ok(crate::provider::list_devices())
}

/// The name of the device a program gets when it asks for none: the first kernel device, or the
/// soft device on 127.0.0.1 where there is no kernel device.
///
/// The environment variable `ERDMA_DEVICE` overrides the choice.
pub fn default_device_name() -> String {
    if let Ok(name) = std::env::var("ERDMA_DEVICE") {
        if !name.is_empty() {
            return name;
        }
    }
    crate::provider::first_device_name()
}
