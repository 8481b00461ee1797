"""The cluster manifest as `tandem validate` and `tandem up` see it: the shipped manifests are valid, and a broken
one is reported whole, every problem with its YAML path, line and a hint. Listen addresses, ports and exposure:
test_manifest_network.py."""

from __future__ import annotations

import re

import pytest

from tandem.cluster.cli import main
from tandem.cluster.manifest import parse_bytes
from tandem.cluster.manifest_checks import validate_file
from tests.cluster.manifest_files import MANIFESTS, manifest_errors, write_manifest


@pytest.fixture(autouse=True)
def _load_embedded_once(embedded_shape_once):
    """validate_file loads the embedded model's shape once for the session (tests/conftest.py)."""


# --- sizes -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    (268435456, 268435456),
    ("256MiB", 256 << 20),
    ("1GB", 10**9),
    ("1.5 GiB", 3 << 29),
    ("64kib", 64 << 10),
    ("512", 512),
    ("100 B", 100),
])
def test_parse_bytes_accepts_ints_and_units(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["lots", True, "12 parsecs", "", "MiB", "-1MiB"])
def test_parse_bytes_rejects_what_is_not_a_size(value):
    with pytest.raises(ValueError, match="expected a size"):
        parse_bytes(value)


# --- every problem at once ---------------------------------------------------------------------------------------

BROKEN = """\
name: tandem
model: embedded
mode: disaggregated
pools:
  prefill:
    parallelism:
      pp: 99
    replicas:
      min: 3
      max: 1
    engine:
      block_size: 16
      kv_cache_byts: 256MiB
  decode:
    parallelism:
      ep: 2
    engine:
      block_size: 32
      max_model_len: 100000
router:
  policy: fastest
listen:
  grpc: localhost
"""


def test_a_broken_manifest_reports_every_problem_with_path_line_and_hint(tmp_path, embedded_shape):
    errors = manifest_errors(write_manifest(tmp_path, BROKEN))
    by_path = {e.path: e for e in errors}
    assert len(by_path) == len(errors), "one error per problem"
    assert {path: e.line for path, e in by_path.items()} == {
        "pools.prefill.parallelism": 6,
        "pools.prefill.replicas": 8,
        "pools.prefill.engine.kv_cache_byts": 13,
        "pools.decode.parallelism": 15,
        "pools.decode.engine.block_size": 18,
        "pools.decode.engine.max_model_len": 19,
        "router.policy": 21,
        "listen.grpc": 23,
    }
    assert [e.line for e in errors] == sorted(e.line for e in errors), "reported in file order"

    unknown = by_path["pools.prefill.engine.kv_cache_byts"]
    assert "unknown key 'kv_cache_byts'" in unknown.message
    assert unknown.hint.startswith("did you mean 'kv_cache_bytes'?")
    assert "max_num_seqs" in unknown.hint  # the keys allowed there

    assert by_path["pools.prefill.replicas"].message == "min (3) is more than max (1)"

    config = embedded_shape.config
    pp = by_path["pools.prefill.parallelism"]
    assert f"pp=99 is more than the model's {config.num_layers} layers" in pp.message
    assert f"{config.num_layers} layers" in pp.hint and f"{config.num_kv_heads} KV heads" in pp.hint
    ep = by_path["pools.decode.parallelism"]
    assert "ep=2 needs a mixture-of-experts model" in ep.message
    assert "0 experts" in ep.hint

    block = by_path["pools.decode.engine.block_size"]
    assert "(16 vs 32)" in block.message and "both pools must agree" in block.hint
    context = by_path["pools.decode.engine.max_model_len"]
    assert f"100000 exceeds the model's context ({config.max_position_embeddings})" in context.message

    policy = by_path["router.policy"]
    assert "'least_loaded', 'round_robin' or 'random'" in policy.message and policy.hint == "got 'fastest'"
    assert "expected HOST:PORT" in by_path["listen.grpc"].message


def test_parallelism_is_checked_against_the_model_heads(tmp_path, embedded_shape):
    # 9 query heads / 3 KV heads: tp=10 has a rank without a head; tp=4 splits the query heads (3+2+2+2) and
    # each rank reads its KV heads equally, which ReplicaLayout accepts.
    assert (embedded_shape.config.num_heads, embedded_shape.config.num_kv_heads) == (9, 3)
    path = write_manifest(tmp_path, """\
pools:
  prefill:
    parallelism: {tp: 10}
  decode:
    parallelism: {tp: 4, pp: 2}
""")
    [error] = manifest_errors(path)
    assert (error.path, error.line) == ("pools.prefill.parallelism", 3)
    assert "tp=10 is more than the model's 9 attention heads" in error.message


