//! Replication (`replication:`): propagation lag of the peers' load, corrections the
//! digests made (0 in steady state: each is a lost message), peers dropped, and
//! messages refused. No samples without replication.

use super::{counter, counters, gauge, ConstHistogram};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The replicas' shared load, once replication started.
pub struct ReplicationCollector(pub Option<Arc<crate::replication::Replication>>);

super::debug_as_name!(ReplicationCollector);

impl Collector for ReplicationCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let Some(replication) = self.0.as_ref() else {
            return Ok(());
        };
        let e = &mut encoder;
        let counters_now = replication.counters();
        let load = |n: &std::sync::atomic::AtomicU64| n.load(Ordering::Relaxed);
        let view = replication.view();
        let mut buckets: Vec<(f64, u64)> = crate::replication::LAG_BUCKETS_US
            .iter()
            .zip(&counters_now.lag_buckets)
            .map(|(us, n)| (*us as f64 / 1e6, load(n)))
            .collect();
        let count = load(&counters_now.lag_count);
        let below: u64 = buckets.iter().map(|(_, n)| n).sum();
        buckets.push((f64::INFINITY, count.saturating_sub(below)));
        let lag = ConstHistogram {
            sum: load(&counters_now.lag_sum_us) as f64 / 1e6,
            count,
            buckets,
        };
        lag.encode(e.encode_descriptor(
            "kvhint_replication_propagation_lag_seconds",
            "A peer's load change seen there to applied here (deltas; clocks of both hosts).",
            None,
            MetricType::Histogram,
        )?)?;
        counter(
            e,
            "kvhint_replication_digest_corrections",
            "Worker totals a peer's digest corrected (a message was lost; 0 in steady state).",
            view.stats.corrections,
        )?;
        counters(
            e,
            "kvhint_replication_peers_dropped",
            "Peers removed from the sums: silent past replication.peer_timeout_ms, said goodbye, or replaced by a restart under the same name.",
            [
                ([("reason", "silent")], view.stats.dropped_silent),
                ([("reason", "goodbye")], view.stats.left),
                ([("reason", "restarted")], view.stats.replaced),
            ],
        )?;
        counter(
            e,
            "kvhint_replication_refused",
            "Peer messages ignored because the peer uses another block size, names itself with more than 256 bytes, or is new while 256 peers are summed.",
            view.stats.refused_block_size + view.stats.refused_name + view.stats.refused_peers,
        )?;
        counter(
            e,
            "kvhint_replication_config_mismatches",
            "Peers heard with another config or plugin set (their load is summed; warned).",
            view.stats.fingerprint_mismatches,
        )?;
        gauge(
            e,
            "kvhint_replication_peers",
            "Peers whose load is summed now.",
            view.peers.len() as f64,
        )?;
        gauge(
            e,
            "kvhint_replication_connected",
            "1 while connected to NATS.",
            f64::from(u8::from(replication.connected())),
        )?;
        counters(
            e,
            "kvhint_replication_messages",
            "Messages published and received on the fleet's subject, and publishes dropped while NATS was away.",
            [
                ([("direction", "published")], load(&counters_now.published)),
                ([("direction", "received")], load(&counters_now.received)),
                ([("direction", "publish_failed")], load(&counters_now.publish_failures)),
            ],
        )?;
        counter(
            e,
            "kvhint_replication_disconnects",
            "Times the connection to NATS was lost.",
            load(&counters_now.disconnects),
        )?;
        counter(
            e,
            "kvhint_replication_decode_errors",
            "Messages on the fleet's subject that are not kvhint's (ignored; warned about once per 10 s at most).",
            load(&counters_now.decode_errors),
        )
    }
}
