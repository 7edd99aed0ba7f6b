//! Validation of the links between pools (`[[link]]`), the transfer engine they use
//! (`[transfer]`) and the faults it may be told to strike (`[faults]`): which prefill pool hands
//! off to which decode pool, over which backend, and that every prefill pool has a way out and
//! every decode pool a way in.

use std::ops::Range;

use toml::Spanned;

use super::super::config::{
    Endpoint, FaultsConfig, LinkConfig, PoolConfig, PoolRole, TransferBackend, TransferConfig, MAX_LINK_CONNECTIONS,
};
use super::super::config::{DEFAULT_FAULTS, DEFAULT_TRANSFER, DEFAULT_TRANSFER_BACKEND};
use super::super::error::{line_of, quoted_list, GraphError};
use super::super::raw::{RawFaults, RawLink, RawPool, RawTransfer};
use super::super::rules::{deployment_token, milliseconds, parse_endpoint, parse_link_rate, probability};

use super::Validator;

/// A tcp link's consumer listens on loopback, on a port the kernel picks, unless it names an
/// endpoint.
const DEFAULT_TCP_HOST: &str = "127.0.0.1";
const DEFAULT_TCP_PORT: u16 = 0;

impl Validator<'_> {
    pub(super) fn links(&self, raw: &[Spanned<RawLink>], pools: &[PoolConfig]) -> Result<Vec<LinkConfig>, GraphError> {
        let mut links: Vec<LinkConfig> = Vec::with_capacity(raw.len());
        let mut header_spans: Vec<Range<usize>> = Vec::with_capacity(raw.len());
        for spanned in raw {
            let link = spanned.get_ref();
            let from = self.linked_pool("link.from", spanned, link.from.as_ref(), PoolRole::Prefill, pools)?;
            let to = self.linked_pool("link.to", spanned, link.to.as_ref(), PoolRole::Decode, pools)?;
            let first_line = |index: usize| line_of(self.text, header_spans[index].start);
            if let Some(first) = links.iter().position(|l| l.from == from && l.to == to) {
                return Err(self.error(
                    "link.to",
                    link.to.as_ref().map(Spanned::span),
                    format!("the link from `{from}` to `{to}` is already defined at line {}", first_line(first)),
                ));
            }
            let backend = self.field("link.backend", link.backend.as_ref(), DEFAULT_TRANSFER_BACKEND, |backend| {
                TransferBackend::from_name(&backend).ok_or_else(|| {
                    let known: Vec<&str> = TransferBackend::ALL.iter().map(|b| b.name()).collect();
                    format!("`{backend}` is not a transfer backend; known: {}", quoted_list(&known))
                })
            })?;
            let spread = pools.iter().find(|p| p.name == from && p.hosts.len() > 1);
            if let (Some(p), TransferBackend::Inproc | TransferBackend::Sim) = (spread, backend) {
                return Err(self.error(
                    "link.backend",
                    link.backend.as_ref().map(Spanned::span).or(Some(spanned.span())),
                    format!(
                        "prefill pool `{from}` lists {} processes (hosts), each handing off over its own links: \
                         the link must be backend = \"tcp\", to decode pool `{to}` in a process of its own",
                        p.hosts.len()
                    ),
                ));
            }
            let endpoint = match (backend, &link.endpoint) {
                (TransferBackend::Inproc | TransferBackend::Sim, None) => None,
                (TransferBackend::Inproc | TransferBackend::Sim, Some(endpoint)) => {
                    let defaulted = if link.backend.is_none() { " (the default)" } else { "" };
                    return Err(self.error(
                        "link.endpoint",
                        Some(endpoint.span()),
                        format!(
                            "the backend is \"{backend}\"{defaulted}, which has no endpoint: both pools run in one \
                             process; remove it, or set backend = \"tcp\""
                        ),
                    ));
                }
                (TransferBackend::Tcp, endpoint) => {
                    let default = Endpoint { host: DEFAULT_TCP_HOST.to_string(), port: DEFAULT_TCP_PORT };
                    let endpoint = self.field("link.endpoint", endpoint.as_ref(), default, |e| parse_endpoint(&e))?;
                    // The endpoint is the consumer's one listen address: every tcp link into a decode
                    // pool names the same one.
                    let listening = links.iter().position(|l| l.to == to && l.endpoint.is_some());
                    if let Some(other) = listening.filter(|&other| links[other].endpoint.as_ref() != Some(&endpoint)) {
                        let listens = links[other].endpoint.as_ref().map(Endpoint::to_string).unwrap_or_default();
                        return Err(self.error(
                            "link.endpoint",
                            link.endpoint.as_ref().map(Spanned::span).or(link.backend.as_ref().map(Spanned::span)),
                            format!(
                                "`{endpoint}` differs from `{listens}`, where decode pool `{to}` listens for the \
                                 link at line {}: every tcp link into one decode pool names the same endpoint",
                                first_line(other)
                            ),
                        ));
                    }
                    // A fixed port is one consumer's listener: two decode pools cannot both bind it.
                    let taken = links
                        .iter()
                        .position(|l| endpoint.port != 0 && l.to != to && l.endpoint.as_ref() == Some(&endpoint));
                    if let Some(other) = taken {
                        return Err(self.error(
                            "link.endpoint",
                            link.endpoint.as_ref().map(Spanned::span),
                            format!(
                                "`{endpoint}` is already where decode pool `{}` listens (the link at line {}); \
                                 two decode pools cannot listen on one fixed port (port 0 lets the kernel pick)",
                                links[other].to,
                                first_line(other)
                            ),
                        ));
                    }
                    Some(endpoint)
                }
            };
            let bandwidth = self.optional_field("link.bandwidth", link.bandwidth.as_ref(), |r| parse_link_rate(&r))?;
            let stream_min_tokens = link.stream_min_tokens.as_ref().map(|v| *v.get_ref());
            links.push(LinkConfig { from, to, backend, endpoint, bandwidth, stream_min_tokens });
            header_spans.push(spanned.span());
        }
        Ok(links)
    }

    /// `link.from` or `link.to`: present, naming a pool of `role`.
    fn linked_pool(
        &self,
        key: &str,
        link: &Spanned<RawLink>,
        raw: Option<&Spanned<String>>,
        role: PoolRole,
        pools: &[PoolConfig],
    ) -> Result<String, GraphError> {
        let end = key.trim_start_matches("link.");
        let Some(name) = raw else {
            let what = if role == PoolRole::Prefill { "that hands off" } else { "that takes the handoffs" };
            return Err(self.error(
                key,
                Some(link.span()),
                format!("missing: every [[link]] names in `{end}` the {role} pool {what}"),
            ));
        };
        self.checked(key, name, |name| {
            let Some(pool) = pools.iter().find(|pool| pool.name == name) else {
                let known: Vec<&str> = pools.iter().map(|pool| pool.name.as_str()).collect();
                return Err(format!("no pool named `{name}`; the pools are {}", quoted_list(&known)));
            };
            match pool.role {
                actual if actual == role => Ok(name),
                PoolRole::Aggregated => Err(format!(
                    "pool `{name}` is aggregated: it prefills and decodes its own requests and cannot be linked; \
                     `{end}` names a {role} pool"
                )),
                actual => Err(format!(
                    "pool `{name}` is a {actual} pool, but `{end}` names a {role} pool (links run from prefill to \
                     decode)"
                )),
            }
        })
    }

    /// Every prefill pool has a link out and every decode pool a link in.
    pub(super) fn every_pool_linked(
        &self,
        raw: &[Spanned<RawPool>],
        pools: &[PoolConfig],
        links: &[LinkConfig],
    ) -> Result<(), GraphError> {
        let names = |role: PoolRole| {
            let names: Vec<&str> = pools.iter().filter(|p| p.role == role).map(|p| p.name.as_str()).collect();
            quoted_list(&names)
        };
        for (spanned, pool) in raw.iter().zip(pools) {
            let name = &pool.name;
            let message = match pool.role {
                PoolRole::Prefill if !links.iter().any(|link| &link.from == name) => format!(
                    "prefill pool `{name}` has no [[link]] out: add one with from = \"{name}\" and to = one of the \
                     decode pools ({})",
                    names(PoolRole::Decode)
                ),
                PoolRole::Decode if !links.iter().any(|link| &link.to == name) => format!(
                    "decode pool `{name}` has no [[link]] in: add one with to = \"{name}\" and from = one of the \
                     prefill pools ({})",
                    names(PoolRole::Prefill)
                ),
                _ => continue,
            };
            return Err(self.error("pool.role", Some(Self::role_span(spanned)), message));
        }
        Ok(())
    }

    /// `[transfer]`: only in a graph with links.
    pub(super) fn transfer(
        &self,
        raw: Option<&Spanned<RawTransfer>>,
        links: &[LinkConfig],
    ) -> Result<TransferConfig, GraphError> {
        let Some(spanned) = raw else { return Ok(DEFAULT_TRANSFER) };
        if links.is_empty() {
            return Err(self.error(
                "transfer",
                Some(spanned.span()),
                "the graph has no [[link]]: [transfer] configures the transfers from prefill to decode pools",
            ));
        }
        let raw = spanned.get_ref();
        Ok(TransferConfig {
            deployment_token: self.optional_field(
                "transfer.deployment_token",
                raw.deployment_token.as_ref(),
                deployment_token,
            )?,
            checksum: raw.checksum.unwrap_or(DEFAULT_TRANSFER.checksum),
            connections: self.field(
                "transfer.connections",
                raw.connections.as_ref(),
                DEFAULT_TRANSFER.connections,
                |n| {
                    usize::try_from(n)
                        .ok()
                        .filter(|n| (1..=MAX_LINK_CONNECTIONS).contains(n))
                        .ok_or_else(|| format!("{n} connections per link; expected 1 to {}", MAX_LINK_CONNECTIONS))
                },
            )?,
        })
    }

    /// `[faults]`: every chance in [0, 1] and `delay_ms` a duration bounded like the flags';
    /// `delay_ms` and `delay_probability` act together, so one set without the other (which
    /// would delay nothing) is an error.
    pub(super) fn faults(&self, raw: &RawFaults) -> Result<FaultsConfig, GraphError> {
        let chance = |key: &str, value: Option<&Spanned<f64>>, default: f64| {
            self.field(&format!("faults.{key}"), value, default, probability)
        };
        let defaults = &DEFAULT_FAULTS;
        let faults = FaultsConfig {
            seed: raw.seed.unwrap_or(defaults.seed),
            drop_connection: chance("drop_connection", raw.drop_connection.as_ref(), defaults.drop_connection)?,
            delay_ms: self.field("faults.delay_ms", raw.delay_ms.as_ref(), defaults.delay_ms, milliseconds)?,
            delay_probability: chance("delay_probability", raw.delay_probability.as_ref(), defaults.delay_probability)?,
            corrupt: chance("corrupt", raw.corrupt.as_ref(), defaults.corrupt)?,
            duplicate_completion: chance(
                "duplicate_completion",
                raw.duplicate_completion.as_ref(),
                defaults.duplicate_completion,
            )?,
        };
        let alone = |key: &str, value: &Spanned<f64>, other: &str, other_value: f64| {
            self.error(
                &format!("faults.{key}"),
                Some(value.span()),
                format!(
                    "{key} = {} delays nothing while faults.{other} is {other_value} (the default); set \
                     faults.{other} too",
                    value.get_ref()
                ),
            )
        };
        match (&raw.delay_ms, &raw.delay_probability) {
            (Some(ms), None) if faults.delay_ms > 0.0 => {
                Err(alone("delay_ms", ms, "delay_probability", faults.delay_probability))
            }
            (None, Some(chance)) if faults.delay_probability > 0.0 => {
                Err(alone("delay_probability", chance, "delay_ms", faults.delay_ms))
            }
            _ => Ok(faults),
        }
    }
}
