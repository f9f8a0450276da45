//! The plugin's operations in safe Rust, one function per entry of NCCL's table, whatever the
//! table version: the private `ffi` module converts the C arguments and calls these.
//!
//! Process-wide state: the configuration and the open devices ([`Plugin`]), made by the first
//! `init` and kept until the last v11 context is finalised (tables before v11 are never
//! finalised); the object table ([`crate::objects`]); and the closed connections that still
//! linger.
//!
//! Closing a connection does not destroy its queue pairs at once: the peer may still be waiting
//! for the acknowledgement of its last message, which a destroyed queue pair would never send
//! (the peer's send would then fail after its retries). A closed connection lingers until the
//! peer closes its end too, or [`LINGER`] has passed.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::{Connecting, ListenComm, log_listen};
use crate::config::Config;
use crate::device::{Dev, lasting_str, open_all};
use crate::error::{NetError, NetResult};
use crate::handle::{HANDLE_BYTES, Handle};
use crate::log::{INIT, Logger, NET, info, set_logger};
use crate::mem::{MemReg, PTR_CUDA, PTR_HOST};
use crate::objects::{self, Obj};
use crate::proto::MAX_RECVS;
use crate::recv::RecvBuf;

/// The name NCCL knows the plugin by (`NCCL_NET=erdma` selects it).
pub const NAME: &std::ffi::CStr = c"erdma";

/// How long a closed connection waits for its peer to close too.
pub const LINGER: Duration = Duration::from_secs(10);

/// A v11 per-communicator context.
#[derive(Debug)]
pub struct NetCtx {
    /// NCCL's communicator id.
    pub comm_id: u64,
}

/// The configuration and the devices.
#[derive(Debug)]
pub struct Plugin {
    /// What the environment says.
    pub config: Config,
    /// The devices, by NCCL's index.
    pub devs: Vec<Arc<Dev>>,
}

struct State {
    plugin: Option<Arc<Plugin>>,
    contexts: usize,
    legacy: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    plugin: None,
    contexts: 0,
    legacy: false,
});

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

struct Lingering {
    obj: Obj,
    until: Instant,
}

static LINGERING: Mutex<Vec<Lingering>> = Mutex::new(Vec::new());

fn plugin() -> NetResult<Arc<Plugin>> {
    state()
        .plugin
        .clone()
        .ok_or_else(|| NetError::internal("the plugin is used before init (or after finalize)"))
}

fn dev(p: &Plugin, dev: i32) -> NetResult<Arc<Dev>> {
    usize::try_from(dev)
        .ok()
        .and_then(|d| p.devs.get(d))
        .cloned()
        .ok_or_else(|| {
            NetError::invalid(format!(
                "device {dev} does not exist (the plugin has {})",
                p.devs.len()
            ))
        })
}

fn start(logger: Option<Logger>) -> NetResult<MutexGuard<'static, State>> {
    if logger.is_some() {
        set_logger(logger);
    }
    let mut st = state();
    if st.plugin.is_none() {
        let config = Config::from_env().map_err(NetError::usage)?;
        let devs = open_all(&config).map_err(NetError::usage)?;
        info!(
            INIT | NET,
            "NET/erdma: erdma {} plugin: {} device(s): {}",
            env!("CARGO_PKG_VERSION"),
            devs.len(),
            devs.iter()
                .map(|d| format!("[{}]{}", d.index, d.name()))
                .collect::<Vec<_>>()
                .join(" ")
        );
        st.plugin = Some(Arc::new(Plugin {
            config,
            devs: devs.into_iter().map(Arc::new).collect(),
        }));
    }
    Ok(st)
}

/// `init` of tables v8–v10 (once per process; never finalised).
pub fn init(logger: Option<Logger>) -> NetResult<()> {
    start(logger)?.legacy = true;
    Ok(())
}

/// `init` of table v11 (once per communicator): a context id.
pub fn init_ctx(comm_id: u64, logger: Option<Logger>) -> NetResult<u64> {
    let mut st = start(logger)?;
    let id = objects::insert(Obj::Ctx(Arc::new(NetCtx { comm_id }))).map_err(NetError::system)?;
    st.contexts += 1;
    Ok(id)
}

