//! `/tokenize` and `/detokenize`: the ids the router books with (the model's
//! own tokenizer and chat template, in process), and text from ids.

use super::GatewayError;
use crate::snapshot::Snapshot;
use crate::splice::Body;
use std::sync::Arc;

/// A `/tokenize` (`encode`) or `/detokenize` body's answer: CPU work, run on
/// the booking threads as a booking is.
pub fn answer(
    snapshot: &Snapshot,
    body: &[u8],
    encode: bool,
) -> Result<serde_json::Value, GatewayError> {
    let text = std::str::from_utf8(body).map_err(|_| GatewayError::not_utf8())?;
    let parsed =
        Body::parse(text).map_err(|e| GatewayError::bad_request("invalid_json", e.to_string()))?;
    let model = named_model(snapshot, &parsed)?;
    if encode {
        return tokenize_body(snapshot, &model, &parsed);
    }
    let ids: Vec<u32> = parsed
        .get("tokens")
        .map_err(|e| GatewayError::bad_request("invalid_tokens", e).at("tokens"))?
        .ok_or_else(|| {
            GatewayError::bad_request(
                "missing_tokens",
                "the body has no `tokens`: the list of token ids to turn into text",
            )
            .at("tokens")
        })?;
    let prompt = model
        .tokenizer
        .decode(&ids)
        .map_err(|e| GatewayError::bad_request("invalid_tokens", e.0).at("tokens"))?;
    Ok(serde_json::json!({"prompt": prompt}))
}

/// The model a `/tokenize` or `/detokenize` body names: its `model`, or the
/// one model this router serves.
fn named_model(
    snapshot: &crate::snapshot::Snapshot,
    body: &Body<'_>,
) -> Result<Arc<crate::models::Model>, GatewayError> {
    let name: Option<String> = body
        .get("model")
        .map_err(|e| GatewayError::bad_request("invalid_field", e).at("model"))?;
    let names = snapshot.models.names();
    let name = match name {
        Some(name) => name,
        None if names.len() == 1 => names[0].clone(),
        None => return Err(GatewayError::missing_model(names)),
    };
    snapshot
        .models
        .get(&name)
        .cloned()
        .ok_or_else(|| GatewayError::model_not_found(&name, names))
}

fn tokenize_body(
    snapshot: &crate::snapshot::Snapshot,
    model: &crate::models::Model,
    body: &Body<'_>,
) -> Result<serde_json::Value, GatewayError> {
    let flag = |key: &'static str| -> Result<Option<bool>, GatewayError> {
        body.get(key)
            .map_err(|e| GatewayError::bad_request("invalid_field", e).at(key))
    };
    let strs = flag("return_token_strs")?.unwrap_or(false);
    let invalid = |param: &'static str| {
        move |e: crate::models::RenderError| {
            GatewayError::bad_request("invalid_prompt", e.0).at(param)
        }
    };
    // Held to the bound a prompt is held to: past it the count is of no use
    // (no prompt that long is booked), and tokenizing it all would let one
    // request spend seconds of CPU.
    let max = snapshot.limits.max_prompt_tokens;
    let bounded = |param: &'static str| {
        move |e: crate::models::EncodeError| match e {
            crate::models::EncodeError::Invalid(e) => {
                GatewayError::bad_request("invalid_prompt", e.0).at(param)
            }
            crate::models::EncodeError::TooLong(too_long) => {
                super::prompt_too_long(too_long).at(param)
            }
        }
    };
    let tokens = if body.has("messages") {
        let request = crate::models::ChatRequest::from_body(body)
            .map_err(|e| GatewayError::bad_request("invalid_messages", e).at("messages"))?;
        if flag("add_special_tokens")?.unwrap_or(false) {
            let text = model
                .tokenizer
                .render_chat(&request)
                .map_err(invalid("messages"))?;
            model
                .tokenizer
                .encode_text_within(&text, true, max)
                .map_err(bounded("messages"))?
        } else {
            model
                .tokenizer
                .encode_chat_within(&request, max)
                .map_err(bounded("messages"))?
                .0
        }
    } else {
        let prompt: String = body
            .get("prompt")
            .map_err(|e| GatewayError::bad_request("invalid_prompt", e).at("prompt"))?
            .ok_or_else(|| {
                GatewayError::bad_request(
                    "missing_prompt",
                    "the body has neither `prompt` (a string) nor `messages` (a chat)",
                )
                .at("prompt")
            })?;
        let special = flag("add_special_tokens")?.unwrap_or(true);
        model
            .tokenizer
            .encode_text_within(&prompt, special, max)
            .map_err(bounded("prompt"))?
    };
    let token_strs = if strs {
        Some(
            model
                .tokenizer
                .token_strs(&tokens)
                .map_err(invalid("prompt"))?,
        )
    } else {
        None
    };
    Ok(serde_json::json!({
        "count": tokens.len(),
        "max_model_len": snapshot.limits.max_prompt_tokens,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}
