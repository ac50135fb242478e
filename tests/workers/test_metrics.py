"""/metrics of a real diff worker and a real rollout node, scraped over HTTP after real
versions: the series exist and their values match what the store holds."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pipeline import metrics
from pipeline.config import Settings
from pipeline.store import open_store
from pipeline.testing import synthetic
from pipeline.versions import chain
from tests.pipeline_helpers import deltasync_env, processes, wait_for
from workers import queues
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter

ROOT = Path(__file__).resolve().parents[2]
RUN = "metrics"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    return sum(found) if found else None


def scraped(port: int, check: Callable[[list[Sample]], bool]) -> Callable[[], bool]:
    def condition() -> bool:
        try:
            return check(scrape(port))
        except OSError:
            return False  # not serving yet

    return condition


def test_worker_and_rollout_node_serve_the_series_of_real_versions(
    redis_url: str, tmp_path: Path
) -> None:
    diff_port, node_port = _free_port(), _free_port()
    env = deltasync_env(redis_url, tmp_path)
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    emitter = Emitter(RUN, settings=settings)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    store = open_store(settings.store_url)
    worker_env = {**env, "DELTASYNC_METRICS_PORT": str(diff_port)}
    node_env = {**env, "DELTASYNC_METRICS_PORT": str(node_port)}

    with processes(worker_env, tmp_path / "logs", diff=["worker", "diff"]):
        state = generator.state()
        emitter.emit_state(0, state)
        wait_for(lambda: chain.list_versions(store, RUN).head == 0, "the anchor")
        with processes(
            node_env,
            tmp_path / "node-logs",
            node=["rollout", "--run", RUN, "--node-id", "n1", "--poll", "0.2"],
        ):
            wait_for(
                scraped(node_port, lambda s: value(s, "deltasync_replica_version") == 0),
                "the node at v0",
            )
            for step in (1, 2):
                emitter.emit_state(step, generator.step())
            wait_for(
                scraped(node_port, lambda s: value(s, "deltasync_replica_version") == 2),
                "the node at v2",
            )
            # A step whose checkpoint is gone: the diff job refuses it.
            queues.enqueue_diff(
                emitter.runtime.redis,
                queues.DiffArgs(RUN, 3, str(tmp_path / "gone"), owned=False),
            )
            wait_for(
                scraped(diff_port, lambda s: bool(value(s, "deltasync_refusals_total"))),
                "a refusal",
            )
            worker = scrape(diff_port)
            node = scrape(node_port)

    deltas = [chain.load_manifest(store, RUN, "delta", v) for v in (1, 2)]
    delta_bytes = float(sum(m.total_bytes for m in deltas))
    anchor_bytes = float(chain.load_manifest(store, RUN, "anchor", 0).total_bytes)
    assert 0 < delta_bytes < anchor_bytes

    # The diff worker: one anchor and two deltas, their bytes, their latencies.
    assert value(worker, "deltasync_versions_published_total", run=RUN, kind="anchor") == 1
    assert value(worker, "deltasync_versions_published_total", run=RUN, kind="delta") == 2
    assert value(worker, "deltasync_bytes_up_total", run=RUN, kind="delta") == delta_bytes
    assert value(worker, "deltasync_bytes_up_total", run=RUN, kind="anchor") == anchor_bytes
    assert value(worker, "deltasync_step_to_available_seconds_count", run=RUN) == 2
    available_s = value(worker, "deltasync_step_to_available_seconds_sum", run=RUN)
    assert available_s is not None and 0 < available_s < 3600
    assert value(worker, "deltasync_refusals_total", run=RUN, role="diff") is not None
    assert value(worker, "deltasync_queue_depth", queue=queues.DIFF_QUEUE) is not None
    assert value(worker, "deltasync_queue_depth", queue=queues.COMPACT_QUEUE) == 0

    # The rollout node: a bootstrap from the anchor, then both deltas, at the head.
    assert value(node, "deltasync_versions_applied_total", run=RUN, kind="anchor") == 1
    assert value(node, "deltasync_versions_applied_total", run=RUN, kind="delta") == 2
    assert value(node, "deltasync_bytes_down_total", run=RUN, kind="delta") == delta_bytes
    assert value(node, "deltasync_bytes_down_total", run=RUN, kind="anchor") == anchor_bytes
    assert value(node, "deltasync_pause_seconds_count", run=RUN, kind="delta") == 2
    pause_s = value(node, "deltasync_pause_seconds_sum", run=RUN, kind="delta")
    assert pause_s is not None and 0 < pause_s < 600
    assert value(node, "deltasync_replica_lag_versions", run=RUN, node="n1") == 0
    assert value(node, "deltasync_replica_version", run=RUN, node="n1") == 2
    applied_count = value(node, "deltasync_step_to_applied_seconds_count", run=RUN)
    assert applied_count is not None and 1 <= applied_count <= 3
    assert value(node, "deltasync_refusals_total", run=RUN) is None  # nothing refused


# --- what compose and the dashboard name -----------------------------------------------

SUFFIXES = ("", "_total", "_bucket", "_count", "_sum")


def _families() -> set[str]:
    """Names of the metric families deltasync serves."""
    names = {"deltasync_queue_depth", "deltasync_queue_failed_jobs"}
    for obj in vars(metrics).values():
        if isinstance(obj, Counter | Gauge | Histogram):
            names |= {family.name for family in obj.describe()}
    return names


def test_the_dashboard_shows_every_metric_and_queries_only_real_series() -> None:
    dashboard = json.loads((ROOT / "docker" / "grafana" / "deltasync.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"deltasync_[a-z_]+", e)}
    families = _families()
    series = {f + suffix for f in families for suffix in SUFFIXES}
    assert used and not used - series, f"queried but never served: {used - series}"
    shown = {f for f in families if any(u in {f + x for x in SUFFIXES} for u in used)}
    assert shown == families, f"not on the dashboard: {families - shown}"


def test_prometheus_scrapes_every_deltasync_service_on_the_metrics_port() -> None:
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    port = compose["x-env"]["DELTASYNC_METRICS_PORT"]
    assert port == "${DELTASYNC_METRICS_PORT:-9464}"
    scraped_names = {
        name
        for job in config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        if sd["port"] == 9464
        for name in sd["names"]
    }
    deltasync = {
        name
        for name, service in compose["services"].items()
        if "dockerfile" in service.get("build", {})
        or str(service.get("image", "")).startswith("${DELTASYNC_")
    }
    assert deltasync == scraped_names


def test_a_taken_port_leaves_the_process_working_without_an_endpoint() -> None:
    from workers import metrics_http

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert metrics_http.serve_metrics(port) is None  # logged, not raised
        assert metrics_http.serve_metrics(0) is None  # off
