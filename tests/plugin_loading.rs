//! Loading real plugin `.so` files built from real crates (issue: stable-ABI
//! plugin API, loader and registry). Each test is one behaviour an operator or
//! plugin author would notice.

use kvhint::catalog::{self, PluginFile};
use kvhint::loader::LoadErrorKind;
use kvhint::registry::Registry;
use kvhint_e2e::{kvhint_bin, loader, plugin_so, plugins_dir_with, private_dir, standalone_so};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

fn load_error(path: &Path) -> kvhint::loader::LoadError {
    let (loader, _cache) = loader();
    loader
        .load(path, None)
        .err()
        .unwrap_or_else(|| panic!("{} should have been refused", path.display()))
}

#[test]
fn both_plugins_load_and_register_their_types() {
    let dir = plugins_dir_with(&[plugin_so("kv_fetch"), plugin_so("harness_prefetch")]);
    let (loader, _cache) = loader();
    let mut registry = Registry::new();
    let files = catalog::plugin_files(Some(dir.path()), &[], &|_| None).unwrap();
    let reports = catalog::load_into(&loader, &mut registry, &files);
    let loaded: Vec<(String, Vec<String>)> = reports
        .iter()
        .map(|r| {
            let file = r.result.as_ref().unwrap_or_else(|e| panic!("{e:?}"));
            (file.plugin.info.name.clone(), file.hint_types.clone())
        })
        .collect();
    assert_eq!(
        loaded,
        [
            (
                "harness-prefetch".to_string(),
                vec!["harness_prefetch".to_string()]
            ),
            ("kv-fetch".to_string(), vec!["kv_fetch".to_string()]),
        ]
    );
    let kv_fetch = registry
        .construct("kv_fetch", &serde_json::json!({}))
        .unwrap();
    assert!(kv_fetch
        .commitments
        .contains(kvhint_plugin_api::policy::Commitments::KV_COPY));
    let prefetch = registry
        .construct("harness_prefetch", &serde_json::json!({"max_blocks": 8}))
        .unwrap();
    assert!(prefetch.commitments.is_empty());
}

#[test]
fn plugin_built_against_another_plugin_api_is_refused_with_what_to_rebuild() {
    let so = standalone_so("old-api");
    let dir = plugins_dir_with(&[so]);
    let error = load_error(&dir.path().join("libfixture_old_api.so"));
    let text = error.to_string();
    assert!(
        matches!(error.kind, LoadErrorKind::IncompatibleApi { ref plugin, .. } if plugin == "0.1.0"),
        "{text}"
    );
    assert!(
        text.contains("built against kvhint-plugin-api 0.1.0"),
        "{text}"
    );
    assert!(
        text.contains("rebuild it against kvhint-plugin-api 0.2.0"),
        "{text}"
    );
    assert!(
        text.contains("libfixture_old_api.so"),
        "names the file: {text}"
    );
}

#[test]
fn so_without_root_module_is_refused() {
    let dir = plugins_dir_with(&[plugin_so("fixture_no_root_module")]);
    let error = load_error(&dir.path().join("libfixture_no_root_module.so"));
    assert!(
        matches!(error.kind, LoadErrorKind::NoRootModule(_)),
        "{error}"
    );
    assert!(error.to_string().contains("export_plugin!"), "{error}");
}

#[test]
fn truncated_so_is_refused_before_dlopen_and_the_process_survives() {
    let dir = private_dir();
    let whole = std::fs::read(plugin_so("harness_prefetch")).unwrap();
    let path = dir.path().join("libtruncated.so");
    // Cut after the section table's loss only (debug info and section headers
    // gone, segments whole): still refused as cut short.
    std::fs::write(&path, &whole[..whole.len() * 9 / 10]).unwrap();
    let error = load_error(&path);
    assert!(
        error.to_string().contains("truncated or corrupt"),
        "{error}"
    );

    // Keep the ELF and program headers, cut into the first loadable segment:
    // dlopen would map pages past the end of the file and die of SIGBUS.
    std::fs::write(&path, &whole[..8192]).unwrap();
    let error = load_error(&path);
    assert!(
        matches!(
            error.kind,
            LoadErrorKind::Elf(kvhint::loader::elf::ElfError::Truncated { .. })
        ),
        "{error}"
    );
    assert!(error.to_string().contains("truncated"), "{error}");

    // Through the CLI too: an exit status of 1 with the reason, not a signal.
    let output = Command::new(kvhint_bin())
        .args(["plugins", "--plugins-dir"])
        .arg(dir.path())
        .arg("--cache-dir")
        .arg(dir.path().join("cache"))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("libtruncated.so") && stdout.contains("truncated"),
        "{stdout}"
    );

    // And the same loader still loads a good plugin afterwards.
    let (loader, _cache) = loader();
    assert!(loader.load(&path, None).is_err());
    let good = plugins_dir_with(&[plugin_so("harness_prefetch")]);
    loader
        .load(&good.path().join("libharness_prefetch.so"), None)
        .unwrap();
}

