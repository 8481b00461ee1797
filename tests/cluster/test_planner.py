"""`tandem plan` and the simulation under it: the simulated latencies are the profile's own lines, the planner picks
the deployment its simulation ranks first (the split search finds the best split an exhaustive one finds), the
written manifest is valid and says what was predicted, and bad input is refused with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.bench.loadgen.records import WorkRequest
from tandem.bench.loadgen.stats import SLO
from tandem.bench.loadgen.workloads import Conversation
from tandem.cluster.hardware_profile import Profile, read_profile
from tandem.cluster.manifest_yaml import parse_manifest
from tandem.cluster.planner import Option, Planner, budget_unit, default_budget, manifest_text
from tandem.cluster.simulation import Shape, simulate
from tandem.router.mocks.batching import StepCosts

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "deploy" / "profiles"
COSTS = StepCosts(step_s=0.02, decode_token_s=0.001, context_token_s=1e-5, prefill_token_s=0.001,
                  prefill_pair_s=1e-6, kv_bytes_per_token=1000, transfer_bytes_per_s=1e7, max_num_batched_tokens=256)


def _one(prompt_tokens: int, max_tokens: int, at: float = 0.0) -> Conversation:
    return Conversation(at, (WorkRequest(max_tokens, prompt_ids=tuple(range(1000, 1000 + prompt_tokens))),))


def test_a_lone_request_takes_what_the_step_lines_say():
    # 600 prompt tokens in chunks of 256 (each chunk attends to what came before it), then 4 decode steps whose
    # context grows by one each: the simulated TTFT and gaps are these sums, on virtual time.
    n, out = 600, 5
    chunks = [(0, 256), (256, 256), (512, 88)]
    prefill = sum(COSTS.step_s + COSTS.prefill_token_s * c + COSTS.prefill_pair_s * (c * o + c * (c + 1) / 2)
                  for o, c in chunks)
    gaps = [COSTS.step_s + COSTS.decode_token_s + COSTS.context_token_s * (n + i) for i in range(1, out)]
    colocated = simulate(Shape("colocated", 0, 1), {"decode": COSTS}, [_one(n, out)])
    assert colocated["ttft_ms"]["p50"] / 1000 == pytest.approx(prefill, rel=1e-3)
    assert colocated["itl_ms"]["max"] / 1000 == pytest.approx(max(gaps), rel=1e-3)
    assert colocated["e2e_ms"]["p50"] / 1000 == pytest.approx(prefill + sum(gaps), rel=1e-3)
    # Disaggregated: the same prefill, then the KV's transfer (600 x 1000 bytes at 10 MB/s) before the stream.
    disaggregated = simulate(Shape("disaggregated", 1, 1), {"prefill": COSTS, "decode": COSTS}, [_one(n, out)])
    assert disaggregated["ttft_ms"]["p50"] / 1000 == pytest.approx(prefill + COSTS.transfer_time(n), rel=1e-3)


def test_shapes_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="needs a replica in each pool"):
        Shape("disaggregated", 0, 2)
    with pytest.raises(ValueError, match="decode replicas and no prefill pool"):
        Shape("colocated", 1, 2)
    with pytest.raises(ValueError, match="mode must be one of"):
        Shape("both", 1, 1)


def _profile(mode: str, *, prefill_token_s: float, threads: dict[str, int]) -> Profile:
    """A profile made up for the planner: decode steps of 20 ms + 1 ms a sequence, prompts at prefill_token_s."""
    shipped = read_profile(PROFILES / f"cpu-2core-avx512-bench-{mode}.json")
    pools = {}
    for name, pool in shipped.pools.items():
        fit = pool.fit.model_copy(update={"step_s": 0.02, "decode_token_s": 0.001, "context_token_s": 0.0,
                                          "prefill_token_s": prefill_token_s, "prefill_pair_s": 0.0})
        layout = pool.layout.model_copy(update={"threads": threads[name]})
        pools[name] = pool.model_copy(update={"fit": fit, "layout": layout})
    return shipped.model_copy(update={"pools": pools})


def _long_mix(count: int, gap_s: float) -> list[Conversation]:
    return [_one(1500 if i % 4 == 0 else 100, 32, i * gap_s) for i in range(count)]


def test_a_strict_itl_slo_with_long_prompts_plans_disaggregated():
    # Prompts cost 6 ms a token: a 1500-token prompt's chunks (512 tokens, 3 s each) stall a colocated replica's
    # decodes past the 300 ms ITL limit; disaggregated replicas never mix the two.
    disaggregated = _profile("disaggregated", prefill_token_s=0.006, threads={"prefill": 1, "decode": 1})
    colocated = _profile("colocated", prefill_token_s=0.006, threads={"decode": 1})
    lines: list[str] = []
    ranked = Planner([disaggregated, colocated], _long_mix(40, 0.5), 2.0, SLO(ttft=30.0, itl_p99=0.3), 4,
                     lines.append).plan()
    best = ranked[0]
    assert best.option.shape.mode == "disaggregated" and best.summary["slo_attainment"] == 1.0
    colocated_best = next(p for p in ranked if p.option.shape.mode == "colocated")
    assert colocated_best.option.shape.decode == 4 and colocated_best.summary["slo_attainment"] < 0.95
    assert best.rank() < colocated_best.rank()
    assert any(line.startswith("  disaggregated 1P:3D") for line in lines)


def test_the_split_search_finds_what_an_exhaustive_one_finds():
    profile = _profile("disaggregated", prefill_token_s=0.004, threads={"prefill": 1, "decode": 1})
    planner = Planner([profile], _long_mix(60, 0.15), 1 / 0.15, SLO(ttft=30.0, itl_p99=0.3), 16)
    planner.plan()
    searched = [p for p in planner.predictions.values() if (p.option.max_num_seqs, p.option.max_num_batched_tokens)
                == (32, 512)]
    assert len(searched) < 15  # coarse to fine: not every split was simulated
    found = min(p.rank() for p in searched)
    for prefill in range(1, 16):
        assert planner.predict(Option(profile, Shape("disaggregated", prefill, 16 - prefill), 32, 512)).rank() >= found


def test_cheap_prompts_and_a_loose_slo_plan_colocated():
    # Prompts at 0.1 ms a token stall nothing: every replica both prefills and decodes, and colocated replicas
    # share their load without a transfer; at equal goodput it wins on TTFT.
    disaggregated = _profile("disaggregated", prefill_token_s=0.0001, threads={"prefill": 1, "decode": 1})
    colocated = _profile("colocated", prefill_token_s=0.0001, threads={"decode": 1})
    ranked = Planner([disaggregated, colocated], _long_mix(20, 0.5), 2.0, SLO(ttft=5.0, itl_p99=1.0), 4).plan()
    assert ranked[0].option.shape == Shape("colocated", 0, 4)
    assert ranked[0].summary["slo_attainment"] == 1.0


def test_the_planned_manifest_is_valid_and_says_what_was_predicted():
    profile = _profile("disaggregated", prefill_token_s=0.004, threads={"prefill": 1, "decode": 1})
    planner = Planner([profile], _long_mix(8, 0.5), 2.0, SLO(ttft=30.0), 5)
    prediction = planner.predict(Option(profile, Shape("disaggregated", 2, 3), 16, 256))
    text = manifest_text(prediction, ["planned in a test"])
    assert text.startswith("# planned in a test\n")
    assert "cpu_affinity dropped" in text
    manifest = parse_manifest(text)
    assert manifest.pools.prefill.replicas.initial == 2 and manifest.pools.decode.replicas.max == 3
    assert manifest.pools.decode.engine.max_num_seqs == 16
    assert manifest.pools.prefill.engine.max_num_batched_tokens == 256
    assert manifest.pools.decode.cpu_affinity is None
    assert prediction.figures()["units"] == 5


def test_bad_input_is_refused_with_its_reason():
    disaggregated = read_profile(PROFILES / "cpu-2core-avx512-bench-disaggregated.json")
    gpu = disaggregated.model_copy(update={"pools": {
        name: pool.model_copy(update={"layout": pool.layout.model_copy(update={"device": "cuda"})})
        for name, pool in disaggregated.pools.items()}})
    with pytest.raises(ValueError, match="mix GPU and CPU"):
        budget_unit([disaggregated, gpu])
    assert budget_unit([gpu]) == "GPUs" and default_budget([disaggregated]) == 2
    chats = [Conversation(0.0, (WorkRequest(8, messages=(("user", "hi"),)),))]
    with pytest.raises(ValueError, match="sessions workload sends chat messages"):
        Planner([disaggregated], chats, 1.0, SLO(), 2)
    half = disaggregated.model_copy(update={"pools": {"decode": disaggregated.pools["decode"]}})
    with pytest.raises(ValueError, match="has no prefill pool"):
        Planner([half], _long_mix(2, 1.0), 1.0, SLO(), 2)
    lines: list[str] = []
    assert Planner([disaggregated], _long_mix(2, 1.0), 1.0, SLO(), 1, lines.append).plan() == []
    assert "more than the budget of 1" in lines[-1]


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cluster.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_the_command_plans_the_shipped_profiles_and_writes_the_best(tmp_path):
    out = tmp_path / "planned.yaml"
    done = _tandem("plan", "--profile", str(PROFILES / "cpu-2core-avx512-bench-disaggregated.json"), "--profile",
                   str(PROFILES / "cpu-2core-avx512-bench-colocated.json"), "--workload", "long-mix", "--rate", "0.3",
                   "--num-requests", "12", "--input", "lognormal:96,0.4", "--long-share", "0.25", "--long-input",
                   "uniform:1024,1536", "--output", "fixed:16", "--slo", "ttft=20s,itl_p99=500ms", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["budget"] == 2 and result["unit"] == "cores"
    modes = {row["mode"] for row in result["ranked"]}
    assert modes == {"disaggregated", "colocated"} and result["best"] == result["ranked"][0]
    assert all(row["requests"] == 12 for row in result["ranked"])
    text = out.read_text()
    assert "# predicted (ttft <= 20000 ms, itl_p99 <= 500 ms)" in text and "# runner-up 1:" in text
    assert yaml.safe_load(text)["mode"] == result["best"]["mode"]
    assert "best first" in done.stderr
    refused = _tandem("plan", "--profile", str(PROFILES / "cpu-2core-avx512-bench-colocated.json"), "--workload",
                      "long-mix", "--duration", "10")
    assert refused.returncode == 2 and "--rate R" in refused.stderr
