//! The error path of loading: a library that does not exist, or one that lacks the required
//! functions, named through the `ERDMA_IBVERBS_LIB` / `ERDMA_RDMACM_LIB` overrides.
//!
//! The tables are loaded once per process, so each case runs in a child process of this test
//! binary (it has no libtest harness: `main` is the driver, and `ERDMA_SYS_LOAD_CASE` selects a
//! case in the child).

use std::process::Command;

use erdma_sys::LoadError;

const MISSING_VERBS: &str = "liberdma-sys-test-missing-verbs.so.1";
const MISSING_CM: &str = "liberdma-sys-test-missing-cm.so.1";

fn rdma_core_expected() -> bool {
    std::env::var_os("ERDMA_SYS_NO_RDMA_CORE").is_none()
}

fn missing_library(err: LoadError, file: &str, hint: &str) {
    let LoadError::Library {
        library,
        hint: h,
        dlerror,
    } = &err
    else {
        panic!("expected a library error, got {err:?}");
    };
    assert_eq!(library, file);
    assert_eq!(*h, hint);
    assert!(dlerror.contains(file), "dlerror names the file: {dlerror}");
    assert_eq!(err.symbol(), None);
    assert_eq!(
        err.to_string(),
        format!("{file} could not be loaded ({hint}): {dlerror}")
    );
}

fn missing_symbol(err: LoadError, file: &str, symbol: &str, version: &str) {
    assert!(matches!(err, LoadError::Symbol { .. }), "{err:?}");
    assert_eq!(err.library(), file);
    assert_eq!(err.symbol(), Some(symbol));
    assert!(err.dlerror().contains(symbol), "{}", err.dlerror());
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "{file} lacks the required function {symbol} (symbol version {version};"
        )),
        "{text}"
    );
}

fn child(case: &str) {
    match case {
        "missing-ibverbs" => {
            let e = erdma_sys::ibverbs().expect_err("the override names a missing file");
            missing_library(e.clone(), MISSING_VERBS, "install rdma-core / libibverbs1");
            // The failure is remembered.
            assert_eq!(erdma_sys::ibverbs().expect_err("cached"), e);
            // The other table is independent.
            assert_eq!(erdma_sys::rdmacm().is_ok(), rdma_core_expected());
        }
        "missing-rdmacm" => {
            let e = erdma_sys::rdmacm().expect_err("the override names a missing file");
            missing_library(e, MISSING_CM, "install rdma-core / librdmacm1");
            assert_eq!(erdma_sys::ibverbs().is_ok(), rdma_core_expected());
        }
        "foreign-ibverbs" => {
            let e = erdma_sys::ibverbs().expect_err("libc has no verbs");
            missing_symbol(e, "libc.so.6", "ibv_get_device_list", "IBVERBS_1.1");
        }
        "foreign-rdmacm" => {
            let e = erdma_sys::rdmacm().expect_err("libc has no rdma_cm");
            missing_symbol(e, "libc.so.6", "rdma_create_event_channel", "RDMACM_1.0");
        }
        "empty-override" => {
            // An empty override means "not set".
            match erdma_sys::ibverbs() {
                Ok(lib) => assert_eq!(lib.library(), "libibverbs.so.1"),
                Err(e) => missing_library(e, "libibverbs.so.1", "install rdma-core / libibverbs1"),
            }
        }
        other => panic!("unknown case {other}"),
    }
}

fn main() {
    if let Ok(case) = std::env::var("ERDMA_SYS_LOAD_CASE") {
        child(&case);
        return;
    }
    let exe = std::env::current_exe().expect("own path");
    let cases: &[(&str, &str, &str)] = &[
        ("missing-ibverbs", "ERDMA_IBVERBS_LIB", MISSING_VERBS),
        ("missing-rdmacm", "ERDMA_RDMACM_LIB", MISSING_CM),
        ("foreign-ibverbs", "ERDMA_IBVERBS_LIB", "libc.so.6"),
        ("foreign-rdmacm", "ERDMA_RDMACM_LIB", "libc.so.6"),
        ("empty-override", "ERDMA_IBVERBS_LIB", ""),
    ];
    // Enough of libtest's command line for `--list` and name filters (`--exact`), so that
    // test runners that list and then run single tests work; other flags are ignored.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let exact = args.iter().any(|a| a == "--exact");
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let name = |case: &str| format!("load_error::{case}");
    let selected = |case: &str| {
        filters.is_empty()
            || filters.iter().any(|f| {
                if exact {
                    **f == name(case)
                } else {
                    name(case).contains(f.as_str())
                }
            })
    };
    let cases: Vec<_> = cases.iter().filter(|(case, _, _)| selected(case)).collect();
    if args.iter().any(|a| a == "--list") {
        for (case, _, _) in &cases {
            println!("{}: test", name(case));
        }
        return;
    }
    let mut failed = 0;
    for (case, var, value) in &cases {
        let out = Command::new(&exe)
            .env("ERDMA_SYS_LOAD_CASE", case)
            .env_remove("ERDMA_IBVERBS_LIB")
            .env_remove("ERDMA_RDMACM_LIB")
            .env(var, value)
            .output()
            .expect("run the child");
        if out.status.success() {
            println!("test load_error::{case} ... ok");
        } else {
            failed += 1;
            println!("test load_error::{case} ... FAILED ({})", out.status);
            println!("{}", String::from_utf8_lossy(&out.stderr));
        }
    }
    println!(
        "\nload_error: {} passed; {failed} failed",
        cases.len() - failed
    );
    if failed > 0 {
        std::process::exit(1);
    }
}
