"""`tandem bench` end to end against the router over mock replicas (real gRPC and HTTP servers on loopback, the
router's real request path, replicas that stream deterministic tokens with a fixed step time): each workload and
both APIs, the results folder, and the summary as stdout's last line."""

from __future__ import annotations

import json

import pytest

from tandem.bench.loadgen.report import read_records
from tandem.cluster.cli import main
from tandem.router.mocks.front import MockFront
from tandem.router.mocks.replicas import MockDecode

from tests.router.router_harness import model_facts

STEP_S = 0.01


@pytest.fixture(scope="module")
def cluster():
    front = MockFront(MockDecode("decode-0", step_s=STEP_S), model_facts(2048))
    yield front
    front.close()


def bench(capsys, *argv) -> dict:
    assert main(["bench", "--quiet", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_an_open_loop_run_over_grpc_measures_every_request(cluster, capsys, tmp_path):
    summary = bench(capsys, "--target", cluster.target, "--rate", "40", "--num-requests", "40", "--input",
                    "uniform:16,64", "--output", "fixed:8", "--slo", "ttft=5s,itl_p99=5s", "--out", str(tmp_path))
    assert summary["requests"] == summary["completed"] == 40 and summary["errors"] == {}
    assert summary["output_token_throughput"] > 0 and summary["goodput_rps"] == summary["request_throughput"]
    assert summary["asked_rate"] == 40 and summary["pacing_ms"]["p99"] < 100
    # each mock token takes STEP_S: a gap can only be longer (a batch of messages arriving together is one gap)
    assert summary["itl_ms"]["p50"] >= 1000 * STEP_S * 0.9
    records = read_records(tmp_path / "requests.jsonl")
    assert [r.output_tokens for r in records] == [8] * 40
    assert all(16 <= r.prompt_tokens <= 64 for r in records)
    assert {p.name for p in tmp_path.iterdir()} >= {"requests.jsonl", "summary.json", "latency_cdf.png",
                                                     "itl_timeline.png"}
    assert json.loads((tmp_path / "summary.json").read_text())["completed"] == 40


def test_shared_prefixes_show_as_prefix_hits_and_a_tight_slo_cuts_goodput(cluster, capsys, tmp_path):
    summary = bench(capsys, "--target", cluster.target, "--rate", "50", "--num-requests", "30", "--workload",
                    "shared-prefix", "--prefix-groups", "2", "--prefix-len", "256", "--input", "fixed:16",
                    "--output", "fixed:4", "--slo", "ttft=1ms", "--out", str(tmp_path))
    assert summary["completed"] == 30
    assert summary["prefix_hit_rate"] > 0.5  # 256 of 272 tokens shared, the mock caches whole blocks
    assert summary["goodput_rps"] == 0 and summary["slo_attainment"] == 0  # nothing answers within 1 ms


def test_sessions_over_the_openai_api_carry_history_and_session_ids(cluster, capsys, tmp_path):
    summary = bench(capsys, "--openai", cluster.url, "--rate", "10", "--num-requests", "4", "--workload",
                    "sessions", "--turns", "3", "--think-time", "0.05", "--input", "fixed:12", "--output",
                    "fixed:6", "--out", str(tmp_path))
    assert summary["requests"] == summary["completed"] == 12
    records = read_records(tmp_path / "requests.jsonl")
    by_session: dict = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    assert len(by_session) == 4
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        # a later turn carries the conversation so far, and is due after the previous answer plus think time
        assert turns[0].prompt_tokens < turns[1].prompt_tokens < turns[2].prompt_tokens
        assert all(b.scheduled_s >= a.end_s + 0.05 - 1e-9 for a, b in zip(turns, turns[1:]))


def test_a_rate_sweep_writes_one_run_per_rate_and_the_sweep(cluster, capsys, tmp_path):
    summary = bench(capsys, "--target", cluster.target, "--rate", "20,40", "--num-requests", "12", "--input",
                    "fixed:16", "--output", "fixed:4", "--arrival", "gamma", "--burstiness", "0.5",
                    "--slo", "e2e=10s", "--out", str(tmp_path))
    assert [point["rate"] for point in summary["sweep"]] == [20, 40]
    assert summary["max_rate_meeting_slo"] == 40
    assert (tmp_path / "rate-20" / "requests.jsonl").exists() and (tmp_path / "sweep.png").exists()


def test_a_trace_replays_at_its_timestamps(cluster, capsys, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(row) for row in [
        {"timestamp": 1000, "input_length": 40, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1250, "input_length": 40, "output_length": 3, "hash_ids": [7, 9]},
        {"timestamp": 1500, "prompt": "Hello there", "output_length": 2}]) + "\n")
    summary = bench(capsys, "--target", cluster.target, "--workload", "trace", "--trace", str(trace),
                    "--trace-time-unit", "ms", "--trace-block-tokens", "16", "--warmup", "0", "--out", str(tmp_path / "out"))
    records = read_records(tmp_path / "out" / "requests.jsonl")
    assert [r.scheduled_s for r in records] == pytest.approx([0.0, 0.25, 0.5])
    assert [r.output_tokens for r in records] == [3, 3, 2] and summary["completed"] == 3
    assert records[1].cached_tokens == 16  # block 7 is the shared first 16 tokens


def test_bad_flags_and_an_unreachable_server_are_clear_errors(capsys, tmp_path):
    assert main(["bench", "--target", "127.0.0.1:1", "--rate", "1", "--num-requests", "1", "--timeout", "3",
                 "--out", str(tmp_path)]) == 1
    assert "warm-up request failed (UNAVAILABLE" in capsys.readouterr().err
    assert main(["bench", "--target", "127.0.0.1:1", "--rate", "1"]) == 2
    assert "--num-requests N and/or --duration S" in capsys.readouterr().err
    assert main(["bench", "--target", "127.0.0.1:1", "--rate", "1", "--duration", "1", "--input", "zipf:3"]) == 2
    assert "bad length distribution 'zipf:3'" in capsys.readouterr().err


def test_several_tenants_load_at_once_each_at_its_share_with_its_own_lengths(cluster, capsys, tmp_path):
    summary = bench(capsys, "--target", cluster.target, "--rate", "10", "--duration", "3", "--output", "fixed:4",
                    "--tenant", "chat,key=sk-chat-0123456789,input=lognormal:24,0.2",
                    "--tenant", "batch,share=3,key=sk-batch-0123456789,input=uniform:100,120,output=fixed:6",
                    "--out", str(tmp_path))
    chat, batch = summary["by_class"]["chat"], summary["by_class"]["batch"]
    assert chat["completed"] == chat["requests"] and batch["completed"] == batch["requests"]
    assert 2 * chat["requests"] < batch["requests"] < 5 * chat["requests"]  # 3x the rate, Poisson over 3 s
    records = read_records(tmp_path / "requests.jsonl")
    assert [r.index for r in records] == list(range(len(records)))
    assert all(100 <= r.prompt_tokens <= 120 and r.output_tokens == 6 for r in records if r.klass == "batch")
    assert all(r.prompt_tokens < 60 and r.output_tokens == 4 for r in records if r.klass == "chat")


def test_tenant_flags_are_checked(capsys):
    assert main(["bench", "--target", "127.0.0.1:1", "--rate", "1", "--num-requests", "3", "--tenant", "a"]) == 2
    assert "give one --rate and --duration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--target", "127.0.0.1:1", "--rate", "1", "--duration", "1", "--tenant", "a,weight=2"])
    assert "unknown field 'weight'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--target", "127.0.0.1:1", "--rate", "1", "--duration", "1", "--tenant", "a,key_env=NOPE_X"])
    assert "NOPE_X is not set" in capsys.readouterr().err
