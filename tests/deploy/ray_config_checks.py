"""The checks tests/deploy/test_ray_configs.py runs on the `ray up` configs of deploy/ray/: Ray's own schema and
launcher requirements, which manifest each config's head starts, and whether every pool's replica fits a node type.
Each returns what is wrong, as sentences (or a report), so the tests can also show them failing on broken configs."""

from __future__ import annotations

import json
import math
import re
import shlex
import warnings
from argparse import Namespace
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jsonschema
import ray.autoscaler
import yaml

from tandem.cluster.cli import build_parser
from tandem.cluster.manifest import Manifest
from tandem.cluster.replica_plans import replica_plan
from tests.deploy.model_shapes import LLAMA3_70B, MIXTRAL_8X22B


ROOT = Path(__file__).resolve().parents[2]
# The `ray up` configs. fake-multinode.yaml is Ray's fake multi-node provider, which `ray start` runs on one machine
# (tests/cluster/test_ray_autoscaler.py checks it with these same functions, and runs it).
FAKE_MULTINODE = ROOT / "deploy" / "ray" / "fake-multinode.yaml"
CONFIGS = sorted(path for path in (ROOT / "deploy" / "ray").glob("*.yaml") if path != FAKE_MULTINODE)
LARGE_MANIFESTS = [ROOT / "deploy" / "manifests" / name for name in ("gpu-llama3-70b.yaml", "gpu-mixtral-8x22b.yaml")]
SHAPES = {"Meta-Llama-3-70B-Instruct": LLAMA3_70B, "Mixtral-8x22B-Instruct-v0.1": MIXTRAL_8X22B}  # by folder name
RAY_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}
SHELL_OPERATOR = set("();<>|&")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# ---- 1. the config as `ray up` reads it ----------------------------------------------------------------------


@lru_cache(maxsize=1)
def ray_schema() -> dict:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def schema_errors(config: dict) -> list[str]:
    """Every way config breaks the installed ray's ray-schema.json, as 'path: message', in path order. The
    validator is the draft the schema's $schema names (draft-07 in ray 2.60)."""
    schema = ray_schema()
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    errors = sorted(validator(schema).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message}" for e in errors]


def launcher_errors(config: dict) -> list[str]:
    """What ray's cluster launcher requires beyond the schema (ray 2.60, autoscaler/_private/): SSH needs
    auth.ssh_user (command_runner.py reads auth["ssh_user"]; a config's `auth` replaces the provider defaults'
    whole section). The local provider (local/config.py prepare_local / prepare_manual) needs provider.head_ip and
    provider.worker_ips, or provider.coordinator_address with max_workers, and refuses available_node_types,
    head_node and worker_nodes. Cloud providers need available_node_types and head_node_type (util.py
    check_legacy_fields)."""
    errors = []
    if not (config.get("auth") or {}).get("ssh_user"):
        errors.append("auth.ssh_user: missing; ray's SSH runner needs the user to log in as")
    provider = config.get("provider") or {}
    if provider.get("type") != "local":
        errors += [f"{key}: missing" for key in ("available_node_types", "head_node_type") if key not in config]
        return errors
    errors += [f"{key}: the local provider refuses it (one node type, made by ray)"
               for key in ("available_node_types", "head_node", "worker_nodes") if config.get(key)]
    if "coordinator_address" in provider:
        if "max_workers" not in config:
            errors.append("max_workers: required with provider.coordinator_address")
        return errors
    head, workers = provider.get("head_ip"), provider.get("worker_ips")
    if not isinstance(head, str) or not head:
        errors.append("provider.head_ip: missing; the local provider needs the head's address (or a "
                      "coordinator_address)")
    if not isinstance(workers, list) or not all(isinstance(ip, str) and ip for ip in workers):
        errors.append("provider.worker_ips: missing or not a list of addresses")
    elif len(set(workers)) != len(workers) or head in workers:
        errors.append("provider.worker_ips: an address listed twice, or the head's among them")
    return errors


# ---- the shell commands of a config -----------------------------------------------------------------------------


