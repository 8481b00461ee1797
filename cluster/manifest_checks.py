"""The manifest checks that need more than the file: the model's shape against each pool's parallelism, the two
pools' KV formats, context lengths, listen ports that are already taken, and the TLS files. Used by `tandem
validate` and by `tandem up` before anything starts. Besides errors, check_file() returns warnings: what a valid
manifest leaves open to other machines (exposure_warnings), and pinned CPUs this machine lacks
(cpu_affinity_warnings)."""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from tandem.cluster.manifest import COLOCATED_HAS_PREFILL, MODE_NEEDS_PREFILL, ApiKey, Manifest, TLSSettings
from tandem.cluster.manifest_yaml import ManifestError, ManifestInvalid, line_map, manifest_from, read_text, read_yaml
from tandem.engine.engine_config import SELF_DRAFT
from tandem.engine.errors import ModelLoadError
from tandem.engine.hardware.cpu_affinity import format_cpus, offered_cpus
from tandem.engine.hardware.device import DEVICES, planned_device
from tandem.router.tls import TLSFileError, check_certificates


def listen_problem(address: str, field: str = "grpc") -> ManifestError | None:
    """Why the router could not listen on address (HOST:PORT, manifest key listen.<field>) on this machine, None
    if it can. The router runs on the node `tandem up` runs on, so this machine is the one that matters."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        return None  # malformed: the schema reports it
    if int(port) == 0:
        return None
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As the router's servers bind: connections of a server that just stopped, in TIME_WAIT, leave the port
        # free; a socket listening there does not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return ManifestError(f"listen.{field}", f"{address} is already in use",
                                     "stop what listens there (`tandem down`?) or pick another port")
            return ManifestError(f"listen.{field}", f"cannot listen on {address}: {e.strerror}",
                                 "the router listens on the machine `tandem up` runs on; use one of its addresses "
                                 "(127.0.0.1, 0.0.0.0, ...)")
    return None


def is_loopback(host: str) -> bool:
    """Whether host (a name or an IP, IPv6 with or without brackets) is this machine's loopback, which only its
    own processes reach. 0.0.0.0, :: and every other name count as reachable from other machines."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warnings(manifest: Manifest, lines: dict[tuple, int] | None = None) -> list[ManifestError]:
    """What a valid manifest leaves open to other machines without protection: a router address beyond
    loopback while no client is authenticated (no auth.api_keys, no tls.client_ca_file), and a ray.host beyond
    loopback (whoever reaches a Ray head's ports can run code on the cluster). Warnings, not errors."""
    warnings = []
    if not manifest.auth.api_keys and not (manifest.tls and manifest.tls.client_ca_file):
        for field in ("grpc", "http"):
            address = getattr(manifest.listen, field)
            if address is not None and not is_loopback(address.rpartition(":")[0]):
                warnings.append(ManifestError(
                    f"listen.{field}", f"{address} is reachable from other machines and auth.api_keys is empty: "
                                       "anyone who reaches it can send requests",
                    "add auth.api_keys or tls.client_ca_file (docs/SECURITY.md), or listen on 127.0.0.1"))
    if not is_loopback(manifest.ray.host):
        warnings.append(ManifestError(
            "ray.host", f"a Ray head that `tandem up` starts listens on {manifest.ray.host}: whoever reaches its "
                        "ports can run code on this machine (Ray checks no credentials unless RAY_AUTH_MODE=token)",
            "keep 127.0.0.1 on one machine; across machines, firewall Ray's ports to the cluster's nodes and turn "
            "on Ray's TLS (docs/SECURITY.md)"))
    return [_at_line(w, lines or {}) for w in warnings]


def cpu_affinity_warnings(manifest: Manifest, lines: dict[tuple, int] | None = None,
                          offered: frozenset[int] | None = None) -> list[ManifestError]:
    """A pool's cpu_affinity naming CPUs this machine does not offer (offered: default offered_cpus(), those
    of this process). Warnings, not errors: the pool's replicas may run on other nodes, which may have them; a
    replica on a node without them fails to start, naming them."""
    offered = offered_cpus() if offered is None else offered
    warnings = []
    for name, pool in manifest.pool_items():
        if pool.cpu_affinity is not None and (missing := set(pool.cpu_affinity) - offered):
            warnings.append(ManifestError(
                f"pools.{name}.cpu_affinity", f"CPU(s) {format_cpus(missing)} are not on this machine, which offers "
                                              f"CPUs {format_cpus(offered)}: a replica started here would fail",
                "fine if the pool's replicas run on nodes that have them; else list CPUs this machine has (nproc)"))
    return [_at_line(w, lines or {}) for w in warnings]


