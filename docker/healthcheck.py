"""Container health check: the Redis that carries events and jobs answers PING.

Exit 0 when healthy, 1 otherwise. Without DELTASYNC_REDIS_URL the process runs its own
embedded Redis, so there is nothing external to check.
"""

from __future__ import annotations

import os
import sys

import redis


def main() -> int:
    url = os.environ.get("DELTASYNC_REDIS_URL")
    if not url:
        return 0
    try:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        print(f"health: redis at {url.split('@')[-1]} unreachable: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
