"""The shipped demo pair: a small Qwen3 target trained on the Python stdlib, and its DFlash drafter."""
from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEMO_TARGET = ASSETS / "demo" / "target"
DEMO_DRAFTER = ASSETS / "demo" / "dflash"


def best_method(drafter: str | None) -> str:
    """With a DFlash drafter the marginal tree is the best shipped method; without one, prompt lookup."""
    return "ddtree" if drafter else "pld"