#[test]
fn non_elf_file_is_refused() {
    let dir = private_dir();
    let path = dir.path().join("libnotes.so");
    std::fs::write(&path, "these are not the plugins you are looking for\n").unwrap();
    let error = load_error(&path);
    assert!(
        matches!(
            error.kind,
            LoadErrorKind::Elf(kvhint::loader::elf::ElfError::NotElf(_))
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains("not an ELF shared object"),
        "{error}"
    );
}

#[test]
fn panic_abort_build_is_refused() {
    let dir = plugins_dir_with(&[standalone_so("panic-abort")]);
    let error = load_error(&dir.path().join("libfixture_panic_abort.so"));
    assert!(matches!(error.kind, LoadErrorKind::PanicAbort), "{error}");
    assert!(error.to_string().contains("panic = \"abort\""), "{error}");
}

#[test]
fn same_hint_type_in_two_plugins_is_refused_naming_both() {
    let dir = plugins_dir_with(&[
        plugin_so("harness_prefetch"),
        plugin_so("fixture_duplicate_type"),
    ]);
    let (loader, _cache) = loader();
    let mut registry = Registry::new();
    let files = catalog::plugin_files(Some(dir.path()), &[], &|_| None).unwrap();
    let reports = catalog::load_into(&loader, &mut registry, &files);
    // Files load in name order: the duplicate-type fixture first.
    assert!(reports[0].result.is_ok());
    let errors = reports[1].result.as_ref().unwrap_err();
    let text = errors.join("\n");
    assert!(
        text.contains("\"harness_prefetch\" is registered twice"),
        "{text}"
    );
    assert!(text.contains("fixture-duplicate-type"), "{text}");
    assert!(text.contains("plugin harness-prefetch"), "{text}");
    assert_eq!(
        registry.types().count(),
        1,
        "the refused plugin added nothing"
    );
}

#[test]
fn world_writable_plugin_file_is_refused() {
    let dir = plugins_dir_with(&[plugin_so("harness_prefetch")]);
    let path = dir.path().join("libharness_prefetch.so");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let error = load_error(&path);
    assert!(matches!(error.kind, LoadErrorKind::Trust(_)), "{error}");
    assert!(error.to_string().contains("chmod go-w"), "{error}");
}

#[test]
fn two_different_plugin_files_give_two_distinct_modules() {
    let dir = plugins_dir_with(&[plugin_so("kv_fetch"), plugin_so("harness_prefetch")]);
    let (loader, _cache) = loader();
    let a = loader
        .load(&dir.path().join("libkv_fetch.so"), None)
        .unwrap();
    let b = loader
        .load(&dir.path().join("libharness_prefetch.so"), None)
        .unwrap();
    assert_eq!(a.info.name, "kv-fetch");
    assert_eq!(b.info.name, "harness-prefetch");
    // Each module's registration function is its own file's.
    let mut registry = Registry::new();
    registry
        .add_module(
            kvhint::registry::Origin::BuiltIn {
                crate_name: "a".into(),
            },
            a.module,
        )
        .unwrap();
    registry
        .add_module(
            kvhint::registry::Origin::BuiltIn {
                crate_name: "b".into(),
            },
            b.module,
        )
        .unwrap();
    let names: Vec<_> = registry.types().map(|t| t.name.clone()).collect();
    assert_eq!(names, ["kv_fetch", "harness_prefetch"]);
    assert_eq!(loader.libraries_mapped(), 2);
}

#[test]
fn loading_the_same_content_again_is_a_noop() {
    let dir = plugins_dir_with(&[plugin_so("harness_prefetch")]);
    let other = plugins_dir_with(&[plugin_so("harness_prefetch")]);
    let (loader, _cache) = loader();
    let first = loader
        .load(&dir.path().join("libharness_prefetch.so"), None)
        .unwrap();
    let again = loader
        .load(&other.path().join("libharness_prefetch.so"), None)
        .unwrap();
    assert_eq!(first.sha256, again.sha256);
    assert_eq!(loader.libraries_mapped(), 1);
    // The private copy is named by content.
    let cached = first
        .cached_path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    assert_eq!(
        cached,
        format!("libharness_prefetch-{}.so", &first.sha256[..16])
    );
}

#[test]
fn sha256_pin_mismatch_is_refused() {
    let dir = plugins_dir_with(&[plugin_so("harness_prefetch")]);
    let path = dir.path().join("libharness_prefetch.so");
    let (loader, _cache) = loader();
    let error = loader.load(&path, Some(&"0".repeat(64))).err().unwrap();
    assert!(
        matches!(error.kind, LoadErrorKind::PinMismatch { .. }),
        "{error}"
    );
    let sha = loader.load(&path, None).unwrap().sha256;
    assert!(loader.load(&path, Some(&sha)).is_ok());
}

#[test]
fn plugins_command_lists_each_file_or_why_it_was_refused() {
    let dir = plugins_dir_with(&[
        plugin_so("harness_prefetch"),
        plugin_so("fixture_misbehaving"),
    ]);
    let cache = private_dir();
    let run = |dir: &Path| {
        Command::new(kvhint_bin())
            .args(["plugins", "--plugins-dir"])
            .arg(dir)
            .arg("--cache-dir")
            .arg(cache.path().join("c"))
            .output()
            .unwrap()
    };
    let output = run(dir.path());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("plugin harness-prefetch 0.1.0 (kvhint-plugin-api 0.2.0, ABI 2)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("hint harness_prefetch: commitments none; default under: none"),
        "{stdout}"
    );
    assert!(
        stdout.contains("hint echo: commitments none; default under: any worker selection"),
        "{stdout}"
    );

    // kv_fetch as a .so beside the built-in is a duplicate type: refused, exit 1.
    std::fs::copy(plugin_so("kv_fetch"), dir.path().join("libkv_fetch.so")).unwrap();
    let output = run(dir.path());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(
            "refused: hint policy type \"kv_fetch\" is registered twice: by built-in kv-fetch"
        ),
        "{stdout}"
    );
}

