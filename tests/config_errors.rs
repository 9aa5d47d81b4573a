//! Every class of config error, each with its message and its line and column,
//! as `kvhint check` reports them: all errors at once, in file order.

use kvhint_e2e::errors::config_errors as errors;
use kvhint_e2e::{config_file, kvhint_bin};
use std::process::Command;

/// `yaml` gives exactly this one error, word for word.
fn assert_one(yaml: &str, expected: &str) {
    assert_errors(yaml, &[expected]);
}

/// `yaml` gives exactly these errors, in this order, word for word.
fn assert_errors(yaml: &str, expected: &[&str]) {
    let found = errors(yaml);
    assert_eq!(found, expected, "the whole error list");
}

#[test]
fn invalid_yaml_syntax() {
    assert_one(
        "worker_selection:\n  decode: [dynamo-default-cost-fn\n",
        "kvhint.yaml:3:1: invalid YAML: while parsing a flow sequence, expected ',' or ']'; the flow sequence opened by the `[` at line 2, column 11 is never closed: add its `]` (or write the items as a block list, one `- item` a line)",
    );
}

#[test]
fn duplicate_key() {
    assert_one(
        "worker_selection:\n  decode: kvcr\n  decode: dynamo-default-cost-fn\n",
        "kvhint.yaml:3:3: duplicate key `decode` (first at line 2, column 3)",
    );
}

#[test]
fn unknown_keys_anywhere_with_a_suggestion() {
    assert_errors(
        "worker_selction: {}\n",
        &[
            "kvhint.yaml:1:1: worker_selction: unknown key `worker_selction` (did you mean `worker_selection`?); expected one of: plugins, router, kv_events, auth, worker_selection, models, workers, gateway, replication, endpoint_picker",
        ],
    );
    assert_one(
        "worker_selection:\n  decode:\n    type: kvcr\n    hint: []\n",
        "kvhint.yaml:4:5: worker_selection.decode.hint: unknown key `hint` (did you mean `hints`?); expected one of: type, parameters, hints",
    );
    assert_one(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n        params: {}\n",
        "kvhint.yaml:6:9: worker_selection.decode.hints[0].params: unknown key `params`; expected one of: type, name, parameters",
    );
    assert_one(
        "router:\n  blocksize: 16\nworker_selection: {decode: kvcr}\n",
        "kvhint.yaml:2:3: router.blocksize: unknown key `blocksize` (did you mean `block_size`?); expected one of: mode, block_size, quarantine_after_panics, policy_budget_us, quarantine_after_overruns, seed, max_prompt_tokens, max_request_id_bytes, max_open_bookings, booking_ttl",
    );
}

#[test]
fn unknown_role() {
    assert_one(
        "worker_selection:\n  decoder: kvcr\n",
        "kvhint.yaml:2:3: worker_selection.decoder: unknown role `decoder`; expected one of: aggregated, prefill, decode",
    );
}

#[test]
fn missing_type() {
    assert_one(
        "worker_selection:\n  decode:\n    hints: []\n",
        "kvhint.yaml:3:5: worker_selection.decode: a role needs `type`: the selection policy (e.g. `dynamo-default-cost-fn` or `kvcr`)",
    );
    assert_one(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - name: x\n",
        "kvhint.yaml:5:9: worker_selection.decode.hints[0]: a hint needs `type`: the hint policy to run",
    );
}

#[test]
fn wrong_shapes() {
    assert_one(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints: kv_fetch\n",
        "kvhint.yaml:4:12: worker_selection.decode.hints: `hints` must be a list of {type, name?, parameters?} items (or [] for none)",
    );
    assert_one(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n        parameters: [1, 2]\n",
        "kvhint.yaml:6:21: worker_selection.decode.hints[0].parameters: `parameters` must be a mapping, found a sequence; write `parameters: {}` or leave the key out",
    );
    assert_one(
        "router:\n  block_size: 0\nworker_selection: {decode: kvcr}\n",
        "kvhint.yaml:2:15: router.block_size: expected a whole number from 1 to 1048576, found `0`",
    );
    assert_one(
        "router:\n  mode: fastest\nworker_selection: {decode: kvcr}\n",
        "kvhint.yaml:2:9: router.mode: unknown router mode `fastest`; expected one of: kv, round-robin, random",
    );
}

