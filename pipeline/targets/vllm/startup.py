"""Starting a vLLM engine that deltasync drives, and the process set-up it needs.

Nothing here runs at import. The code that starts an engine calls, in this order:

- ``prepare_engine_process(cpu_plain_linear)``: tells this process and the worker
  processes it spawns (through the environment, which they inherit) whether CPU
  linear weights stay plain, and installs the CPU hooks in this process for its
  in-process workers (``pipeline.targets.vllm.cpu``; spawned workers install them
  when the deltasync worker extension is built, see its ``__new__``);
- ``engine_start_guard()`` around the engine's construction.

``start_engine`` does both around ``vllm.LLM``; ``start_node_engine`` adds a
rollout node's defaults (``node_engine_options``). vllm is imported only inside
the functions that need it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeline.config import prefer_vllm_in_process, set_vllm_cpu_plain_linear
from pipeline.errors import ConfigError
from pipeline.targets.vllm import cpu

EXTENSION_CLS = "pipeline.targets.vllm.extension.DeltasyncWorkerExtension"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def prepare_engine_process(*, cpu_plain_linear: bool = True) -> None:
    """Set up this process to start an engine: the plain-linear switch for every
    worker it will hold or spawn, and the CPU hooks for the in-process ones. It
    holds for the rest of the process (the environment is what spawned workers
    read)."""
    set_vllm_cpu_plain_linear(cpu_plain_linear)
    cpu.install()


@contextlib.contextmanager
def engine_start_guard() -> Iterator[None]:
    """Work around vLLM 0.32's CPU start-up scan of every module namespace.

    At engine start the CPU platform walks ``sys.modules`` and calls
    ``vars(value).get(...)`` on every value that has a ``__dict__``. Objects that
    answer any attribute (llvmlite's ``binding.ffi.lib``, loaded with numba, which
    the codec uses for its kernels) return a non-mapping there and the engine fails
    to start. Such values are taken out of their modules while the engine starts
    and put back afterwards.
    """
    hidden: list[tuple[dict[str, Any], str, object]] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                odd = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except Exception:  # vars() itself refusing is harmless to vLLM's scan
                odd = False
            if odd:
                hidden.append((namespace, attr, value))
                del namespace[attr]
    try:
        yield
    finally:
        for namespace, attr, value in hidden:
            namespace[attr] = value


def start_engine(*, cpu_plain_linear: bool = True, **llm_options: Any) -> Any:
    """``vllm.LLM(**llm_options)`` with the deltasync worker extension (unless given),
    after ``prepare_engine_process`` and inside ``engine_start_guard``. Use it instead
    of ``LLM(...)`` in processes that may already have used the codec.

    ``cpu_plain_linear`` (CPU build only): keep linear weights as plain tensors
    instead of prepacked kernel copies, so a delta is written in place rather than
    reloading whole layers (``pipeline.targets.vllm.cpu``). It holds for the rest of
    this process.
    """
    from vllm import LLM

    prepare_engine_process(cpu_plain_linear=cpu_plain_linear)
    llm_options.setdefault("worker_extension_cls", EXTENSION_CLS)
    with engine_start_guard():
        return LLM(**llm_options)


def on_cpu() -> bool:
    """Whether this vLLM build runs on the CPU."""
    from vllm.platforms import current_platform  # vLLM is optional and slow to import

    return bool(current_platform.is_cpu())


def node_engine_options(model_path: Path, options: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a rollout node's engine over ``model_path``.

    Defaults: dummy weights when the folder holds none (the bootstrap loads the
    run's anchor), no tokenizer when the folder has none (the node never decodes
    text), on CPU an eager engine with a small KV cache (vLLM's CPU default reserves
    most of the machine's memory), and the single-process executor for an engine of
    one worker. ``options`` override them.
    """
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"vLLM model folder {folder} has no config.json")
    kwargs: dict[str, Any] = {"model": str(folder)}
    if not any(folder.glob("*.safetensors")):
        kwargs["load_format"] = "dummy"
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        kwargs["skip_tokenizer_init"] = True
    if on_cpu():
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    kwargs.update(options)
    parallel = int(kwargs.get("tensor_parallel_size", 1))
    if parallel * int(kwargs.get("pipeline_parallel_size", 1)) == 1:
        kwargs.setdefault("distributed_executor_backend", "uni")
    return kwargs


def start_node_engine(model_path: Path, options: Mapping[str, Any]) -> Any:
    """A rollout node's in-process engine over ``model_path`` (``node_engine_options``).

    One process for engine and worker unless the environment says otherwise: a
    rollout node has no use for vLLM's engine-core process, and in-process start is
    several times faster."""
    prefer_vllm_in_process()
    return start_engine(**node_engine_options(model_path, options))


__all__ = [
    "EXTENSION_CLS",
    "engine_start_guard",
    "node_engine_options",
    "on_cpu",
    "prepare_engine_process",
    "start_engine",
    "start_node_engine",
]
