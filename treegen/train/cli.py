"""`treegen train ...`: the training commands (filled in by the drafter issues)."""
from __future__ import annotations

import click


@click.group()
def train():
    """Train drafters and heads."""
