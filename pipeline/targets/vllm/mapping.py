"""Where checkpoint (HF) tensors live inside a loaded vLLM model, learnt from the model.

vLLM renames, fuses (q/k/v -> qkv_proj, gate/up -> gate_up_proj), shards (tensor
parallel) and pads parameters, each model in its own ``load_weights``. Rather than
re-implementing those rules per architecture, this module asks the model:

- Routing: every parameter's ``weight_loader`` is swapped for a recorder and the
  model's own ``load_weights`` is run on the real checkpoint names with zero-stride
  placeholder tensors; the recorder notes which parameter (and shard id) each
  checkpoint name reaches, writing nothing.
- Placement: for a parameter that is a plain tensor (GPU, and on CPU the
  embeddings and norms), the original loader is run once against an integer probe
  (flat index + 1 of every checkpoint element) written into a scratch integer
  tensor of the parameter's shape. Where the probe lands is the exact map from
  checkpoint coordinates to parameter coordinates on this rank, with packing
  offsets, tensor-parallel slices and padding included. It is kept only when it is
  a box (contiguous range per dimension), which is what narrow-and-copy loaders
  produce; anything else falls back to the loading path.
- A parameter that is not a plain tensor (CPU oneDNN-repacked linears show shape
  (0,)) has no placement: such modules are refreshed through vLLM's
  ``reload_weights`` with every checkpoint tensor that feeds the module (the whole
  fused group), because a module reloaded from part of its inputs is corrupted.

vllm is never imported here; the functions take the ``torch.nn.Module`` the worker
holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from pipeline.errors import TargetError

log = structlog.get_logger(__name__)

_MISSING = object()


@dataclass(frozen=True)
class Route:
    """Which parameter a checkpoint tensor is loaded into (``None``: the model ignores it)."""

    parameter: str | None
    args: tuple[Any, ...]  # extra loader arguments, e.g. the shard id "q" / 0
    # Keyword loader arguments, e.g. FusedMoE's weight_name, shard_id and expert_id.
    kwargs: tuple[tuple[str, Any], ...] = ()
    # Loader calls the tensor makes (a fused expert tensor is loaded expert by
    # expert); more than one: no placement, the loading path refreshes it.
    calls: int = 1

    @property
    def module(self) -> str | None:
        return None if self.parameter is None else self.parameter.rpartition(".")[0]


@dataclass(frozen=True)
class Placement:
    """A box of a checkpoint tensor held at a box of a plain parameter on this rank."""

    parameter: str
    source_offset: tuple[int, ...]  # start of the box in checkpoint coordinates
    target_offset: tuple[int, ...]  # start of the box in parameter coordinates
    size: tuple[int, ...]  # box extent per dimension (0 somewhere: nothing on this rank)
    target_shape: tuple[int, ...]  # shape of the parameter, or of its sub-tensor at ``lead``
    # Leading indices of a parameter with more dimensions than the checkpoint tensor
    # (one expert of a stacked w13/w2): the box lies in ``param[lead]``.
    lead: tuple[int, ...] = ()


_Hit = tuple[str, tuple[Any, ...], tuple[tuple[str, Any], ...]]
# Buffers vLLM's loaders drop on purpose: recomputed from the config, no weight lost.
_DERIVED_BUFFERS = (
    "rotary_emb.inv_freq",
    "rotary_pos_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)
# Layers that another pipeline stage holds (vLLM's placeholders on this stage).
_OTHER_STAGE = ("PPMissingLayer", "StageMissingLayer")
# Keywords naming the loader's two tensors (FusedMoE passes everything by keyword).
_TENSOR_KEYWORDS = ("param", "loaded_weight")


class _Recorder:
    """Stands in for a weight loader: notes what reached it, writes nothing."""

    def __init__(self, parameter: str, hits: list[_Hit]) -> None:
        self.parameter = parameter
        self.hits = hits

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        # Positional (param, loaded, *extra) or keywords; the extras are kept.
        extra = args[2 - sum(1 for k in _TENSOR_KEYWORDS if k in kwargs) :]
        named = tuple(sorted((k, v) for k, v in kwargs.items() if k not in _TENSOR_KEYWORDS))
        self.hits.append((self.parameter, tuple(extra), named))
        return True  # FusedMoE asks for success (return_success=True)


def _route(hf_name: str, hits: list[_Hit]) -> Route:
    if not hits:
        return Route(None, ())
    if len(hits) == 1:
        return Route(*hits[0])
    modules = {parameter.rpartition(".")[0] for parameter, _, _ in hits}
    if len(modules) > 1:
        raise TargetError(
            f"tensor {hf_name}: the vLLM model loads it into {len(modules)} modules "
            f"({', '.join(sorted(modules))})"
        )
    return Route(hits[0][0], (), (), calls=len(hits))


def _skipped_on_purpose(model: torch.nn.Module, hf_name: str, tied: set[str]) -> bool:
    """Whether the loader skipping ``hf_name`` loses no weight of this model."""
    if hf_name in tied or any(buffer in hf_name for buffer in _DERIVED_BUFFERS):
        return True  # a tied alias is loaded under its other name
    module = model
    for part in hf_name.split(".")[:-1]:
        child = dict(module.named_children()).get(part)
        if child is None:
            return False
        if type(child).__name__ in _OTHER_STAGE:
            return True
        module = child
    return False


def route_names(
    model: torch.nn.Module,
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    shapes: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> dict[str, Route]:
    """Checkpoint name -> Route, by running ``load_weights`` with recording loaders.

    ``shapes`` gives dtype and shape of each checkpoint tensor; placeholders of
    that dtype and shape are passed (expanded zero-stride views: no memory).
    A name the model's loader rejects raises TargetError naming it, and so does
    one it skips silently (an expert index the model does not have, a parameter it
    lacks): its weights would be lost. Names skipped on purpose stay, routed to
    ``None``: rotary caches, a tied alias, a layer of another pipeline stage.
    """
    # One entry per parameter object: a tied parameter (lm_head sharing the
    # embedding) is saved and restored once, under its first name.
    params = dict(model.named_parameters())
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    tied = {name for names in names_of.values() if len(names) > 1 for name in names}
    saved: dict[str, object] = {}
    hits: list[_Hit] = []
    for name, param in params.items():
        saved[name] = getattr(param, "weight_loader", _MISSING)
        param.weight_loader = _Recorder(name, hits)  # type: ignore[attr-defined]
    routes: dict[str, Route] = {}
    try:
        for hf_name, (dtype, shape) in shapes.items():
            hits.clear()
            placeholder = torch.zeros((), dtype=dtype).expand(shape)
            try:
                load_weights([(hf_name, placeholder)])
            except Exception as exc:
                raise TargetError(
                    f"tensor {hf_name}: the vLLM model cannot place it ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''})"
                ) from exc
            routes[hf_name] = _route(hf_name, hits)
            if not hits and not _skipped_on_purpose(model, hf_name, tied):
                raise TargetError(
                    f"tensor {hf_name}: the vLLM model's loader skips it, its weights "
                    "would be lost (no such expert or parameter in this model)"
                )
    finally:
        for name, param in params.items():
            if saved[name] is _MISSING:
                del param.weight_loader  # type: ignore[attr-defined]
            else:
                param.weight_loader = saved[name]  # type: ignore[attr-defined]
    return routes


def _box(mask: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Start and size of the smallest box holding every True of ``mask`` (None: empty)."""
    starts: list[int] = []
    sizes: list[int] = []
    for dim in range(mask.dim()):
        others = [d for d in range(mask.dim()) if d != dim]
        line = mask.any(dim=others) if others else mask
        hit = line.nonzero().view(-1)
        if hit.numel() == 0:
            return None
        first, last = int(hit[0]), int(hit[-1])
        starts.append(first)
        sizes.append(last - first + 1)
    return tuple(starts), tuple(sizes)


