"""The signed envelope: a document's raw bytes behind a small signature header.

A signed document (a manifest, ``run.json``) is stored as::

    {"signature":{"alg":"ed25519","key_id":K,"sha256":H,"sig":S,"size":N},"signed":<doc>}

where ``<doc>`` is the document's own canonical JSON, byte for byte, ``N`` its length
and ``H`` its sha256. The Ed25519 signature ``S`` covers only the small statement
``{"sha256":H,"signs":WHAT,"size":N}`` (canonical JSON), so a reader checks it from
the first :data:`HEADER_BYTES` of the object, before it reads the rest: an unsigned
or wrongly signed object costs that prefix whatever its size, and a signed one is
read only up to the size its signer named. ``WHAT`` (``manifest``, ``run record``)
keeps one kind of signed document from standing in for another.

No cryptography here (see :mod:`pipeline.format.signing`): building, splitting and
checking the bytes against the header.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from pipeline.errors import CorruptObjectError, SignatureError

PREFIX = b'{"signature":{'
SEPARATOR = b',"signed":'
HEADER_BYTES = 1024  # the header is ~200 bytes; anything longer is not ours
SIGNATURE_FIELDS = frozenset({"alg", "key_id", "sha256", "sig", "size"})
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MAX_SIZE = 1 << 40


def canonical(doc: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, ASCII only."""
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def statement(what: str, sha256: str, size: int) -> bytes:
    """The bytes an envelope's signature covers."""
    return canonical({"sha256": sha256, "signs": what, "size": size})


def digest(payload: bytes) -> tuple[str, int]:
    return hashlib.sha256(payload).hexdigest(), len(payload)


def wrap(signature: dict[str, Any], payload: bytes) -> bytes:
    """The envelope of ``payload`` under ``signature`` (a header :func:`header` reads)."""
    return PREFIX[:-1] + canonical(signature) + SEPARATOR + payload + b"}"


def is_sealed(data: bytes) -> bool:
    return data.startswith(PREFIX)


@dataclass(frozen=True)
class Header:
    signature: dict[str, Any]  # alg, key_id, sha256, sig (str), size (int)
    length: int  # bytes before the signed document

    @property
    def size(self) -> int:
        return int(self.signature["size"])

    @property
    def total(self) -> int:
        """The envelope's length in bytes."""
        return self.length + self.size + 1


def header(prefix: bytes, name: str) -> Header | None:
    """The signature header at the start of ``prefix`` (at least the object's first
    :data:`HEADER_BYTES`, or all of it), None if the object is not an envelope;
    SignatureError if the header is malformed."""
    if not is_sealed(prefix):
        return None
    text = prefix[: HEADER_BYTES + len(SEPARATOR)].decode("ascii", errors="replace")
    try:
        raw, end = json.JSONDecoder().raw_decode(text, len(PREFIX) - 1)
    except (ValueError, RecursionError):
        raise SignatureError(f"{name} has a malformed signature header") from None
    if (
        not isinstance(raw, dict)
        or set(raw) != SIGNATURE_FIELDS
        or end > HEADER_BYTES
        or not all(isinstance(raw[k], str) for k in ("alg", "key_id", "sha256", "sig"))
        or not _HEX64.match(raw["sha256"])
        or isinstance(raw["size"], bool)
        or not isinstance(raw["size"], int)
        or not 0 < raw["size"] <= _MAX_SIZE
        or prefix[end : end + len(SEPARATOR)] != SEPARATOR
    ):
        raise SignatureError(f"{name} has a malformed signature header")
    return Header(raw, end + len(SEPARATOR))


def unwrap(data: bytes, name: str) -> tuple[bytes, dict[str, Any] | None]:
    """(the document's bytes, its signature header or None): ``data`` itself when it is
    not an envelope. CorruptObjectError when the signed bytes are not those the header
    names (their signature is checked by whoever holds a key, see ``signing``)."""
    try:
        found = header(data, name)
    except SignatureError as exc:
        raise CorruptObjectError(str(exc)) from None
    if found is None:
        return data, None
    payload = data[found.length : -1]
    if (
        len(data) != found.total
        or not data.endswith(b"}")
        or digest(payload) != (found.signature["sha256"], found.size)
    ):
        raise CorruptObjectError(f"{name}: the signed bytes are not those its signature names")
    return payload, found.signature
