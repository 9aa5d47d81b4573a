//! The plugin side of the boundary: adapters from the author's types to the
//! stable-ABI trait objects, and [`export_plugin!`](crate::export_plugin).
//!
//! Every entry point the host can call — registration, construction,
//! `build_hints`, `set_log_sink` ([`crate::log::set_sink`]), and dropping a
//! policy or a provider (which runs the author's `Drop` impls and those of
//! whatever a provider closure captured) — runs inside `catch_unwind` here, in
//! the plugin. A panic that
//! reached the boundary would make `abi_stable` abort the whole router; caught
//! here it becomes an [`FfiError`] of kind `Panicked` that the host counts and
//! contains.

use crate::abi::{
    error_code, host_kind, policy_kind, selection_flags, FfiActionWriter, FfiCandidate,
    FfiConstructed, FfiError, FfiHintContext, FfiHintHost, FfiHintPolicy, FfiHintPolicyBox,
    FfiHintPolicy_TO, FfiHintProvider, FfiHintProvider_TO, FfiLogSink, FfiRegistration,
    FfiRouterSettings, FfiSelection, FfiSelectionConstructed, FfiSelectionPolicy,
    FfiSelectionPolicy_TO, FfiSelectionProvider, FfiSelectionProvider_TO, FfiSelectionRequest,
    PluginMod, PluginModRef,
};
use crate::actions::Actions;
use crate::context::HintContext;
use crate::policy::{HintError, HintErrorKind, HintPolicy};
use crate::registry::{
    HintHost, HintPolicyProvider, HintRegistry, Parameters, Provider, RouterSettings,
    SelectionPolicyProvider,
};
use crate::selection::{Candidates, SelectionPolicy, SelectionRequest};
use abi_stable::{
    prefix_type::PrefixTypeTrait,
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RSlice, RStr, RString, RVec},
};
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Once};

thread_local! {
    /// Set while plugin code runs under [`guarded`]; the panic hook then records
    /// where the panic happened instead of printing it.
    static GUARDED: Cell<bool> = const { Cell::new(false) };
    static PANIC_LOCATION: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// A panic inside a policy is an error the host reports and counts; printing a
/// backtrace for it on every booking would flood the log. So while plugin code
/// runs guarded, the hook only records the location. Outside, it defers to the
/// previous hook.
///
/// Installed only in a plugin loaded from its own `.so`, which has a std (and
/// a panic hook) of its own. A plugin crate linked into the router shares the
/// router's std: replacing the hook there would replace the router's, so there
/// the host's hook prints a policy's panic like any other (see [`root_module`]).
fn install_panic_hook() {
    if !in_own_file() {
        return;
    }
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if GUARDED.with(Cell::get) {
                let location = info
                    .location()
                    .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
                PANIC_LOCATION.with(|slot| *slot.borrow_mut() = location);
            } else {
                previous(info);
            }
        }));
    });
}

/// Set when the host loads this plugin from its `.so` (through the exported
/// symbol), never when the crate is linked into the host.
static OWN_STD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this copy of plugin-api runs in a plugin's own `.so` (see
/// [`OWN_STD`]): only then may it install process-wide things (the panic
/// hook, the log bridge's global subscriber).
pub(crate) fn in_own_file() -> bool {
    OWN_STD.load(std::sync::atomic::Ordering::Relaxed)
}

/// Runs `f`, turning a panic into an `FfiError` of kind `Panicked`.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, FfiError>) -> RResult<T, FfiError> {
    install_panic_hook();
    let was_guarded = GUARDED.with(|g| g.replace(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was_guarded));
    match result {
        Ok(result) => result.into(),
        Err(panic) => {
            let location = PANIC_LOCATION
                .with(|slot| slot.borrow_mut().take())
                .map(|l| format!(" at {l}"))
                .unwrap_or_default();
            RResult::RErr(FfiError {
                code: error_code::PANICKED,
                message: RString::from(format!(
                    "{what} panicked{location}: {}",
                    panic_message(&*panic)
                )),
            })
        }
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "(a panic payload that is not a string)".to_string()
    }
}

impl From<HintError> for FfiError {
    fn from(error: HintError) -> Self {
        let code = match error.kind() {
            HintErrorKind::BadParameters => error_code::BAD_PARAMETERS,
            HintErrorKind::Failed => error_code::FAILED,
        };
        FfiError {
            code,
            message: RString::from(error.message()),
        }
    }
}

