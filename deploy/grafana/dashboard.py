"""The Grafana dashboard of a tandem cluster, built with Grafana's typed builders (grafana-foundation-sdk): where a
request's time goes (TTFT, TPOT, ITL, queue, prefill per pool, the KV transfer's tail, decode), the load and the
refusals, the prefix caches, the KV transfers, the pools and their autoscaling, and the router process's own health
(garbage collection pauses, event loop lag). Every query reads the router's /metrics (the Helm chart's
ServiceMonitor scrapes it); the Prometheus data source is a dashboard variable.

    .venv/bin/python deploy/grafana/dashboard.py     # writes tandem.json here and the Helm chart's copy

tests/deploy/test_grafana_dashboard.py checks both files are this script's output, that every query names only
metrics the router exports, and that the JSON loads as a Grafana dashboard model."""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as d
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions, VizTooltipOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (BigValueColorMode, BigValueGraphMode, LegendDisplayMode,
                                                  LegendPlacement, SortOrder, TooltipDisplayMode)
from grafana_foundation_sdk.models.dashboard import DataSourceRef

HERE = Path(__file__).resolve().parent
OUTPUTS = (HERE / "tandem.json", HERE.parent / "helm" / "tandem" / "dashboards" / "tandem.json")
SOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"


def _query(expr: str, legend: str, ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(SOURCE)


def _series(title: str, unit: str, description: str, *queries: tuple[str, str]) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(SOURCE).span(8).height(8)
             .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                     .show_legend(True))
             .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
             .line_width(1).fill_opacity(10))
    for ref, (expr, legend) in zip("ABCDEFGH", queries):
        panel = panel.with_target(_query(expr, legend, ref))
    return panel


