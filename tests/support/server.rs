//! A `kvhint serve` child ([`Server`]): started on a free loopback port, read
//! with deadlines, killed on drop, with its HTTP calls, status and log at hand;
//! and [`PluginSite`], the private directory with a watched plugins directory
//! and config such a server serves.

use crate::paths::private_dir;
use crate::plugins::{drop_in, kvhint_bin, plugin_so};
use crate::process;
use crate::wait::Waiting;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;
use tempfile::TempDir;

/// A private directory (0700) with a plugins directory holding the given
/// `.so` files and a config (`kvhint.yaml`, block size 4) that watches it, for
/// tests of a serving router.
pub struct PluginSite {
    pub dir: TempDir,
}

impl PluginSite {
    pub fn new(plugins: &[(&str, PathBuf)], yaml_roles: &str) -> PluginSite {
        let site = PluginSite { dir: private_dir() };
        site.make_plugins_dir();
        for (name, so) in plugins {
            drop_in(&site.plugins().join(name), &std::fs::read(so).unwrap()).unwrap();
        }
        site.write_config(yaml_roles);
        site
    }

    /// A plugins directory holding the example plugin.
    pub fn with_prefetch(roles: &str) -> PluginSite {
        Self::new(
            &[("libharness_prefetch.so", plugin_so("harness_prefetch"))],
            roles,
        )
    }

    /// Creates the (empty) plugins directory, 0700.
    pub fn make_plugins_dir(&self) {
        std::fs::create_dir(self.plugins()).unwrap();
        std::fs::set_permissions(self.plugins(), std::fs::Permissions::from_mode(0o700)).unwrap();
    }

    pub fn plugins(&self) -> PathBuf {
        self.dir.path().join("plugins")
    }

    pub fn config(&self) -> PathBuf {
        self.dir.path().join("kvhint.yaml")
    }

    /// Writes the config with these roles, by the drop-in protocol.
    pub fn write_config(&self, roles: &str) {
        let yaml = format!(
            "plugins:\n  directory: plugins\n  cache_dir: cache\nrouter:\n  block_size: 4\n  max_prompt_tokens: 256\nworker_selection:\n{roles}"
        );
        drop_in(&self.config(), yaml.as_bytes()).unwrap();
    }
}

/// A running `kvhint serve`, killed on drop.
pub struct Server {
    pub child: Child,
    pub base: String,
    pub agent: ureq::Agent,
    pub log_file: PathBuf,
    /// What `serve` prints after `listening on …` (the endpoint picker's
    /// address, say); kept open so that printing never meets a closed pipe.
    stdout: Mutex<process::LineReader>,
}

impl Server {
    pub fn start(config: &Path, extra: &[&str], log_dir: &Path) -> Server {
        Self::start_command(Command::new(kvhint_bin()), config, extra, log_dir)
    }

    /// Like [`Self::start`], with `command` as the program that runs `kvhint`
    /// (a shell that sets a limit first, say), given `serve …` as arguments.
    pub fn start_command(
        mut command: Command,
        config: &Path,
        extra: &[&str],
        log_dir: &Path,
    ) -> Server {
        let log = log_dir.join("serve.log");
        let mut child = command
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(config)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        // `serve` prints `listening on ADDRESS` once it listens; a serve that
        // hangs before that fails the test instead of hanging it.
        let stdout = process::LineReader::new(child.stdout.take().unwrap());
        let line = match stdout.line(Duration::from_secs(60)) {
            Ok(line) => line,
            Err(why) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "serve did not say where it listens: {why}\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            }
        };
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "serve did not start: {line:?}\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            })
            .to_string();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .new_agent();
        Server {
            child,
            base: format!("http://{address}"),
            agent,
            log_file: log,
            stdout: Mutex::new(stdout),
        }
    }

    pub fn address(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    /// The next line `serve` prints to stdout, waiting at most `within`.
    pub fn stdout_line(&self, within: Duration) -> Result<String, process::NoLine> {
        self.stdout
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .line(within)
    }

    /// The endpoint picker's address, from the `endpoint picker listening on
    /// …` line `serve` prints after its own when `endpoint_picker:` is set.
    pub fn picker_address(&self) -> String {
        let line = self
            .stdout_line(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("no endpoint picker address: {e}\n{}", self.log()));
        line.trim()
            .strip_prefix("endpoint picker listening on ")
            .unwrap_or_else(|| panic!("unexpected line {line:?}\n{}", self.log()))
            .to_string()
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut response = self
            .agent
            .get(&format!("{}{path}", self.base))
            .call()
            .unwrap();
        let status = response.status().as_u16();
        (status, response.body_mut().read_to_string().unwrap())
    }

    pub fn post_raw(&self, path: &str, content_type: &str, body: &str) -> (u16, Value) {
        let mut response = self
            .agent
            .post(&format!("{}{path}", self.base))
            .header("content-type", content_type)
            .send(body)
            .unwrap();
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, "application/json", &body.to_string())
    }

    pub fn status(&self) -> Value {
        serde_json::from_str(&self.get("/admin/status").1).unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_file).unwrap_or_default()
    }

    /// Waits (20 s at most, [`crate::wait`]) until `check` holds, or fails
    /// naming `what`, with the server's log.
    pub fn wait_for(&self, what: &str, mut check: impl FnMut(&Server) -> bool) {
        Waiting::new(what, Duration::from_secs(20))
            .report(|| format!("--- serve log ---\n{}", self.log()))
            .until(|| check(self).then_some(()));
    }

    /// Waits until the router holds no booking and no worker carries load.
    pub fn until_idle(&self) {
        self.wait_for("zero open bookings and zero load", |s| {
            let status = s.status();
            status["open_bookings"] == 0
                && status["workers"].as_array().unwrap().iter().all(|w| {
                    w["load"]
                        == json!({"active_requests": 0, "active_blocks": 0, "prefill_blocks": 0})
                })
        });
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
