//! Who may read the HTTP endpoint (issue 24, item 4).
//!
//! With `--acl`, everything the endpoint shows of the cluster — the
//! console, its JSON (`/api/v1/...`), its event stream and `/metrics` —
//! needs a token whose role may read the cluster (`viewer`, `operator`,
//! `admin`: [`crate::authz::Right::ReadCluster`] over every job), the same
//! tokens the gRPC API takes, checked against the replicated ACLs at each
//! request. `/healthz` and `/readyz` stay open (a load balancer's probes
//! carry no token and learn nothing of the jobs).
//!
//! A token comes as `Authorization: Bearer SECRET` (a scraper: Prometheus's
//! `authorization` setting) or in the cookie [`TOKEN_COOKIE`], which
//! `POST /login` sets from a form (a browser: an `EventSource` cannot send
//! a header). The cookie is `HttpOnly`, `SameSite=Strict`, and `Secure`
//! when the endpoint is served over TLS.
//!
//! Without `--acl` nothing is checked, as on the gRPC API; the endpoint
//! then listens on loopback only unless `--insecure`.
//!
//! Absences: no route reads a token itself; no answer says whether a
//! refused secret exists.

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::authz::{scope, Right, Scope};

/// The cookie a browser's token travels in once it logged in.
pub const TOKEN_COOKIE: &str = "keel_token";

/// The longest secret read from a request (a token's secret is 69 bytes).
const SECRET_MAX_LEN: usize = 256;

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(
        "this endpoint needs a token whose role may read the cluster (viewer, operator or \
         admin): send `Authorization: Bearer SECRET`, or log in at /"
    )]
    NoToken,
    #[error("{0}")]
    NotAToken(String),
    #[error(
        "token {name:?} is a {role}: reading the cluster needs a viewer, operator or admin token"
    )]
    Forbidden { name: String, role: &'static str },
}

impl Refused {
    pub fn status(&self) -> StatusCode {
        match self {
            Refused::NoToken | Refused::NotAToken(_) => StatusCode::UNAUTHORIZED,
            Refused::Forbidden { .. } => StatusCode::FORBIDDEN,
        }
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let mut response = (self.status(), format!("{self}\n")).into_response();
        if self.status() == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer realm=\"keel\""),
            );
        }
        response
    }
}

/// The secret a request presents: its bearer token, else its cookie.
pub fn presented(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let cookie = || {
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().split_once('='))
            .find(|(name, _)| *name == TOKEN_COOKIE)
            .map(|(_, value)| value.trim())
    };
    bearer
        .or_else(cookie)
        .filter(|s| !s.is_empty() && s.len() <= SECRET_MAX_LEN)
}

/// Whether `secret` is a token of `acl`, unexpired at `now_ms`, that may
/// read the cluster; its name if so.
pub fn check(
    acl: &keel_state::acl::Acl,
    secret: Option<&str>,
    now_ms: u64,
) -> Result<String, Refused> {
    let secret = secret.ok_or(Refused::NoToken)?;
    let holder = crate::authz::token_role(acl, secret, now_ms).map_err(Refused::NotAToken)?;
    if scope(holder.role, Right::ReadCluster) != Scope::All {
        return Err(Refused::Forbidden {
            name: holder.name,
            role: holder.role.as_str(),
        });
    }
    Ok(holder.name)
}

/// The `Set-Cookie` value that keeps `secret` for this browser's session;
/// `None` for a secret a cookie cannot carry as it is (RFC 6265's
/// cookie-octets: no space, quote, comma, semicolon or backslash).
pub fn login_cookie(secret: &str, tls: bool) -> Option<String> {
    let octets = secret
        .bytes()
        .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b',' | b';' | b'\\'));
    (octets && !secret.is_empty()).then(|| {
        format!(
            "{TOKEN_COOKIE}={secret}; Path=/; HttpOnly; SameSite=Strict{}",
            if tls { "; Secure" } else { "" }
        )
    })
}

/// The `Set-Cookie` value that forgets it.
pub fn logout_cookie(tls: bool) -> String {
    format!(
        "{TOKEN_COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict{}",
        if tls { "; Secure" } else { "" }
    )
}

/// A login form's fields (`application/x-www-form-urlencoded`).
#[derive(Debug, serde::Deserialize)]
pub struct LoginForm {
    pub token: String,
}

