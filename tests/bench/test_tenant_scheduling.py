"""bench/tenant_scheduling.py at a small size: the engine's scheduler on virtual time keeps an interactive
tenant's TTFT close to its own under fair where fcfs lets a batch tenant's backlog multiply it, sjf lets nothing
wait past its aging bound, and the script prints its results as one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tandem.bench.tenant_scheduling import Costs, long_mix, tenants

ROOT = Path(__file__).resolve().parents[2]
COSTS = Costs(0.02, 0.0005, 0.001)


def args(**kw) -> SimpleNamespace:
    return SimpleNamespace(**({"duration": 180.0, "rate": 0.3, "batch_factor": 5.0, "long_mix_rate": 1.8,
                               "long_share": 0.15, "aging_s": 10.0, "budget": 256, "fair_reserve_s": 0.0,
                               "seed": 0} | kw))


def test_fair_keeps_the_interactive_tenant_near_its_own_ttft_and_fcfs_does_not():
    result = tenants(args(), COSTS)
    assert result["fcfs_chat_p99_vs_alone"] > 3 * result["fair_chat_p99_vs_alone"], result
    assert result["fair"]["chat_ttft_p50_s"] < result["fcfs"]["chat_ttft_p50_s"] / 2
    assert result["requests"]["batch"] > 4 * result["requests"]["chat"]  # the batch tenant at 5x the rate
    assert "fair_reserve" not in result


def test_a_fair_reserve_keeps_the_interactive_tenant_closer_still_to_its_own_ttft():
    result = tenants(args(fair_reserve_s=30.0), COSTS)
    assert result["fair_reserve_chat_p99_vs_alone"] < result["fair_chat_p99_vs_alone"], result


def test_sjf_lets_nothing_wait_past_its_aging_bound():
    result = long_mix(args(), COSTS)
    assert result["sjf"]["longest_wait_s"] <= result["aging_s"]
    assert result["sjf"]["requests"] == result["fcfs"]["requests"] > 100


def test_the_script_prints_one_json_line():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tenant_scheduling.py"), "--duration", "60"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert {"tenants", "long-mix", "costs", "budget"} <= set(result)
