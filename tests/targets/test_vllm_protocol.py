"""What crosses the vLLM RPC boundary (pipeline/targets/vllm/protocol.py), and that
importing pipeline/ changes no process state. No engine needed: vLLM is not imported."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch

from pipeline.errors import TargetError
from pipeline.format.manifest import TensorEntry
from pipeline.format.tensors import TensorSpec
from pipeline.targets.proving import DEFAULT_PATCH_MEMORY_BYTES
from pipeline.targets.vllm.protocol import (
    PrepareRequest,
    PrepareSummary,
    specs_from_wire,
    specs_to_wire,
)

ENTRY = TensorEntry("w", "bfloat16", (2, 3), "ab" * 16, "part-0.safetensors", 4)


def request() -> PrepareRequest:
    return PrepareRequest(
        version=3,
        verify="touched",
        entries=(ENTRY,),
        objects={"part-0.safetensors": b"\x00\x01"},
        parent_state_hash="cd" * 16,
        content_hash="xxh3-128",
        early={"part-0.safetensors": "ef" * 32},
        patch_memory_bytes=5 << 20,
    )


def test_prepare_request_survives_pickle_and_json_shaped_trips() -> None:
    sent = request()
    wire = sent.wire()
    assert PrepareRequest.parse(pickle.loads(pickle.dumps(wire))) == sent
    # JSON (the server's /collective_rpc) turns the shape into a list, as msgpack does.
    through_json = json.loads(json.dumps({**wire, "objects": {}}))
    assert PrepareRequest.parse({**through_json, "objects": wire["objects"]}) == sent
    assert wire["entries"][0]["name"] == "w"  # named fields, not positions


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"verify": "some"}, r"verify 'some' is not one of touched, all, none"),
        ({"version": "3"}, r"version is str, not int"),
        ({"version": True}, r"version is bool, not int"),
        ({"entries": [["w", "bfloat16", [2, 3], "ab", "o", 4]]}, r"entry is list, not a mapping"),
        ({"entries": [{"name": "w"}]}, r"no dtype"),
        ({"objects": {"k": "a path"}}, r"object 'k' is str, not bytes"),
        ({"early": {"k": 1}}, r"early must map str to str"),
        ({"patch_memory_bytes": -1}, r"patch_memory_bytes is -1, not >= 0"),
        ({"patch_memory_bytes": False}, r"patch_memory_bytes is bool, not int"),
    ],
)
def test_a_bad_prepare_request_is_a_one_line_target_error(
    change: dict[str, Any], message: str
) -> None:
    wire: dict[str, Any] = {**request().wire(), **change}
    with pytest.raises(TargetError, match=rf"^vLLM RPC: bad prepare request: {message}$"):
        PrepareRequest.parse(wire)


def test_a_request_without_a_patch_budget_gets_the_default() -> None:
    wire: dict[str, Any] = request().wire()
    del wire["patch_memory_bytes"]
    assert PrepareRequest.parse(wire).patch_memory_bytes == DEFAULT_PATCH_MEMORY_BYTES


def test_an_entry_of_unknown_dtype_is_refused_at_the_boundary() -> None:
    wire: dict[str, Any] = request().wire()
    wire["entries"] = [{**wire["entries"][0], "dtype": "float7"}]
    with pytest.raises(TargetError, match=r"unknown dtype 'float7'"):
        PrepareRequest.parse(wire)


def test_specs_and_summaries_round_trip() -> None:
    specs = {"a": TensorSpec(torch.bfloat16, (4, 2)), "b": TensorSpec(torch.float32, ())}
    assert specs_from_wire(json.loads(json.dumps(specs_to_wire(specs)))) == specs
    with pytest.raises(TargetError, match=r"^vLLM RPC: bad specs: shape '4' is not a list"):
        specs_from_wire({"a": {"dtype": "bfloat16", "shape": "4"}})
    summary = PrepareSummary(tensors=2, changed=10, early_tensors=1, walked=1)
    assert PrepareSummary.parse(summary.wire()) == summary
    with pytest.raises(TargetError, match="no early_tensors"):
        PrepareSummary.parse({"tensors": 2, "changed": 10})


def test_importing_pipeline_changes_no_process_state() -> None:
    """No module under pipeline/ writes the environment, imports vLLM or installs a
    hook at import: those happen when an engine is started or a worker is built."""
    script = """
import importlib, os, pkgutil, sys
import pipeline
before = dict(os.environ)
for info in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
    importlib.import_module(info.name)
assert dict(os.environ) == before, "environment changed on import"
assert "vllm" not in sys.modules, "vllm imported"
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