def test_a_missing_moe_model_hints_at_make_model_next_to_the_mode_error(tmp_path):
    model = tmp_path / "tiny-moe"
    path = write_manifest(tmp_path, f"""\
mode: colocated
model: {model}
pools:
  prefill: {{}}
  decode: {{}}
""")
    errors = manifest_errors(path)
    assert [(e.path, e.line) for e in errors] == [("mode", 1), ("model", 2)]
    assert "colocated mode runs only the decode pool" in errors[0].message
    assert "remove pools.prefill" in errors[0].message
    assert f"{str(model)!r} does not exist" in errors[1].message
    assert errors[1].hint == f"generate the small MoE test model with `tandem make-model tiny-moe {model}`"


def test_a_missing_model_and_no_prefill_pool_in_disaggregated_mode(tmp_path):
    model = tmp_path / "llama-folder"
    path = write_manifest(tmp_path, f"model: {model}\nmode: disaggregated\npools:\n  decode: {{}}\n")
    errors = manifest_errors(path)
    assert [(e.path, e.line) for e in errors] == [("model", 1), ("mode", 2)]
    errors = [errors[1], errors[0]]
    assert "disaggregated mode needs a prefill pool (pools.prefill)" in errors[0].message
    assert "make-model" not in errors[1].hint and "Hugging Face folder" in errors[1].hint


@pytest.mark.parametrize("text", ["- a\n- b\n", "just words\n", ""])
def test_a_manifest_that_is_not_a_mapping(tmp_path, text):
    [error] = manifest_errors(write_manifest(tmp_path, text))
    assert error.path == ""
    assert error.message == "the manifest must be a YAML mapping"
    assert "deploy/manifests/local.yaml" in error.hint


def test_invalid_yaml_reports_the_line(tmp_path):
    [error] = manifest_errors(write_manifest(tmp_path, "name: tandem\nmodel: embedded\nmode: colocated: yes\npools: {}\n"))
    assert error.line == 3
    assert error.message.startswith("not valid YAML: mapping values are not allowed here")


def test_an_unreadable_manifest(tmp_path):
    [error] = manifest_errors(tmp_path / "absent.yaml")
    assert "cannot be read" in error.message


# --- modes and router settings --------------------------------------------------------------------------------

def test_a_mode_error_is_reported_beside_field_errors(tmp_path):
    path = write_manifest(tmp_path, "mode: colocated\npools:\n  prefill: {}\n  decode: {}\nrouter: {policy: fastest}\n")
    errors = manifest_errors(path)
    assert [(e.path, e.line) for e in errors] == [("mode", 1), ("router.policy", 5)]


def test_router_settings_are_checked(tmp_path):
    path = write_manifest(tmp_path, "pools:\n  prefill: {}\n  decode: {}\nrouter:\n  policy: fastest\n"
                            "  weights: {prefix_tokens: -1, queued_prefil_tokens: 2}\n  local_prefill_max_tokens: -5\n")
    errors = {e.path: e for e in manifest_errors(path)}
    assert "cache_aware" in errors["router.policy"].message
    assert "router.weights.prefix_tokens" in errors and "router.local_prefill_max_tokens" in errors
    assert "queued_prefill_tokens" in errors["router.weights.queued_prefil_tokens"].hint  # did you mean


def test_router_admission_defaults_to_the_queue_timeout_and_slo_mode_needs_a_ttft_slo(tmp_path):
    from tandem.cluster.controller import serving_limits

    pools = "pools:\n  prefill: {}\n  decode: {}\n"
    assert validate_file(write_manifest(tmp_path, pools), check_ports=False).router.admission == "queue_timeout"
    errors = {e.path: e for e in manifest_errors(write_manifest(tmp_path, pools + "router:\n  admission: slo\n"))}
    assert "TTFT SLO" in errors["router.admission"].message and "slo.ttft_s" in errors["router.admission"].hint
    assert errors["router.admission"].line == 5
    errors = {e.path: e for e in manifest_errors(write_manifest(tmp_path, pools + "router:\n  admission: fastest\n"))}
    assert "queue_timeout" in errors["router.admission"].message
    manifest = validate_file(write_manifest(tmp_path, pools + "router:\n  admission: slo\nslo:\n  ttft_s: 0.5\n"),
                             check_ports=False)
    admission = serving_limits(manifest).admission  # what the router is started with
    assert (admission.mode, admission.ttft_slo_s) == ("slo", 0.5)