/// `finalize` of table v11. The last context releases the devices (unless an older table's
/// `init` also ran), once the closed connections have gone.
pub fn finalize(ctx: u64) -> NetResult<()> {
    if ctx == 0 {
        // NCCL finalises after a failed init with whatever the context was.
        return Ok(());
    }
    match objects::remove(ctx) {
        Some(Obj::Ctx(_)) => {}
        _ => return Err(NetError::internal("finalize of an unknown context")),
    }
    let mut st = state();
    if let Some(p) = &st.plugin {
        log_counters(p);
    }
    st.contexts = st.contexts.saturating_sub(1);
    if st.contexts == 0 && !st.legacy {
        drop(st);
        reap(Some(Instant::now() + Duration::from_secs(1)));
        let mut st = state();
        if st.contexts == 0 && !st.legacy {
            st.plugin = None;
        }
    }
    Ok(())
}

/// Logs what each device's transport counters say about the run so far (retransmissions and
/// drops show a network, or socket buffers, that lose packets).
fn log_counters(p: &Plugin) {
    use erdma::soft::counter;
    for d in &p.devs {
        if let Ok(c) = d.ctx.port_counters(1) {
            let get = |n| c.get(n).map_or("-".to_string(), |v: u64| v.to_string());
            info!(
                NET,
                "NET/erdma: {}: packets sent {} received {}, retries {}, retransmitted {}, ACK \
                 timeouts {}, socket drops {}",
                d.name(),
                get(counter::SENT_PKTS),
                get(counter::RCVD_PKTS),
                get(counter::RETRIES),
                get(counter::RETRANSMITTED_PKTS),
                get(counter::ACK_TIMEOUTS),
                get(counter::SOCKET_DROPS)
            );
        }
    }
}

/// Checks a v11 context id.
pub fn check_ctx(ctx: u64) -> NetResult<()> {
    match objects::get(ctx) {
        Some(Obj::Ctx(_)) => Ok(()),
        _ => Err(NetError::internal("an unknown network context")),
    }
}

/// `devices`.
pub fn devices() -> NetResult<usize> {
    Ok(plugin()?.devs.len())
}

/// What `getProperties` reports, independent of the table version.
#[derive(Debug, Clone, Copy)]
pub struct Props {
    /// Device name (a lasting C string).
    pub name: *const std::ffi::c_char,
    /// PCI path (a lasting C string) or NULL.
    pub pci_path: *const std::ffi::c_char,
    /// GUID.
    pub guid: u64,
    /// `NCCL_PTR_*` bits.
    pub ptr_support: i32,
    /// Mbit/s.
    pub speed: i32,
    /// Port number.
    pub port: i32,
    /// Latency, µs.
    pub latency: f32,
    /// Connections at most.
    pub max_comms: i32,
    /// Grouped receives.
    pub max_recvs: i32,
    /// Largest transfer NCCL should ask for.
    pub max_bytes: usize,
}

/// `getProperties`.
pub fn properties(d: i32) -> NetResult<Props> {
    let p = plugin()?;
    let dev = dev(&p, d)?;
    Ok(Props {
        name: lasting_str(dev.name()),
        pci_path: dev
            .pci_path
            .as_deref()
            .map_or(std::ptr::null(), lasting_str),
        guid: dev.guid,
        ptr_support: if dev.gdr.0 {
            PTR_HOST | PTR_CUDA
        } else {
            PTR_HOST
        },
        speed: dev.speed_mbps,
        port: 1,
        latency: 0.0,
        max_comms: 65536,
        max_recvs: MAX_RECVS as i32,
        max_bytes: 1 << 30,
    })
}

/// `listen`: fills the handle; a listen id.
pub fn listen(d: i32, handle: &mut [u8; HANDLE_BYTES]) -> NetResult<u64> {
    reap(None);
    let p = plugin()?;
    let dev = dev(&p, d)?;
    let l = ListenComm::listen(
        &dev,
        p.config.qps,
        p.config.min_chunk,
        p.config.connect_timeout,
        handle,
    )?;
    log_listen(&l);
    objects::insert(Obj::Listen(Arc::new(Mutex::new(l)))).map_err(NetError::system)
}

