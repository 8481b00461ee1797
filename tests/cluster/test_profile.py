"""`tandem profile` and the profile file: the fits recover the lines they were made from, a bad file is refused with
its reason, and the command measures the shipped disaggregated manifest's two pools as `tandem up` builds them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cluster.hardware_profile import (DecodePoint, Fit, PrefillPoint, Profile, Transfer, fit_points,
                                             read_profile, write_profile)

ROOT = Path(__file__).resolve().parents[2]
TRUE = Fit(step_s=0.020, decode_token_s=0.002, context_token_s=2e-6, prefill_token_s=4e-4, prefill_pair_s=3e-8,
           decode_error=0.0, prefill_error=0.0)
BUDGET = 512


def _points(fit: Fit):
    prefill = [PrefillPoint(prompt_tokens=n, prompts=p, steps=-(-n * p // BUDGET),
                            seconds=fit.prefill(n, p, BUDGET)) for n in (128, 512, 1536) for p in (1, 4)]
    decode = [DecodePoint(batch=b, context=c, seconds=fit.decode_step(b, c)) for b in (1, 4, 16, 32)
              for c in (64, 1024)]
    return prefill, decode


def test_the_fits_recover_the_lines_the_points_were_made_from():
    prefill, decode = _points(TRUE)
    fit = fit_points(prefill, decode, BUDGET)
    for name in ("step_s", "decode_token_s", "context_token_s", "prefill_token_s", "prefill_pair_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert fit.decode_error < 1e-9 and fit.prefill_error < 1e-9
    # 10% slower decode steps at 32 sequences: the error says so, and no term goes negative.
    noisy = [p.model_copy(update={"seconds": p.seconds * (1.1 if p.batch == 32 else 1.0)}) for p in decode]
    fit = fit_points(prefill, noisy, BUDGET)
    assert 0.01 < fit.decode_error < 0.1 and min(fit.step_s, fit.decode_token_s, fit.context_token_s) >= 0


def test_points_that_cannot_separate_the_terms_are_refused():
    prefill, decode = _points(TRUE)
    with pytest.raises(ValueError, match="two batch sizes and two contexts"):
        fit_points(prefill, [p for p in decode if p.context == 64], BUDGET)
    with pytest.raises(ValueError, match="two prompt lengths"):
        fit_points([p for p in prefill if p.prompt_tokens == 512], decode, BUDGET)


def _profile() -> Profile:
    prefill, decode = _points(TRUE)
    pool = {"layout": {"tp": 1, "pp": 1, "ep": 1, "device": "cpu", "dtype": "float32", "weights": "dense",
                       "threads": 1, "compiled": False},
            "block_size": 16, "num_kv_blocks": 1000, "max_num_batched_tokens": BUDGET, "max_num_seqs": 32,
            "kv_bytes_per_token": 23040, "prefill": prefill, "decode": decode, "fit": TRUE}
    return Profile.model_validate({"machine": "test", "model": "embedded", "manifest": "m.yaml",
                                   "manifest_yaml": "mode: colocated\n", "mode": "colocated",
                                   "created": "2026-12-03T00:00:00+00:00", "pools": {"decode": pool},
                                   "transfer": Transfer(bytes_per_s=1e9, source="given")})


def test_a_profile_reads_back_and_prices_the_batching_mock(tmp_path):
    path = tmp_path / "p.json"
    write_profile(_profile(), path)
    back = read_profile(path)
    assert back == _profile()
    costs = back.step_costs("decode")
    # A decode step of 8 sequences at 1000 tokens, and a 1536-token prompt in chunks of the budget: the mock's
    # prices equal the profile's own lines.
    assert costs.step_time(8, 0, context_tokens=8 * 1000) == pytest.approx(TRUE.decode_step(8, 1000))
    chunks = [(o, min(BUDGET, 1536 - o)) for o in range(0, 1536, BUDGET)]
    assert sum(costs.step_time(0, n, prefill_pairs=n * o + n * (n + 1) / 2) for o, n in chunks) == pytest.approx(
        TRUE.prefill(1536, 1, BUDGET))
    assert costs.transfer_time(100) == pytest.approx(100 * 23040 / 1e9)
    assert back.step_costs("decode", max_num_seqs=8).max_num_seqs == 8
    with pytest.raises(ValueError, match="no pool 'prefill'; it has decode"):
        back.step_costs("prefill")


def test_a_bad_profile_file_is_refused_with_its_reason(tmp_path):
    with pytest.raises(ValueError, match="cannot read the profile"):
        read_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a tandem profile"):
        read_profile(tmp_path / "bad.json")
    data = json.loads(_profile().model_dump_json())
    data["version"] = 2
    data["pools"]["decode"]["fit"]["step_s"] = -1
    (tmp_path / "v2.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"version: .*pools\.decode\.fit\.step_s"):
        read_profile(tmp_path / "v2.json")


def test_tandem_profile_measures_each_pool_of_the_disaggregated_manifest(tmp_path):
    """A small grid on the shipped manifest, in a process of its own (the replicas pin the process to their CPUs):
    both pools, built as `tandem up` builds them (one thread each, the prefill pool uncompiled), with every point
    that fits measured, and fitted lines through them; and the KV transfer rate, measured between two processes
    with the manifest's transport settings (shared memory off: through UCX)."""
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "profile",
                           str(ROOT / "deploy/manifests/bench-disaggregated.yaml"), "--out", str(out),
                           "--prompts", "32,96,8000", "--prompt-counts", "1,2", "--batches", "1,3",
                           "--contexts", "16,48", "--decode-steps", "2", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "prompt(s) of 8000 tokens do not fit the pool; left out" in proc.stderr  # beyond max_model_len 4096
    profile = read_profile(out)
    assert set(profile.pools) == {"prefill", "decode"}
    assert profile.transfer.source.startswith("measured: the transport path") and profile.transfer.bytes_per_s > 0
    assert "profile: KV transfer: " in proc.stderr
    for name, pool in profile.pools.items():
        assert pool.layout.threads == 1 and pool.layout.tp == 1 and pool.max_num_batched_tokens == 512
        assert {(p.prompt_tokens, p.prompts) for p in pool.prefill} == {(32, 1), (32, 2), (96, 1), (96, 2)}
        assert {(p.batch, p.context) for p in pool.decode} == {(1, 18), (3, 18), (1, 50), (3, 50)}
        assert pool.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # K and V, 30 layers x 3 KV heads x 64, float32
        assert pool.fit.step_s > 0 and pool.fit.decode_error < 1 and pool.fit.prefill_error < 1
    assert not profile.pools["prefill"].layout.compiled
    assert f"to {out}" in proc.stdout


def test_the_shipped_profiles_read_and_their_fits_hold_their_points():
    """deploy/profiles/: measured with `tandem profile` (docs/BENCHMARKS.md says on what): each reads, and its lines
    predict its own points within 25% (root mean square)."""
    shipped = sorted((ROOT / "deploy/profiles").glob("*.json"))
    assert shipped
    for path in shipped:
        profile = read_profile(path)
        for name, pool in profile.pools.items():
            assert pool.fit.decode_error < 0.25 and pool.fit.prefill_error < 0.25, (path.name, name)
