"""deploy/ray/*.yaml, the `ray up` cluster configs, checked offline (no cloud, no credentials, no network):

1. Each validates against ray/autoscaler/ray-schema.json of the installed ray (what `ray up` checks it with,
   every error listed with its path), meets what ray's launcher requires beyond the schema (the local provider's
   head_ip and worker_ips, auth.ssh_user), and passes ray's own preparation (prepare_config + validate_config:
   all that `ray up` does before it calls a cloud).
2. The manifest the config's head starts (the `tandem up PATH` of head_start_ray_commands, PATH shipped by
   file_mounts; both read from the config) fits its node types: for every pool some worker node type offers one
   replica's whole placement-group bundle (world_size x each rank's CPUs, GPUs and custom resources: the ranks
   land together on one node) and there are enough such nodes for replicas.max; the head offers no GPU and none
   of a pool's custom resources; no node type offers a custom resource that no pool asks for (a misspelling
   would leave its pool nowhere to go). What a node offers is what Ray will advertise for it: on a cloud, its
   node type's `resources` (the updater passes them to `ray start` as RAY_OVERRIDE_RESOURCES); on the local
   provider, which has one node type of no resources, the flags of its `ray start` commands.
The checks run on broken copies of the configs too, so that each of them is seen to fail."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tandem.cluster.manifest import Manifest
from tandem.cluster.manifest_checks import validate_file
from tests.deploy.model_shapes import manifest_with_model, write_hf_shaped_folder
from tests.deploy.ray_config_checks import (
    CONFIGS, LARGE_MANIFESTS, RAY_BUILTIN_RESOURCES, ROOT, SHAPES, fit_report, head_tandem_up, invocations,
    key_problems, launcher_errors, load, node_types, paired_manifest, ray_start_offers, schema_errors, shell_words)


@pytest.fixture(autouse=True)
def _load_embedded_once(embedded_shape_once):
    """validate_file loads the embedded model's shape once for the session (tests/conftest.py)."""


@pytest.fixture(scope="module")
def shaped_models(tmp_path_factory, embedded_shape) -> dict[str, Path]:
    """Weight-free folders shaped like the large models, by the folder name the manifests' model: paths end in."""
    root = tmp_path_factory.mktemp("models")
    return {name: write_hf_shaped_folder(root / name, config, embedded_shape.tokenizer)
            for name, config in SHAPES.items()}


@pytest.fixture
def load_manifest(tmp_path, shaped_models, monkeypatch):
    """A manifest as `tandem up` on the head would check it: its model path replaced by the shaped folder of the
    same name, its API key in the environment."""
    monkeypatch.setenv("TANDEM_API_KEY", "sk-test-ray-configs-0123456789")

    def load_manifest(path: Path) -> Manifest:
        text = path.read_text()
        copy_path = tmp_path / path.name
        copy_path.write_text(manifest_with_model(text, shaped_models[Path(yaml.safe_load(text)["model"]).name]))
        return validate_file(copy_path, check_ports=False)

    return load_manifest


def ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


# ---- the shipped configs ----------------------------------------------------------------------------------------


