"""Redis connections: clients from URLs, URLs with secrets redacted, and one
translation of Redis failures into ``ServiceUnavailableError``."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from pipeline.errors import ConfigError, ServiceUnavailableError

_SECRET_QUERY_KEYS = ("password", "pass", "token", "secret")


def text(value: str | bytes) -> str:
    """A Redis reply field as text (clients without ``decode_responses`` give bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, safe for logs and errors."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<malformed URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if sep else f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*/"
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redis_client(
    url: str,
    *,
    socket_timeout_s: float = 30.0,
    connect_timeout_s: float = 5.0,
    retries: int = 3,
    name: str | None = None,
) -> redis.Redis:
    """A client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs.

    Users and passwords (ACL) come from the URL; TLS options from its query
    (``?ssl_ca_certs=/path&ssl_cert_reqs=required``). Transient connection
    errors and timeouts are retried with exponential backoff. Blocking reads
    must block for less than ``socket_timeout_s`` (``EventStream`` sees to that;
    rq raises the timeout of its own connections as it needs). ``name`` is the
    connection's client name (``CLIENT LIST``: who is connected, for ``redis stop``).
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"redis URL {redact_url(url)!r}: scheme must be redis, rediss or unix")
    if scheme != "unix":  # the path names the database; redis-py reads any other as 0
        try:
            database = unquote(urlsplit(url).path).replace("/", "")
        except ValueError:
            database = ""  # from_url names what is wrong
        if database and not (database.isascii() and database.isdigit()):
            raise ConfigError(
                f"redis URL {redact_url(url)!r}: database {database[:20]!r} is not a number "
                "(redis://host:port/0)"
            )
    try:
        client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            health_check_interval=30,
            client_name=None if name is None else re.sub(r"[^!-~]", "_", name)[:100],
        )
    except ValueError as exc:
        raise ConfigError(f"redis URL {redact_url(url)!r} is invalid: {exc}") from None
    return client


def client_url(client: redis.Redis) -> str:
    """Where ``client`` connects, as a URL without any password."""
    kwargs = client.connection_pool.connection_kwargs
    db = kwargs.get("db", 0)
    user = kwargs.get("username")
    auth = f"{quote(str(user))}@" if user else ""
    if kwargs.get("path"):
        return f"unix://{auth}{kwargs['path']}?db={db}"
    scheme = "rediss" if "ssl_cert_reqs" in kwargs else "redis"
    return f"{scheme}://{auth}{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"


@contextlib.contextmanager
def redis_errors(client: redis.Redis, doing: str = "") -> Iterator[None]:
    """Turn Redis failures into ``ServiceUnavailableError`` naming the server (no password).

    Connection problems and timeouts read "unavailable"; a refused password
    "refused the password"; errors the server answers with (wrong type, read-only
    replica, out of memory) read "failed".
    """
    try:
        yield
    except redis.RedisError as exc:
        raise service_error(exc, client_url(client), doing) from exc


def service_error(exc: redis.RedisError, where: str, doing: str = "") -> ServiceUnavailableError:
    """One line for a Redis failure at ``where`` (a URL without password)."""
    what = f" while {doing}" if doing else ""
    lines = str(exc).splitlines()
    detail = lines[0] if lines else type(exc).__name__
    if isinstance(exc, redis.AuthenticationError | redis.AuthenticationWrongNumberOfArgsError):
        return ServiceUnavailableError(
            f"redis at {where} refused the password{what}: {detail} (check DELTASYNC_REDIS_URL; "
            "`deltasync redis url` prints the embedded server's)"
        )
    state = (
        "is unavailable"
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError)
        else "failed"
    )
    return ServiceUnavailableError(f"redis at {where} {state}{what}: {detail}")
