//! A served model's tokenizer and chat template, as the engine behind it has them.
//!
//! The router hashes the token ids an engine will compute, so it must render and
//! tokenize exactly as the engine does. That is HF `tokenizers` (with Oniguruma,
//! the regex engine Python's tokenizers use) on the model's `tokenizer.json`, and
//! the chat template from `tokenizer_config.json` rendered the way
//! `transformers.apply_chat_template` renders it: Jinja with `trim_blocks` and
//! `lstrip_blocks`, Python's string methods (`pycompat`), `raise_exception`,
//! `strftime_now`, and a `tojson` that writes what Python's `json.dumps` writes
//! (`", "` and `": "` separators, key order kept, no HTML escaping; minijinja's own
//! `tojson` escapes `<` and writes no spaces, which changes every tool prompt). A
//! rendered chat is encoded without special tokens (the template wrote them);
//! a completion prompt with them, as vLLM does. The text is encoded by the
//! encoder picked for the model at load ([`super::encoder`]: `tokenizers`
//! 1.0.0-rc.3 where it gives 0.23's ids on a self-test, 0.23 otherwise).

use super::content_format::{self, ContentFormat, ContentFormatOption};
use super::cuts::Cuts;
use super::encoder::{Encode, Encoder, EncoderOptions};
use super::pieces::{PieceCache, PieceStats, Stop};
use crate::splice::{Body, Edits};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::value::RawValue;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a model's tokenizer could not be loaded: the file, and what was wrong.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{file}: {problem}")]
pub struct LoadError {
    pub file: PathBuf,
    pub problem: String,
}

/// Why a request could not be rendered or tokenized (a client's error: 400).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct RenderError(pub String);

/// A prompt with more tokens than the router books (`router.max_prompt_tokens`),
/// found before all of it was tokenized: `counted` tokens in its first `read`
/// bytes of `bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLong {
    pub counted: usize,
    pub max: usize,
    pub read: usize,
    pub bytes: usize,
}

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            counted,
            max,
            read,
            bytes,
        } = self;
        // The router's own refusal says "the prompt has N tokens"; here N is where
        // counting stopped, so it says "at least", and how far in that was.
        write!(
            f,
            "the prompt has at least {counted} tokens (counting stopped there, {read} of its \
             {bytes} bytes in); this router accepts at most {max} (router.max_prompt_tokens): \
             shorten the prompt, or raise router.max_prompt_tokens"
        )
    }
}

/// Why a prompt was not tokenized: it is not valid (a client's error), or it has
/// more tokens than the bound it was tokenized under.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EncodeError {
    #[error("{0}")]
    Invalid(#[from] RenderError),
    #[error("{0}")]
    TooLong(TooLong),
}

