//! Drives the built plugin library the way NCCL does: `dlopen`, `dlsym` of a table symbol, then
//! the table's functions with NCCL's own calling patterns (polling `connect`/`accept` until they
//! return a connection, `isend`/`irecv` until they return a request, `test` until done).
//!
//! The table layouts here are written from NCCL's headers independently of the plugin's own, so
//! a layout mistake on either side shows up as a failing test.
#![allow(dead_code, unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub type Ptr = *mut c_void;
pub type PPtr = *mut *mut c_void;

pub const SUCCESS: c_int = 0;
pub const SYSTEM_ERROR: c_int = 2;
pub const INTERNAL_ERROR: c_int = 3;
pub const INVALID_ARGUMENT: c_int = 4;
pub const INVALID_USAGE: c_int = 5;
pub const REMOTE_ERROR: c_int = 6;
pub const PTR_HOST: c_int = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropsV8 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropsV11 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub vdev_ndevs: c_int,
    pub vdev_devs: [c_int; 4],
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
    pub max_multi_request_size: c_int,
}

type F = Option<unsafe extern "C" fn()>;

#[repr(C)]
pub struct NetV8 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> c_int>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV8) -> c_int>,
    pub listen: Option<unsafe extern "C" fn(c_int, Ptr, PPtr) -> c_int>,
    pub connect: Option<unsafe extern "C" fn(c_int, Ptr, PPtr, PPtr) -> c_int>,
    pub accept: Option<unsafe extern "C" fn(Ptr, PPtr, PPtr) -> c_int>,
    pub reg_mr: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PPtr) -> c_int>,
    pub reg_mr_dma_buf: F,
    pub dereg_mr: Option<unsafe extern "C" fn(Ptr, Ptr) -> c_int>,
    pub isend: Option<unsafe extern "C" fn(Ptr, Ptr, c_int, c_int, Ptr, PPtr) -> c_int>,
    pub irecv:
        Option<unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, *mut c_int, PPtr, PPtr) -> c_int>,
    pub iflush: Option<unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, PPtr, PPtr) -> c_int>,
    pub test: Option<unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> c_int>,
    pub close_send: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub close_recv: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub close_listen: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub get_device_mr: F,
    pub irecv_consumed: F,
}

#[repr(C)]
pub struct NetV11 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(PPtr, u64, Ptr, Ptr, Ptr) -> c_int>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> c_int>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV11) -> c_int>,
    pub listen: Option<unsafe extern "C" fn(Ptr, c_int, Ptr, PPtr) -> c_int>,
    pub connect: Option<unsafe extern "C" fn(Ptr, c_int, Ptr, PPtr, PPtr) -> c_int>,
    pub accept: Option<unsafe extern "C" fn(Ptr, PPtr, PPtr) -> c_int>,
    pub reg_mr: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PPtr) -> c_int>,
    pub reg_mr_dma_buf: F,
    pub dereg_mr: Option<unsafe extern "C" fn(Ptr, Ptr) -> c_int>,
    pub isend: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, PPtr) -> c_int>,
    pub irecv: Option<
        unsafe extern "C" fn(Ptr, c_int, PPtr, *mut usize, *mut c_int, PPtr, PPtr, PPtr) -> c_int,
    >,
    pub iflush: Option<unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, PPtr, PPtr) -> c_int>,
    pub test: Option<unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> c_int>,
    pub close_send: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub close_recv: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub close_listen: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub get_device_mr: F,
    pub irecv_consumed: F,
    pub make_vdevice: F,
    pub finalize: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub set_net_attr: F,
}

/// The plugin library's path: `ERDMA_NCCL_PLUGIN`, or the one cargo built next to this test.
pub fn library_path() -> PathBuf {
    if let Ok(p) = std::env::var("ERDMA_NCCL_PLUGIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("the test's path");
    let deps = exe.parent().expect("deps directory");
    for dir in [deps, deps.parent().unwrap_or(deps)] {
        for name in ["libnccl-net-erdma.so", "liberdma_nccl.so"] {
            let p = dir.join(name);
            if p.exists() {
                return p;
            }
        }
    }
    panic!("the plugin library was not built next to {}", exe.display());
}

/// The loaded library (never unloaded: NCCL's own behaviour with `-z nodelete`).
pub struct Lib {
    handle: Ptr,
}

// SAFETY: the handle is only used for dlsym, which is thread-safe.
unsafe impl Send for Lib {}
// SAFETY: as above.
unsafe impl Sync for Lib {}

impl Lib {
    pub fn open() -> Lib {
        let path = library_path();
        let c = CString::new(path.to_string_lossy().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; RTLD_NOW | RTLD_LOCAL as NCCL opens plugins.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {} failed", path.display());
        Lib { handle }
    }

    pub fn symbol(&self, name: &str) -> Ptr {
        let c = CString::new(name).unwrap();
        // SAFETY: a live handle and a NUL-terminated name.
        unsafe { libc::dlsym(self.handle, c.as_ptr()) }
    }

    pub fn v8(&self) -> &'static NetV8 {
        let p = self.symbol("ncclNetPlugin_v8");
        assert!(!p.is_null(), "ncclNetPlugin_v8 is not exported");
        // SAFETY: the symbol is the v8 table, a static of this layout that lives for the
        // process (the library is never unloaded).
        unsafe { &*(p as *const NetV8) }
    }

    pub fn v11(&self) -> &'static NetV11 {
        let p = self.symbol("ncclNetPlugin_v11");
        assert!(!p.is_null(), "ncclNetPlugin_v11 is not exported");
        // SAFETY: as in `v8`, for the v11 table.
        unsafe { &*(p as *const NetV11) }
    }
}

pub fn name_of(p: *const c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: the plugin hands out NUL-terminated strings that live for the process.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A page-aligned host buffer (what NCCL's host buffers are), filled and checked by tests.
pub struct HostBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value.
unsafe impl Send for HostBuf {}

impl HostBuf {
    pub fn new(len: usize) -> HostBuf {
        let len = len.max(1);
        // SAFETY: an anonymous private mapping; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        HostBuf {
            ptr: ptr.cast(),
            len,
        }
    }

    pub fn ptr(&self) -> Ptr {
        self.ptr.cast()
    }

    pub fn at(&self, off: usize) -> Ptr {
        assert!(off <= self.len);
        // SAFETY: within the mapping (checked).
        unsafe { self.ptr.add(off).cast() }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Copies the bytes out (the device may be writing; tests read only after completion).
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        let mut v = vec![0u8; len];
        // SAFETY: the range is inside the mapping; no reference to its bytes is made.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), v.as_mut_ptr(), len) };
        v
    }

    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Pattern bytes for transfer `seed`: every byte depends on its offset and the seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Polls `f` until it gives a value, failing the test after `limit`.
pub fn poll<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

/// Calls one plugin function. The arguments are plain values (ids, pointers the test owns);
/// evaluating them inside the unsafe block hides no unsafe operation.
#[macro_export]
macro_rules! call {
    ($t:expr, $f:ident ( $($a:expr),* $(,)? )) => {{
        let f = $t.$f.expect(concat!(stringify!($f), " is NULL"));
        // SAFETY: a function of the plugin's table, called with the arguments NCCL passes.
        unsafe { f($($a),*) }
    }};
}