def _at_line(error: ManifestError, lines: dict[tuple, int]) -> ManifestError:
    """error with the line of the deepest part of its path that the file has."""
    # line_map keys list items by their int index ("auth.api_keys.1" -> ("auth", "api_keys", 1))
    parts = tuple(int(p) if p.isdigit() else p for p in error.path.split(".")) if error.path else ()
    line = next((lines[parts[:k]] for k in range(len(parts), 0, -1) if parts[:k] in lines), None)
    return ManifestError(error.path, error.message, error.hint, line)


def _get(data, *path, default=None):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def _int(value, default: int = 1) -> int | None:
    """value if it is a plain int (else None: pydantic reports the type error), default when absent."""
    if value is None:
        return default
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _gpus_and_device(pool: dict) -> tuple[float | None, str | None]:
    """A pool's per-rank GPUs and its engine.device as written (None where the type is wrong: pydantic says so)."""
    gpus = _get(pool, "resources", "gpus", default=0)
    device = _get(pool, "engine", "device", default="auto")
    ok_gpus = isinstance(gpus, (int, float)) and not isinstance(gpus, bool) and gpus >= 0
    return (gpus if ok_gpus else None), (device if device in DEVICES else None)


def _device_errors(name: str, pool: dict) -> list[ManifestError]:
    """A pool's devices against the GPUs its ranks ask Ray for: CUDA needs a GPU per rank, and a replica split
    over several ranks needs whole GPUs (NCCL runs one rank per GPU)."""
    gpus, device = _gpus_and_device(pool)
    split = [_int(_get(pool, "parallelism", k)) for k in ("tp", "pp", "ep")]
    if gpus is None or device is None or None in split:
        return []
    world_size = split[0] * split[1] * split[2]
    errors = []
    if device == "cuda" and gpus == 0:
        errors.append(ManifestError(f"pools.{name}.engine.device", "device: cuda, but the pool's ranks ask for no GPU",
                                    f"give each rank a GPU (pools.{name}.resources.gpus: 1), or set device: cpu"))
    speculative = _get(pool, "engine", "speculative")  # read by the replicas that decode only
    if (name == "decode" and planned_device(device, gpus) == "cuda" and isinstance(speculative, dict)
            and speculative.get("proposer") == "draft" and speculative.get("draft", SELF_DRAFT) == SELF_DRAFT):
        errors.append(ManifestError(
            f"pools.{name}.engine.speculative.draft", "the draft 'self' (the target's GGUF weights packed 4-bit) runs "
            "on the CPU only, and this pool computes on CUDA", "name a smaller model of the same vocabulary as the "
            "draft, or use the suffix or ngram proposer"))
    if world_size > 1 and 0 < gpus < 1:
        errors.append(ManifestError(
            f"pools.{name}.resources.gpus", f"{gpus:g} of a GPU per rank, but a replica of this pool has "
                                            f"{world_size} ranks, which NCCL runs one per GPU",
            "give each rank a whole GPU (gpus: 1), or run the replica as one rank (tp, pp and ep 1) to share a GPU"))
    if gpus > 1 and gpus != int(gpus):
        errors.append(ManifestError(f"pools.{name}.resources.gpus", f"{gpus:g} GPUs per rank",
                                    "Ray hands out fractions below 1 or whole GPUs: use 0.5, 1, 2, ..."))
    return errors


def _load_format(data: dict) -> str:
    """dummy when every pool makes dummy weights (then the model folder needs no weight files), else auto."""
    formats = {str(_get(data, "pools", name, "engine", "load_format", default="auto"))
               for name in ("prefill", "decode") if isinstance(_get(data, "pools", name), dict)}
    return "dummy" if formats == {"dummy"} else "auto"


def _model_errors(model, load_format: str = "auto") -> tuple[list[ManifestError], object]:
    from tandem.engine.loader import load_model

    if not isinstance(model, str):
        return [], None  # a type error pydantic reports
    path = None if model == "embedded" else model
    if path is not None and not Path(path).expanduser().exists():
        hint = (f"generate the small MoE test model with `tandem make-model tiny-moe {path}`"
                if "moe" in Path(path).name else "give a Hugging Face folder, a .gguf file, or `embedded`")
        return [ManifestError("model", f"{path!r} does not exist (relative paths start where tandem runs: "
                                       f"{Path.cwd()})", hint)], None
    try:
        return [], load_model(path, weights=False, progress=False, load_format=load_format)
    except ModelLoadError as e:
        return [ManifestError("model", str(e))], None


