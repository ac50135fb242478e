"""Start-up of the commands an operator runs all day: wall time of each as a fresh
process, median of ``--reps`` runs, beside a bare ``python -c pass``.

    python benchmarks/bench_cli_startup.py [--reps 7]

The commands (`deltasync --help`, `--version`, `status`, `tail`, `redis url`) run
against an embedded Redis in a temporary data folder and a local store holding one
published version of a tiny model, so `status` loads, checks and resolves real
manifests. `tests/workers/test_cli_startup.py` checks, without timing, that none of them
imports torch, numba, vLLM or the codec.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.coord.connection import redis_client
from pipeline.coord.events import StepCompleted
from pipeline.coord.stream import EventStream
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store import open_store
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from workers.redis_launcher import ensure_redis, stop_redis

REPO = Path(__file__).resolve().parents[1]
RUN = "startup"
COMMANDS = {
    "deltasync --help": ["--help"],
    "deltasync --version": ["--version"],
    "deltasync status": ["status", "--run", RUN],
    "deltasync tail": ["tail", "--run", RUN],
    "deltasync redis url": ["redis", "url"],
}


def timed(argv: list[str], env: dict[str, str], reps: int) -> float:
    """Median wall seconds of ``argv`` run ``reps`` times (after one unmeasured run)."""
    times = []
    for rep in range(reps + 1):
        started = time.perf_counter()
        subprocess.run(argv, env=env, cwd=REPO, check=True, capture_output=True)
        if rep:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder) / "home"
        url = ensure_redis(home)
        try:
            store_url = (Path(folder) / "store").as_uri()
            state = UpdateGenerator(ModelConfig.preset("tiny"), seed=1).state()
            save_state(state, Path(folder) / "0.safetensors")
            cache = StateCache(Path(folder) / "cache", RUN)
            publish_step(open_store(store_url), RUN, 0, Path(folder) / "0.safetensors", cache)
            EventStream(redis_client(url), RUN).publish(
                StepCompleted.now(run=RUN, version=0, checkpoint="/c/0", owned=False)
            )
            env = dict(
                os.environ,
                DELTASYNC_HOME=str(home),
                DELTASYNC_STORE=store_url,
                PYTHONPATH=str(REPO),
                DELTASYNC_LOG_JSON="1",
            )
            env.pop("DELTASYNC_REDIS_URL", None)
            python = sys.version.split()[0]
            print(f"median of {args.reps} runs, {os.cpu_count()} CPUs, Python {python}")
            base = timed([sys.executable, "-c", "pass"], env, args.reps)
            print(f"{'python -c pass':<24} {base:6.3f} s")
            for name, argv in COMMANDS.items():
                took = timed([sys.executable, "-m", "workers", *argv], env, args.reps)
                print(f"{name:<24} {took:6.3f} s")
        finally:
            stop_redis(home)


if __name__ == "__main__":
    main()
