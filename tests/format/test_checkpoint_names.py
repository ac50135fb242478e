"""The trainer publishes checkpoint names: what ``save_pretrained`` writes, even where a
transformers 5 model keeps its experts fused in memory; a state dict already in
checkpoint format passes through unchanged; the manifest records the form.

The end-to-end test runs a real diff worker process on a real redis-server and
compares every published version with transformers' own ``save_pretrained`` files.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pipeline.config import Settings
from pipeline.format.checkpoints.checkpoint_names import checkpoint_state
from pipeline.store import open_store
from pipeline.versions import chain
from tests import vllm_model as dense
from tests import vllm_moe_model as moe
from tests.pipeline_helpers import assert_same_state, deltasync_env, processes, wait_for
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter


def _saved(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """What transformers' save_pretrained writes for ``model`` in bf16."""
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
    return moe.read_weights(folder)


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in state.items()}


@pytest.mark.parametrize("family", moe.FAMILIES)
def test_fused_experts_in_memory_become_the_saved_checkpoint(family: str, tmp_path: Path) -> None:
    model = moe.load_trainable(moe.build_model(tmp_path / "v0", family))
    in_memory = model.state_dict()
    assert any(n.endswith("experts.gate_up_proj") for n in in_memory)  # fused in memory
    for _ in moe.train_steps(model, 1):
        pass
    saved = _saved(model, tmp_path / "v1")
    assert any(".experts.3." in n for n in saved)  # one tensor per expert on disk
    state, form = checkpoint_state(model)
    assert form == "checkpoint"
    assert_same_state(_bf16(dict(state)), saved, family)
    if family == "mixtral":  # tied embeddings: saved once, as save_pretrained does
        assert "lm_head.weight" in in_memory and "lm_head.weight" not in saved


def test_a_model_already_in_checkpoint_format_passes_through(tmp_path: Path) -> None:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(dense.build_model(tmp_path / "qwen3"))
    state, form = checkpoint_state(model)
    assert form == "checkpoint"
    own = model.state_dict()
    assert list(state) == list(own) or sorted(state) == sorted(own)
    assert all(state[n] is own[n] or torch.equal(state[n], own[n]) for n in own)
    plain = torch.nn.Linear(4, 4)
    state, form = checkpoint_state(plain)
    assert form == "state_dict" and sorted(state) == ["bias", "weight"]


@pytest.mark.slow
def test_emitted_versions_are_the_saved_checkpoints_and_say_so(
    redis_url: str, tmp_path: Path
) -> None:
    """Three runs through a real diff worker: a transformers MoE model in memory
    (``emit_state(step, model)``), the same versions as ``save_pretrained`` files
    (``emit_checkpoint``), and as a state dict in checkpoint format
    (``emit_state(step, mapping)``). Every version of every run rebuilds from the
    store bit for bit as the saved files; the manifests say which form was sent."""
    env = deltasync_env(redis_url, tmp_path)
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    store = open_store(settings.store_url)
    model = moe.load_trainable(moe.build_model(tmp_path / "base", "qwen2_moe"))
    saved: dict[int, dict[str, torch.Tensor]] = {}
    runs = {"moe-model": "checkpoint", "moe-files": None, "moe-dict": "given"}
    emitters = {run: Emitter(run, settings=settings) for run in runs}
    with processes(env, tmp_path / "logs", diff=["worker", "diff"]):
        for step in range(3):
            if step:
                for _ in moe.train_steps(model, 1, seed=step):
                    pass
            folder = tmp_path / f"saved-{step}"
            saved[step] = _saved(model, folder)
            emitters["moe-model"].emit_state(step, model)
            emitters["moe-files"].emit_checkpoint(step, folder / moe.WEIGHTS_FILE)
            emitters["moe-dict"].emit_state(step, saved[step])
        for run in runs:
            wait_for(lambda run=run: chain.list_versions(store, run).head == 2, f"{run} head")
    for run, form in runs.items():
        index = chain.list_versions(store, run)
        assert index.versions == (0, 1, 2)
        for step, expected in saved.items():
            kind = "anchor" if step in index.anchors else "delta"
            assert chain.load_manifest(store, run, kind, step).tensor_form == form, run
            rebuilt = dict(chain.reconstruct_tensors(store, run, step))
            assert_same_state(rebuilt, expected, f"{run} version {step}")


def test_the_manifest_records_the_form_only_when_known() -> None:
    from pipeline.errors import CorruptObjectError
    from pipeline.format.manifest import to_json
    from pipeline.format.manifest_parse import parse_manifest
    from tests.format.test_manifest import sample

    unknown = sample()
    assert b"tensor_form" not in to_json(unknown)  # bytes as before the field existed
    for form in ("checkpoint", "state_dict", "given"):
        recorded = sample(tensor_form=form)
        parsed = parse_manifest(to_json(recorded))
        assert parsed == recorded and parsed.tensor_form == form
    bad = to_json(sample(tensor_form="checkpoint")).replace(b'"checkpoint"', b'"Check Point"')
    with pytest.raises(CorruptObjectError, match="tensor_form"):
        parse_manifest(bad)
