//! `kvhint serve` over loopback: the README's curl session, hot add, broken
//! and replaced plugins, reloads under load, and bad requests. Each test runs
//! the real binary on 127.0.0.1 with an ephemeral port.

use kvhint_e2e::http::{book_and_release, register_decode_worker};
use kvhint_e2e::trace::tokens;
use kvhint_e2e::{action_types, plugin_so, workspace_root, Server};
use serde_json::{json, Value};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

fn drop_in(path: &Path, bytes: &[u8]) {
    kvhint_e2e::drop_in(path, bytes).unwrap();
}

type Setup = kvhint_e2e::PluginSite;

/// The role most tests serve: the default cost function and the example
/// plugin, with the given `max_blocks`.
fn prefetch_roles(max_blocks: u32) -> String {
    format!(
        "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{{type: harness_prefetch, parameters: {{max_blocks: {max_blocks}}}}}]\n"
    )
}

/// Books the tests' 16-token prompt as request `id`, and releases it.
fn book(server: &Server, id: &str) -> Value {
    book_and_release(server, id, &tokens(1, 16))
}

#[test]
fn readme_curl_session_runs_as_documented() {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let start = readme
        .find("<!-- curl-session:start -->")
        .expect("README has the curl session");
    let end = readme.find("<!-- curl-session:end -->").unwrap();
    let session = &readme[start..end];
    let block_start = session.find("```console\n").unwrap() + "```console\n".len();
    let block = &session[block_start..session[block_start..].find("```").unwrap() + block_start];

    // The README's session starts the router on the example service config at
    // 127.0.0.1:8080; here it gets a free port instead.
    let root = kvhint_e2e::examples_copy();
    let server = Server::start(&root.path().join("examples/serve.yaml"), &[], root.path());
    let mut steps: Vec<(String, Vec<String>)> = Vec::new();
    for line in block.lines() {
        if let Some(command) = line.strip_prefix("$ ") {
            steps.push((command.to_string(), Vec::new()));
        } else if let Some((_, output)) = steps.last_mut() {
            output.push(line.to_string());
        }
    }
    let curls: Vec<_> = steps
        .iter()
        .filter(|(c, _)| c.starts_with("curl"))
        .collect();
    assert!(
        curls.len() >= 8,
        "the session shows the API: {} curl steps",
        curls.len()
    );
    for (command, expected) in curls {
        let command = command.replace("127.0.0.1:8080", server.address());
        // The shell the README's preamble left: the tokens in ADMIN, WORKER, CLIENT.
        let output = Command::new("sh")
            .arg("-c")
            .arg(&command)
            .envs(
                kvhint_e2e::EXAMPLE_TOKENS
                    .iter()
                    .map(|(who, token)| (who.to_uppercase(), *token)),
            )
            .current_dir(root.path())
            .output()
            .unwrap();
        let actual = String::from_utf8_lossy(&output.stdout).trim().to_string();
        let expected = expected.join("\n").trim().to_string();
        match (
            serde_json::from_str::<Value>(&actual),
            serde_json::from_str::<Value>(&expected),
        ) {
            (Ok(a), Ok(e)) => assert_eq!(a, e, "`{command}`"),
            _ => assert_eq!(actual, expected, "`{command}`"),
        }
    }
}

