"""A live vLLM engine as a deltasync target.

``VllmTarget(llm)`` wraps an in-process ``vllm.LLM`` started with
``worker_extension_cls="pipeline.targets.vllm.extension.DeltasyncWorkerExtension"``. Every
operation is a ``collective_rpc`` to the extension's ``deltasync_*`` methods with
plain data only (requests and answers typed in ``pipeline.targets.vllm.protocol``),
so the same code drives single-process, multi-process and tensor-parallel engines.
A rollout node builds it through ``for_node`` (``pipeline.targets.build_target``).
vllm itself is never imported here.

Applying a delta is two-phase across workers: ``prepare`` decodes and verifies the
delta against each worker's checkpoint-named shadow and writes the shadow (the
model untouched); only when every worker prepared does ``commit`` push the changed
tensors into the model, after which the prefix cache is reset. A failed prepare
aborts the others, so no worker is left ahead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import structlog
import torch
from safetensors.torch import load, save

from pipeline import errors
from pipeline.errors import ConfigError, DeltasyncError, MismatchError, TargetError
from pipeline.format.manifest import Manifest
from pipeline.targets.base import (
    ApplyReport,
    EarlyProof,
    Target,
    TargetCapabilities,
    TensorSpec,
    VerifyMode,
)
from pipeline.targets.pieced import AnchorPiece, whole_tensors
from pipeline.targets.proving import DEFAULT_PATCH_MEMORY_BYTES
from pipeline.targets.setup import TargetSetup, anchor_specs
from pipeline.targets.vllm.engine import as_driver
from pipeline.targets.vllm.protocol import (
    PrepareRequest,
    PrepareSummary,
    PrepareWire,
    specs_from_wire,
    specs_to_wire,
)
from pipeline.targets.vllm.startup import EXTENSION_CLS, start_engine, start_node_engine

log = structlog.get_logger(__name__)

DEFAULT_CHUNK_BYTES = 256 << 20


def _raise(envelope: dict[str, Any]) -> None:
    cls = getattr(errors, str(envelope.get("error")), None)
    if not (isinstance(cls, type) and issubclass(cls, DeltasyncError)):
        cls = TargetError
    raise cls(str(envelope.get("message", "vLLM worker failed")))


class VllmTarget(Target):
    """Checkpoint-named weights of a live vLLM engine (see module doc)."""

    capabilities = TargetCapabilities(early_proofs="handed", pieces=True)

    def __init__(
        self,
        llm: Any,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        expected_specs: Mapping[str, TensorSpec] | None = None,
        background_prepare: bool = True,
        patch_memory_bytes: int = DEFAULT_PATCH_MEMORY_BYTES,
    ) -> None:
        """``expected_specs``: the checkpoint tensors an engine that holds no deltasync
        state yet (started on dummy weights) is to take; ``specs()`` answers them, once
        the model's loader accepted every name, until ``load_state`` fills the engine.
        ``patch_memory_bytes``: the host memory each worker's decoded patches of one
        delta may take; above it the workers walk the deltas instead
        (``DELTASYNC_PATCH_MEMORY_MB``)."""
        self.llm = llm
        # A vllm.LLM, or a driver of a served engine (pipeline.targets.vllm.engine).
        self.engine = as_driver(llm)
        self.chunk_bytes = chunk_bytes
        self.expected_specs = dict(expected_specs) if expected_specs is not None else None
        # Decode and verify deltas on a worker thread while the engine serves (the
        # pause is then the commit alone); False: one blocking prepare RPC.
        self.background_prepare = background_prepare
        self.patch_memory_bytes = patch_memory_bytes
        self.version: int | None = None  # last applied version, when known
        self._specs: dict[str, TensorSpec] | None = None
        # Seconds spent in each phase of the last apply_delta (prepare, commit, reset).
        self.last_timings: dict[str, float] = {}
        self._early: dict[str, str] = {}  # key -> sha256 of objects the workers prove early

    @classmethod
    def for_node(cls, setup: TargetSetup) -> VllmTarget | None:
        """A rollout node's vLLM target: over ``setup.engine`` (an engine the caller
        started and serves), else over an in-process engine started from the model
        folder ``setup.model_path`` (``startup.start_node_engine``, with
        ``setup.engine_options``). Until the bootstrap loads it, the engine holds no
        checkpoint-named state: it is to take the newest anchor's tensors (the
        model's loader checks the names), so this waits for the run's first anchor
        (None when stopped meanwhile)."""
        engine = setup.engine
        if engine is None:
            if setup.model_path is None:
                raise ConfigError("--target vllm needs --model (a model folder with config.json)")
            engine = start_node_engine(setup.model_path, setup.engine_options)
        specs = anchor_specs(setup.store, setup.run, setup.stop, setup.refused)
        if specs is None:
            return None
        budget = setup.patch_memory_bytes
        return cls(
            engine,
            expected_specs=specs,
            patch_memory_bytes=DEFAULT_PATCH_MEMORY_BYTES if budget is None else budget,
        )

    # --- RPC plumbing ---------------------------------------------------------------

    def _envelopes(self, method: str, *args: object) -> list[dict[str, Any]]:
        try:
            answers = self.engine.collective_rpc(method, args)
        except Exception as exc:
            raise TargetError(f"vLLM collective_rpc {method} failed: {exc}") from exc
        if not answers or not all(isinstance(a, dict) and "ok" in a for a in answers):
            raise TargetError(
                f"vLLM collective_rpc {method}: no deltasync answer (is the engine started "
                f"with worker_extension_cls={EXTENSION_CLS!r}?)"
            )
        return list(answers)

    def _call(self, method: str, *args: object) -> Any:
        answers = self._envelopes(method, *args)
        for answer in answers:
            if not answer["ok"]:
                _raise(answer)
        return answers[0]["value"]

    def _set_specs(self, wire: object) -> dict[str, TensorSpec]:
        self._specs = specs_from_wire(wire, "specs answer")
        return self._specs

    def _reset_prefix_cache(self) -> None:
        if not self.engine.reset_prefix_cache():
            raise TargetError("vLLM engine refused to reset its prefix cache (requests running?)")

    # --- Target ----------------------------------------------------------------------

    def specs(self) -> dict[str, TensorSpec]:
        if self._specs is None:
            held = self._call("deltasync_specs")
            if held is not None:
                self._set_specs(held)
            elif self.expected_specs is not None:
                self._call("deltasync_check_names", specs_to_wire(self.expected_specs))
                return dict(self.expected_specs)
            else:
                raise TargetError("vLLM engine holds no deltasync state: call load_state first")
        assert self._specs is not None
        return dict(self._specs)

    def load_state(
        self, tensors: Iterable[tuple[str, torch.Tensor]], hashes: Mapping[str, str] | None = None
    ) -> None:
        """Replace the engine's weights and the workers' shadow with ``tensors`` (a
        complete checkpoint in HF names), sent as safetensors chunks. ``hashes`` are
        not used: the workers hash their shadow themselves."""
        self._early = {}
        self._call("deltasync_load_begin")
        batch: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in tensors:
            batch[name] = tensor.detach().to("cpu").contiguous()
            size += tensor.numel() * tensor.element_size()
            if size >= self.chunk_bytes:
                self._call("deltasync_load_chunk", save(batch))
                batch, size = {}, 0
        if batch:
            self._call("deltasync_load_chunk", save(batch))
        self._replace(None, "deltasync_load_commit", True)  # the node names the version after
        log.info("vllm target loaded", tensors=len(self._specs or {}))

    def load_pieces(self, pieces: Iterable[AnchorPiece]) -> None:
        """Bootstrap from a sharded run's anchor: whole tensors are assembled from the
        pieces here (memory: those being assembled) and sent as ``load_state`` sends
        them; vLLM's loaders then place them as any checkpoint's."""
        shapes = {name: spec.shape for name, spec in self.specs().items()}
        self.load_state(whole_tensors(pieces, shapes))

    def load_model_files(self, version: int | None = None) -> None:
        """Adopt the checkpoint files the engine was started from as the shadow.

        Right only when the node knows which version those files hold: pass it,
        and compare ``hashes()`` with that version's manifest before trusting it.
        """
        self._early = {}
        self._set_specs(self._call("deltasync_load_files", None, False))
        self.version = version

    def load_files(self, paths: Sequence[str], version: int | None = None) -> None:
        """Replace the engine's weights with safetensors files (or folders of them)
        that the workers can read; cheaper than ``load_state`` on the same host."""
        self._replace(version, "deltasync_load_files", [str(p) for p in paths], True)

    def _replace(self, version: int | None, method: str, *args: object) -> None:
        """The workers' ``method`` replaces the engine's weights with ``version``'s."""
        self._early = {}
        with self.engine.weights_change(version):
            self._set_specs(self._call(method, *args))
            self._reset_prefix_cache()
        self.version = version

    def apply_delta(
        self,
        manifest: Manifest,
        objects: dict[str, bytes],
        verify: VerifyMode,
        early: Sequence[EarlyProof] = (),
    ) -> ApplyReport:
        """``early`` is not used: the workers use their own proofs (``start_early_proof``)."""
        if manifest.kind != "delta":
            raise MismatchError(
                f"{manifest.run} v{manifest.version} is an {manifest.kind}, not a delta"
            )
        if self.version is not None and manifest.parent != self.version:
            raise MismatchError(
                f"delta {manifest.run} v{manifest.version} has parent {manifest.parent}, "
                f"vLLM target holds v{self.version}"
            )
        request = PrepareRequest.for_delta(
            manifest, objects, verify, self._early, self.patch_memory_bytes
        ).wire()
        self._early = {}  # the workers drop every early proof at this prepare
        started = time.perf_counter()
        prepared = self._prepare(request)
        failed = [answer for answer in prepared if not answer["ok"]]
        if failed:
            if len(failed) < len(prepared):
                self._envelopes("deltasync_abort")
            _raise(failed[0])
        decoded = time.perf_counter()
        with self.engine.weights_change(manifest.version):
            self._call("deltasync_commit")
            committed = time.perf_counter()
            self._reset_prefix_cache()
        finished = time.perf_counter()  # a served engine's drain and resume included
        # In the background mode the engine keeps serving while workers prepare:
        # it is unavailable only from the commit on.
        pause = finished - (decoded if self.background_prepare else started)
        self.last_timings = {
            "prepare_s": decoded - started,
            "commit_s": committed - decoded,
            "reset_s": finished - committed,
        }
        summary = PrepareSummary.parse(prepared[0]["value"])
        self.version = manifest.version
        report = ApplyReport(
            manifest.version,
            summary.tensors,
            summary.changed,
            pause,
            walked=summary.walked,
            early_tensors=summary.early_tensors,
        )
        log.info("vllm target applied delta", run=manifest.run, **asdict(report))
        return report

    def start_early_proof(self, key: str, data: bytes, sha256: str) -> bool:
        """Have every worker prove delta object ``key`` (bytes checked against
        ``sha256``) against its shadow, on a thread of its own while the engine keeps
        serving; answers at once. The next ``apply_delta`` lets the workers use the
        proofs if its manifest lists the object with this sha256 and the shadow was
        not written since. Call it from the thread that drives the engine. False when
        a worker could not start it (busy with a delta, or holding no state)."""
        answers = self._envelopes(
            "deltasync_prove_start", key, data, sha256, self.patch_memory_bytes
        )
        started = all(answer["ok"] and answer["value"] for answer in answers)
        if started:
            self._early[key] = sha256
        return started

    def _prepare(self, request: PrepareWire) -> list[dict[str, Any]]:
        """Every worker's prepare envelope: in one blocking RPC, or started on a
        worker thread and polled, so the engine serves in between."""
        if not self.background_prepare:
            return self._envelopes("deltasync_prepare", request)
        started = self._envelopes("deltasync_prepare_start", request)
        results = self._wait_prepared(len(started))
        failed = [answer for answer in started if not answer["ok"]]
        if failed:
            # The workers that did start have finished: undo them, report why.
            self._envelopes("deltasync_abort")
            _raise(failed[0])
        return results

    def _wait_prepared(self, workers: int) -> list[dict[str, Any]]:
        """Poll until every worker's background prepare has answered."""
        results: dict[int, dict[str, Any]] = {}
        wait = 0.0005
        while len(results) < workers:
            for index, answer in enumerate(self._envelopes("deltasync_prepare_result")):
                if index not in results and (not answer["ok"] or answer["value"] is not None):
                    results[index] = answer
            if len(results) < workers:
                time.sleep(wait)
                wait = min(wait * 2, 0.005)
        return [results[index] for index in range(workers)]

    def hashes(
        self, names: Sequence[str] | None = None, algorithm: str | None = None
    ) -> dict[str, str]:
        answer: dict[str, str] = self._call(
            "deltasync_hashes", None if names is None else list(names), algorithm
        )
        return answer

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        specs = self.specs()
        chunk: list[str] = []
        size = 0
        for name, spec in specs.items():
            chunk.append(name)
            size += spec.dtype.itemsize * math.prod(spec.shape)
            if size >= self.chunk_bytes:
                yield from load(self._call("deltasync_export", chunk)).items()
                chunk, size = [], 0
        if chunk:
            yield from load(self._call("deltasync_export", chunk)).items()

    def read_parameter(self, name: str) -> torch.Tensor | None:
        """The engine's own bits of ``name`` where they are a plain tensor (rank 0's
        slice), else None. For checks: proves in-place writes reached the model."""
        blob = self._call("deltasync_read_param", name)
        return None if blob is None else load(blob)[name]


# start_engine and EXTENSION_CLS live in startup; they are named here too, where the
# target's users have always found them.
__all__ = ["EXTENSION_CLS", "VllmTarget", "start_engine"]
