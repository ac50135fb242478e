"""Settings from the environment and options, validated when built."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from pipeline.config import (
    REMOVED_SETTINGS,
    S3Tuning,
    Settings,
    configuration_reference,
    environment_variables,
    removed_settings,
    s3_tuning,
    vllm_options,
)
from pipeline.errors import ConfigError
from tests.pipeline_helpers import cli, deltasync_env


def test_defaults_derive_from_the_home_folder(tmp_path: Path) -> None:
    settings = Settings.from_env({"DELTASYNC_HOME": str(tmp_path)})
    assert settings.data_dir == tmp_path
    assert settings.redis_url is None
    assert settings.store_url == (tmp_path / "store").as_uri()
    assert settings.staging_dir == tmp_path / "staging"
    assert settings.cache_dir == tmp_path / "cache"
    assert (settings.level, settings.max_chain, settings.keep_anchors) == (1, 20, 2)
    assert settings.max_delta_fraction == 0.5
    assert settings.replica_ttl_s == 600.0
    assert settings.signing_key_path is None and settings.signing_key() is None
    assert settings.verify_key_path is None and settings.verify_key() is None
    assert (settings.log_level, settings.log_json, settings.keep_staging) == ("info", None, False)


def test_home_defaults_to_dot_deltasync(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Settings.from_env({}).data_dir == tmp_path / ".deltasync"
    assert Settings().cache_dir == tmp_path / ".deltasync" / "cache"


def test_environment_is_parsed(tmp_path: Path) -> None:
    key = tmp_path / "signing.pem"
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\n")
    env = {
        "DELTASYNC_HOME": str(tmp_path / "home"),
        "DELTASYNC_REDIS_URL": "rediss://user:pw@redis.example:6380/1",
        "DELTASYNC_STORE": "s3://bucket/prefix",
        "DELTASYNC_STAGING": str(tmp_path / "stage"),
        "DELTASYNC_CACHE": str(tmp_path / "cache"),
        "DELTASYNC_LEVEL": "3",
        "DELTASYNC_COMPACT_MAX_CHAIN": " 7 ",
        "DELTASYNC_COMPACT_MAX_FRACTION": "0.25",
        "DELTASYNC_KEEP_ANCHORS": "3",
        "DELTASYNC_REPLICA_TTL": "30.5",
        "DELTASYNC_SIGNING_KEY": str(key),
        "DELTASYNC_VERIFY_KEY": str(key),
        "DELTASYNC_LOG_LEVEL": "DEBUG",
        "DELTASYNC_LOG_JSON": "yes",
        "DELTASYNC_KEEP_STAGING": "1",
    }
    s = Settings.from_env(env)
    assert s.redis_url == "rediss://user:pw@redis.example:6380/1"
    assert s.store_url == "s3://bucket/prefix"
    assert s.staging_dir == tmp_path / "stage"
    assert s.cache_dir == tmp_path / "cache"
    assert (s.level, s.max_chain, s.keep_anchors) == (3, 7, 3)
    assert (s.max_delta_fraction, s.replica_ttl_s) == (0.25, 30.5)
    assert s.signing_key_path == key and s.signing_key() == key.read_bytes()
    assert s.verify_key() == key.read_bytes()
    assert (s.log_level, s.log_json, s.keep_staging) == ("debug", True, True)


def test_overrides_win_and_none_means_not_given(tmp_path: Path) -> None:
    env = {
        "DELTASYNC_HOME": str(tmp_path),
        "DELTASYNC_LEVEL": "3",
        "DELTASYNC_REDIS_URL": "redis://env:6379/0",
    }
    s = Settings.from_env(env, level=1, redis_url=None, store_url=str(tmp_path / "elsewhere"))
    assert s.level == 1
    assert s.redis_url == "redis://env:6379/0"
    assert s.store_url == (tmp_path / "elsewhere").as_uri()  # a plain path is a local folder
    s = Settings.from_env(env, keep_staging="true", max_chain="4", data_dir=tmp_path / "d")
    assert (s.keep_staging, s.max_chain) == (True, 4)
    assert s.cache_dir == tmp_path / "d" / "cache"
    with pytest.raises(ConfigError, match="unknown setting"):
        Settings.from_env(env, colour="blue")


def test_empty_variables_count_as_unset(tmp_path: Path) -> None:
    s = Settings.from_env({"DELTASYNC_HOME": str(tmp_path), "DELTASYNC_REDIS_URL": " "})
    assert s.redis_url is None


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DELTASYNC_REDIS_URL", "http://localhost:6379"),
        ("DELTASYNC_REDIS_URL", "localhost:6379"),
        ("DELTASYNC_REDIS_URL", "redis://:secret@host:99999/0"),
        ("DELTASYNC_REDIS_URL", "redis:///0"),
        ("DELTASYNC_REDIS_URL", "unix://"),
        ("DELTASYNC_LEVEL", "fast"),
        ("DELTASYNC_LEVEL", "9"),
        ("DELTASYNC_LEVEL", "2"),
        ("DELTASYNC_LEVEL", "1.5"),
        ("DELTASYNC_COMPACT_MAX_CHAIN", "0"),
        ("DELTASYNC_COMPACT_MAX_CHAIN", "-3"),
        ("DELTASYNC_COMPACT_MAX_FRACTION", "0"),
        ("DELTASYNC_COMPACT_MAX_FRACTION", "nan"),
        ("DELTASYNC_COMPACT_MAX_FRACTION", "inf"),
        ("DELTASYNC_COMPACT_MAX_FRACTION", "half"),
        ("DELTASYNC_KEEP_ANCHORS", "0"),
        ("DELTASYNC_PATCH_MEMORY_MB", "-1"),
        ("DELTASYNC_PATCH_MEMORY_MB", "lots"),
        ("DELTASYNC_REPLICA_TTL", "-1"),
        ("DELTASYNC_REPLICA_TTL", "soon"),
        ("DELTASYNC_SIGNING_KEY", "/nonexistent/key.pem"),
        ("DELTASYNC_VERIFY_KEY", "/nonexistent/key.pub"),
        ("DELTASYNC_LOG_LEVEL", "loud"),
        ("DELTASYNC_LOG_JSON", "maybe"),
        ("DELTASYNC_KEEP_STAGING", "2"),
        ("DELTASYNC_STAGING", "/tmp/a\nb"),
    ],
)
def test_bad_values_name_the_variable(tmp_path: Path, variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"DELTASYNC_HOME": str(tmp_path), variable: value})
    message = str(info.value)
    assert message.startswith(variable)
    assert "\n" not in message
    assert "secret" not in message


def test_a_retired_codec_level_says_what_to_use_instead(tmp_path: Path) -> None:
    advice = "level 2 is no longer supported; republish with level 1 or 3"
    with pytest.raises(ConfigError, match=advice):
        Settings.from_env({"DELTASYNC_HOME": str(tmp_path), "DELTASYNC_LEVEL": "2"})


def test_bad_typed_overrides(tmp_path: Path) -> None:
    for override in ({"max_chain": True}, {"level": "x"}, {"keep_staging": 3}):
        with pytest.raises(ConfigError):
            Settings.from_env({"DELTASYNC_HOME": str(tmp_path)}, **override)


def test_settings_are_frozen(tmp_path: Path) -> None:
    s = Settings.from_env({"DELTASYNC_HOME": str(tmp_path)})
    with pytest.raises(AttributeError):
        s.level = 2  # type: ignore[misc]


def test_every_field_is_documented() -> None:
    reference = configuration_reference()
    doc = Settings.__doc__ or ""
    for spec in fields(Settings):
        assert spec.metadata["env"].startswith("DELTASYNC_")
        assert spec.metadata["doc"]
        assert f"`{spec.metadata['env']}`" in reference
        assert f"``{spec.name}``" in doc


def test_every_variable_is_read_in_config_alone() -> None:
    """One settings source: each DELTASYNC_* name the code mentions is declared in
    pipeline/config.py, and no other module reads the environment for one."""
    declared = set(environment_variables())
    assert len(declared) == len(environment_variables())
    assert not declared & set(REMOVED_SETTINGS), "a removed setting is read"
    declared |= set(REMOVED_SETTINGS)
    repo = Path(__file__).resolve().parents[2]
    for path in sorted([*repo.glob("pipeline/**/*.py"), *repo.glob("workers/**/*.py")]):
        text = path.read_text()
        named = set(re.findall(r"DELTASYNC_[A-Z0-9_]+", text))
        assert named <= declared, f"{path.relative_to(repo)}: {sorted(named - declared)}"
        if path.name == "config.py" and path.parent.name == "pipeline":
            continue
        for line in text.splitlines():
            if re.search(r"os\.environ\b|getenv\(", line):
                assert "DELTASYNC" not in line, f"{path}: {line.strip()}"
                assert not re.search(r"[A-Z]_ENV\b", line), f"{path}: {line.strip()}"


def test_process_variables(tmp_path: Path) -> None:
    tuning = s3_tuning({"AWS_ENDPOINT_URL": "http://aws", "DELTASYNC_S3_PART_SIZE": "6291456"})
    assert tuning == S3Tuning(endpoint="http://aws", part_size=6 << 20, max_attempts=4)
    assert s3_tuning({"DELTASYNC_S3_ENDPOINT": "http://s3", "AWS_ENDPOINT_URL": "x"}).endpoint == (
        "http://s3"
    )
    with pytest.raises(ConfigError, match="DELTASYNC_S3_MAX_ATTEMPTS"):
        s3_tuning({"DELTASYNC_S3_MAX_ATTEMPTS": "many"})
    assert vllm_options({}) == {}
    assert vllm_options({"DELTASYNC_VLLM_OPTIONS": '{"seed": 1}'}) == {"seed": 1}
    for bad in ("{", "[1]"):
        with pytest.raises(ConfigError, match="DELTASYNC_VLLM_OPTIONS"):
            vllm_options({"DELTASYNC_VLLM_OPTIONS": bad})


def test_a_removed_setting_is_ignored_with_one_warning(redis_url: str, tmp_path: Path) -> None:
    """An old deployment's DELTASYNC_PARALLEL_PARTS (the single-machine parallel diff,
    removed) builds settings as before; a diff worker says once that it is ignored."""
    old = {"DELTASYNC_PARALLEL_PARTS": "1"}
    assert Settings.from_env(old) == Settings.from_env({})
    assert removed_settings({}) == []
    [line] = removed_settings(old)
    assert line.startswith("DELTASYNC_PARALLEL_PARTS is set but was removed and is ignored")
    for extra, count in ((old, 1), ({}, 0)):
        done = cli(deltasync_env(redis_url, tmp_path, **extra), "worker", "diff", "--burst")
        assert done.returncode == 0, done.stderr[-2000:]
        warned = [x for x in done.stderr.splitlines() if "DELTASYNC_PARALLEL_PARTS" in x]
        assert len(warned) == count, done.stderr[-2000:]
        assert all('"level": "warning"' in x for x in warned), warned