fn parameters(json: RStr<'_>, settings: &FfiRouterSettings) -> Result<Parameters, HintError> {
    Ok(
        Parameters::from_json(json.as_str())?.with_router(RouterSettings {
            block_size: settings.block_size as usize,
            seed: settings.seed,
        }),
    )
}

/// Drops `value` with a panic in its `Drop` caught: the host drops plugin objects
/// on every reload, and a panic unwinding out of the drop function `abi_stable`
/// generated would abort the router. A caught panic leaks nothing the drop did
/// not already leak, and is reported on stderr by the panic hook.
fn drop_guarded<T>(value: T) {
    install_panic_hook();
    let _ = catch_unwind(AssertUnwindSafe(move || drop(value)));
}

struct PolicyAdapter {
    /// Taken (once) by the `Drop` impl, to drop it under `catch_unwind`.
    policy: std::mem::ManuallyDrop<Arc<dyn HintPolicy>>,
}

impl Drop for PolicyAdapter {
    fn drop(&mut self) {
        // SAFETY: `policy` is taken here, once, and the adapter is never used
        // again: this is its drop.
        drop_guarded(unsafe { std::mem::ManuallyDrop::take(&mut self.policy) });
    }
}

impl FfiHintPolicy for PolicyAdapter {
    fn build_hints(
        &self,
        context: &FfiHintContext<'_>,
        out: &mut FfiActionWriter,
    ) -> RResult<(), FfiError> {
        guarded("build_hints", || {
            let mut actions = Actions::new(out);
            Ok(self
                .policy
                .build_hints(&HintContext::new(context), &mut actions)?)
        })
    }
}

struct ProviderAdapter {
    /// Taken (once) by the `Drop` impl, to drop it under `catch_unwind`.
    provider: std::mem::ManuallyDrop<Arc<HintPolicyProvider>>,
}

impl Drop for ProviderAdapter {
    fn drop(&mut self) {
        // SAFETY: as for `PolicyAdapter`: taken once, in the adapter's drop.
        drop_guarded(unsafe { std::mem::ManuallyDrop::take(&mut self.provider) });
    }
}

impl FfiHintProvider for ProviderAdapter {
    fn construct(
        &self,
        parameters_json: RStr<'_>,
        settings: &FfiRouterSettings,
    ) -> RResult<FfiConstructed, FfiError> {
        guarded("the provider", || {
            let parameters = parameters(parameters_json, settings)?;
            let constructor = (self.provider)(&parameters)?;
            let commitments = constructor.policy.commitments().bits();
            let policy: FfiHintPolicyBox = FfiHintPolicy_TO::from_value(
                PolicyAdapter {
                    policy: std::mem::ManuallyDrop::new(constructor.policy),
                },
                TD_Opaque,
            );
            Ok(FfiConstructed {
                policy,
                commitments,
            })
        })
    }
}

struct SelectionAdapter {
    /// Taken (once) by the `Drop` impl, to drop it under `catch_unwind`.
    policy: std::mem::ManuallyDrop<Arc<dyn SelectionPolicy>>,
}

impl Drop for SelectionAdapter {
    fn drop(&mut self) {
        // SAFETY: as for `PolicyAdapter`: taken once, in the adapter's drop.
        drop_guarded(unsafe { std::mem::ManuallyDrop::take(&mut self.policy) });
    }
}

impl FfiSelectionPolicy for SelectionAdapter {
    fn select(
        &self,
        request: &FfiSelectionRequest<'_>,
        candidates: RSlice<'_, FfiCandidate<'_>>,
    ) -> RResult<FfiSelection, FfiError> {
        guarded("select", || {
            let selection = self.policy.select(
                &SelectionRequest::new(request),
                &Candidates::new(candidates.as_slice()),
            )?;
            Ok(FfiSelection {
                index: selection.index() as u64,
                commit_kv_copy: selection.commits_kv_copy(),
            })
        })
    }
}

struct SelectionProviderAdapter {
    /// Taken (once) by the `Drop` impl, to drop it under `catch_unwind`.
    provider: std::mem::ManuallyDrop<Arc<SelectionPolicyProvider>>,
}

impl Drop for SelectionProviderAdapter {
    fn drop(&mut self) {
        // SAFETY: as for `PolicyAdapter`: taken once, in the adapter's drop.
        drop_guarded(unsafe { std::mem::ManuallyDrop::take(&mut self.provider) });
    }
}