#[test]
fn unknown_selection_policy_and_bad_selection_parameters() {
    assert_one(
        "worker_selection:\n  decode:\n    type: kv-cr\n",
        "kvhint.yaml:3:11: worker_selection.decode.type: unknown selection policy type \"kv-cr\"; known types: cache-aware, dynamo-default-cost-fn, kvcr, random, round-robin; put the plugin that provides it in the plugins directory, or fix the spelling",
    );
    // Pointed at the offending key, not just the mapping.
    assert_one(
        "worker_selection:\n  decode:\n    type: kvcr\n    parameters:\n      shared_cache_multiplier: 0.5\n      overlap_weight: 2\n",
        "kvhint.yaml:6:7: worker_selection.decode.parameters.overlap_weight: bad parameters for selection policy \"kvcr\" (built-in kvhint-selection): unknown field `overlap_weight`, expected `overlap_score_weight` or `shared_cache_multiplier`",
    );
    // A hint type where a selection policy belongs says what it is.
    assert_one(
        "worker_selection:\n  decode: kv_fetch\n",
        "kvhint.yaml:2:11: worker_selection.decode: \"kv_fetch\" (built-in kv-fetch) is a hint policy, not a selection policy; known selection policy types: cache-aware, dynamo-default-cost-fn, kvcr, random, round-robin",
    );
}

#[test]
fn type_errors_in_parameters_point_at_their_key_and_every_one_is_reported() {
    // A wrong type, not only an unknown key, is pointed at its own key.
    assert_one(
        "worker_selection:\n  decode:\n    type: kvcr\n    parameters:\n      shared_cache_multiplier: 0.5\n      overlap_score_weight: heavy\n",
        "kvhint.yaml:6:7: worker_selection.decode.parameters.overlap_score_weight: bad parameters for selection policy \"kvcr\" (built-in kvhint-selection): `overlap_score_weight`: invalid type: string \"heavy\", expected f64",
    );
    // Three problems in one mapping: all three, each at its key, in file order.
    assert_errors(
        "worker_selection:\n  decode:\n    type: kvcr\n    parameters:\n      overlap_score_weight: heavy\n      shared_cache_multiplier: [1]\n      typo: 1\n",
        &[
            "kvhint.yaml:5:7: worker_selection.decode.parameters.overlap_score_weight: bad parameters for selection policy \"kvcr\" (built-in kvhint-selection): `overlap_score_weight`: invalid type: string \"heavy\", expected f64",
            "kvhint.yaml:6:7: worker_selection.decode.parameters.shared_cache_multiplier: bad parameters for selection policy \"kvcr\" (built-in kvhint-selection): `shared_cache_multiplier`: invalid type: sequence, expected f64",
            "kvhint.yaml:7:7: worker_selection.decode.parameters.typo: bad parameters for selection policy \"kvcr\" (built-in kvhint-selection): unknown field `typo`, expected `overlap_score_weight` or `shared_cache_multiplier`",
        ],
    );
    // The same for a hint policy's parameters.
    assert_one(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n        parameters:\n          min_additional_blocks: two\n",
        "kvhint.yaml:7:11: worker_selection.decode.hints[0].parameters.min_additional_blocks: bad parameters for hint policy \"kv_fetch\" (built-in kv-fetch): `min_additional_blocks`: invalid type: string \"two\", expected usize",
    );
}

#[test]
fn unknown_hint_type_lists_the_known_ones() {
    assert_one(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fecth\n",
        "kvhint.yaml:5:9: worker_selection.decode.hints[0]: unknown hint policy type \"kv_fecth\"; known types: kv_fetch; put the plugin that provides it in the plugins directory, or fix the spelling",
    );
}

