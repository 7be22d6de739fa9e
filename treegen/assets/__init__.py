"""The shipped demo pair: a small Qwen3 target trained on the Python stdlib, and its DFlash drafter."""
from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEMO_TARGET = ASSETS / "demo" / "target"
DEMO_DRAFTER = ASSETS / "demo" / "dflash"


def demo_asset(value: str) -> Path | None:
    """`demo/NAME` names a shipped checkpoint of the demo pair (demo/dflash, demo/treeflash, ...); else None."""
    if not value.startswith("demo/"):
        return None
    name = value.removeprefix("demo/")
    return ASSETS / "demo" / name if name and "/" not in name and ".." not in name else None


def shipped(name: str, kind: str) -> str:
    """`demo` is the shipped demo target (kind "target") or DFlash drafter, `demo/NAME` another shipped
    checkpoint; anything else is returned as given (a folder or hub id)."""
    if name == "demo":
        return str(DEMO_TARGET if kind == "target" else DEMO_DRAFTER)
    return str(demo_asset(name) or name)


# the shipped checkpoint each method reads on the demo target (the rest take the DFlash drafter)
DEMO_CHECKPOINTS = {"treeflash": "treeflash", "domino": "domino", "dartree": "domino"}


def demo_drafter_for(method: str | None) -> Path | None:
    """The shipped demo-pair checkpoint `method` runs with by default, when it is installed."""
    path = ASSETS / "demo" / DEMO_CHECKPOINTS.get(method or "", "dflash")
    return path if path.exists() else None


def best_method(drafter: str | None) -> str:
    """With a DFlash drafter the marginal tree is the best shipped method; without one, prompt lookup."""
    return "ddtree" if drafter else "pld"
