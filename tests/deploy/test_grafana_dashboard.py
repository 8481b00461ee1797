"""deploy/grafana/tandem.json (and the Helm chart's copy): the output of deploy/grafana/dashboard.py; a Grafana
dashboard JSON model (loaded through grafana-foundation-sdk's dashboard model, every panel placed on the grid and
reading the Prometheus data source variable); every metric its queries name is one the router's /metrics exports
(taken from a live router over mock replicas); and the chart ships it as a ConfigMap for Grafana's sidecar."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard, RowPanel
from grafana_foundation_sdk.models.prometheus import Dataquery as PrometheusQuery
from prometheus_client.parser import text_string_to_metric_families

from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tests.deploy.helm_render import one, render, values_of
from tests.router.test_http_api import Server

ROOT = Path(__file__).resolve().parents[2]
BUILDER = ROOT / "deploy" / "grafana" / "dashboard.py"
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def _builder():
    spec = importlib.util.spec_from_file_location("tandem_grafana_dashboard", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model() -> dict:
    return json.loads((ROOT / "deploy" / "grafana" / "tandem.json").read_text())


@pytest.fixture(scope="module")
def families() -> dict[str, str]:
    """name -> type of every family the router's /metrics exports (those with no sample yet included): a mock
    cluster after one request, scraped twice (the replicas' counters come with the second)."""
    server = Server([MockDecode("decode-0")], [MockPrefill("prefill-0")])
    try:
        server.client().completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=3)
        httpx.get(f"{server.url}/metrics")
        time.sleep(0.5)
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        server.close()
    return {f.name: f.type for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


@pytest.fixture(scope="module")
def exported(families) -> set[str]:
    """Every sample name /metrics can carry, from its families' types."""
    return {name + suffix for name, kind in families.items() for suffix in SAMPLE_SUFFIXES.get(kind, ("",))}


def test_the_committed_files_are_the_builders_output():
    builder = _builder()
    text = builder.render()
    for path in builder.OUTPUTS:
        assert path.read_text() == text, f"{path} is stale: run .venv/bin/python deploy/grafana/dashboard.py"


def test_it_loads_as_a_grafana_dashboard_with_every_panel_on_the_grid(model):
    register_default_plugins()  # panel and query types decode to their own models (else: untyped bags)
    dashboard = Dashboard.from_json(model)
    # nothing is lost or untyped on the way: the model writes back the same JSON
    assert json.loads(json.dumps(dashboard, cls=JSONEncoder)) == model
    assert dashboard.uid == "tandem-serving" and dashboard.title == "tandem"
    [variable] = dashboard.templating.list_val
    assert (variable.type_val, variable.name, variable.query) == ("datasource", "datasource", "prometheus")
    panels = [p for p in dashboard.panels if not isinstance(p, RowPanel)]
    assert len(panels) >= 30
    cells = set()
    for panel in panels:
        grid = panel.grid_pos
        assert 0 <= grid.x and grid.x + grid.w <= 24 and grid.h > 0, (panel.title, grid)
        cell = (grid.x, grid.y)
        assert cell not in cells, f"two panels at {cell}"
        cells.add(cell)
        assert panel.datasource.uid == "${datasource}" and panel.targets, panel.title
        assert all(isinstance(t, PrometheusQuery) and t.expr for t in panel.targets), panel.title
        refs = [t.ref_id for t in panel.targets]
        assert len(set(refs)) == len(refs) and all(refs), (panel.title, refs)


def test_every_query_names_only_metrics_the_router_exports(model, exported):
    used = set()
    for panel in model["panels"]:
        for target in panel.get("targets", ()):
            used.update(re.findall(r"\btandem_[a-z0-9_]+", target["expr"]))
    missing = sorted(used - exported)
    assert not missing, missing
    # and what issue 49 asks an operator to see is there
    for name in ("tandem_time_to_first_token_seconds_bucket", "tandem_time_per_output_token_seconds_bucket",
                 "tandem_inter_token_latency_seconds_bucket", "tandem_request_queue_seconds_bucket",
                 "tandem_request_prefill_time_seconds_bucket", "tandem_num_preemptions_total",
                 "tandem_prefix_cache_hits_total", "tandem_kv_transfer_bytes_total",
                 "tandem_kv_transfer_seconds_bucket",
                 "tandem_structured_output_requests_total", "tandem_pool_replicas"):
        assert name in used, name


def test_the_chart_ships_it_for_grafanas_sidecar_when_asked(model):
    assert not [o for o in render(None) if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]
    objects = render(values_of("gpu-multi-node"))
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard"))
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    assert json.loads(config_map["data"]["tandem.json"]) == model
    assert one(objects, "ServiceMonitor")  # the metrics it reads are scraped


def test_docs_metrics_lists_every_family(families):
    listed = set(re.findall(r"^\| `(tandem_[a-z0-9_]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), re.M))
    expected = {name + ("_total" if kind == "counter" else "") for name, kind in families.items()}
    assert not expected - listed, sorted(expected - listed)
    assert not listed - expected, sorted(listed - expected)