impl FfiSelectionProvider for SelectionProviderAdapter {
    fn construct(
        &self,
        parameters_json: RStr<'_>,
        settings: &FfiRouterSettings,
    ) -> RResult<FfiSelectionConstructed, FfiError> {
        guarded("the selection provider", || {
            let parameters = parameters(parameters_json, settings)?;
            let constructor = (self.provider)(&parameters)?;
            let policy = &constructor.policy;
            let mut flags = 0;
            if policy.kv_aware() {
                flags |= selection_flags::KV_AWARE;
            }
            if policy.commits_kv_copies() {
                flags |= selection_flags::COMMITS_KV_COPIES;
            }
            if policy.wants_peer_copies() {
                flags |= selection_flags::WANTS_PEER_COPIES;
            }
            Ok(FfiSelectionConstructed {
                policy: FfiSelectionPolicy_TO::from_value(
                    SelectionAdapter {
                        policy: std::mem::ManuallyDrop::new(constructor.policy),
                    },
                    TD_Opaque,
                ),
                flags,
            })
        })
    }
}

/// Runs a plugin's registration function and converts what it registered.
/// Called by the code [`export_plugin!`](crate::export_plugin) generates.
#[doc(hidden)]
pub fn run_registration<E: Display>(
    register: impl FnOnce(&mut HintRegistry) -> Result<(), E>,
) -> RResult<RVec<FfiRegistration>, FfiError> {
    guarded("the registration function", || {
        let mut registry = HintRegistry::new();
        register(&mut registry).map_err(|e| FfiError {
            code: error_code::FAILED,
            message: RString::from(e.to_string()),
        })?;
        Ok(registry
            .entries
            .into_iter()
            .map(|entry| match entry.provider {
                Provider::Hint {
                    provider,
                    default_hosts,
                } => FfiRegistration {
                    kind: policy_kind::HINT,
                    name: entry.name.into(),
                    default_hosts: default_hosts
                        .into_iter()
                        .map(|host| match host {
                            HintHost::AnyWorkerSelection => FfiHintHost {
                                kind: host_kind::ANY_WORKER_SELECTION,
                                selection: RString::new(),
                            },
                            HintHost::WorkerSelection(name) => FfiHintHost {
                                kind: host_kind::WORKER_SELECTION,
                                selection: name.into(),
                            },
                        })
                        .collect(),
                    hint_provider: ROption::RSome(FfiHintProvider_TO::from_value(
                        ProviderAdapter {
                            provider: std::mem::ManuallyDrop::new(provider),
                        },
                        TD_Opaque,
                    )),
                    selection_provider: ROption::RNone,
                },
                Provider::Selection(provider) => FfiRegistration {
                    kind: policy_kind::SELECTION,
                    name: entry.name.into(),
                    default_hosts: RVec::new(),
                    hint_provider: ROption::RNone,
                    selection_provider: ROption::RSome(FfiSelectionProvider_TO::from_value(
                        SelectionProviderAdapter {
                            provider: std::mem::ManuallyDrop::new(provider),
                        },
                        TD_Opaque,
                    )),
                },
            })
            .collect())
    })
}