def probe_placement(
    model: torch.nn.Module,
    hf_name: str,
    route: Route,
    hf_shape: tuple[int, ...],
    loader: Callable[..., object],
) -> Placement | None:
    """Run ``loader`` on an index probe to find where ``hf_name`` lands; None if unplaceable.

    The parameter's storage is swapped for a scratch integer tensor during the
    probe and put back afterwards; the live weights are not read or written.
    """
    if route.parameter is None or route.calls != 1:
        return None
    param = model.get_parameter(route.parameter)
    # A stacked expert parameter has leading dimensions the checkpoint tensor lacks.
    extra = param.dim() - len(hf_shape)
    if param.is_meta or param.numel() == 0 or extra < 0:
        return None
    numel = math.prod(hf_shape)
    index_dtype = torch.int32 if max(numel, param.numel()) < 2**31 - 1 else torch.int64
    live = param.data
    grad = param.requires_grad
    try:
        param.requires_grad_(False)  # integer storage cannot require grad
        param.data = torch.full(live.shape, -1, dtype=index_dtype, device=live.device)
        probe = torch.arange(1, numel + 1, dtype=index_dtype, device=live.device)
        loader(param, probe.view(hf_shape), *route.args, **dict(route.kwargs))
        landed = param.data
    except Exception as exc:  # a loader that needs real floats: use the loading path
        log.debug("probe failed", tensor=hf_name, error=str(exc))
        return None
    finally:
        param.data = live
        param.requires_grad_(grad)
    if landed.shape != live.shape or landed.dtype != index_dtype:
        return None
    lead: list[int] = []
    for _ in range(extra):
        others = list(range(1, landed.dim()))
        mask = (landed > 0).any(dim=others) if others else landed > 0
        hit = mask.nonzero().view(-1)
        if hit.numel() > 1:
            return None  # spread over several experts: not one box
        index = int(hit[0]) if hit.numel() else 0
        lead.append(index)
        landed = landed[index]
    sub_shape = tuple(landed.shape)
    mask = landed > 0
    box = _box(mask)
    if box is None:  # this rank holds none of it
        zero = (0,) * len(hf_shape)
        return Placement(route.parameter, zero, zero, zero, sub_shape, tuple(lead))
    start, size = box
    region = landed[tuple(slice(s, s + n) for s, n in zip(start, size, strict=True))]
    first = int(region.reshape(-1)[0]) - 1
    source: list[int] = []
    for extent in reversed(hf_shape):
        source.append(first % extent)
        first //= extent
    source.reverse()
    if any(s + n > e for s, n, e in zip(source, size, hf_shape, strict=True)):
        return None
    expected = torch.ones(size, dtype=torch.int64, device=live.device)
    stride = 1
    for dim in reversed(range(len(hf_shape))):
        shape = [1] * len(hf_shape)
        shape[dim] = size[dim]
        coords = torch.arange(source[dim], source[dim] + size[dim], device=live.device)
        expected = expected + (coords * stride).view(shape)
        stride *= hf_shape[dim]
    if not torch.equal(region.to(torch.int64), expected):
        return None
    return Placement(route.parameter, tuple(source), start, size, sub_shape, tuple(lead))