#[test]
fn explicit_plugin_files_load_without_a_directory() {
    let dir = plugins_dir_with(&[plugin_so("harness_prefetch")]);
    let explicit = [PluginFile {
        path: dir.path().join("libharness_prefetch.so"),
        sha256: None,
    }];
    let files = catalog::plugin_files(None, &explicit, &|_| None).unwrap();
    let (loader, _cache) = loader();
    let mut registry = Registry::new();
    let reports = catalog::load_into(&loader, &mut registry, &files);
    assert!(reports[0].result.is_ok());
    assert!(registry.get("harness_prefetch").is_some());
}

#[test]
fn an_explicit_pin_applies_to_a_file_also_found_in_the_directory() {
    let dir = plugins_dir_with(&[plugin_so("harness_prefetch")]);
    let path = dir.path().join("libharness_prefetch.so");
    let wrong = [PluginFile {
        path: path.clone(),
        sha256: Some("0".repeat(64)),
    }];
    let files = catalog::plugin_files(Some(dir.path()), &wrong, &|_| None).unwrap();
    assert_eq!(files.len(), 1, "loaded once");
    let (loader, _cache) = loader();
    let mut registry = Registry::new();
    let reports = catalog::load_into(&loader, &mut registry, &files);
    let errors = reports[0].result.as_ref().unwrap_err().join("\n");
    assert!(errors.contains("the config pins"), "{errors}");

    // Two different pins for one file are refused outright.
    let error = catalog::plugin_files(Some(dir.path()), &wrong, &|_| Some("1".repeat(64)))
        .err()
        .unwrap();
    assert!(error.to_string().contains("keep one pin"), "{error}");
}

#[test]
fn libraries_refused_after_dlopen_stay_counted_and_count_against_the_cap() {
    let dir = plugins_dir_with(&[standalone_so("panic-abort"), plugin_so("harness_prefetch")]);
    let cache = private_dir();
    let loader = kvhint::loader::Loader::new(&kvhint::loader::LoaderOptions {
        cache_dir: cache.path().join("cache"),
        max_libraries: 1,
        // Refused *after* dlopen needs the library opened in this process: with
        // the probe, the probe refuses it and it is never mapped here.
        probe: kvhint::loader::ProbeMode::Off,
        ..Default::default()
    })
    .unwrap();
    let refused = dir.path().join("libfixture_panic_abort.so");
    // Refused after dlopen: it is mapped now, and counted.
    assert!(matches!(
        loader.load(&refused, None).err().unwrap().kind,
        LoadErrorKind::PanicAbort
    ));
    assert_eq!(loader.libraries_mapped(), 1);
    // Asked again, the same answer without opening it again.
    assert!(matches!(
        loader.load(&refused, None).err().unwrap().kind,
        LoadErrorKind::PanicAbort
    ));
    assert_eq!(loader.libraries_mapped(), 1);
    // And it holds the one place the cap allows.
    let error = loader
        .load(&dir.path().join("libharness_prefetch.so"), None)
        .err()
        .unwrap();
    assert!(
        matches!(
            error.kind,
            LoadErrorKind::TooManyLibraries { mapped: 1, cap: 1 }
        ),
        "{error}"
    );
}