#[test]
fn bad_hint_parameters_carry_the_plugins_own_message() {
    assert_one(
        "plugins:\n  files: ['{so:harness_prefetch}']\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: harness_prefetch\n        parameters:\n          max_block: 8\n",
        "kvhint.yaml:9:11: worker_selection.decode.hints[0].parameters.max_block: bad parameters for hint policy \"harness_prefetch\" (plugin harness-prefetch 0.1.0 (<dir>/libharness_prefetch.so)): unknown field `max_block`, expected `max_blocks`",
    );
    // A value the plugin's own validation refuses.
    let found = errors(
        "plugins:\n  files: ['{so:harness_prefetch}']\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: harness_prefetch\n        parameters: {max_blocks: 0}\n",
    );
    assert!(
        found[0].contains("max_blocks must be at least 1"),
        "{found:?}"
    );
    assert!(
        found[0].starts_with("kvhint.yaml:8:9: worker_selection.decode.hints[0].parameters"),
        "{found:?}"
    );
}

#[test]
fn missing_plugin_file_and_bad_pin() {
    assert_one(
        "plugins:\n  files: [./libnothere.so]\nworker_selection: {decode: kvcr}\n",
        "kvhint.yaml: plugins.files[0]: plugin <dir>/./libnothere.so: cannot read it: No such file or directory (os error 2)",
    );
    assert_one(
        "plugins:\n  files:\n    - path: ./libx.so\n      sha256: abc\nworker_selection: {decode: kvcr}\n",
        "kvhint.yaml:4:15: plugins.files[0].sha256: expected 64 hex digits (the output of `sha256sum`)",
    );
    assert_one(
        "plugins:\n  directory: ./no-such-dir\nworker_selection: {decode: kvcr}\n",
        "kvhint.yaml:2:14: plugins.directory: plugins directory <dir>/./no-such-dir: it cannot be listed: No such file or directory (os error 2); create it, or fix the path",
    );
}

#[test]
fn every_error_is_reported_at_once_in_file_order() {
    assert_errors(
        "router:\n  mode: fastest\nworker_selection:\n  decoder: kvcr\n  decode:\n    type: kvcr\n    hint: []\n",
        &[
            "kvhint.yaml:2:9: router.mode: unknown router mode `fastest`; expected one of: kv, round-robin, random",
            "kvhint.yaml:4:3: worker_selection.decoder: unknown role `decoder`; expected one of: aggregated, prefill, decode",
            "kvhint.yaml:7:5: worker_selection.decode.hint: unknown key `hint` (did you mean `hints`?); expected one of: type, parameters, hints",
        ],
    );
}

#[test]
fn check_prints_every_error_and_exits_1() {
    let fixture = config_file(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fecth\n      - type: kv_fetch\n        parameters: {min_additional_blocks: 0}\n",
    );
    let output = Command::new(kvhint_bin())
        .args(["check", "--config"])
        .arg(&fixture.path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(":5:9: worker_selection.decode.hints[0]: unknown hint policy type"),
        "{stderr}"
    );
    assert!(stderr.contains(":7:9: worker_selection.decode.hints[1].parameters: bad parameters for hint policy \"kv_fetch\" (built-in kv-fetch): min_additional_blocks must be at least 1"), "{stderr}");
    assert!(stderr.contains("2 errors found"), "{stderr}");
}

#[test]
fn a_config_without_worker_selection_books_every_role_by_cache_aware() {
    let fixture = config_file("router: {block_size: 16}\n");
    let output = Command::new(kvhint_bin())
        .args(["check", "--config"])
        .arg(&fixture.path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains(
            "worker_selection: not in the config; every role is booked by `cache-aware` with its defaults"
        ),
        "{stdout}"
    );
    for role in ["aggregated", "prefill", "decode"] {
        assert!(
            stdout.contains(&format!("role {role}: selection cache-aware {{}}")),
            "{stdout}"
        );
    }
    // Written out, it is the same config; an empty section is still a mistake.
    assert_one(
        "worker_selection: {}\n",
        "kvhint.yaml:1:19: worker_selection: `worker_selection` is empty: configure at least one role (aggregated, prefill or decode)",
    );
}

#[test]
fn check_lists_the_configured_engine_sources() {
    let fixture = config_file(
        "kv_events:\n  sources:\n    - {worker_id: 7, dp_size: 2, role: decode, endpoint: \"tcp://10.0.0.7:5557\", replay_endpoint: \"tcp://10.0.0.7:5600\"}\nworker_selection:\n  decode: kvcr\n",
    );
    let output = Command::new(kvhint_bin())
        .args(["check", "--config"])
        .arg(&fixture.path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("kv_events: media GPU, 1 source"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "worker 7 (decode, 2 ranks): connect tcp://10.0.0.7:5557, replay tcp://10.0.0.7:5600"
        ),
        "{stdout}"
    );
}