def shell_words(command: str) -> list[str]:
    """command split as bash would, with its operators (; && > & ...) as words of their own."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def invocations(commands: list[str], *program: str) -> list[list[str]]:
    """The arguments of every `program ...` (e.g. "ray", "start") in commands, each up to the next operator."""
    found = []
    for words in map(shell_words, commands):
        for i in range(len(words) - len(program) + 1):
            if tuple(words[i:i + len(program)]) == program:
                args = []
                for word in words[i + len(program):]:
                    if set(word) <= SHELL_OPERATOR:
                        break
                    args.append(word)
                found.append(args)
    return found


def ray_start_offers(commands: list[str]) -> dict[str, float]:
    """What the one `ray start` in commands declares (--num-cpus, --num-gpus, --resources), parsed by ray's own
    command line (an unknown flag fails here as it would on the node)."""
    with warnings.catch_warnings():  # importing ray's CLI imports Ray Serve, whose pydantic models warn
        warnings.simplefilter("ignore")
        from ray.scripts.scripts import start

    [args] = invocations(commands, "ray", "start")
    params = start.make_context("ray start", list(args)).params
    offers = {name: float(value) for name, value in json.loads(params["resources"] or "{}").items()}
    for flag, name in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        if params[flag] is not None:
            offers[name] = float(params[flag])
    return offers


def head_tandem_up(config: dict) -> Namespace:
    """The one `tandem up` of the head's start commands, parsed by tandem's own command line."""
    [args] = invocations(config["head_start_ray_commands"], "tandem", "up")
    return build_parser().parse_args(["up", *args])


def shipped(config: dict, remote: str) -> Path | None:
    """The local file that file_mounts ships to remote (mounted itself or in a mounted folder), None if none.
    Local paths are relative to where `ray up` runs: the repository root."""
    for mount, local in (config.get("file_mounts") or {}).items():
        mount = mount.rstrip("/")
        if remote == mount or remote.startswith(mount + "/"):
            base = Path(local).expanduser()
            return (base if base.is_absolute() else ROOT / base) / remote[len(mount):].lstrip("/")
    return None


def paired_manifest(config: dict) -> Path:
    """The manifest the head's `tandem up` starts, as the file in this repository that file_mounts ships there."""
    remote = head_tandem_up(config).manifest
    local = shipped(config, remote)
    assert local is not None, f"no file_mounts entry ships {remote}, which the head's `tandem up` starts"
    return local


# ---- 2. the manifest against the node types ---------------------------------------------------------------------


@dataclass(frozen=True)
class NodeType:
    name: str
    offers: dict[str, float]  # what one node advertises to Ray; no "CPU": Ray counts them when it starts
    max_workers: int  # 0 for the head
    is_head: bool


def node_types(config: dict) -> list[NodeType]:
    """The config's node types with what each node will advertise: the flags of its `ray start`, overridden on a
    cloud by its node type's `resources` (RAY_OVERRIDE_RESOURCES, which wins over flags: ray 2.60
    _private/resource_and_label_spec.py _merge_resources). The local provider passes no override (its one node
    type has no resources), so there the flags are all. The fake multi-node provider runs no start commands: its
    nodes offer their node type's `resources` (the head, those of its `ray start` flags, which the config repeats)."""
    if config["provider"]["type"] == "fake_multinode":
        head_flags = worker_flags = {}
    else:
        head_flags = ray_start_offers(config["head_start_ray_commands"])
        worker_flags = ray_start_offers(config["worker_start_ray_commands"])
    if config["provider"]["type"] == "local":
        return [NodeType("provider.head_ip", head_flags, 0, True),
                NodeType("provider.worker_ips", worker_flags, cluster_max_workers(config), False)]
    types = []
    for name, node_type in config["available_node_types"].items():
        is_head = name == config["head_node_type"]
        offers = (head_flags if is_head else worker_flags) | {k: float(v) for k, v in node_type["resources"].items()}
        types.append(NodeType(name, offers, 0 if is_head else node_type.get("max_workers", config["max_workers"]),
                              is_head))
    return types


def cluster_max_workers(config: dict) -> int:
    """How many worker nodes the cluster may have: on the local provider, no more than its listed machines (ray
    caps max_workers there: local/config.py prepare_manual)."""
    if config["provider"]["type"] == "local":
        machines = len(config["provider"]["worker_ips"])
        return min(config.get("max_workers", machines), machines)
    return config["max_workers"]


