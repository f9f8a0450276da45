//! A bare librdmacm client (no SDK): one connection attempt with given private data.

use std::ffi::CStr;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use erdma_sys as sys;

/// Connects with `private`, returns the name of the event that answered (after the
/// established connection, if any, is torn down again), or what failed before.
pub fn connect(dst: SocketAddr, private: &[u8]) -> Result<String, String> {
    let cm = sys::rdmacm().map_err(|e| e.to_string())?;
    let SocketAddr::V4(v4) = dst else {
        return Err("IPv4 only".into());
    };
    // SAFETY: plain librdmacm calls in their documented order, on objects created here and
    // destroyed once at the end; every pointer passed is live for its call.
    unsafe {
        let ch = (cm.rdma_create_event_channel)();
        if ch.is_null() {
            return Err("rdma_create_event_channel".into());
        }
        let mut id = std::ptr::null_mut();
        if (cm.rdma_create_id)(ch, &mut id, std::ptr::null_mut(), sys::RDMA_PS_TCP) != 0 {
            return Err("rdma_create_id".into());
        }
        let mut sin: libc::sockaddr_in = std::mem::zeroed();
        sin.sin_family = libc::AF_INET as libc::sa_family_t;
        sin.sin_port = v4.port().to_be();
        sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
        let result = (|| {
            let dst_sa = (&mut sin as *mut libc::sockaddr_in).cast();
            if (cm.rdma_resolve_addr)(id, std::ptr::null_mut(), dst_sa, 2000) != 0 {
                return Err(os("rdma_resolve_addr"));
            }
            expect(cm, ch, "RDMA_CM_EVENT_ADDR_RESOLVED")?;
            if (cm.rdma_resolve_route)(id, 2000) != 0 {
                return Err(os("rdma_resolve_route"));
            }
            expect(cm, ch, "RDMA_CM_EVENT_ROUTE_RESOLVED")?;
            let mut attr: sys::ibv_qp_init_attr = std::mem::zeroed();
            attr.cap.max_send_wr = 1;
            attr.cap.max_recv_wr = 1;
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            attr.qp_type = sys::IBV_QPT_RC;
            if (cm.rdma_create_qp)(id, std::ptr::null_mut(), &mut attr) != 0 {
                return Err(os("rdma_create_qp"));
            }
            let mut param: sys::rdma_conn_param = std::mem::zeroed();
            param.private_data = private.as_ptr().cast();
            param.private_data_len = private.len() as u8;
            param.responder_resources = 1;
            param.initiator_depth = 1;
            param.retry_count = 7;
            let connected = if (cm.rdma_connect)(id, &mut param) != 0 {
                Err(os("rdma_connect"))
            } else {
                next(cm, ch, Duration::from_secs(20)).map(|(name, status)| {
                    if status != 0 {
                        format!("{name} (status {status})")
                    } else {
                        name
                    }
                })
            };
            if connected.as_deref() == Ok("RDMA_CM_EVENT_ESTABLISHED") {
                (cm.rdma_disconnect)(id);
                let _ = next(cm, ch, Duration::from_secs(20));
            }
            (cm.rdma_destroy_qp)(id);
            connected
        })();
        (cm.rdma_destroy_id)(id);
        (cm.rdma_destroy_event_channel)(ch);
        result
    }
}

fn os(what: &str) -> String {
    let e = std::io::Error::last_os_error();
    let name = match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => "ECONNREFUSED".to_string(),
        _ => e.to_string(),
    };
    format!("{what}: {name}")
}

/// # Safety
/// `ch` is a live event channel.
unsafe fn expect(
    cm: &sys::RdmaCm,
    ch: *mut sys::rdma_event_channel,
    want: &str,
) -> Result<(), String> {
    // SAFETY: the caller's contract.
    let (name, status) = unsafe { next(cm, ch, Duration::from_secs(10))? };
    if name == want {
        Ok(())
    } else {
        Err(format!("{name} (status {status}) where {want} was due"))
    }
}

/// The next event's name and status, waiting at most `wait`.
///
/// # Safety
/// `ch` is a live event channel.
unsafe fn next(
    cm: &sys::RdmaCm,
    ch: *mut sys::rdma_event_channel,
    wait: Duration,
) -> Result<(String, i32), String> {
    let end = Instant::now() + wait;
    // SAFETY: the channel is live (the caller's contract).
    let fd = unsafe { (*ch).fd };
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no rdma_cm event in {wait:?}"));
        }
        // SAFETY: one valid pollfd for the call.
        if unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) } > 0 {
            break;
        }
    }
    let mut ev = std::ptr::null_mut();
    // SAFETY: a live channel with an event waiting; the event is acknowledged once below.
    unsafe {
        if (cm.rdma_get_cm_event)(ch, &mut ev) != 0 {
            return Err(os("rdma_get_cm_event"));
        }
        let name = CStr::from_ptr((cm.rdma_event_str)((*ev).event))
            .to_string_lossy()
            .into_owned();
        let status = (*ev).status;
        (cm.rdma_ack_cm_event)(ev);
        Ok((name, status))
    }
}
