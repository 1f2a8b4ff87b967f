//! Repeated warnings and errors of the libraries Keel runs on, shown once a
//! window per place in their code.
//!
//! openraft logs an error at every failed heartbeat while a member is down
//! (twice a second) and a warning at every bootstrap. Keel says once what
//! is wrong and what to do (`raft_network`'s "a peer does not answer");
//! [`RepeatLimit`] keeps the library's own repeats from burying it: an event
//! at WARN or ERROR from one of `targets` passes if its call site has not
//! passed in the last `window`; others always pass.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_executors::book::{Clock, SystemClock};
use tracing::level_filters::LevelFilter;
use tracing::{Level, Metadata};
use tracing_subscriber::layer::{Context, Filter};

/// The server's log filter when `KEEL_LOG` is not set.
pub const DEFAULT_FILTER: &str = "info,openraft=warn,sled=warn,chunked_wal=warn,raft_log=warn";

/// The filter; see the module's documentation.
pub struct RepeatLimit {
    targets: Vec<&'static str>,
    window: Duration,
    clock: Arc<dyn Clock>,
    /// When each call site (file, line) last passed.
    last: Mutex<BTreeMap<(String, u32), Instant>>,
}

impl std::fmt::Debug for RepeatLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RepeatLimit")
            .field("targets", &self.targets)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

impl RepeatLimit {
    /// Limits the warnings and errors of `targets` (module path prefixes) to
    /// one per call site per `window`.
    pub fn new(targets: Vec<&'static str>, window: Duration) -> RepeatLimit {
        RepeatLimit::with_clock(targets, window, Arc::new(SystemClock))
    }

    /// The same, reading the time from `clock` (a test's).
    pub fn with_clock(
        targets: Vec<&'static str>,
        window: Duration,
        clock: Arc<dyn Clock>,
    ) -> RepeatLimit {
        RepeatLimit {
            targets,
            window,
            clock,
            last: Mutex::default(),
        }
    }

    /// Whether events of this call site are limited: warnings and errors
    /// of `targets`. Every other call site always passes.
    fn limits(&self, meta: &Metadata<'_>) -> bool {
        meta.is_event()
            && *meta.level() <= Level::WARN
            && self.targets.iter().any(|t| meta.target().starts_with(t))
    }

    fn passes(&self, meta: &Metadata<'_>) -> bool {
        if !self.limits(meta) {
            return true;
        }
        let key = (
            meta.file().unwrap_or(meta.target()).to_string(),
            meta.line().unwrap_or(0),
        );
        let now = self.clock.now();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match last.get(&key) {
            Some(t) if now.saturating_duration_since(*t) < self.window => false,
            _ => {
                last.insert(key, now);
                true
            }
        }
    }
}

impl<S> Filter<S> for RepeatLimit {
    fn enabled(&self, meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        self.passes(meta)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        // A limited call site is asked at every event: whether it passes
        // depends on the time. Every other one is left to the other
        // filters' interest: `sometimes` for all of them would make every
        // span and event of every library (openraft's, h2's, at any level)
        // be created and checked at run time (about 8 % of the replicas'
        // CPU in a profile of the write benchmark; BENCHMARKS.md).
        if self.limits(meta) {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::always()
        }
    }

    /// It turns nothing off by level. Without a hint, a filter `and`-ed
    /// with it has none either, so the process's most verbose level was
    /// TRACE whatever the other filter said: every `debug!` and `trace!`
    /// call site of every library past its level check, and every `log`
    /// record of sled's handed to the subscriber to refuse (about a tenth
    /// of the replicas' extra CPU per write; BENCHMARKS.md).
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::TRACE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_executors::book::ManualClock;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn failed_heartbeat() {
        tracing::error!(target: "openraft::replication", "Unreachable node");
    }