def test_tenant_rate_limits_and_weights_are_checked_and_reach_the_router(tmp_path):
    from tandem.cluster.controller import serving_limits

    head = "pools:\n  prefill: {}\n  decode: {}\nauth:\n  api_keys: [{tenant: acme, key: sk-acme-0123456789}]\n"
    errors = {e.path: e for e in manifest_errors(write_manifest(tmp_path, head + (
        "  tenants:\n    acme: {requests_per_minute: 0, tokens_per_minute: -3, weight: 0, tokens_per_minut: 5}\n")))}
    assert {"auth.tenants.acme.requests_per_minute", "auth.tenants.acme.tokens_per_minute",
            "auth.tenants.acme.weight", "auth.tenants.acme.tokens_per_minut"} <= set(errors)
    assert "tokens_per_minute" in errors["auth.tenants.acme.tokens_per_minut"].hint  # did you mean
    manifest = validate_file(write_manifest(tmp_path, head + (
        "  tenants:\n    acme: {requests_per_minute: 60, tokens_per_minute: 5000, weight: 2.5}\n")), check_ports=False)
    acme = serving_limits(manifest).tenant("acme")  # what the router is started with
    assert (acme.requests_per_minute, acme.tokens_per_minute, acme.weight) == (60, 5000, 2.5)


# --- the CLI -----------------------------------------------------------------------------------------------------


