"""The tandem Helm chart rendered offline with Helm's own library (helm-python-sdk: Helm v4's Go SDK in a wheel, no
helm binary, no cluster), and the parts of what it renders that the deploy tests read."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tandem"
# The chart's defaults, and the value sets of ci/ by name (cpu-demo, gpu-one-node, gpu-multi-node).
VALUE_SETS = {"default": None, **{p.name.removesuffix("-values.yaml"): p
                                  for p in sorted((CHART / "ci").glob("*-values.yaml"))}}
RELEASE, NAMESPACE = "demo", "serving"


def values_of(name: str) -> dict | None:
    path = VALUE_SETS[name]
    return None if path is None else yaml.safe_load(path.read_text())


def render(values: dict | None) -> list[dict]:
    """Every object the chart renders for values (the chart's defaults under them), NOTES excluded."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for name, text in sorted(out.items()) if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def merged(name: str) -> dict:
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values_of(name))


def manifest_text(objects: list[dict]) -> str:
    return one(objects, "ConfigMap", f"{RELEASE}-tandem-manifest")["data"]["manifest.yaml"]


def ray_offers(group: dict) -> dict[str, float]:
    """What a worker group's pods offer Ray: GPUs and CPUs from the container's limits, custom resources from
    rayStartParams (KubeRay's quoted JSON, '"{\\"name\\": n}"')."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    offers = {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}
    raw = group["rayStartParams"].get("resources")
    if raw is not None:
        assert raw.startswith('"') and raw.endswith('"'), raw
        offers |= json.loads(raw[1:-1].replace('\\"', '"'))
    return offers


def control_pod(objects: list[dict]) -> dict:
    groups = one(objects, "RayCluster")["spec"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == "control")["template"]
