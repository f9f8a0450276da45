//! The committed bindings against the rdma-core headers installed on this machine: a C program
//! compiled from those headers prints the sizes, offsets and constant values below, and each
//! must equal what the Rust bindings say. This catches bindings generated from other headers
//! (bindgen's own layout assertions only check the bindings against themselves at compile
//! time).
//!
//! Needs a C compiler (`$CC` or `cc`) and the headers; on a machine without rdma-core set
//! `ERDMA_SYS_NO_RDMA_CORE=1`, which skips the comparison.

use std::io::Write;
use std::mem::{offset_of, size_of};
use std::process::{Command, Stdio};

use erdma_sys::*;

/// (C expression, value of the Rust equivalent).
macro_rules! checks {
    ($($c:literal => $r:expr),* $(,)?) => {
        vec![$(($c, ($r) as i64)),*]
    };
}

fn expectations() -> Vec<(&'static str, i64)> {
    checks! {
        // Data path.
        "sizeof(struct ibv_context)" => size_of::<ibv_context>(),
        "offsetof(struct ibv_context, ops)" => offset_of!(ibv_context, ops),
        "offsetof(struct ibv_context, num_comp_vectors)" => offset_of!(ibv_context, num_comp_vectors),
        "offsetof(struct ibv_context, abi_compat)" => offset_of!(ibv_context, abi_compat),
        "offsetof(struct ibv_context_ops, poll_cq)" => offset_of!(ibv_context_ops, poll_cq),
        "offsetof(struct ibv_context_ops, req_notify_cq)" => offset_of!(ibv_context_ops, req_notify_cq),
        "offsetof(struct ibv_context_ops, post_send)" => offset_of!(ibv_context_ops, post_send),
        "offsetof(struct ibv_context_ops, post_recv)" => offset_of!(ibv_context_ops, post_recv),
        "sizeof(struct verbs_context)" => size_of::<verbs_context>(),
        "offsetof(struct verbs_context, query_port)" => offset_of!(verbs_context, query_port),
        "offsetof(struct verbs_context, query_device_ex)" => offset_of!(verbs_context, query_device_ex),
        "offsetof(struct verbs_context, sz)" => offset_of!(verbs_context, sz),
        "offsetof(struct verbs_context, context)" => offset_of!(verbs_context, context),
        "sizeof(struct ibv_device)" => size_of::<ibv_device>(),
        "offsetof(struct ibv_device, transport_type)" => offset_of!(ibv_device, transport_type),
        "offsetof(struct ibv_device, ibdev_path)" => offset_of!(ibv_device, ibdev_path),
        "sizeof(struct ibv_qp)" => size_of::<ibv_qp>(),
        "offsetof(struct ibv_qp, qp_num)" => offset_of!(ibv_qp, qp_num),
        "offsetof(struct ibv_qp, state)" => offset_of!(ibv_qp, state),
        "sizeof(struct ibv_cq)" => size_of::<ibv_cq>(),
        "offsetof(struct ibv_cq, cqe)" => offset_of!(ibv_cq, cqe),
        "sizeof(struct ibv_sge)" => size_of::<ibv_sge>(),
        "sizeof(struct ibv_send_wr)" => size_of::<ibv_send_wr>(),
        "offsetof(struct ibv_send_wr, sg_list)" => offset_of!(ibv_send_wr, sg_list),
        "offsetof(struct ibv_send_wr, opcode)" => offset_of!(ibv_send_wr, opcode),
        "offsetof(struct ibv_send_wr, send_flags)" => offset_of!(ibv_send_wr, send_flags),
        "offsetof(struct ibv_send_wr, imm_data)" => offset_of!(ibv_send_wr, __bindgen_anon_1),
        "offsetof(struct ibv_send_wr, wr.rdma.rkey)" => offset_of!(ibv_send_wr, wr.rdma.rkey),
        "offsetof(struct ibv_send_wr, wr.atomic.swap)" => offset_of!(ibv_send_wr, wr.atomic.swap),
        "offsetof(struct ibv_send_wr, qp_type)" => offset_of!(ibv_send_wr, qp_type),
        "sizeof(struct ibv_recv_wr)" => size_of::<ibv_recv_wr>(),
        "offsetof(struct ibv_recv_wr, num_sge)" => offset_of!(ibv_recv_wr, num_sge),
        "sizeof(struct ibv_wc)" => size_of::<ibv_wc>(),
        "offsetof(struct ibv_wc, status)" => offset_of!(ibv_wc, status),
        "offsetof(struct ibv_wc, opcode)" => offset_of!(ibv_wc, opcode),
        "offsetof(struct ibv_wc, byte_len)" => offset_of!(ibv_wc, byte_len),
        "offsetof(struct ibv_wc, imm_data)" => offset_of!(ibv_wc, __bindgen_anon_1),
        "offsetof(struct ibv_wc, qp_num)" => offset_of!(ibv_wc, qp_num),
        "offsetof(struct ibv_wc, wc_flags)" => offset_of!(ibv_wc, wc_flags),
        "offsetof(struct ibv_wc, dlid_path_bits)" => offset_of!(ibv_wc, dlid_path_bits),
        // Control path.
        "sizeof(struct ibv_device_attr)" => size_of::<ibv_device_attr>(),
        "offsetof(struct ibv_device_attr, atomic_cap)" => offset_of!(ibv_device_attr, atomic_cap),
        "offsetof(struct ibv_device_attr, phys_port_cnt)" => offset_of!(ibv_device_attr, phys_port_cnt),
        "sizeof(struct ibv_device_attr_ex)" => size_of::<ibv_device_attr_ex>(),
        "offsetof(struct ibv_device_attr_ex, max_dm_size)" => offset_of!(ibv_device_attr_ex, max_dm_size),
        "offsetof(struct ibv_device_attr_ex, phys_port_cnt_ex)" => offset_of!(ibv_device_attr_ex, phys_port_cnt_ex),
        "sizeof(struct ibv_port_attr)" => size_of::<ibv_port_attr>(),
        "offsetof(struct ibv_port_attr, link_layer)" => offset_of!(ibv_port_attr, link_layer),
        "offsetof(struct ibv_port_attr, port_cap_flags2)" => offset_of!(ibv_port_attr, port_cap_flags2),
        "sizeof(union ibv_gid)" => size_of::<ibv_gid>(),
        "sizeof(struct ibv_gid_entry)" => size_of::<ibv_gid_entry>(),
        "sizeof(struct ibv_mr)" => size_of::<ibv_mr>(),
        "offsetof(struct ibv_mr, rkey)" => offset_of!(ibv_mr, rkey),
        "sizeof(struct ibv_pd)" => size_of::<ibv_pd>(),
        "sizeof(struct ibv_comp_channel)" => size_of::<ibv_comp_channel>(),
        "sizeof(struct ibv_qp_init_attr)" => size_of::<ibv_qp_init_attr>(),
        "offsetof(struct ibv_qp_init_attr, sq_sig_all)" => offset_of!(ibv_qp_init_attr, sq_sig_all),
        "sizeof(struct ibv_qp_attr)" => size_of::<ibv_qp_attr>(),
        "offsetof(struct ibv_qp_attr, ah_attr)" => offset_of!(ibv_qp_attr, ah_attr),
        "offsetof(struct ibv_qp_attr, max_dest_rd_atomic)" => offset_of!(ibv_qp_attr, max_dest_rd_atomic),
        "offsetof(struct ibv_qp_attr, rate_limit)" => offset_of!(ibv_qp_attr, rate_limit),
        "sizeof(struct ibv_ah_attr)" => size_of::<ibv_ah_attr>(),
        "offsetof(struct ibv_ah_attr, port_num)" => offset_of!(ibv_ah_attr, port_num),
        "sizeof(struct ibv_async_event)" => size_of::<ibv_async_event>(),
        // rdma_cm.
        "sizeof(struct rdma_cm_id)" => size_of::<rdma_cm_id>(),
        "offsetof(struct rdma_cm_id, qp)" => offset_of!(rdma_cm_id, qp),
        "offsetof(struct rdma_cm_id, route)" => offset_of!(rdma_cm_id, route),
        "offsetof(struct rdma_cm_id, port_num)" => offset_of!(rdma_cm_id, port_num),
        "offsetof(struct rdma_cm_id, qp_type)" => offset_of!(rdma_cm_id, qp_type),
        "sizeof(struct rdma_cm_event)" => size_of::<rdma_cm_event>(),
        "offsetof(struct rdma_cm_event, status)" => offset_of!(rdma_cm_event, status),
        "offsetof(struct rdma_cm_event, param)" => offset_of!(rdma_cm_event, param),
        "sizeof(struct rdma_conn_param)" => size_of::<rdma_conn_param>(),
        "offsetof(struct rdma_conn_param, qp_num)" => offset_of!(rdma_conn_param, qp_num),
        "sizeof(struct rdma_addr)" => size_of::<rdma_addr>(),
        "sizeof(struct rdma_addrinfo)" => size_of::<rdma_addrinfo>(),
        // erdma ABI.
        "sizeof(struct erdma_ureq_create_cq)" => size_of::<erdma_ureq_create_cq>(),
        "sizeof(struct erdma_uresp_create_qp)" => size_of::<erdma_uresp_create_qp>(),
        "sizeof(struct erdma_uresp_alloc_ctx)" => size_of::<erdma_uresp_alloc_ctx>(),
        "offsetof(struct erdma_uresp_alloc_ctx, cdb)" => offset_of!(erdma_uresp_alloc_ctx, cdb),
        "ERDMA_ABI_VERSION" => ERDMA_ABI_VERSION,
        // Constants.
        "IBV_QPS_RESET" => IBV_QPS_RESET,
        "IBV_QPS_INIT" => IBV_QPS_INIT,
        "IBV_QPS_RTR" => IBV_QPS_RTR,
        "IBV_QPS_RTS" => IBV_QPS_RTS,
        "IBV_QPS_ERR" => IBV_QPS_ERR,
        "IBV_QPT_RC" => IBV_QPT_RC,
        "IBV_WR_RDMA_WRITE" => IBV_WR_RDMA_WRITE,
        "IBV_WR_RDMA_WRITE_WITH_IMM" => IBV_WR_RDMA_WRITE_WITH_IMM,
        "IBV_WR_SEND" => IBV_WR_SEND,
        "IBV_WR_SEND_WITH_IMM" => IBV_WR_SEND_WITH_IMM,
        "IBV_WR_RDMA_READ" => IBV_WR_RDMA_READ,
        "IBV_WR_ATOMIC_CMP_AND_SWP" => IBV_WR_ATOMIC_CMP_AND_SWP,
        "IBV_WR_ATOMIC_FETCH_AND_ADD" => IBV_WR_ATOMIC_FETCH_AND_ADD,
        "IBV_WR_SEND_WITH_INV" => IBV_WR_SEND_WITH_INV,
        "IBV_WC_SUCCESS" => IBV_WC_SUCCESS,
        "IBV_WC_WR_FLUSH_ERR" => IBV_WC_WR_FLUSH_ERR,
        "IBV_WC_RETRY_EXC_ERR" => IBV_WC_RETRY_EXC_ERR,
        "IBV_WC_GENERAL_ERR" => IBV_WC_GENERAL_ERR,
        "IBV_WC_RECV" => IBV_WC_RECV,
        "IBV_WC_RECV_RDMA_WITH_IMM" => IBV_WC_RECV_RDMA_WITH_IMM,
        "IBV_WC_COMP_SWAP" => IBV_WC_COMP_SWAP,
        "IBV_WC_WITH_IMM" => ibv_wc_flags::IBV_WC_WITH_IMM.0,
        "IBV_WC_WITH_INV" => ibv_wc_flags::IBV_WC_WITH_INV.0,
        "IBV_ACCESS_LOCAL_WRITE" => ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0,
        "IBV_ACCESS_REMOTE_WRITE" => ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        "IBV_ACCESS_REMOTE_READ" => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
        "IBV_ACCESS_REMOTE_ATOMIC" => ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0,
        "IBV_ACCESS_RELAXED_ORDERING" => ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0,
        "IBV_ACCESS_OPTIONAL_RANGE" => IBV_ACCESS_OPTIONAL_RANGE,
        "IBV_SEND_FENCE" => ibv_send_flags::IBV_SEND_FENCE.0,
        "IBV_SEND_SIGNALED" => ibv_send_flags::IBV_SEND_SIGNALED.0,
        "IBV_SEND_SOLICITED" => ibv_send_flags::IBV_SEND_SOLICITED.0,
        "IBV_SEND_INLINE" => ibv_send_flags::IBV_SEND_INLINE.0,
        "IBV_QP_STATE" => ibv_qp_attr_mask::IBV_QP_STATE.0,
        "IBV_QP_ACCESS_FLAGS" => ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0,
        "IBV_QP_AV" => ibv_qp_attr_mask::IBV_QP_AV.0,
        "IBV_QP_PATH_MTU" => ibv_qp_attr_mask::IBV_QP_PATH_MTU.0,
        "IBV_QP_DEST_QPN" => ibv_qp_attr_mask::IBV_QP_DEST_QPN.0,
        "IBV_QP_MAX_DEST_RD_ATOMIC" => ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0,
        "IBV_DEVICE_MEM_MGT_EXTENSIONS" => ibv_device_cap_flags::IBV_DEVICE_MEM_MGT_EXTENSIONS.0,
        "IBV_MTU_1024" => IBV_MTU_1024,
        "IBV_MTU_4096" => IBV_MTU_4096,
        "IBV_PORT_ACTIVE" => IBV_PORT_ACTIVE,
        "IBV_NODE_UNKNOWN" => IBV_NODE_UNKNOWN,
        "IBV_NODE_RNIC" => IBV_NODE_RNIC,
        "IBV_TRANSPORT_UNKNOWN" => IBV_TRANSPORT_UNKNOWN,
        "IBV_TRANSPORT_IWARP" => IBV_TRANSPORT_IWARP,
        "IBV_LINK_LAYER_ETHERNET" => IBV_LINK_LAYER_ETHERNET,
        "IBV_ATOMIC_GLOB" => IBV_ATOMIC_GLOB,
        "IBV_EVENT_QP_FATAL" => IBV_EVENT_QP_FATAL,
        "IBV_EVENT_PORT_ACTIVE" => IBV_EVENT_PORT_ACTIVE,
        "IBV_GID_TYPE_ROCE_V2" => IBV_GID_TYPE_ROCE_V2,
        "IBV_SYSFS_NAME_MAX" => IBV_SYSFS_NAME_MAX,
        "IBV_DEVICE_RAW_SCATTER_FCS" => IBV_DEVICE_RAW_SCATTER_FCS,
        "RDMA_PS_TCP" => RDMA_PS_TCP,
        "RDMA_CM_EVENT_ESTABLISHED" => RDMA_CM_EVENT_ESTABLISHED,
        "RDMA_CM_EVENT_DISCONNECTED" => RDMA_CM_EVENT_DISCONNECTED,
        "RDMA_MAX_RESP_RES" => RDMA_MAX_RESP_RES,
        "RDMA_OPTION_ID_TOS" => RDMA_OPTION_ID_TOS,
        "RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER" => RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER,
    }
}