def test_there_is_a_config_for_aws_gcp_and_local_machines():
    assert {load(path)["provider"]["type"] for path in CONFIGS} == {"aws", "gcp", "local"}


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_config_matches_rays_schema_and_launcher(path):
    config = load(path)
    assert schema_errors(config) == []
    assert launcher_errors(config) == []


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_rays_own_preparation_accepts_the_config(path):
    """What `ray up` does with the file before it calls a cloud: defaults merged, the local provider's node type
    made, node type limits filled in, then validate_config (the schema and its cross-field checks)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(load(path))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_the_head_starts_ray_without_gpus_and_tandem_up_in_the_background(path):
    config = load(path)
    head = ray_start_offers(config["head_start_ray_commands"])
    assert head.get("GPU") == 0
    [ray_start] = invocations(config["head_start_ray_commands"], "ray", "start")
    assert "--head" in ray_start and "--autoscaling-config=~/ray_bootstrap_config.yaml" in ray_start
    assert "--dashboard-host=127.0.0.1" in ray_start  # reached through `ray dashboard`, never open
    up = head_tandem_up(config)
    assert up.detach and up.placement_timeout >= 1800 and up.ready_timeout >= 1800
    [command] = [c for c in config["head_start_ray_commands"] if "tandem" in shell_words(c)]
    words = shell_words(command)
    assert words[-1] == "&" and words[words.index("tandem") - 2:words.index("tandem")] == ["setsid", "nohup"]
    assert ">" in words and "/dev/null" in words  # its output in a log, stdin closed: ray up's SSH session returns


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_the_paired_manifest_fits_the_node_types(path, load_manifest):
    config = load(path)
    manifest_path = paired_manifest(config)
    assert manifest_path.parent == ROOT / "deploy" / "manifests" and manifest_path in LARGE_MANIFESTS
    manifest = load_manifest(manifest_path)
    assert manifest.ray.address == "auto"  # joins the cluster `ray up` made
    report = fit_report(config, manifest)
    assert report.problems == []
    expected_notes = 2 if config["provider"]["type"] == "local" else 0  # Ray counts on-prem machines' CPUs
    assert len(report.notes) == expected_notes and all("CPU" in note for note in report.notes)
    assert key_problems(config, manifest) == []


@pytest.mark.parametrize("manifest_path", LARGE_MANIFESTS, ids=ids(LARGE_MANIFESTS))
@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_either_large_manifest_fits_every_config(path, manifest_path, load_manifest):
    """The configs' comments offer the other manifest as a one-line swap: it fits the same node types."""
    assert fit_report(load(path), load_manifest(manifest_path)).problems == []


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_gpu_node_types_follow_the_resource_convention(path):
    """One tandem_<pool> unit per GPU: a node of 8 GPUs serves one 8-rank replica of its pool."""
    for t in node_types(load(path)):
        if t.is_head:
            continue
        custom = {k: v for k, v in t.offers.items() if k not in RAY_BUILTIN_RESOURCES}
        assert custom and set(custom) <= {"tandem_prefill", "tandem_decode"}, t
        assert all(v == t.offers["GPU"] == 8 for v in custom.values()), t


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_node_type_initialization_commands_keep_the_top_level_ones(path):
    """A node type's initialization_commands replace the top-level list for its nodes (ray 2.60
    autoscaler/_private/autoscaler.py _get_node_type_specific_fields): they must repeat it."""
    config = load(path)
    for name, node_type in (config.get("available_node_types") or {}).items():
        if "initialization_commands" in node_type:
            own = node_type["initialization_commands"]
            assert all(command in own for command in config.get("initialization_commands", [])), name


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_every_node_runs_ray_with_token_authentication_from_a_shipped_file(path):
    """Every command Ray runs on a node sources ~/.bashrc: setup_commands put Ray's token mode and the token's
    path there, the path inside a folder file_mounts ships (the user's, made before `ray up`), never a token."""
    config = load(path)
    [setup] = [c for c in config["setup_commands"] if "RAY_AUTH_MODE" in c]
    assert "~/.bashrc" in setup and "export RAY_AUTH_MODE=token" in setup
    token_path = re.search(r'RAY_AUTH_TOKEN_PATH="\$HOME/([^"]+)"', setup).group(1)
    assert any(token_path.startswith(remote.removeprefix("~/") + "/") for remote in config["file_mounts"])
    assert "RAY_AUTH_TOKEN=" not in json.dumps(config)  # no literal token anywhere


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_file_mounts_ship_files_that_exist_and_the_source_without_its_venv(path):
    config = load(path)
    for remote, local in config["file_mounts"].items():
        local_path = Path(local).expanduser()
        if not local.startswith("~"):  # ~/.tandem-secrets is the user's, made before `ray up` (README)
            assert (ROOT / local_path).exists(), f"{remote}: {local} does not exist in the repository"
    if "." in config["file_mounts"].values():  # the repository itself
        assert ".gitignore" in config.get("rsync_filter", []) and "**/.git/**" in config.get("rsync_exclude", [])


# ---- the checks fail where they should ---------------------------------------------------------------------------


@pytest.fixture
def aws() -> dict:
    return load(ROOT / "deploy" / "ray" / "aws-gpu.yaml")


@pytest.fixture
def llama(load_manifest) -> Manifest:
    return load_manifest(ROOT / "deploy" / "manifests" / "gpu-llama3-70b.yaml")


def test_a_decode_node_of_4_gpus_cannot_hold_a_tp4_x_pp2_replica(aws, llama):
    aws["available_node_types"]["decode_gpu"]["resources"] |= {"GPU": 4, "tandem_decode": 4}
    [problem] = fit_report(aws, llama).problems
    assert problem.startswith("pool decode: one replica is 8 ranks x {CPU: 8, GPU: 1, tandem_decode: 1}")
    assert "{CPU: 64, GPU: 8, tandem_decode: 8}" in problem and "decode_gpu offers GPU 4, tandem_decode 4" in problem


def test_a_misspelt_custom_resource_is_reported_twice(aws, llama):
    resources = aws["available_node_types"]["decode_gpu"]["resources"]
    resources["tandem_decdoe"] = resources.pop("tandem_decode")
    problems = fit_report(aws, llama).problems
    assert len(problems) == 2, problems
    assert "node type decode_gpu offers 'tandem_decdoe', which no pool of the manifest asks for" in problems[0]
    assert problems[1].startswith("pool decode:") and "decode_gpu offers tandem_decode 0" in problems[1]


