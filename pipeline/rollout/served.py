"""The versions of a ``deltasync serve`` over HTTP: the header names, the gate's
request headers, and a client of ``GET /deltasync/version`` (stdlib only: no torch,
no vLLM, no HTTP library).

Every response of the server names the version that produced it
(``x-deltasync-version: RUN@VERSION``). A request may ask for a version:
``x-deltasync-min-version: V`` (or ``RUN@V``) holds it until the server has applied
V or newer, for at most ``x-deltasync-wait-timeout: S`` seconds (the server's
default otherwise); past that it is answered 504 with the server's version and the
run's head. ``GET /deltasync/version?wait_for=V&timeout=S`` is the same wait
without a request (a long poll).
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from pipeline.errors import ConfigError, ServiceUnavailableError, VersionTimeoutError

VERSION_HEADER = "x-deltasync-version"
MIN_VERSION_HEADER = "x-deltasync-min-version"
WAIT_TIMEOUT_HEADER = "x-deltasync-wait-timeout"
VERSION_ROUTE = "/deltasync/version"
WEIGHTS_ROUTE = "/deltasync/weights"
# How long a request asking for a version waits for it when it names no timeout
# (``deltasync serve --wait-timeout`` changes it), and the longest wait a request may
# ask for (a day; longer asks are refused as malformed).
GATE_WAIT_S = 300.0
MAX_WAIT_S = 86400.0
_CONNECT_RETRY_S = 0.5  # between attempts while a server's port is still closed
_LONG_POLL_S = 60.0  # the longest single long poll; longer waits poll again


def parse_label(label: str) -> tuple[str, int]:
    """``"RUN@VERSION"`` (the version header) as ``(run, version)``."""
    run, sep, version = label.rpartition("@")
    if not sep or not run or not version.isdigit():
        raise ConfigError(f"{label[:80]!r} is not a version label (RUN@VERSION)")
    return run, int(version)


def parse_min_version(value: str, run: str | None = None, *, name: str = MIN_VERSION_HEADER) -> int:
    """The version a ``x-deltasync-min-version`` value asks for: ``V`` or ``RUN@V``
    (an integer >= 0); a label must name ``run`` when given."""
    text = value.strip()
    asked_run: str | None = None
    if "@" in text:
        asked_run, _, text = text.rpartition("@")
    if not text.isdigit() or not text.isascii() or len(text) > 18:
        raise ConfigError(
            f"{name} must be a version (an integer >= 0, or RUN@VERSION), got {value[:80]!r}"
        )
    if asked_run is not None and run is not None and asked_run != run:
        raise ConfigError(f"{name} names run {asked_run[:80]!r}; this server follows {run!r}")
    return int(text)


def parse_wait_timeout(value: str, *, name: str = WAIT_TIMEOUT_HEADER) -> float:
    """Seconds from a ``x-deltasync-wait-timeout`` value: a number > 0, at most a day."""
    try:
        seconds = float(value.strip())
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_WAIT_S):
        raise ConfigError(
            f"{name} must be seconds, a number > 0 and <= {MAX_WAIT_S:.0f}, got {value[:80]!r}"
        )
    return seconds


def gate_headers(min_version: int, wait_timeout_s: float | None = None) -> dict[str, str]:
    """The request headers that hold a request until ``min_version`` or newer is served."""
    if isinstance(min_version, bool) or not isinstance(min_version, int) or min_version < 0:
        raise ConfigError(f"min_version must be an integer >= 0, got {min_version!r}")
    headers = {MIN_VERSION_HEADER: str(min_version)}
    if wait_timeout_s is not None:
        headers[WAIT_TIMEOUT_HEADER] = (
            f"{parse_wait_timeout(str(wait_timeout_s), name='wait_timeout_s'):g}"
        )
    return headers


@dataclass(frozen=True)
class ServedVersion:
    """What a ``deltasync serve`` holds (``GET /deltasync/version``).

    ``version``: the version it serves (None while it holds none); ``head``: the
    run's newest published version (None when the store could not be listed);
    ``waiting``: requests waiting to be admitted right now (for a newer version,
    or through an update)."""

    run: str
    node: str
    version: int | None
    label: str | None
    head: int | None
    lag: int | None
    updates: int
    waiting: int
    last_error: str | None

    @classmethod
    def from_json(cls, doc: Any) -> ServedVersion:
        if not isinstance(doc, dict):
            raise ConfigError(f"not a deltasync version document: {str(doc)[:80]!r}")
        try:
            return cls(
                run=str(doc["run"]),
                node=str(doc["node"]),
                version=_optional_int(doc["version"]),
                label=None if doc["label"] is None else str(doc["label"]),
                head=_optional_int(doc["head"]),
                lag=_optional_int(doc["lag"]),
                updates=int(doc.get("updates", 0)),
                waiting=int(doc.get("waiting", 0)),
                last_error=None if doc.get("last_error") is None else str(doc["last_error"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a deltasync version document ({exc!r})") from None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


class VersionClient:
    """A client of one ``deltasync serve``: what it holds, and waiting for a version.

    ``url`` is the server's address (``http://host:8000``; a trailing ``/v1``, the
    OpenAI base URL, is accepted too). Plain HTTP from the standard library."""

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        base = url.rstrip("/").removesuffix("/v1")
        parts = urllib.parse.urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"server URL {url!r} must look like http://host:port")
        self.url = base
        self.timeout_s = timeout_s

    def status(self) -> ServedVersion:
        """What the server holds now (one request; fails at once when it is down)."""
        code, doc = self._get(VERSION_ROUTE, self.timeout_s)
        if code != 200:
            raise ServiceUnavailableError(f"{self.url}{VERSION_ROUTE} answered {code}: {doc}")
        return ServedVersion.from_json(doc)

    def wait_for(self, version: int, timeout_s: float = 300.0) -> ServedVersion:
        """Block until the server has applied ``version`` or newer, and return what it
        holds. A server whose port is not open yet (it opens once its first version
        is loaded) is waited for within the same time. Past ``timeout_s``:
        ``VersionTimeoutError`` naming what the server holds and the run's head."""
        gate_headers(version)  # checks the number
        deadline = time.monotonic() + timeout_s
        last: str = "the server did not answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise VersionTimeoutError(
                    f"{self.url} did not reach version {version} within {timeout_s:g} s: {last}"
                )
            poll = min(remaining, _LONG_POLL_S)
            query = urllib.parse.urlencode({"wait_for": version, "timeout": f"{poll:.3f}"})
            try:
                code, doc = self._get(f"{VERSION_ROUTE}?{query}", poll + self.timeout_s)
            except ServiceUnavailableError as exc:
                last = str(exc)
                time.sleep(min(_CONNECT_RETRY_S, max(0.0, deadline - time.monotonic())))
                continue
            if code == 200:
                return ServedVersion.from_json(doc)
            if code == 504:
                error = doc.get("error", {}) if isinstance(doc, dict) else {}
                last = f"it holds {error.get('version')}, the run's head is {error.get('head')}"
                continue
            raise ServiceUnavailableError(f"{self.url}{VERSION_ROUTE} answered {code}: {doc}")

    def weights(self) -> dict[str, Any]:
        """``GET /deltasync/weights``: the version, ``state_hash`` and each held
        tensor's content hash, as the server's workers hold them."""
        code, doc = self._get(WEIGHTS_ROUTE, self.timeout_s)
        if code != 200 or not isinstance(doc, dict):
            raise ServiceUnavailableError(f"{self.url}{WEIGHTS_ROUTE} answered {code}: {doc}")
        return doc

    def _get(self, path: str, timeout_s: float) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}", headers={"accept": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return int(response.status), json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                return int(exc.code), json.loads(body or b"null")
            except ValueError:
                return int(exc.code), body[:200].decode(errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServiceUnavailableError(f"cannot reach {self.url}: {reason}") from None


__all__ = [
    "GATE_WAIT_S",
    "MIN_VERSION_HEADER",
    "VERSION_HEADER",
    "VERSION_ROUTE",
    "WAIT_TIMEOUT_HEADER",
    "WEIGHTS_ROUTE",
    "ServedVersion",
    "VersionClient",
    "gate_headers",
    "parse_label",
    "parse_min_version",
    "parse_wait_timeout",
]