#[test]
fn hot_add_a_plugin_and_use_it_on_the_next_booking_without_restart() {
    let roles_before =
        "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: harness_prefetch}]\n";
    let setup = Setup::with_prefetch(roles_before);
    let server = Server::start(&setup.config(), &["--watch-config"], setup.dir.path());
    register_decode_worker(&server, 1);
    assert_eq!(action_types(&book(&server, "before")), ["kv.prefetch"]);
    let generation = server.status()["generation"].as_u64().unwrap();

    // Build output in, by the drop-in protocol; then the YAML names it.
    let added = Instant::now();
    drop_in(
        &setup.plugins().join("libfixture_hot_add.so"),
        &std::fs::read(plugin_so("fixture_hot_add")).unwrap(),
    );
    setup.write_config(
        "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: harness_prefetch}, {type: hot_added}]\n",
    );
    let mut n = 0;
    server.wait_for("a booking that carries the new policy's action", |s| {
        n += 1;
        action_types(&book(s, &format!("after-{n}"))) == ["kv.prefetch", "test.hot_added"]
    });
    eprintln!(
        "hot add took {:?} (rename to first booking with the action)",
        added.elapsed()
    );
    let status = server.status();
    assert!(status["generation"].as_u64().unwrap() > generation);
    assert!(status["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["name"] == "fixture-hot-add"));
}

#[test]
fn a_broken_so_dropped_in_leaves_the_old_snapshot_serving() {
    let roles =
        "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: harness_prefetch}]\n";
    let setup = Setup::with_prefetch(roles);
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    register_decode_worker(&server, 1);
    let generation = server.status()["generation"].as_u64().unwrap();

    let whole = std::fs::read(plugin_so("fixture_hot_add")).unwrap();
    drop_in(&setup.plugins().join("libbroken.so"), &whole[..8192]);
    server.wait_for("the failed reload in /admin/status", |s| {
        s.status()["reloads"]["failed"].as_u64() >= Some(1)
    });
    let status = server.status();
    let why = status["reloads"]["last_error"]["errors"].to_string();
    assert!(
        why.contains("libbroken.so") && why.contains("truncated"),
        "{why}"
    );
    assert_eq!(status["reloads"]["last_error"]["trigger"], "plugins_watch");
    assert_eq!(
        status["generation"].as_u64().unwrap(),
        generation,
        "old snapshot still serving"
    );
    // And it still books, with its hints.
    assert_eq!(action_types(&book(&server, "still")), ["kv.prefetch"]);
    let (_, metrics) = server.get("/metrics");
    assert!(
        metrics.contains("kvhint_reloads_total{result=\"failed\"} 1"),
        "{metrics}"
    );

    // Removing the broken file recovers.
    std::fs::remove_file(setup.plugins().join("libbroken.so")).unwrap();
    server.wait_for("a successful reload", |s| {
        s.status()["reloads"]["last_error"].is_null()
    });
}

#[test]
fn replacing_a_plugin_with_a_new_build_under_the_same_name_switches_code() {
    let roles = "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: versioned}]\n";
    let setup = Setup::new(
        &[("libversioned.so", plugin_so("fixture_versioned_v1"))],
        roles,
    );
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    register_decode_worker(&server, 1);
    assert_eq!(
        book(&server, "v1")["hint"]["actions"][0]["payload"]["build"],
        "1.0.0"
    );

    drop_in(
        &setup.plugins().join("libversioned.so"),
        &std::fs::read(plugin_so("fixture_versioned_v2")).unwrap(),
    );
    let mut n = 0;
    server.wait_for("the new build to answer", |s| {
        n += 1;
        book(s, &format!("v2-{n}"))["hint"]["actions"][0]["payload"]["build"] == "2.0.0"
    });
    // The old build stays mapped (never unloaded), and is counted.
    assert_eq!(server.status()["libraries_mapped"], 2);
}

#[test]
fn twenty_reloads_during_concurrent_bookings_fail_no_booking() {
    let setup = Setup::with_prefetch(&prefetch_roles(1));
    let server = Arc::new(Server::start(&setup.config(), &[], setup.dir.path()));
    for id in 1..=4 {
        register_decode_worker(&server, id);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let booked = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let bookers: Vec<_> = (0..4)
        .map(|t| {
            let (server, stop, booked, failed) =
                (Arc::clone(&server), Arc::clone(&stop), Arc::clone(&booked), Arc::clone(&failed));
            std::thread::spawn(move || {
                let mut n = 0u64;
                // Bounded: stops when told, or after 20 000 bookings.
                while !stop.load(Ordering::Relaxed) && n < 20_000 {
                    n += 1;
                    let id = format!("t{t}-{n}");
                    let (status, body) = server.post(
                        "/book",
                        &json!({"request_id": id, "role": "decode", "token_ids": tokens(n as u32 % 50, 24)}),
                    );
                    let released = server.post("/release", &json!({"request_id": id})).0;
                    if status == 200 && released == 200 && body["hint"]["actions"].is_array() {
                        booked.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let before_reloads = booked.load(Ordering::Relaxed);
    for i in 0..20 {
        // Each reload swaps in a genuinely different snapshot.
        setup.write_config(&prefetch_roles(1 + i % 3));
        let (status, body) = server.post_raw("/admin/reload", "application/json", "");
        assert_eq!(status, 200, "{body}");
    }
    let during = booked.load(Ordering::Relaxed) - before_reloads;
    stop.store(true, Ordering::Relaxed);
    for booker in bookers {
        booker.join().unwrap();
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0);
    assert!(during > 0, "bookings ran while reloading");
    let status = server.status();
    assert_eq!(status["reloads"]["ok"], 20);
    assert_eq!(status["generation"], 21);
    assert_eq!(status["open_bookings"], 0);
}

#[test]
fn bad_requests_get_4xx_in_one_shape_and_change_nothing() {
    let roles =
        "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: harness_prefetch}]\n";
    let setup = Setup::with_prefetch(roles);
    let server = Server::start(
        &setup.config(),
        &["--max-body-bytes", "4096"],
        setup.dir.path(),
    );
    register_decode_worker(&server, 1);
    let (status, _) = server.post(
        "/kv_events",
        &json!({"worker_id": 1, "event": {"stored": {"parent_block_hash": null,
            "blocks": [{"block_hash": 7, "token_ids": [1, 2, 3, 4]}]}}}),
    );
    assert_eq!(status, 200);
    let (status, _) = server.post(
        "/book",
        &json!({"request_id": "open", "role": "decode", "token_ids": tokens(1, 8)}),
    );
    assert_eq!(status, 200);
    let before = server.status();
    let (_, metrics_before) = server.get("/metrics");
    let gauge = |metrics: &str, name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .map(|l| l.to_string())
    };

    let big =
        json!({"request_id": "big", "role": "decode", "token_ids": tokens(1, 4000)}).to_string();
    let cases: Vec<(&str, String, &str, u16, &str)> = vec![
        ("/book", "{\"request_id\": ".into(), "application/json", 400, "bad_request"),
        ("/book", json!({"request_id": "x", "role": "decode", "token_ids": [1], "hint": {"actions": []}}).to_string(), "application/json", 400, "client_hint_refused"),
        ("/book", json!({"request_id": "x", "role": "decoder", "token_ids": [1]}).to_string(), "application/json", 400, "bad_request"),
        ("/book", json!({"request_id": "x", "role": "prefill", "token_ids": [1, 2]}).to_string(), "application/json", 422, "role_not_configured"),
        ("/book", json!({"request_id": "x", "role": "decode", "token_ids": []}).to_string(), "application/json", 422, "empty_prompt"),
        ("/book", json!({"request_id": "open", "role": "decode", "token_ids": [1]}).to_string(), "application/json", 409, "duplicate_request"),
        ("/book", json!({"request_id": "long", "role": "decode", "token_ids": tokens(1, 300)}).to_string(), "application/json", 422, "prompt_too_long"),
        ("/book", big, "application/json", 413, "payload_too_large"),
        ("/book", "request_id=x".into(), "text/plain", 415, "unsupported_media_type"),
        ("/kv_events", json!({"worker_id": 99, "event": "cleared"}).to_string(), "application/json", 404, "unknown_worker"),
        ("/kv_events", json!({"worker_id": 1, "event": {"stored": {"parent_block_hash": 12345, "blocks": []}}}).to_string(), "application/json", 422, "kv_event_rejected"),
        ("/release", json!({"request_id": "never"}).to_string(), "application/json", 404, "unknown_request"),
        ("/workers", json!({"worker_id": 2, "role": "decode", "runtime_data": {"router_hint": "yes"}}).to_string(), "application/json", 422, "invalid_runtime_data"),
    ];
    for (path, body, content_type, status, code) in cases {
        let (got, response) = server.post_raw(path, content_type, &body);
        assert_eq!(got, status, "{path} {body:.80}: {response}");
        assert_eq!(response["error"], code, "{path} {body:.80}: {response}");
        assert!(
            response["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{response}"
        );
    }
    let mut response = server
        .agent
        .delete(&format!("{}/workers/99", server.base))
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 404);
    let body: Value = serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(body["error"], "unknown_worker");

    // Path and method mistakes answer in the same shape.
    let mut response = server
        .agent
        .delete(&format!("{}/workers/abc", server.base))
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(body["error"], "bad_request", "{body}");
    let (status, text) = server.get("/book");
    assert_eq!(status, 405);
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"], "method_not_allowed", "{body}");

    // Nothing changed: the same workers, loads, open bookings and index.
    let after = server.status();
    assert_eq!(before["workers"], after["workers"]);
    assert_eq!(before["open_bookings"], after["open_bookings"]);
    let (_, metrics_after) = server.get("/metrics");
    for name in [
        "kvhint_kv_index_blocks",
        "kvhint_workers",
        "kvhint_open_bookings",
    ] {
        assert_eq!(
            gauge(&metrics_before, name),
            gauge(&metrics_after, name),
            "{name}"
        );
    }
    assert!(metrics_after.contains("kvhint_api_errors_total{error=\"client_hint_refused\"} 1"));
    // The service is still fine.
    let (status, _) = server.get("/healthz");
    assert_eq!(status, 200);
    let mut stderr = String::new();
    let _ = std::fs::File::open(&server.log_file).map(|mut f| f.read_to_string(&mut stderr));
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Every error answer is counted once, by its code, whoever answered it: a
/// handler, an extractor, the router's fallbacks, or the front door (in OpenAI's
/// shape). One middleware counts them all.
#[test]
fn every_error_answer_is_counted_once_by_its_code() {
    let roles = "  decode:\n    type: dynamo-default-cost-fn\n    hints: []\n";
    let setup = Setup::with_prefetch(roles);
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    let calls: [(&str, &str, &str, u16); 6] = [
        ("GET", "/book", "", 405),
        ("GET", "/no-such-endpoint", "", 404),
        ("POST", "/book", "{not json", 400),
        (
            "POST",
            "/release",
            "{\"request_id\": \"never-booked\"}",
            404,
        ),
        ("DELETE", "/workers/abc", "", 400),
        ("POST", "/v1/completions", "{not json", 400),
    ];
    for (method, path, body, expected) in calls {
        let url = format!("{}{path}", server.base);
        let response = match method {
            "GET" => server.agent.get(&url).call(),
            "DELETE" => server.agent.delete(&url).call(),
            _ => server
                .agent
                .post(&url)
                .header("content-type", "application/json")
                .send(body),
        }
        .unwrap();
        assert_eq!(response.status().as_u16(), expected, "{method} {path}");
    }
    let (_, metrics) = server.get("/metrics");
    let counted: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("kvhint_api_errors_total{"))
        .collect();
    let mut counted = counted;
    counted.sort();
    assert_eq!(
        counted,
        [
            "kvhint_api_errors_total{error=\"bad_request\"} 2",
            "kvhint_api_errors_total{error=\"invalid_json\"} 1",
            "kvhint_api_errors_total{error=\"method_not_allowed\"} 1",
            "kvhint_api_errors_total{error=\"not_found\"} 1",
            "kvhint_api_errors_total{error=\"unknown_request\"} 1",
        ],
        "{metrics}"
    );
}

#[test]
fn sighup_reloads_the_config() {
    let setup = Setup::with_prefetch(&prefetch_roles(1));
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    let hup = |server: &Server| {
        let status = Command::new("kill")
            .args(["-HUP", &server.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    // A SIGHUP the moment the router says it is ready must not end it (the
    // handler exists before anything slow runs).
    hup(&server);
    server.wait_for("the first SIGHUP reload", |s| {
        s.status()["reloads"]["last_ok_trigger"] == "sighup"
    });
    register_decode_worker(&server, 1);
    let prefetched = |booking: &Value| {
        booking["hint"]["actions"][0]["payload"]["block_hashes"]
            .as_array()
            .map(Vec::len)
    };
    assert_eq!(prefetched(&book(&server, "before")), Some(1));

    // No watch on the config: only the signal makes the router read it again.
    setup.write_config(&prefetch_roles(3));
    hup(&server);
    server.wait_for("the second SIGHUP reload", |s| {
        s.status()["generation"] == 3
    });
    assert_eq!(prefetched(&book(&server, "after")), Some(3));
}

#[test]
fn a_reload_that_changes_a_restart_only_setting_is_refused() {
    let roles =
        "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: harness_prefetch}]\n";
    let setup = Setup::with_prefetch(roles);
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    let other = setup.dir.path().join("elsewhere");
    std::fs::create_dir(&other).unwrap();
    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o700)).unwrap();
    drop_in(
        &setup.config(),
        format!(
            "plugins:\n  directory: elsewhere\n  cache_dir: cache\nrouter:\n  block_size: 8\nworker_selection:\n{roles}"
        )
        .as_bytes(),
    );
    let (status, body) = server.post_raw("/admin/reload", "application/json", "");
    assert_eq!(status, 422, "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("router.block_size") && detail.contains("needs a restart"),
        "{detail}"
    );
    assert!(
        detail.contains("plugins.directory") && detail.contains("watches"),
        "{detail}"
    );
    assert_eq!(
        server.status()["generation"],
        1,
        "the old snapshot keeps serving"
    );
}

#[test]
fn a_reload_that_changes_the_loaders_size_cap_or_probe_timeout_is_refused() {
    let roles =
        "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: harness_prefetch}]\n";
    let setup = Setup::with_prefetch(roles);
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    drop_in(
        &setup.config(),
        format!(
            "plugins:\n  directory: plugins\n  cache_dir: cache\n  max_file_bytes: 1048576\n  probe_timeout_ms: 500\nrouter:\n  block_size: 4\n  max_prompt_tokens: 256\nworker_selection:\n{roles}"
        )
        .as_bytes(),
    );
    let (status, body) = server.post_raw("/admin/reload", "application/json", "");
    assert_eq!(status, 422, "{body}");
    let detail = body["detail"].as_str().unwrap();
    for (key, says) in [
        (
            "plugins.max_file_bytes",
            "uses 268435456 bytes, the config now says 1048576",
        ),
        (
            "plugins.probe_timeout_ms",
            "uses 10000 ms, the config now says 500",
        ),
    ] {
        assert!(
            detail.contains(key) && detail.contains(says) && detail.contains("needs a restart"),
            "{key}: {detail}"
        );
    }
    assert_eq!(
        server.status()["generation"],
        1,
        "the old snapshot keeps serving"
    );
}

#[test]
fn a_panicking_drop_of_a_policy_or_its_provider_does_not_abort_the_router_on_reload() {
    let roles = "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: drop_panics}]\n";
    let setup = Setup::new(
        &[(
            "libfixture_misbehaving.so",
            plugin_so("fixture_misbehaving"),
        )],
        roles,
    );
    let mut command = Command::new(kvhint_e2e::kvhint_bin());
    command.env("FIXTURE_PROVIDER_DROP_PANICS", "1");
    let server = Server::start_command(command, &setup.config(), &[], setup.dir.path());
    register_decode_worker(&server, 1);
    book(&server, "before");
    // The reload drops the old snapshot: its `drop_panics` instance, and the
    // providers of the old registry (whose closure captured a panicking guard).
    setup.write_config("  decode:\n    type: dynamo-default-cost-fn\n    hints: []\n");
    let (status, body) = server.post_raw("/admin/reload", "application/json", "");
    assert_eq!(status, 200, "{body}");
    server.wait_for("the old snapshot to be dropped", |s| {
        let log = s.log();
        log.contains("fixture: policy drop panic") && log.contains("fixture: provider drop panic")
    });
    assert_eq!(server.get("/healthz").0, 200, "the router is still up");
    assert_eq!(server.status()["generation"], 2);
    book(&server, "after");
}

#[test]
fn hot_add_a_selection_plugin_then_reload_it_away_without_restart() {
    // Served first by the built-in default; then the session_affinity example
    // plugin is dropped in and the config names it, with no restart.
    let setup = Setup::with_prefetch("  decode: dynamo-default-cost-fn\n");
    let server = Server::start(&setup.config(), &["--watch-config"], setup.dir.path());
    for id in 1..=4 {
        register_decode_worker(&server, id);
    }
    let book_session = |server: &Server, id: &str, session: &str| -> Value {
        let (status, body) = server.post(
            "/book",
            &json!({"request_id": id, "role": "decode", "token_ids": tokens(1, 16),
                    "session_context": {"session_id": session}}),
        );
        assert_eq!(status, 200, "{body}");
        body
    };
    drop_in(
        &setup.plugins().join("libsession_affinity.so"),
        &std::fs::read(plugin_so("session_affinity")).unwrap(),
    );
    setup.write_config("  decode:\n    type: session_affinity\n    hints: []\n");
    server.wait_for("a snapshot that books with session_affinity", |s| {
        s.status()["plugins"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["name"] == "session-affinity"))
    });
    // Sticky: the same session lands on the same worker while others pile up
    // load elsewhere (the bookings stay open, so the default cost would move).
    let mut placed = std::collections::BTreeMap::new();
    for n in 0..12 {
        let session = format!("s{}", n % 3);
        let booking = book_session(&server, &format!("sticky-{n}"), &session);
        assert!(booking.get("selection_fallback").is_none(), "{booking}");
        let worker = booking["worker_id"].as_u64().unwrap();
        assert_eq!(*placed.entry(session).or_insert(worker), worker);
    }
    let metrics = server.get("/metrics").1;
    assert!(
        metrics.contains(
            "kvhint_selection_calls_total{role=\"decode\",policy=\"session_affinity\"} 12"
        ),
        "{metrics}"
    );
    // A session context of the wrong shape fails the policy: the booking still
    // goes out, placed by the built-in default, and is counted.
    let (status, body) = server.post(
        "/book",
        &json!({"request_id": "odd", "role": "decode", "token_ids": tokens(1, 16),
                "session_context": {"session_id": 7}}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["selection_fallback"], "error", "{body}");
    let metrics = server.get("/metrics").1;
    assert!(
        metrics.contains("kvhint_selection_fallbacks_total{role=\"decode\",policy=\"session_affinity\",reason=\"error\"} 1"),
        "{metrics}"
    );
    // Reloaded back to the built-in: the plugin's policy is dropped, nothing breaks.
    setup.write_config("  decode: dynamo-default-cost-fn\n");
    let mut n = 0;
    server.wait_for("bookings placed by the built-in again", |s| {
        n += 1;
        let (status, _) = s.post(
            "/book",
            &json!({"request_id": format!("back-{n}"), "role": "decode", "token_ids": tokens(1, 16)}),
        );
        status == 200
            && s.status()["roles"]
                .as_array()
                .is_some_and(|r| r.iter().any(|r| r["selection"] == "dynamo-default-cost-fn"))
    });
}

/// The scheduling policy (`/proc/PID/task/TID/stat` field 41) of each of the server's
/// threads whose name (as `comm` holds it, with its newline) starts with `name`.
#[cfg(target_os = "linux")]
fn thread_policies(server: &Server, name: &str) -> Vec<u32> {
    let tasks = format!("/proc/{}/task", server.child.id());
    let Ok(tasks) = std::fs::read_dir(&tasks) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            if !comm.starts_with(name) {
                return None;
            }
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            // Fields after the command name (in parentheses) start at field 3.
            stat.rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(41 - 3)?
                .parse()
                .ok()
        })
        .collect()
}

#[cfg(target_os = "linux")]
#[test]
fn the_event_paths_threads_run_under_the_configured_policy_and_a_reload_moves_them() {
    const SCHED_OTHER: u32 = 0;
    const SCHED_BATCH: u32 = 3;
    let setup = Setup::with_prefetch(&prefetch_roles(1));
    // A source nobody publishes on: its thread connects and waits, following the
    // setting as it polls.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = |policy: &str| {
        format!(
            "plugins:\n  directory: plugins\n  cache_dir: cache\nrouter:\n  block_size: 4\n  max_prompt_tokens: 256\nkv_events:\n{policy}  sources:\n    - {{worker_id: 7, role: decode, endpoint: \"tcp://127.0.0.1:{port}\"}}\nworker_selection:\n{}",
            prefetch_roles(1)
        )
    };
    // Without the key: the default, batch.
    drop_in(&setup.config(), config("").as_bytes());
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    let policies = |server: &Server| {
        (
            thread_policies(server, "kvhint-ingest"),
            thread_policies(server, "kvhint-kv-7-0"),
        )
    };
    server.wait_for("both threads under SCHED_BATCH", |s| {
        policies(s) == (vec![SCHED_BATCH], vec![SCHED_BATCH])
    });
    assert_eq!(server.status()["kv_events_thread_policy"], "batch");
    assert_eq!(server.status()["thread_policy_refusals"], 0);
    // libzmq's I/O and reaper threads (unnamed, so `kvhint` like the main thread) start
    // with the router, not with the first subscription: they keep the process's policy.
    let unnamed = thread_policies(&server, "kvhint\n");
    assert!(
        unnamed.len() >= 3,
        "the main thread and libzmq's: {unnamed:?}"
    );
    assert!(unnamed.iter().all(|p| *p == SCHED_OTHER), "{unnamed:?}");

    // A reload to normal reaches both threads without an event to wake them.
    drop_in(
        &setup.config(),
        config("  thread_policy: normal\n").as_bytes(),
    );
    let hup = Command::new("kill")
        .args(["-HUP", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    server.wait_for("the reload", |s| s.status()["generation"] == 2);
    server.wait_for("both threads under SCHED_OTHER", |s| {
        policies(s) == (vec![SCHED_OTHER], vec![SCHED_OTHER])
    });
    assert_eq!(server.status()["kv_events_thread_policy"], "normal");

    // Still routing: an event stored on worker 7 makes it the booked worker over 8.
    register_decode_worker(&server, 8);
    let (status, body) = server.post(
        "/kv_events",
        &json!({"worker_id": 7, "event": {"stored": {"parent_block_hash": null,
            "blocks": [{"block_hash": 1, "token_ids": [1, 2, 3, 4]}]}}}),
    );
    assert_eq!(status, 200, "{body}");
    let (status, body) = server.post(
        "/book",
        &json!({"request_id": "after", "role": "decode", "token_ids": [1, 2, 3, 4, 5]}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["worker_id"], 7, "{body}");
}

/// A plugin that names a new action type on every booking (issue 26, item 5):
/// `/metrics` keeps the first 64 types apart and counts the rest under `other`, so
/// the scrape stays bounded and no action goes uncounted.
#[test]
fn a_plugin_that_invents_action_types_cannot_grow_metrics_without_bound() {
    let roles = "  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: burst, parameters: {count: 1, invent_types: true}}]\n";
    let setup = Setup::new(
        &[(
            "libfixture_misbehaving.so",
            plugin_so("fixture_misbehaving"),
        )],
        roles,
    );
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    register_decode_worker(&server, 1);
    for i in 0..70 {
        let booking = book(&server, &format!("invent{i}"));
        assert_eq!(
            action_types(&booking),
            [format!("test.burst.invent{i}.0")],
            "{booking}"
        );
    }
    let (_, metrics) = server.get("/metrics");
    let counted: Vec<(&str, u64)> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("kvhint_hint_actions_total{action_type=\""))
        .filter_map(|l| {
            let (kind, count) = l.split_once("\"} ")?;
            Some((kind, count.parse().ok()?))
        })
        .collect();
    assert_eq!(counted.len(), 65, "64 types and `other`:\n{metrics}");
    assert!(counted.contains(&("other", 6)), "{metrics}");
    assert_eq!(counted.iter().map(|(_, n)| n).sum::<u64>(), 70, "{metrics}");
}

/// Prometheus asks for OpenMetrics and gets it; curl (no `Accept`) gets the
/// Prometheus text format. Same series either way: only OpenMetrics' own rules differ
/// (`# TYPE` names a counter without `_total`, the text ends with `# EOF`).
#[test]
fn metrics_are_openmetrics_for_a_scraper_that_asks_and_prometheus_text_otherwise() {
    let setup = Setup::with_prefetch(&prefetch_roles(4));
    let server = Server::start(&setup.config(), &[], setup.dir.path());
    register_decode_worker(&server, 1);
    let types = action_types(&book(&server, "om"));
    let scrape = |accept: Option<&str>| {
        let mut request = server.agent.get(format!("{}/metrics", server.base));
        if let Some(accept) = accept {
            request = request.header("accept", accept);
        }
        let mut response = request.call().unwrap();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        (content_type, response.body_mut().read_to_string().unwrap())
    };
    // What Prometheus sends by default.
    let (om_type, om) = scrape(Some("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"));
    let (text_type, text) = scrape(None);
    assert!(
        om_type.starts_with("application/openmetrics-text; version=1.0.0"),
        "{om_type}"
    );
    assert!(
        text_type.starts_with("text/plain; version=0.0.4"),
        "{text_type}"
    );
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(!text.contains("# EOF"), "{text}");
    assert!(om.contains("# TYPE kvhint_bookings counter\n"), "{om}");
    assert!(
        text.contains("# TYPE kvhint_bookings_total counter\n"),
        "{text}"
    );
    for body in [&om, &text] {
        assert!(
            body.contains("\nkvhint_bookings_total{role=\"decode\"} 1\n"),
            "{body}"
        );
        for kind in &types {
            let line = format!("\nkvhint_hint_actions_total{{action_type=\"{kind}\"}} 1\n");
            assert!(body.contains(&line), "{body}");
        }
    }
    // The same series (bucket bounds aside: OpenMetrics writes `le="1.0"`, the
    // Prometheus text `le="1"`, as Go's client does).
    let series = |body: &str| -> Vec<String> {
        let mut series: Vec<String> = body
            .lines()
            .filter(|l| !l.starts_with('#') && !l.contains("_bucket{"))
            .filter_map(|l| Some(l.rsplit_once(' ')?.0.to_string()))
            .collect();
        series.sort();
        series
    };
    assert_eq!(series(&om), series(&text));
}