@dataclass(frozen=True)
class FitReport:
    problems: list[str]  # a replica that could not be placed, or a node type that could never serve
    notes: list[str]  # what the file leaves to the node (CPUs Ray counts when it starts)


def _amounts(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def fit_report(config: dict, manifest: Manifest) -> FitReport:
    """Whether the config's nodes can hold the manifest's replicas, up to each pool's replicas.max."""
    types = node_types(config)
    problems, notes = [], []
    asked = {name for _, pool in manifest.pool_items() for name in pool.resources.custom}
    for t in types:
        if t.is_head:
            if t.offers.get("GPU") != 0:
                problems.append(f"head node type {t.name} offers GPUs ({t.offers.get('GPU', 'all it has')}): "
                                f"give it GPU: 0 (--num-gpus=0) so that no replica lands there")
            if taken := sorted(asked & set(t.offers)):
                problems.append(f"head node type {t.name} offers {', '.join(taken)}: a replica could land there")
        problems += [f"node type {t.name} offers {name!r}, which no pool of the manifest asks for (misspelt?)"
                     for name in sorted(set(t.offers) - RAY_BUILTIN_RESOURCES - asked)]
    workers = [t for t in types if not t.is_head]
    nodes = Counter()
    for pool_name, pool in manifest.pool_items():
        need = replica_plan(manifest, pool_name, 0).bundle  # a replica's ranks together: one bundle, one node
        what = (f"pool {pool_name}: one replica is {pool.parallelism.world_size} ranks x "
                f"{_amounts(pool.resources.bundle())} = {_amounts(need)}")
        best, short = None, []
        for t in workers:
            counted = {k: v for k, v in need.items() if k != "CPU" or "CPU" in t.offers}
            per_node = min((math.floor(t.offers.get(k, 0.0) / v + 1e-9) for k, v in counted.items()),
                           default=pool.replicas.max)  # a replica that asks for nothing fits anywhere
            if per_node < 1:
                short.append(f"{t.name} offers " + ", ".join(f"{k} {t.offers.get(k, 0.0):g}" for k, v in
                                                              counted.items() if t.offers.get(k, 0.0) < v))
                continue
            if "CPU" in need and "CPU" not in t.offers:
                notes.append(f"{what}: node type {t.name} leaves its CPU count to Ray; it needs {need['CPU']:g}")
            if best is None or per_node > best[1]:
                best = (t, per_node)
        if best is None:
            problems.append(f"{what}, which no worker node type holds ({'; '.join(short) or 'there is none'})")
            continue
        t, per_node = best
        nodes[t.name] += math.ceil(pool.replicas.max / per_node)
    for t in workers:
        if nodes[t.name] > t.max_workers:
            problems.append(f"node type {t.name}: the replicas.max of the pools it serves need {nodes[t.name]} "
                            f"node(s), but its max_workers is {t.max_workers}")
    if sum(nodes.values()) > cluster_max_workers(config):
        problems.append(f"max_workers is {cluster_max_workers(config)}, but the pools' replicas.max need "
                        f"{sum(nodes.values())} worker node(s)")
    return FitReport(problems, notes)


def key_problems(config: dict, manifest: Manifest) -> list[str]:
    """Every key_env of the manifest must be exported by the head's start commands, from a file that file_mounts
    ships (`export NAME="$(cat PATH)"`), never written into the config."""
    exports = dict(arg.partition("=")[::2] for args in invocations(config["head_start_ray_commands"], "export")
                   for arg in args)
    problems = []
    for entry in manifest.auth.api_keys:
        if entry.key_env is None:
            continue
        value = exports.get(entry.key_env)
        source = re.fullmatch(r"\$\(cat (\S+)\)", value or "")
        if source is None:
            problems.append(f"the head's start commands do not export {entry.key_env} from a file "
                            f"(export {entry.key_env}=\"$(cat PATH)\"), which the manifest's auth reads")
        elif shipped(config, source[1]) is None:
            problems.append(f"{entry.key_env} is read from {source[1]}, which no file_mounts entry ships")
    return problems


# ---- fixtures ------------------------------------------------------------------------------------------------
