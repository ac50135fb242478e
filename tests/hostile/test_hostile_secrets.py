"""Secrets: Redis with a password and an ACL user, used through DELTASYNC_REDIS_URL by
a real worker and a real rollout node over a real S3 store. The passwords and the
store's secret key never appear in logs or error messages, and rq payloads in Redis
are JSON, never pickle."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import redis

from pipeline.config import Settings
from pipeline.store import open_store
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator
from pipeline.versions import chain
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from tests.servers import S3_SECRET_KEY, RedisServer, SeaweedS3Server
from workers import queues
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.slow

ADMIN_PASSWORD = "adm1n-Pa55-7c1e0f"
USER = "deltasync"
USER_PASSWORD = "us3r-Pa55-9b2d44"


class PasswordRedis(RedisServer):
    """redis-server that requires a password (and gets an ACL user once started)."""

    def command(self) -> list[str]:
        return [*super().command(), "--requirepass", ADMIN_PASSWORD]

    def is_ready(self) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, password=ADMIN_PASSWORD)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def add_user(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, password=ADMIN_PASSWORD)
        try:
            client.execute_command(
                "ACL", "SETUSER", USER, "on", f">{USER_PASSWORD}", "~*", "&*", "+@all"
            )
        finally:
            client.close()

    def user_url(self, password: str = USER_PASSWORD) -> str:
        return f"redis://{USER}:{password}@127.0.0.1:{self.port}/0"


@pytest.mark.redis
def test_passwords_and_store_keys_stay_out_of_logs(
    tmp_path: Path, s3_server: SeaweedS3Server, s3_url: str
) -> None:
    server = PasswordRedis(tmp_path / "redis")
    server.start()
    try:
        server.add_user()
        url = server.user_url()
        env = deltasync_env(url, tmp_path, DELTASYNC_STORE=s3_url)
        settings = Settings.from_env(env)
        store = open_store(settings.store_url)
        emitter = Emitter("secret-run", settings=settings)
        generator = UpdateGenerator(ModelConfig.preset("tiny"), seed=2)
        outputs: list[str] = []
        with processes(env, tmp_path / "logs", diff=["worker", "diff"]):
            state = generator.state()
            for step in range(2):
                if step:
                    state = generator.step()
                emitter.emit_state(step, state)
            wait_for(lambda: chain.list_versions(store, "secret-run").head == 1, "the head")
            node = cli(env, "rollout", "--run", "secret-run", "--node-id", "n", "--poll", "0.3",
                       "--until", "1", "--dump", str(tmp_path / "dump.safetensors"))  # fmt: skip
            assert node.returncode == 0, node.stderr[-3000:]
            outputs += [node.stdout, node.stderr]

        # rq payloads: JSON (zlib-compressed by rq), never pickle.
        admin = redis.Redis.from_url(url)
        for step in range(2):
            raw = admin.hget(f"rq:job:{queues.diff_job_id('secret-run', step)}", "data")
            assert isinstance(raw, bytes)
            payload = zlib.decompress(raw)
            assert not payload.startswith(b"\x80"), "a pickle"
            decoded = json.loads(payload)
            assert "secret-run" in json.dumps(decoded)

        # Operator commands with the right and the wrong password.
        status = cli(env, "status", "--run", "secret-run")
        assert status.returncode == 0, status.stderr
        wrong = deltasync_env(server.user_url("not-the-password-31337"), tmp_path)
        denied = cli(wrong, "status", "--run", "secret-run")
        assert denied.returncode != 0
        assert len(denied.stderr.strip().splitlines()) == 1, denied.stderr
        outputs += [status.stdout, status.stderr, denied.stdout, denied.stderr]
        assert "not-the-password-31337" not in denied.stderr
        bad_url = cli(deltasync_env("redis://u:p4ss%zz@[::1:6379/0", tmp_path), "status",
                      "--run", "x")  # fmt: skip
        assert bad_url.returncode != 0 and "p4ss" not in bad_url.stderr
        outputs += [bad_url.stderr]
    finally:
        server.stop()

    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))
    everything = logs + "".join(outputs)
    assert "worker starting" in logs and "***" in logs  # the URL is logged, redacted
    for secret in (ADMIN_PASSWORD, USER_PASSWORD, S3_SECRET_KEY):
        assert secret not in everything, f"a secret leaked: {secret[:4]}..."
