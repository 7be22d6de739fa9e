"""`treegen bench`: every method side by side in one run (see the bench issue)."""
from __future__ import annotations

import click


@click.command()
def bench():
    """Benchmark methods side by side (not built yet)."""
    raise click.ClickException("treegen bench is not built yet")
