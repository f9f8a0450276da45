//! Build script of erdma-sys.
//!
//! A normal build does nothing here: the bindings are committed (`src/bindings.rs`,
//! `src/prototypes.rs`) and nothing of rdma-core is needed to compile the crate.
//!
//! With `--features regenerate` it runs bindgen over `wrapper.h` for the target being built and
//! writes `bindings.rs` and `prototypes.rs` into `OUT_DIR`, which the crate then includes in
//! place of the committed files. `scripts/regen-bindings` copies them back into `src/`.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "regenerate")]
    regen::run();
}

#[cfg(feature = "regenerate")]
mod regen {
    use std::collections::HashMap;
    use std::env;
    use std::path::PathBuf;

    use bindgen::callbacks::{DeriveTrait, ImplementsTrait, ParseCallbacks};

    /// Types and constants come from these prefixes (and whatever they pull in).
    const ITEMS: &[&str] = &[
        "ibv_.*",
        "IBV_.*",
        "rdma_.*",
        "RDMA_.*",
        "erdma_.*",
        "ERDMA_.*",
        // The extended context around `ibv_context` (read by the ported inline verbs) and the
        // port-attribute type of the exported `ibv_query_port` symbol.
        "verbs_context",
        "_compat_ibv_port_attr",
        // `IBV_ACCESS_OPTIONAL_RANGE` is a macro over this enum's values.
        "ib_uverbs_access_flags",
    ];

    /// Enums whose values are bits of a mask: newtypes with bit operators. Every other enum
    /// becomes an integer type alias plus constants, so a value the Rust side does not know is
    /// still a valid value when read back from the library.
    const FLAG_ENUMS: &[&str] = &[
        "ib_uverbs_access_flags",
        "ibv_access_flags",
        "ibv_cq_attr_mask",
        "ibv_cq_init_attr_mask",
        "ibv_create_cq_attr_flags",
        "ibv_create_cq_wc_flags",
        "ibv_device_cap_flags",
        "ibv_dm_mask",
        "ibv_flow_action_esp_mask",
        "ibv_flow_flags",
        "ibv_ind_table_init_attr_mask",
        "ibv_odp_general_caps",
        "ibv_odp_transport_cap_bits",
        "ibv_ops_flags",
        "ibv_parent_domain_init_attr_mask",
        "ibv_pci_atomic_op_size",
        "ibv_port_cap_flags",
        "ibv_port_cap_flags2",
        "ibv_qp_attr_mask",
        "ibv_qp_create_flags",
        "ibv_qp_create_send_ops_flags",
        "ibv_qp_init_attr_mask",
        "ibv_qp_open_attr_mask",
        "ibv_raw_packet_caps",
        "ibv_read_counters_flags",
        "ibv_rereg_mr_flags",
        "ibv_rx_hash_fields",
        "ibv_rx_hash_function_flags",
        "ibv_send_flags",
        "ibv_srq_attr_mask",
        "ibv_srq_init_attr_mask",
        "ibv_tm_cap_flags",
        "ibv_values_mask",
        "ibv_wc_flags",
        "ibv_wq_attr_mask",
        "ibv_wq_flags",
        "ibv_wq_init_attr_mask",
        "ibv_xrcd_init_attr_mask",
        "rdma_cm_join_mc_attr_mask",
    ];

    /// System types taken from the `libc` crate instead of being generated again.
    const LIBC_TYPES: &[&str] = &[
        "sockaddr",
        "sockaddr_in",
        "sockaddr_in6",
        "sockaddr_storage",
        "sa_family_t",
        "in_port_t",
        "in_addr",
        "in_addr_t",
        "in6_addr",
        "socklen_t",
        "pthread_mutex_t",
        "pthread_cond_t",
        "timespec",
    ];

    /// Private glibc types reached only through the blocked system types above.
    const LIBC_INTERNALS: &[&str] = &[
        "__pthread_.*",
        "__atomic_wide_counter.*",
        "in6_addr__.*",
        "__time_t",
        "__syscall_slong_t",
        "__socklen_t",
    ];

    /// Exported functions whose prototypes are generated, only to type-check the run-time
    /// function tables against them.
    const FUNCTIONS: &[&str] = &["ibv_.*", "_ibv_.*", "rdma_.*"];

