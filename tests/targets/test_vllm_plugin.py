"""A stock vLLM server (`python -m vllm.entrypoints.openai.api_server`, what `vllm
serve` runs) with the `deltasync` weight-transfer backend, loaded through the
`vllm.general_plugins` entry point, driven by `deltasync rollout --target vllm-http`
as a real process, under load from the official `openai` client while a real diff
worker publishes versions.

Checked: no request fails; `/weight_info` names each version; every greedy answer is
what a fresh engine generates at one of the run's versions (none mixes two), and
once the server says v5, exactly v5's; a damaged delta is refused while the server
answers on with v5; the workers' weights end equal to the trainer's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.events import ReplicaError
from pipeline.coord.stream import EventStream
from pipeline.format.hashes import content_hashes
from pipeline.store.file import FileStore
from pipeline.targets.vllm.target import EXTENSION_CLS
from pipeline.versions import chain
from tests.pipeline_helpers import REPO, deltasync_env, processes, wait_for
from tests.servers import free_port, stop_process
from tests.targets.test_vllm_serve import (
    HAVE_OPENAI,
    RUN,
    SERVER_OPTIONS,
    VERSIONS,
    Load,
    applied,
    get_json,
    publish_damaged,
    reference_outputs,
    responding,
    trainer_versions,
)
from tests.vllm_model import VLLM_MARKS
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter

pytestmark = [
    *VLLM_MARKS,
    pytest.mark.skipif(not HAVE_OPENAI, reason="openai (the test extra) is not installed"),
]

NODE = "http-1"


def plugin_site(folder: Path) -> Path:
    """A folder that, on the path, declares deltasync's `vllm.general_plugins` entry
    point (as the installed package's metadata does), for this checkout."""
    info = folder / "deltasync_vllm_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deltasync-vllm-plugin\n"
                                   "Version: 0.0\n")  # fmt: skip
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ndeltasync = workers.nodes.vllm_plugin:register\n"
    )
    return folder


def collective_rpc(base: str, method: str, *args: object) -> Any:
    request = urllib.request.Request(
        f"{base}/collective_rpc",
        data=json.dumps({"method": method, "args": list(args)}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


class HashesRead:
    """``deltasync_hashes`` through ``/collective_rpc``; ``read`` is False while vLLM
    answers something other than one envelope per worker (the last answer is kept
    for the failure message)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.results: Any = None

    def read(self) -> bool:
        self.results = collective_rpc(self.base, "deltasync_hashes", None)["results"]
        ok = isinstance(self.results, list) and all(isinstance(r, dict) for r in self.results)
        if not ok:
            print(f"collective_rpc deltasync_hashes answered {self.results!r:.500}")
        return ok


def test_stock_vllm_server_with_the_plugin_follows_a_run_driven_over_http(
    tmp_path: Path, redis_url: str
) -> None:
    serve_model, weights, folders = trainer_versions(tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = deltasync_env(redis_url, tmp_path, OMP_NUM_THREADS="2")
    server_env = dict(
        env,
        VLLM_SERVER_DEV_MODE="1",
        DELTASYNC_VLLM_CPU_PLAIN_LINEAR="1",
        # No memory for decoded patches: the workers walk every delta into their shadow.
        DELTASYNC_PATCH_MEMORY_MB="0",
        PYTHONPATH=os.pathsep.join([str(REPO), str(plugin_site(tmp_path / "site"))]),
    )
    store = FileStore(tmp_path / "store")
    client = redis_client(redis_url)
    events = EventStream(client, RUN)
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    emitter = Emitter(RUN, settings=settings)
    server_log = tmp_path / "server.log"
    log = server_log.open("ab")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(serve_model),
         "--load-format", "dummy", "--weight-transfer-config", '{"backend": "deltasync"}',
         "--worker-extension-cls", EXTENSION_CLS,
         "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), *SERVER_OPTIONS],
        env=server_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    node = ["rollout", "--run", RUN, "--target", "vllm-http", "--url", base,
            "--node-id", NODE, "--poll", "0.5"]  # fmt: skip
    try:
        with processes(env, tmp_path / "logs", diff=["worker", "diff"]):
            emitter.emit_checkpoint(0, folders[0] / "model.safetensors")
            wait_for(lambda: responding(f"{base}/v1/models"), "the server to start", 600)
            with processes(env, tmp_path / "node-logs", node=node) as procs:
                wait_for(applied(events, 0), "v0 applied")
                assert get_json(f"{base}/weight_info")["weight_version"] == f"{RUN}@0"
                model = get_json(f"{base}/v1/models")["data"][0]["id"]
                with Load(f"{base}/v1", model) as load:
                    for version in range(1, VERSIONS):
                        wait_for(load.answered(None, 4 * version), "answers before the next")
                        emitter.emit_checkpoint(version, folders[version] / "model.safetensors")
                        wait_for(applied(events, version), f"v{version} applied")
                        info = get_json(f"{base}/weight_info")
                        assert info["weight_version"] == f"{RUN}@{version}"
                    # Each thread has one request in flight at most: answers after the
                    # next four were all sent once the server held the last version.
                    mark = load.count(None) + 4
                    wait_for(load.answered(None, mark + 8), "answers on the last version")
                    publish_damaged(store, tmp_path, folders[VERSIONS - 1], weights[-1], VERSIONS)

                    def refused() -> bool:
                        return any(isinstance(e, ReplicaError) and e.node == NODE
                                   for _, e in events.read("0-0", count=10_000))  # fmt: skip

                    wait_for(refused, "the damaged delta refused")
                    answered = load.count(None)
                    wait_for(load.answered(None, answered + 8), "answers after the refusal")
                    info = get_json(f"{base}/weight_info")
                held = HashesRead(base)
                wait_for(held.read, "the workers' hashes")
                assert procs["node"].poll() is None
        assert server.poll() is None
    finally:
        stop_process(server)
        log.close()
        client.close()

    assert load.failures == []
    assert info["weight_version"] == f"{RUN}@{VERSIONS - 1}"
    # The plugin's log lines (structlog's default renderer, maybe coloured).
    lines = re.sub(r"\x1b\[[0-9;]*m", "", server_log.read_text(errors="replace"))
    walked = re.findall(r"vllm target applied delta.*walked=(\d+)", lines)
    # Tensors a step changes densely (bitmap records) keep their patches.
    assert len(walked) >= VERSIONS - 1 and any(int(n) > 0 for n in walked), walked
    # The workers' weights are the trainer's last version, bit for bit (content
    # hashes of the state the backend keeps, read through the worker extension).
    # In the run's own tensor hash (its first anchor fixed it).
    head = chain.load_manifest(store, RUN, "delta", VERSIONS - 1)
    algorithm = content_hashes.get(head.content_hash)
    want = {name: algorithm.full(t) for name, t in weights[-1].items()}
    assert held.results == [{"ok": True, "value": want}]
    references = reference_outputs(folders, tmp_path / "reference.json")
    last = VERSIONS - 1
    for index, answer in enumerate(load.answers):
        kind = "chat" if answer.kind == "chat" else "completion"
        possible = {v for v in references if references[v][kind][answer.prompt] == answer.text}
        assert possible, answer  # some version's output: none mixes two
        if index >= mark:
            assert last in possible, answer