def placed_view(param: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The parameter's data, or its sub-tensor at ``placement.lead`` (one expert)."""
    return param.data[placement.lead] if placement.lead else param.data


def scatter_positions(
    placement: Placement, hf_shape: tuple[int, ...], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For flat checkpoint positions: (mask of those held on this rank, their flat
    positions in the parameter)."""
    coords = []
    rest = positions
    for extent in reversed(hf_shape):
        coords.append(rest % extent)
        rest = rest // extent
    coords.reverse()
    keep = torch.ones_like(positions, dtype=torch.bool)
    flat = torch.zeros_like(positions)
    for dim, coord in enumerate(coords):
        lo = placement.source_offset[dim]
        keep &= (coord >= lo) & (coord < lo + placement.size[dim])
        flat = flat * placement.target_shape[dim] + (coord - lo + placement.target_offset[dim])
    return keep, flat[keep]


def whole_box(param: torch.Tensor, placement: Placement, held: torch.Tensor) -> torch.Tensor | None:
    """The box of a CPU parameter that holds the whole checkpoint tensor ``held`` as
    one contiguous block in the checkpoint's layout (a plain linear, a norm, one part
    of a fused linear on an unsharded rank): what a delta can be walked into directly.
    None where it is not (a slice on this rank, a strided box, another device), or
    where the box shares ``held``'s memory (a walk adds differences: not twice)."""
    shape = tuple(held.shape)
    if placement.size != shape or any(placement.source_offset):
        return None
    box = gather_placed(param, placement)
    if box.device.type != "cpu" or not box.is_contiguous() or box.dtype != held.dtype:
        return None
    if box.untyped_storage().data_ptr() == held.untyped_storage().data_ptr():
        return None
    return box


def gather_placed(param: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The box of the parameter that holds the placed checkpoint values."""
    return placed_view(param, placement)[
        tuple(slice(s, s + n) for s, n in zip(placement.target_offset, placement.size, strict=True))
    ]


def source_box(tensor: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The box of the checkpoint tensor that this rank holds."""
    return tensor[
        tuple(slice(s, s + n) for s, n in zip(placement.source_offset, placement.size, strict=True))
    ]


def scatter_rows(
    placement: Placement, hf_shape: tuple[int, ...], positions: torch.Tensor
) -> tuple[slice, torch.Tensor] | None:
    """Fast form of ``scatter_positions`` for sorted positions when the box keeps whole
    rows (every dimension after the first is full and unshifted, as in fused and
    row-sharded linears, embeddings and norms): (slice of the positions held on this
    rank, their flat positions in the parameter). None when the box is not of that form.
    """
    if len(hf_shape) == 0:
        return None
    for dim in range(1, len(hf_shape)):
        if not (
            placement.source_offset[dim] == 0
            and placement.target_offset[dim] == 0
            and placement.size[dim] == hf_shape[dim] == placement.target_shape[dim]
        ):
            return None
    row = math.prod(hf_shape[1:])
    low = placement.source_offset[0] * row
    high = low + placement.size[0] * row
    if positions.numel() and low <= int(positions[0]) and int(positions[-1]) < high:
        first, last = 0, positions.numel()  # the common case: all of it on this rank
    else:
        bounds = torch.searchsorted(positions, torch.tensor([low, high], device=positions.device))
        first, last = int(bounds[0]), int(bounds[1])
    held = slice(first, last)
    shift = placement.target_offset[0] * row - low
    flat = positions[held] if shift == 0 else positions[held] + shift
    return held, flat