def _quantiles(title: str, histogram: str, description: str, by: str = "") -> timeseries.Panel:
    """p50, p90 and p99 of a histogram (by: a label to split it by)."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return _series(title, "s", description, *(
        (f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket{RATE})))", f"p{round(q * 100)}{suffix}")
        for q in (0.5, 0.9, 0.99)))


def _stat(title: str, unit: str, expr: str, description: str) -> stat.Panel:
    return (stat.Panel().title(title).description(description).unit(unit).datasource(SOURCE).span(6).height(4)
            .graph_mode(BigValueGraphMode.AREA).color_mode(BigValueColorMode.VALUE)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"])).with_target(_query(expr, title)))


def build() -> d.Dashboard:
    return (
        d.Dashboard("tandem").uid("tandem-serving").tags(["tandem", "llm-serving"]).refresh("30s")
        .time("now-1h", "now").editable()
        .description("A tandem cluster, from its router's /metrics: latency, load, caches, KV transfers, pools.")
        .with_variable(d.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))

        .with_row(d.Row("Overview"))
        .with_panel(_stat("Requests/s", "reqps", f"sum(rate(tandem_requests_total{RATE}))",
                          "Requests that ended, any status"))
        .with_panel(_stat("Active", "short", "sum(tandem_active_requests)", "Requests being served now"))
        .with_panel(_stat("Tokens/s", "short", f"sum(rate(tandem_completion_tokens_total{RATE}))",
                          "Generated tokens per second"))
        .with_panel(_stat("Errors/s", "reqps", f'sum(rate(tandem_requests_total{{code!="OK"}}{RATE}))',
                          "Requests that ended with an error (refusals included)"))

        .with_row(d.Row("Latency"))
        .with_panel(_quantiles("Time to first token", "tandem_time_to_first_token_seconds",
                               "Arrival at the router to the first token"))
        .with_panel(_quantiles("Time per output token", "tandem_time_per_output_token_seconds",
                               "Per request: first token to last, over the tokens after the first"))
        .with_panel(_quantiles("Inter-token latency", "tandem_inter_token_latency_seconds",
                               "Time between a request's tokens"))
        .with_panel(_quantiles("End to end", "tandem_e2e_request_latency_seconds", "Arrival to the last token"))
        .with_panel(_quantiles("Queue by pool", "tandem_request_queue_seconds", "Waiting in a pool's queue (decode: at "
                               "the router for a decode replica with room; prefill: in the prefill replica's queue)",
                               by="pool"))
        .with_panel(_quantiles("Prefill by pool", "tandem_request_prefill_time_seconds",
                               "The prefill call to the first token, by the pool that prefilled", by="pool"))
        .with_panel(_quantiles("KV transfer tail", "tandem_kv_transfer_seconds",
                               "The KV transfer after the prefill replica sampled (the rest overlaps prefill)"))
        .with_panel(_quantiles("Decode", "tandem_request_decode_time_seconds", "First token to last"))
        .with_panel(_quantiles("Routing decision", "tandem_routing_decision_seconds",
                               "Routing one request, hashing included"))

        .with_row(d.Row("Load and refusals"))
        .with_panel(_series("Requests by status", "reqps", "Requests that ended, by gRPC status name",
                            (f"sum by (code) (rate(tandem_requests_total{RATE}))", "{{code}}")))
        .with_panel(_series("Waiting", "short", "Requests waiting at the router",
                            ("sum(tandem_queued_requests)", "for decode room"),
                            ("sum(tandem_requests_waiting_to_start)", "without a first token"),
                            ("sum(tandem_waiting_for_prefill_requests)", "for a prefill replica")))
        .with_panel(_series("Refusals", "reqps", "Requests refused at once, by reason",
                            (f"sum by (reason) (rate(tandem_admission_refusals_total{RATE}))", "{{reason}}"),
                            (f"sum by (api) (rate(tandem_auth_failures_total{RATE}))", "auth {{api}}")))
        .with_panel(_series("Structured output", "reqps", "Constrained requests by outcome",
                            (f"sum by (outcome) (rate(tandem_structured_output_requests_total{RATE}))",
                             "{{outcome}}")))
        .with_panel(_series("Preemptions", "short", "Requests a replica's scheduler preempted, per second",
                            (f"sum by (pool, replica) (rate(tandem_num_preemptions_total{RATE}))",
                             "{{pool}} {{replica}}")))
        .with_panel(_series("In flight per replica", "short", "Requests in flight on each replica",
                            ("sum by (pool, replica) (tandem_replica_in_flight)", "{{pool}} {{replica}}")))

        .with_row(d.Row("Prefix caches"))
        .with_panel(_series("Prefix hit rate by pool", "percentunit", "Prompt tokens found in a prefix cache",
                            (f"sum by (pool) (rate(tandem_prefix_cache_hits_total{RATE})) / sum by (pool) "
                             f"(rate(tandem_prefix_cache_queries_total{RATE}))", "{{pool}}")))
        .with_panel(_series("Replica hit rate", "percentunit", "Each replica's own prefix hit rate",
                            ("tandem_replica_prefix_hit_rate", "{{pool}} {{replica}}")))
        .with_panel(_series("Free KV blocks", "short", "Free KV blocks per replica (last poll)",
                            ("tandem_replica_kv_blocks_free", "{{pool}} {{replica}}")))

        .with_row(d.Row("KV transfer"))
        .with_panel(_series("KV bytes", "Bps", "KV payload bytes the replicas' agents sent and received",
                            (f"sum by (pool, direction) (rate(tandem_kv_transfer_bytes_total{RATE}))",
                             "{{pool}} {{direction}}")))
        .with_panel(_series("Messages dropped", "short", "KV messages dropped unread, by reason (forged: MAC)",
                            (f"sum by (reason) (rate(tandem_kv_messages_dropped_total{RATE}))", "{{reason}}")))
        .with_panel(_series("Where prompts were prefilled", "reqps", "Prefill decisions, by place and reason",
                            (f"sum by (where, reason) (rate(tandem_prefill_decisions_total{RATE}))",
                             "{{where}} {{reason}}")))

        .with_row(d.Row("Pools and autoscaling"))
        .with_panel(_series("Replicas", "short", "Replicas per pool by state (desired: what the autoscaler wants)",
                            ("sum by (pool, state) (tandem_pool_replicas)", "{{pool}} {{state}}")))
        .with_panel(_series("Scaling decisions", "short", "Decisions that changed a pool, and replicas Ray could "
                            "not place",
                            (f"sum by (pool) (increase(tandem_scaling_decisions_total{RATE}))", "{{pool}}"),
                            ("sum by (pool) (tandem_pool_shortfall_replicas)", "{{pool}} short")))
        .with_panel(_series("Replicas lost", "short", "Replicas found dead and removed",
                            ("sum(tandem_replicas_lost_total)", "lost")))

        .with_row(d.Row("Router process"))
        .with_panel(_quantiles("Event loop lag", "tandem_event_loop_lag_seconds",
                               "How late the router's event loop ran a callback due every 50 ms"))
        .with_panel(_series("Garbage collection", "s", "Seconds per second the collector held the router's "
                            "threads, by generation (2: full)",
                            (f"sum by (generation) (rate(tandem_gc_pause_seconds_sum{RATE}))", "gen {{generation}}")))
        .with_panel(_series("Frozen objects", "short", "Objects frozen at the router's start",
                            ("tandem_gc_frozen_objects", "frozen")))
    )


def render() -> str:
    """The dashboard's JSON text, as the files hold it."""
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> None:
    text = render()
    for path in OUTPUTS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
