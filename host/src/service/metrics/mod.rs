//! `/metrics`: a `prometheus_client` registry of collectors that read, at scrape
//! time, the counters the router already keeps.
//!
//! Counting and rendering are apart so the booking path stays lock-free. Everything
//! a booking counts is a plain atomic in the struct that owns the figure: the
//! service's own in [`Metrics`] (action types and error codes in a lock-free
//! [`labels::LabelCounts`]), the policies' in [`crate::hints::PolicyStats`] and
//! [`crate::selection::SelectionStats`] (per-thread counters and histograms), the
//! engine subscriptions', the gateway's and the replication's in theirs. A
//! prometheus-client metric (a `Family` is a map behind a `RwLock`; its `Histogram`
//! a mutex) on that path would put a lock on every booking. Instead each scrape
//! assembles a [`Registry`] of one `Collector` per job (a submodule each:
//! [`service`], [`policies`], [`engine_events`], [`gateway`], [`replication`]) that
//! loads the atomics and encodes them as const counters, gauges and histograms.
//!
//! The format follows the scraper's `Accept` header: OpenMetrics 1.0 when it asks for
//! it (Prometheus does), else Prometheus text 0.0.4 (curl, older scrapers). Both come
//! from the same registry, with the same metric names, labels and values; counter
//! families are registered without their `_total`, which the encoder appends.

mod engine_events;
mod gateway;
pub mod labels;
mod policies;
mod replication;
mod service;

pub use engine_events::SourceCollector;
pub use gateway::GatewayCollector;
pub use policies::PolicyCollector;
pub use replication::ReplicationCollector;
pub use service::{BookingCollector, Metrics, StateCollector};

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::encoding::{LabelSetEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::fmt;

/// The OpenMetrics text format's content type.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The Prometheus text format's (0.0.4) content type.
pub const PROMETHEUS_TEXT: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Whether a scraper's `Accept` header asks for OpenMetrics.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|accept| {
        accept.split(',').any(|range| {
            let mut parts = range.split(';').map(str::trim);
            let asks = parts
                .next()
                .is_some_and(|media| media.eq_ignore_ascii_case("application/openmetrics-text"));
            // `q=0` means "not this one".
            asks && !parts.any(|p| p.replace(' ', "").eq_ignore_ascii_case("q=0"))
        })
    })
}

/// Renders `registry` in OpenMetrics (`openmetrics`) or Prometheus text: the text
/// and its content type.
pub fn encode(registry: &Registry, openmetrics: bool) -> (&'static str, String) {
    let mut text = String::new();
    let written = if openmetrics {
        prometheus_client::encoding::text::encode(&mut text, registry)
    } else {
        prometheus_client::encoding::prometheus_text::encode(&mut text, registry)
    };
    if let Err(error) = written {
        // Writing into a String fails only if a collector returned an error.
        tracing::warn!(%error, "rendering /metrics failed; the text is cut short");
    }
    (
        if openmetrics {
            OPENMETRICS
        } else {
            PROMETHEUS_TEXT
        },
        text,
    )
}

/// A worker's labels, `worker_id` then `dp_rank`.
pub(crate) struct WorkerLabels(pub crate::domain::WorkerKey);

impl EncodeLabelSet for WorkerLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> fmt::Result {
        use prometheus_client::encoding::EncodeLabel;
        ("worker_id", self.0.worker_id).encode(encoder.encode_label())?;
        ("dp_rank", self.0.dp_rank).encode(encoder.encode_label())
    }
}

/// One counter family; `name` without `_total` (the encoder appends it).
fn counters<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in samples {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// One counter without labels; `name` without `_total`.
fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> fmt::Result {
    let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(value).encode(family)
}

/// One counter of seconds (a fraction) without labels; `name` without `_total`.
fn float_counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> fmt::Result {
    let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(value).encode(family)
}

/// A gauge's value: whole numbers as integers (`1`, not `1.0`), as the text had them
/// before it went through the crate.
fn gauge_value(encoder: prometheus_client::encoding::MetricEncoder, value: f64) -> fmt::Result {
    if value.fract() == 0.0 && value.abs() < 9.0e15 {
        ConstGauge::new(value as i64).encode(encoder)
    } else {
        ConstGauge::new(value).encode(encoder)
    }
}

/// One gauge family.
fn gauges<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, f64)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        gauge_value(family.encode_family(&labels)?, value)?;
    }
    Ok(())
}

/// One gauge without labels.
fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: f64) -> fmt::Result {
    let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    gauge_value(family, value)
}

/// A histogram's figures as the encoder takes them: each bucket's own count (not
/// cumulative) by upper bound, the last bound `+Inf`.
pub(crate) struct ConstHistogram {
    pub sum: f64,
    pub count: u64,
    pub buckets: Vec<(f64, u64)>,
}

impl ConstHistogram {
    /// From cumulative counts per bound (the total count separately): what the
    /// router's histograms keep.
    fn from_cumulative(bounds: &[f64], cumulative: &[u64], count: u64, sum: f64) -> Self {
        let mut below = 0;
        let mut buckets: Vec<(f64, u64)> = bounds
            .iter()
            .zip(cumulative)
            .map(|(bound, &upto)| {
                let own = upto.saturating_sub(below);
                below = below.max(upto);
                (*bound, own)
            })
            .collect();
        buckets.push((f64::INFINITY, count.saturating_sub(below)));
        Self {
            sum,
            count,
            buckets,
        }
    }

    /// A [`crate::counters::LatencyHistogram`]'s figures (bounds in µs; seconds out).
    fn latency(histogram: &crate::counters::LatencyHistogram) -> Self {
        let bounds = crate::hints::LATENCY_BUCKETS_US.map(|us| us / 1e6);
        let cumulative = histogram.cumulative();
        let count = cumulative.last().copied().unwrap_or(0);
        Self::from_cumulative(&bounds, &cumulative, count, histogram.sum_seconds())
    }
}

impl EncodeMetric for ConstHistogram {
    fn encode(&self, mut encoder: prometheus_client::encoding::MetricEncoder) -> fmt::Result {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// One histogram family.
fn histograms<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, ConstHistogram)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, histogram) in samples {
        histogram.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Collectors hold the app; `Collector` asks for `Debug`.
macro_rules! debug_as_name {
    ($($collector:ty),*) => {$(
        impl std::fmt::Debug for $collector {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(stringify!($collector))
            }
        }
    )*};
}
pub(crate) use debug_as_name;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_is_served_to_the_scrapers_that_ask_for_it() {
        // What Prometheus 2.x/3.x sends by default.
        let prometheus = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(Some("text/plain; version=0.0.4")));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text; q=0"
        )));
    }

    #[test]
    fn a_histogram_from_cumulative_counts_has_each_buckets_own_count_and_inf() {
        let h = ConstHistogram::from_cumulative(&[0.1, 1.0], &[2, 5], 6, 3.5);
        assert_eq!(h.buckets, vec![(0.1, 2), (1.0, 3), (f64::INFINITY, 1)]);
        assert_eq!((h.count, h.sum), (6, 3.5));
    }
}
