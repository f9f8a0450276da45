//! Logging through NCCL's own logger (the function `init` receives), so the plugin's lines obey
//! `NCCL_DEBUG` / `NCCL_DEBUG_SUBSYS` and land where NCCL's do. Before `init`, or when a host
//! passes no logger (a test harness), warnings go to standard error, and information too when
//! `NCCL_DEBUG` is `INFO` or `TRACE`.

use std::ffi::{CString, c_char, c_int, c_ulong};
use std::sync::RwLock;

/// NCCL's `ncclDebugLogger_t`.
pub type Logger = unsafe extern "C" fn(
    level: c_int,
    flags: c_ulong,
    file: *const c_char,
    line: c_int,
    fmt: *const c_char,
    ...
);

/// NCCL's log levels (`ncclDebugLogLevel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(i32)]
pub enum Level {
    /// `NCCL_LOG_WARN`.
    Warn = 2,
    /// `NCCL_LOG_INFO`.
    Info = 3,
    /// `NCCL_LOG_TRACE`.
    Trace = 5,
}

/// NCCL's `NCCL_INIT` subsystem flag.
pub const INIT: u64 = 0x1;
/// NCCL's `NCCL_NET` subsystem flag.
pub const NET: u64 = 0x10;

static LOGGER: RwLock<Option<Logger>> = RwLock::new(None);

/// Installs (or, with `None`, removes) NCCL's logger.
pub fn set_logger(logger: Option<Logger>) {
    *LOGGER.write().unwrap_or_else(|e| e.into_inner()) = logger;
}

fn stderr_level() -> Level {
    match std::env::var("NCCL_DEBUG").as_deref() {
        Ok(v) if v.eq_ignore_ascii_case("TRACE") => Level::Trace,
        Ok(v) if v.eq_ignore_ascii_case("INFO") => Level::Info,
        _ => Level::Warn,
    }
}

/// Logs one line.
pub fn log(level: Level, subsys: u64, msg: &str) {
    let logger = *LOGGER.read().unwrap_or_else(|e| e.into_inner());
    match logger {
        Some(f) => {
            let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
            call(f, level, subsys, &text);
        }
        None => {
            if level <= stderr_level() {
                let tag = match level {
                    Level::Warn => "WARN",
                    Level::Info => "INFO",
                    Level::Trace => "TRACE",
                };
                eprintln!("erdma-nccl {tag} {msg}");
            }
        }
    }
}

#[allow(unsafe_code)]
fn call(f: Logger, level: Level, subsys: u64, text: &CString) {
    // SAFETY: `f` is the logger NCCL passed to `init`, a C-variadic function of exactly this
    // signature; "%s" consumes one `char*` argument, a NUL-terminated string that outlives the
    // call, and the file name is a static NUL-terminated string.
    unsafe {
        f(
            level as c_int,
            subsys as c_ulong,
            c"erdma-nccl".as_ptr(),
            0,
            c"%s".as_ptr(),
            text.as_ptr(),
        )
    };
}

/// Logs a warning.
macro_rules! log_warn {
    ($($arg:tt)*) => {
        $crate::log::log($crate::log::Level::Warn, $crate::log::NET, &format!($($arg)*))
    };
}

/// Logs information (NCCL_DEBUG=INFO).
macro_rules! log_info {
    ($sub:expr, $($arg:tt)*) => {
        $crate::log::log($crate::log::Level::Info, $sub, &format!($($arg)*))
    };
}

pub(crate) use log_info as info;
pub(crate) use log_warn as warn;
