//! The connection phases a perftest-style run goes through (setup, keys, bandwidth report,
//! close), in either out-of-band format: perftest 4.5's own, so the C `ib_*` tools can be
//! either end, or the project's ([`erdma::connect::exchange`]), which also carries the flags both
//! ends must agree on.

use std::net::TcpStream;
use std::time::Duration;

use erdma::connect::compat::perftest::{self as pt, BwReport, Keys, Role};
use erdma::connect::{self, PeerInfo};
use erdma::{Mtu, QpEndpoint, RemoteMr};

use super::{Oob, Options};

/// The channel of the format `o` asks for, over a connected stream.
pub(super) fn channel(o: &Options, stream: TcpStream, role: Role) -> Box<dyn Channel> {
    match o.oob {
        Oob::Perftest => Box::new(PerftestChannel(pt::Session::new(
            stream,
            role,
            o.step_timeout,
        ))),
        Oob::Erdma => Box::new(ErdmaChannel {
            stream,
            tool: o.tool_name(),
            timeout: o.step_timeout,
            flags: agreed_flags(o),
        }),
    }
}

/// The connection phases, in either format.
pub(super) trait Channel {
    /// The setup steps: the path MTU both sides use, and the cycle buffer (the span a
    /// perftest peer moves its remote addresses through for small messages).
    fn setup(&mut self, mtu: Mtu) -> erdma::Result<(Mtu, u64)>;
    fn keys(&mut self, mine: &Keys) -> erdma::Result<Keys>;
    fn report(&mut self, mine: &BwReport) -> erdma::Result<BwReport>;
    fn close(self: Box<Self>, mine: &Keys) -> erdma::Result<()>;
    fn name(&self) -> &'static str;
    /// The TCP stream the phases travel on (none for `-R`'s rdma_cm channel).
    fn stream(&self) -> Option<&TcpStream>;
    /// Whether the peer has sent something not yet read (it ended its run).
    fn peer_spoke(&self) -> bool {
        let Some(s) = self.stream() else {
            return false;
        };
        let mut b = [0u8; 1];
        if s.set_nonblocking(true).is_err() {
            return false;
        }
        let spoke = s.peek(&mut b).is_ok();
        let _ = s.set_nonblocking(false);
        spoke
    }
}

struct PerftestChannel(pt::Session);

impl Channel for PerftestChannel {
    fn setup(&mut self, mtu: Mtu) -> erdma::Result<(Mtu, u64)> {
        let agreed = self.0.setup(mtu)?;
        Ok((agreed.mtu, u64::from(agreed.cycle_buffer)))
    }
    fn keys(&mut self, mine: &Keys) -> erdma::Result<Keys> {
        self.0.hand_shake(mine)
    }
    fn report(&mut self, mine: &BwReport) -> erdma::Result<BwReport> {
        self.0.xchg_bw_report(mine)
    }
    fn close(self: Box<Self>, mine: &Keys) -> erdma::Result<()> {
        self.0.close(mine)
    }
    fn name(&self) -> &'static str {
        "Ethernet (perftest)"
    }
    fn stream(&self) -> Option<&TcpStream> {
        Some(self.0.stream())
    }
}

