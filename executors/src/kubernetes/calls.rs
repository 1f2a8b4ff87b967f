//! One call to the API server, bounded, and what its failure means.
//!
//! kube-rs's client retries 429, 503 and 504 by itself, with backoffs up
//! to minutes ([`client`] turns that off); a call awaited inside a
//! reconcile pass would then hold every other launch and stop. Here every
//! call has a deadline, and a failure is sorted into what the caller does
//! next: try again later (after the server's `Retry-After` when it gave
//! one), take it as a refusal, or look at what is already there.

use std::future::Future;
use std::time::Duration;

/// How a call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// It may succeed later: no answer within the deadline, no connection,
    /// 429 (too many requests), or a 5xx (a webhook that failed, etcd
    /// slow, a create persisted but answered 504). `retry_after`: what the
    /// server asked for.
    Transient {
        message: String,
        retry_after: Option<Duration>,
    },
    /// 409: the object exists (or changed meanwhile).
    Conflict(String),
    /// 404.
    NotFound,
    /// Any other 4xx: refused for good (a quota, a bad spec, RBAC).
    Refused { code: u16, message: String },
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Transient { message, .. } => write!(f, "{message}"),
            CallError::Conflict(m) => write!(f, "conflict: {m}"),
            CallError::NotFound => write!(f, "not found"),
            CallError::Refused { code, message } => write!(f, "{message} (HTTP {code})"),
        }
    }
}

impl CallError {
    /// What a kube-rs error means for the caller.
    pub fn of(e: kube::Error) -> CallError {
        match e {
            kube::Error::Api(status) => {
                let message = if status.reason.is_empty() {
                    status.message.clone()
                } else {
                    format!("{} ({})", status.message, status.reason)
                };
                match status.code {
                    404 => CallError::NotFound,
                    409 => CallError::Conflict(message),
                    429 | 500..=599 => CallError::Transient {
                        message,
                        retry_after: status
                            .details
                            .as_ref()
                            .map(|d| d.retry_after_seconds)
                            .filter(|s| *s > 0)
                            .map(|s| Duration::from_secs(u64::from(s))),
                    },
                    code => CallError::Refused { code, message },
                }
            }
            other => CallError::Transient {
                message: other.to_string(),
                retry_after: None,
            },
        }
    }
}

/// `call`, given up on after `deadline` (a transient failure).
pub async fn bounded<T>(
    deadline: Duration,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, CallError> {
    match tokio::time::timeout(deadline, call).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(CallError::of(e)),
        Err(_) => Err(CallError::Transient {
            message: format!(
                "no answer from the API server within {:.0} s",
                deadline.as_secs_f64()
            ),
            retry_after: None,
        }),
    }
}

/// How long to wait before attempt `attempt + 1` (0-based) of a call that
/// failed transiently: 0.5 s doubling to 30 s, or longer when the server
/// asked for longer (capped at 10 minutes).
pub fn retry_delay(attempt: u32, retry_after: Option<Duration>) -> Duration {
    let backoff = Duration::from_millis(500)
        .saturating_mul(1u32 << attempt.min(6))
        .min(Duration::from_secs(30));
    retry_after
        .map_or(backoff, |r| r.max(backoff))
        .min(Duration::from_secs(600))
}

/// A kube-rs client for `config` without the client's own retries (Keel
/// retries in the background, see the module's documentation).
pub fn client(mut config: kube::Config) -> Result<kube::Client, kube::Error> {
    config.default_retry = false;
    kube::Client::try_from(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, retry_after_seconds: u32) -> kube::Error {
        let mut status = kube::core::Status::failure("etcd is slow", "TooManyRequests");
        status.code = code;
        status.details =
            serde_json::from_value(serde_json::json!({ "retryAfterSeconds": retry_after_seconds }))
                .ok();
        kube::Error::Api(Box::new(status))
    }

    #[test]
    fn failures_are_sorted_by_what_the_caller_does_next() {
        assert_eq!(
            CallError::of(api(429, 7)),
            CallError::Transient {
                message: "etcd is slow (TooManyRequests)".into(),
                retry_after: Some(Duration::from_secs(7)),
            }
        );
        assert!(matches!(
            CallError::of(api(504, 0)),
            CallError::Transient {
                retry_after: None,
                ..
            }
        ));
        assert!(matches!(CallError::of(api(409, 0)), CallError::Conflict(_)));
        assert_eq!(CallError::of(api(404, 0)), CallError::NotFound);
        assert!(matches!(
            CallError::of(api(403, 0)),
            CallError::Refused { code: 403, .. }
        ));
    }

    #[test]
    fn retries_back_off_and_honour_the_server() {
        assert_eq!(retry_delay(0, None), Duration::from_millis(500));
        assert_eq!(retry_delay(3, None), Duration::from_secs(4));
        assert_eq!(retry_delay(20, None), Duration::from_secs(30));
        assert_eq!(
            retry_delay(0, Some(Duration::from_secs(12))),
            Duration::from_secs(12)
        );
        assert_eq!(
            retry_delay(0, Some(Duration::from_secs(86_400))),
            Duration::from_secs(600)
        );
    }
}
