//! Opening a shared library with `dlopen` and finding versioned symbols in it, and the one error
//! type of the crate, [`LoadError`].
//!
//! Owns the raw `dlopen`/`dlvsym`/`dlsym`/`dlerror` calls. Must not: know about verbs (the
//! tables in `crate::table` say which symbols they need) or ever `dlclose` a library whose
//! symbols were handed out.

use std::ffi::{CStr, CString, OsString, c_void};
use std::fmt;
use std::os::unix::ffi::OsStringExt;
use std::ptr::NonNull;

/// Why a library or one of its required functions could not be loaded.
///
/// Returned (as a clone of the first, cached, failure) by [`crate::ibverbs`] and
/// [`crate::rdmacm`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadError {
    /// `dlopen` failed: the library is not installed, not found, or not loadable.
    Library {
        /// The file name that was passed to `dlopen` (after the environment override).
        library: String,
        /// What to install to get it.
        hint: &'static str,
        /// The `dlerror()` text.
        dlerror: String,
    },
    /// The library was opened but lacks a function the crate requires.
    Symbol {
        /// The file name that was opened.
        library: String,
        /// The missing function.
        symbol: &'static str,
        /// The symbol version that was asked for first (`IBVERBS_1.1`, …).
        version: &'static str,
        /// The `dlerror()` text of the last lookup.
        dlerror: String,
    },
}

impl LoadError {
    /// The library file name the error is about.
    pub fn library(&self) -> &str {
        match self {
            LoadError::Library { library, .. } | LoadError::Symbol { library, .. } => library,
        }
    }

    /// The missing function, when the library itself was found.
    pub fn symbol(&self) -> Option<&'static str> {
        match self {
            LoadError::Library { .. } => None,
            LoadError::Symbol { symbol, .. } => Some(symbol),
        }
    }

    /// The `dlerror()` text.
    pub fn dlerror(&self) -> &str {
        match self {
            LoadError::Library { dlerror, .. } | LoadError::Symbol { dlerror, .. } => dlerror,
        }
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Library {
                library,
                hint,
                dlerror,
            } => write!(f, "{library} could not be loaded ({hint}): {dlerror}"),
            LoadError::Symbol {
                library,
                symbol,
                version,
                dlerror,
            } => write!(
                f,
                "{library} lacks the required function {symbol} (symbol version {version}; \
                 rdma-core too old, or not the expected library): {dlerror}"
            ),
        }
    }
}

impl std::error::Error for LoadError {}

/// One function a table resolves: its name and the symbol version a program linked against the
/// rdma-core headers of these bindings would record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Symbol {
    /// The exported function name.
    pub name: &'static CStr,
    /// Its symbol version in the library's version script (`IBVERBS_1.1`, `RDMACM_1.0`, …).
    pub version: &'static CStr,
    /// Whether loading fails without it (otherwise the table holds `None`).
    pub required: bool,
}

impl Symbol {
    /// The name as `&str` (symbol names are ASCII).
    pub fn name_str(&self) -> &'static str {
        self.name.to_str().unwrap_or("<non-UTF-8 symbol name>")
    }

    /// The version as `&str` (version names are ASCII).
    pub fn version_str(&self) -> &'static str {
        self.version.to_str().unwrap_or("<non-UTF-8 version name>")
    }
}

/// An opened shared library. It is never closed once a table was built from it, because the
/// table's function pointers live for the rest of the process.
#[derive(Debug)]
pub(crate) struct Library {
    handle: NonNull<c_void>,
    name: String,
}

/// Reads and clears the calling thread's `dlerror()` state.
fn take_dlerror() -> Option<String> {
    // SAFETY: dlerror takes no arguments; glibc keeps its state per thread.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        return None;
    }
    // SAFETY: a non-null dlerror result is a NUL-terminated string that stays valid until the
    // next dl* call on this thread; it is copied before any such call.
    let text = unsafe { CStr::from_ptr(msg) };
    Some(text.to_string_lossy().into_owned())
}

impl Library {
    /// Opens `default`, or the file named by the environment variable `env_var` when that is
    /// set and not empty.
    ///
    /// # Errors
    ///
    /// [`LoadError::Library`] with `hint` when `dlopen` fails or the name contains a NUL byte.
    pub(crate) fn open(
        env_var: &str,
        default: &str,
        hint: &'static str,
    ) -> Result<Library, LoadError> {
        let name: OsString = match std::env::var_os(env_var) {
            Some(v) if !v.is_empty() => v,
            _ => OsString::from(default),
        };
        let display = name.to_string_lossy().into_owned();
        let fail = |dlerror: String| LoadError::Library {
            library: display.clone(),
            hint,
            dlerror,
        };
        let c_name = CString::new(name.into_vec())
            .map_err(|_| fail(format!("the name given in {env_var} contains a NUL byte")))?;
        take_dlerror();
        // SAFETY: `c_name` is a valid NUL-terminated path. Opening runs the library's
        // initialisers, which for rdma-core only set up internal state.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        match NonNull::new(handle) {
            Some(handle) => Ok(Library {
                handle,
                name: display,
            }),
            None => {
                Err(fail(take_dlerror().unwrap_or_else(|| {
                    "dlopen failed without a message".into()
                })))
            }
        }
    }

    /// The file name that was opened.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Finds `symbol`: first at exactly its recorded version (what a link-time binding would
    /// use), then, for libraries built without symbol versions, by plain name.
    ///
    /// # Errors
    ///
    /// The `dlerror()` text when neither lookup finds it.
    pub(crate) fn lookup(&self, symbol: &Symbol) -> Result<NonNull<c_void>, String> {
        take_dlerror();
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: the handle is open; name and version are NUL-terminated strings.
            let p = unsafe {
                libc::dlvsym(
                    self.handle.as_ptr(),
                    symbol.name.as_ptr(),
                    symbol.version.as_ptr(),
                )
            };
            if let Some(p) = NonNull::new(p) {
                return Ok(p);
            }
            take_dlerror();
        }
        // SAFETY: the handle is open; the name is a NUL-terminated string.
        let p = unsafe { libc::dlsym(self.handle.as_ptr(), symbol.name.as_ptr()) };
        NonNull::new(p)
            .ok_or_else(|| take_dlerror().unwrap_or_else(|| "symbol resolves to NULL".into()))
    }

    /// Closes a library that no table was built from.
    pub(crate) fn close(self) {
        // SAFETY: the handle is open and no pointer obtained from it is kept: this is only
        // called when building the table failed, and the partial table is dropped.
        unsafe { libc::dlclose(self.handle.as_ptr()) };
    }
}