/// The same phases over [`erdma::connect::exchange`]: the setup carries the tool's name (so two
/// different tools refuse each other) and the MTU; keys travel as an endpoint and a region.
struct ErdmaChannel {
    stream: TcpStream,
    tool: String,
    timeout: Duration,
    /// The flags both ends must agree on, as `-s 65536 -n 5000 ...` words.
    flags: Vec<(&'static str, String)>,
}

/// The flags both ends of a run must agree on (our own format carries them; perftest's cannot).
fn agreed_flags(o: &Options) -> Vec<(&'static str, String)> {
    vec![
        ("-s", o.size.to_string()),
        ("-n", o.iters.to_string()),
        ("-q", o.qps.to_string()),
        ("-a", u8::from(o.all).to_string()),
        (
            "-D",
            o.duration
                .map_or("-".into(), |d| d.as_secs_f64().to_string()),
        ),
    ]
}

const ERDMA_TAG: &str = "erdma-perftest/1";

impl ErdmaChannel {
    fn xchg(&mut self, info: &PeerInfo) -> erdma::Result<PeerInfo> {
        connect::exchange(&mut self.stream, info, self.timeout)
    }
}

pub(super) fn proto(what: String) -> erdma::Error {
    erdma::Error::Protocol { what }
}

impl Channel for ErdmaChannel {
    fn setup(&mut self, mtu: Mtu) -> erdma::Result<(Mtu, u64)> {
        let mut mine = format!("{ERDMA_TAG} {} {}", self.tool, mtu.as_enum());
        for (flag, value) in &self.flags {
            mine.push_str(&format!(" {flag}={value}"));
        }
        let theirs = self.xchg(&PeerInfo {
            user: mine.into_bytes(),
            ..PeerInfo::default()
        })?;
        let text = String::from_utf8_lossy(&theirs.user).to_string();
        let mut words = text.split(' ');
        if words.next() != Some(ERDMA_TAG) {
            return Err(proto(format!(
                "peer is not an erdma perftest-style tool (it says {text:?})"
            )));
        }
        let tool = words.next().unwrap_or("");
        if tool != self.tool {
            return Err(proto(format!(
                "peer runs {tool}, this side runs {}",
                self.tool
            )));
        }
        let remote = words
            .next()
            .and_then(|m| m.parse::<u32>().ok())
            .and_then(Mtu::from_enum)
            .ok_or_else(|| proto(format!("peer's setup message {text:?} has no valid MTU")))?;
        // Then the flags that must match: a mismatch would run out of step, or report numbers
        // of a run the other side did not make.
        for word in words {
            let Some((flag, value)) = word.split_once('=') else {
                return Err(proto(format!("peer's setup message {text:?} has {word:?}")));
            };
            let ours = self.flags.iter().find(|(f, _)| *f == flag);
            if let Some((_, mine)) = ours.filter(|(_, mine)| mine != value) {
                return Err(proto(format!(
                    "the peer runs with {flag} {value}, this side with {flag} {mine}"
                )));
            }
        }
        Ok((mtu.min(remote), u64::from(pt::CYCLE_BUFFER)))
    }
    fn keys(&mut self, mine: &Keys) -> erdma::Result<Keys> {
        let info = PeerInfo {
            endpoints: vec![QpEndpoint {
                qp_num: mine.qpn,
                psn: mine.psn,
                gid: mine.gid,
                lid: mine.lid,
                mtu: Mtu::Mtu4096,
            }],
            regions: vec![RemoteMr {
                addr: mine.vaddr,
                len: 0,
                rkey: mine.rkey,
            }],
            user: mine.out_reads.to_be_bytes().to_vec(),
        };
        let t = self.xchg(&info)?;
        match (
            t.endpoints.as_slice(),
            t.regions.as_slice(),
            t.user.as_slice(),
        ) {
            ([e], [r], [a, b]) => Ok(Keys {
                lid: e.lid,
                out_reads: u16::from_be_bytes([*a, *b]),
                qpn: e.qp_num,
                psn: e.psn,
                rkey: r.rkey,
                vaddr: r.addr,
                gid: e.gid,
                srqn: 0,
            }),
            _ => Err(proto(format!(
                "peer's keys message has {} endpoints, {} regions and {} user bytes (want 1, 1, 2)",
                t.endpoints.len(),
                t.regions.len(),
                t.user.len()
            ))),
        }
    }
    fn report(&mut self, mine: &BwReport) -> erdma::Result<BwReport> {
        let mut user = Vec::with_capacity(40);
        user.extend_from_slice(&mine.size.to_be_bytes());
        user.extend_from_slice(&mine.iters.to_be_bytes());
        user.extend_from_slice(&mine.bw_peak.to_be_bytes());
        user.extend_from_slice(&mine.bw_avg.to_be_bytes());
        user.extend_from_slice(&mine.msg_rate.to_be_bytes());
        let t = self.xchg(&PeerInfo {
            user,
            ..PeerInfo::default()
        })?;
        if t.user.len() != 40 {
            return Err(proto(format!(
                "peer's report is {} bytes, expected 40",
                t.user.len()
            )));
        }
        let w = |i: usize| -> [u8; 8] { t.user[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]) };
        let f = |i: usize, what: &str| -> erdma::Result<f64> {
            let v = f64::from_be_bytes(w(i));
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err(proto(format!(
                    "peer's report: {what} {v} is not a non-negative number"
                )))
            }
        };
        Ok(BwReport {
            size: u64::from_be_bytes(w(0)),
            iters: u64::from_be_bytes(w(1)),
            bw_peak: f(2, "peak bandwidth")?,
            bw_avg: f(3, "average bandwidth")?,
            msg_rate: f(4, "message rate")?,
        })
    }
    fn close(mut self: Box<Self>, mine: &Keys) -> erdma::Result<()> {
        self.keys(mine).map(|_| ())
    }
    fn name(&self) -> &'static str {
        "Ethernet (erdma)"
    }
    fn stream(&self) -> Option<&TcpStream> {
        Some(&self.stream)
    }
}
