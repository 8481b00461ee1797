"""The example manifests of deploy/manifests as shipped: each is valid and has the layout its comments promise (the
checks every manifest gets, and their errors, are test_manifest.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cluster.manifest_checks import validate_file

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "manifests"


@pytest.fixture(autouse=True)
def _load_embedded_once(embedded_shape_once):
    """validate_file loads the embedded model's shape once for the session (tests/conftest.py)."""


def test_local_manifest_gives_each_pool_its_own_core():
    """What `make run` starts: one process per pool, each pinned to its own CPU with one torch thread."""
    manifest = validate_file(MANIFESTS / "local.yaml", check_ports=False)
    assert manifest.mode == "disaggregated" and manifest.model_path is None
    prefill, decode = manifest.pools.prefill, manifest.pools.decode
    assert prefill.parallelism.world_size == decode.parallelism.world_size == 1
    assert (prefill.cpu_affinity, decode.cpu_affinity) == ((0,), (1,))
    assert prefill.resources.bundle() == {"CPU": 1.0, "prefill": 1}
    assert decode.resources.bundle() == {"CPU": 1.0, "decode": 1}
    assert manifest.listen.grpc == "127.0.0.1:50051" and manifest.listen.http == "127.0.0.1:8000"


def test_local_parallel_manifest_is_valid():
    manifest = validate_file(MANIFESTS / "local-parallel.yaml", check_ports=False)
    assert manifest.mode == "disaggregated"
    assert manifest.model_path is None  # embedded
    assert [name for name, _ in manifest.pool_items()] == ["prefill", "decode"]
    prefill, decode = manifest.pools.prefill, manifest.pools.decode
    assert (prefill.parallelism.tp, prefill.parallelism.pp, prefill.parallelism.ep) == (2, 1, 1)
    assert (decode.parallelism.tp, decode.parallelism.pp, decode.parallelism.ep) == (1, 2, 1)
    assert prefill.parallelism.world_size == decode.parallelism.world_size == 2
    assert prefill.engine.kv_cache_bytes == decode.engine.kv_cache_bytes == 256 << 20
    assert prefill.engine.block_size == decode.engine.block_size == 16
    assert prefill.engine.max_model_len == 2048
    assert prefill.resources.bundle() == {"CPU": 0.5, "prefill": 1}
    assert decode.resources.bundle() == {"CPU": 0.5, "decode": 1}
    assert prefill.replicas.start == decode.replicas.start == 1
    assert manifest.router.policy == "cache_aware" and manifest.router.weights.queued_prefill_tokens == 0.5
    assert manifest.router.local_prefill_max_tokens == 0 and not manifest.router.session_affinity
    assert manifest.transport.kind == "ucx" and manifest.transport.lease_s == 30
    assert manifest.listen.grpc == "127.0.0.1:50051" and manifest.listen.http == "127.0.0.1:8000"
    assert manifest.auth.api_keys == []
    assert manifest.ray.address is None


def test_local_colocated_manifest_is_valid():
    manifest = validate_file(MANIFESTS / "local-colocated.yaml", check_ports=False)
    assert manifest.mode == "colocated"
    assert manifest.pools.prefill is None
    assert [name for name, _ in manifest.pool_items()] == ["decode"]
    decode = manifest.pools.decode
    assert (decode.parallelism.tp, decode.parallelism.pp, decode.parallelism.ep) == (1, 1, 1)  # one process
    assert decode.resources.cpus == 2.0 and decode.cpu_affinity is None  # two torch threads, wherever Ray runs it
    assert decode.engine.kv_cache_bytes == 512 << 20 and decode.engine.max_num_seqs == 64
    assert manifest.listen.grpc == "127.0.0.1:50051" and manifest.listen.http == "127.0.0.1:8000"