    #[test]
    fn a_librarys_repeated_errors_pass_once_a_window_and_keels_always() {
        let lines = Lines::default();
        let clock = Arc::new(ManualClock::new(0));
        let limit =
            RepeatLimit::with_clock(vec!["openraft"], Duration::from_secs(60), clock.clone());
        let writer = lines.clone();
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .with_filter(limit);
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..5 {
                failed_heartbeat();
                tracing::warn!(target: "keel::raft_network", "a peer does not answer");
                tracing::info!(target: "openraft::engine", "info passes");
            }
            clock.advance(Duration::from_secs(61));
            failed_heartbeat();
        });
        let text = String::from_utf8(lines.0.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .unwrap_or_default();
        assert_eq!(text.matches("Unreachable node").count(), 2, "{text}");
        assert_eq!(text.matches("a peer does not answer").count(), 5, "{text}");
        assert_eq!(text.matches("info passes").count(), 5, "{text}");
    }

    /// A call site of its own, for asking the filter's interest in it.
    macro_rules! callsite {
        ($name:ident, $target:expr, $level:expr, $kind:expr) => {
            struct $name;
            impl tracing::callsite::Callsite for $name {
                fn set_interest(&self, _: tracing::subscriber::Interest) {}
                fn metadata(&self) -> &Metadata<'_> {
                    static META: Metadata<'static> = Metadata::new(
                        stringify!($name),
                        $target,
                        $level,
                        None,
                        None,
                        None,
                        tracing::field::FieldSet::new(&[], tracing::callsite::Identifier(&$name)),
                        $kind,
                    );
                    &META
                }
            }
        };
    }
    callsite!(
        RaftWarning,
        "openraft::replication",
        Level::WARN,
        tracing::metadata::Kind::EVENT
    );
    callsite!(
        RaftDebug,
        "openraft::engine",
        Level::DEBUG,
        tracing::metadata::Kind::EVENT
    );
    callsite!(
        RaftSpan,
        "openraft::core",
        Level::WARN,
        tracing::metadata::Kind::SPAN
    );
    callsite!(
        KeelWarning,
        "keel::raft_network",
        Level::WARN,
        tracing::metadata::Kind::EVENT
    );

    /// The server's filter (the default, limited) keeps its most verbose
    /// level: INFO, not "unknown" (which made it TRACE for the process).
    #[test]
    fn the_limited_default_filter_says_its_most_verbose_level() {
        use tracing_subscriber::filter::FilterExt;
        let filter = tracing_subscriber::EnvFilter::new(DEFAULT_FILTER)
            .and(RepeatLimit::new(vec!["openraft"], Duration::from_secs(60)));
        assert_eq!(
            <_ as Filter<tracing_subscriber::Registry>>::max_level_hint(&filter),
            Some(LevelFilter::INFO)
        );
        let verbose = tracing_subscriber::EnvFilter::new("debug")
            .and(RepeatLimit::new(vec!["openraft"], Duration::from_secs(60)));
        assert_eq!(
            <_ as Filter<tracing_subscriber::Registry>>::max_level_hint(&verbose),
            Some(LevelFilter::DEBUG)
        );
    }

    /// Only the limited call sites are asked at every event; the others keep
    /// the other filters' static interest (a `sometimes` for every call site
    /// made every library span and event be built and checked at run time).
    #[test]
    fn only_a_librarys_warnings_and_errors_are_asked_at_every_event() {
        use tracing::callsite::Callsite;
        let limit = RepeatLimit::new(vec!["openraft"], Duration::from_secs(60));
        let interest = |cs: &'static dyn Callsite| {
            <RepeatLimit as Filter<tracing_subscriber::Registry>>::callsite_enabled(
                &limit,
                cs.metadata(),
            )
        };
        assert!(interest(&RaftWarning).is_sometimes());
        for cs in [&RaftDebug as &'static dyn Callsite, &RaftSpan, &KeelWarning] {
            assert!(interest(cs).is_always(), "{:?}", cs.metadata());
        }
    }
}
