//! Who may call what: bearer tokens when the config has `auth`, and without it,
//! the guards that keep a loopback-only router loopback-only.
//!
//! With `auth`, every endpoint but `/healthz` and `/metrics` takes
//! `Authorization: Bearer <token>` of its caller class (an admin token is taken
//! everywhere), checked against the current snapshot's tokens, so a reload that
//! re-reads the token files takes effect at once.
//!
//! Without `auth`, the router is only as private as its address. A browser on
//! the same machine can still reach a loopback port: a page can post a form to
//! it (a "simple" request needs no preflight), and a page on a name its owner
//! re-points at 127.0.0.1 (DNS rebinding) can even read the answers. Both show
//! in the headers: a form post carries the page's `Origin`, and a rebound
//! request carries the attacker's name in `Host`. So an unauthenticated router
//! refuses a request whose `Origin` is not its own host, and, when it listens on
//! loopback, one whose `Host` is not a loopback name.

use super::error::ApiError;
use crate::config::auth::Caller;
use crate::snapshot::Snapshot;
use arc_swap::ArcSwap;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// How the router is exposed (fixed at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Exposure {
    /// The listen address is a loopback address.
    pub loopback: bool,
}

/// What a guard reads: the serving snapshot's tokens, how the router is
/// exposed, and the caller class its routes are for (`None`: open routes).
#[derive(Clone)]
pub struct Guard {
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    pub exposure: Exposure,
    pub caller: Option<Caller>,
}

/// The middleware for routes `caller` may use: `from_fn_with_state(Guard { .. }, guard)`.
pub async fn guard(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let caller = guard.caller;
    // The guard is dropped before the handler runs: an `arc-swap` guard is
    // meant for a short borrow, not to be held across an await.
    let snapshot = guard.snapshot.load();
    let verdict = match single_host(request.headers()) {
        Err(error) => Err(error),
        Ok(()) => match (&snapshot.tokens, caller) {
            (Some(tokens), Some(caller)) => match bearer(request.headers()) {
                Some(token) if tokens.admits(caller, token) => Ok(()),
                Some(_) => Err(unauthorized(caller, "the token given is not one of them")),
                None => Err(unauthorized(caller, "none was given")),
            },
            (Some(_), None) => Ok(()),
            (None, _) => same_site(request.uri(), request.headers(), guard.exposure),
        },
    };
    drop(snapshot);
    match verdict {
        Ok(()) => next.run(request).await,
        Err(error) => {
            let mut response = error.into_response();
            if response.status() == StatusCode::UNAUTHORIZED {
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"kvhint\""),
                );
            }
            response
        }
    }
}

/// The token of `Authorization: Bearer <token>` (scheme in any case).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at(value.iter().position(|b| *b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = token.trim_ascii();
    (!token.is_empty()).then_some(token)
}

fn unauthorized(caller: Caller, problem: &str) -> ApiError {
    let file = if caller == Caller::Admin {
        "auth.admin_token_file".to_string()
    } else {
        format!("auth.{} (or auth.admin_token_file)", caller.key())
    };
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        format!(
            "this endpoint takes a {caller} token, as `Authorization: Bearer <token>`, from the file the config names in {file}; {problem}"
        ),
    )
}

/// The host part of a `Host` header or an origin's authority: no port, no
/// brackets, lower case.
fn host_of(authority: &str) -> String {
    let authority = authority.trim();
    let host = if let Some(rest) = authority.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, port)| {
            if port.chars().all(|c| c.is_ascii_digit()) {
                h
            } else {
                authority
            }
        })
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// `localhost`, a name under `.localhost`, or a loopback address.
fn is_loopback_name(host: &str) -> bool {
    host == "localhost"
        || host.ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A request with more than one `Host` header is refused (RFC 9112 §3.2: 400):
/// the guards below would read one and a proxy or handler might use another.
fn single_host(headers: &HeaderMap) -> Result<(), ApiError> {
    let hosts = headers.get_all(header::HOST).iter().count();
    if hosts > 1 {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "duplicate_host",
            format!("the request has {hosts} `Host` headers; HTTP/1.1 (RFC 9112, section 3.2) allows exactly one: send one `Host` header"),
        ));
    }
    Ok(())
}