def test_the_decode_pools_compile_their_step_and_the_prefill_pool_does_not():
    """engine.compile unset: the replica's EngineConfig leaves it to TANDEM_COMPILE (on by default) where the pool
    decodes, and turns it off for a disaggregated cluster's prefill pool; a value in the manifest wins."""
    from tandem.cluster.manifest_yaml import parse_manifest
    from tandem.cluster.replica_plans import replica_plans

    manifest = validate_file(MANIFESTS / "local.yaml", check_ports=False)
    # make run's decode pool compiles in the background, serving eager at once (a first answer before the minute
    # that compiling takes on 2 cores)
    assert {plan.pool: plan.spec.engine.compile for plan in replica_plans(manifest)} == {"prefill": False,
                                                                                          "decode": "background"}
    text = (MANIFESTS / "local.yaml").read_text()
    assert "engine: {block_size: 16," in text
    forced = parse_manifest(text.replace("engine: {block_size: 16,", "engine: {compile: true, block_size: 16,", 1))
    assert {plan.pool: plan.spec.engine.compile for plan in replica_plans(forced)}["prefill"] is True


def test_the_local_decode_pools_speculate_and_a_prefill_pool_never_does():
    """engine.speculative reaches the EngineConfig of the replicas that decode; a disaggregated cluster's prefill
    pool (it only samples a first token) gets none even where its manifest section asks."""
    from tandem.cluster.manifest_yaml import parse_manifest
    from tandem.cluster.replica_plans import replica_plans
    from tandem.engine.engine_config import SpeculativeConfig

    for name in ("local.yaml", "local-colocated.yaml"):
        manifest = validate_file(MANIFESTS / name, check_ports=False)
        specs = {plan.pool: plan.spec.engine.speculative for plan in replica_plans(manifest)}
        assert specs["decode"] == SpeculativeConfig(proposer="suffix", max_tokens=4)
        assert specs.get("prefill") is None
    text = (MANIFESTS / "local.yaml").read_text()
    asked = parse_manifest(text.replace("engine: {block_size: 16,", "engine: {speculative: {proposer: ngram}, "
                                        "block_size: 16,", 1))
    assert {plan.pool: plan.spec.engine.speculative for plan in replica_plans(asked)}["prefill"] is None
    forced = parse_manifest(text.replace("{proposer: suffix, max_tokens: 4}", "{proposer: suffix, adaptive: false}"))
    assert {plan.pool: plan.spec.engine.speculative for plan in replica_plans(forced)}["decode"] == \
        SpeculativeConfig(proposer="suffix", adaptive=False)
    for bad, message in (("{proposer: eagle}", "proposer"), ("{max_tokens: 17}", "max_tokens"),
                         ("{ngram_min: 3, ngram_max: 2}", "ngram_min"), ("{adaptive: sometimes}", "adaptive")):
        with pytest.raises(ValueError, match=message):
            parse_manifest(text.replace("engine: {block_size: 16,", f"engine: {{speculative: {bad}, block_size: 16,",
                                        1))


def test_replicas_of_one_host_pass_kv_by_reference_only_when_the_manifest_says_so():
    """transport.shared_memory (opt-in, default false) reaches every replica's TransferConfig."""
    from tandem.cluster.manifest_yaml import parse_manifest
    from tandem.cluster.replica_plans import transfer_config

    manifest = validate_file(MANIFESTS / "local.yaml", check_ports=False)
    assert transfer_config(manifest, b"s" * 32).shared_memory is False
    text = (MANIFESTS / "local.yaml").read_text()
    assert "transport:\n  kind: ucx\n" in text
    on = parse_manifest(text.replace("transport:\n  kind: ucx\n", "transport:\n  kind: ucx\n  shared_memory: true\n"))
    assert transfer_config(on, b"s" * 32).shared_memory is True


def test_the_tenants_bench_manifest_shares_the_decode_pool_fairly_between_two_keyed_tenants(monkeypatch):
    from tandem.cluster.replica_plans import replica_plans

    monkeypatch.setenv("TANDEM_BENCH_CHAT_KEY", "sk-chat-0123456789")
    monkeypatch.setenv("TANDEM_BENCH_BATCH_KEY", "sk-batch-0123456789")
    manifest = validate_file(MANIFESTS / "bench-tenants.yaml", check_ports=False)
    [plan] = replica_plans(manifest)
    assert plan.spec.engine.scheduling.policy == "fair"
    assert plan.spec.engine.scheduling.tenant_weights == (("chat", 1.0), ("batch", 1.0))
    assert {k.tenant: k.key_env for k in manifest.auth.api_keys} == {"chat": "TANDEM_BENCH_CHAT_KEY",
                                                                     "batch": "TANDEM_BENCH_BATCH_KEY"}
