"""`deltasync delta ...`: offline encode, apply and inspect, no Redis or store needed."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.codec import DEFAULT_LEVEL, LEVELS

_PATH = click.Path(path_type=Path)
_EXISTING = click.Path(exists=True, path_type=Path)


@click.group("delta")
def delta() -> None:
    """Offline deltas between two checkpoints (safetensors files or sharded folders).

    \b
    Example:
      deltasync delta create --base a.safetensors --new b.safetensors --out d/
    """


@delta.command("create")
@click.option("--base", required=True, type=_EXISTING, help="Checkpoint the receiver holds.")
@click.option("--new", "new", required=True, type=_EXISTING, help="Checkpoint to ship.")
@click.option("--out", required=True, type=_PATH, help="Delta folder to write.")
@click.option(
    "--level",
    type=click.Choice([str(level) for level in LEVELS]),
    default=str(DEFAULT_LEVEL),
    help="Codec level: 1 codes positions on their own; 3 also conditions them on the "
    "base's magnitudes, in chunks that decode independently (smaller).",
)
def create(base: Path, new: Path, out: Path, level: str) -> None:
    """Encode the bitwise difference from BASE to NEW into the folder OUT.

    \b
    Example:
      deltasync delta create --base a.safetensors --new b.safetensors --out d/ --level 3
    """
    from pipeline.publish import offline

    summary = offline.create_delta(base, new, out, level=int(level))
    click.echo(
        f"wrote {out}: {summary.changed:,} of {summary.total:,} elements changed "
        f"({100 * summary.changed / max(summary.total, 1):.2f}%), {summary.bytes:,} bytes"
    )


@delta.command("apply")
@click.option("--base", required=True, type=_EXISTING, help="Checkpoint the delta was made from.")
@click.option("--delta", "delta_path", required=True, type=_EXISTING, help="Delta folder.")
@click.option("--out", required=True, type=_PATH, help="Checkpoint to write (same form as base).")
def apply(base: Path, delta_path: Path, out: Path) -> None:
    """Apply a delta to BASE and write the result to OUT, verifying every hash first.

    \b
    Example:
      deltasync delta apply --base a.safetensors --delta d/ --out c.safetensors
    """
    from pipeline.publish import offline

    offline.apply_delta(base, delta_path, out)
    click.echo(f"wrote {out}")


@delta.command("inspect")
@click.argument("delta_path", type=_EXISTING)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
def inspect(delta_path: Path, as_json: bool) -> None:
    """Show what a delta holds, tensor by tensor.

    \b
    Example:
      deltasync delta inspect d/ --json
    """
    from pipeline.publish import offline

    report = offline.inspect_delta(delta_path)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{delta_path} (codec level {report.level})")
    for column in ("tensor", "dtype", "shape", "encoding", "changed", "bytes", "B/changed"):
        table.add_column(column, justify="left" if column in ("tensor", "encoding") else "right")
    for row in report.rows:
        per = f"{row.bytes / row.changed:.2f}" if row.changed else "-"
        table.add_row(
            row.name,
            row.dtype,
            "x".join(map(str, row.shape)) or "()",
            row.encoding,
            f"{row.changed:,}",
            f"{row.bytes:,}",
            per,
        )
    Console().print(table)
    click.echo(f"total: {report.changed:,} of {report.total:,} changed, {report.bytes:,} bytes")


COMMANDS: list[click.Command] = [delta]