/// `connect`: `Some(send id)` once connected; the connection in progress is remembered in the
/// handle.
pub fn connect(d: i32, handle: &mut [u8; HANDLE_BYTES]) -> NetResult<Option<u64>> {
    let stage = Handle::stage(handle);
    let pending = if stage == 0 {
        reap(None);
        let p = plugin()?;
        let dev = dev(&p, d)?;
        let h = Handle::decode(handle).map_err(NetError::invalid)?;
        let c = Connecting::start(&dev, h, p.config.min_chunk, p.config.connect_timeout)?;
        let c = Arc::new(Mutex::new(c));
        let id = objects::insert(Obj::Connecting(c.clone())).map_err(NetError::system)?;
        Handle::set_stage(handle, id);
        (id, c)
    } else {
        match objects::get(stage) {
            Some(Obj::Connecting(c)) => (stage, c),
            _ => {
                return Err(NetError::internal(
                    "connect with a handle whose connection attempt is unknown (it failed \
                     before, or the handle was copied)",
                ));
            }
        }
    };
    let (id, c) = pending;
    let step = lock(&c).step();
    match step {
        Ok(None) => Ok(None),
        Ok(Some(comm)) => {
            objects::remove(id);
            Handle::set_stage(handle, 0);
            let id =
                objects::insert(Obj::Send(Arc::new(Mutex::new(comm)))).map_err(NetError::system)?;
            Ok(Some(id))
        }
        Err(e) => {
            objects::remove(id);
            Handle::set_stage(handle, 0);
            Err(e)
        }
    }
}

