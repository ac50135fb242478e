"""Every setting of deltasync: typed, checked when built, read from one place.

``Settings.from_env(**overrides)`` reads ``DELTASYNC_*`` variables; an
override (a command-line option) wins over the environment, and an override of
``None`` means "not given". Every bad value raises ``ConfigError`` naming the
variable. ``configuration_reference()`` renders the table of variables that the
README's configuration reference is copied from.

Besides ``Settings``: the process variables that tune one component where it
runs (S3 tuning, vLLM options, fault points; see ``PROCESS_VARIABLES``), and the
leases and time-to-lives of the Redis coordination. No other module reads a
``DELTASYNC_*`` variable; thread counts come from ``pipeline/cpus.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipeline.codec.names import ANCHOR_COMPRESSIONS, LEVELS, RETIRED_LEVELS
from pipeline.errors import ConfigError
from pipeline.format.hashes import content_hashes

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
REDIS_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_HOME = Path("~/.deltasync")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

# --------------------------------------------------------------------------- leases, TTLs
# Run locks are short leases renewed while their job runs: a worker that dies stops
# holding the run within a minute (at once on the same machine), not after the
# longest job. Part claims of a sharded step are run locks too.
LOCK_LEASE_S = 60.0
LOCK_RENEW_S = 15.0
DIFF_LOCK_WAIT_S = 3600.0  # a diff job waits this long for the run's diff lock
# A state cache is written under its file lock for one version at a time, and scrubbed
# one tensor at a time: a writer waiting longer than this gives up (the job is retried).
CACHE_LOCK_WAIT_S = 900.0
CACHE_LOCK_LOG_S = 30.0  # and says it waits this often
COMPACT_LOCK_WAIT_S = 6 * 3600.0
DIFF_LINE_LEASE_S = 30.0  # a diff job waiting its turn, unless it renews
FANOUT_TTL_S = 24 * 3600.0  # a sharded step's fan-out record and part records
# A sharded step's coordinator calls a host in again for a part nobody holds (its
# worker died, its job was lost) this often while it waits.
SHARDED_RECALL_S = 2.0
# A policy compaction that never finishes (its worker died) stops blocking the next one.
POLICY_PENDING_TTL_S = 3600.0
# A failed policy compaction is tried again after DELTASYNC_COMPACT_RETRY seconds,
# doubled after each failure in a row up to this; its record is shown this long.
COMPACT_RETRY_MAX_S = 3600.0
COMPACTION_FAILED_TTL_S = 7 * 24 * 3600.0
ANNOUNCED_TTL_S = 30 * 24 * 3600  # once-only markers of announced versions
EMITTED_TTL_S = 7 * 24 * 3600  # markers of emitted steps
# Ranks registered for a sharded step: long enough for any step to finish staging.
SHARDS_TTL_S = 24 * 3600.0
CACHE_DAMAGE_TTL_S = 7 * 24 * 3600.0  # scrub findings shown by status this long
REPLICA_TTL_S = 600.0  # default of DELTASYNC_REPLICA_TTL
DIFF_JOB_TIMEOUT_S = 3600  # rq's timeout of one diff job
# A running job's heartbeat in rq's started registry: renewed this often while the job
# runs, lapsing this long after its worker died; a worker's maintenance then retries it.
JOB_HEARTBEAT_S = 15.0
JOB_HEARTBEAT_TTL_S = 90
COMPACT_JOB_TIMEOUT_S = 6 * 3600


def _text(env: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{env}: expected text, got {type(value).__name__}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ConfigError(f"{env}: contains control characters")
    return value


def _paths(env: str, value: object) -> tuple[Path, ...]:
    if isinstance(value, tuple | list):
        return tuple(_path(env, v) for v in value)
    return tuple(_path(env, part) for part in _text(env, value).split(os.pathsep) if part)


def _path(env: str, value: object) -> Path:
    path = value if isinstance(value, Path) else Path(_text(env, value))
    return path.expanduser().absolute()


# A plain path that begins like a store URL with its "://" mistyped (file//x, s3:/b, hf:x):
# taken as a folder it would silently become ./file/x. Refused instead.
STORE_SCHEMES = ("file", "s3", "hf")
_MISTYPED_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)(:/{0,1}(?!/)|//)")


def check_plain_store_path(env: str, text: str) -> None:
    """ConfigError for a store path (no ``://``) that looks like a mistyped URL."""
    match = _MISTYPED_URL.match(text)
    if match is None:
        return
    scheme, sep = match.group(1), match.group(2)
    if sep.startswith(":") or scheme.lower() in STORE_SCHEMES:
        raise ConfigError(
            f"{env}: {text[:200]!r} is ambiguous: a URL needs {scheme}://, and a folder of "
            f"that name needs ./{text[:200]}"
        )


def _store_url(env: str, value: object) -> str:
    if isinstance(value, Path):
        return value.expanduser().absolute().as_uri()
    text = _text(env, value)
    if "://" not in text:  # a plain path means a local folder
        check_plain_store_path(env, text)
        return Path(text).expanduser().absolute().as_uri()
    return text


def _int(env: str, value: object) -> int:
    return int(_number(env, value, int, "an integer"))


def _float(env: str, value: object) -> float:
    return _number(env, value, float, "a number")


def _number(env: str, value: object, kind: type[float], what: str) -> float:
    """``value`` as ``kind`` (int or float; an int stands for a float, never a bool)."""
    if isinstance(value, bool):
        raise ConfigError(f"{env}: expected {what}, got {value!r}")
    if isinstance(value, int) or (kind is float and isinstance(value, float)):
        return kind(value)
    try:
        return kind(_text(env, value).strip())
    except ValueError:
        raise ConfigError(f"{env}: expected {what}, got {value!r}") from None


def _bool(env: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(env, value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{env}: expected true/false (1/0, yes/no, on/off), got {value!r}")


_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _host(env: str, value: object) -> str:
    text = _text(env, value).strip()
    if not _HOST.fullmatch(text):
        raise ConfigError(f"{env}: expected a host name (letters, digits, '.', '_', '-')")
    return text


def _choice(env: str, value: object) -> str:
    return _text(env, value).strip().lower()


# How a field of each type is read (a field of a narrower kind names its own parser).
_BY_TYPE: dict[str, Callable[[str, object], Any]] = {
    "Path": _path,
    "str": _text,
    "int": _int,
    "float": _float,
    "bool": _bool,
    "tuple[Path, ...]": _paths,
}


def _var(
    env: str, default: str, doc: str, parse: Callable[[str, object], Any] | None = None
) -> dict[str, Any]:
    """A field's variable, documented default, meaning and parser (None: its type's)."""
    return {"env": env, "default": default, "doc": doc, "parse": parse}


@dataclass(frozen=True, kw_only=True)
class Settings:
    # The fields' documentation lives in their metadata so that the class
    # docstring and the README table are generated from one source.

    data_dir: Path = field(
        default=Path(),
        metadata=_var(
            "DELTASYNC_HOME",
            "~/.deltasync",
            "Folder for deltasync's own state: the embedded Redis server, and the "
            "default store, staging and cache folders.",
        ),
    )
    redis_url: str | None = field(
        default=None,
        metadata=_var(
            "DELTASYNC_REDIS_URL",
            "(embedded)",
            "Redis URL: redis://[user:password@]host:port/db, rediss:// for TLS, "
            "unix:///path/to/socket. Unset: commands start (and later reuse) an "
            "embedded redis-server kept in <data_dir>/redis.",
        ),
    )
    store_url: str = field(
        default="",
        metadata=_var(
            "DELTASYNC_STORE",
            "file://<data_dir>/store",
            "Object store URL: file://PATH (or a plain path), s3://bucket/prefix, "
            "hf://buckets/<namespace>/<bucket>/<prefix>.",
            parse=_store_url,
        ),
    )
    staging_dir: Path = field(
        default=Path(),
        metadata=_var(
            "DELTASYNC_STAGING",
            "<data_dir>/staging",
            "Where the trainer side writes full checkpoints for the diff worker to pick up.",
        ),
    )
    cache_dir: Path = field(
        default=Path(),
        metadata=_var(
            "DELTASYNC_CACHE",
            "<data_dir>/cache",
            "Workers' cache of the last published weights (memory-mapped).",
        ),
    )
    cache_link: bool = field(
        default=False,
        metadata=_var(
            "DELTASYNC_CACHE_LINK",
            "false",
            "Hard-link the trainer's checkpoint files (emit --checkpoint) into the diff "
            "worker's cache instead of copying them: no copy and no second copy on disk. "
            "Only for trainers that write every step to a new path and never rewrite a "
            "published checkpoint in place (a rewrite is caught, and costs a rebuild).",
        ),
    )
    level: int = field(
        default=1,
        metadata=_var("DELTASYNC_LEVEL", "1", "Delta codec level (one of the codec's LEVELS)."),
    )
    max_chain: int = field(
        default=20,
        metadata=_var(
            "DELTASYNC_COMPACT_MAX_CHAIN",
            "20",
            "Compaction policy: request a new anchor once this many deltas follow the last one.",
        ),
    )
    max_delta_fraction: float = field(
        default=0.5,
        metadata=_var(
            "DELTASYNC_COMPACT_MAX_FRACTION",
            "0.5",
            "Compaction policy: request a new anchor once the chain's cumulative delta "
            "bytes exceed this fraction of the anchor's bytes.",
        ),
    )
    compact_retry_s: float = field(
        default=60.0,
        metadata=_var(
            "DELTASYNC_COMPACT_RETRY",
            "60",
            "Seconds before a failed policy compaction is tried again; doubled after each "
            "failure in a row, up to an hour. `deltasync status` shows the failure's reason.",
        ),
    )
    keep_anchors: int = field(
        default=2,
        metadata=_var(
            "DELTASYNC_KEEP_ANCHORS",
            "2",
            "Garbage collection keeps at least this many newest anchors (and their chains).",
        ),
    )
    replica_ttl_s: float = field(
        default=REPLICA_TTL_S,
        metadata=_var(
            "DELTASYNC_REPLICA_TTL",
            "600",
            "Seconds a replica's heartbeat counts as live; garbage collection keeps "
            "what live replicas need.",
        ),
    )
    worker_lease_s: float = field(
        default=60.0,
        metadata=_var(
            "DELTASYNC_WORKER_LEASE",
            "60",
            "Seconds a diff or compaction worker's heartbeat counts as alive (an idle worker "
            "renews it every lease - 15 s, at least every second; a busy one every 15 s): "
            "`deltasync status` shows a worker silent for longer as dead, and it leaves "
            "the registry a minute later.",
        ),
    )
    redis_timeout_s: float = field(
        default=3.0,
        metadata=_var(
            "DELTASYNC_REDIS_TIMEOUT",
            "3",
            "Seconds the trainer side (Emitter.emit_state, emit_checkpoint, deltasync emit) "
            "waits for Redis per attempt, two attempts, before it fails with a one-line "
            "error; a step that did not reach Redis leaves nothing staged and can be "
            "emitted again.",
        ),
    )
    signing_key_path: Path | None = field(
        default=None,
        metadata=_var(
            "DELTASYNC_SIGNING_KEY",
            "(none)",
            "Private key file used to sign manifests; unset: manifests are not signed.",
        ),
    )
    verify_key_path: Path | None = field(
        default=None,
        metadata=_var(
            "DELTASYNC_VERIFY_KEY",
            "(none)",
            "Public key file; when set, replicas refuse manifests without a valid signature.",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=_var(
            "DELTASYNC_LOG_LEVEL", "info", "debug, info, warning, error or critical.", parse=_choice
        ),
    )
    log_json: bool | None = field(
        default=None,
        metadata=_var(
            "DELTASYNC_LOG_JSON",
            "(auto)",
            "true: JSON lines; false: console format; unset: console on a terminal, "
            "JSON otherwise.",
        ),
    )
    keep_staging: bool = field(
        default=False,
        metadata=_var(
            "DELTASYNC_KEEP_STAGING",
            "false",
            "Keep staged checkpoints that deltasync wrote after they are published.",
        ),
    )
    checkpoint_roots: tuple[Path, ...] | None = field(
        default=None,
        metadata=_var(
            "DELTASYNC_CHECKPOINT_ROOTS",
            "(any)",
            "Folders, separated by ':', that diff workers accept checkpoints from besides "
            "the run's staging folder; a job naming another path is set aside. Unset: any "
            "readable path (set it where Redis writers are not trusted to name files).",
        ),
    )

    diff_host: str | None = field(
        default=None,
        metadata=_var(
            "DELTASYNC_DIFF_HOST",
            "(none)",
            "The trainer host a diff worker serves: it also takes the part jobs routed "
            "to that host's queue, first. Unset: the shared diff queue only.",
            parse=_host,
        ),
    )
    launch: str | None = field(
        default=None,
        metadata=_var(
            "DELTASYNC_LAUNCH",
            "(from torch.distributed)",
            "A token shared by every rank of one start of a sharded trainer: a step "
            "emitted again after a restart never completes with an earlier start's "
            "folders. Unset: rank 0 draws one and broadcasts it when torch.distributed "
            "is initialised.",
            parse=_host,
        ),
    )
    part_bytes: int = field(
        default=512 << 20,
        metadata=_var(
            "DELTASYNC_PART_BYTES",
            "536870912",
            "Bytes of weights per part object, fixed by a run's first anchor.",
        ),
    )
    sharded_part_wait_s: float = field(
        default=900.0,
        metadata=_var(
            "DELTASYNC_SHARDED_PART_WAIT_S",
            "900",
            "Seconds the coordinator of a sharded step waits for every trainer host to "
            "record its parts; past it the step fails naming the hosts that did not.",
        ),
    )
    early_start: bool = field(
        default=False,
        metadata=_var(
            "DELTASYNC_EARLY_START",
            "false",
            "Rollout nodes fetch each part of the next version as soon as the diff worker "
            "announces it, before the manifest, and decode and hash it against their weights: "
            "faster when nodes have cores of their own, slower when they share the diff "
            "worker's.",
        ),
    )
    kernel_cache: str = field(
        default="",
        metadata=_var(
            "DELTASYNC_KERNEL_CACHE",
            "",
            "Folder of the compiled kernels (numba), shared by every environment of this "
            "user; empty: ~/.cache/deltasync/kernels (under XDG_CACHE_HOME if set); off: "
            "numba's own cache next to the sources. NUMBA_CACHE_DIR, when set, wins.",
        ),
    )
    warm: bool = field(
        default=True,
        metadata=_var(
            "DELTASYNC_WARM",
            "true",
            "Rollout nodes and diff workers compile (or load) the codec's kernels on a "
            "thread of their own as they start, so the first version does not wait for "
            "them (false: compiled on first use).",
        ),
    )
    content_hash: str = field(
        default="mixsum-128",
        metadata=_var(
            "DELTASYNC_CONTENT_HASH",
            "mixsum-128",
            "Tensor content hash of a new run, fixed by its first anchor: mixsum-128 "
            "(updated from the changed elements alone) or xxh3-128 (rehashed in full).",
            parse=_choice,
        ),
    )
    scrub_minutes: float = field(
        default=10.0,
        metadata=_var(
            "DELTASYNC_SCRUB_MINUTES",
            "10",
            "Rollout nodes re-hash every held tensor in full in the background, one pass "
            "about every this many minutes (0: never); a mismatch is reported as a "
            "replica error and the node recovers from the store. Diff workers scrub "
            "their state caches alike (a damaged cache is rebuilt by the next step).",
        ),
    )
    scrub_cpu: float = field(
        default=0.25,
        metadata=_var(
            "DELTASYNC_SCRUB_CPU",
            "0.25",
            "Share of the hashing cores the background re-hash may use at most (0 to 1).",
        ),
    )
    patch_memory_mb: int = field(
        default=1024,
        metadata=_var(
            "DELTASYNC_PATCH_MEMORY_MB",
            "1024",
            "Rollout nodes (torch target on CPU, and each vLLM worker) keep a version's "
            "decoded patches in memory up to this size (about 12 bytes per changed bf16 "
            "element); a larger delta is decoded again straight into the weights (a vLLM "
            "worker's shadow), at about 1.2 bytes, for a longer pause.",
        ),
    )
    anchor_compression: str = field(
        default="none",
        metadata=_var(
            "DELTASYNC_ANCHOR_COMPRESSION",
            "none",
            "Format of new anchors: none (plain safetensors, which any tool loads) or "
            "zstd (lossless zstd byte planes: about 30% fewer store bytes and bootstrap "
            "bandwidth for bf16 weights, at some CPU on write and bootstrap). Readers take "
            "both.",
            parse=_choice,
        ),
    )
    metrics_port: int = field(
        default=0,
        metadata=_var(
            "DELTASYNC_METRICS_PORT",
            "0",
            "Port of the Prometheus /metrics endpoint that workers and rollout nodes serve "
            "(all interfaces); 0: none.",
        ),
    )

    def __post_init__(self) -> None:
        # Empty values mean "derive from data_dir"; frozen, hence object.__setattr__.
        data_dir = _path(
            "DELTASYNC_HOME", self.data_dir if self.data_dir != Path() else DEFAULT_HOME
        )
        object.__setattr__(self, "data_dir", data_dir)
        if not self.store_url:
            object.__setattr__(self, "store_url", (data_dir / "store").as_uri())
        for name, sub in (("staging_dir", "staging"), ("cache_dir", "cache")):
            value = getattr(self, name)
            object.__setattr__(self, name, data_dir / sub if value == Path() else value.absolute())
        if self.redis_url is not None:
            _check_redis_url(self.redis_url)
        if "://" not in self.store_url:
            raise ConfigError(f"DELTASYNC_STORE: not a store URL: {self.store_url!r}")
        if self.level in RETIRED_LEVELS:
            raise ConfigError(f"DELTASYNC_LEVEL: {RETIRED_LEVELS[self.level]}")
        if self.level not in LEVELS:
            raise ConfigError(f"DELTASYNC_LEVEL: {self.level} is not one of {list(LEVELS)}")
        _require(self.part_bytes >= 1, "DELTASYNC_PART_BYTES", f"{self.part_bytes} is not positive")
        for env, count in (
            ("DELTASYNC_COMPACT_MAX_CHAIN", self.max_chain),
            ("DELTASYNC_KEEP_ANCHORS", self.keep_anchors),
        ):
            _require(count >= 1, env, f"must be >= 1, got {count}")
        for env, number, unit in (
            ("DELTASYNC_SHARDED_PART_WAIT_S", self.sharded_part_wait_s, ""),
            ("DELTASYNC_COMPACT_MAX_FRACTION", self.max_delta_fraction, ""),
            ("DELTASYNC_COMPACT_RETRY", self.compact_retry_s, " of seconds"),
            ("DELTASYNC_REPLICA_TTL", self.replica_ttl_s, " of seconds"),
            ("DELTASYNC_REDIS_TIMEOUT", self.redis_timeout_s, " of seconds"),
        ):
            ok = math.isfinite(number) and number > 0
            _require(ok, env, f"must be a positive number{unit}, got {number}")
        for env, choice, choices in (
            ("DELTASYNC_ANCHOR_COMPRESSION", self.anchor_compression, ANCHOR_COMPRESSIONS),
            ("DELTASYNC_CONTENT_HASH", self.content_hash, sorted(content_hashes.ALGORITHMS)),
            ("DELTASYNC_LOG_LEVEL", self.log_level, LOG_LEVELS),
        ):
            _require(choice in choices, env, f"{choice!r} is not one of {', '.join(choices)}")
        minutes, cpu, memory = self.scrub_minutes, self.scrub_cpu, self.patch_memory_mb
        ok = math.isfinite(minutes) and minutes >= 0
        _require(ok, "DELTASYNC_SCRUB_MINUTES", f"must be >= 0, got {minutes}")
        _require(0 < cpu <= 1, "DELTASYNC_SCRUB_CPU", f"must be in (0, 1], got {cpu}")
        _require(memory >= 0, "DELTASYNC_PATCH_MEMORY_MB", f"must be >= 0, got {memory}")
        lease, port = self.worker_lease_s, self.metrics_port
        ok = math.isfinite(lease) and lease >= 2
        _require(ok, "DELTASYNC_WORKER_LEASE", f"must be at least 2 seconds, got {lease}")
        _require(0 <= port <= 65535, "DELTASYNC_METRICS_PORT", f"not a port number: {port}")
        for name, env in (
            ("signing_key_path", "DELTASYNC_SIGNING_KEY"),
            ("verify_key_path", "DELTASYNC_VERIFY_KEY"),
        ):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ConfigError(f"{env}: no such key file: {path}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``env`` (default ``os.environ``) with ``overrides`` on top.

        Overrides are keyed by field name and may be strings (parsed like the
        environment) or typed values; ``None`` means "not given".
        """
        environ = os.environ if env is None else env
        specs = {f.name: f for f in fields(cls)}
        unknown = sorted(set(overrides) - set(specs))
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
        raw: dict[str, Any] = {}
        for name, spec in specs.items():
            value = overrides.get(name)
            if value is None:
                text = environ.get(spec.metadata["env"], "").strip()
                value = text or None
            if value is not None:
                parse = spec.metadata["parse"] or _BY_TYPE[str(spec.type).removesuffix(" | None")]
                raw[name] = parse(spec.metadata["env"], value)
        return cls(**raw)

    def signing_key(self) -> bytes | None:
        """The signing key file's bytes, or None when manifests are not signed."""
        return _read_key(self.signing_key_path, "DELTASYNC_SIGNING_KEY")

    def verify_key(self) -> bytes | None:
        """The verification key file's bytes, or None when signatures are not required."""
        return _read_key(self.verify_key_path, "DELTASYNC_VERIFY_KEY")


def _require(ok: bool, env: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{env}: {problem}")


def _read_key(path: Path | None, env: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{env}: cannot read key file {path}: {exc.strerror}") from exc


def _check_redis_url(url: str) -> None:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        # The scheme alone: the URL may hold a password.
        raise ConfigError(
            f"DELTASYNC_REDIS_URL: scheme {scheme or '(none)'!r} is not one of "
            f"{', '.join(s + '://' for s in REDIS_SCHEMES)}"
        )
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a non-numeric or out-of-range port
    except ValueError as exc:
        raise ConfigError(f"DELTASYNC_REDIS_URL: malformed URL ({exc})") from None
    if scheme == "unix" and not parts.path:
        raise ConfigError("DELTASYNC_REDIS_URL: unix:// URL without a socket path")
    if scheme != "unix" and not parts.hostname:
        raise ConfigError(f"DELTASYNC_REDIS_URL: {scheme}:// URL without a host")


# --------------------------------------------------------------------------- a rollout node

VERIFY_MODES = ("touched", "all", "none")


@dataclass(frozen=True, kw_only=True)
class RolloutOptions:
    """What one rollout node runs (``deltasync rollout``'s options), checked when built.

    ``store_url`` and ``redis_url`` override the settings' (None: the settings';
    without any Redis URL the embedded server of the data folder). ``early_start``
    None means ``DELTASYNC_EARLY_START``. ``vllm_options`` are ``vllm.LLM`` keyword
    arguments, over ``DELTASYNC_VLLM_OPTIONS``. ``wait``: a run with no version and no
    event yet is waited for (else it is an error naming the runs there are).
    """

    run: str
    target: str = "torch"
    node_id: str | None = None
    store_url: str | None = None
    redis_url: str | None = None
    device: str = "cpu"
    verify: str = "touched"
    poll_interval_s: float = 2.0
    until_version: int | None = None
    dump_path: Path | None = None
    model_path: Path | None = None
    prefetch: bool = True
    early_start: bool | None = None
    vllm_options: Mapping[str, Any] = field(default_factory=dict)
    wait: bool = False
    server_url: str | None = None

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ConfigError(
                f"verify mode {self.verify!r} is not one of {', '.join(VERIFY_MODES)}"
            )
        if not self.poll_interval_s > 0:
            raise ConfigError(f"poll interval must be positive, got {self.poll_interval_s}")


# --------------------------------------------------------------------------- process variables
# Read where they act, not part of Settings: a store opened from its URL alone, a
# vLLM worker process that inherits the environment, a crash point in any process.

S3_ENDPOINT_ENV = "DELTASYNC_S3_ENDPOINT"
S3_PART_SIZE_ENV = "DELTASYNC_S3_PART_SIZE"
S3_MAX_ATTEMPTS_ENV = "DELTASYNC_S3_MAX_ATTEMPTS"
VLLM_OPTIONS_ENV = "DELTASYNC_VLLM_OPTIONS"
VLLM_CPU_PLAIN_LINEAR_ENV = "DELTASYNC_VLLM_CPU_PLAIN_LINEAR"
FAULT_ENV = "DELTASYNC_FAULT"
FAULT_FILE_ENV = "DELTASYNC_FAULT_FILE"
S3_DEFAULT_PART_SIZE = 64 << 20
S3_DEFAULT_MAX_ATTEMPTS = 4

PROCESS_VARIABLES: dict[str, str] = {
    S3_ENDPOINT_ENV: "S3 endpoint URL (else AWS_ENDPOINT_URL, else AWS).",
    S3_PART_SIZE_ENV: f"S3 multipart part size in bytes (default {S3_DEFAULT_PART_SIZE}).",
    S3_MAX_ATTEMPTS_ENV: f"S3 attempts per request (default {S3_DEFAULT_MAX_ATTEMPTS}).",
    VLLM_OPTIONS_ENV: "JSON object of vllm.LLM options for rollout nodes' engines.",
    VLLM_CPU_PLAIN_LINEAR_ENV: "1: vLLM CPU workers keep linear weights plain (set by "
    "deltasync for the processes vLLM starts).",
    FAULT_ENV: "Tests: arm a crash point (name[@N]) for the life of the process.",
    FAULT_FILE_ENV: "Tests: a file naming a crash point, read at each point.",
}


@dataclass(frozen=True)
class S3Tuning:
    endpoint: str | None
    part_size: int
    max_attempts: int


def s3_tuning(env: Mapping[str, str] | None = None) -> S3Tuning:
    """The S3 store's endpoint, part size and retries from the environment."""
    environ = os.environ if env is None else env
    endpoint = environ.get(S3_ENDPOINT_ENV) or environ.get("AWS_ENDPOINT_URL") or None
    return S3Tuning(
        endpoint=endpoint,
        part_size=_env_int(environ, S3_PART_SIZE_ENV, S3_DEFAULT_PART_SIZE),
        max_attempts=_env_int(environ, S3_MAX_ATTEMPTS_ENV, S3_DEFAULT_MAX_ATTEMPTS),
    )


def vllm_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` options in ``DELTASYNC_VLLM_OPTIONS`` ({} when unset)."""
    raw = (os.environ if env is None else env).get(VLLM_OPTIONS_ENV)
    if not raw:
        return {}
    try:
        extra = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{VLLM_OPTIONS_ENV} is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"{VLLM_OPTIONS_ENV} must be a JSON object of LLM options")
    return extra


def vllm_cpu_plain_linear() -> bool:
    """Whether vLLM CPU workers of this process keep linear weights plain."""
    return os.environ.get(VLLM_CPU_PLAIN_LINEAR_ENV, "0") == "1"


def set_vllm_cpu_plain_linear(on: bool) -> None:
    """Set for this process and the worker processes vLLM starts (they inherit it)."""
    os.environ[VLLM_CPU_PLAIN_LINEAR_ENV] = "1" if on else "0"


def prefer_vllm_in_process() -> None:
    """vLLM's engine core in this process unless ``VLLM_ENABLE_V1_MULTIPROCESSING``
    says otherwise (vLLM's own variable; set before an engine starts)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def armed_fault() -> str | None:
    """``DELTASYNC_FAULT``, read at each crash point (tests arm it at run time)."""
    return os.environ.get(FAULT_ENV)


def fault_file() -> str:
    """``DELTASYNC_FAULT_FILE`` ("" when unset)."""
    return os.environ.get(FAULT_FILE_ENV, "")


def set_in_environment(name: str) -> bool:
    """Whether the environment sets the variable of the Settings field ``name``."""
    specs = {f.name: f for f in fields(Settings)}
    if name not in specs:
        raise ConfigError(f"unknown setting {name!r}")
    return specs[name].metadata["env"] in os.environ


# Settings that no longer exist, with what to do instead: a deployment that still sets
# one gets a warning line from its workers (unknown variables are not errors).
REMOVED_SETTINGS: dict[str, str] = {
    "DELTASYNC_PARALLEL_PARTS": "a version's parts are encoded by one diff job, whose "
    "threads use the cores (docs/PERFORMANCE.md); unset it",
}


def removed_settings(env: Mapping[str, str] | None = None) -> list[str]:
    """One line for each removed setting that ``env`` (default ``os.environ``) sets."""
    environ = os.environ if env is None else env
    return [
        f"{name} is set but was removed and is ignored: {why}"
        for name, why in REMOVED_SETTINGS.items()
        if name in environ
    ]


def environment_variables() -> list[str]:
    """Every ``DELTASYNC_*`` variable deltasync reads."""
    return [f.metadata["env"] for f in fields(Settings)] + list(PROCESS_VARIABLES)


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def _per_setting(line: str) -> str:
    """``line`` filled in with each setting's name, env, default and doc, one a line."""
    return "".join(line.format(name=f.name, **f.metadata) + "\n" for f in fields(Settings))


def configuration_reference() -> str:
    """A Markdown table of every setting: variable, default, meaning."""
    head = "| Variable | Default | Meaning |\n| --- | --- | --- |\n"
    return head + _per_setting("| `{env}` | `{default}` | {doc} |")


Settings.__doc__ = (
    "deltasync's settings. Build with ``Settings.from_env(**overrides)``.\n\n"
    "Fields (environment variable, default):\n\n"
) + _per_setting("- ``{name}`` ({env}, {default}): {doc}")
