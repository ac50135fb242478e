"""What a rollout node gives a target to build itself with (``build_target``).

A registered target class answers ``for_node(setup)``: it builds itself from the
run's store (waiting for the first anchor when it must), a model folder, an engine
already started, or whatever else of ``TargetSetup`` it needs, and returns None
when ``setup.stop`` was set while it waited.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from pipeline.errors import DeltasyncError, StoreError
from pipeline.format.matching import spec_of
from pipeline.format.tensors import TensorSpec
from pipeline.store.base import ObjectStore
from pipeline.targets.base import Target
from pipeline.versions import chain

log = structlog.get_logger(__name__)

ANCHOR_WAIT_S = 2.0

# (anchor version, why it was refused): called while waiting past a bad anchor.
Refused = Callable[[int, DeltasyncError], None]


@dataclass(frozen=True)
class TargetSetup:
    """A rollout node's target, before it exists."""

    store: ObjectStore
    run: str
    stop: threading.Event
    device: str = "cpu"  # where a torch target holds its tensors
    model_path: Path | None = None  # a checkpoint (torch) or a model folder (vLLM)
    patch_memory_bytes: int | None = None  # budget for kept patches (None: the default)
    # vLLM ``LLM`` options over the node's defaults (``pipeline.targets.vllm.startup``).
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    # An engine started by the caller (a served ``ServedEngine``) instead of one of ours.
    engine: Any = None
    refused: Refused | None = None


class NodeTarget(Protocol):
    """A target class that ``build_target`` can construct."""

    @classmethod
    def for_node(cls, setup: TargetSetup) -> Target | None:
        """The target, built from ``setup``; None when stopped while waiting."""


def anchor_specs(
    store: ObjectStore, run: str, stop: threading.Event, refused: Refused | None = None
) -> dict[str, TensorSpec] | None:
    """Names, dtypes and shapes of the newest anchor's tensors; waits for the run's
    first anchor if there is none yet (None: stopped while waiting). An anchor that
    fails its signature or checks goes to ``refused`` and the next older one is tried
    (one unusable manifest planted at the head stops no node)."""
    while not stop.is_set():
        try:
            anchors = sorted(chain.list_versions(store, run).anchors, reverse=True)
        except DeltasyncError as exc:
            log.warning("cannot list the run's anchors yet", error=str(exc))
            anchors = []
        for anchor in anchors:
            try:
                manifest = chain.load_manifest(store, run, "anchor", anchor)
            except StoreError as exc:  # the store, not the manifest: try again later
                log.warning("cannot read the run's anchors yet", error=str(exc))
                break
            except DeltasyncError as exc:
                log.warning("unusable anchor skipped", version=anchor, error=str(exc))
                if refused is not None:
                    refused(anchor, exc)
                continue
            return {t.name: spec_of(t) for t in manifest.tensors}
        else:
            log.info("waiting for the run's first anchor", store=store.url)
        stop.wait(ANCHOR_WAIT_S)
    return None


__all__ = ["ANCHOR_WAIT_S", "NodeTarget", "Refused", "TargetSetup", "anchor_specs"]
