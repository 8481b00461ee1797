"""`tandem plan`: which deployment to run, chosen by simulation from profiled costs (DistServe's method; NVIDIA
Dynamo's planner answers the same question from its profiler's data). Given profiles (cluster/hardware_profile.py,
written by `tandem profile`), a workload at a rate (as `tandem bench` describes one, or a trace), an SLO and a
hardware budget (cores or GPUs), it enumerates the deployments the profiles offer within the budget:

- colocated: as many replicas of a colocated profile's pool as fit;
- disaggregated: every prefill:decode split of a disaggregated profile's two pools that fits (searched coarse to
  fine when there are many), each pool priced by its own profile;
- batch limits: the profiled max_num_seqs and max_num_batched_tokens, then halved and doubled chunk sizes and a
  halved sequence cap for the best shapes;

predicts each one's TTFT, ITL and goodput by running the workload's own requests through the router's real request
driver over mock replicas priced by the profile, on virtual time (cluster/simulation.py), and ranks them: most
requests predicted within the SLO first (goodput at the asked rate), then the least SLO pressure (the largest of
TTFT p90 / ttft, ITL p99 / itl_p99, ..., then the next), then the fewest units. manifest_text writes the best as a
manifest (the profile's own, its replica counts and limits changed) with its predicted figures and the runners-up
as comments.

What it does not see: anything the mock replicas do not model (KV capacity beyond max_num_seqs, preemption, the
router's and the network's own time, other processes on the machine, a KV transfer hidden behind the prefill's
later layers: the mock starts it when the prefill ends), and the profile's fit error (decode_error,
prefill_error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import yaml

from tandem.bench.loadgen.stats import SLO
from tandem.bench.loadgen.workloads import Conversation
from tandem.cluster.hardware_profile import PoolProfile, Profile
from tandem.cluster.simulation import Shape, simulate
from tandem.router.mocks.batching import StepCosts

COARSE = 8  # prefill:decode splits tried at first; the best one's neighbours are then refined
RUNNERS_UP = 5


def pool_units(pool: PoolProfile) -> int:
    """What one replica of the pool takes from the budget: its GPUs (tp x pp x ep) or its CPU threads."""
    layout = pool.layout
    return layout.tp * layout.pp * layout.ep if layout.device.startswith("cuda") else layout.threads


def budget_unit(profiles: Sequence[Profile]) -> str:
    """"GPUs" or "cores"; raises ValueError when the profiles mix devices (their units do not add up)."""
    kinds = {"GPUs" if p.layout.device.startswith("cuda") else "cores" for prof in profiles
             for p in prof.pools.values()}
    if len(kinds) != 1:
        raise ValueError("the profiles mix GPU and CPU pools: plan each kind of hardware on its own")
    return kinds.pop()


def _pools(profile: Profile) -> dict[str, str]:
    """Role -> the profile's pool that plays it (prefill, decode; colocated: decode alone)."""
    if profile.mode == "colocated":
        if len(profile.pools) != 1:
            raise ValueError(f"a colocated profile must hold one pool, {profile.manifest}'s holds "
                             f"{', '.join(profile.pools)}")
        return {"decode": next(iter(profile.pools))}
    missing = {"prefill", "decode"} - profile.pools.keys()
    if missing:
        raise ValueError(f"the disaggregated profile of {profile.manifest} has no {' or '.join(sorted(missing))} "
                         f"pool: profile both pools (tandem profile without --pools)")
    return {"prefill": "prefill", "decode": "decode"}


@dataclass(frozen=True)
class Option:
    """One deployment the planner may choose: a shape over a profile's pools, with these batch limits (every
    pool's) and the units of the budget it takes."""

    profile: Profile
    shape: Shape
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def pools(self) -> dict[str, str]:
        return _pools(self.profile)

    @property
    def units(self) -> int:
        pools = self.pools
        return sum(getattr(self.shape, role) * pool_units(self.profile.pool(name)) for role, name in pools.items())

    @property
    def key(self) -> tuple:
        return id(self.profile), self.shape, self.max_num_seqs, self.max_num_batched_tokens

    def costs(self) -> dict[str, StepCosts]:
        return {role: replace(self.profile.step_costs(name, max_num_seqs=self.max_num_seqs),
                              max_num_batched_tokens=self.max_num_batched_tokens)
                for role, name in self.pools.items()}

    def describe(self) -> str:
        return (f"{self.shape.describe()}, max_num_seqs {self.max_num_seqs}, max_num_batched_tokens "
                f"{self.max_num_batched_tokens}")


