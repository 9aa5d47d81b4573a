//! Config errors as `kvhint check` prints them, made comparable word for word:
//! the temporary directory a fixture lives in is cut from the front of each
//! error (`kvhint.yaml:L:C: …`) and shown as `<dir>` where a message names a
//! file in it, so a test asserts each case's whole error list.

use crate::plugins::{config_file, snapshot_of};
use std::path::Path;

/// Every error building `yaml`'s snapshot gives, in order (empty if it builds).
pub fn config_errors(yaml: &str) -> Vec<String> {
    config_errors_naming(yaml, &[])
}

/// [`config_errors`], also showing each directory of `names` as its
/// placeholder (a tokenizer directory made elsewhere as `<tokenizer>`, say).
pub fn config_errors_naming(yaml: &str, names: &[(&Path, &str)]) -> Vec<String> {
    let fixture = config_file(yaml);
    match snapshot_of(&fixture, None) {
        Ok(_) => Vec::new(),
        Err(errors) => errors
            .0
            .iter()
            .map(|e| {
                let text = e.to_string();
                let mut text = match text.find("kvhint.yaml") {
                    Some(i) => text[i..].to_string(),
                    None => text,
                };
                for (dir, name) in names {
                    text = text.replace(&dir.display().to_string(), name);
                }
                text.replace(&fixture.dir.path().display().to_string(), "<dir>")
            })
            .collect(),
    }
}
