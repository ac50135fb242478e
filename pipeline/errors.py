"""One root error class with specific errors under it.

Every error message is one line that names the object, tensor or service at
fault; the CLI prints ``str(error)`` and exits non-zero.
"""

from __future__ import annotations


class DeltasyncError(Exception):
    """Root of every error deltasync raises on purpose."""


class ConfigError(DeltasyncError):
    """A setting, URL or option is invalid."""


class CodecError(DeltasyncError):
    """A delta could not be encoded or decoded (unknown codec, bad parameters)."""


class CorruptObjectError(DeltasyncError):
    """An object's bytes are damaged: bad hash, truncated, absurd header."""


class MismatchError(DeltasyncError):
    """Tensor names, shapes, dtypes or content hashes do not match what was expected."""


class StoreError(DeltasyncError):
    """The object store failed or cannot be reached."""


class ObjectNotFoundError(StoreError):
    """A key does not exist in the store."""


class ChainError(DeltasyncError):
    """A version cannot be resolved: missing delta, broken parent link, no anchor."""


class RollbackError(ChainError):
    """The store shows less than a node has verified (its floor) or than Redis has
    announced: versions hidden or deleted. The node keeps what it holds."""


class EventError(DeltasyncError):
    """An event is malformed, of an unknown type or of an unsupported schema."""


class SignatureError(DeltasyncError):
    """A manifest is unsigned where a signature is required, or its signature is wrong."""


class TargetError(DeltasyncError):
    """A target (torch model, vLLM engine) cannot take a patch."""


class ServiceUnavailableError(DeltasyncError):
    """Redis or another service cannot be reached."""


class StepNotSentError(ServiceUnavailableError):
    """Redis failed before any part of a step reached it: nothing was emitted and
    nothing stays staged; the same step can be emitted again."""


class LockError(DeltasyncError):
    """A lock is held by someone else (after waiting as long as allowed)."""


class VersionTimeoutError(DeltasyncError):
    """A server did not reach the version asked for within the time allowed."""
