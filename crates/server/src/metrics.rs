//! Prometheus metrics, rendered as text on `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    pub node: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    pub status: u16,
}

/// Routing outcomes, as label values of `forkless_route_total`.
pub mod outcome {
    pub const LOCAL: &str = "owned_locally";
    pub const FORWARDED_OK: &str = "forwarded_ok";
    pub const FORWARD_FAILED: &str = "forward_failed";
    pub const NOT_OWNER: &str = "not_owner";
    pub const FAIL_CLOSED: &str = "fail_closed";
    pub const REFUSED_HOP_HEADER: &str = "refused_hop_header";
}

pub struct Metrics {
    registry: Registry,
    pub route: Family<OutcomeLabel, Counter>,
    pub forward_seconds: Histogram,
    pub events_appended: Counter,
    pub executions_started: Counter,
    pub responses: Family<StatusLabel, Counter>,
    pub peer_up: Family<NodeLabel, Gauge>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("forkless");
        let route = Family::<OutcomeLabel, Counter>::default();
        registry.register("route", "Requests by routing outcome", route.clone());
        let forward_seconds = Histogram::new([
            0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0,
        ]);
        registry.register(
            "forward_seconds",
            "Latency of forwards to the owner",
            forward_seconds.clone(),
        );
        let events_appended = Counter::default();
        registry.register(
            "events_appended",
            "Events durably appended on this node",
            events_appended.clone(),
        );
        let executions_started = Counter::default();
        registry.register(
            "executions_started",
            "Executions created on this node",
            executions_started.clone(),
        );
        let responses = Family::<StatusLabel, Counter>::default();
        registry.register(
            "responses",
            "API responses by status code",
            responses.clone(),
        );
        let peer_up = Family::<NodeLabel, Gauge>::default();
        registry.register(
            "peer_up",
            "1 if the peer answered its last probe",
            peer_up.clone(),
        );
        Metrics {
            registry,
            route,
            forward_seconds,
            events_appended,
            executions_started,
            responses,
            peer_up,
        }
    }

    pub fn outcome(&self, outcome: &'static str) {
        self.route.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
