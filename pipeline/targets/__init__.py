"""Targets a rollout node applies versions to, looked up by name.

Implementations are imported lazily: asking for "torch" never imports vLLM.
"""

from __future__ import annotations

import importlib

from pipeline.errors import ConfigError

TARGETS: dict[str, str] = {
    "torch": "pipeline.targets.torch:TorchTarget",
    "vllm": "pipeline.targets.vllm.target:VllmTarget",
}


def target_class(name: str) -> type:
    """The target class registered under ``name`` (imported on first use)."""
    try:
        path = TARGETS[name]
    except KeyError:
        known = ", ".join(sorted(TARGETS))
        raise ConfigError(f"unknown target {name!r}; known targets: {known}") from None
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, attr)
    if not isinstance(cls, type):
        raise ConfigError(f"target {name!r} names {path}, which is not a class")
    return cls


def register_target(name: str, path: str) -> None:
    """Register ``"module:Class"`` under ``name`` (replaces an existing entry)."""
    if ":" not in path:
        raise ConfigError(f"target path {path!r} must look like 'package.module:Class'")
    TARGETS[name] = path


__all__ = ["TARGETS", "register_target", "target_class"]