#[test]
fn quoted_numbers_invalid_names_and_null_parameters() {
    assert_one(
        "router:\n  block_size: \"16\"\nworker_selection: {decode: kvcr}\n",
        "kvhint.yaml:2:15: router.block_size: expected a whole number from 1 to 1048576, found the string \"16\"; write the number without quotes",
    );
    assert_one(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n        name: \"\"\n",
        "kvhint.yaml:6:15: worker_selection.decode.hints[0].name: hint name \"\" is invalid: use 1-64 characters from a-z, A-Z, 0-9, '_', '-', '.'",
    );
    assert_one(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n        parameters: ~\n",
        "kvhint.yaml:6:21: worker_selection.decode.hints[0].parameters: `parameters` must be a mapping, found nothing (null); write `parameters: {}` or leave the key out",
    );
}

/// `kv_events:`: each mistake located at the offending key, with what to write.
#[test]
fn kv_events_sources_errors_name_the_field_and_what_to_write() {
    let roles = "worker_selection:\n  decode: kvcr\n";
    let cases: [(&str, &str); 8] = [
        (
            "kv_events:\n  sources:\n    - {worker_id: 1, role: decode, endpoint: \"tcp://*:5557\"}\n",
            "kvhint.yaml:3:46: kv_events.sources[0].endpoint: `tcp://*:5557` is the engine's bind address; the router connects to the engine, so name the engine's host (tcp://ENGINE_HOST:PORT), or set `bind: true` if the engine connects to the router",
        ),
        (
            "kv_events:\n  sources:\n    - {worker_id: 1, role: decode}\n",
            "kvhint.yaml:3:8: kv_events.sources[0]: a source needs `endpoint`: where the engine publishes, as in its --kv-events-config",
        ),
        (
            "kv_events:\n  sources:\n    - {worker_id: 1, role: boss, endpoint: \"tcp://h:1\"}\n",
            "kvhint.yaml:3:28: kv_events.sources[0].role: unknown role `boss`; expected one of: aggregated, prefill, decode",
        ),
        (
            "kv_events:\n  sources:\n    - {worker_id: 1, role: decode, endpoint: \"tcp://h:65535\", dp_size: 2}\n",
            "kvhint.yaml:3:46: kv_events.sources[0].endpoint: `tcp://h:65535` plus dp rank 1 is port 65536, past 65535",
        ),
        (
            "kv_events:\n  sources:\n    - {worker_id: 1, role: decode, endpoint: \"tcp://h:1\"}\n    - {worker_id: 1, role: decode, endpoint: \"tcp://h:2\"}\n",
            "kvhint.yaml:4:8: kv_events.sources[1]: worker_id 1 is listed twice (first at line 3); list each worker once, with `dp_size` for its ranks",
        ),
        (
            "kv_events:\n  media: []\n",
            "kvhint.yaml:2:10: kv_events.media: `media` is a non-empty list of storage media whose blocks count, like [GPU] (vLLM: GPU, CPU, STORAGE; SGLang: GPU, CPU_PINNED, DISK, EXTERNAL)",
        ),
        (
            "kv_events:\n  replay_timout_ms: 5\n",
            "kvhint.yaml:2:3: kv_events.replay_timout_ms: unknown key `replay_timout_ms` (did you mean `replay_timeout_ms`?); expected one of: media, receive_hwm, replay_timeout_ms, thread_policy, sources, max_sources",
        ),
        (
            "kv_events:\n  thread_policy: idle\n",
            "kvhint.yaml:2:18: kv_events.thread_policy: unknown thread policy `idle`; expected one of: batch, normal",
        ),
    ];
    for (yaml, expected) in cases {
        assert_one(&format!("{yaml}{roles}"), expected);
    }
    assert!(
        errors(&format!(
            "kv_events:\n  media: [GPU, CPU]\n  thread_policy: normal\n  sources:\n    - {{worker_id: 1, dp_size: 2, role: decode, endpoint: \"tcp://h:5557\", replay_endpoint: \"tcp://h:5600\", bind: false}}\n{roles}"
        ))
        .is_empty(),
        "a correct section passes"
    );
}

