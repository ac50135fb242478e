"""Object stores selected by URL: file:// (default), s3://, hf://buckets/...

``open_store(url)`` looks the scheme up in a name-to-implementation registry
whose entries are imported lazily; an unknown scheme is an error that lists
the known ones.
"""

from __future__ import annotations

import importlib
import re

from pipeline.config import check_plain_store_path
from pipeline.errors import ConfigError
from pipeline.store.base import ObjectStore, check_key, check_prefix, put_if_absent

__all__ = [
    "ObjectStore",
    "check_key",
    "check_prefix",
    "known_schemes",
    "open_store",
    "put_if_absent",
    "register_store",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

_REGISTRY: dict[str, str] = {
    "file": "pipeline.store.file:FileStore",
    "s3": "pipeline.store.s3:S3Store",
    "hf": "pipeline.store.hf_bucket:HfBucketStore",
}


def register_store(scheme: str, target: str) -> None:
    """Map a URL scheme to ``"package.module:Class"`` (a class with ``from_url(url)``).

    The module is imported only when a URL of that scheme is opened.
    """
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise ConfigError(f"invalid store scheme {scheme!r}")
    if not _TARGET.match(target):
        raise ConfigError(f"store implementation must be 'module:Class', got {target!r}")
    _REGISTRY[scheme.lower()] = target


def known_schemes() -> list[str]:
    return sorted(_REGISTRY)


def open_store(url: str | None) -> ObjectStore:
    """Open the store named by ``url``; a plain path (no scheme) is a local folder."""
    if url is None or not url.strip():
        raise ConfigError("no object store URL given (set DELTASYNC_STORE or pass --store)")
    url = url.strip()
    match = _SCHEME.match(url)
    if match is None:
        check_plain_store_path("store URL", url)  # file//x is not a folder named "file"
    scheme = match.group(1).lower() if match else "file"
    target = _REGISTRY.get(scheme)
    if target is None:
        raise ConfigError(
            f"unknown store scheme {scheme!r} in {url!r}; known: {', '.join(known_schemes())}"
        )
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"store scheme {scheme!r} needs {module_name} which cannot be imported: {error}"
        ) from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"store scheme {scheme!r}: {module_name} has no {class_name}")
    store = cls.from_url(url)
    if not isinstance(store, ObjectStore):
        raise ConfigError(f"store scheme {scheme!r}: {target} is not an ObjectStore")
    return store
