"""deltasync methods added to every vLLM worker (``worker_extension_cls``).

Start vLLM with ``worker_extension_cls="pipeline.targets.vllm.extension.DeltasyncWorkerExtension"``
and drive it with ``collective_rpc("deltasync_<method>", args=(...))``; the node side
is ``pipeline.targets.vllm.target.VllmTarget``. Only plain data crosses the process
boundary (bytes, str, int, float, lists, dicts): structured requests travel in the
shapes of ``pipeline.targets.vllm.protocol`` and are parsed there on arrival, and
every method answers with an envelope (``worker_state``) so that errors survive the
trip. Importing this module changes nothing: the CPU hooks are installed as each
worker is built (``DeltasyncWorkerExtension.__new__``).

Each worker keeps a shadow: the full checkpoint-named (HF) weights on CPU, exactly
as the trainer published them. Deltas are decoded against the shadow (the codec
needs the exact base), verified, written into the shadow, and then pushed into the
model. The shadow is also what ``hashes`` and ``export`` read, so they report the
checkpoint the engine was given, never a re-derived kernel layout.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ParamSpec, Self

import structlog
import torch
from safetensors.torch import load, save

from pipeline import collector
from pipeline.errors import CorruptObjectError, MismatchError, TargetError
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.targets.patching import int_view
from pipeline.targets.proving import (
    DEFAULT_PATCH_MEMORY_BYTES,
    check_base,
    early_results,
    prove_and_write,
)
from pipeline.targets.vllm.cpu import computes_from_weight
from pipeline.targets.vllm.cpu import install as install_cpu_linear_hook
from pipeline.targets.vllm.mapping import (
    Placement,
    Route,
    gather_placed,
    placed_view,
    probe_placement,
    route_names,
    scatter_positions,
    scatter_rows,
    source_box,
    whole_box,
)
from pipeline.targets.vllm.protocol import (
    PrepareRequest,
    PrepareSummary,
    PrepareWire,
    SummaryWire,
    WireSpec,
    specs_from_wire,
    specs_to_wire,
)
from pipeline.targets.vllm.worker_state import (
    Envelope,
    WorkerState,
    enveloped,
    failed,
    ok,
)
from pipeline.targets.walking import Written, written_patch

log = structlog.get_logger(__name__)

_P = ParamSpec("_P")


def _rpc(method: Callable[_P, object]) -> Callable[_P, Envelope]:
    """An RPC method whose value, or error, is answered in an envelope (``enveloped``)."""

    @functools.wraps(method)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> Envelope:
        return enveloped(lambda: method(*args, **kwargs))

    return call


class DeltasyncWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # vLLM appends this class to its worker class's bases and never runs our
        # __init__ (its WorkerBase.__init__ does not chain up), but this runs as each
        # worker is built, before it loads the model: the CPU hooks must be in place
        # by then to keep linear weights plain (enabled by the environment). Nothing
        # is installed when the module is merely imported.
        install_cpu_linear_hook()
        return super().__new__(cls)

    # --- helpers (underscore names: never called over RPC) -----------------------

    def _ds(self) -> WorkerState:
        state: WorkerState | None = getattr(self, "_deltasync_state", None)
        if state is None:
            # With the deltasync weight-transfer backend too (workers/nodes/vllm_plugin.py),
            # this worker's methods read and write the state that backend keeps.
            host = getattr(getattr(self, "weight_transfer_engine", None), "host", None)
            if isinstance(host, DeltasyncWorkerExtension) and host is not self:
                state = host._ds()
            else:
                state = WorkerState()
            self._deltasync_state = state
        return state

    def _ds_model(self) -> torch.nn.Module:
        model: torch.nn.Module = self.model_runner.get_model()  # type: ignore[attr-defined]
        return model

    def _ds_loaded(self) -> WorkerState:
        state = self._ds()
        state.check_idle()
        if not state.loaded:
            raise TargetError("vLLM worker holds no deltasync state: call load_state first")
        return state

    def _ds_reload(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's own loading path (CPU repacking, TP slicing, fusing included)."""
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=list(tensors), is_checkpoint_format=True
        )

    def _ds_routes(
        self, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> dict[str, Route]:
        """Where the model's loader puts each named tensor (see ``route_names``)."""
        model = self._ds_model()
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object]
        load_weights = model.load_weights  # type: ignore[assignment]
        with torch.no_grad():
            return route_names(model, load_weights, shapes)

    def _ds_adopt(self, tensors: dict[str, torch.Tensor], push: bool) -> None:
        """Make ``tensors`` the shadow; with ``push``, reload all of them into the model.

        Every name is routed first, so a tensor the model cannot place fails the
        call (TargetError naming it) before the shadow or the model change.
        """
        state = self._ds()
        state.check_idle()
        routes = self._ds_routes({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
        state.pending = None
        state.early.wrote()
        if push:
            state.loaded = False  # a failed reload leaves the model unknown
            self._ds_reload(tensors.items())
        state.shadow = tensors
        state.hashes = {}
        state.routes = routes
        state.placements = self._ds_placements(state)
        state.loaded = True
        ignored = sorted(n for n, r in routes.items() if r.parameter is None)
        log.info(
            "deltasync weight map",
            tensors=len(routes),
            in_place=len(state.placements),
            ignored=len(ignored),
        )
        if ignored:
            # Skipped on purpose (rotary caches, a tied alias, another stage's
            # layer; route_names refuses any other skip): held in the shadow only.
            log.info("tensors the vLLM model does not load", tensors=ignored[:8])

    def _ds_placements(self, state: WorkerState) -> dict[str, Placement]:
        """Plain-tensor placements of shadow tensors that the model holds bit for bit."""
        from vllm.model_executor.model_loader.weight_utils import (
            default_weight_loader,
        )

        model = self._ds_model()
        placements: dict[str, Placement] = {}
        with torch.no_grad():
            for name, route in state.routes.items():
                if route.parameter is None or not _writable_in_place(model, route):
                    continue
                param = model.get_parameter(route.parameter)
                loader = getattr(param, "weight_loader", default_weight_loader)
                shape = tuple(state.shadow[name].shape)
                placement = probe_placement(model, name, route, shape, loader)
                if placement is None:
                    continue
                # Kernels that repack stacked experts after loading (the CPU build's
                # grouped GEMM) leave other bits there: the check below refuses them.
                # Post-load processing (scales, permutes) would make raw checkpoint
                # values wrong in place: keep a placement only where the parameter
                # holds the checkpoint's exact bits.
                held = gather_placed(param, placement)
                want = source_box(state.shadow[name], placement).to(held.device)
                if held.dtype == want.dtype and torch.equal(
                    held.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
                ):
                    placements[name] = placement
        return placements

    def _ds_reload_groups(self, state: WorkerState, names: Iterable[str]) -> None:
        """Reload from the shadow every tensor feeding the modules ``names`` reach."""
        modules = {state.routes[n].module for n in names} - {None}
        group = sorted(n for n, r in state.routes.items() if r.module in modules)
        self._ds_reload((n, state.shadow[n]) for n in group)

    def _ds_push(self, state: WorkerState, pending: Written) -> None:
        """Bring the model in line with the shadow for the tensors ``pending`` wrote:
        in place where the parameter holds the checkpoint's bits (a walked tensor's
        delta walked again into the parameter where it holds the whole tensor as one
        block, else its changes read back from the shadow, one tensor at a time),
        else through vLLM's loading path."""
        model = self._ds_model()
        patches = {p.name: p for p in pending.patches}
        reload: list[str] = []
        with torch.no_grad():
            for name in pending.touched:
                route = state.routes[name]
                if route.parameter is None:
                    continue
                placement = state.placements.get(name)
                if placement is None:
                    reload.append(name)
                    continue
                param = model.get_parameter(placement.parameter)
                patch = patches.get(name)
                if patch is None:  # walked into the shadow
                    walks = pending.walks[name]
                    box = whole_box(param, placement, state.shadow[name])
                    if box is not None:
                        # The box holds the shadow's old bits (see _ds_placements):
                        # the proven delta walks into it as into the shadow.
                        for walk in walks:
                            walk.delta.apply_to(walk.name, walk.target(box), confirm=True)
                        continue
                    patch = written_patch(name, walks, state.shadow[name])
                shape = tuple(state.shadow[name].shape)
                rows = scatter_rows(placement, shape, patch.positions)
                if rows is not None:
                    held, flat = rows
                    values = patch.values[held]
                else:
                    keep, flat = scatter_positions(placement, shape, patch.positions)
                    values = patch.values[keep]
                if flat.numel() == 0:
                    continue
                # Integer views on both sides: the bits move, nothing is converted.
                int_view(placed_view(param, placement)).view(-1).index_copy_(
                    0, flat.to(param.device), int_view(values).to(param.device)
                )
        if reload:
            self._ds_reload_groups(state, reload)

    # --- RPC methods (each answers an envelope: see _rpc) ------------------------

    @_rpc
    def deltasync_load_begin(self) -> None:
        """Start a load_state: following chunks replace the whole shadow."""
        self._ds().staging = {}

    @_rpc
    def deltasync_load_chunk(self, data: bytes) -> int:
        """One safetensors blob of checkpoint tensors (part of a load_state)."""
        state = self._ds()
        if state.staging is None:
            raise TargetError("vLLM worker: load chunk outside load_begin/load_commit")
        tensors = load(bytes(data))
        state.staging.update((n, t.contiguous()) for n, t in tensors.items())
        return len(tensors)

    @_rpc
    def deltasync_load_commit(self, push: bool) -> dict[str, WireSpec]:
        """Adopt the staged tensors as the shadow; with ``push``, reload them all into
        the model (the model then holds exactly the shadow)."""
        state = self._ds()
        if state.staging is None:
            raise TargetError("vLLM worker: load_commit without load_begin")
        staged, state.staging = state.staging, None
        self._ds_adopt(staged, push)
        return specs_to_wire(state.specs())

    @_rpc
    def deltasync_load_files(self, paths: list[str] | None, push: bool) -> dict[str, WireSpec]:
        """Adopt safetensors files readable by the worker as the shadow: ``paths``
        (files or folders), or None for the folder the engine was started from.
        With ``push`` the tensors are also reloaded into the model. JSON-safe
        arguments, so it also works through the server's ``/collective_rpc``."""
        if paths is None:
            sources = [Path(self.model_config.model)]  # type: ignore[attr-defined]
        else:
            sources = [Path(path) for path in paths]
        files: list[Path] = []
        for source in sources:
            files.extend(sorted(source.glob("*.safetensors")) if source.is_dir() else [source])
        if not files:
            raise TargetError(f"vLLM worker: no safetensors files in {sources[0]}")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load(file.read_bytes()))
        self._ds_adopt(tensors, push)
        return specs_to_wire(self._ds().specs())

    @_rpc
    def deltasync_specs(self) -> dict[str, WireSpec] | None:
        """Specs of the shadow; None while the worker holds no deltasync state."""
        state = self._ds()
        return specs_to_wire(state.specs()) if state.loaded else None

    @_rpc
    def deltasync_check_names(self, specs: dict[str, WireSpec]) -> int:
        """Check that the model's loader accepts every named tensor (dtype, shape);
        writes nothing. TargetError names the first it rejects."""
        shapes = {
            name: (spec.dtype, spec.shape)
            for name, spec in specs_from_wire(specs, "check_names request").items()
        }
        return len(self._ds_routes(shapes))

    def deltasync_prepare(self, request: PrepareWire) -> Envelope:
        """Decode, check and write a delta into the shadow; the model is not touched.

        ``request``: a ``PrepareRequest`` on the wire (``protocol.PrepareWire``): the
        version, verify mode, parent state hash and content hash, the manifest's
        entries, the objects (key -> bytes), optionally sha256 (key -> hex digest,
        checked here), early (key -> sha256 of the objects whose early proofs,
        started with ``deltasync_prove_start``, may stand in for their decode and
        hash) and the patch budget: a delta whose decoded patches would take more
        host memory keeps none for the tensors the compiled walk reads; they are
        proven, then walked into the shadow (the commit walks them again into the
        model, or reads their changes back: ``_ds_push``). Answers a
        ``PrepareSummary``. Any failure leaves the shadow as it was.
        """

        def run() -> SummaryWire:
            state = self._ds_loaded()
            if state.pending is not None:
                raise TargetError("vLLM worker: a prepared delta is neither committed nor aborted")
            parsed = PrepareRequest.parse(request)
            entries = list(parsed.entries)
            verify = parsed.verify
            objects = parsed.objects
            for key, digest in parsed.sha256.items():
                if key not in objects or sha256_bytes(objects[key]) != digest:
                    raise CorruptObjectError(f"delta object {key}: missing or sha256 mismatch")
            # Early proofs are checked like fresh ones; the generation says the
            # shadow was not written since they were made.
            taken = state.early.take()  # none still hashes with the old algorithm
            algorithm = state.use(parsed.content_hash)
            ready = early_results(
                entries, dict(parsed.early), taken, state.early.generation, algorithm.name
            )
            if verify == "all":
                state.hashes = {}  # every held hash is recomputed in full
            if verify != "none":
                check_base(
                    state, entries, parsed.parent_state_hash, state.state_hash, f"v{parsed.version}"
                )
            written = prove_and_write(
                state, entries, objects, verify, algorithm, ready, parsed.patch_memory_bytes
            )
            state.hashes.update(written.hashes)
            state.pending = written
            return PrepareSummary(
                tensors=len(written.touched),
                changed=written.changed,
                early_tensors=written.early_tensors,
                walked=len(written.walks),
            ).wire()

        with collector.held_off():  # (see pipeline/collector.py)
            return enveloped(run)

    @_rpc
    def deltasync_prove_start(
        self,
        key: str,
        data: bytes,
        sha256: str,
        patch_memory_bytes: int = DEFAULT_PATCH_MEMORY_BYTES,
    ) -> bool:
        """Start proving one delta object against the shadow before its manifest is
        read (early start: the node got it from a part hint and checked its bytes
        against ``sha256``). Answers at once: True when started, False when the worker
        is busy with a delta or already has it. A later prepare whose ``early`` lists
        the object with this sha256 uses the proof if the shadow was not written
        since. The proofs keep patches up to ``patch_memory_bytes`` between two
        writes, then only hashes (those tensors are walked at the prepare)."""
        state = self._ds()
        if state.busy() or not state.loaded:
            return False
        if isinstance(patch_memory_bytes, bool) or not isinstance(patch_memory_bytes, int):
            raise TargetError("vLLM RPC: patch_memory_bytes must be an int")
        state.early.patch_memory_bytes = patch_memory_bytes
        return state.early.start(key, bytes(data), sha256)

    @_rpc
    def deltasync_prepare_start(self, request: PrepareWire) -> bool:
        """``deltasync_prepare`` on a thread of its own; answers at once, so the engine
        keeps serving while the delta is decoded and verified (the model is not
        touched). Collect the outcome with ``deltasync_prepare_result``."""
        state = self._ds_loaded()
        if state.pending is not None or state.prepared is not None:
            raise TargetError("vLLM worker: a prepared delta is neither committed nor aborted")

        def work() -> None:
            state.prepared = self.deltasync_prepare(request)

        state.preparing = threading.Thread(target=work, name="deltasync-prepare", daemon=True)
        state.preparing.start()
        return True

    def deltasync_prepare_result(self) -> Envelope:
        """``{"ok": True, "value": None}`` while a background prepare runs, then the
        prepare's own envelope (once; its value is never None)."""
        state = self._ds()
        thread = state.preparing
        if thread is None:
            return failed(TargetError("vLLM worker: no delta is being prepared"))
        if thread.is_alive():
            return ok(None)
        state.preparing = None
        answer, state.prepared = state.prepared, None
        return answer or failed(TargetError("vLLM worker: background prepare gave no answer"))

    def deltasync_prepare_json(self, request_json: str) -> Envelope:
        """``deltasync_prepare`` for callers that can only send JSON text (the
        server's ``/collective_rpc``): ``objects`` maps each key to a local file path
        the worker can read, and ``sha256`` should be given."""
        try:
            request = json.loads(request_json)
            paths: dict[str, str] = request["objects"]
            request["objects"] = {key: Path(path).read_bytes() for key, path in paths.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return failed(TargetError(f"vLLM worker: bad prepare request: {exc}"))
        wire: PrepareWire = request
        return self.deltasync_prepare(wire)

    def deltasync_commit(self) -> Envelope:
        """Push the prepared delta into the model. On failure the shadow is rolled back
        and the touched groups are pushed again from it."""

        def run() -> float:
            state = self._ds_loaded()
            pending = state.pending
            if pending is None:
                raise TargetError("vLLM worker: commit without a prepared delta")
            started = time.perf_counter()
            try:
                self._ds_push(state, pending)
            except Exception:
                state.undo(pending)
                self._ds_reload_groups(state, pending.touched)
                raise
            state.pending = None
            return time.perf_counter() - started

        with collector.held_off():  # (see pipeline/collector.py)
            return enveloped(run)

    @_rpc
    def deltasync_abort(self) -> bool:
        """Undo a prepared delta in the shadow (another worker failed to prepare)."""
        state = self._ds()
        state.check_idle()
        pending = state.pending
        if pending is None:
            return False
        state.undo(pending)
        return True

    @_rpc
    def deltasync_hashes(
        self, names: list[str] | None, algorithm: str | None = None
    ) -> dict[str, str]:
        state = self._ds_loaded()
        state.use(algorithm)
        wanted = list(state.shadow) if names is None else list(names)
        missing = [n for n in wanted if n not in state.shadow]
        if missing:
            raise MismatchError(f"tensor {missing[0]} is not held by the vLLM target")
        return {n: state.held_hash(n) for n in wanted}

    @_rpc
    def deltasync_export(self, names: list[str]) -> bytes:
        """Shadow tensors as one safetensors blob."""
        state = self._ds_loaded()
        return save({n: state.shadow[n] for n in names})

    @_rpc
    def deltasync_read_param(self, hf_name: str) -> bytes | None:
        """The model's own bits of a checkpoint tensor, where a placement knows them
        (tests and debugging: proves an in-place write reached the live parameter)."""
        state = self._ds_loaded()
        placement = state.placements.get(hf_name)
        if placement is None:
            return None
        param = self._ds_model().get_parameter(placement.parameter)
        box = gather_placed(param, placement).detach().cpu().contiguous()
        return save({hf_name: box})


# UnquantizedFusedMoEMethod: stacked experts (w13/w2); whether the kernel computes
# from them as loaded is decided by the bit check of each placement.
_PLAIN_METHODS = (
    "UnquantizedLinearMethod",
    "UnquantizedEmbeddingMethod",
    "UnquantizedFusedMoEMethod",
)


def _writable_in_place(model: torch.nn.Module, route: Route) -> bool:
    """Whether the module computes from the parameter itself, so that writing the
    parameter is enough. Not so where vLLM derived a kernel copy at load time: the
    CPU GEMM dispatch (``cpu_linear``) keeps a packed copy unless the plain-linear
    hook kept the weight (``pipeline.targets.vllm.cpu``), even of lm_head whose
    weight stays readable; quantized methods hold transformed values."""
    assert route.module is not None
    module = model.get_submodule(route.module)
    if not computes_from_weight(module):
        return False
    method = getattr(module, "quant_method", None)
    if method is not None and type(method).__name__ not in _PLAIN_METHODS:
        return False
    param = model.get_parameter(route.parameter or "")
    return bool(param.is_contiguous())
