//! vLLM 0.34.0's own request renderer as a tokenization oracle: the binary
//! `vllm/vllm-rs` inside its wheel (it links only libc, libm, libdl, libpthread and
//! libgcc), run as `vllm-rs render DIR` on 127.0.0.1. It answers
//! `POST /v1/chat/completions/render` and `POST /v1/completions/render` with the
//! token ids vLLM would give the engine: what the router's tokenizer must equal.
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
    /// Serves `tokenizer_dir`'s tokenizer and template as model `name`, with the
    /// minimal `config.json` vLLM wants beside them (a Qwen3 architecture).
    pub fn start(tokenizer_dir: &Path, name: &str) -> Renderer {
        let model = private_dir();
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(tokenizer_dir.join(file), model.path().join(file))
                .unwrap_or_else(|e| panic!("cannot copy {file}: {e}"));
        }
        std::fs::write(
            model.path().join("config.json"),
            r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
                "max_position_embeddings": 40960, "torch_dtype": "float16",
                "bos_token_id": 151643, "eos_token_id": 151645}"#,
        )
        .unwrap();
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
            // Qwen3 calls tools in Hermes's format; vLLM renders tools only with a parser.
            .args(["--tool-call-parser", "hermes"])
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

    fn ids(&self, path: &str, request: &Value) -> Vec<u32> {
        let (status, reply) = crate::http::post(
            &self.agent,
            &format!("http://127.0.0.1:{}{path}", self.port),
            request,
        );
        assert_eq!(status, 200, "{path}: {reply}");
        // Completions answer a list (one per prompt).
        let one = if reply.is_array() { &reply[0] } else { &reply };
        one["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("no token_ids: {reply}"))
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
