"""The prepared GPU check, run end to end in its tiny shape on this machine (fp32 on a CPU)."""
from __future__ import annotations

import json

import pytest

from treegen.bench import gpu_check


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    assert gpu_check.main(["--shape", "tiny", "--out", str(out)]) == 0
    return json.loads((out / "gpu-check.json").read_text()), (out / "gpu-check.md").read_text()


def test_verify_table_has_every_row_count(outputs):
    report, _ = outputs
    samples = report["verify_samples"]["target"]
    assert [int(n) for n in samples] == list(gpu_check.ROWS)
    assert all(len(times) >= 3 and min(times) > 0 for times in samples.values())
    assert all(ms > 0 for ms in report["verify_median_ms"]["target"].values())


def test_every_method_timed_and_projected(outputs):
    report, _ = outputs
    assert set(report["methods"]) == set(gpu_check.CPU_TAU)
    for method, result in report["methods"].items():
        assert "error" not in result, (method, result.get("error"))
        assert result["rounds"] and all(r["t_verify"] > 0 for r in result["rounds"])
        assert result["mean_ms"]["t_draft"] >= 0 and result["mean_ms"]["t_verify"] > 0
    for method in ("ddtree", "treeflash", "dartree"):  # budget 64 trees, random weights or not
        assert 1 < report["methods"][method]["mean_tree"] <= 64
    assert report["methods"]["ar"]["mean_tree"] == 0
    projection = report["projection"]
    assert set(projection) == set(gpu_check.CPU_TAU)
    assert projection["ar"]["projected_speedup"] == pytest.approx(1.0)
    assert all(p["projected_speedup"] > 0 and p["round_ms"] > 0 for p in projection.values())


def test_report_says_what_was_skipped_and_labels_the_projection(outputs):
    report, md = outputs
    assert report["versions"]["torch"] and report["shape"]["vocab"] == 512
    assert any(s["step"] == "4-bit target" for s in report["skipped"])  # no CUDA here
    assert "PROJECTED" in md and "not a GPU measurement" in md and "4-bit target" in md
    for method in gpu_check.CPU_TAU:
        assert f"| {method} | " in md
    assert md.count("\n| ") >= len(gpu_check.ROWS) + len(gpu_check.CPU_TAU) + 2


def test_big_shape_refused_without_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_out_of_budget_skips_methods_but_keeps_the_verify_table(tmp_path):
    assert gpu_check.main(["--shape", "tiny", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["methods"] == {} and report["projection"] == {}
    assert {s["step"] for s in report["skipped"]} >= {f"method {m}" for m in gpu_check.CPU_TAU}
    assert len(report["verify_median_ms"]["target"]) == len(gpu_check.ROWS)


def test_bf16_target_and_checkpoints_build_every_method(tmp_path):
    """The GPU run's dtype path: a bf16 target made in place, bf16 checkpoints, every drafter built from them."""
    import torch

    from treegen.drafters import build_drafter

    target = gpu_check.random_target(gpu_check.SHAPES["tiny"], torch.device("cpu"), torch.bfloat16)
    assert target.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
    folders = gpu_check.write_drafters(target, gpu_check.SHAPES["tiny"], tmp_path)
    assert json.loads((tmp_path / "vp" / "config.json").read_text())["dflash_config"]["variable_prefix"] is True
    for method, folder, options in gpu_check.method_runs(folders):
        assert build_drafter(method, target, folder, options) is not None
