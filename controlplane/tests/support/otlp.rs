//! An OTLP/gRPC collector on 127.0.0.1 that keeps every span it receives
//! (issue 24, item 2): the `TraceService` of `opentelemetry-proto`, served
//! by tonic on its own runtime. Used by the trace test (`replication.rs`)
//! and the write benchmark's traced run.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;

/// One span as received: ids in hex, its name, and the
/// `service.instance.id` of the process that sent it.
#[derive(Debug, Clone)]
pub struct Received {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub name: String,
    pub instance: String,
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<Received>>>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let mut got = self.0.lock().expect("spans");
        for resource_spans in request.into_inner().resource_spans {
            let instance = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.instance.id")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    AnyValue::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                got.push(Received {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    name: span.name,
                    instance: instance.clone(),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

pub struct Collector {
    pub endpoint: String,
    spans: Sink,
    _runtime: tokio::runtime::Runtime,
}

impl Collector {
    pub fn start() -> Collector {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
        let spans = Sink::default();
        let service = TraceServiceServer::new(spans.clone());
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        Collector {
            endpoint,
            spans,
            _runtime: runtime,
        }
    }

    /// How many spans arrived.
    pub fn count(&self) -> usize {
        self.spans.0.lock().expect("spans").len()
    }

    pub fn spans(&self) -> Vec<Received> {
        self.spans.0.lock().expect("spans").clone()
    }
}
