"""A manifest's `engine:` section is the engine's own configuration (cluster/engine_settings.py): every setting of
EngineConfig and SpeculativeConfig is a key, every default the manifest states is the engine's, and what the
engine refuses the manifest refuses at its key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tandem.cluster.engine_settings import EngineSettings, SchedulerSettings, SpeculativeSettings
from tandem.cluster.manifest_yaml import ManifestInvalid, parse_manifest
from tandem.cluster.replica_plans import replica_plans
from tandem.engine.engine_config import EngineConfig
from tandem.engine.engine_config import SchedulingConfig, SpeculativeConfig
from tandem.replica.spec import ReplicaSpec

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "manifests"


def _defaults(config_type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(config_type)}


def test_every_engine_setting_is_a_key_with_the_engines_default():
    engine, replica = _defaults(EngineConfig), _defaults(ReplicaSpec)
    stated = {name: field.default for name, field in EngineSettings.model_fields.items()}
    # a new EngineConfig field is a manifest key without a line here; lora is the manifest's own section, for
    # every pool (cluster/lora_settings.py), scheduling the pool's scheduler section (below)
    assert set(engine) - {"lora", "scheduling"} <= set(stated)
    assert set(stated) - set(engine) == {"device", "dtype", "weights", "load_format"}  # the replica's, beside the engine's
    for name, default in stated.items():
        assert default == (engine[name] if name in engine else replica[name]), name
    assert stated["max_num_seqs"] == EngineConfig().max_num_seqs == 128  # was 64 in the manifest, 128 in the engine
    assert EngineSettings().config() == EngineConfig()

    scheduler = {name: field.default for name, field in SchedulerSettings.model_fields.items()}
    assert scheduler == {k: v for k, v in _defaults(SchedulingConfig).items() if k not in ("tenant_weights",
                                                                                           "default_weight")}
    assert SchedulerSettings().config() == SchedulingConfig()

    speculative = {name: field.default for name, field in SpeculativeSettings.model_fields.items()}
    assert speculative == _defaults(SpeculativeConfig)
    assert SpeculativeSettings().config() == SpeculativeConfig()


def _local(engine_keys: str) -> str:
    """local.yaml with its decode pool's engine section replaced by a KV budget, a context and engine_keys."""
    text = (MANIFESTS / "local.yaml").read_text()
    start = text.index("engine: {", text.index("  decode:")) + len("engine: {")
    end, depth = start, 1
    while depth:
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        end += 1
    return text[:start] + f"kv_cache_bytes: 256MiB, max_model_len: 2048, {engine_keys}}}" + text[end:]


def test_the_draft_proposer_and_every_engine_key_reach_the_decode_replicas(tmp_path, monkeypatch):
    manifest = parse_manifest(_local("speculative: {proposer: draft, draft: self, adaptive: false}, "
                                     "kv_cache_dtype: int8, enable_chunked_prefill: false, check_integrity: true"))
    specs = {plan.pool: plan.spec for plan in replica_plans(manifest)}
    assert specs["decode"].engine.speculative == SpeculativeConfig(proposer="draft", draft="self", adaptive=False)
    assert specs["prefill"].engine.speculative is None  # a disaggregated cluster's prefill pool never speculates
    decode = specs["decode"].engine
    assert (decode.kv_cache_dtype, decode.enable_chunked_prefill, decode.check_integrity) == ("int8", False, True)

    draft = tmp_path / "draft"
    draft.mkdir()
    relative = parse_manifest(_local(f"speculative: {{proposer: draft, draft: {draft.name}}}"))
    monkeypatch.chdir(tmp_path)  # relative paths are read from where tandem runs, as the model's
    plans = replica_plans(relative)
    decode = next(plan.spec for plan in plans if plan.pool == "decode")
    assert decode.engine.speculative.draft == str(draft)  # as every node reads it: absolute


@pytest.mark.parametrize("keys, path, needle", [
    ("max_num_seqs: 0", "pools.decode.engine.max_num_seqs", "greater than or equal to 1"),
    ("kv_cache_fraction: 1.5", "pools.decode.engine.kv_cache_fraction", "less than or equal to 1"),
    ("attention_backend: flash", "pools.decode.engine.attention_backend", "'auto', 'torch' or 'triton'"),
    ("block_size: 12", "pools.decode.engine.block_size", "power of two"),
    ("speculative: {proposer: eagle}", "pools.decode.engine.speculative.proposer", "'ngram', 'suffix' or 'draft'"),
    ("speculative: {max_tokens: 17}", "pools.decode.engine.speculative.max_tokens", "less than or equal to 16"),
    ("speculative: {ngram_min: 3, ngram_max: 2}", "pools.decode.engine.speculative", "ngram_min <= ngram_max"),
    ("num_kv_blocks: 8", "pools.decode.engine", "give one KV budget"),  # beside local.yaml's kv_cache_bytes
])
def test_what_the_engine_refuses_the_manifest_refuses_at_its_key(keys, path, needle):
    with pytest.raises(ManifestInvalid) as caught:
        parse_manifest(_local(keys))
    errors = {e.path: e.message for e in caught.value.errors}
    assert path in errors and needle in errors[path], errors


def test_a_pools_scheduler_section_reaches_its_replicas_with_the_tenants_weights(tmp_path):
    from tandem.cluster.manifest_checks import validate_file
    from tandem.cluster.replica_plans import replica_plan
    from tests.cluster.manifest_files import manifest_errors, write_manifest

    head = ("pools:\n  prefill: {}\n  decode:\n    scheduler: {policy: fair, preempt_after_s: 2}\n"
            "auth:\n  api_keys: [{tenant: acme, key: sk-acme-0123456789}]\n  tenants: {acme: {weight: 3}}\n"
            "  default_tenant: {weight: 0.5}\n")
    manifest = validate_file(write_manifest(tmp_path, head), check_ports=False)
    decode = replica_plan(manifest, "decode", 0).spec.engine.scheduling
    assert decode == SchedulingConfig("fair", 2.0, 30.0, tenant_weights=(("acme", 3.0),), default_weight=0.5)
    assert (decode.weight("acme"), decode.weight("someone"), decode.weight(None)) == (3.0, 0.5, 0.5)
    assert replica_plan(manifest, "prefill", 0).spec.engine.scheduling.policy == "priority"  # the default
    errors = {e.path: e for e in manifest_errors(write_manifest(tmp_path, (
        "pools:\n  prefill:\n    scheduler: {policy: lottery}\n  decode:\n"
        "    scheduler: {policy: fcfs, preempt_after_s: 1}\n")))}
    assert "'fcfs', 'priority', 'sjf' or 'fair'" in errors["pools.prefill.scheduler.policy"].message
    assert "fcfs ignores" in errors["pools.decode.scheduler"].message
    errors = {e.path: e for e in manifest_errors(write_manifest(tmp_path, (
        "pools:\n  prefill:\n    scheduler: {policy: sjf, fair_reserve_s: 30}\n  decode:\n"
        "    scheduler: {policy: fair, fair_reserve_s: -1}\n")))}
    assert "under policy fair, not sjf" in errors["pools.prefill.scheduler"].message
    assert "greater than or equal to 0" in errors["pools.decode.scheduler.fair_reserve_s"].message
    reserved = validate_file(write_manifest(tmp_path, "pools:\n  prefill: {}\n  decode:\n"
                                            "    scheduler: {policy: fair, fair_reserve_s: 30}\n"), check_ports=False)
    assert replica_plan(reserved, "decode", 0).spec.engine.scheduling.fair_reserve_s == 30.0
