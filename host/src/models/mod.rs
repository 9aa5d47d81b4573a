//! The models the gateway serves: for each name a client may write in `model`, the
//! tokenizer and chat template the router renders and hashes with, the role its
//! requests are booked under, and its LoRA name.
//!
//! Built with each snapshot from `models:`, so a reload can add, drop or repoint a
//! model; a tokenizer whose files have not changed since the last snapshot is
//! reused rather than parsed again (a large vocabulary's `tokenizer.json` takes
//! hundreds of milliseconds to load).

pub mod content_format;
pub mod cover;
pub mod cuts;
pub mod encoder;
pub mod pieces;
pub mod tokenizer;

use crate::config::{ConfigError, ModelConfig};
use crate::domain::Role;
pub use content_format::{ContentFormat, ContentFormatOption};
pub use encoder::EncoderOptions;
use parking_lot::Mutex;
pub use pieces::PieceStats;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
pub use tokenizer::{ChatRequest, EncodeError, ModelTokenizer, RenderError, TooLong};

/// One served model.
#[derive(Debug)]
pub struct Model {
    pub name: String,
    pub role: Role,
    /// The LoRA adapter the engines serve it as: it seeds the block hashes as the
    /// engines' own do.
    pub lora: Option<String>,
    /// Prefill and decode on two pools (`models.<name>.disaggregation`).
    pub disaggregation: Option<crate::config::disaggregation::Disaggregation>,
    pub tokenizer: Arc<ModelTokenizer>,
}

/// Every served model, by name.
#[derive(Debug, Default)]
pub struct Models {
    by_name: HashMap<String, Arc<Model>>,
    /// Names in the config's order, for listing.
    names: Vec<String>,
}

impl Models {
    pub fn get(&self, name: &str) -> Option<&Arc<Model>> {
        self.by_name.get(name)
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Loads every model's tokenizer (through `cache`, if given), each with a
    /// piece cache of `piece_cache_bytes`; each failure is an error at the
    /// model's `tokenizer` key, naming the file.
    pub fn load(
        file: &Path,
        models: &[ModelConfig],
        cache: Option<&TokenizerCache>,
        piece_cache_bytes: u64,
    ) -> Result<Models, Vec<ConfigError>> {
        let mut out = Models::default();
        let mut errors = Vec::new();
        for model in models {
            let options = EncoderOptions {
                force_hf: model.force_hf,
                fast_file: None,
            };
            let loaded = match cache {
                Some(cache) => cache.get(
                    &model.tokenizer,
                    piece_cache_bytes,
                    &options,
                    model.content_format,
                ),
                None => ModelTokenizer::load_with(&model.tokenizer, piece_cache_bytes, &options)
                    .map(|mut tokenizer| {
                        tokenizer.set_content_format(model.content_format);
                        Arc::new(tokenizer)
                    }),
            };
            match loaded {
                Ok(tokenizer) => {
                    out.names.push(model.name.clone());
                    out.by_name.insert(
                        model.name.clone(),
                        Arc::new(Model {
                            name: model.name.clone(),
                            role: model.role,
                            lora: model.lora.clone(),
                            disaggregation: model.disaggregation.clone(),
                            tokenizer,
                        }),
                    );
                }
                Err(e) => {
                    let mut at = model.at.clone();
                    at.path = format!("{}.tokenizer", at.path);
                    errors.push(ConfigError::new(
                        file,
                        Some(at),
                        format!("{e}; point `tokenizer` at the model's tokenizer directory"),
                    ));
                }
            }
        }
        if errors.is_empty() {
            Ok(out)
        } else {
            Err(errors)
        }
    }
}

/// What a tokenizer directory's files were when they were loaded, the piece
/// cache's size, whether 0.23 was asked for (`encoder: hf`) and the
/// `chat_template_content_format`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fingerprint(
    Vec<(u64, Option<std::time::SystemTime>)>,
    u64,
    bool,
    ContentFormatOption,
);

impl Fingerprint {
    fn of(
        dir: &Path,
        piece_cache_bytes: u64,
        force_hf: bool,
        content_format: ContentFormatOption,
    ) -> Fingerprint {
        Fingerprint(
            [
                "tokenizer.json",
                "tokenizer_config.json",
                "chat_template.jinja",
            ]
            .iter()
            .map(|name| match std::fs::metadata(dir.join(name)) {
                Ok(m) => (m.len(), m.modified().ok()),
                Err(_) => (u64::MAX, None),
            })
            .collect(),
            piece_cache_bytes,
            force_hf,
            content_format,
        )
    }
}

/// Tokenizers kept across reloads while their files (and the piece cache's size)
/// stay the same: their piece caches stay warm through a reload.
#[derive(Debug, Default)]
pub struct TokenizerCache {
    loaded: Mutex<HashMap<PathBuf, (Fingerprint, Arc<ModelTokenizer>)>>,
}

impl TokenizerCache {
    fn get(
        &self,
        dir: &Path,
        piece_cache_bytes: u64,
        options: &EncoderOptions,
        content_format: ContentFormatOption,
    ) -> Result<Arc<ModelTokenizer>, tokenizer::LoadError> {
        let fingerprint = Fingerprint::of(dir, piece_cache_bytes, options.force_hf, content_format);
        if let Some((seen, tokenizer)) = self.loaded.lock().get(dir) {
            if *seen == fingerprint {
                return Ok(Arc::clone(tokenizer));
            }
        }
        let mut tokenizer = ModelTokenizer::load_with(dir, piece_cache_bytes, options)?;
        tokenizer.set_content_format(content_format);
        let tokenizer = Arc::new(tokenizer);
        self.loaded
            .lock()
            .insert(dir.to_path_buf(), (fingerprint, Arc::clone(&tokenizer)));
        Ok(tokenizer)
    }
}