/// The checks an unauthenticated router makes (see the module docs). The host
/// a request is addressed to is the authority of an absolute-form target
/// (`GET http://name/path`: RFC 9112 §3.2.2 has it replace `Host`), else `Host`;
/// on loopback both must name loopback. Every `Origin` and `Sec-Fetch-Site`
/// header is checked, not only the first.
fn same_site(uri: &Uri, headers: &HeaderMap, exposure: Exposure) -> Result<(), ApiError> {
    let host_header = headers
        .get(header::HOST)
        .map(|h| h.to_str().map(host_of).unwrap_or_else(|_| "?".to_string()));
    let target = uri.authority().map(|a| host_of(a.as_str()));
    let host = target.clone().or_else(|| host_header.clone());
    if exposure.loopback {
        for host in [&target, &host_header].into_iter().flatten() {
            if !is_loopback_name(host) {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "forbidden_host",
                    format!(
                        "this router listens on loopback without `auth` and answers only requests addressed to a loopback name, not {host:?}; to reach it by another name, configure `auth`"
                    ),
                ));
            }
        }
    }
    let cross_site = || {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "cross_origin_refused",
            "a request from a web page of another site is refused: this router has no `auth`, so it cannot tell a page's request from its operator's; configure `auth` to call it from a browser",
        )
    };
    if headers
        .get_all("sec-fetch-site")
        .iter()
        .any(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"))
    {
        return Err(cross_site());
    }
    for origin in headers.get_all(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let authority = origin
            .split_once("://")
            .map(|(_, rest)| rest.split('/').next().unwrap_or(""));
        let same = match (authority.map(host_of), &host) {
            (Some(origin_host), _) if exposure.loopback => is_loopback_name(&origin_host),
            (Some(origin_host), Some(host)) => origin_host == *host,
            _ => false,
        };
        if !same {
            return Err(cross_site());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, HeaderValue::from_static(v));
        }
        map
    }

    fn check(h: &HeaderMap, exposure: Exposure) -> Result<(), ApiError> {
        same_site(&Uri::from_static("/admin/status"), h, exposure)
    }

    #[test]
    fn a_second_host_and_an_absolute_target_are_checked_too() {
        let loopback = Exposure { loopback: true };
        let mut two = headers(&[("host", "127.0.0.1:8080")]);
        two.append("host", HeaderValue::from_static("evil.example"));
        assert_eq!(single_host(&two).map_err(|e| e.code), Err("duplicate_host"));
        assert_eq!(single_host(&headers(&[("host", "127.0.0.1")])), Ok(()));
        let absolute = Uri::from_static("http://evil.example/admin/status");
        let loopback_host = headers(&[("host", "127.0.0.1:8080")]);
        assert_eq!(
            same_site(&absolute, &loopback_host, loopback).map_err(|e| e.code),
            Err("forbidden_host")
        );
        let local = Uri::from_static("http://localhost:8080/admin/status");
        assert_eq!(same_site(&local, &loopback_host, loopback), Ok(()));
        let mut origins = headers(&[("host", "127.0.0.1"), ("origin", "http://localhost")]);
        origins.append("origin", HeaderValue::from_static("https://evil.example"));
        assert_eq!(
            check(&origins, loopback).map_err(|e| e.code),
            Err("cross_origin_refused")
        );
    }

    #[test]
    fn hosts_are_compared_without_port_case_or_brackets() {
        assert_eq!(host_of("LocalHost:8080"), "localhost");
        assert_eq!(host_of("[::1]:80"), "::1");
        assert_eq!(host_of("127.0.0.1"), "127.0.0.1");
        assert_eq!(host_of("evil.example."), "evil.example");
        assert!(is_loopback_name("127.9.9.9"));
        assert!(is_loopback_name("app.localhost"));
        assert!(!is_loopback_name("localhost.evil.example"));
        assert!(!is_loopback_name("10.0.0.1"));
    }

    #[test]
    fn a_loopback_router_without_auth_refuses_other_hosts_and_other_sites() {
        let loopback = Exposure { loopback: true };
        let ok = [
            headers(&[("host", "127.0.0.1:8080")]),
            headers(&[
                ("host", "localhost:8080"),
                ("origin", "http://localhost:3000"),
            ]),
            headers(&[]),
        ];
        for h in ok {
            assert_eq!(check(&h, loopback), Ok(()), "{h:?}");
        }
        let refused = [
            (
                headers(&[("host", "rebound.evil.example:8080")]),
                "forbidden_host",
            ),
            (
                headers(&[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "https://evil.example"),
                ]),
                "cross_origin_refused",
            ),
            (
                headers(&[("host", "127.0.0.1:8080"), ("origin", "null")]),
                "cross_origin_refused",
            ),
            (
                headers(&[("host", "127.0.0.1:8080"), ("sec-fetch-site", "cross-site")]),
                "cross_origin_refused",
            ),
        ];
        for (h, code) in refused {
            assert_eq!(check(&h, loopback).map_err(|e| e.code), Err(code), "{h:?}");
        }
        let exposed = Exposure { loopback: false };
        assert_eq!(
            check(&headers(&[("host", "router.internal:8080")]), exposed),
            Ok(())
        );
        assert_eq!(
            check(
                &headers(&[
                    ("host", "router.internal:8080"),
                    ("origin", "http://router.internal:8080")
                ]),
                exposed
            ),
            Ok(())
        );
        assert!(check(
            &headers(&[
                ("host", "router.internal:8080"),
                ("origin", "http://evil.example")
            ]),
            exposed
        )
        .is_err());
    }
}
