"""Targets a rollout node applies versions to, built by name through a registry.

``register_target(name, "package.module:Class")`` records where a target class
lives; the module is imported only when the name is first used, so asking for
"torch" never imports vLLM. ``build_target(name, setup)`` constructs one through
the class's ``for_node`` (``pipeline.targets.setup``). An unknown name is a
one-line ConfigError listing the known ones.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.targets.base import Target
    from pipeline.targets.setup import NodeTarget, TargetSetup

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

TARGETS: dict[str, str] = {
    "torch": "pipeline.targets.torch:TorchTarget",
    "vllm": "pipeline.targets.vllm.target:VllmTarget",
}


def register_target(name: str, path: str) -> None:
    """Register ``"package.module:Class"`` under ``name`` (replaces an existing entry).
    Nothing is imported until the name is used."""
    if not re.fullmatch(r"[A-Za-z][\w-]*", name):
        raise ConfigError(f"invalid target name {name!r}")
    if not _PATH.match(path):
        raise ConfigError(f"target path {path!r} must look like 'package.module:Class'")
    TARGETS[name] = path


def known_targets() -> list[str]:
    return sorted(TARGETS)


def target_class(name: str) -> type[NodeTarget]:
    """The target class registered under ``name`` (imported on first use)."""
    path = TARGETS.get(name)
    if path is None:
        known = ", ".join(known_targets())
        raise ConfigError(f"unknown target {name!r}; known targets: {known}")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"target {name!r}: cannot import {module_name} ({exc})") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ConfigError(f"target {name!r} names {path}, which is not a class")
    if not callable(getattr(cls, "for_node", None)):
        raise ConfigError(f"target {name!r} names {path}, which has no for_node(setup)")
    found: type[NodeTarget] = cls
    return found


def build_target(name: str, setup: TargetSetup) -> Target | None:
    """The target ``name`` built for a rollout node (None: ``setup.stop`` was set
    while it waited for the run's first anchor)."""
    return target_class(name).for_node(setup)


__all__ = ["TARGETS", "build_target", "known_targets", "register_target", "target_class"]