/// The special tokens `tokenizer_config.json` names, passed to the template as
/// `transformers` passes them.
const SPECIAL_TOKENS: &[&str] = &[
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// One model's tokenizer and (if it has one) its chat template, ready to use from
/// any thread.
pub struct ModelTokenizer {
    /// 0.23's tokenizer (decoding, the vocabulary, the piece cache's split) and
    /// the encoder picked for this model's text.
    encoder: Encoder,
    /// The template environment, with the template named `chat`.
    chat: Option<Environment<'static>>,
    /// The content format detected from the template ("string" without one).
    detected_format: ContentFormat,
    /// The model's `chat_template_content_format`.
    format_option: ContentFormatOption,
    /// `bos_token` and the others, as strings (absent ones left out).
    specials: Vec<(&'static str, String)>,
    /// Ids of the pieces between special tokens, kept; or why this tokenizer's
    /// pieces cannot be encoded apart (every text is then encoded whole).
    pieces: Result<PieceCache, String>,
    pub dir: PathBuf,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .field("encoder", &self.encoder)
            .field("chat_template", &self.chat.is_some())
            .field("content_format", &self.content_format())
            .field("pieces", &self.pieces)
            .finish()
    }
}

impl ModelTokenizer {
    /// Loads `dir/tokenizer.json` and `dir/tokenizer_config.json` (its
    /// `chat_template`, or a `chat_template.jinja` beside it, as newer models ship),
    /// with a cache of at most `cache_bytes` for the ids of prompt pieces.
    pub fn load(dir: &Path, cache_bytes: u64) -> Result<Self, LoadError> {
        Self::load_with(dir, cache_bytes, &EncoderOptions::default())
    }

    /// [`load`](Self::load), with the encoder picked as `options` say.
    pub fn load_with(
        dir: &Path,
        cache_bytes: u64,
        options: &EncoderOptions,
    ) -> Result<Self, LoadError> {
        let tokenizer_file = dir.join("tokenizer.json");
        let fail = |file: &Path, problem: String| LoadError {
            file: file.to_path_buf(),
            problem,
        };
        if !tokenizer_file.is_file() {
            return Err(fail(
                &tokenizer_file,
                "not found: a model's tokenizer directory holds the tokenizer.json and \
                 tokenizer_config.json its engine loads (as on the model's hub page)"
                    .into(),
            ));
        }
        let encoder = Encoder::load(&tokenizer_file, options).map_err(|e| {
            fail(
                &tokenizer_file,
                format!("not a tokenizer HF tokenizers can load: {e}"),
            )
        })?;
        let config_file = dir.join("tokenizer_config.json");
        let config: Json = match std::fs::read(&config_file) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| fail(&config_file, format!("not valid JSON: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(e) => return Err(fail(&config_file, format!("cannot be read: {e}"))),
        };
        let specials = SPECIAL_TOKENS
            .iter()
            .filter_map(|name| {
                let token = match config.get(*name)? {
                    Json::String(s) => s.clone(),
                    // An AddedToken written out: {"content": "<s>", ...}.
                    Json::Object(o) => o.get("content")?.as_str()?.to_string(),
                    _ => return None,
                };
                Some((*name, token))
            })
            .collect();
        let template = match config.get("chat_template") {
            Some(Json::String(t)) => Some(t.clone()),
            // A list of named templates: the one named "default".
            Some(Json::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => {
                let jinja = dir.join("chat_template.jinja");
                match std::fs::read_to_string(&jinja) {
                    Ok(text) => Some(text),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => return Err(fail(&jinja, format!("cannot be read: {e}"))),
                }
            }
        };
        let detected_format = template
            .as_deref()
            .map_or(ContentFormat::String, content_format::detect);
        let chat = match template {
            Some(source) => Some(environment(source).map_err(|e| {
                fail(
                    &config_file,
                    format!("its chat_template does not compile: {e:#}"),
                )
            })?),
            None => None,
        };
        let pieces = PieceCache::for_tokenizer(encoder.hf(), cache_bytes);
        match &pieces {
            Err(why) => tracing::info!(
                tokenizer = %tokenizer_file.display(),
                "prompt pieces are not cached for this tokenizer, and a prompt over \
                 router.max_prompt_tokens is tokenized whole before it is refused: {why}"
            ),
            Ok(pieces) => {
                if let Some(why) = pieces.uncut() {
                    tracing::info!(
                        tokenizer = %tokenizer_file.display(),
                        "a long prompt piece is tokenized whole for this tokenizer (the \
                         bound is checked after it): {why}"
                    );
                }
            }
        }
        Ok(Self {
            encoder,
            chat,
            detected_format,
            format_option: ContentFormatOption::Auto,
            specials,
            pieces,
            dir: dir.to_path_buf(),
        })
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// Renders chats with the content format `option` says (the model's
    /// `chat_template_content_format`): the one detected from the template
    /// (`Auto`, as loaded), or the one set.
    pub fn set_content_format(&mut self, option: ContentFormatOption) {
        self.format_option = option;
    }

    /// The content format chats are rendered with (vLLM's "string" or
    /// "openai", [`content_format`]), and whether it was `"detected"` from the
    /// template or `"configured"`.
    pub fn content_format(&self) -> (ContentFormat, &'static str) {
        match self.format_option {
            ContentFormatOption::Auto => (self.detected_format, "detected"),
            ContentFormatOption::Set(format) => (format, "configured"),
        }
    }

    /// The library that encodes this model's text ([`encoder::FAST`] or
    /// [`encoder::HF`]), and why not the fast one when it is 0.23.
    ///
    /// [`encoder::FAST`]: super::encoder::FAST
    /// [`encoder::HF`]: super::encoder::HF
    pub fn encoder(&self) -> (&'static str, Option<&str>) {
        (self.encoder.name(), self.encoder.fallback())
    }

    /// A completion prompt's ids, with the special tokens the tokenizer adds (a BOS
    /// for models that take one), as vLLM encodes `/v1/completions`; with what the
    /// piece cache held of it.
    pub fn encode_prompt(&self, prompt: &str) -> Result<(Vec<u32>, PieceStats), RenderError> {
        self.encode(prompt, true, usize::MAX).map_err(unbounded)
    }

    /// [`encode_prompt`](Self::encode_prompt), refused with [`EncodeError::TooLong`]
    /// as soon as the count passes `max`, before the rest is tokenized.
    pub fn encode_prompt_within(
        &self,
        prompt: &str,
        max: usize,
    ) -> Result<(Vec<u32>, PieceStats), EncodeError> {
        self.encode(prompt, true, max)
    }

    fn encode(
        &self,
        text: &str,
        special: bool,
        max: usize,
    ) -> Result<(Vec<u32>, PieceStats), EncodeError> {
        let fail = |e| RenderError(format!("the prompt could not be tokenized: {e}"));
        let too_long = |counted, read| {
            EncodeError::TooLong(TooLong {
                counted,
                max,
                read,
                bytes: text.len(),
            })
        };
        match &self.pieces {
            Ok(pieces) => match pieces.encode(&self.encoder, text, special, max) {
                Ok(done) => Ok(done),
                Err(Stop::Over { counted, read }) => Err(too_long(counted, read)),
                Err(Stop::Failed(e)) => Err(fail(e).into()),
            },
            // Not cut into pieces: tokenized whole, then counted.
            Err(_) => {
                let mut ids = Vec::new();
                self.encoder
                    .encode_onto(text, special, &mut ids)
                    .map_err(fail)?;
                if ids.len() > max {
                    return Err(too_long(ids.len(), text.len()));
                }
                Ok((ids, PieceStats::default()))
            }
        }
    }

    /// A text's ids with or without the special tokens the tokenizer adds, for
    /// `POST /tokenize` (through the piece cache).
    pub fn encode_text(&self, text: &str, special: bool) -> Result<Vec<u32>, RenderError> {
        self.encode(text, special, usize::MAX)
            .map(|(ids, _)| ids)
            .map_err(unbounded)
    }

    /// [`encode_text`](Self::encode_text), refused with [`EncodeError::TooLong`]
    /// as soon as the count passes `max`, before the rest is tokenized.
    pub fn encode_text_within(
        &self,
        text: &str,
        special: bool,
        max: usize,
    ) -> Result<Vec<u32>, EncodeError> {
        self.encode(text, special, max).map(|(ids, _)| ids)
    }

    /// Each id's token as the vocabulary writes it (`"Ġthe"`); an id the
    /// vocabulary does not have is an error naming it.
    pub fn token_strs(&self, ids: &[u32]) -> Result<Vec<String>, RenderError> {
        ids.iter()
            .map(|id| {
                self.encoder.hf().id_to_token(*id).ok_or_else(|| {
                    RenderError(format!(
                        "token id {id} is not in the model's vocabulary of {}",
                        self.encoder.hf().get_vocab_size(true)
                    ))
                })
            })
            .collect()
    }

    /// The text of `ids`, special tokens included (as vLLM's `/detokenize`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, RenderError> {
        let size = self.encoder.hf().get_vocab_size(true);
        if let Some(bad) = ids.iter().find(|id| **id as usize >= size) {
            return Err(RenderError(format!(
                "token id {bad} is not in the model's vocabulary of {size}"
            )));
        }
        self.encoder
            .hf()
            .decode(ids, false)
            .map_err(|e| RenderError(format!("the ids could not be decoded: {e}")))
    }

    /// The ids this model's encoder gives for the whole text, without the piece
    /// cache: what the cache must always equal.
    pub fn encode_uncached(&self, text: &str, special: bool) -> Result<Vec<u32>, RenderError> {
        let mut ids = Vec::new();
        self.encoder
            .encode_onto(text, special, &mut ids)
            .map_err(|e| RenderError(format!("the prompt could not be tokenized: {e}")))?;
        Ok(ids)
    }

    /// Renders a chat request (`messages`, and `tools`, `documents`,
    /// `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`
    /// when it has them) and tokenizes the text, without adding special tokens.
    pub fn encode_chat(
        &self,
        request: &ChatRequest,
    ) -> Result<(Vec<u32>, PieceStats), RenderError> {
        self.encode_chat_within(request, usize::MAX)
            .map_err(unbounded)
    }

    /// [`encode_chat`](Self::encode_chat), refused with [`EncodeError::TooLong`]
    /// as soon as the count passes `max`, before the rest is tokenized.
    pub fn encode_chat_within(
        &self,
        request: &ChatRequest,
        max: usize,
    ) -> Result<(Vec<u32>, PieceStats), EncodeError> {
        let text = self.render_chat(request)?;
        self.encode(&text, false, max)
    }

    /// The piece cache's totals and size (entries, bytes), or why it is off.
    pub fn piece_cache(&self) -> Result<(PieceStats, u64, u64), &str> {
        match &self.pieces {
            Ok(pieces) if pieces.keeps() => Ok(pieces.totals()),
            Ok(_) => Err("gateway.tokenizer_cache_mib is 0"),
            Err(why) => Err(why),
        }
    }

    /// Where this tokenizer cuts a long prompt piece into parts, if it does.
    pub fn cuts(&self) -> Option<Cuts> {
        self.pieces.as_ref().ok()?.cuts()
    }

    /// Why a long prompt piece is tokenized whole rather than part by part (the
    /// bound on its tokens is then checked only after it), if it is.
    pub fn uncut(&self) -> Option<&str> {
        match &self.pieces {
            Ok(pieces) => pieces.uncut(),
            Err(why) => Some(why),
        }
    }

    /// The chat request rendered through the model's template.
    pub fn render_chat(&self, request: &ChatRequest) -> Result<String, RenderError> {
        let Some(env) = &self.chat else {
            return Err(RenderError(
                "this model has no chat template (tokenizer_config.json has no \
                 chat_template): use /v1/completions"
                    .into(),
            ));
        };
        let template = env
            .get_template("chat")
            .map_err(|e| RenderError(format!("the chat template is missing: {e}")))?;
        // Variables as transformers sets them; chat_template_kwargs last, so
        // they may override any (as vLLM lets them). Every value keeps the
        // client's key order: `tojson` writes it, and the engine's renderer
        // keeps it too.
        let mut context: Vec<(String, Value)> = Vec::new();
        let (format, _) = self.content_format();
        context.push((
            "messages".into(),
            normalise_messages(&request.messages, format)?,
        ));
        if let Some(tools) = &request.tools {
            context.push(("tools".into(), normalise_tools(tools)?));
        }
        if let Some(documents) = &request.documents {
            context.push(("documents".into(), ordered(documents.get())?));
        }
        context.push((
            "add_generation_prompt".into(),
            Value::from(request.add_generation_prompt),
        ));
        if request.continue_final_message {
            context.push(("continue_final_message".into(), Value::from(true)));
        }
        for (name, token) in &self.specials {
            context.push(((*name).to_string(), Value::from(token.as_str())));
        }
        if let Some(kwargs) = &request.chat_template_kwargs {
            let kwargs = Body::parse(kwargs.get()).map_err(|e| {
                RenderError(format!(
                    "`chat_template_kwargs` is an object of template options: {e}"
                ))
            })?;
            for (key, raw) in kwargs.fields() {
                context.retain(|(k, _)| k != key);
                context.push((key.to_string(), ordered(raw)?));
            }
        }
        let rendered = template
            .render(Value::from(
                context
                    .into_iter()
                    .collect::<std::collections::BTreeMap<String, Value>>(),
            ))
            .map_err(|e| {
                RenderError(format!(
                    "the chat template failed: {}",
                    crate::logging::with_causes(&e)
                ))
            })?;
        if request.continue_final_message {
            // As transformers does: cut the rendering after the final message's
            // content (as the template saw it: its last text part where it
            // was given parts), so the model goes on writing it.
            let last = request
                .messages
                .last()
                .and_then(|m| serde_json::from_str::<serde_json::Map<String, Json>>(m.get()).ok())
                .and_then(|m| match (format, m.get("content")?) {
                    (ContentFormat::OpenAi, Json::Array(parts)) => {
                        parts.iter().rev().find_map(part_text).map(str::to_string)
                    }
                    (_, content) => content_text(content),
                })
                .unwrap_or_default();
            let cut = match rendered.rfind(last.as_str()).filter(|_| !last.is_empty()) {
                Some(at) => rendered[..at + last.len()].trim_end().to_string(),
                None => match rendered
                    .rfind(last.trim())
                    .filter(|_| !last.trim().is_empty())
                {
                    Some(at) => rendered[..at + last.trim().len()].to_string(),
                    None => {
                        return Err(RenderError(
                            "continue_final_message: the chat template does not write the \
                             final message's content as given, so it cannot be continued"
                                .into(),
                        ))
                    }
                },
            };
            return Ok(cut);
        }
        Ok(rendered)
    }
}

/// An encoding with no bound (`usize::MAX` tokens) cannot be too long; if it
/// somehow were, it is reported as a tokenizer failure rather than a panic.
fn unbounded(error: EncodeError) -> RenderError {
    match error {
        EncodeError::Invalid(e) => e,
        EncodeError::TooLong(t) => RenderError(t.to_string()),
    }
}

/// What a chat template reads from a chat request, each part as the client wrote
/// it (raw JSON), so that key order survives into the template.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Box<RawValue>>,
    #[serde(default)]
    pub tools: Option<Vec<Box<RawValue>>>,
    #[serde(default)]
    pub documents: Option<Box<RawValue>>,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    #[serde(default)]
    pub continue_final_message: bool,
    #[serde(default)]
    pub chat_template_kwargs: Option<Box<RawValue>>,
}

fn yes() -> bool {
    true
}

impl ChatRequest {
    /// The request read from a body's top-level fields, as deserializing the
    /// whole body would read it, without parsing the body's text again: each
    /// field's raw value is read alone.
    pub fn from_body(body: &Body<'_>) -> Result<Self, String> {
        fn field<T: serde::de::DeserializeOwned>(
            body: &Body<'_>,
            key: &str,
        ) -> Result<Option<T>, String> {
            body.raw(key)
                .map(|raw| serde_json::from_str(raw).map_err(|e| format!("`{key}`: {e}")))
                .transpose()
        }
        Ok(Self {
            messages: field(body, "messages")?.ok_or("missing field `messages`")?,
            tools: field(body, "tools")?.flatten(),
            documents: field(body, "documents")?.flatten(),
            add_generation_prompt: field(body, "add_generation_prompt")?.unwrap_or(true),
            continue_final_message: field(body, "continue_final_message")?.unwrap_or(false),
            chat_template_kwargs: field(body, "chat_template_kwargs")?.flatten(),
        })
    }
}

/// A message's content as text: a string, or the text parts of a list joined by
/// newlines (vLLM's "string" content format).
fn content_text(content: &Json) -> Option<String> {
    match content {
        Json::String(s) => Some(s.clone()),
        Json::Array(parts) => Some(
            parts
                .iter()
                .filter_map(part_text)
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    }
}

/// A content part's text: a string part, or a text part's `text`.
fn part_text(part: &Json) -> Option<&str> {
    match part {
        Json::String(s) => Some(s.as_str()),
        Json::Object(o) if o.get("type").and_then(Json::as_str) == Some("text") => {
            o.get("text").and_then(Json::as_str)
        }
        _ => None,
    }
}

/// JSON text as a template value, with every object's keys in the text's order.
fn ordered(raw: &str) -> Result<Value, RenderError> {
    serde_json::from_str::<Value>(raw).map_err(|e| RenderError(format!("invalid JSON: {e}")))
}

/// Messages as vLLM hands them to the template, in its content `format`:
///
/// - "string": list content joined to one text with "\n";
/// - "openai": content as a list of text parts, `[{"type": "text", "text":
///   …}]` (a string content as one part, a string part as a text part, a text
///   part's other fields kept after `type` and `text`), except a `tool`
///   message's, which vLLM joins to one text in either format.
///
/// A `null` or absent content (an assistant's tool call, as OpenAI clients
/// send it) is empty: `""`, or `[]` in "openai" (a template never sees
/// `none`), as vLLM's renderer has it. Anything but text parts is refused (no
/// engine behind this router renders images from a chat template).
fn normalise_messages(
    messages: &[Box<RawValue>],
    format: ContentFormat,
) -> Result<Value, RenderError> {
    if messages.is_empty() {
        return Err(RenderError("`messages` is empty".into()));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let body =
            Body::parse(message.get()).map_err(|e| RenderError(format!("messages[{i}]: {e}")))?;
        if !body.raw("role").is_some_and(|r| r.starts_with('"')) {
            return Err(RenderError(format!(
                "messages[{i}] has no `role` string (system, user, assistant or tool)"
            )));
        }
        // `get` reads a null as absent; both are an empty content.
        let content: Json = body
            .get("content")
            .map_err(|e| RenderError(format!("messages[{i}]: {e}")))?
            .unwrap_or(Json::Null);
        if let Some(other) = content
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| !p.is_string() && p.get("type").and_then(Json::as_str) != Some("text"))
        {
            return Err(RenderError(format!(
                "messages[{i}].content has a part of type {}: only text parts are routed",
                other.get("type").unwrap_or(&Json::Null)
            )));
        }
        let tool = body.raw("role") == Some("\"tool\"");
        let joined = |content: &Json| {
            serde_json::to_string(&content_text(content).unwrap_or_default()).unwrap_or_default()
        };
        // The content as the template gets it, as JSON text (`None`: as sent).
        let edited = match (format, &content) {
            (_, Json::String(_)) if format == ContentFormat::String || tool => None,
            // Not a content at all: the template gets it as sent, as before.
            (_, Json::Bool(_) | Json::Number(_) | Json::Object(_)) => None,
            (ContentFormat::String, content) => Some(joined(content)),
            (ContentFormat::OpenAi, content) if tool => Some(joined(content)),
            (ContentFormat::OpenAi, Json::String(_)) => Some(format!(
                "[{}]",
                text_part(body.raw("content").unwrap_or("\"\""))
                    .map_err(|e| RenderError(format!("messages[{i}].content: {e}")))?
                    .unwrap_or_default()
            )),
            (ContentFormat::OpenAi, Json::Array(_)) => {
                let parts: Vec<&RawValue> =
                    serde_json::from_str(body.raw("content").unwrap_or("[]"))
                        .map_err(|e| RenderError(format!("messages[{i}].content: {e}")))?;
                let mut list = Vec::with_capacity(parts.len());
                for (j, part) in parts.iter().enumerate() {
                    if let Some(part) = text_part(part.get())
                        .map_err(|e| RenderError(format!("messages[{i}].content[{j}]: {e}")))?
                    {
                        list.push(part);
                    }
                }
                Some(format!("[{}]", list.join(",")))
            }
            (ContentFormat::OpenAi, _) => Some("[]".into()),
        };
        match edited {
            None => out.push(ordered(message.get())?),
            Some(content) => {
                let mut edits = Edits::default();
                edits.set("content", content);
                let edited = body.edited(&edits);
                out.push(ordered(std::str::from_utf8(&edited).unwrap_or_default())?);
            }
        }
    }
    Ok(Value::from(out))
}

/// A content part (a string, or a text part as the client wrote it) as vLLM's
/// "openai" format has it: `{"type": "text", "text": …}` then the part's other
/// fields in the client's order; `None` for a text part without text (vLLM
/// skips it).
fn text_part(raw: &str) -> Result<Option<String>, String> {
    if raw.starts_with('"') {
        return Ok(Some(format!("{{\"type\":\"text\",\"text\":{raw}}}")));
    }
    let part = Body::parse(raw).map_err(|e| e.to_string())?;
    let Some(text) = part.raw("text").filter(|t| t.starts_with('"')) else {
        return Ok(None);
    };
    let mut out = format!("{{\"type\":\"text\",\"text\":{text}");
    for (key, value) in part.fields() {
        if key != "type" && key != "text" {
            out.push(',');
            out.push_str(&serde_json::to_string(key).unwrap_or_default());
            out.push(':');
            out.push_str(value);
        }
    }
    out.push('}');
    Ok(Some(out))
}

/// Tools as vLLM's request model hands them to the template: `{"type", "function":
/// {"name", "description", "parameters", …}}` in that order (what `tojson`
/// writes into the prompt), the parameters' schema in the client's order.
fn normalise_tools(tools: &[Box<RawValue>]) -> Result<Value, RenderError> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let fail = |e: String| RenderError(format!("tools[{i}]: {e}"));
        let body = Body::parse(tool.get()).map_err(|e| fail(e.to_string()))?;
        let kind = body.raw("type").unwrap_or("\"function\"");
        let Some(function) = body.raw("function") else {
            return Err(fail(
                "has no `function` (name, description, parameters)".into(),
            ));
        };
        let function = Body::parse(function).map_err(|e| fail(e.to_string()))?;
        let mut text = String::from("{");
        let mut first = true;
        let mut field = |text: &mut String, key: &str, raw: &str| {
            if !std::mem::take(&mut first) {
                text.push(',');
            }
            text.push_str(&serde_json::to_string(key).unwrap_or_default());
            text.push(':');
            text.push_str(raw);
        };
        const KNOWN: [&str; 3] = ["name", "description", "parameters"];
        for key in KNOWN {
            if let Some(raw) = function.raw(key) {
                field(&mut text, key, raw);
            }
        }
        for (key, raw) in function.fields() {
            if !KNOWN.contains(&key) {
                field(&mut text, key, raw);
            }
        }
        text.push('}');
        out.push(ordered(&format!(
            "{{\"type\":{kind},\"function\":{text}}}"
        ))?);
    }
    Ok(Value::from(out))
}

