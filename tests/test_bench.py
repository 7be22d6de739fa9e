"""`treegen bench` end to end on the tiny target with a tiny random DFlash drafter in the published layout."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from treegen.cli import cli

PROMPTS = [
    {"id": "add", "category": "code", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"},
    {"id": "loop", "category": "code", "prompt": "for i in range(10):\n    if i % 2 == 0:\n"},
    {"id": "point", "category": "class", "prompt": "class Point:\n    def __init__(self, x, y):\n"},
]
SUMMARY_KEYS = {"mean_accepted_length", "acceptance_per_position", "mean_tree_size", "tokens_per_second",
                "speedup_vs_ar", "identical_to_ar", "time_split_s"}
LABELS = ["ar", "pld", "dflash", "ddtree", "hf-generate", "hf-pld"]


def invoke(*args):
    return CliRunner().invoke(cli, ["bench", *map(str, args)])


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig

    from treegen.models.checkpoint import save_dflash
    from treegen.models.dflash import DFlashConfig, DFlashDrafter

    t = AutoConfig.from_pretrained(tiny_model_dir)
    cfg = DFlashConfig(hidden_size=t.hidden_size, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=t.hidden_size // 4, num_target_layers=t.num_hidden_layers,
                       target_layer_ids=(0, 1), mask_token_id=t.vocab_size - 1, vocab_size=t.vocab_size,
                       block_size=6)
    torch.manual_seed(3)
    model = DFlashDrafter(cfg)
    for p in model.parameters():  # random norms as well: a drafter that proposes varied, mostly wrong trees
        p.data.normal_(0, 0.3 if p.dim() == 2 else 1.0)
    out = tmp_path_factory.mktemp("dflash")
    save_dflash(model, out)
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def greedy_run(tiny_model_dir, drafter_dir, prompts_file, tmp_path_factory):
    """One bench at T=0 of every method and the peers: (result, JSON record, plot path)."""
    out = tmp_path_factory.mktemp("bench")
    result = invoke("--methods", "ar,pld,dflash,ddtree", "--prompts", prompts_file, "-n", 10, "--repeats", 2,
                    "--target", tiny_model_dir, "--drafter", drafter_dir, "--json", out / "b.json",
                    "--plot", out / "b.png")
    return result, json.loads((out / "b.json").read_text()), out / "b.png"


def test_json_schema_per_method_and_category(greedy_run):
    result, record, _ = greedy_run
    assert result.exit_code == 0, result.output
    assert list(record["methods"]) == LABELS
    for key in ("command", "date", "machine", "target", "drafter", "n", "temperature", "repeats", "prompts_source"):
        assert key in record, key
    assert {"platform", "torch", "device", "threads", "cpu", "cpu_capability"} <= set(record["machine"])
    assert record["command"].startswith("treegen bench --methods ar,pld,dflash,ddtree --prompts ")
    assert record["n"] == 10 and record["repeats"] == 2 and record["categories"] == ["code", "class"]
    for label, m in record["methods"].items():
        assert SUMMARY_KEYS <= set(m) and set(m["categories"]) == {"code", "class"}, label
        for summary in m["categories"].values():
            assert SUMMARY_KEYS <= set(summary)
        assert set(m["speedup_vs_ar"]) == {"median", "min", "max"}
    assert len(record["runs"]) == 2 * len(PROMPTS) * len(LABELS)


def test_acceptance_numbers_are_there_for_methods_and_blank_for_peers(greedy_run):
    _, record, _ = greedy_run
    m = record["methods"]
    assert m["ar"]["mean_accepted_length"] == 1.0 and m["ar"]["mean_tree_size"] == 0.0
    assert m["ddtree"]["mean_tree_size"] > m["dflash"]["mean_tree_size"] > 0
    assert {"draft", "build", "verify", "other"} <= set(m["ddtree"]["time_split_s"])
    assert m["ddtree"]["time_split_s"]["build"] > 0   # best-first, dedup and the mask are timed apart
    for peer in ("hf-generate", "hf-pld"):
        assert m[peer]["mean_accepted_length"] is None and m[peer]["time_split_s"] is None
        assert m[peer]["tokens_per_second"] > 0


def test_speedup_of_ar_is_exactly_one(greedy_run):
    _, record, _ = greedy_run
    ar = record["methods"]["ar"]
    assert ar["speedup_vs_ar"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert all(c["speedup_vs_ar"] == {"median": 1.0, "min": 1.0, "max": 1.0} for c in ar["categories"].values())


def test_every_output_equals_ar_at_temperature_zero(greedy_run):
    _, record, _ = greedy_run
    for label, m in record["methods"].items():
        assert m["identical_to_ar"] is True and m["mismatches"] == [], label
        assert all(c["identical_to_ar"] is True for c in m["categories"].values()), label


def test_table_and_plot(greedy_run):
    result, _, plot = greedy_run
    for label in LABELS:
        assert label in result.stdout
    assert "accept len" in result.stdout and "speedup vs ar" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_presets_compare_two_settings_sharing_one_target_load(tiny_model_dir, drafter_dir, prompts_file,
                                                              tmp_path, monkeypatch):
    import treegen.api

    loads = []
    real = treegen.api.load_target
    monkeypatch.setattr(treegen.api, "load_target", lambda *a, **k: loads.append(a) or real(*a, **k))
    for budget in (4, 12):
        (tmp_path / f"tree{budget}.yaml").write_text(f"method: ddtree\nmethod_options: {{budget: {budget}}}\n")
    out = tmp_path / "b.json"
    result = invoke("--methods", f"{tmp_path / 'tree4.yaml'},{tmp_path / 'tree12.yaml'}", "--prompts", prompts_file,
                    "--limit", 1, "-n", 6, "--repeats", 1, "--temperature", 0.8, "--no-peers",
                    "--target", tiny_model_dir, "--drafter", drafter_dir, "--json", out)
    assert result.exit_code == 0, result.output
    methods = json.loads(out.read_text())["methods"]
    assert list(methods) == ["ar", "tree4", "tree12"] and len(loads) == 1
    assert [methods[k]["method_options"]["budget"] for k in ("tree4", "tree12")] == [4, 12]
    assert all(m["identical_to_ar"] is None for m in methods.values())   # sampling: identity not expected


def test_a_mismatch_is_red_and_fails_unless_allowed(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """A treegen method whose T=0 output differs from ar's fails the bench; a transformers peer's is a note
    (its kernels may break a near-tie otherwise)."""
    from treegen.bench.peers import HFPeer
    from treegen.bench.runner import Output, TreegenContestant

    def first_token_changed(run):
        def changed(self, *args):
            out = run(self, *args)
            if getattr(self, "label", "") == "ar":
                return out
            return Output([out.tokens[0] + 1] + out.tokens[1:], out.stats)
        return changed

    monkeypatch.setattr(HFPeer, "run", first_token_changed(HFPeer.run))
    args = ("--methods", "ar", "--prompts", prompts_file, "--limit", 1, "-n", 4, "--repeats", 1,
            "--target", tiny_model_dir, "--json", tmp_path / "b.json")
    result = invoke(*args)
    assert result.exit_code == 0 and "NO (1 prompt)" in result.stdout and "round differently" in result.stdout
    assert json.loads((tmp_path / "b.json").read_text())["methods"]["hf-pld"]["identical_to_ar"] is False
    monkeypatch.setattr(TreegenContestant, "run", first_token_changed(TreegenContestant.run))
    result = invoke("--methods", "ar,pld", *args[2:])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1].startswith("treegen: error: at T=0 the output of pld")
    assert invoke("--methods", "ar,pld", *args[2:], "--allow-mismatch").exit_code == 0


def test_hf_assisted_peer_with_a_draft_model(tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "b.json"
    result = invoke("--methods", "ar", "--prompts", prompts_file, "--limit", 1, "-n", 6, "--repeats", 1,
                    "--target", tiny_model_dir, "--hf-assistant", tiny_model_dir, "--json", out)
    assert result.exit_code == 0, result.output
    assisted = json.loads(out.read_text())["methods"]["hf-assisted"]
    assert assisted["identical_to_ar"] is True and assisted["kind"] == "peer"
    assert assisted["generate_kwargs"]["assistant_model"] == str(tiny_model_dir)


def test_an_assistant_without_peers_is_a_usage_error(tiny_model_dir):
    result = invoke("--no-peers", "--hf-assistant", tiny_model_dir, "--target", tiny_model_dir)
    assert result.exit_code == 2 and "--hf-assistant is a peer" in result.stderr


def test_an_unwritable_json_path_is_a_usage_error_before_loading(tiny_model_dir):
    result = invoke("--json", "/no/such/dir/b.json", "--target", tiny_model_dir)
    assert result.exit_code == 2 and "the folder /no/such/dir does not exist" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (("--prompts", "missing.jsonl"), "--prompts missing.jsonl: no such file, nor a built-in set"),
    (("--methods", "ar,warp"), "unknown method or preset 'warp'"),
    (("--prompts", "BAD"), "bad.jsonl:2: not valid JSON"),
    (("--methods", "ar,dflash"), "needs a drafter"),
])
def test_bad_input_is_one_usage_line(tiny_model_dir, tmp_path, args, message):
    # found before anything loads, so a usage error (exit 2), as everywhere in treegen
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    args = tuple(str(bad) if a == "BAD" else a for a in args)
    result = invoke(*args, "--target", tiny_model_dir)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treegen: error: ") and message in lines[0], lines


def test_runs_carry_token_digests_equal_to_ars_and_the_title_names_the_model(greedy_run):
    result, record, _ = greedy_run
    digests = {(r["label"], r["prompt"], r["repeat"]): r["tokens_sha256"] for r in record["runs"]}
    for (label, prompt, repeat), digest in digests.items():
        assert digest == digests["ar", prompt, 0], (label, prompt, repeat)
    assert "ForCausalLM" in record["model"] and record["model"] in result.stdout
    assert record["interrupted"] is False and record["load"]["runs"] == len(record["runs"])


def test_ctrl_c_keeps_the_table_and_json_of_the_prompts_that_finished(tiny_model_dir, prompts_file, tmp_path,
                                                                    monkeypatch):
    from treegen.bench.peers import HFPeer

    real, calls = HFPeer.run, []

    def interrupted_on_the_third_prompt(self, ids, *args):
        calls.append(ids)
        if self.label == "hf-pld" and len(calls) > 6:    # warm-up (2 peers) + 2 prompts x 2 peers, then Ctrl-C
            raise KeyboardInterrupt
        return real(self, ids, *args)

    monkeypatch.setattr(HFPeer, "run", interrupted_on_the_third_prompt)
    out = tmp_path / "b.json"
    result = invoke("--methods", "ar", "--prompts", prompts_file, "-n", 4, "--repeats", 1,
                    "--target", tiny_model_dir, "--json", out)
    assert result.exit_code == 130, result.output
    record = json.loads(out.read_text())
    assert record["interrupted"] is True and {r["prompt"] for r in record["runs"]} == {"add", "loop"}
    assert "2 of 3 prompts" in result.stdout and "interrupted" in result.stdout
    assert "speedup vs ar (range)" not in result.stdout    # one repeat: one value, no range
