//! Traces over OTLP (issue 24, item 2): `--otlp-endpoint`.
//!
//! A submission is one trace across processes: the CLI's span, the API's
//! span on the replica it reached (and on the leader it was forwarded to),
//! the WAL append and the apply of its entry on every replica, the leader's
//! decision that placed the job, the launch, and the first progress. The
//! context travels in the `traceparent` gRPC metadata between processes and
//! in the log entry from the proposal on
//! ([`keel_storage::trace_context`]), so a leader elected after the
//! submission joins the same trace.
//!
//! Only spans of the target [`keel_storage::trace_context::TARGET`] are
//! exported: the OpenTelemetry layer is filtered to it, and without
//! `--otlp-endpoint` no layer wants those spans, so they are never built.
//!
//! Sampling: a span under a sampled parent is sampled (the CLI samples
//! every command it traces); a trace that starts at a server (a request
//! without a `traceparent`) is sampled at `--trace-sample-ratio`. The
//! choice is made before the request's span exists: a request that is not
//! traced gets no span at all, not one built and dropped at the exporter.
//! An entry carries the context of a sampled trace only.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::Layer;

pub use keel_storage::trace_context::{
    current_trace_parent, join, parent_context, trace_parent_of, TARGET, TRACEPARENT_HEADER,
};

/// The share of the traces that start in this process that are kept (f64
/// bits; 0 until an export starts).
static ROOT_SHARE: AtomicU64 = AtomicU64::new(0);

/// How long a process waits at exit for its last spans to be exported.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum TracesError {
    #[error("--otlp-endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("--trace-sample-ratio must be between 0 and 1, not {0}")]
    SampleRatio(f64),
}

/// Which traces a process starts are sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// Every trace (a client command someone asked to trace).
    Always,
    /// This share of the traces that start here; a span under a parent
    /// follows the parent's choice.
    Ratio(f64),
}

impl Sampling {
    /// `--trace-sample-ratio`, checked.
    pub fn ratio(ratio: f64) -> Result<Sampling, TracesError> {
        if !(0.0..=1.0).contains(&ratio) {
            return Err(TracesError::SampleRatio(ratio));
        }
        Ok(Sampling::Ratio(ratio))
    }

    fn share(self) -> f64 {
        match self {
            Sampling::Always => 1.0,
            Sampling::Ratio(r) => r,
        }
    }
}

/// The layer a process adds to its subscriber to export its spans.
pub type TraceLayer = Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>;

/// A process's span export: the layer to install, and the provider to
/// flush before the process exits.
#[derive(Debug)]
pub struct TraceExport {
    provider: SdkTracerProvider,
}

impl TraceExport {
    /// Starts exporting to the OTLP/gRPC collector at `endpoint`
    /// (`http://HOST:4317`) as `service.name` "keel", `service.instance.id`
    /// `instance`. Must be called inside the Tokio runtime (the exporter's
    /// channel lives on it).
    pub fn start(
        endpoint: &str,
        sampling: Sampling,
        instance: &str,
    ) -> Result<(TraceExport, TraceLayer), TracesError> {
        let bad = |reason: String| TracesError::Endpoint {
            endpoint: endpoint.to_string(),
            reason,
        };
        let uri: tonic::codegen::http::Uri = endpoint
            .parse()
            .map_err(|e| bad(format!("not a URL ({e})")))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(bad("give http://HOST:PORT or https://HOST:PORT".into()));
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| bad(e.to_string()))?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("keel")
            .with_attribute(KeyValue::new("service.instance.id", instance.to_string()))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            // Roots are chosen before their span is made
            // ([`starts_trace`]); the exporter keeps what it is given.
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
            .with_resource(resource)
            .build();
        let layer = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("keel"))
            // Neither the busy/idle times of a span nor its code location
            // and thread: fewer clock reads and attributes per span.
            .with_tracked_inactivity(false)
            .with_location(false)
            .with_threads(false)
            .with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target(TARGET, tracing::Level::TRACE),
            );
        ROOT_SHARE.store(sampling.share().to_bits(), Ordering::Relaxed);
        Ok((TraceExport { provider }, Box::new(layer)))
    }

    /// Exports what is left and stops, waiting at most [`FLUSH_TIMEOUT`].
    pub async fn shutdown(self) {
        let provider = self.provider;
        // The batch processor's thread blocks until its export is done;
        // the export's connection is driven by this runtime.
        let done =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(FLUSH_TIMEOUT));
        if let Ok(Err(e)) = done.await {
            tracing::warn!(error = %e, "the last spans were not exported");
        }
    }
}