/// Found by `tests/fuzz.rs`: YAML features a config does not take are refused
/// at their position (the parser marks the node an anchor or tag is on),
/// saying what to write instead.
#[test]
fn anchors_tags_and_complex_keys_are_refused_at_their_position() {
    assert_one(
        "worker_selection:\n  decode: &sel kvcr\n",
        "kvhint.yaml:2:16: YAML anchors and aliases (`&name`, `*name`) are not supported in a config; write the value out in full",
    );
    assert_one(
        "worker_selection:\n  decode: !policy kvcr\n",
        "kvhint.yaml:2:19: YAML tags (`!name`, `!!type`) are not supported in a config; remove the tag (quote a value to make it a string)",
    );
    assert_one(
        "worker_selection:\n  ? [decode]\n  : kvcr\n",
        "kvhint.yaml:2:5: a mapping key must be a plain value, not a list or mapping; write the key as text",
    );
}

/// Found by `tests/fuzz.rs`: an error at the end of a file without a final
/// line break points at the end of its last line, not at a line past it.
#[test]
fn an_error_at_the_end_of_a_file_points_inside_it() {
    assert_one(
        "worker_selection:\n  decode: [kvcr",
        "kvhint.yaml:2:16: invalid YAML: while parsing a flow sequence, expected ',' or ']'; the flow sequence opened by the `[` at line 2, column 11 is never closed: add its `]` (or write the items as a block list, one `- item` a line)",
    );
}

/// Issue 11: a second YAML document is refused, not silently ignored, and a
/// byte-order mark is not part of the first key.
#[test]
fn a_second_document_is_an_error_and_a_bom_is_not_part_of_a_key() {
    assert_one(
        "worker_selection:\n  decode: kvcr\n---\nrouter:\n  block_size: 0\n",
        "kvhint.yaml:3:1: a second YAML document starts here (after a `---` or `...` line); a config is one document: remove that line and merge what follows into the document above, or delete what follows",
    );
    assert!(errors("\u{feff}worker_selection:\n  decode: kvcr\n").is_empty());
}

/// Errors from parsing and from the rule checks, in file order.
#[test]
fn parse_and_rule_errors_are_sorted_in_file_order() {
    // `config::load` stops before the rule checks (the unknown `kv-cr` is not
    // reported yet); the parse errors alone are already in file order (the walker
    // visits `router` first).
    assert_errors(
        "worker_selection:\n  decode:\n    type: kv-cr\n  decoder: kvcr\nrouter:\n  mode: fastest\n",
        &[
            "kvhint.yaml:4:3: worker_selection.decoder: unknown role `decoder`; expected one of: aggregated, prefill, decode",
            "kvhint.yaml:6:9: router.mode: unknown router mode `fastest`; expected one of: kv, round-robin, random",
        ],
    );
}

/// Issue 28, item 1: yaml-rust reads a NUL as the end of the input, so one in a
/// comment silently dropped everything after it (an `auth:` section, and `serve`
/// started unauthenticated). Every character YAML forbids is a located error.
#[test]
fn a_nul_or_another_forbidden_control_character_is_a_located_error_never_the_end() {
    let nul = "router:\n  block_size: 16\n# a note \u{0} here\nauth:\n  admin_token_file: admin.token\nworker_selection:\n  decode: kvcr\n";
    assert_eq!(
        errors(nul),
        vec!["kvhint.yaml:3:10: the control character U+0000 (NUL) is not allowed in YAML, not even in a comment or a quoted string, and nothing after it would be read; delete it (in a double-quoted string, write it as the escape `\\u0000`)".to_string()]
    );
    // An escape character in a value, a DEL in a key and a C1 control in a quoted
    // string: each at its own line and column, in file order.
    assert_errors(
        "router:\n  block_size: 1\u{1b}6\nworker_selection:\n  de\u{7f}code: kvcr\n  \"x\u{9b}\": 1\n",
        &[
            "kvhint.yaml:2:16: the control character U+001B (ESC) is not allowed in YAML, not even in a comment or a quoted string, and nothing after it would be read; delete it (in a double-quoted string, write it as the escape `\\u001B`)",
            "kvhint.yaml:4:5: the control character U+007F (DEL) is not allowed in YAML, not even in a comment or a quoted string, and nothing after it would be read; delete it (in a double-quoted string, write it as the escape `\\u007F`)",
            "kvhint.yaml:5:5: the control character U+009B (a C1 control character) is not allowed in YAML, not even in a comment or a quoted string, and nothing after it would be read; delete it (in a double-quoted string, write it as the escape `\\u009B`)",
        ],
    );
    // Tab and CR LF are allowed.
    assert_eq!(
        errors("worker_selection:\r\n  decode:\t kvcr\n"),
        Vec::<String>::new()
    );
    // `check` refuses the file: it never prints `auth: none` for it.
    let fixture = config_file(nul);
    let output = Command::new(kvhint_bin())
        .args(["check", "--config"])
        .arg(&fixture.path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(":3:10: the control character U+0000 (NUL)"),
        "{stderr}"
    );
    assert!(!String::from_utf8_lossy(&output.stdout).contains("auth: none"));
}