/// The page a browser without a token gets: a form that logs in.
pub fn login_page(why: &Refused) -> Response {
    let why = match why {
        Refused::NoToken => String::new(),
        other => format!("<p class=\"why\">{}</p>", escape(&other.to_string())),
    };
    let page = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>Keel: log in</title><style>body{{font:14px system-ui,sans-serif;margin:4em auto;\
         max-width:28em}}input{{width:100%;font:inherit;padding:.4em;box-sizing:border-box}}\
         .why{{color:#a00}}</style></head><body><h1>Keel</h1>\
         <p>This cluster's console needs a token whose role may read the cluster (viewer, \
         operator or admin): <code>keel acl token create NAME --role viewer</code>.</p>{why}\
         <form method=\"post\" action=\"/login\"><label>Token <input name=\"token\" \
         type=\"password\" autocomplete=\"current-password\" autofocus></label>\
         <p><button type=\"submit\">Log in</button></p></form></body></html>"
    );
    (
        why_status(why.is_empty()),
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        page,
    )
        .into_response()
}

fn why_status(no_token: bool) -> StatusCode {
    if no_token {
        StatusCode::UNAUTHORIZED
    } else {
        StatusCode::FORBIDDEN
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::acl::{Role, SecretHash};
    use keel_state::{ClusterState, Command, LogEntry};

    fn acl_with(tokens: &[(&str, Role, &str)]) -> ClusterState {
        let mut state = ClusterState::new();
        let mut entries = vec![LogEntry::new(
            1,
            Command::bootstrap_acl(
                "root",
                SecretHash::of("root-secret-0123456789abcdefghijklmn"),
            ),
        )];
        for (name, role, secret) in tokens {
            entries.push(LogEntry::new(
                2,
                Command::create_token(*name, *role, SecretHash::of(secret), None),
            ));
        }
        for (i, e) in entries.iter().enumerate() {
            state.apply(i as u64 + 1, e).expect("applies");
        }
        state
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                header::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                v.parse().expect("value"),
            );
        }
        h
    }

    #[test]
    fn a_bearer_token_or_the_cookie_is_what_a_request_presents() {
        assert_eq!(
            presented(&headers(&[("authorization", "Bearer s3cret")])),
            Some("s3cret")
        );
        assert_eq!(
            presented(&headers(&[("cookie", "a=b; keel_token=s3cret; c=d")])),
            Some("s3cret")
        );
        assert_eq!(presented(&headers(&[("authorization", "Basic xyz")])), None);
        assert_eq!(presented(&headers(&[("cookie", "keel_token=")])), None);
        let long = "x".repeat(SECRET_MAX_LEN + 1);
        assert_eq!(
            presented(&headers(&[("authorization", &format!("Bearer {long}"))])),
            None
        );
    }

    #[test]
    fn only_a_known_token_that_may_read_the_cluster_passes() {
        let state = acl_with(&[
            (
                "viewer",
                Role::Viewer,
                "viewer-secret-0123456789abcdefghijkl",
            ),
            ("user", Role::User, "user-secret-0123456789abcdefghijklmno"),
        ]);
        let acl = state.acl();
        assert_eq!(
            check(acl, Some("viewer-secret-0123456789abcdefghijkl"), 10),
            Ok("viewer".to_string())
        );
        assert_eq!(
            check(acl, Some("root-secret-0123456789abcdefghijklmn"), 10),
            Ok("root".to_string())
        );
        let forbidden = check(acl, Some("user-secret-0123456789abcdefghijklmno"), 10);
        assert!(
            matches!(&forbidden, Err(Refused::Forbidden { role: "user", .. })),
            "{forbidden:?}"
        );
        assert_eq!(check(acl, None, 10), Err(Refused::NoToken));
        let unknown = check(acl, Some("not-a-secret"), 10).expect_err("refused");
        assert_eq!(unknown.status(), StatusCode::UNAUTHORIZED);
        assert!(
            unknown.to_string().contains("not one of this cluster's"),
            "{unknown}"
        );
    }

    #[test]
    fn the_login_cookie_is_http_only_and_strict() {
        let cookie = login_cookie("s3cret", true).expect("a cookie");
        assert!(cookie.starts_with("keel_token=s3cret;"), "{cookie}");
        for part in ["HttpOnly", "SameSite=Strict", "Secure", "Path=/"] {
            assert!(cookie.contains(part), "{cookie}");
        }
        assert!(!login_cookie("s3cret", false)
            .expect("a cookie")
            .contains("Secure"));
        for bad in ["a;b", "a b", "a\"b", ""] {
            assert_eq!(login_cookie(bad, false), None, "{bad:?}");
        }
        assert!(logout_cookie(false).contains("Max-Age=0"));
    }
}