def test_a_head_with_gpus_or_a_pool_resource_is_reported(aws, llama):
    aws["available_node_types"]["head"]["resources"] = {"CPU": 8, "GPU": 8, "tandem_prefill": 8}
    problems = fit_report(aws, llama).problems
    assert [p.split(" offers ")[0] for p in problems] == ["head node type head"] * 2, problems


def test_too_few_nodes_for_replicas_max_are_reported(aws, llama):
    aws["available_node_types"]["prefill_gpu"]["max_workers"] = 2
    aws["max_workers"] = 6
    assert fit_report(aws, llama).problems == [
        "node type prefill_gpu: the replicas.max of the pools it serves need 4 node(s), but its max_workers is 2",
        "max_workers is 6, but the pools' replicas.max need 8 worker node(s)",
    ]


def test_local_workers_are_what_their_ray_start_flags_say(llama):
    config = load(ROOT / "deploy" / "ray" / "local-gpu.yaml")
    [worker] = [t for t in node_types(config) if not t.is_head]
    assert worker.offers == {"GPU": 8, "tandem_prefill": 8, "tandem_decode": 8} and worker.max_workers == 8
    config["worker_start_ray_commands"] = [c.replace("--num-gpus=8", "--num-gpus=4")
                                           for c in config["worker_start_ray_commands"]]
    problems = fit_report(config, llama).problems
    assert len(problems) == 2 and all("offers GPU 4" in p for p in problems), problems

    config = load(ROOT / "deploy" / "ray" / "local-gpu.yaml")
    config["provider"]["worker_ips"] = config["provider"]["worker_ips"][:3]  # max_workers 8 is capped at 3
    assert fit_report(config, llama).problems == [
        "node type provider.worker_ips: the replicas.max of the pools it serves need 8 node(s), but its max_workers "
        "is 3",
        "max_workers is 3, but the pools' replicas.max need 8 worker node(s)"]


def test_a_misspelt_ray_start_flag_fails_as_on_the_node():
    import click

    with pytest.raises(click.NoSuchOption):
        ray_start_offers(["ray start --address=$RAY_HEAD_IP:6379 --num-gpu=8"])


def test_schema_errors_name_their_path(aws):
    aws["available_node_types"]["prefill_gpu"]["resources"]["GPU"] = 8.5  # resources are whole numbers
    aws["available_node_types"]["decode_gpu"]["node_cfg"] = aws["available_node_types"]["decode_gpu"].pop("node_config")
    aws["worker_start_commands"] = aws.pop("worker_start_ray_commands")
    errors = schema_errors(aws)
    assert errors[0].startswith("(top level): Additional properties are not allowed ('worker_start_commands'")
    assert errors[1].startswith("available_node_types.decode_gpu: 'node_config' is a required property")
    assert errors[2].startswith("available_node_types.decode_gpu: Additional properties are not allowed ('node_cfg'")
    assert errors[3] == "available_node_types.prefill_gpu.resources.GPU: 8.5 is not of type 'integer'"
    assert len(errors) == 4, errors


def test_the_local_providers_own_requirements_are_checked():
    from ray.autoscaler._private.util import prepare_config

    config = load(ROOT / "deploy" / "ray" / "local-gpu.yaml")
    del config["provider"]["head_ip"]
    del config["auth"]["ssh_user"]
    config["available_node_types"] = {"gpu": {"resources": {"GPU": 8}, "node_config": {}}}
    assert launcher_errors(config) == [
        "auth.ssh_user: missing; ray's SSH runner needs the user to log in as",
        "available_node_types: the local provider refuses it (one node type, made by ray)",
        "provider.head_ip: missing; the local provider needs the head's address (or a coordinator_address)",
    ]
    with pytest.raises(Exception, match="not supported for on-premise clusters"):  # ray up says so too
        prepare_config(config)


def test_an_api_key_the_head_does_not_export_is_reported(aws, llama):
    aws["head_start_ray_commands"] = [c.replace('export TANDEM_API_KEY="$(cat ~/tandem-secrets/api-key)" &&', "")
                                      for c in aws["head_start_ray_commands"]]
    assert key_problems(aws, llama) == [
        "the head's start commands do not export TANDEM_API_KEY from a file (export TANDEM_API_KEY=\"$(cat PATH)\"), "
        "which the manifest's auth reads"]
    aws = load(ROOT / "deploy" / "ray" / "aws-gpu.yaml")
    del aws["file_mounts"]["~/tandem-secrets"]
    assert key_problems(aws, llama) == [
        "TANDEM_API_KEY is read from ~/tandem-secrets/api-key, which no file_mounts entry ships"]