def test_cli_validate_accepts_the_local_manifest(capsys):
    path = MANIFESTS / "local-parallel.yaml"
    assert main(["validate", "--no-port-check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: valid (disaggregated;" in out
    assert "prefill 2x1x1 (tp x pp x ep)" in out and "decode 1x2x1 (tp x pp x ep)" in out
    assert "gRPC on 127.0.0.1:50051" in out


def test_cli_validate_lists_every_error_as_path_line_and_exits_2(tmp_path, capsys):
    path = write_manifest(tmp_path, BROKEN)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:6: pools.prefill.parallelism: impossible for this model: pp=99" in err
    assert f"{path}:13: pools.prefill.engine.kv_cache_byts: unknown key 'kv_cache_byts'" in err
    assert "    hint: did you mean 'kv_cache_bytes'?" in err
    assert f"{path}:18: pools.decode.engine.block_size: differs from the prefill pool's (16 vs 32)" in err
    assert f"{path}:21: router.policy:" in err
    assert f"tandem: {path}: 8 error(s)" in err


def test_the_same_message_at_two_paths_is_reported_twice(tmp_path):
    path = write_manifest(tmp_path, "pools:\n  prefill:\n    engine: {block_size: 3}\n  decode:\n    engine: {block_size: 3}\n")
    errors = manifest_errors(path)
    assert [(e.path, e.line) for e in errors] == [("pools.prefill.engine.block_size", 3),
                                                  ("pools.decode.engine.block_size", 5)]
    assert errors[0].message == errors[1].message == "block_size must be a power of two, got 3"


# --- devices ----------------------------------------------------------------------------------------------------


def test_cuda_needs_a_gpu_per_rank_and_a_split_replica_needs_whole_gpus(tmp_path):
    path = write_manifest(tmp_path, """\
pools:
  prefill:
    parallelism: {tp: 2}
    resources: {gpus: 0.5}
    engine: {device: cuda}
  decode:
    resources: {gpus: 0}
    engine: {device: cuda, dtype: bfloat16}
""")
    errors = {e.path: e for e in manifest_errors(path)}
    assert set(errors) == {"pools.prefill.resources.gpus", "pools.decode.engine.device"}
    split = errors["pools.prefill.resources.gpus"]
    assert split.line == 4 and "0.5 of a GPU per rank" in split.message and "2 ranks" in split.message
    assert "gpus: 1" in split.hint and "share a GPU" in split.hint
    no_gpu = errors["pools.decode.engine.device"]
    assert no_gpu.line == 8 and "ask for no GPU" in no_gpu.message
    assert "pools.decode.resources.gpus: 1" in no_gpu.hint and "device: cpu" in no_gpu.hint


def test_the_self_draft_is_refused_on_a_decode_pool_that_computes_on_cuda(tmp_path):
    """The draft 'self' runs packed 4-bit weights, which only the CPU runs: a decode pool on a GPU (auto with a GPU
    share, or device cuda) gets an error at its draft; on the CPU it passes, and the prefill pool never decodes."""
    text = """\
pools:
  prefill:
    resources: {gpus: 0.5}
    engine: {speculative: {proposer: draft}}
  decode:
    resources: {gpus: GPUS}
    engine: {speculative: {proposer: draft, draft: self}}
"""
    errors = manifest_errors(write_manifest(tmp_path, text.replace("GPUS", "0.5")))
    assert [(e.path, e.line) for e in errors] == [("pools.decode.engine.speculative.draft", 7)]
    assert "CPU only" in errors[0].message and "smaller model of the same vocabulary" in errors[0].hint
    assert validate_file(write_manifest(tmp_path, text.replace("GPUS", "0"))).pools.decode.engine.speculative


def test_a_single_rank_may_share_a_gpu_and_whole_gpus_are_whole(tmp_path):
    shared = write_manifest(tmp_path, """\
pools:
  prefill: {resources: {gpus: 0.5}, engine: {device: cuda}}
  decode: {resources: {gpus: 0.5}}
""", "shared.yaml")
    assert validate_file(shared, check_ports=False).pools.decode.device == "cuda"  # auto, given a GPU share
    odd = write_manifest(tmp_path, """\
pools:
  prefill: {resources: {gpus: 1.5}}
  decode: {resources: {gpus: 1.5}}
""", "odd.yaml")
    assert {(e.path, e.hint.startswith("Ray hands out fractions below 1 or whole GPUs")) for e in manifest_errors(odd)} == {
        ("pools.prefill.resources.gpus", True), ("pools.decode.resources.gpus", True)}


def test_pools_of_different_kv_dtypes_are_valid_and_validate_says_what_converting_costs(
        tmp_path, capsys, embedded_shape_once):
    # prefill on GPUs defaults to bfloat16, decode on the CPU to float32: the decode pool converts what arrives
    path = write_manifest(tmp_path, """\
pools:
  prefill: {resources: {gpus: 1}}
  decode: {resources: {gpus: 0}, engine: {kv_cache_dtype: int8}}
""")
    manifest = validate_file(path, check_ports=False)
    assert (manifest.pools.prefill.dtype, manifest.pools.decode.dtype) == ("bfloat16", "float32")
    assert main(["validate", "--no-port-check", str(path)]) == 0
    out = capsys.readouterr().out
    found = re.search(r"the prefill pool stores bfloat16 KV \(([\d.]+) KiB/token\), the decode pool int8 "
                      r"\(([\d.]+) KiB/token\)\. Transfers carry ([\d.]+) KiB per token and the decode pool "
                      r"converts each received block: ([\d.]+) ms per 1,000 tokens", out)
    assert found, out
    bf16, int8, carried, ms = map(float, found.groups())
    assert bf16 == carried == 30 * 2 * 3 * 64 * 2 / 1024  # SmolLM2: 30 layers x 3 KV heads x 64, 2 bytes
    assert int8 == round(bf16 / 2 * 17 / 16, 1)  # a byte a value, and a scale row per 16-token block
    assert ms > 0
    same = write_manifest(tmp_path, """\
pools:
  prefill: {engine: {kv_cache_dtype: int8}}
  decode: {engine: {kv_cache_dtype: int8}}
""", "same.yaml")
    assert main(["validate", "--no-port-check", str(same)]) == 0
    assert "converts on receive" not in capsys.readouterr().out


def test_quantized_weights_compute_in_bfloat16(tmp_path):
    path = write_manifest(tmp_path, "pools:\n  prefill: {engine: {weights: int8}}\n  decode: {engine: {weights: int4}}\n")
    manifest = validate_file(path, check_ports=False)
    assert (manifest.pools.prefill.dtype, manifest.pools.decode.dtype) == ("bfloat16", "bfloat16")
    bad = write_manifest(tmp_path, "pools:\n  prefill: {}\n  decode: {engine: {weights: int8, dtype: float32}}\n", "bad.yaml")
    [error] = manifest_errors(bad)
    assert error.path == "pools.decode.engine" and "int8 computes in bfloat16" in error.message


def test_an_unreadable_tls_file_is_reported_at_its_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative tls paths start where tandem runs
    (tmp_path / "server.key").write_text("not a key\n")
    path = write_manifest(tmp_path, "pools:\n  prefill: {}\n  decode: {}\ntls:\n  cert_file: server.pem\n"
                            "  key_file: server.key\n")
    [error] = manifest_errors(path)
    assert (error.path, error.line) == ("tls.cert_file", 5)
    assert f"cannot read {tmp_path.resolve() / 'server.pem'}" in error.message
    assert "relative paths start there" in error.hint
    assert main(["validate", str(path), "--no-port-check"]) == 2
    assert "tls.cert_file" in capsys.readouterr().err


def test_lora_adapters_are_read_as_a_replica_reads_them(tmp_path, embedded_shape, embedded_shape_once):
    """tandem validate reads each adapter against the model: a folder that is none, or one of a higher rank than
    lora.max_rank, is reported at its name; a good one passes."""
    from tandem.engine.loader.lora_adapter import write_random_adapter

    good = write_random_adapter(tmp_path / "good", embedded_shape.config, 8)
    wide = write_random_adapter(tmp_path / "wide", embedded_shape.config, 32)
    text = f"""\
pools:
  prefill: {{}}
  decode: {{}}
lora:
  max_rank: 16
  adapters: {{good: {good}, wide: {wide}, missing: {tmp_path / "missing"}}}
"""
    errors = {e.path: e for e in manifest_errors(write_manifest(tmp_path, text))}
    assert set(errors) == {"lora.adapters.wide", "lora.adapters.missing"}
    assert "rank 32 is over this replica's lora.max_rank (16)" in errors["lora.adapters.wide"].message
    assert "adapter_config.json is missing" in errors["lora.adapters.missing"].message