@dataclass(frozen=True)
class Prediction:
    option: Option
    summary: dict  # the load generator's summary of the simulated run (bench/loadgen/stats.py)
    slo: SLO = field(default_factory=SLO)

    @property
    def goodput(self) -> float:
        return self.summary["goodput_rps"]

    def pressures(self) -> list[float]:
        """Each latency over its SLO (p90 of TTFT, TPOT and E2E; p99 and max of ITL), largest first; without an
        SLO, TTFT p90 in seconds. [inf] when nothing completed."""
        s = self.summary
        pairs = [(s["ttft_ms"]["p90"], self.slo.ttft), (s["tpot_ms"]["p90"], self.slo.tpot),
                 (s["itl_ms"]["p99"], self.slo.itl_p99), (s["itl_ms"]["max"], self.slo.itl_max),
                 (s["e2e_ms"]["p90"], self.slo.e2e)]
        if not self.slo:
            pairs = [(s["ttft_ms"]["p90"], 1.0)]
        ratios = [ms / 1000 / limit for ms, limit in pairs if limit is not None and ms is not None]
        return sorted(ratios, reverse=True) if ratios else [math.inf]

    def rank(self) -> tuple:
        """Most requests within the SLO (goodput at the asked rate, without the run's length in it: a run that ends
        sooner would otherwise count as more goodput), then the least SLO pressure (the largest latency over its
        limit, then the next), then the fewest units."""
        return (-round(self.summary["slo_attainment"], 9), tuple(round(r, 4) for r in self.pressures()),
                self.option.units)

    def figures(self) -> dict:
        """The predicted figures, JSON-ready."""
        s = self.summary
        return {"deployment": self.option.describe(), "mode": self.option.shape.mode,
                "prefill_replicas": self.option.shape.prefill, "decode_replicas": self.option.shape.decode,
                "max_num_seqs": self.option.max_num_seqs,
                "max_num_batched_tokens": self.option.max_num_batched_tokens, "units": self.option.units,
                "profile": self.option.profile.manifest, "ttft_p90_ms": s["ttft_ms"]["p90"],
                "itl_p99_ms": s["itl_ms"]["p99"], "tpot_p90_ms": s["tpot_ms"]["p90"],
                "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
                "completed": s["completed"], "requests": s["requests"]}


