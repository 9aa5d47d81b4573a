//! The peer gateways the benches run beside kvhint, from the harness's Python
//! environment (`tests/engines/requirements.txt`): SGLang's model gateway
//! (`smg` 1.13.0) and vLLM's router (`vllm-router` 0.1.17), each with
//! `--policy cache_aware` at its launcher's defaults, in front of the same
//! workers as kvhint.

use crate::http::agent;
use crate::process::{free_port, spawn_tied};
use crate::wait::Waiting;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A peer gateway: its process and where clients send requests.
pub struct Peer {
    pub name: &'static str,
    pub url: String,
    pub child: Child,
}

impl Peer {
    /// `smg launch … --policy cache_aware` in front of `workers`.
    pub fn smg(workers: &[String]) -> Peer {
        let port = free_port();
        let mut args: Vec<String> = ["launch", "--host", "127.0.0.1", "--port"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.push(port.to_string());
        args.push("--worker-urls".into());
        args.extend(workers.iter().cloned());
        args.extend(policy_and_metrics());
        Self::start("smg", &args, port)
    }

    /// `vllm-router … --policy cache_aware` in front of `workers`.
    pub fn vllm_router(workers: &[String]) -> Peer {
        let port = free_port();
        let mut args: Vec<String> = ["--host", "127.0.0.1", "--port"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.push(port.to_string());
        args.push("--worker-urls".into());
        args.extend(workers.iter().cloned());
        args.extend(policy_and_metrics());
        Self::start("vllm-router", &args, port)
    }

    /// Starts `binary` (from the harness's environment) with `args` and waits
    /// until it answers `GET /v1/models` on `port`.
    pub fn start(binary: &'static str, args: &[String], port: u16) -> Peer {
        let python = crate::provision::python();
        let Some(bin) = python.parent() else {
            panic!("{} has no parent directory", python.display());
        };
        let path = bin.join(binary);
        let log = std::env::temp_dir().join(format!("kvhint-bench-{binary}-{port}.log"));
        let stderr = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let mut command = Command::new(&path);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        let mut child =
            spawn_tied(command).unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
        let agent = agent();
        let url = format!("http://127.0.0.1:{port}");
        Waiting::new(
            &format!("{binary} to answer GET /v1/models"),
            Duration::from_secs(60),
        )
        .every(Duration::from_millis(100))
        .report(|| std::fs::read_to_string(&log).unwrap_or_default())
        .until(|| {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "{binary} exited ({status}):\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            agent
                .get(&format!("{url}/v1/models"))
                .call()
                .is_ok_and(|r| r.status().as_u16() == 200)
                .then_some(())
        });
        Peer {
            name: binary,
            url,
            child,
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `--policy cache_aware`, and a metrics port of its own (both peers default
/// to 29000, so two at once would collide).
fn policy_and_metrics() -> Vec<String> {
    vec![
        "--policy".to_string(),
        "cache_aware".to_string(),
        "--prometheus-host".to_string(),
        "127.0.0.1".to_string(),
        "--prometheus-port".to_string(),
        free_port().to_string(),
    ]
}
