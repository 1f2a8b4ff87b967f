//! A bound on the API requests one replica works on at once (issue 22,
//! item 5): one more is refused at once, `RESOURCE_EXHAUSTED` with the
//! reason `OVERLOADED`, instead of queueing until the replica runs out of
//! memory or its Raft heartbeats starve.
//!
//! Only the client API is bounded: the Raft service on the same port is
//! served beside it, outside this wrapper, so no client load can cost the
//! cluster its quorum. `ClusterStatus` (health checks, peers' bootstrap
//! questions) and `NodeHeartbeat` (a node that cannot report is marked
//! lost) are never refused here; event streams have their own bound
//! (`--max-event-streams`).
//!
//! Every request has a deadline too (`--request-timeout-s`, or the client's
//! own `grpc-timeout` if shorter, which tonic applies): one that waits
//! longer (for a quorum that is gone) is answered `DEADLINE_EXCEEDED`, and
//! its place comes back, so requests stuck on a partition cannot hold every
//! place until it heals. A write cut so may still be applied: the client
//! sends it again under its request id. `AddMember` (bounded by its own
//! catch-up timeout) and `WatchEvents` (whose answer is its stream) are
//! not cut.

use std::sync::Arc;

use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::codegen::http;

/// The most API requests one replica works on at once, unless
/// `--max-api-requests` says otherwise.
pub const MAX_API_REQUESTS: usize = 1024;

/// How long a request may take, unless `--request-timeout-s` says
/// otherwise.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The methods with a deadline of their own, never cut here.
const OWN_DEADLINE: [&str; 2] = [
    "/keel.api.v1.Keel/AddMember",
    "/keel.api.v1.Keel/WatchEvents",
];

/// The methods never refused for load.
const NEVER_SHED: [&str; 2] = [
    "/keel.api.v1.Keel/ClusterStatus",
    "/keel.api.v1.Keel/NodeHeartbeat",
];

/// Wraps the API service: a request holds one of `limit` permits until its
/// answer (for a stream, its first headers) is ready.
#[derive(Debug, Clone)]
pub struct Bounded<S> {
    pub inner: S,
    permits: Arc<Semaphore>,
    limit: usize,
    deadline: std::time::Duration,
}

impl<S> Bounded<S> {
    pub fn new(inner: S, limit: usize) -> Bounded<S> {
        Bounded {
            inner,
            permits: Arc::new(Semaphore::new(limit)),
            limit,
            deadline: REQUEST_TIMEOUT,
        }
    }

    /// Cuts a request that takes longer than `deadline`.
    pub fn with_deadline(mut self, deadline: std::time::Duration) -> Bounded<S> {
        self.deadline = deadline;
        self
    }
}