/// Marks this copy of plugin-api as running in a `.so` of its own (see
/// [`install_panic_hook`]). Called by the exported symbol's loader only.
#[doc(hidden)]
pub fn loaded_from_its_own_file() {
    OWN_STD.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Builds a plugin's root module. Called by the code
/// [`export_plugin!`](crate::export_plugin) generates.
#[doc(hidden)]
pub fn root_module(
    name: &'static str,
    version: &'static str,
    panic_unwind: bool,
    register: extern "C" fn() -> RResult<RVec<FfiRegistration>, FfiError>,
    set_log_sink: extern "C" fn(FfiLogSink),
) -> PluginModRef {
    PluginMod {
        abi_version: crate::ABI_VERSION,
        panic_unwind,
        api_version: RStr::from_str(crate::API_VERSION),
        name: RStr::from_str(name),
        version: RStr::from_str(version),
        register,
        set_log_sink,
    }
    .leak_into_prefix()
}

/// Exports a plugin. Call it once at the crate root with the plugin's
/// registration function, `fn(&mut HintRegistry) -> Result<(), E>` for any
/// displayable `E`:
///
/// ```ignore
/// kvhint_plugin_api::export_plugin!(register);
/// ```
///
/// It generates the `abi_stable` root module the router loads from the `.so`,
/// exported as `kvhint_plugin_root_v2__<crate name>`
/// ([`ROOT_SYMBOL_PREFIX`](crate::abi::ROOT_SYMBOL_PREFIX)), and a
/// `pub fn kvhint_plugin_module()` that returns the same module, so a crate
/// built as both `rlib` and `cdylib` can also be linked into a router. The
/// symbol is named after the crate, so several plugin crates linked into one
/// router never collide; and a linked-in crate neither gets a log sink nor
/// installs a panic hook: it shares the router's `tracing` and std.
#[macro_export]
macro_rules! export_plugin {
    ($register:path) => {
        #[doc(hidden)]
        extern "C" fn __kvhint_register() -> $crate::__private::abi_stable::std_types::RResult<
            $crate::__private::abi_stable::std_types::RVec<$crate::abi::FfiRegistration>,
            $crate::abi::FfiError,
        > {
            $crate::export::run_registration($register)
        }

        // A function per plugin, not one in this crate, so the records carry
        // this crate's name; `set_sink` catches every panic.
        #[doc(hidden)]
        extern "C" fn __kvhint_set_log_sink(sink: $crate::abi::FfiLogSink) {
            $crate::log::set_sink(env!("CARGO_PKG_NAME"), sink)
        }

        /// This plugin's root module, for a router that links the crate in.
        pub fn kvhint_plugin_module() -> $crate::abi::PluginModRef {
            static MODULE: ::std::sync::OnceLock<$crate::abi::PluginModRef> =
                ::std::sync::OnceLock::new();
            *MODULE.get_or_init(|| {
                $crate::export::root_module(
                    env!("CARGO_PKG_NAME"),
                    env!("CARGO_PKG_VERSION"),
                    cfg!(panic = "unwind"),
                    __kvhint_register,
                    __kvhint_set_log_sink,
                )
            })
        }

        // What `#[abi_stable::export_root_module]` generates, spelled with
        // `$crate` paths so plugins need not depend on `abi_stable` themselves,
        // and under a name of this crate's own (see the macro's docs).
        #[doc(hidden)]
        #[export_name = concat!("kvhint_plugin_root_v2__", env!("CARGO_CRATE_NAME"))]
        pub static __KVHINT_LIB_HEADER: $crate::__private::abi_stable::library::LibHeader = {
            extern "C" fn __kvhint_erased_module(
            ) -> $crate::__private::abi_stable::library::RootModuleResult {
                // Only the router's loader calls this, and only in a `.so`.
                $crate::export::loaded_from_its_own_file();
                $crate::__private::abi_stable::library::__call_root_module_loader(
                    kvhint_plugin_module,
                )
            }
            // SAFETY: `from_constructor::<M>` needs the constructor's erased
            // `PrefixRef` to have been cast from a `PrefixRef<M>`'s. It is:
            // `__call_root_module_loader` takes `kvhint_plugin_module`, which
            // returns a `PluginModRef` (the `M` here), and erases that module's
            // own prefix reference, as the attribute's expansion does.
            unsafe {
                $crate::__private::abi_stable::library::LibHeader::from_constructor::<
                    $crate::abi::PluginModRef,
                >(
                    __kvhint_erased_module,
                    $crate::__private::abi_stable::library::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_export_name_uses_the_abi_prefix() {
        // `export_plugin!` spells the prefix out (attributes need a literal);
        // this keeps it equal to the constant the loader searches for.
        assert_eq!(crate::abi::ROOT_SYMBOL_PREFIX, "kvhint_plugin_root_v2__");
    }

    #[test]
    fn the_root_module_carries_the_log_sink_setter() {
        use crate::abi::{FfiError, FfiLogSink, FfiRegistration};
        use abi_stable::std_types::{RResult, RVec};
        extern "C" fn register() -> RResult<RVec<FfiRegistration>, FfiError> {
            RResult::ROk(RVec::new())
        }
        extern "C" fn set_log_sink(_: FfiLogSink) {}
        let module = super::root_module("my-plugin", "0.1.0", true, register, set_log_sink);
        assert_eq!(module.name().as_str(), "my-plugin");
        assert_eq!(module.abi_version(), crate::ABI_VERSION);
    }
}