    /// Tells bindgen what the `libc` replacements of the system types implement.
    #[derive(Debug)]
    struct LibcTypes;

    impl ParseCallbacks for LibcTypes {
        fn blocklisted_type_implements_trait(
            &self,
            name: &str,
            derive_trait: DeriveTrait,
        ) -> Option<ImplementsTrait> {
            // bindgen passes the spelling of the use site: "const struct sockaddr", …
            let mut name = name;
            for prefix in ["const ", "volatile ", "struct ", "union "] {
                name = name.strip_prefix(prefix).unwrap_or(name);
            }
            if !LIBC_TYPES.contains(&name) {
                return None;
            }
            Some(match derive_trait {
                DeriveTrait::Copy => ImplementsTrait::Yes,
                // libc has no `Default` for these; an all-zero value is valid for all of them.
                DeriveTrait::Default => ImplementsTrait::Manually,
                // `Debug` needs libc's `extra_traits`; equality and hashing make no sense here.
                _ => ImplementsTrait::No,
            })
        }
    }

    fn base() -> bindgen::Builder {
        let mut b = bindgen::Builder::default()
            .header("wrapper.h")
            .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
            .parse_callbacks(Box::new(LibcTypes))
            .rust_target(bindgen::RustTarget::stable(85, 0).expect("valid Rust target"))
            .rust_edition(bindgen::RustEdition::Edition2024)
            .generate_comments(false)
            .disable_header_comment()
            .layout_tests(true)
            .derive_default(true)
            .prepend_enum_name(false)
            .default_enum_style(bindgen::EnumVariation::Consts)
            .sort_semantically(true)
            .merge_extern_blocks(true);
        for t in LIBC_TYPES {
            b = b.blocklist_type(t);
        }
        for t in LIBC_INTERNALS {
            b = b.blocklist_item(t);
        }
        b
    }

    pub fn run() {
        let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
        println!("cargo::rerun-if-changed=wrapper.h");

        let mut types = base();
        for item in ITEMS {
            types = types.allowlist_type(item).allowlist_var(item);
        }
        for e in FLAG_ENUMS {
            types = types.bitfield_enum(e);
        }
        let types = types
            .generate()
            .expect(
                "bindgen failed on wrapper.h (are libclang and the rdma-core headers installed?)",
            )
            .to_string();
        std::fs::write(out.join("bindings.rs"), name_anonymous_enums(&types))
            .expect("write bindings.rs");

        let mut protos = base().allowlist_recursively(false);
        for f in FUNCTIONS {
            protos = protos.allowlist_function(f);
        }
        protos
            .generate()
            .expect("bindgen failed on the function prototypes")
            .write_to_file(out.join("prototypes.rs"))
            .expect("write prototypes.rs");
    }

    /// Constants of anonymous C enums get a numbered type alias (`_bindgen_ty_13`) whose number
    /// changes whenever the headers gain an enum. Replace each such alias by the integer type it
    /// stands for, so the constants have a stable, meaningful type.
    fn name_anonymous_enums(src: &str) -> String {
        const PREFIX: &str = "pub type _bindgen_ty_";
        let mut aliases = HashMap::new();
        let mut kept = String::with_capacity(src.len());
        for line in src.lines() {
            if let Some((num, ty)) = line.strip_prefix(PREFIX).and_then(|r| r.split_once(" = ")) {
                aliases.insert(
                    format!("_bindgen_ty_{num}"),
                    ty.trim_end_matches(';').to_owned(),
                );
                continue;
            }
            kept.push_str(line);
            kept.push('\n');
        }
        let mut out = String::with_capacity(kept.len());
        let mut ident = String::new();
        let flush = |out: &mut String, ident: &mut String| {
            match aliases.get(ident.as_str()) {
                Some(ty) => out.push_str(ty),
                None => out.push_str(ident),
            }
            ident.clear();
        };
        for c in kept.chars() {
            if c.is_ascii_alphanumeric() || c == '_' {
                ident.push(c);
            } else {
                flush(&mut out, &mut ident);
                out.push(c);
            }
        }
        flush(&mut out, &mut ident);
        out
    }
}
