//! A write's trace context, as its log entry carries it (issue 24).
//!
//! An entry's `trace_parent` is the W3C `traceparent` of the API span that
//! proposed it ([`keel_state::command::LogEntry::trace_parent`]). Every
//! replica that writes, applies or acts on the entry opens its span under
//! that context, so one submission is one trace across processes and
//! across a change of leader: the context is in the log, not in a
//! process's memory.
//!
//! The spans are `tracing` spans of the target [`TARGET`] at `TRACE`
//! level. Only the OpenTelemetry layer a replica installs with
//! `--otlp-endpoint` wants them, so without it they are never built
//! ([`tracing::Span::none`]) and nothing here costs more than the check
//! that a field is `None`.
//!
//! Invariant: nothing here changes the state or the log; a context that
//! does not parse is ignored, as W3C Trace Context asks of a receiver.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The `tracing` target of the spans that make up a write's trace. The
/// OpenTelemetry layer is filtered to it; the log's own filter leaves it
/// out unless asked for at `TRACE`.
pub const TARGET: &str = "keel_trace";

/// The W3C header (and gRPC metadata key) that carries a trace context.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// The OpenTelemetry context `trace_parent` names, when it parses as a W3C
/// `traceparent` with a valid trace and span id.
pub fn parent_context(trace_parent: &str) -> Option<opentelemetry::Context> {
    let carrier = HashMap::from([(TRACEPARENT_HEADER.to_string(), trace_parent.to_string())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// Puts `span` in the trace `trace_parent` names, as a child of that span.
/// Nothing happens to a span that is not built (no layer wants it) or to a
/// context that does not parse.
pub fn join(span: &tracing::Span, trace_parent: &str) {
    if span.is_disabled() {
        return;
    }
    if let Some(cx) = parent_context(trace_parent) {
        // Fails only for a span the layer does not hold: nothing to join.
        let _ = span.set_parent(cx);
    }
}

/// The `traceparent` of `span`, for an entry or a request to carry, when
/// its trace is sampled (an unsampled trace is never exported, so its
/// context is not worth a byte of the log).
pub fn trace_parent_of(span: &tracing::Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let span_context = cx.span().span_context().clone();
    if !span_context.is_valid() || !span_context.is_sampled() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier
        .remove(TRACEPARENT_HEADER)
        .filter(|t| t.len() <= keel_state::command::TRACE_PARENT_MAX_LEN)
}

/// The trace context of the span the caller is in ([`trace_parent_of`]).
pub fn current_trace_parent() -> Option<String> {
    trace_parent_of(&tracing::Span::current())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_w3c_traceparent_parses_and_anything_else_is_ignored() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = parent_context(good).expect("a valid traceparent");
        let span_context = cx.span().span_context().clone();
        assert_eq!(
            span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!(span_context.is_sampled() && span_context.is_remote());
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "not a trace",
        ] {
            assert!(parent_context(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn without_a_layer_spans_carry_no_context() {
        let span = tracing::trace_span!(target: TARGET, "keel.test");
        join(
            &span,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        assert_eq!(trace_parent_of(&span), None);
    }
}