fn c_program(checks: &[(&str, i64)]) -> String {
    let mut src = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n\
         #include <rdma/rdma_cma.h>\n#include <rdma/erdma-abi.h>\nint main(void) {\n",
    );
    for (expr, _) in checks {
        src.push_str(&format!(
            "  printf(\"%s=%lld\\n\", \"{expr}\", (long long)({expr}));\n"
        ));
    }
    src.push_str("  return 0;\n}\n");
    src
}

#[test]
fn bindings_match_the_installed_headers() {
    let checks = expectations();
    if std::env::var_os("ERDMA_SYS_NO_RDMA_CORE").is_some() {
        eprintln!("ERDMA_SYS_NO_RDMA_CORE is set: no headers to compare against");
        return;
    }
    let dir = std::env::temp_dir().join(format!("erdma-sys-c-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = dir.join("probe");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut child = Command::new(&cc)
        .args(["-x", "c", "-o"])
        .arg(&exe)
        .arg("-")
        .stdin(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cc} is needed (or set ERDMA_SYS_NO_RDMA_CORE=1): {e}"));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(c_program(&checks).as_bytes())
        .expect("write the probe source");
    assert!(
        child.wait().expect("cc runs").success(),
        "the probe compiles"
    );
    let out = Command::new(&exe).output().expect("the probe runs");
    std::fs::remove_dir_all(&dir).ok();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("ASCII output");
    let mut mismatches = Vec::new();
    let mut seen = 0;
    for (line, (expr, rust)) in text.lines().zip(&checks) {
        let (name, value) = line.rsplit_once('=').expect("name=value");
        assert_eq!(name, *expr);
        let c: i64 = value.parse().expect("a number");
        if c != *rust {
            mismatches.push(format!("{expr}: C {c}, Rust {rust}"));
        }
        seen += 1;
    }
    assert_eq!(seen, checks.len(), "one line per check");
    assert!(
        mismatches.is_empty(),
        "layout drift:\n{}",
        mismatches.join("\n")
    );
}
