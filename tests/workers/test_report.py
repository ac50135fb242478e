"""`deltasync report` on a real run: real diff jobs and rollout nodes write the events,
the real CLI draws them; the PNG is read back (size, and pixels of each panel)."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import Settings
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.targets.torch import TorchTarget
from pipeline.testing import synthetic
from pipeline.versions.history import build, collect
from tests.pipeline_helpers import cli, deltasync_env
from workers.jobs import diff
from workers.report import COLOURS, DPI, HEIGHT_IN, NODE_COLOURS, WIDTH_IN, render_png
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter

mpimg = pytest.importorskip("matplotlib.image", reason="the report extra is not installed")

RUN = "pictured"
STEPS = 7


def rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])


def pixels_of(image: np.ndarray, colour: str) -> int:
    """Pixels within a small distance of ``colour`` (lines are antialiased at the edges)."""
    distance = np.abs(image[..., :3] - rgb(colour)).max(axis=-1)
    return int((distance < 0.06).sum())


@pytest.fixture
def real_run(redis_url: str, tmp_path: Path) -> dict[str, str]:
    """Seven versions through real diff jobs; node a follows every one, node b joins late
    and syncs every third version, so it lags."""
    env = deltasync_env(redis_url, tmp_path, DELTASYNC_COMPACT_MAX_CHAIN="100")
    settings = Settings.from_env(env)
    runtime = Runtime(settings)
    set_current(runtime)
    emitter = Emitter(RUN, settings=settings)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=7)
    state = generator.state()

    def node(name: str) -> RolloutNode:
        target = TorchTarget({n: torch.empty_like(t) for n, t in state.items()})
        return RolloutNode(runtime.store, RUN, target, NodeOptions(node_id=name, prefetch=False),
                           events=EventStream(runtime.redis, RUN), redis=runtime.redis)  # fmt: skip

    a, b = node("node-a"), node("node-b")
    for step in range(STEPS):
        if step:
            state = generator.step()
        emitted = emitter.emit_state(step, state)
        diff.diff_job(RUN, step, emitted.checkpoint, owned=True)
        a.step_once()
        if step in (2, 5, STEPS - 1):
            b.step_once()
    assert a.applied_version == b.applied_version == STEPS - 1
    return env


def test_report_of_a_real_run_png_data_and_html_page(
    real_run: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "run.png"
    done = cli(real_run, "report", "--run", RUN, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"{STEPS} versions, 2 replicas" in done.stdout
    image = mpimg.imread(str(out))
    assert image.shape[:2] == (round(HEIGHT_IN * DPI), round(WIDTH_IN * DPI))
    assert (image[2, 2, :3] == 1.0).all()  # a white margin
    height, width = image.shape[:2]
    top_left = image[: height // 2, : width // 2]
    top_right = image[: height // 2, width // 2 :]
    bottom_left = image[height // 2 :, : width // 2]
    bottom_right = image[height // 2 :, width // 2 :]
    # Bars of the changed fraction, top left; no replica colour there.
    assert pixels_of(top_left, COLOURS[0]) > 500
    assert pixels_of(top_left, NODE_COLOURS[0]) == 0
    # Delta bytes, raw bytes and the full checkpoint, top right.
    for colour in (COLOURS[0], COLOURS[4], COLOURS[2]):
        assert pixels_of(top_right, colour) > 50, colour
    # Both latency lines, bottom left.
    assert pixels_of(bottom_left, COLOURS[0]) > 50 and pixels_of(bottom_left, COLOURS[1]) > 50
    # One lag line per replica, bottom right.
    assert pixels_of(bottom_right, NODE_COLOURS[0]) > 50
    assert pixels_of(bottom_right, NODE_COLOURS[1]) > 50

    # The data behind it.
    runtime = Runtime(Settings.from_env(real_run))
    report = collect(runtime.redis, runtime.store, RUN)
    assert [r.version for r in report.versions] == list(range(STEPS))
    assert report.versions[0].kind == "anchor"
    assert report.full_bytes == sum(
        t.numel() * 2 for t in synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"))
        .state().values()
    )  # fmt: skip
    for row in report.versions[1:]:
        assert row.kind == "delta" and 0 < row.changed < row.total
        assert row.changed_fraction is not None and 0 < row.changed_fraction < 1
        assert 0 < row.bytes < report.raw_bytes(row) < report.full_bytes
        assert row.available_s is not None and row.synced_s is not None
        assert row.synced_s >= row.available_s
    assert sorted(report.versions[-1].applied_at) == ["node-a", "node-b"]
    assert max(v for _, v in report.lag["node-b"]) >= 2  # it lagged
    assert report.lag["node-a"][-1][1] == report.lag["node-b"][-1][1] == 0  # both caught up

    page = tmp_path / "run.html"
    done = cli(real_run, "report", "--run", RUN, "--out", str(page), "--html")
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert not re.search(r"(src|href)=['\"]https?:", text)  # nothing to fetch
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)[1])
    assert mpimg.imread(io.BytesIO(png), format="png").shape[:2] == (900, 1200)
    assert text.count("<tr>") == STEPS + 1


def test_a_run_without_versions_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no published version"):
        render_png(build("empty", [], 0, 0))