/// The trace id (32 hex digits) of a W3C `traceparent`, as a tracing
/// backend looks a trace up.
pub fn trace_id_of(trace_parent: &str) -> Option<String> {
    let cx = parent_context(trace_parent)?;
    Some(cx.span().span_context().trace_id().to_string())
}

/// Whether a trace that starts here (no parent) is kept: at the export's
/// share, drawn from the thread's generator.
pub fn starts_trace() -> bool {
    let share = f64::from_bits(ROOT_SHARE.load(Ordering::Relaxed));
    share >= 1.0 || (share > 0.0 && rand::random::<f64>() < share)
}

/// The span a gRPC request is served in: `keel.api.v1.Keel/METHOD`, a
/// child of the caller's `traceparent` when it sent a sampled one, a new
/// trace at the sampling share when it sent none; else no span (also
/// without `--otlp-endpoint`). A caller's unsampled trace stays unsampled.
pub fn api_span(path: &str, traceparent: Option<&str>) -> tracing::Span {
    if !tracing::enabled!(target: TARGET, tracing::Level::TRACE) {
        return tracing::Span::none();
    }
    let parent = traceparent.and_then(parent_context);
    let traced = match &parent {
        Some(cx) => cx.span().span_context().is_sampled(),
        None => starts_trace(),
    };
    if !traced {
        return tracing::Span::none();
    }
    let span = tracing::trace_span!(
        target: TARGET,
        "keel.api",
        otel.name = path.trim_start_matches('/'),
        otel.kind = "server",
        rpc.system = "grpc",
    );
    if let Some(cx) = parent {
        // Fails only for a span the layer does not hold.
        let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, cx);
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_trace_id_is_the_second_field_of_its_traceparent() {
        assert_eq!(
            trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(trace_id_of("garbage"), None);
    }

    #[test]
    fn a_sample_ratio_outside_zero_to_one_is_refused_naming_the_flag() {
        for bad in [-0.1, 1.5, f64::NAN] {
            let err = Sampling::ratio(bad).expect_err("refused");
            assert!(err.to_string().contains("--trace-sample-ratio"), "{err}");
        }
        assert_eq!(Sampling::ratio(0.01).ok(), Some(Sampling::Ratio(0.01)));
    }

    #[test]
    fn a_trace_starts_here_at_the_share_and_a_request_without_export_gets_no_span() {
        ROOT_SHARE.store(0.0f64.to_bits(), Ordering::Relaxed);
        assert!((0..1_000).all(|_| !starts_trace()));
        ROOT_SHARE.store(1.0f64.to_bits(), Ordering::Relaxed);
        assert!((0..1_000).all(|_| starts_trace()));
        ROOT_SHARE.store(0.5f64.to_bits(), Ordering::Relaxed);
        let kept = (0..10_000).filter(|_| starts_trace()).count();
        assert!((4_000..6_000).contains(&kept), "{kept} of 10,000 at 0.5");
        ROOT_SHARE.store(0.0f64.to_bits(), Ordering::Relaxed);
        // No layer wants the trace's spans here: none is built, sampled
        // parent or not.
        let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(api_span("/keel.api.v1.Keel/SubmitJob", Some(sampled)).is_disabled());
    }

    #[tokio::test]
    async fn an_endpoint_that_is_not_a_url_is_refused_naming_the_flag() {
        for bad in ["", "localhost:4317", "ftp://collector:4317", "http://"] {
            let err = TraceExport::start(bad, Sampling::Always, "test")
                .err()
                .expect("refused");
            assert!(err.to_string().contains("--otlp-endpoint"), "{bad}: {err}");
        }
    }
}
