//! `endpoint_picker:`: kvhint as Envoy's endpoint picker (the Gateway API
//! Inference Extension's ext_proc protocol). Optional: without the section no
//! gRPC listener starts. Its own file so the section's parsing and errors stay in
//! one place; read once at start (the listener's address cannot change on reload).

use super::yaml::{join, node_location, Walker};
use marked_yaml::Node;
use std::net::SocketAddr;

/// `endpoint_picker:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointPickerConfig {
    /// `listen`: where the gRPC server (`envoy.service.ext_proc.v3.ExternalProcessor`
    /// and `grpc.health.v1.Health`) listens.
    pub listen: SocketAddr,
    /// `fallbacks`: endpoints named after the booked one in
    /// `x-gateway-destination-endpoint`, for the proxy's retries (0, the
    /// default: none; Envoy's own `ORIGINAL_DST` cluster reads one address, so
    /// only a proxy that follows the list wants more).
    pub fallbacks: u32,
    /// `max_body_bytes`: a request body larger than this is refused with 413.
    pub max_body_bytes: u64,
    /// `max_streams`: ext_proc streams open at once at most; one more is
    /// refused with gRPC `RESOURCE_EXHAUSTED`.
    pub max_streams: u64,
    /// `max_buffered_bytes`: request-body bytes held across every stream at
    /// most; a chunk past it ends its stream with `RESOURCE_EXHAUSTED`.
    pub max_buffered_bytes: u64,
    /// `body_timeout_ms`: from a request's headers to the end of its body at
    /// most; past it the stream ends with `DEADLINE_EXCEEDED`.
    pub body_timeout_ms: u64,
}

impl EndpointPickerConfig {
    pub const DEFAULT_FALLBACKS: u32 = 0;
    pub const DEFAULT_MAX_BODY_BYTES: u64 = 16 << 20;
    pub const DEFAULT_MAX_STREAMS: u64 = 1_024;
    pub const DEFAULT_MAX_BUFFERED_BYTES: u64 = 256 << 20;
    pub const DEFAULT_BODY_TIMEOUT_MS: u64 = 30_000;
}

pub(super) fn endpoint_picker(walker: &mut Walker, node: &Node) -> Option<EndpointPickerConfig> {
    let map = walker.mapping(node, "endpoint_picker")?;
    walker.known_keys(
        map,
        "endpoint_picker",
        &[
            "listen",
            "fallbacks",
            "max_body_bytes",
            "max_streams",
            "max_buffered_bytes",
            "body_timeout_ms",
        ],
    );
    let mut fallbacks = EndpointPickerConfig::DEFAULT_FALLBACKS;
    if let Some(n) = map.get_node("fallbacks") {
        if let Some(v) = walker.unsigned(n, "endpoint_picker.fallbacks", 0, 16) {
            fallbacks = v as u32;
        }
    }
    let mut max_body_bytes = EndpointPickerConfig::DEFAULT_MAX_BODY_BYTES;
    if let Some(n) = map.get_node("max_body_bytes") {
        if let Some(v) = walker.unsigned(n, "endpoint_picker.max_body_bytes", 1, 1 << 30) {
            max_body_bytes = v;
        }
    }
    let mut number = |key: &str, min: u64, max: u64, default: u64| {
        map.get_node(key)
            .and_then(|n| walker.unsigned(n, &join("endpoint_picker", key), min, max))
            .unwrap_or(default)
    };
    let max_streams = number(
        "max_streams",
        1,
        1 << 20,
        EndpointPickerConfig::DEFAULT_MAX_STREAMS,
    );
    let max_buffered_bytes = number(
        "max_buffered_bytes",
        1,
        1 << 40,
        EndpointPickerConfig::DEFAULT_MAX_BUFFERED_BYTES,
    );
    let body_timeout_ms = number(
        "body_timeout_ms",
        1,
        3_600_000,
        EndpointPickerConfig::DEFAULT_BODY_TIMEOUT_MS,
    );
    let path = join("endpoint_picker", "listen");
    let Some(listen) = map.get_node("listen") else {
        walker.error(
            node_location("endpoint_picker", node),
            "`endpoint_picker.listen` is missing: give the gRPC address Envoy's ext_proc filter calls, e.g. `listen: 127.0.0.1:9002`",
        );
        return None;
    };
    let text = walker.string(listen, &path)?;
    match text.parse::<SocketAddr>() {
        Ok(listen) => Some(EndpointPickerConfig {
            listen,
            fallbacks,
            max_body_bytes,
            max_streams,
            max_buffered_bytes,
            body_timeout_ms,
        }),
        Err(_) => {
            walker.error(
                node_location(&path, listen),
                format!("`{text}` is not an IP:PORT address; write e.g. `127.0.0.1:9002` (a host name is not resolved here)"),
            );
            None
        }
    }
}
