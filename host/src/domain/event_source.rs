//! Where an engine publishes KV events, as a registration or the config names it, and
//! one data-parallel rank's endpoints: offset by rank as the engines do it, checked
//! before anything connects. A leaf: the config checks sources with it too.

use serde::Deserialize;
use std::fmt;

/// Where an engine publishes its KV events (its `--kv-events-config`), as a worker
/// registration or the config's `kv_events.sources` give it.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq, Eq, Hash)]
#[serde(deny_unknown_fields)]
pub struct KvEventSource {
    /// The engine's `endpoint`, as its config names it for data-parallel rank 0: a
    /// registration for rank `r` subscribes at the port plus `r`, as the engines
    /// publish (`tcp://10.0.0.7:5557` → rank 2 at `:5559`).
    pub endpoint: String,
    /// The engine's `replay_endpoint` (a ROUTER socket it binds), offset by rank
    /// the same way. Without one, a gap clears the worker's index entries instead.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// The engine's `topic` ("" by default).
    #[serde(default)]
    pub topic: String,
    /// `false` (the default): the engine binds (its endpoint has `*`, or SGLang's
    /// `bind: true`) and the router connects to `endpoint`. `true`: the engine
    /// connects to a concrete address (its endpoint names this router's host) and the
    /// router binds `endpoint` for it.
    #[serde(default)]
    pub bind: bool,
}

/// A worker registration's `kv_events`: where its engine publishes, or
/// `"approximate"` for an engine that publishes none (llama.cpp; TRT-LLM without its
/// publisher), which the router then credits with the blocks it routed there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KvEvents {
    Approximate,
    Source(KvEventSource),
}

impl KvEvents {
    pub fn source(&self) -> Option<&KvEventSource> {
        match self {
            Self::Approximate => None,
            Self::Source(source) => Some(source),
        }
    }
}

impl<'de> Deserialize<'de> for KvEvents {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = KvEvents;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "where the engine publishes KV events ({\"endpoint\": \"tcp://…\", …}), \
                     or \"approximate\" for an engine that publishes none",
                )
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<KvEvents, E> {
                match text {
                    "approximate" => Ok(KvEvents::Approximate),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<KvEvents, A::Error> {
                KvEventSource::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(KvEvents::Source)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// A source's endpoints for one rank, ready for ZMQ.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoints {
    /// The PUB side, this rank's port.
    pub events: String,
    pub replay: Option<String>,
    pub topic: String,
    pub bind: bool,
}

impl fmt::Display for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}",
            if self.bind {
                "bound at"
            } else {
                "connected to"
            },
            self.events
        )
    }
}

/// Why a source cannot be used, with the field to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv_events.{field} {problem}")]
pub struct SourceError {
    pub field: &'static str,
    pub problem: String,
}

fn fail(field: &'static str, problem: impl Into<String>) -> SourceError {
    SourceError {
        field,
        problem: problem.into(),
    }
}

/// Hosts a subscriber cannot connect to: they mean "every interface" on the engine.
fn is_wildcard(host: &str) -> bool {
    matches!(host, "*" | "0.0.0.0" | "::" | "[::]")
}

/// `endpoint` for data-parallel rank `rank`: a `tcp://` port plus the rank, an
/// `inproc://` name with `_dp{rank}` appended (rank 0 unchanged), as vLLM's and
/// SGLang's publishers offset theirs. Both refuse an `ipc://` endpoint for a rank
/// above 0, so it is refused here too.
fn for_rank(field: &'static str, endpoint: &str, rank: u32) -> Result<String, SourceError> {
    let endpoint = endpoint.trim();
    if let Some(address) = endpoint.strip_prefix("tcp://") {
        let Some((host, port)) = address.rsplit_once(':') else {
            return Err(fail(
                field,
                format!("`{endpoint}` has no port; write it as tcp://HOST:PORT"),
            ));
        };
        let port: u16 = port.parse().map_err(|_| {
            fail(
                field,
                format!("`{endpoint}`: `{port}` is not a port number (1–65535)"),
            )
        })?;
        if host.is_empty() || port == 0 {
            return Err(fail(
                field,
                format!("`{endpoint}` needs a host and a non-zero port: tcp://HOST:PORT"),
            ));
        }
        let port = u32::from(port) + rank;
        if port > u32::from(u16::MAX) {
            return Err(fail(
                field,
                format!("`{endpoint}` plus dp rank {rank} is port {port}, past 65535"),
            ));
        }
        return Ok(format!("tcp://{host}:{port}"));
    }
    if endpoint.starts_with("ipc://") && rank > 0 {
        return Err(fail(
            field,
            format!(
                "`{endpoint}` cannot serve dp rank {rank}: the engines offset only tcp:// \
                 ports (and inproc:// names) by rank; use tcp://HOST:PORT"
            ),
        ));
    }
    if endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://") {
        return Ok(if rank == 0 {
            endpoint.to_string()
        } else {
            format!("{endpoint}_dp{rank}")
        });
    }
    Err(fail(
        field,
        format!(
            "`{endpoint}` is not a ZMQ endpoint: use tcp://HOST:PORT, ipc://PATH or inproc://NAME"
        ),
    ))
}

