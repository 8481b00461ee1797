"""The router's Prometheus metrics (GET /metrics on the HTTP port): request latencies as histograms, token and
request counters, and, read from the driver at scrape time, queue depth, routing decisions with their reasons,
the KV feed, and every replica's load as the router sees it. One registry per router (tests run several).

The KV transfer messages each replica's agents dropped (tandem_kv_messages_dropped, by replica and reason: a
peer sending forged, malformed or oversized messages shows here), and those they sent by reference to replicas
of the same host (tandem_kv_messages_by_reference), and what each replica's speculative decoding proposed and got
accepted (tandem_speculative_*, by proposer), come from the replicas' stats(): a scrape starts asking every replica
and shows what the previous one brought, so /metrics never waits on a replica and those counts are at most one
scrape old."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tandem.engine.core.kv_tiers import TierHitCosts, TierStats
from tandem.engine.decoding.speculation import SpeculationStats
from tandem.engine.heap import PAUSE_BUCKETS, GCPauses, gc_pauses
from tandem.kv_transfer.drops import MessageDrops
from tandem.replica.contract import ReplicaStats
from tandem.router.accounting import Accounting, Timings
from tandem.router.admission import AdmissionController
from tandem.router.lifecycle import RequestDriver
from tandem.router.pool_signals import PoolScaling
from tandem.router.routing import PREFILL_POOL

_log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
STATS_TIMEOUT_S = 5.0  # how long a scrape's refresh waits for one replica's stats()
LOOP_TICK_S = 0.05  # how often watch_loop() asks the event loop for a turn


class RouterMetrics:
    def __init__(self, driver: RequestDriver, active: Callable[[], int]):
        """active: how many requests the router is serving now."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_requests", "Finished requests by API and status code", ["api", "code"],
                                registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Arrival at the router to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("tandem_request_queue_seconds", "Waiting in a pool's queue, by pool (decode: at the "
                               "router for a decode replica with room; prefill: in the prefill replica's queue "
                               "before its first scheduling of the prompt)", ["pool"], buckets=LATENCY_BUCKETS,
                               registry=r)
        self.tpot = Histogram("tandem_time_per_output_token_seconds", "Per request: its first token to its last, "
                              "over the tokens after the first", buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("tandem_request_prefill_time_seconds", "The prefill call to the first token, "
                                      "by the pool that prefilled (prefill: KV transfer tail and decode admission "
                                      "included)", ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("tandem_request_decode_time_seconds", "First token to last",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_time = Histogram("tandem_kv_transfer_seconds", "The KV transfer's tail after the prefill "
                                       "replica sampled the first token (the rest overlaps prefill compute)",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_queries = Counter("tandem_prefix_cache_queries", "Prompt tokens of finished requests, by the "
                                      "pool that prefilled them", ["pool"], registry=r)
        self.prefix_hits = Counter("tandem_prefix_cache_hits", "Of those, the tokens found in a prefix cache",
                                   ["pool"], registry=r)
        self.structured = Counter("tandem_structured_output_requests", "Requests with a structured-output "
                                  "constraint, by outcome (ok; incomplete: max_tokens ended the output before the "
                                  "constraint was satisfied; invalid: refused, the schema, regex or grammar does "
                                  "not compile; failed: any other error)", ["outcome"], registry=r)
        self.decision = Histogram("tandem_routing_decision_seconds", "Routing one request (hashing included)",
                                  buckets=DECISION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("tandem_cached_prompt_tokens", "Prompt tokens served from a prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("tandem_completion_tokens", "Generated tokens", registry=r)
        self.auth_failures = Counter("tandem_auth_failures", "Calls refused for a missing or wrong API key",
                                     ["api"], registry=r)
        self.admission_refusals = Counter(
            "tandem_admission_refusals", "Requests refused at once because the cluster could not start them in "
            "time, by reason (max_queued, unmeasured, queue_timeout, slo)", ["reason"], registry=r)
        self.replica_counters = ReplicaCounters(driver)
        r.register(_DriverCollector(driver, active, self.replica_counters))
        driver.routing.observe = self.decision.observe
        self.scaling: dict[str, PoolScaling] = {}  # the control plane's last report (RouterActor.report_scaling)
        r.register(_ScalingCollector(lambda: self.scaling))
        self.loop_lag = Histogram("tandem_event_loop_lag_seconds", "How late the router's event loop ran a callback "
                                  f"due every {LOOP_TICK_S:g} s (a garbage collection or a blocking call stalls "
                                  "every request of the router)", buckets=PAUSE_BUCKETS, registry=r)
        r.register(_HeapCollector(gc_pauses()))  # the clock runs from now on, not from the first scrape
        self.loop_lag_longest = 0.0  # seconds: the longest lag watch_loop() has seen

    async def watch_loop(self, tick_s: float = LOOP_TICK_S) -> None:
        """Observes the event loop's lag until cancelled: each turn sleeps tick_s and records how much later than
        that it woke."""
        while True:
            due = time.monotonic() + tick_s
            await asyncio.sleep(tick_s)
            lag = max(0.0, time.monotonic() - due)
            self.loop_lag.observe(lag)
            self.loop_lag_longest = max(self.loop_lag_longest, lag)

    def watch_admission(self, admission: AdmissionController) -> None:
        """Exposes the admission controller's requests waiting to start and its start rate at scrape time."""
        self.registry.register(_AdmissionCollector(admission))

    def observe_gaps(self, gaps: list[float]) -> None:
        for gap in gaps:
            self.itl.observe(gap)

    def finished(self, api: str, code: str, account: Accounting | None, timings: Timings | None, *,
                 structured: bool = False) -> None:
        """One request ended with status `code` ("OK" or a gRPC status name). account and timings: a request
        that ran and succeeded (None otherwise). structured: it had a structured-output constraint."""
        self.requests.labels(api, code).inc()
        if structured:
            self.structured.labels("failed" if code != "OK" else
                                   "incomplete" if account is not None and account.cut_by_length else "ok").inc()
        if account is None or timings is None:
            return
        usage = account.usage()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        if usage.completion_tokens:
            self.ttft.observe(timings.ttft_s)
            self.decode_time.observe(max(0.0, timings.e2e_s - timings.ttft_s))
        if usage.completion_tokens > 1:
            self.tpot.observe(timings.mean_itl_s)
        self.e2e.observe(timings.e2e_s)
        self.queue.labels("decode").observe(timings.queue_s)
        if account.prefill_route:
            pool = "prefill" if account.prefill_route == PREFILL_POOL else "decode"
            self.prefill_time.labels(pool).observe(timings.prefill_s)
            self.prefix_queries.labels(pool).inc(usage.prompt_tokens)
            self.prefix_hits.labels(pool).inc(usage.cached_tokens)
            if pool == "prefill":
                self.queue.labels("prefill").observe(account.prefill_queue_s)
                self.transfer_time.observe(timings.transfer_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ReplicaCounters:
    """Counters of each replica as its stats() last said, by (pool, replica name): the KV transfer messages its
    agents dropped, by reason (counts: MessageDrops), those they sent by reference (by_reference), and what its
    speculative decoding proposed and got accepted (speculation, replicas that speculate only). A replica that
    does not answer keeps its last counts; one no longer routed to is left out."""

    def __init__(self, driver: RequestDriver, timeout_s: float = STATS_TIMEOUT_S):
        self.driver, self.timeout_s = driver, timeout_s
        self.counts: dict[tuple[str, str], MessageDrops] = {}
        self.by_reference: dict[tuple[str, str], int] = {}
        self.speculation: dict[tuple[str, str], SpeculationStats] = {}
        self.kv_tiers: dict[tuple[str, str], TierStats] = {}
        self.stats: dict[tuple[str, str], ReplicaStats] = {}  # each replica's last stats() in full
        self._refreshing: asyncio.Task | None = None

    async def refresh(self) -> None:
        """Asks every replica routed to for its stats (each for at most timeout_s), concurrently."""
        replicas = self.driver.replicas()
        answers = await asyncio.gather(*(asyncio.wait_for(r.api.stats(), self.timeout_s) for r in replicas),
                                       return_exceptions=True)
        counts, by_reference, speculation, tiers, stats = {}, {}, {}, {}, {}
        for replica, answer in zip(replicas, answers):
            key = (replica.pool, replica.name)
            if isinstance(answer, ReplicaStats):
                stats[key] = answer
                counts[key], by_reference[key] = answer.kv_messages_dropped, answer.kv_messages_by_reference
                if answer.speculation is not None:
                    speculation[key] = answer.speculation
                if answer.kv_tiers is not None:
                    tiers[key] = answer.kv_tiers
            else:
                _log.debug("stats of %s for /metrics failed: %r", replica.name, answer)
                if key in self.counts:
                    counts[key], by_reference[key] = self.counts[key], self.by_reference.get(key, 0)
                if key in self.speculation:
                    speculation[key] = self.speculation[key]
                if key in self.kv_tiers:
                    tiers[key] = self.kv_tiers[key]
                if key in self.stats:
                    stats[key] = self.stats[key]
        self.counts, self.by_reference, self.speculation, self.kv_tiers = counts, by_reference, speculation, tiers
        self.stats = stats

    def start_refresh(self) -> None:
        """Starts refresh() on the running event loop unless one is still running (no running loop: nothing)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = loop.create_task(self.refresh())

    @property
    def refreshing(self) -> asyncio.Task | None:
        """The refresh a scrape started last (done or not; None before the first)."""
        return self._refreshing


class _DriverCollector:
    """Reads the driver's live state at scrape time."""

    def __init__(self, driver: RequestDriver, active: Callable[[], int], counters: ReplicaCounters):
        self.driver, self.active, self.replica_counters = driver, active, counters

    def collect(self):
        d = self.driver
        self.replica_counters.start_refresh()
        dropped = CounterMetricFamily("tandem_kv_messages_dropped", "KV transfer messages a replica's agents "
                                      "dropped, by reason (forged, malformed, oversized, unknown_transfer, late); "
                                      "as of the previous scrape", labels=["pool", "replica", "reason"])
        for (pool, name), drops in sorted(self.replica_counters.counts.items()):
            for reason, count in drops.by_reason():
                dropped.add_metric([pool, name, reason], count)
        yield dropped
        by_reference = CounterMetricFamily("tandem_kv_messages_by_reference", "KV transfer data messages a "
                                           "replica's agents sent by reference to replicas of the same host (shared "
                                           "memory); as of the previous scrape", labels=["pool", "replica"])
        for (pool, name), count in sorted(self.replica_counters.by_reference.items()):
            by_reference.add_metric([pool, name], count)
        yield by_reference
        yield from _replica_stats_metrics(self.replica_counters.stats)
        yield from _speculation_metrics(self.replica_counters.speculation)
        yield from _kv_tier_metrics(self.replica_counters.kv_tiers,
                                    {(r.pool, r.name): r.load.tier_hit_costs for r in d.prefill + d.decode})
        yield _gauge("tandem_active_requests", "Requests being served", self.active())
        yield _gauge("tandem_queued_requests", "Requests waiting for a decode replica with room", d.num_queued)
        yield _gauge("tandem_waiting_for_prefill_requests", "Requests waiting at the router for a prefill replica "
                     "with fewer than router.prefill_queue_tokens queued (late binding)", d.num_waiting_prefill)
        replicas = GaugeMetricFamily("tandem_replicas", "Replicas routed to, by pool", labels=["pool"])
        for pool, members in (("prefill", d.prefill), ("decode", d.decode)):
            replicas.add_metric([pool], len(members))
        yield replicas
        lost = CounterMetricFamily("tandem_replicas_lost", "Replicas found dead and removed from their pool")
        lost.add_metric([], len(d.lost))
        yield lost
        decisions = CounterMetricFamily("tandem_prefill_decisions", "Where prompts were prefilled, and why",
                                        labels=["where", "reason"])
        for (where, reason), count in sorted(d.routing.decisions.items()):
            decisions.add_metric([where, reason], count)
        yield decisions
        pulls = CounterMetricFamily("tandem_prefix_pulls", "Prefixes a prefill replica pulled from a replica holding "
                                    "them instead of computing them, by outcome (pulled, no_room, failed)",
                                    labels=["outcome"])
        for outcome, count in sorted(d.pulls.outcomes.items()):
            pulls.add_metric([outcome], count)
        yield pulls
        pulled = CounterMetricFamily("tandem_prefix_pulled_blocks", "KV blocks those pulls moved")
        pulled.add_metric([], d.pulls.blocks_pulled)
        yield pulled
        yield _gauge("tandem_prefix_pull_cost", "What pulling a block costs against computing it, as measured "
                     "over the pulls so far (a prior before any)", d.pulls.pull_cost)
        feed = CounterMetricFamily("tandem_kv_feed", "The router's KV event feed: batches, events, snapshots "
                                                     "(resyncs), gaps and failed polls", labels=["kind"])
        for kind, count in vars(d.feed.counters).items():
            feed.add_metric([kind], count)
        yield feed
        indexed = GaugeMetricFamily("tandem_prefix_index_blocks", "Distinct block hashes in the router's index",
                                    labels=["pool"])
        for pool, index in d.routing.indexes.items():
            indexed.add_metric([pool], len(index))
        yield indexed
        in_flight = GaugeMetricFamily("tandem_replica_in_flight", "Requests in flight per replica",
                                      labels=["pool", "replica"])
        queued = GaugeMetricFamily("tandem_replica_queued_prefill_tokens", "Uncached prompt tokens sent to a "
                                   "prefill replica and not answered yet", labels=["replica"])
        free = GaugeMetricFamily("tandem_replica_kv_blocks_free", "Free KV blocks per replica (last poll)",
                                 labels=["pool", "replica"])
        for r in d.prefill + d.decode:
            in_flight.add_metric([r.pool, r.name], r.load.in_flight)
            if r.pool == "prefill":
                queued.add_metric([r.name], r.load.queued_prefill_tokens)
            if r.load.kv_blocks_free is not None:
                free.add_metric([r.pool, r.name], r.load.kv_blocks_free)
        yield in_flight
        yield queued
        yield free


class _ScalingCollector:
    """The pools' scaling as the control plane last reported it (RouterActor.report_scaling)."""

    def __init__(self, states: Callable[[], dict[str, PoolScaling]]):
        self.states = states

    def collect(self):
        replicas = GaugeMetricFamily("tandem_pool_replicas", "Replicas per pool by state (desired: what the "
                                     "autoscaler or a pin wants)", labels=["pool", "state"])
        decisions = CounterMetricFamily("tandem_scaling_decisions", "Scaling decisions that changed a pool",
                                        labels=["pool"])
        last = GaugeMetricFamily("tandem_scaling_last_decision", "1 for the last scaling decision of a pool, with "
                                 "its action and reason", labels=["pool", "action", "reason"])
        shortfall = GaugeMetricFamily("tandem_pool_shortfall_replicas", "Replicas a pool wanted that Ray could "
                                      "not place", labels=["pool"])
        for pool, state in sorted(self.states().items()):
            for name in ("desired", "ready", "pending", "draining"):
                replicas.add_metric([pool, name], getattr(state, name))
            decisions.add_metric([pool], state.decisions)
            shortfall.add_metric([pool], state.shortfall)
            if state.last_action:
                last.add_metric([pool, state.last_action, state.last_reason], 1)
        yield from (replicas, decisions, last, shortfall)


class _HeapCollector:
    """The router process's garbage collector (engine/heap.py): its pauses per generation, and the objects frozen
    at the router's start, which no collection scans."""

    def __init__(self, clock: GCPauses):
        self.clock = clock

    def collect(self):
        pauses = HistogramMetricFamily("tandem_gc_pause_seconds", "Garbage collection pauses of the router's "
                                       "process by generation (2: full); each holds every thread",
                                       labels=["generation"])
        for generation, p in sorted(self.clock.pauses().items()):
            buckets = [(f"{bound:g}", n) for bound, n in zip(PAUSE_BUCKETS, p.buckets)] + [("+Inf", p.count)]
            pauses.add_metric([str(generation)], buckets, p.seconds)
        yield pauses
        yield _gauge("tandem_gc_frozen_objects", "Objects frozen at the router's start (no collection scans them)",
                     gc.get_freeze_count())


class _AdmissionCollector:
    def __init__(self, admission: AdmissionController):
        self.admission = admission

    def collect(self):
        state = self.admission.state()
        yield _gauge("tandem_requests_waiting_to_start", "Admitted requests without a first token yet",
                     state.waiting)
        yield _gauge("tandem_start_rate", "First tokens per second while requests waited (0: not measured yet)",
                     state.start_rate or 0.0)


def _replica_stats_metrics(by_replica: dict[tuple[str, str], ReplicaStats]):
    """Each replica's engine and KV transfer counters from its last stats() (as of the previous scrape)."""
    preemptions = CounterMetricFamily("tandem_num_preemptions", "Requests a replica's scheduler preempted (their "
                                      "KV blocks freed, recomputed later)", labels=["pool", "replica"])
    kv_bytes = CounterMetricFamily("tandem_kv_transfer_bytes", "KV payload bytes a replica's agents sent or "
                                   "received (written into blocks)", labels=["pool", "replica", "direction"])
    hit_rate = GaugeMetricFamily("tandem_replica_prefix_hit_rate", "The fraction of prompt tokens a replica found "
                                 "in its prefix cache", labels=["pool", "replica"])
    for (pool, name), stats in sorted(by_replica.items()):
        preemptions.add_metric([pool, name], stats.num_preemptions)
        kv_bytes.add_metric([pool, name, "sent"], stats.kv_bytes_sent)
        kv_bytes.add_metric([pool, name, "received"], stats.kv_bytes_received)
        hit_rate.add_metric([pool, name], stats.prefix_hit_rate)
    yield from (preemptions, kv_bytes, hit_rate)


def _speculation_metrics(by_replica: dict[tuple[str, str], SpeculationStats]):
    """Speculative decoding per replica and proposer: tokens proposed and accepted, verified steps by the number of
    proposals accepted (a histogram: bucket le=n counts steps that accepted at most n), and steps where the cost
    model kept no proposal."""
    labels = ["pool", "replica", "proposer"]
    proposed = CounterMetricFamily("tandem_speculative_proposed_tokens", "Speculated tokens verified by the model; "
                                   "as of the previous scrape", labels=labels)
    accepted = CounterMetricFamily("tandem_speculative_accepted_tokens", "Speculated tokens the model accepted",
                                   labels=labels)
    declined = CounterMetricFamily("tandem_speculative_declined_steps", "Decode steps whose proposals the cost model "
                                   "dropped as not paying", labels=labels)
    lengths = HistogramMetricFamily("tandem_speculative_acceptance_length", "Proposals accepted per verified step",
                                    labels=labels)
    for (pool, name), s in sorted(by_replica.items()):
        values = [pool, name, s.proposer]
        proposed.add_metric(values, s.proposed)
        accepted.add_metric(values, s.accepted)
        declined.add_metric(values, s.declined_steps)
        cumulative, buckets = 0, []
        for length, count in enumerate(s.acceptance_counts):
            cumulative += count
            buckets.append((str(length), cumulative))
        lengths.add_metric(values, buckets + [("+Inf", cumulative)], sum_value=s.accepted)
    yield from (proposed, accepted, declined, lengths)


def _kv_tier_metrics(by_replica: dict[tuple[str, str], TierStats],
                     costs: dict[tuple[str, str], TierHitCosts] | None = None):
    """KV tiers per replica (engine/core/kv_tiers.py): prefix blocks served from each tier, blocks each tier holds
    and can hold, copies down, copies up and their seconds, disk copies that failed by reason (those blocks were
    recomputed), and what the router weighs a hit on each tier at (costs, by the replica's measurements)."""
    labels = ["pool", "replica", "tier"]
    hits = CounterMetricFamily("tandem_kv_tier_hit_blocks", "Prefix blocks a request got from a KV tier (host, "
                               "disk) instead of computing them; as of the previous scrape", labels=labels)
    used = GaugeMetricFamily("tandem_kv_tier_blocks", "KV blocks a tier holds", labels=labels)
    capacity = GaugeMetricFamily("tandem_kv_tier_capacity_blocks", "KV blocks a tier can hold", labels=labels)
    copies = CounterMetricFamily("tandem_kv_tier_copied_blocks", "Blocks copied down: device to host (saved), host "
                                 "to disk (spilled)", labels=["pool", "replica", "copy"])
    failures = CounterMetricFamily("tandem_kv_tier_failures", "Disk tier reads and writes that failed, by reason "
                                   "(missing, truncated, corrupt, write failed, ...): recomputed, never served",
                                   labels=["pool", "replica", "reason"])
    up = CounterMetricFamily("tandem_kv_tier_copied_up_bytes", "Bytes copied up from a tier: host to device (host), "
                             "disk to host (disk)", labels=labels)
    up_s = CounterMetricFamily("tandem_kv_tier_copied_up_seconds", "Seconds those copies took (their ratio is the "
                               "tier's measured bandwidth)", labels=labels)
    cost = GaugeMetricFamily("tandem_kv_tier_hit_cost", "What a prefix block found on a tier costs to bring up, as a "
                             "fraction of recomputing it: how the router weighs a hit there", labels=labels)
    for (pool, name), t in sorted(by_replica.items()):
        tiers = [("host", t.host_hits, t.host_blocks, t.host_capacity)]
        if t.disk_capacity:
            tiers.append(("disk", t.disk_hits, t.disk_blocks, t.disk_capacity))
        for tier, hit, blocks, slots in tiers:
            hits.add_metric([pool, name, tier], hit)
            used.add_metric([pool, name, tier], blocks)
            capacity.add_metric([pool, name, tier], slots)
        copies.add_metric([pool, name, "saved"], t.saved)
        copies.add_metric([pool, name, "spilled"], t.spilled)
        for reason, count in sorted(t.failures.items()):
            failures.add_metric([pool, name, reason], count)
        hit_costs = (costs or {}).get((pool, name))
        for tier, blocks, seconds, hit_cost in (("host", t.loaded_blocks, t.load_s, hit_costs and hit_costs.host),
                                                ("disk", t.read_blocks, t.read_s, hit_costs and hit_costs.disk)):
            if tier == "host" or t.disk_capacity:
                up.add_metric([pool, name, tier], blocks * t.block_bytes)
                up_s.add_metric([pool, name, tier], seconds)
                if hit_cost is not None:
                    cost.add_metric([pool, name, tier], hit_cost)
    yield from (hits, used, capacity, copies, failures, up, up_s, cost)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family
