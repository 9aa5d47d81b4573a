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
    FfiAction, FfiConstructed, FfiError, FfiErrorKind, FfiHintContext, FfiHintHost, FfiHintPolicy,
    FfiHintPolicyBox, FfiHintPolicy_TO, FfiHintProvider, FfiHintProvider_TO, FfiLogSink,
    FfiRegistration, PluginMod, PluginModRef,
};
use crate::context::HintContext;
use crate::policy::{Action, HintError, HintErrorKind, HintPolicy};
use crate::registry::{HintHost, HintPolicyProvider, HintRegistry, Parameters};
use abi_stable::{
    prefix_type::PrefixTypeTrait,
    sabi_trait::TD_Opaque,
    std_types::{RResult, RStr, RString, RVec},
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
/// previous hook: when a plugin crate is linked into the host, this is the
/// host's own std, whose panics must still print.
fn install_panic_hook() {
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
                kind: FfiErrorKind::Panicked,
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
        let kind = match error.kind() {
            HintErrorKind::BadParameters => FfiErrorKind::BadParameters,
            HintErrorKind::Failed => FfiErrorKind::Failed,
        };
        FfiError {
            kind,
            message: RString::from(error.message()),
        }
    }
}

impl From<Action> for FfiAction {
    fn from(action: Action) -> Self {
        FfiAction {
            action_type: action.action_type.into(),
            action_version: action.action_version.into(),
            payload_json: action.payload.into_string().into(),
        }
    }
}

/// Why an action may not be sent, if it may not.
fn malformed(action: &Action) -> Option<String> {
    if action.action_type.is_empty() {
        return Some("an action has an empty action_type".into());
    }
    if action.action_version.is_empty() {
        return Some(format!(
            "action {:?} has an empty action_version",
            action.action_type
        ));
    }
    if !action.payload.is_object() {
        let mut shown = action.payload.as_str().to_string();
        if shown.len() > 80 {
            let cut = (0..=80)
                .rev()
                .find(|&i| shown.is_char_boundary(i))
                .unwrap_or(0);
            shown.truncate(cut);
            shown.push('…');
        }
        return Some(format!(
            "action {:?} has a payload that is not a JSON object: {shown}",
            action.action_type
        ));
    }
    None
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
    fn build_hints(&self, context: &FfiHintContext<'_>) -> RResult<RVec<FfiAction>, FfiError> {
        guarded("build_hints", || {
            let actions = self.policy.build_hints(&HintContext::new(context))?;
            // The payload's JSON was made by serde_json in this plugin, so it
            // is valid by construction; what can still be wrong is checked here too, so
            // the host never has to parse a payload (rule R8: a malformed
            // action costs the policy its actions for this booking).
            if let Some(problem) = actions.iter().find_map(malformed) {
                return Err(FfiError {
                    kind: FfiErrorKind::Malformed,
                    message: problem.into(),
                });
            }
            Ok(actions.into_iter().map(FfiAction::from).collect())
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
    fn construct(&self, parameters_json: RStr<'_>) -> RResult<FfiConstructed, FfiError> {
        guarded("the provider", || {
            let parameters = Parameters::from_json(parameters_json.as_str())?;
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

/// Runs a plugin's registration function and converts what it registered.
/// Called by the code [`export_plugin!`](crate::export_plugin) generates.
pub fn run_registration<E: Display>(
    register: impl FnOnce(&mut HintRegistry) -> Result<(), E>,
) -> RResult<RVec<FfiRegistration>, FfiError> {
    guarded("the registration function", || {
        let mut registry = HintRegistry::new();
        register(&mut registry).map_err(|e| FfiError {
            kind: FfiErrorKind::Failed,
            message: RString::from(e.to_string()),
        })?;
        Ok(registry
            .entries
            .into_iter()
            .map(|entry| FfiRegistration {
                name: entry.name.into(),
                default_hosts: entry
                    .default_hosts
                    .into_iter()
                    .map(|host| match host {
                        HintHost::AnyWorkerSelection => FfiHintHost::AnyWorkerSelection,
                        HintHost::WorkerSelection(name) => {
                            FfiHintHost::WorkerSelection(name.into())
                        }
                    })
                    .collect(),
                provider: FfiHintProvider_TO::from_value(
                    ProviderAdapter {
                        provider: std::mem::ManuallyDrop::new(entry.provider),
                    },
                    TD_Opaque,
                ),
            })
            .collect())
    })
}

/// Builds a plugin's root module. Called by the code
/// [`export_plugin!`](crate::export_plugin) generates.
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
/// and a `pub fn kvhint_plugin_module()` that returns the same module, so a
/// crate built as both `rlib` and `cdylib` can also be linked into a host.
/// The module's `set_log_sink` lets the router route the plugin's `tracing`
/// events into its own log ([`crate::log`]).
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

        /// This plugin's root module, for a host that links the crate in.
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
        // `$crate` paths so plugins need not depend on `abi_stable` themselves.
        // The symbol name is abi_stable 0.11's; a unit test pins it.
        #[doc(hidden)]
        #[export_name = "_1as_0lib_1header_0root_bmodule_bloader"]
        pub static __KVHINT_LIB_HEADER: $crate::__private::abi_stable::library::LibHeader = {
            extern "C" fn __kvhint_erased_module(
            ) -> $crate::__private::abi_stable::library::RootModuleResult {
                $crate::__private::abi_stable::library::__call_root_module_loader(
                    kvhint_plugin_module,
                )
            }
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
    fn export_symbol_is_abi_stables_root_module_loader_name() {
        // `export_plugin!` hard-codes this name; if abi_stable ever changes it,
        // this test says so before a host fails to find any plugin.
        assert_eq!(
            abi_stable::library::ROOT_MODULE_LOADER_NAME,
            "_1as_0lib_1header_0root_bmodule_bloader"
        );
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
        // An `Option` (see `PluginMod::set_log_sink`): the loader never gets a
        // panicking accessor, and `export_plugin!` always fills the field.
        assert!(module.set_log_sink().is_some());
        assert_eq!(module.name().as_str(), "my-plugin");
    }
}