def _tls_errors(tls) -> list[ManifestError]:
    """The tls: files that cannot be read or used (the router would fail to start on them), at tls.<field>."""
    if not isinstance(tls, dict):
        return []  # absent, or a type error pydantic reports
    try:
        settings = TLSSettings.model_validate(tls)
    except ValidationError:
        return []  # the schema reports it
    hint = "the router reads these PEM files on the machine `tandem up` runs on (relative paths start there)"
    errors = []
    try:
        settings.router_config().check()
    except TLSFileError as e:
        errors.append(ManifestError(f"tls.{e.field}", str(e), hint))
    if settings.ca_file is not None:
        try:
            check_certificates(settings.ca_file, "ca_file")
        except TLSFileError as e:
            errors.append(ManifestError("tls.ca_file", str(e), hint))
    return errors


def _lora_errors(data: dict, config) -> list[ManifestError]:
    """Each adapter of the lora section read as a replica will read it (engine/loader/lora_adapter.py)."""
    from tandem.engine.loader.lora_adapter import check_adapter

    lora = data.get("lora")
    if not isinstance(lora, dict) or not isinstance(lora.get("adapters"), dict):
        return []
    max_rank = lora.get("max_rank", 16) if isinstance(lora.get("max_rank", 16), int) else 256
    errors = []
    for name, path in lora["adapters"].items():
        if not isinstance(path, str):
            continue
        try:
            check_adapter(Path(path).expanduser(), config, max_rank)
        except ValueError as e:
            errors.append(ManifestError(f"lora.adapters.{name}", str(e),
                                        "give a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors)"))
    return errors


def check_manifest(data: dict, lines: dict[tuple, int] | None = None, *,
                   check_ports: bool = True) -> list[ManifestError]:
    """The problems a structurally valid manifest can still have, checked on the parsed YAML (so that they are
    reported beside pydantic's own errors, not after them): the model, each pool's split of it, the two pools'
    KV formats, context lengths, the listen port, SLO admission without a TTFT SLO. Parts with the wrong type
    are skipped (pydantic reports them)."""
    from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout

    lines = lines or {}
    errors, loaded = _model_errors(data.get("model", "embedded"), _load_format(data))
    pools = [name for name in ("prefill", "decode") if isinstance(_get(data, "pools", name), dict)]
    if loaded is not None:
        config = loaded.config
        errors += _lora_errors(data, config)
        for name in pools:
            split = [_int(_get(data, "pools", name, "parallelism", k)) for k in ("tp", "pp", "ep")]
            if None in split or min(split) < 1:
                continue
            tp, pp, ep = split
            try:
                ReplicaLayout.build(ParallelConfig(tp=tp, pp=pp, ep=ep), num_layers=config.num_layers,
                                    num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                                    num_experts=config.num_experts)
            except ValueError as e:
                errors.append(ManifestError(
                    f"pools.{name}.parallelism", f"impossible for this model: {e}",
                    f"the model has {config.num_layers} layers, {config.num_heads} attention heads, "
                    f"{config.num_kv_heads} KV heads and {config.num_experts} experts"))
            limit = _int(_get(data, "pools", name, "engine", "max_model_len"), None)
            if limit is not None and limit > config.max_position_embeddings:
                errors.append(ManifestError(f"pools.{name}.engine.max_model_len",
                                            f"{limit} exceeds the model's context ({config.max_position_embeddings})"))
    mode = data.get("mode", "disaggregated")
    if mode == "disaggregated" and "prefill" not in pools:
        errors.append(ManifestError("mode", MODE_NEEDS_PREFILL))
    if mode == "colocated" and "prefill" in pools:
        errors.append(ManifestError("mode", COLOCATED_HAS_PREFILL))
    for name in pools:
        errors += _device_errors(name, _get(data, "pools", name))
    if mode == "disaggregated" and len(pools) == 2:
        # The KV dtypes may differ (the decode pool converts what arrives: kv_conversion says what it costs); the
        # block size may not.
        sizes = {name: _get(data, "pools", name, "engine", "block_size", default=16) for name in pools}
        if sizes["prefill"] != sizes["decode"]:
            errors.append(ManifestError(
                "pools.decode.engine.block_size", f"differs from the prefill pool's ({sizes['prefill']} vs "
                f"{sizes['decode']})", "KV blocks are copied block for block: both pools must agree"))
    addresses = {"grpc": _get(data, "listen", "grpc", default="127.0.0.1:50051"), "http": _get(data, "listen", "http")}
    for field, address in addresses.items():
        if check_ports and isinstance(address, str) and (problem := listen_problem(address, field)) is not None:
            errors.append(problem)
    http = addresses["http"]
    if http is not None and http == addresses["grpc"] and not http.endswith(":0"):
        errors.append(ManifestError("listen.http", f"{http} is also the gRPC address",
                                    "give the HTTP API a port of its own"))
    ray_host = _get(data, "ray", "host")
    if isinstance(ray_host, str) and ray_host.strip("[]") in ("0.0.0.0", "::"):
        errors.append(ManifestError(
            "ray.host", f"{ray_host} is not an address other nodes can reach the Ray head at",
            "give this machine's address on the cluster's network (Ray then listens on all interfaces anyway), "
            "or 127.0.0.1 to keep Ray on this machine"))
    keys = _get(data, "auth", "api_keys", default=[])
    for i, entry in enumerate(keys if isinstance(keys, list) else []):
        try:
            key = ApiKey.model_validate(entry)
        except ValidationError:
            continue  # the schema reports it
        try:
            key.resolve()
        except ValueError as e:  # a variable that is not set, a file that cannot be read
            errors.append(ManifestError(f"auth.api_keys.{i}", str(e),
                                        "keys are read by `tandem up`, from its environment and files"))
    if _get(data, "router", "admission") == "slo" and _get(data, "slo", "ttft_s") is None:
        errors.append(ManifestError("router.admission", "admission 'slo' needs a TTFT SLO to admit against",
                                    "set slo.ttft_s (seconds), or use admission: queue_timeout"))
    errors += _tls_errors(data.get("tls"))
    return [_at_line(e, lines) for e in errors]


