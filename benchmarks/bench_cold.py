"""A fresh environment's first applied delta, against its steady state.

    python benchmarks/bench_cold.py [--params 0.2e9] [--versions 3]
                                    [--cases cold,warm-at-start,warmed,venv-cold,venv-cached]

Each case starts a redis-server, one ``deltasync worker diff`` and one ``deltasync
rollout --target torch`` in processes of their own, with a kernel cache folder of its
own (``XDG_CACHE_HOME``), emits version 0 (Emitter.emit_state of a Qwen-shaped bf16
state, benchmarks/emulator.py), waits for the node's bootstrap, then emits
``--versions`` deltas of magnitude-dependent updates (2% changed) one after the other.
It prints the bootstrap (version 0's step-completed to the node holding it: the
processes' start-up, the anchor's publish and load, and whatever compiling they
wait for), then, for the first delta and for the median of the later ones, the sync
(step-completed to applied, one clock: the Redis stream) and the node's apply
(decode, proof and write), and the first's excess over the steady state. The target:
the first delta within the steady state plus 2 s.

Cases (the kernel cache empty unless said):
- ``cold``: kernels compiled on first use (``DELTASYNC_WARM=0``), as before the
  warm-up existed: the first version a worker publishes and a node applies waits.
- ``warm-at-start``: the product's default: nodes and diff workers compile the kernels
  on a thread of their own as they start.
- ``warmed``: ``deltasync warm`` ran first (scripts/setup.sh, the images), its time
  printed; the processes then load the kernels from the cache.
- ``venv-cold`` / ``venv-cached``: a virtual environment made now, deltasync installed
  into it from this checkout (``pip install --no-deps``; its dependencies come from
  this environment through a .pth file), the processes run from it: with an empty
  kernel cache and the product's default, and with the cache another environment of
  this machine filled (the kernels are keyed by their sources, not by where they are
  installed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_e2e import applied_nodes, stream_events
from benchmarks.emulator import MagnitudeEmulator, make_state, qwen_like_shapes
from tests.pipeline_helpers import REPO, wait_for
from tests.servers import RedisServer

RUN = "cold"
CASES = ("cold", "warm-at-start", "warmed", "venv-cold", "venv-cached")


def make_venv(folder: Path) -> Path:
    """A new virtual environment with deltasync installed from this checkout (not
    editable); its dependencies are this environment's. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    found = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    site = Path(found.stdout.strip())
    (site / "outer-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         str(REPO)],
        check=True,
        cwd=folder,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    alone = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [str(python), "-c", "import pipeline, workers; print(pipeline.__file__, workers.__file__)"],
        check=True, capture_output=True, text=True, cwd=folder, env=alone,
    ).stdout.strip()  # fmt: skip
    if str(REPO) in where:
        raise SystemExit(f"the new environment imports this checkout, not its own copy: {where}")
    print(f"new environment: {where}", flush=True)
    return python


@contextlib.contextmanager
def started(python: Path, env: dict[str, str], logs: Path, **commands: list[str]) -> Iterator[None]:
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for name, args in commands.items():
            out = (logs / f"{name}.log").open("ab")
            procs.append(
                subprocess.Popen(
                    [str(python), "-m", "workers", *args],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=logs,
                )
            )
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def step_completed(r: redis.Redis, version: int) -> float:
    """When version's step-completed event was added (the stream's clock)."""
    return next(
        t for t, d in stream_events(r, RUN)
        if d.get("type") == "step-completed" and int(d["version"]) == version
    )  # fmt: skip