/// `accept`: `Some(receive id)` once connected.
pub fn accept(listen: u64) -> NetResult<Option<u64>> {
    let Some(Obj::Listen(l)) = objects::get(listen) else {
        return Err(NetError::internal(
            "accept on an unknown or closed listen object",
        ));
    };
    let r = lock(&l).accept()?;
    match r {
        None => Ok(None),
        Some(comm) => objects::insert(Obj::Recv(Arc::new(Mutex::new(comm))))
            .map(Some)
            .map_err(NetError::system),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn comm_dev(comm: u64) -> NetResult<Arc<Dev>> {
    match objects::get(comm) {
        Some(Obj::Send(c)) => Ok(lock(&c).dev().clone()),
        Some(Obj::Recv(c)) => Ok(lock(&c).dev().clone()),
        _ => Err(NetError::internal(
            "memory registration on an unknown or closed connection",
        )),
    }
}

/// `regMr`: a registration id.
///
/// # Safety
/// `[addr, addr+size)` must stay allocated until `deregMr` and until every request using it
/// has completed (NCCL's contract for registered buffers).
#[allow(unsafe_code)]
pub unsafe fn reg_mr(comm: u64, addr: u64, size: u64, ptr_type: i32) -> NetResult<u64> {
    let dev = comm_dev(comm)?;
    if ptr_type == PTR_CUDA && !dev.gdr.0 {
        return Err(NetError::invalid(format!(
            "GPU memory registered on {}, which was not offered with NCCL_PTR_CUDA ({})",
            dev.name(),
            dev.gdr.1
        )));
    }
    if ptr_type != PTR_HOST && ptr_type != PTR_CUDA {
        return Err(NetError::invalid(format!(
            "memory type {ptr_type} (NCCL_PTR_HOST=1, NCCL_PTR_CUDA=2)"
        )));
    }
    // SAFETY: forwarded from the caller.
    let m = unsafe { MemReg::register(&dev, addr, size, ptr_type) }
        .map_err(|e| NetError::system(format!("{}: {e}", dev.name())))?;
    objects::insert(Obj::Mr(Arc::new(m))).map_err(NetError::system)
}

/// `deregMr`.
pub fn dereg_mr(comm: u64, mh: u64) -> NetResult<()> {
    comm_dev(comm)?;
    match objects::remove(mh) {
        Some(Obj::Mr(_)) => Ok(()),
        Some(other) => {
            // Not a registration: put nothing back in its place, but say so.
            drop(other);
            Err(NetError::internal(
                "deregMr of something that is not a registration",
            ))
        }
        None => Err(NetError::internal(
            "deregMr of an unknown or released registration",
        )),
    }
}

fn mr(mh: u64) -> NetResult<Option<Arc<MemReg>>> {
    if mh == 0 {
        return Ok(None);
    }
    match objects::get(mh) {
        Some(Obj::Mr(m)) => Ok(Some(m)),
        _ => Err(NetError::invalid("an unknown or released memory handle")),
    }
}

/// `isend`: `Some(request)` or `None` (try again).
pub fn isend(comm: u64, addr: u64, size: u64, tag: i32, mh: u64) -> NetResult<Option<u64>> {
    let Some(Obj::Send(c)) = objects::get(comm) else {
        return Err(NetError::internal(
            "isend on an unknown or closed send connection",
        ));
    };
    let m = mr(mh)?;
    let sub = lock(&c).isend(addr, size, tag, m)?;
    Ok(sub.map(|s| objects::with_sub(comm, s)))
}

/// `irecv`: `Some(request)` or `None` (try again).
pub fn irecv(comm: u64, bufs: &[(u64, u64, i32, u64)]) -> NetResult<Option<u64>> {
    let Some(Obj::Recv(c)) = objects::get(comm) else {
        return Err(NetError::internal(
            "irecv on an unknown or closed receive connection",
        ));
    };
    let mut list: [Option<RecvBuf>; MAX_RECVS] = Default::default();
    if bufs.len() > MAX_RECVS || bufs.is_empty() {
        return Err(NetError::invalid(format!(
            "irecv of {} grouped receives (1..={MAX_RECVS})",
            bufs.len()
        )));
    }
    for (slot, &(addr, size, tag, mh)) in list.iter_mut().zip(bufs) {
        *slot = Some(RecvBuf {
            addr,
            size,
            tag,
            mr: mr(mh)?,
        });
    }
    let bufs: Vec<RecvBuf> = list.into_iter().flatten().collect();
    let sub = lock(&c).irecv(&bufs)?;
    Ok(sub.map(|s| objects::with_sub(comm, s)))
}

/// `iflush`: `Some(request)`, or `None` when there is nothing to wait for.
pub fn iflush(comm: u64, bufs: &[(u64, u64, u64)]) -> NetResult<Option<u64>> {
    let Some(Obj::Recv(c)) = objects::get(comm) else {
        return Err(NetError::internal(
            "iflush on an unknown or closed receive connection",
        ));
    };
    let mut list = Vec::with_capacity(bufs.len());
    for &(addr, size, mh) in bufs {
        list.push((addr, size, mr(mh)?));
    }
    let sub = lock(&c).iflush(&list)?;
    Ok(sub.map(|s| objects::with_sub(comm, s)))
}

/// `test`: `Some((sizes, count))` once done.
pub fn test(req: u64) -> NetResult<Option<([u64; MAX_RECVS], usize)>> {
    match objects::get(req) {
        Some(Obj::Send(c)) => Ok(lock(&c).test(objects::sub(req))?.map(|s| {
            let mut sizes = [0; MAX_RECVS];
            sizes[0] = s;
            (sizes, 1)
        })),
        Some(Obj::Recv(c)) => lock(&c).test(objects::sub(req)),
        _ => Err(NetError::internal(
            "test of a request whose connection is unknown or closed",
        )),
    }
}

fn linger(obj: Obj) {
    lock(&LINGERING).push(Lingering {
        obj,
        until: Instant::now() + LINGER,
    });
}

/// `closeSend`.
pub fn close_send(comm: u64) -> NetResult<()> {
    match objects::remove(comm) {
        Some(Obj::Send(c)) => {
            {
                let mut g = lock(&c);
                g.transport().close_link();
                info!(
                    NET,
                    "NET/erdma: closed the send connection to {}",
                    g.transport().peer()
                );
            }
            linger(Obj::Send(c));
        }
        Some(Obj::Connecting(_)) => {}
        _ => {
            return Err(NetError::internal(
                "closeSend of an unknown or closed connection",
            ));
        }
    }
    reap(None);
    Ok(())
}

/// `closeRecv`.
pub fn close_recv(comm: u64) -> NetResult<()> {
    match objects::remove(comm) {
        Some(Obj::Recv(c)) => {
            {
                let mut g = lock(&c);
                g.transport().close_link();
                info!(
                    NET,
                    "NET/erdma: closed the receive connection from {}",
                    g.transport().peer()
                );
            }
            linger(Obj::Recv(c));
        }
        _ => {
            return Err(NetError::internal(
                "closeRecv of an unknown or closed connection",
            ));
        }
    }
    reap(None);
    Ok(())
}

/// `closeListen`.
pub fn close_listen(listen: u64) -> NetResult<()> {
    match objects::remove(listen) {
        Some(Obj::Listen(_)) => Ok(()),
        _ => Err(NetError::internal(
            "closeListen of an unknown or closed listen object",
        )),
    }
}

/// Drops the closed connections whose peers have closed too, or whose time is up; with
/// `wait_until`, waits (polling) until every one has gone or that instant.
pub fn reap(wait_until: Option<Instant>) {
    loop {
        let mut list = lock(&LINGERING);
        let now = Instant::now();
        let force = wait_until.is_some_and(|w| now >= w);
        list.retain(|l| {
            if force || now >= l.until {
                return false;
            }
            match &l.obj {
                Obj::Send(c) => !lock(c).transport().peer_finished(),
                Obj::Recv(c) => !lock(c).transport().peer_finished(),
                _ => false,
            }
        });
        if list.is_empty() || wait_until.is_none() || force {
            return;
        }
        drop(list);
        std::thread::sleep(Duration::from_millis(5));
    }
}