def kv_conversion(manifest: Manifest, *, measure_tokens: int = 1024) -> str | None:
    """What a disaggregated manifest's KV transfers cost when its pools store KV in different dtypes (None when
    they store the same, or the cluster is colocated): the bytes per token each pool's KV takes, that transfers
    carry the prefill pool's, and the time the decode pool spends converting each received token, measured here
    on measure_tokens tokens of the model's KV (on this machine's CPU: a decode pool on a GPU converts there)."""
    if manifest.mode != "disaggregated":
        return None
    import time

    import torch

    from tandem.engine.attention.kv_quant import convert_blocks
    from tandem.engine.kv.kv_cache import KVCacheSpec, kv_dtype_name, kv_storage_dtype
    from tandem.engine.loader import load_model

    pools = {name: manifest.pool(name) for name in ("prefill", "decode")}
    stored = {name: kv_storage_dtype(p.engine.kv_cache_dtype, getattr(torch, p.dtype)) for name, p in pools.items()}
    if stored["prefill"] == stored["decode"]:
        return None
    config = load_model(manifest.model_path, weights=False, progress=False).config
    block = pools["decode"].engine.block_size
    per_token = {name: KVCacheSpec(config.num_layers, 1, block, config.num_kv_heads, config.head_dim, dtype)
                 .bytes_per_block / block for name, dtype in stored.items()}
    blocks = -(-measure_tokens // block)
    values = torch.randn(config.num_layers, 2, blocks, config.num_kv_heads, block, config.head_dim)
    sent = convert_blocks(values, block, stored["prefill"])
    start = time.perf_counter()
    convert_blocks(sent, block, stored["decode"])
    seconds = (time.perf_counter() - start) * 1000 / (blocks * block)
    names = {name: kv_dtype_name(dtype) for name, dtype in stored.items()}
    return (f"KV transfer converts on receive: the prefill pool stores {names['prefill']} KV "
            f"({per_token['prefill'] / 1024:.1f} KiB/token), the decode pool {names['decode']} "
            f"({per_token['decode'] / 1024:.1f} KiB/token). Transfers carry {per_token['prefill'] / 1024:.1f} KiB "
            f"per token and the decode pool converts each received block: {seconds * 1e3:.1f} ms per 1,000 "
            f"tokens measured on this machine's CPU, on the receiving rank's transfer thread")


@dataclass(frozen=True)
class CheckedManifest:
    manifest: Manifest
    warnings: list[ManifestError]  # exposure_warnings() and cpu_affinity_warnings(), with lines: valid all the same


def validate_file(path: str | Path, *, check_ports: bool = True) -> Manifest:
    """Parses and checks a manifest file. Raises ManifestInvalid listing every error, in file order."""
    return check_file(path, check_ports=check_ports).manifest


def check_file(path: str | Path, *, check_ports: bool = True) -> CheckedManifest:
    """validate_file, and the warnings of a manifest that is valid. Raises ManifestInvalid."""
    path = Path(path)
    text = read_text(path)
    data, lines = read_yaml(text, str(path)), line_map(text)
    try:
        manifest, errors = manifest_from(data, lines, str(path)), []
    except ManifestInvalid as e:
        # The schema's mode rules run only when every field is valid, and without a line: check_manifest
        # reports them always, at `mode:`.
        manifest = None
        mode_rules = (MODE_NEEDS_PREFILL, COLOCATED_HAS_PREFILL)
        errors = [x for x in e.errors if not (x.path == "" and x.message in mode_rules)]
    errors += check_manifest(data, lines, check_ports=check_ports)
    if errors:
        raise ManifestInvalid(str(path), sorted(errors, key=lambda e: e.line or 0))
    return CheckedManifest(manifest, exposure_warnings(manifest, lines) + cpu_affinity_warnings(manifest, lines))