def one_case(case: str, args: argparse.Namespace, work: Path, venv: Path | None) -> dict[str, Any]:
    folder = work / case
    folder.mkdir()
    python = Path(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTASYNC_", "NUMBA_"))}
    env.update(
        {
            "XDG_CACHE_HOME": str(work / ("shared-cache" if case == "venv-cached" else case)),
            "DELTASYNC_HOME": str(folder / "home"),
            "DELTASYNC_STORE": f"file://{folder / 'store'}",
            "DELTASYNC_LOG_JSON": "1",
            "DELTASYNC_WARM": "0" if case == "cold" else "1",
            "PYTHONPATH": str(REPO),
        }
    )
    if case.startswith("venv"):
        assert venv is not None
        python = venv
        env.pop("PYTHONPATH")  # deltasync from the new environment, not this checkout
    warm_s = None
    if case in ("warmed", "venv-cached"):
        started_at = time.perf_counter()
        subprocess.run(
            [str(python), "-m", "workers", "warm"], env=env, check=True, cwd=folder,
            capture_output=True,
        )  # fmt: skip
        warm_s = time.perf_counter() - started_at
    state = make_state(qwen_like_shapes(args.params), seed=0)
    emulator = MagnitudeEmulator(0.02, seed=1)
    rows = []
    with RedisServer(folder / "redis") as server:
        env["DELTASYNC_REDIS_URL"] = server.url
        from pipeline.config import Settings
        from workers.trainers.trainer import Emitter

        settings = Settings.from_env({k: v for k, v in env.items() if k.startswith("DELTASYNC_")})
        r = redis.Redis.from_url(server.url)
        last = args.versions
        node = ["rollout", "--run", RUN, "--target", "torch", "--node-id", "n",
                "--until", str(last), "--poll", "30"]  # fmt: skip
        with started(python, env, folder / "logs", diff=["worker", "diff"], node=node):
            emitter = Emitter(RUN, settings=settings)
            emitter.emit_state(0, state)
            wait_for(lambda: applied_nodes(r, RUN, 0), "the bootstrap", timeout_s=900)
            boot_s = applied_nodes(r, RUN, 0)["n"][0] - step_completed(r, 0)
            for version in range(1, last + 1):
                emulator.step_(state)
                emitter.emit_state(version, state)
                wait_for(lambda v=version: applied_nodes(r, RUN, v), f"v{version}", timeout_s=900)
                t_step = step_completed(r, version)
                t_applied, doc = applied_nodes(r, RUN, version)["n"]
                rows.append({"sync_s": t_applied - t_step, "apply_s": float(doc["apply_s"])})
                print(f"  {case} v{version}: sync {rows[-1]['sync_s']:.2f} s, "
                      f"apply {rows[-1]['apply_s']:.2f} s", flush=True)  # fmt: skip
        r.close()
    steady = {k: statistics.median(row[k] for row in rows[1:]) for k in ("sync_s", "apply_s")}
    return {"case": case, "first": rows[0], "steady": steady, "warm_s": warm_s, "boot_s": boot_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.2e9)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or args.versions < 2:
        parser.error(f"unknown cases {unknown}" if unknown else "--versions: at least 2")
    print(f"load {os.getloadavg()}, {os.cpu_count()} CPUs", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as scratch:
        work = Path(scratch)
        venv = make_venv(work / "venv") if any(c.startswith("venv") for c in cases) else None
        if "venv-cached" in cases:
            # Another environment of this machine (this checkout) fills the cache.
            env = {**os.environ, "XDG_CACHE_HOME": str(work / "shared-cache")}
            env.pop("NUMBA_CACHE_DIR", None)
            env.pop("DELTASYNC_KERNEL_CACHE", None)
            subprocess.run([sys.executable, "-m", "workers", "warm"], env=env, check=True,
                           cwd=REPO, capture_output=True)  # fmt: skip
        for case in cases:
            results.append(one_case(case, args, work, venv))
            shutil.rmtree(work / case, ignore_errors=True)
    print(f"\n{args.params / 1e9:.2f}B bf16, 1 torch node, 2% changed; load {os.getloadavg()}")
    print("| case | `deltasync warm` s | v0 to bootstrapped s | first sync s | steady sync s | "
          "first - steady | first apply s | steady apply s |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        warm = "" if r["warm_s"] is None else f"{r['warm_s']:.1f}"
        first, steady = r["first"], r["steady"]
        print(f"| {r['case']} | {warm} | {r['boot_s']:.1f} | {first['sync_s']:.2f} | "
              f"{steady['sync_s']:.2f} | "
              f"{first['sync_s'] - steady['sync_s']:+.2f} | {first['apply_s']:.2f} | "
              f"{steady['apply_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