/// Issue 26, item 8: an unclosed flow sequence was reported where the file ends;
/// the message now says where the `[` is.
#[test]
fn an_unclosed_flow_sequence_names_the_bracket_that_opened_it() {
    let found = errors("worker_selection:\n  decode:\n    type: kvcr\n    hints: [kv_fetch\n");
    assert_eq!(
        found,
        vec!["kvhint.yaml:5:1: invalid YAML: while parsing a flow sequence, expected ',' or ']'; the flow sequence opened by the `[` at line 4, column 12 is never closed: add its `]` (or write the items as a block list, one `- item` a line)".to_string()]
    );
}

/// Issue 28, item 5: every error used to rescan the whole text to clamp its
/// position, so 100,000 unknown keys took over a minute. The text is scanned once
/// per parse, however many errors it has (counted, not timed).
#[test]
fn locating_errors_scans_the_text_once_however_many_there_are() {
    let file = std::path::Path::new("/nonexistent/kvhint.yaml");
    let config = |unknown: usize| {
        let mut text = String::from("worker_selection:\n  decode: kvcr\n");
        for i in 0..unknown {
            text.push_str(&format!("unknown_key_{i}: 1\n"));
        }
        text
    };
    let mut scans = Vec::new();
    for unknown in [10, 20_000] {
        let text = config(unknown);
        let before = kvhint::testing::text_scans();
        let (_, found) = kvhint::config::parse_lenient(file, &text);
        scans.push(kvhint::testing::text_scans() - before);
        assert_eq!(found.len(), unknown);
        let last = &found[unknown - 1].to_string();
        assert!(
            last.contains(&format!(
                ":{}:1: unknown_key_{}: unknown key",
                unknown + 2,
                unknown - 1
            )),
            "{last}"
        );
    }
    assert_eq!(scans, [1, 1]);
}

#[test]
fn unknown_policy_parameters_are_located_in_one_pass_however_many() {
    // 20,000 unknown keys, one error each, each pointed at its own key. Each
    // line of the policy's report used to be searched for every key (10,000
    // took 11 s); the bound below only keeps a regression from hanging.
    let keys: String = (0..20_000).map(|i| format!("      k{i}: 1\n")).collect();
    let dir = kvhint_e2e::private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        format!("worker_selection:\n  aggregated:\n    type: cache-aware\n    parameters:\n{keys}"),
    )
    .unwrap();
    let output = kvhint_e2e::run_bounded(
        std::process::Command::new(kvhint_e2e::kvhint_bin())
            .arg("check")
            .arg("--config")
            .arg(&config),
        std::time::Duration::from_secs(120),
    );
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    assert_eq!(
        errors.len(),
        20_000,
        "{}",
        &stderr[..stderr.len().min(2000)]
    );
    for (i, error) in errors.iter().enumerate().step_by(997) {
        let want = format!(
            "kvhint.yaml:{}:7: worker_selection.aggregated.parameters.k{i}: ",
            5 + i
        );
        assert!(error.contains(&want), "{error}\nwanted {want}");
    }
}
