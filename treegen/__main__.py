"""`python -m treegen` runs the CLI (the same as the `treegen` command)."""
from .cli import main

main()
