"""The import graph, read from the source: no room imports a room above it, no modules import each other in
a circle (function-local imports count: they hide a circle, they do not remove it). An exception still open
would be listed here with the work that removes it; none is, and a new one fails."""
from __future__ import annotations

from treegen.bench.imports import ROOMS, cycles, module_graph, room, upward

OPEN_UPWARD: set[tuple[str, str]] = set()
OPEN_CIRCLES: list[set[str]] = []


def test_every_room_has_a_floor():
    assert {room(m) for m in module_graph()} <= set(ROOMS)


def test_no_room_imports_a_room_above_it():
    new = [pair for pair in upward(module_graph()) if pair not in OPEN_UPWARD]
    assert not new, "imports of a higher floor (treegen/bench/imports.py ROOMS): " + ", ".join(
        f"{a} -> {b}" for a, b in new)


def test_no_new_import_circles():
    new = [c for c in cycles(module_graph()) if not any(known <= set(c) for known in OPEN_CIRCLES)]
    assert not new, "import circles: " + "; ".join(" <-> ".join(c) for c in new)


def test_bench_does_not_import_train():
    graph = module_graph()
    assert not [(a, b) for a, targets in graph.items() for b in targets
                if room(a) == "bench" and room(b) == "train"]


def package(tmp_path, sources: dict[str, str]):
    """A treegen package under tmp_path with these files (path inside the package -> source)."""
    pkg = tmp_path / "treegen"
    for name, text in {"__init__.py": "", **sources}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_graph_sees_function_local_and_relative_imports(tmp_path):
    graph = module_graph(package(tmp_path, {"engine/__init__.py": "", "api.py": "from .engine import a\n",
                                            "engine/a.py": "def f():\n    from ..api import x\n"}))
    assert graph["treegen.engine.a"] == {"treegen.api"} and graph["treegen.api"] == {"treegen.engine", "treegen.engine.a"}
    assert upward(graph) == [("treegen.engine.a", "treegen.api")]
    assert cycles(graph) == [["treegen.api", "treegen.engine.a"]]


def test_a_sibling_imported_through_its_package_is_no_edge_to_the_package(tmp_path):
    graph = module_graph(package(tmp_path, {"drafters/__init__.py": "def f():\n    from .a import x\n",
                                            "drafters/a.py": "from . import b\n",
                                            "drafters/b.py": "from . import NAME\n"}))
    assert graph["treegen.drafters.a"] == {"treegen.drafters.b"}
    assert graph["treegen.drafters.b"] == {"treegen.drafters"}   # a name the package's __init__ defines
    assert cycles(graph) == [["treegen.drafters", "treegen.drafters.a", "treegen.drafters.b"]]
