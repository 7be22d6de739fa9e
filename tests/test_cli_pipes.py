"""`treegen` as a real process: shell pipelines, a closed pipe, and a --help that does not load torch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TREEGEN = f"{sys.executable} -m treegen.cli"
THIS_CHECKOUT = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # not an installed copy


def test_closed_pipe_is_quiet(tiny_model_dir, tmp_path):
    """`cat p | treegen complete | head -c 10`: 10 bytes come out, treegen exits 0 and says nothing."""
    (tmp_path / "p.txt").write_text("def add(a, b):\n")
    script = (f"set -o pipefail; cat p.txt | {TREEGEN} complete --target {tiny_model_dir} -n 400 --method ar "
              f"2> err.txt | head -c 10 > out.txt")
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, timeout=120, check=False, env=THIS_CHECKOUT)
    assert done.returncode == 0
    assert len((tmp_path / "out.txt").read_bytes()) == 10
    # no traceback, no "Exception ignored"; and no summary either, which shows generation stopped at the
    # closed pipe rather than running to the end
    assert (tmp_path / "err.txt").read_text() == ""


def test_help_is_fast_and_imports_no_torch():
    code = ("import sys; from treegen.cli import cli; code = cli.main(['--help'], standalone_mode=False); "
            "assert code == 0; assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
            "[m for m in sys.modules if m.startswith(('torch', 'transformers'))][:3]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "complete" in done.stdout and "chat" in done.stdout
