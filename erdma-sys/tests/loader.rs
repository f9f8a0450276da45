//! Loading the real libibverbs and librdmacm of this machine and calling functions that need no
//! RDMA device. With `ERDMA_SYS_NO_RDMA_CORE=1` (a machine without rdma-core) the tests instead
//! require that loading fails with a `LoadError` naming the library.

use std::ffi::{CStr, c_void};
use std::io;
use std::os::raw::c_int;
use std::ptr;

use erdma_sys::{IbVerbs, LoadError, RdmaCm, Symbol};

fn rdma_core_expected() -> bool {
    std::env::var_os("ERDMA_SYS_NO_RDMA_CORE").is_none()
}

/// Asserts the error of a machine without rdma-core.
fn assert_not_installed(e: &LoadError, file: &str) {
    assert!(
        !rdma_core_expected(),
        "{file} should load on this machine (set ERDMA_SYS_NO_RDMA_CORE=1 where rdma-core is \
         not installed): {e}"
    );
    assert!(matches!(e, LoadError::Library { .. }), "{e:?}");
    assert_eq!(e.library(), file);
    assert!(e.to_string().contains(file) && e.to_string().contains("install rdma-core"));
}

fn cstr(p: *const std::os::raw::c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: the rdma-core string functions return static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[test]
fn ibverbs_loads_and_device_list_does_not_crash() {
    let lib = match erdma_sys::ibverbs() {
        Ok(lib) => lib,
        Err(e) => return assert_not_installed(&e, "libibverbs.so.1"),
    };
    assert!(rdma_core_expected() || std::env::var_os("ERDMA_IBVERBS_LIB").is_some());
    assert_eq!(lib.library(), IbVerbs::DEFAULT_FILE);
    // The same table on every call.
    assert!(ptr::eq(lib, erdma_sys::ibverbs().expect("cached")));

    let mut n: c_int = -1;
    // SAFETY: `n` is a valid out-parameter; a returned list is freed below.
    let list = unsafe { (lib.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        // A kernel without RDMA support: libibverbs says so through errno (ENOSYS).
        let err = io::Error::last_os_error();
        let code = err.raw_os_error().unwrap_or(0);
        assert_ne!(code, 0, "NULL device list without errno");
        eprintln!("ibv_get_device_list: NULL, errno {code} ({err})");
    } else {
        assert!(n >= 0);
        // SAFETY: the list holds `n` device pointers followed by NULL.
        let devs = unsafe { std::slice::from_raw_parts(list, n as usize + 1) };
        for (i, &dev) in devs[..n as usize].iter().enumerate() {
            assert!(!dev.is_null());
            // SAFETY: `dev` is a device of the live list.
            let name = cstr(unsafe { (lib.ibv_get_device_name)(dev) });
            assert!(!name.is_empty());
            eprintln!("device {i}: {name}");
        }
        assert!(devs[n as usize].is_null(), "NULL-terminated");
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { (lib.ibv_free_device_list)(list) };
    }
}

#[test]
fn ibverbs_string_functions_answer() {
    let lib = match erdma_sys::ibverbs() {
        Ok(lib) => lib,
        Err(e) => return assert_not_installed(&e, "libibverbs.so.1"),
    };
    // SAFETY: a pure function over an enum value; unknown values are allowed.
    let status = |v| cstr(unsafe { (lib.ibv_wc_status_str)(v) });
    // SAFETY: as above.
    let port = |v| cstr(unsafe { (lib.ibv_port_state_str)(v) });
    let ok = status(erdma_sys::IBV_WC_SUCCESS);
    let retry = status(erdma_sys::IBV_WC_RETRY_EXC_ERR);
    let unknown = status(9999);
    let active = port(erdma_sys::IBV_PORT_ACTIVE);
    assert!(ok.contains("success"), "{ok}");
    assert!(retry.contains("retry"), "{retry}");
    assert!(unknown.contains("unknown"), "{unknown}");
    assert!(active.to_ascii_lowercase().contains("active"), "{active}");
}

/// Opens the library a second time (reference-counted by the loader) to compare lookups.
fn dlopen(file: &CStr) -> *mut c_void {
    // SAFETY: a valid NUL-terminated name; the handle is closed by the caller.
    let h = unsafe { libc::dlopen(file.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "{file:?} opens");
    h
}

fn lookups(h: *mut c_void, s: &Symbol) -> (usize, usize) {
    // SAFETY: an open handle and NUL-terminated names.
    let default = unsafe { libc::dlsym(h, s.name.as_ptr()) };
    // SAFETY: as above.
    let pinned = unsafe { libc::dlvsym(h, s.name.as_ptr(), s.version.as_ptr()) };
    (default.addr(), pinned.addr())
}

/// For every function of both tables, the symbol version the table pins is the library's
/// default version, i.e. exactly what a program linked against the library would bind.
#[test]
fn pinned_symbol_versions_are_the_default_ones() {
    let (Ok(lib), Ok(cm)) = (erdma_sys::ibverbs(), erdma_sys::rdmacm()) else {
        assert!(!rdma_core_expected(), "rdma-core should load here");
        return;
    };
    for (file, symbols) in [
        (c"libibverbs.so.1", IbVerbs::SYMBOLS),
        (c"librdmacm.so.1", RdmaCm::SYMBOLS),
    ] {
        let h = dlopen(file);
        for s in symbols {
            let (default, pinned) = lookups(h, s);
            if s.required {
                assert_ne!(pinned, 0, "{} at {} missing", s.name_str(), s.version_str());
            }
            assert_eq!(
                default,
                pinned,
                "{}: the default version is not {}",
                s.name_str(),
                s.version_str()
            );
        }
        // SAFETY: closes the extra reference taken above.
        unsafe { libc::dlclose(h) };
    }

    // The table holds those very addresses.
    let h = dlopen(c"libibverbs.so.1");
    let addr_of = |name: &str| {
        let s = IbVerbs::SYMBOLS
            .iter()
            .find(|s| s.name_str() == name)
            .expect("listed");
        lookups(h, s).1
    };
    assert_eq!(lib.ibv_query_port as usize, addr_of("ibv_query_port"));
    assert_eq!(lib.ibv_reg_mr as usize, addr_of("ibv_reg_mr"));
    assert_eq!(
        lib.ibv_get_device_list as usize,
        addr_of("ibv_get_device_list")
    );
    assert_eq!(
        lib.ibv_reg_dmabuf_mr.map_or(0, |f| f as usize),
        addr_of("ibv_reg_dmabuf_mr")
    );
    // Optional functions are present exactly when the library exports them.
    for s in IbVerbs::SYMBOLS.iter().filter(|s| !s.required) {
        let exported = lookups(h, s).1 != 0;
        assert_eq!(
            lib.optional_present().contains(&s.name_str()),
            exported,
            "{}",
            s.name_str()
        );
    }
    // The old ABI versions still exist beside the pinned ones and are different functions, so
    // pinning matters.
    for name in [c"ibv_query_port", c"ibv_reg_mr", c"ibv_create_qp"] {
        // SAFETY: an open handle and NUL-terminated names.
        let old = unsafe { libc::dlvsym(h, name.as_ptr(), c"IBVERBS_1.0".as_ptr()) };
        // SAFETY: as above.
        let new = unsafe { libc::dlvsym(h, name.as_ptr(), c"IBVERBS_1.1".as_ptr()) };
        assert!(!old.is_null() && !new.is_null() && old != new, "{name:?}");
    }
    // SAFETY: closes the extra reference.
    unsafe { libc::dlclose(h) };
    assert_eq!(cm.library(), RdmaCm::DEFAULT_FILE);
}

#[test]
fn rdmacm_loads_and_event_channel_does_not_crash() {
    let cm = match erdma_sys::rdmacm() {
        Ok(cm) => cm,
        Err(e) => return assert_not_installed(&e, "librdmacm.so.1"),
    };
    // SAFETY: a pure function over an enum value.
    let name = cstr(unsafe { (cm.rdma_event_str)(erdma_sys::RDMA_CM_EVENT_ESTABLISHED) });
    assert_eq!(name, "RDMA_CM_EVENT_ESTABLISHED");

    // SAFETY: no arguments; a returned channel is destroyed below.
    let ch = unsafe { (cm.rdma_create_event_channel)() };
    if ch.is_null() {
        let err = io::Error::last_os_error();
        assert_ne!(
            err.raw_os_error().unwrap_or(0),
            0,
            "NULL channel without errno"
        );
        eprintln!("rdma_create_event_channel: NULL, {err}");
    } else {
        // SAFETY: the channel was just created and is destroyed once.
        unsafe { (cm.rdma_destroy_event_channel)(ch) };
    }
}