def _splits(profile: Profile, budget: int) -> list[int]:
    """Every prefill replica count of the disaggregated profile that leaves room for one decode replica."""
    up, ud = (pool_units(profile.pool(n)) for n in ("prefill", "decode"))
    return list(range(1, (budget - ud) // up + 1))


def _shape(profile: Profile, budget: int, prefill: int = 0) -> Shape:
    """The shape that spends the budget: colocated, as many replicas as fit; disaggregated, `prefill` prefill
    replicas and as many decode replicas as the rest holds."""
    pools = _pools(profile)
    if profile.mode == "colocated":
        return Shape("colocated", 0, budget // pool_units(profile.pool(pools["decode"])))
    left = budget - prefill * pool_units(profile.pool("prefill"))
    return Shape("disaggregated", prefill, left // pool_units(profile.pool("decode")))


def _coarse(values: list[int], count: int) -> list[int]:
    if len(values) <= count:
        return values
    return sorted({values[round(i * (len(values) - 1) / (count - 1))] for i in range(count)})


@dataclass
class Planner:
    """profiles: those to choose among; conversations: the workload's requests with their due times (what
    `tandem bench` would send); rate: its asked rate; budget: units (budget_unit) the deployment may take.
    say: progress lines."""

    profiles: Sequence[Profile]
    conversations: Sequence[Conversation]
    rate: float | None
    slo: SLO
    budget: int
    say: Callable[[str], None] = lambda line: None
    predictions: dict = field(default_factory=dict)  # Option.key -> Prediction

    def __post_init__(self) -> None:
        budget_unit(self.profiles)
        if self.budget < 1:
            raise ValueError(f"the budget must be at least 1, got {self.budget}")
        for profile in self.profiles:
            _pools(profile)
        if any(r.prompt_ids is None for c in self.conversations for r in c.requests):
            raise ValueError("the planner simulates token-id prompts: the sessions workload sends chat messages "
                             "(plan with synthetic, shared-prefix, long-mix or a trace)")

    def predict(self, option: Option) -> Prediction:
        if option.key not in self.predictions:
            settings = _driver_settings(option.profile)
            summary = simulate(option.shape, option.costs(), self.conversations, self.slo, settings=settings,
                               asked_rate=self.rate)
            self.predictions[option.key] = prediction = Prediction(option, summary, self.slo)
            self.say(f"  {option.describe()} ({option.units}): TTFT p90 {format_ms(summary['ttft_ms']['p90'])}, "
                     f"ITL p99 {format_ms(summary['itl_ms']['p99'])}, goodput {prediction.goodput:.3f} req/s "
                     f"({100 * summary['slo_attainment']:.0f}%)")
        return self.predictions[option.key]

    def _base(self, profile: Profile, shape: Shape) -> Option:
        pool = profile.pool(_pools(profile)["decode"])
        return Option(profile, shape, pool.max_num_seqs, pool.max_num_batched_tokens)

    def _fits(self, profile: Profile) -> bool:
        units = [pool_units(profile.pool(name)) for name in _pools(profile).values()]
        return sum(units) <= self.budget

    def shapes(self, profile: Profile) -> list[Option]:
        """The profile's shapes at its own batch limits: colocated, one; disaggregated, the splits searched coarse
        to fine (the best split's neighbours until they are adjacent)."""
        if not self._fits(profile):
            self.say(f"  {profile.manifest}: one replica of each pool takes more than the budget of {self.budget}")
            return []
        if profile.mode == "colocated":
            option = self._base(profile, _shape(profile, self.budget))
            self.predict(option)
            return [option]
        splits = _splits(profile, self.budget)
        tried = {p: self._base(profile, _shape(profile, self.budget, p)) for p in _coarse(splits, COARSE)}
        while True:
            for option in tried.values():
                self.predict(option)
            best = min(tried, key=lambda p: self.predict(tried[p]).rank())
            known = sorted(tried)
            i = known.index(best)
            around = ((known[max(i - 1, 0)], best), (best, known[min(i + 1, len(known) - 1)]))
            between = {(a + b) // 2 for a, b in around if b - a > 1}
            if not between:
                return list(tried.values())
            tried |= {p: self._base(profile, _shape(profile, self.budget, p)) for p in between}

    def plan(self) -> list[Prediction]:
        """Every prediction made, best first."""
        for profile in self.profiles:
            self.say(f"{profile.mode} ({profile.manifest}, {profile.machine}):")
            self.shapes(profile)
        best = sorted(self.predictions.values(), key=Prediction.rank)[:2]
        if best:
            self.say("batch limits of the best shapes:")
        for prediction in best:
            o = prediction.option
            for seqs, chunk in ((o.max_num_seqs, o.max_num_batched_tokens // 2),
                                (o.max_num_seqs, o.max_num_batched_tokens * 2),
                                (max(1, o.max_num_seqs // 2), o.max_num_batched_tokens)):
                if chunk >= 64 and (seqs, chunk) != (o.max_num_seqs, o.max_num_batched_tokens):
                    self.predict(replace(o, max_num_seqs=seqs, max_num_batched_tokens=chunk))
        return sorted(self.predictions.values(), key=Prediction.rank)


def format_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _driver_settings(profile: Profile):
    """The request driver's settings the profiled manifest gives its router (admission, queue timeout, routing)."""
    from tandem.cluster.controller import driver_settings
    from tandem.cluster.manifest_yaml import parse_manifest

    return driver_settings(parse_manifest(profile.manifest_yaml, profile.manifest))


def default_budget(profiles: Sequence[Profile]) -> int:
    """The units the largest profiled manifest's initial replicas take (its own hardware)."""
    from tandem.cluster.manifest_yaml import parse_manifest

    def units(profile: Profile) -> int:
        manifest = parse_manifest(profile.manifest_yaml, profile.manifest)
        return sum(pool.replicas.start * pool_units(profile.pool(name)) for name, pool in manifest.pool_items()
                   if name in profile.pools)

    return max(units(p) for p in profiles)


def manifest_text(prediction: Prediction, header: Sequence[str]) -> str:
    """The profile's manifest with the option's replica counts (fixed: min = max = initial) and batch limits, after
    `header` as comment lines. A pool of more than one replica loses its cpu_affinity (replicas that share a node
    would share its CPUs). Raises ManifestInvalid if the result is not a valid manifest."""
    from tandem.cluster.manifest_yaml import parse_manifest

    o = prediction.option
    data = yaml.safe_load(o.profile.manifest_yaml)
    notes = []
    for role, name in o.pools.items():
        pool = data["pools"][name]
        count = getattr(o.shape, role)
        pool["replicas"] = {"min": count, "max": count, "initial": count}
        pool.setdefault("engine", {}).update(max_num_seqs=o.max_num_seqs,
                                             max_num_batched_tokens=o.max_num_batched_tokens)
        if count > 1 and pool.pop("cpu_affinity", None) is not None:
            notes.append(f"pools.{name}.cpu_affinity dropped: {count} replicas would share its CPUs")
    text = "".join(f"# {line}\n" for line in [*header, *notes]) + yaml.safe_dump(data, sort_keys=False)
    parse_manifest(text, "the planned manifest")
    return text
