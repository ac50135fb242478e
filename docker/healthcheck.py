"""Container health check: the Redis that carries events and jobs answers PING, and the
server at URL (an optional argument) answers 200.

    python healthcheck.py [URL]

Exit 0 when healthy, 1 otherwise. Without DELTASYNC_REDIS_URL the process runs its own
embedded Redis, so there is nothing external to check. The vLLM image passes its
server's /health: vLLM loads the model and the run's weights before it opens the port,
so until then the container is starting, not healthy (`docker compose up --wait` waits).
"""

from __future__ import annotations

import os
import sys
import urllib.request

import redis


def redis_answers() -> bool:
    url = os.environ.get("DELTASYNC_REDIS_URL")
    if not url:
        return True
    try:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        print(f"health: redis at {url.split('@')[-1]} unreachable: {exc}", file=sys.stderr)
        return False
    return True


def server_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            if response.status == 200:
                return True
            print(f"health: {url} answered {response.status}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"health: {url} unreachable: {exc}", file=sys.stderr)
    return False


def main(argv: list[str]) -> int:
    healthy = redis_answers() and all(server_answers(url) for url in argv)
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
