//! The queue-pair mesh along the ring: a rank's buffers and queue pairs, the swap of their
//! descriptions through the bootstrap, the connections to both neighbours and the channels over
//! them.

use super::config::FINGERPRINT_LEN;
use super::{Communicator, MAX_RANKS, RX, RingConfig, TX};
use crate::Context;
use crate::collective::bootstrap::Bootstrap;
use crate::collective::channel::{Receiver, Sender};
use crate::collective::host::{self, Host};
use crate::connect::PeerInfo;
use crate::error::{Error, Result};
use crate::mr::{Access, RemoteMr};
use crate::qp::{InitAttr, QpConfig};
use std::collections::VecDeque;

impl Communicator {
    /// Builds this rank's part of the ring on `ctx`: creates and registers its buffers and
    /// queue pairs, swaps them with its neighbours through `boot`, connects, and waits for
    /// every rank to be ready.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad configuration (or one that differs between ranks),
    /// errors of the device when creating resources, and the bootstrap's errors.
    pub fn new(ctx: &Context, boot: &mut Bootstrap, cfg: RingConfig) -> Result<Communicator> {
        cfg.validate()?;
        let (rank, world) = (boot.rank(), boot.world());
        if world > MAX_RANKS {
            return Err(Error::invalid(format!(
                "a ring of {world} ranks (at most {MAX_RANKS})"
            )));
        }
        let k = cfg.qps_per_connection;
        let s = cfg.slots;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq((2 * k * (4 * s + 16)) as u32)?;
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let work = pd.alloc(cfg.max_bytes.max(64), access)?;
        let staging = pd.alloc(k * s * cfg.chunk_bytes, access)?;
        let qp_config = QpConfig::new(&cq)
            // Room for S chunks (or credits) plus the unsignaled run the SDK allows before it
            // asks the device for a completion to retire them.
            .max_send_wr(4 * s as u32 + 16)
            .max_recv_wr(2 * s as u32 + 2)
            .max_send_sge(1)
            .max_recv_sge(1);
        // Only the predecessor writes into this rank's memory, through the queue pairs it
        // connects to (`rx`). The successor's queue pairs (`tx`) take credits, which are sends,
        // and grant it nothing.
        let rx_attr = InitAttr {
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            ..InitAttr::default()
        };
        let tx_attr = InitAttr {
            access: Access::LOCAL_WRITE,
            ..InitAttr::default()
        };
        let single = world == 1;
        let (mut tx_init, mut rx_init) = (Vec::new(), Vec::new());
        if !single {
            for _ in 0..k {
                tx_init.push(pd.create_qp(&qp_config)?.init(&tx_attr)?);
                rx_init.push(pd.create_qp(&qp_config)?.init(&rx_attr)?);
            }
        }
        let mut endpoints = Vec::with_capacity(2 * k);
        for qp in tx_init.iter().chain(rx_init.iter()) {
            endpoints.push(qp.endpoint()?);
        }
        let host = Host::this();
        let mut user = cfg.fingerprint();
        host.encode(&mut user);
        let mine = PeerInfo {
            endpoints,
            regions: vec![staging.remote(), work.remote()],
            user,
        };
        let all = boot.all_gather(&mine.encode()?)?;
        let mut infos = Vec::with_capacity(world);
        let mut hosts = Vec::with_capacity(world);
        for (r, bytes) in all.iter().enumerate() {
            let info = PeerInfo::decode(bytes)
                .map_err(|e| Error::protocol(format!("rank {r}'s ring setup: {e}")))?;
            let (fingerprint, their_host) = info
                .user
                .split_at_checked(FINGERPRINT_LEN)
                .unwrap_or((&info.user, &[]));
            if fingerprint != &mine.user[..FINGERPRINT_LEN] {
                return Err(Error::invalid(format!(
                    "rank {r} runs with another ring configuration (queue pairs, slots, chunk \
                     or capacity) than rank {rank}"
                )));
            }
            hosts.push(
                Host::decode(their_host)
                    .map_err(|e| Error::protocol(format!("rank {r}'s ring setup: {e}")))?,
            );
            if !single && (info.endpoints.len() != 2 * k || info.regions.len() != 2) {
                return Err(Error::protocol(format!(
                    "rank {r} announced {} queue pairs and {} regions (expected {} and 2)",
                    info.endpoints.len(),
                    info.regions.len(),
                    2 * k
                )));
            }
            infos.push(info);
        }
        let next = &infos[(rank + 1) % world];
        let prev = &infos[(rank + world - 1) % world];
        let mut tx = Vec::with_capacity(k);
        let mut rx = Vec::with_capacity(k);
        for (i, qp) in tx_init.into_iter().enumerate() {
            tx.push(qp.connect(&next.endpoints[k + i], &cfg.connect)?);
        }
        for (i, qp) in rx_init.into_iter().enumerate() {
            rx.push(qp.connect(&prev.endpoints[i], &cfg.connect)?);
        }
        let (peer_staging, peer_work) = if single {
            (RemoteMr::default(), RemoteMr::default())
        } else {
            (next.regions[0], next.regions[1])
        };
        let tx = Sender::new(tx, s, cfg.chunk_bytes, peer_staging, TX)?;
        let rx = Receiver::new(rx, s, cfg.chunk_bytes, RX)?;
        let host_share = host::share(&host, &hosts);
        // Nobody writes before everybody's queue pairs are connected and receiving.
        boot.barrier()?;
        Ok(Communicator {
            tx,
            rx,
            cq,
            #[cfg(feature = "gpu")]
            host_pin: None,
            #[cfg(feature = "gpu")]
            gpu_copies: None,
            work,
            staging,
            _pd: pd,
            peer_work,
            rank,
            world,
            early: VecDeque::new(),
            calls: 0,
            failed: None,
            cfg,
            host_share,
        })
    }
}
