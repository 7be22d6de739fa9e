"""The prepared GPU check, run end to end in its tiny shape on this machine (fp32 on a CPU)."""
from __future__ import annotations

import json

import pytest

from treegen.bench import gpu_check

METHODS = [run[0] for run in gpu_check.method_runs(gpu_check.demo_folders())]
QUICK = ["--exact-prompts", "1", "--exact-tokens", "12"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    tau = out / "bench.json"   # a bench JSON: entries labelled by their method, and one that is a variant
    tau.write_text(json.dumps({"methods": {**{m: {"method": m, "mean_accepted_length": 1.0 + i}
                                                 for i, m in enumerate(METHODS)},
                                           "ddtree-32": {"method": "ddtree", "mean_accepted_length": 99.0}}}))
    assert gpu_check.main(["--shape", "tiny", "--out", str(out), "--tau-from", str(tau), *QUICK]) == 0
    return json.loads((out / "gpu-check.json").read_text()), (out / "gpu-check.md").read_text()


def test_verify_table_has_every_row_count(outputs):
    report, _ = outputs
    samples = report["verify_samples"]["target"]
    assert [int(n) for n in samples] == list(gpu_check.ROWS)
    assert all(len(times) >= 3 and min(times) > 0 for times in samples.values())
    assert all(ms > 0 for ms in report["verify_median_ms"]["target"].values())


def test_every_method_timed_and_projected(outputs):
    report, _ = outputs
    assert set(report["methods"]) == set(METHODS)
    for method, result in report["methods"].items():
        assert "error" not in result, (method, result.get("error"))
        assert result["rounds"] and all(r["t_verify"] > 0 for r in result["rounds"])
        assert result["mean_ms"]["t_draft"] >= 0 and result["mean_ms"]["t_verify"] > 0
    for method in ("ddtree", "treeflash", "dartree"):  # budget 64 trees, random weights or not
        assert 1 < report["methods"][method]["mean_tree"] <= 64
    assert report["methods"]["ar"]["mean_tree"] == 0
    projection = report["projection"]
    assert set(projection) == set(METHODS)
    assert projection["ar"]["projected_speedup"] == pytest.approx(1.0)
    assert projection["ddtree"]["tau"] == 1.0 + METHODS.index("ddtree")   # not the variant's
    assert all(p["projected_speedup"] > 0 and p["round_ms"] > 0 for p in projection.values())


def test_report_says_what_was_skipped_and_labels_the_projection(outputs):
    report, md = outputs
    assert report["versions"]["torch"] and report["shape"]["vocab"] == 512
    assert any(s["step"] == "4-bit target" for s in report["skipped"])  # no CUDA here
    assert "PROJECTED" in md and "not a GPU measurement" in md and "4-bit target" in md
    for method in METHODS:
        assert f"| {method} | " in md
    assert md.count("\n| ") >= len(gpu_check.ROWS) + len(METHODS) + 2


def test_big_shape_refused_without_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_out_of_budget_skips_methods_but_keeps_the_verify_table(tmp_path):
    assert gpu_check.main(["--shape", "tiny", "--out", str(tmp_path), "--budget-s", "0", *QUICK]) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["methods"] == {} and report["projection"] == {}
    assert {s["step"] for s in report["skipped"]} >= {f"method {m}" for m in METHODS} | {"exact cpu fp32"}
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


def test_every_method_checked_exact_on_the_demo_pair(outputs):
    """One PASS line a method (= ar at T=0 in the run's precision); 4-bit says why it was skipped here."""
    report, _ = outputs
    checks = {c["check"]: c for c in report["checks"]}
    for method in METHODS[1:]:
        assert checks[f"exact cpu fp32 {method}"]["status"] == "PASS", checks.get(f"exact cpu fp32 {method}")
    assert checks["exact cpu nf4"]["status"] == "SKIP"
    assert checks["verify target by rows"]["status"] == "TIME"


def test_bf16_exactness_lines(capsys):
    """The GPU's default precision through the same check, one stdout line a method (here on the CPU)."""
    report = {"checks": [], "skipped": []}
    gpu_check.exact_checks(report, "cpu", "bf16", gpu_check.Clock(600), prompts=1, tokens=12)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(METHODS) - 1 and all(line.startswith("PASS exact cpu bf16 ") for line in lines)


def test_no_tau_no_projection(tmp_path):
    assert gpu_check.read_tau(None) == {}
    (tmp_path / "b.json").write_text(json.dumps({"methods": {"ar": {"method": "ar", "mean_accepted_length": None}}}))
    assert gpu_check.read_tau(tmp_path / "b.json") == {}


def test_the_4bit_branch_imports():
    """The CUDA-only 4-bit step cannot run here, but what it loads with must import and configure."""
    import torch

    from treegen.loading import _quantization

    if not gpu_check.importable("bitsandbytes"):
        pytest.skip("bitsandbytes is not installed")
    config = _quantization(False, True, torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