/// The environment `transformers` renders chat templates in, with `source` as the
/// template `chat`.
fn environment(source: String) -> Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", python_tojson);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned("chat", source)?;
    Ok(env)
}

/// `datetime.now().strftime(format)`, in local time, as transformers' helper is.
fn strftime_now(format: String) -> Result<String, JinjaError> {
    let format = std::ffi::CString::new(format).map_err(|_| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            "strftime_now: NUL in the format",
        )
    })?;
    let mut out = vec![0u8; 256];
    // SAFETY: `time` writes the current time into `now`; `localtime_r` fills `tm`
    // from it (both plain out-parameters on the stack); `strftime` writes at most
    // `out.len()` bytes into `out` and returns how many, reading the NUL-terminated
    // `format` it is given.
    let written = unsafe {
        let mut now: libc::time_t = 0;
        libc::time(&mut now);
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&now, &mut tm);
        libc::strftime(out.as_mut_ptr().cast(), out.len(), format.as_ptr(), &tm)
    };
    out.truncate(written);
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False,
/// indent=indent, separators=separators, sort_keys=sort_keys)`.
fn python_tojson(value: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match &separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                "tojson: separators is a pair, like (', ', ': ')",
            ))
        }
        // json.dumps: ", " without indent, "," with it.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut out = String::new();
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
    };
    write_json(&mut out, &value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

fn newline(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(width) = style.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', width * depth));
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), JinjaError> {
    let string = |out: &mut String, text: &str| {
        // serde_json escapes as json.dumps(ensure_ascii=False) does.
        out.push_str(&serde_json::to_string(text).unwrap_or_default());
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let json: Json = serde_json::to_value(value).unwrap_or(Json::Null);
            match &json {
                // Python writes 1.0 for a float that is whole.
                Json::Number(n) if n.is_f64() => {
                    let f = n.as_f64().unwrap_or_default();
                    if f.fract() == 0.0 && f.is_finite() && f.abs() < 1e16 {
                        out.push_str(&format!("{f:.1}"));
                    } else {
                        out.push_str(&n.to_string());
                    }
                }
                other => out.push_str(&other.to_string()),
            }
        }
        ValueKind::String => string(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(out, style, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(out, style, depth + 1);
                match key.as_str() {
                    Some(text) => string(out, text),
                    None => string(out, &key.to_string()),
                }
                out.push_str(&style.key);
                write_json(out, &value.get_item(key)?, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        _ => string(out, &value.to_string()),
    }
    Ok(())
}

/// Tokenizers by model, shared by every booking thread.
pub type SharedTokenizer = Arc<ModelTokenizer>;

#[cfg(test)]
mod tests {
    use super::{normalise_messages, ChatRequest, ContentFormat};
    use crate::splice::Body;
    use serde_json::value::RawValue;

    /// The request path reads a chat from the fields it parsed once; it must
    /// read what deserializing the whole body read, and refuse what it refused.
    #[test]
    fn a_chat_read_from_the_body_s_fields_is_the_whole_body_s_chat() {
        let chats = [
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"x"}]}],"tools":null,"documents":[{"t":1}],"add_generation_prompt":false,"continue_final_message":true,"chat_template_kwargs":{"enable_thinking":false},"stream":true}"#,
            r#"{"tools":[{"type":"function","function":{"name":"f"}}],"messages":[],"chat_template_kwargs":null}"#,
        ];
        for text in chats {
            let body = Body::parse(text).unwrap();
            let fields = ChatRequest::from_body(&body).unwrap();
            let whole: ChatRequest = serde_json::from_str(text).unwrap();
            assert_eq!(format!("{fields:?}"), format!("{whole:?}"), "{text}");
        }
        let refused = [
            r#"{"model":"m"}"#,
            r#"{"messages":{"role":"user"}}"#,
            r#"{"messages":[],"add_generation_prompt":null}"#,
            r#"{"messages":[],"tools":"all"}"#,
        ];
        for text in refused {
            let body = Body::parse(text).unwrap();
            assert!(ChatRequest::from_body(&body).is_err(), "{text}");
            assert!(serde_json::from_str::<ChatRequest>(text).is_err(), "{text}");
        }
    }

    /// The messages a template gets, as JSON.
    fn messages(format: ContentFormat, json: &str) -> String {
        let messages: Vec<Box<RawValue>> = serde_json::from_str(json).unwrap();
        let value = normalise_messages(&messages, format).unwrap();
        serde_json::to_string(&value).unwrap()
    }

    /// As vLLM's `parse_chat_message_content`: in "openai" a string becomes
    /// one text part, a string part a text part (a text part keeps its other
    /// fields after `type` and `text`), a null or absent content `[]`, a
    /// `tool` message's content one text; in "string" list content is joined
    /// with "\n" and a null or absent content is "".
    #[test]
    fn content_reaches_the_template_in_the_format_it_was_detected_in() {
        let chat = r#"[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"text": "a", "type": "text", "cache_control": {"type": "ephemeral"}}, "b"]},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "assistant"},
            {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
            {"role": "tool", "content": "z"}
        ]"#;
        assert_eq!(
            messages(ContentFormat::OpenAi, chat),
            concat!(
                r#"[{"role":"system","content":[{"type":"text","text":"Be brief."}]},"#,
                r#"{"role":"user","content":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}},{"type":"text","text":"b"}]},"#,
                r#"{"role":"assistant","content":[],"tool_calls":[]},"#,
                r#"{"role":"assistant","content":[]},"#,
                r#"{"role":"tool","content":"x\ny"},"#,
                r#"{"role":"tool","content":"z"}]"#
            )
        );
        assert_eq!(
            messages(ContentFormat::String, chat),
            concat!(
                r#"[{"role":"system","content":"Be brief."},"#,
                r#"{"role":"user","content":"a\nb"},"#,
                r#"{"role":"assistant","content":"","tool_calls":[]},"#,
                r#"{"role":"assistant","content":""},"#,
                r#"{"role":"tool","content":"x\ny"},"#,
                r#"{"role":"tool","content":"z"}]"#
            )
        );
        // Anything but text is refused, in either format.
        for format in [ContentFormat::OpenAi, ContentFormat::String] {
            let refused = r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]"#;
            let messages: Vec<Box<RawValue>> = serde_json::from_str(refused).unwrap();
            let error = normalise_messages(&messages, format).unwrap_err();
            assert!(error.0.contains("only text parts are routed"), "{error}");
        }
    }
}