/// The answer to a request cut at its deadline.
pub fn timed_out(deadline: std::time::Duration) -> tonic::Status {
    crate::grpc_status::status_with_reason(
        tonic::Code::DeadlineExceeded,
        format!(
            "no answer within {} s (--request-timeout-s): a write may still be applied; \
             send it again with its request id",
            deadline.as_secs_f64()
        ),
        crate::grpc_status::reason::REQUEST_TIMEOUT,
        None,
        Default::default(),
    )
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Bounded<S> {
    const NAME: &'static str = S::NAME;
}

/// The refusal of one request over the bound.
pub fn overloaded(limit: usize) -> tonic::Status {
    crate::grpc_status::status_with_reason(
        tonic::Code::ResourceExhausted,
        format!(
            "this replica is working on {limit} requests, its limit (--max-api-requests); \
             nothing was done: retry later, or ask another replica"
        ),
        crate::grpc_status::reason::OVERLOADED,
        None,
        Default::default(),
    )
}

impl<S> tonic::codegen::Service<http::Request<Body>> for Bounded<S>
where
    S: tonic::codegen::Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = std::convert::Infallible,
    >,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let path = request.uri().path();
        let deadline = (!OWN_DEADLINE.contains(&path)).then_some(self.deadline);
        let permit = if NEVER_SHED.contains(&path) {
            None
        } else {
            match self.permits.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    let refused = overloaded(self.limit).into_http();
                    return Box::pin(async move { Ok(refused) });
                }
            }
        };
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = match deadline {
                Some(deadline) => match tokio::time::timeout(deadline, answer).await {
                    Ok(response) => response,
                    Err(_) => Ok(timed_out(deadline).into_http()),
                },
                None => answer.await,
            };
            drop(permit);
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::codegen::Service;

    /// A service that answers once given a permit (one per answer).
    #[derive(Clone)]
    struct Held(Arc<Semaphore>);

    impl Service<http::Request<Body>> for Held {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            let go = self.0.clone();
            Box::pin(async move {
                let _ = go.acquire().await.map(|p| p.forget());
                Ok(http::Response::new(Body::default()))
            })
        }
    }

    fn request(path: &str) -> http::Request<Body> {
        http::Request::builder()
            .uri(path)
            .body(Body::default())
            .expect("request")
    }

    fn grpc_status(response: &http::Response<Body>) -> Option<&[u8]> {
        response.headers().get("grpc-status").map(|v| v.as_bytes())
    }

    #[tokio::test]
    async fn a_request_over_the_bound_is_refused_at_once_and_health_never() {
        let go = Arc::new(Semaphore::new(0));
        let mut bounded = Bounded::new(Held(go.clone()), 1);
        let first = tokio::spawn(bounded.call(request("/keel.api.v1.Keel/ListJobs")));
        // Refused at once: the answer is ready without waiting.
        let refused =
            futures::FutureExt::now_or_never(bounded.call(request("/keel.api.v1.Keel/SubmitJob")))
                .expect("answered at once, not queued")
                .expect("infallible");
        assert_eq!(grpc_status(&refused), Some(&b"8"[..]), "RESOURCE_EXHAUSTED");
        let message = refused
            .headers()
            .get("grpc-message")
            .map(|m| String::from_utf8_lossy(m.as_bytes()).into_owned())
            .unwrap_or_default();
        assert!(message.contains("--max-api-requests"), "{message}");
        // Health and heartbeats pass the bound.
        let health = tokio::spawn(bounded.call(request("/keel.api.v1.Keel/ClusterStatus")));
        let beat = tokio::spawn(bounded.call(request("/keel.api.v1.Keel/NodeHeartbeat")));
        go.add_permits(3);
        for answered in [first, health, beat] {
            let response = answered.await.expect("task").expect("infallible");
            assert_eq!(grpc_status(&response), None, "answered by the service");
        }
        // The permit is back: the next request is served.
        let next = tokio::spawn(bounded.call(request("/keel.api.v1.Keel/ListJobs")));
        go.add_permits(1);
        let response = next.await.expect("task").expect("infallible");
        assert_eq!(grpc_status(&response), None);
    }

    /// On tokio's paused clock: the time passes without anyone waiting.
    #[tokio::test(start_paused = true)]
    async fn a_request_past_its_deadline_is_answered_and_frees_its_place() {
        let go = Arc::new(Semaphore::new(0));
        let deadline = std::time::Duration::from_secs(60);
        let mut bounded = Bounded::new(Held(go.clone()), 2).with_deadline(deadline);
        let stuck = tokio::spawn(bounded.call(request("/keel.api.v1.Keel/SubmitJob")));
        let member = tokio::spawn(bounded.call(request("/keel.api.v1.Keel/AddMember")));
        tokio::time::advance(deadline + std::time::Duration::from_secs(1)).await;
        let cut = stuck.await.expect("task").expect("infallible");
        assert_eq!(grpc_status(&cut), Some(&b"4"[..]), "DEADLINE_EXCEEDED");
        // Its place is back: the next request is not refused for load (it
        // is answered when the service answers).
        let next = tokio::spawn(bounded.call(request("/keel.api.v1.Keel/ListJobs")));
        go.add_permits(2);
        let response = next.await.expect("task").expect("infallible");
        assert_eq!(grpc_status(&response), None);
        // AddMember has a deadline of its own: not cut here.
        let response = member.await.expect("task").expect("infallible");
        assert_eq!(grpc_status(&response), None);
    }
}