fn host_of(endpoint: &str) -> Option<&str> {
    endpoint
        .strip_prefix("tcp://")
        .and_then(|a| a.rsplit_once(':'))
        .map(|(host, _)| host)
}

impl Endpoints {
    /// Checks `source` and resolves its endpoints for data-parallel rank `rank`.
    pub fn resolve(rank: u32, source: &KvEventSource) -> Result<Self, SourceError> {
        let events = for_rank("endpoint", &source.endpoint, rank)?;
        if !source.bind && host_of(&events).is_some_and(is_wildcard) {
            return Err(fail(
                "endpoint",
                format!(
                    "`{}` is the engine's bind address; the router connects to the engine, \
                     so name the engine's host (tcp://ENGINE_HOST:PORT), or set \
                     `bind: true` if the engine connects to the router",
                    source.endpoint
                ),
            ));
        }
        let replay = match &source.replay_endpoint {
            None => None,
            Some(replay) => {
                let replay = for_rank("replay_endpoint", replay, rank)?;
                if host_of(&replay).is_some_and(is_wildcard) {
                    return Err(fail(
                        "replay_endpoint",
                        format!(
                            "`{replay}` is the engine's bind address; the engine always binds \
                             its replay socket and the router connects to it, so name the \
                             engine's host (tcp://ENGINE_HOST:PORT)"
                        ),
                    ));
                }
                Some(replay)
            }
        };
        if source.topic.len() > 1024 {
            return Err(fail("topic", "is longer than 1024 bytes"));
        }
        Ok(Self {
            events,
            replay,
            topic: source.topic.clone(),
            bind: source.bind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(endpoint: &str, replay: Option<&str>, bind: bool) -> KvEventSource {
        KvEventSource {
            endpoint: endpoint.into(),
            replay_endpoint: replay.map(str::to_owned),
            topic: String::new(),
            bind,
        }
    }

    #[test]
    fn ranks_offset_ports_and_paths_as_the_engines_do() {
        let e = Endpoints::resolve(
            2,
            &source("tcp://10.0.0.7:5557", Some("tcp://10.0.0.7:5600"), false),
        )
        .unwrap();
        assert_eq!(e.events, "tcp://10.0.0.7:5559");
        assert_eq!(e.replay.as_deref(), Some("tcp://10.0.0.7:5602"));
        let e = Endpoints::resolve(0, &source("ipc:///tmp/kv", None, false)).unwrap();
        assert_eq!(e.events, "ipc:///tmp/kv");
        let e = Endpoints::resolve(1, &source("inproc://kv", None, false)).unwrap();
        assert_eq!(e.events, "inproc://kv_dp1");
        let ipc = Endpoints::resolve(1, &source("ipc:///tmp/kv", None, false)).unwrap_err();
        assert!(ipc.problem.contains("dp rank 1"), "{ipc}");
        let e = Endpoints::resolve(1, &source("tcp://*:6000", None, true)).unwrap();
        assert_eq!(e.events, "tcp://*:6001");
    }

    #[test]
    fn bad_endpoints_say_which_field_and_what_to_write() {
        let wildcard = Endpoints::resolve(0, &source("tcp://*:5557", None, false)).unwrap_err();
        assert_eq!(wildcard.field, "endpoint");
        assert!(wildcard.problem.contains("ENGINE_HOST"), "{wildcard}");
        for (endpoint, words) in [
            ("http://x:1", "not a ZMQ endpoint"),
            ("tcp://x", "no port"),
            ("tcp://x:port", "not a port number"),
            ("tcp://x:65535", "past 65535"),
        ] {
            let error = Endpoints::resolve(1, &source(endpoint, None, false)).unwrap_err();
            assert!(error.to_string().contains(words), "{endpoint}: {error}");
        }
        let replay = Endpoints::resolve(0, &source("tcp://h:1", Some("tcp://0.0.0.0:2"), false))
            .unwrap_err();
        assert_eq!(replay.field, "replay_endpoint");
    }
}
