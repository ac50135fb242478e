"""The ``deltasync`` command: one click group, thin commands over pipeline/ and workers/."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from pipeline.errors import DeltasyncError
from workers.cli import delta as cmd_delta
from workers.cli import ops as cmd_ops
from workers.cli import report as cmd_report
from workers.cli import run as cmd_run


def _fail(message: str) -> NoReturn:
    click.echo(f"deltasync: error: {message}", err=True)
    sys.exit(1)


def _redis_where(ctx: click.Context) -> str:
    obj = ctx.find_root().obj
    runtime = obj.get("runtime") if isinstance(obj, dict) else None
    return str(runtime.redis_url_redacted) if runtime is not None else "(unknown)"


class _Group(click.Group):
    """Turns every deltasync error into one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DeltasyncError as exc:
            _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        except OSError as exc:
            # A path given that cannot be read or written (a typo, a full or read-only
            # disk): the path and the reason.
            paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
            reason = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
            _fail(f"{' -> '.join(paths)}: {reason}" if paths else reason)
        except Exception as exc:
            # Commands that read Redis directly (status, compact --wait): one line too,
            # naming the server without its password. (Not imported here: `--help`
            # loads no client, and an error of a module never loaded cannot occur.)
            redis = sys.modules.get("redis")
            if redis is None or not isinstance(exc, redis.RedisError):
                raise
            from pipeline.coord.connection import service_error

            _fail(str(service_error(exc, _redis_where(ctx))))
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


# Every command's help shows each option's default (None and off flags show none).
@click.group(
    cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
@click.option(
    "--redis-url",
    envvar="DELTASYNC_REDIS_URL",
    help="Redis URL (redis://, rediss://, unix://). Default: an embedded redis-server "
    "started in the data folder and reused by later commands.",
)
@click.option(
    "--store",
    "store_url",
    envvar="DELTASYNC_STORE",
    help="Object store URL: file:///path, s3://bucket/prefix, "
    "hf://buckets/<namespace>/<bucket>/<prefix>. Default: <home>/store.",
)
@click.option(
    "--home",
    "data_dir",
    envvar="DELTASYNC_HOME",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data folder for the embedded Redis, staging, caches. Default: ~/.deltasync.",
)
@click.option("--log-level", envvar="DELTASYNC_LOG_LEVEL", help="debug, info, warning, error.")
@click.option(
    "--log-json/--log-console",
    envvar="DELTASYNC_LOG_JSON",
    default=None,
    help="Force JSON log lines or console output (default: console on a terminal).",
)
@click.version_option(package_name="deltasync")
@click.pass_context
def cli(
    ctx: click.Context,
    redis_url: str | None,
    store_url: str | None,
    data_dir: Path | None,
    log_level: str | None,
    log_json: bool | None,
) -> None:
    """deltasync: ship fresh weights from an RL trainer to inference servers as
    lossless sparse deltas through an object store.

    The trainer emits step-completed events; diff workers publish each step as a
    delta (manifest last); compaction workers turn chains into anchors; rollout
    nodes follow the run and hot-patch their weights in place, bit-exact.

    Start with `deltasync demo`. Global options go before the command;
    `deltasync COMMAND --help` explains each command.

    \b
    Examples:
      deltasync demo
      deltasync --home /data/ds status --run grpo-7
    """
    overrides: dict[str, Any] = {}
    for key, value in (
        ("redis_url", redis_url),
        ("store_url", store_url),
        ("data_dir", data_dir),
        ("log_level", log_level),
        ("log_json", log_json),
    ):
        if value is not None:
            overrides[key] = value
    ctx.obj = {"overrides": overrides}


for _module in (cmd_run, cmd_ops, cmd_delta, cmd_report):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def main() -> None:
    cli(prog_name="deltasync")
