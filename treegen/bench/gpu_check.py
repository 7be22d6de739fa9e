"""A prepared one-shot GPU check (no downloads), one line per check on stdout (PASS / FAIL / SKIP / TIME):
every method's output = ar's at T=0 on the shipped demo pair, on the device in fp32 and bf16 (and with a 4-bit
target); then, on a Qwen3-8B-shaped target with random drafters of every kind in their published layouts, the
verify-forward time by tree rows after a 512-token prefill, and every method's per-round draft / build / verify
time (the 4-bit target's verify times too).

    python -m treegen.bench.gpu_check --out DIR [--shape qwen3-8b|tiny] [--budget-s 480] [--tau-from JSON]

writes DIR/gpu-check.json (every check and raw timing) and DIR/gpu-check.md (tables; with --tau-from, a bench
JSON such as docs/benchmarks/*.json, a PROJECTED speedup per method from its acceptance: random weights accept
nothing). Steps that would pass the budget are skipped. Exits 1 when an exactness check fails.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import namedtuple
from pathlib import Path

import torch

ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
PROMPT_TOKENS, NEW_TOKENS, WARMUP_TOKENS, BLOCK = 512, 32, 4, 16
EXACT_PROMPTS, EXACT_TOKENS = 4, 48   # demo-pair prompts (thirdparty-code) and new tokens per exactness check
METHOD_RESERVE_S, QUANT_RESERVE_S = 20.0, 180.0   # rough seconds a method / the 4-bit step needs on an H200
EXACT_RESERVE_S = 30.0                             # and one precision's exactness checks on the demo pair


# the target's Qwen3 sizes, the drafter's layers and mask token, and Domino's head (the published 8B: 256 / 1024)
Shape = namedtuple("Shape", "layers hidden intermediate heads kv_heads head_dim vocab draft_layers mask_token_id "
                            "emb_dim gru_hidden_dim")
SHAPES = {"qwen3-8b": Shape(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                            vocab=151936, draft_layers=5, mask_token_id=151669, emb_dim=256, gru_hidden_dim=1024),
          "tiny": Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512,
                        draft_layers=2, mask_token_id=511, emb_dim=32, gru_hidden_dim=64)}


class Clock:
    """Seconds since the start against the budget; later steps are skipped rather than run over."""

    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()


def random_target(shape: Shape, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         max_position_embeddings=40960, attn_implementation="sdpa")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # initialised in place on the device, in its dtype: no CPU copy
            return Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def write_drafters(target, shape: Shape, root: Path) -> dict[str, str]:
    """Random DFlash, TreeFlash, Domino and VP-drafter checkpoints in the published layouts -> their folders."""
    from ..drafters.untrained import untrained_dflash
    from ..models.checkpoint import save_dflash
    from ..models.domino import DominoHead, HeadConfig, save_domino
    from ..models.treeflash import from_dflash, save_treeflash
    from ..models.vp_drafter import save_vp_drafter

    dtype, folders = target.dtype, {k: root / k for k in ("dflash", "treeflash", "domino", "vp")}
    with torch.device(target.device):  # fp32 on the device, cast on save: random init stays quick
        backbone = untrained_dflash(target, shape.mask_token_id, shape.draft_layers, BLOCK, seed=0)
        save_dflash(backbone, folders["dflash"], dtype)
        treeflash = from_dflash(backbone)
        treeflash.ar_approximation.d.weight.data.normal_(0, 0.02)  # a zero head would make it plain ddtree
        save_treeflash(treeflash, folders["treeflash"], dtype)
        del treeflash
        head = HeadConfig(shape.emb_dim, shape.gru_hidden_dim, shift_label=True, pure_draft_prefix_len=1)
        save_domino(backbone, DominoHead(shape.hidden, shape.vocab, head), folders["domino"], dtype)
        del backbone
        save_vp_drafter(untrained_dflash(target, shape.mask_token_id, shape.draft_layers, BLOCK, seed=1), folders["vp"], dtype)
    torch.cuda.empty_cache()  # the fp32 drafters built here go back to the pool (a no-op without CUDA)
    return {k: str(v) for k, v in folders.items()}


def verify_samples(model, repeats: int) -> dict[str, list[float]]:
    """Seconds of one verify forward per row count: one sample per VerifyCost.measure call (each prefills
    PROMPT_TOKENS, warms every shape up, and synchronises the device before reading the clock)."""
    from ..engine.budget import VerifyCost

    runs = [VerifyCost.measure(model, ROWS, context=PROMPT_TOKENS, repeats=1).seconds for _ in range(repeats)]
    return {str(n): [run[i] for run in runs] for i, n in enumerate(ROWS)}


def record_verify(report: dict, name: str, model, repeats: int) -> None:
    samples = report["verify_samples"][name] = verify_samples(model, repeats)
    medians = report["verify_median_ms"][name] = {rows: 1e3 * statistics.median(t) for rows, t in samples.items()}
    check_line(report, "TIME", f"verify {name} by rows", ", ".join(f"{n}: {ms:.2f}" for n, ms in medians.items())
               + f" ms (median of {repeats})")


def demo_folders() -> dict[str, str]:
    """The shipped demo pair's drafters, in the folders method_runs reads."""
    from ..assets import ASSETS

    demo = ASSETS / "demo"
    return {k: str(demo / v) for k, v in
            {"dflash": "dflash", "treeflash": "treeflash", "domino": "domino", "vp": "vp-drafter"}.items()}


def exact_checks(report: dict, device: str, precision: str, clock: Clock, prompts: int = EXACT_PROMPTS,
                 tokens: int = EXACT_TOKENS) -> None:
    """Every method's T=0 output = ar's on the demo pair, its target loaded as a user's (treegen.loading) on
    `device` in `precision`: fp32, bf16, or nf4 (4-bit bitsandbytes, bf16 compute; CUDA only)."""
    label = f"exact {device} {precision}"
    if clock.left() < EXACT_RESERVE_S:
        return skip(report, label, f"{clock.left():.0f} s of the budget left")
    if precision == "nf4" and (device != "cuda" or not importable("bitsandbytes")):
        return skip(report, label, "4-bit needs a CUDA device and bitsandbytes")
    from ..assets import DEMO_TARGET
    from ..loading import load_target
    from .prompts import load_prompts

    nf4 = precision == "nf4"
    model, tokenizer = load_target(str(DEMO_TARGET), dtype="bf16" if nf4 else precision, device=device,
                                   load_in_4bit=nf4)
    ids = [torch.tensor(tokenizer(p.text)["input_ids"]) for p in load_prompts("thirdparty-code", prompts)]
    ref = greedy_outputs(model, ("ar", None, {}), ids, tokens)
    for run in method_runs(demo_folders())[1:]:
        try:
            same = sum(a == b for a, b in zip(greedy_outputs(model, run, ids, tokens), ref))
            check_line(report, "PASS" if same == len(ref) else "FAIL", f"{label} {run[0]}",
                       f"{same}/{len(ref)} prompts = ar at T=0, {tokens} new tokens")
        except Exception as err:  # noqa: BLE001 (one broken method must not cost the other checks)
            check_line(report, "FAIL", f"{label} {run[0]}", one_line(err))
    del model
    torch.cuda.empty_cache()   # a no-op without CUDA


def greedy_outputs(model, run: tuple[str, str | None, dict], prompts: list[torch.Tensor], tokens: int) -> list:
    from ..drafters import build_drafter
    from ..engine.generate import GenerationConfig, generate

    method, folder, options = run
    drafter = build_drafter(method, model, folder, options)
    return [[t for r in generate(model, drafter, p, GenerationConfig(tokens)) for t in r.tokens] for p in prompts]


def importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def method_runs(folders: dict[str, str]) -> list[tuple[str, str | None, dict]]:
    """(method, drafter folder, options) for every method; budgets at the published 64 nodes."""
    return [("ar", None, {}), ("pld", None, {}), ("dflash", folders["dflash"], {}),
            ("ddtree", folders["dflash"], {"budget": 64}), ("treeflash", folders["treeflash"], {"budget": 64}),
            ("domino", folders["domino"], {}), ("dartree", folders["domino"], {"budget": 64}),
            ("d2sd", folders["dflash"], {"vp_drafter": folders["vp"]})]


def time_method(target, method: str, folder: str | None, options: dict, prompt: torch.Tensor) -> dict:
    """Per-round timings of one T=0 generation of NEW_TOKENS (after a short warm-up generation)."""
    from ..drafters import build_drafter
    from ..engine.generate import GenerationConfig, generate

    t0 = time.perf_counter()
    with torch.device(target.device):  # a drafter's modules are built where they run: no CPU round trip
        drafter = build_drafter(method, target, folder, options)
    load_s = time.perf_counter() - t0
    for _ in generate(target, drafter, prompt, GenerationConfig(max_new_tokens=WARMUP_TOKENS)):
        pass
    rounds = [r for r in generate(target, drafter, prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
              if r.index > 0]  # round 0 is the prefill
    fields = ("drafted", "accepted", "t_draft", "t_build", "t_verify", "t_commit")
    raw = [{k: getattr(r, k) for k in fields} for r in rounds]
    mean = {k: statistics.fmean(r[k] for r in raw) for k in fields}
    return {"options": options, "load_s": load_s, "rounds": raw, "mean_tree": mean["drafted"],
            "mean_ms": {k: 1e3 * mean[k] for k in fields if k.startswith("t_")}}


def time_methods(target, folders: dict[str, str], vocab: int, clock: Clock, report: dict) -> None:
    prompt = torch.randint(vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1))
    for method, folder, options in method_runs(folders):
        if clock.left() < METHOD_RESERVE_S:
            skip(report, f"method {method}", f"{clock.left():.0f} s of the budget left")
            continue
        try:
            report["methods"][method] = time_method(target, method, folder, options, prompt)
        except Exception as err:  # noqa: BLE001 (a one-shot run: one broken method must not cost the rest)
            report["methods"][method] = {"error": one_line(err)}
        torch.cuda.empty_cache()  # the next method's drafter gets the memory back
        result = report["methods"][method]
        check_line(report, "FAIL" if "error" in result else "TIME", f"method {method}", summary(result))
        write_outputs(report)


def projection(report: dict) -> dict[str, dict]:
    """tau * t_ar_round / (t_draft + t_build + t_verify(tree + 1 rows)), t_verify read off the target's table."""
    from ..engine.budget import VerifyCost

    table = report["verify_median_ms"].get("target")
    timed = {m: r for m, r in report["methods"].items() if "mean_ms" in r}
    if not table or "ar" not in timed:
        return {}
    cost_ms = VerifyCost(tuple(int(n) for n in table), tuple(table.values()))

    def round_ms(r: dict) -> tuple[float, float]:
        verify = float(cost_ms(torch.tensor([r["mean_tree"] + 1.0]))[0])
        return r["mean_ms"]["t_draft"] + r["mean_ms"]["t_build"] + verify, verify

    ar_ms, tau = round_ms(timed["ar"])[0], report["tau"]
    out = {}
    for method, r in timed.items():
        total, verify = round_ms(r)
        out[method] = {"round_ms": total, "verify_ms_from_table": verify}
        if method in tau:
            out[method].update(tau=tau[method], projected_speedup=tau[method] * ar_ms / total)
    return out


def read_tau(path: Path | None) -> dict[str, float]:
    """Acceptance length per method (tokens per target forward) from a bench JSON: each entry whose label is
    its method's name (`ar`, `ddtree`, ... not `ddtree-32`)."""
    if path is None:
        return {}
    methods = json.loads(Path(path).read_text())["methods"]
    return {label: float(m["mean_accepted_length"]) for label, m in methods.items()
            if isinstance(m, dict) and m.get("method") == label and isinstance(m.get("mean_accepted_length"), float)}


def quantized_verify(target, root: Path, clock: Clock, report: dict, repeats: int) -> None:
    """The 4-bit (bnb nf4) target's verify table, loaded through treegen.loading like a user's target."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        return skip(report, "4-bit target", f"bitsandbytes does not import ({err})")
    if target.device.type != "cuda":
        return skip(report, "4-bit target", "no CUDA device")
    if clock.left() < QUANT_RESERVE_S:
        return skip(report, "4-bit target", f"{clock.left():.0f} s of the budget left, ~{QUANT_RESERVE_S:.0f} needed")
    from ..loading import load_target

    t0 = time.perf_counter()
    folder = root / "target"
    try:
        target.save_pretrained(folder)
        write_stub_tokenizer(folder)
        quantized, _ = load_target(str(folder), dtype="bf16", device="cuda", load_in_4bit=True)
    except Exception as err:  # noqa: BLE001 (the bf16 results are written; say why 4-bit is missing)
        return skip(report, "4-bit target", f"save or 4-bit load failed: {one_line(err)}")
    report["seconds_4bit_save_load"] = time.perf_counter() - t0
    record_verify(report, "target-nf4", quantized, repeats)


def write_stub_tokenizer(folder: Path) -> None:
    """load_target loads a tokenizer beside the model; a two-word one is enough (timings never decode)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"<unk>": 0, "x": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(folder)


def skip(report: dict, step: str, reason: str) -> None:
    report["skipped"].append({"step": step, "reason": reason})
    check_line(report, "SKIP", step, reason)


def check_line(report: dict, status: str, name: str, detail: str) -> None:
    """One line a check on stdout (PASS, FAIL, SKIP or TIME), kept in the report too."""
    report["checks"].append({"status": status, "check": name, "detail": detail})
    print(f"{status} {name}: {detail}", flush=True)


def summary(result: dict) -> str:
    if "error" in result:
        return result["error"]
    return f"tree {result['mean_tree']:.1f}, " + ", ".join(f"{k[2:]} {v:.2f} ms" for k, v in result["mean_ms"].items())


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def log(line: str) -> None:
    print(f"gpu-check: {line}", file=sys.stderr, flush=True)


def new_report(args, shape: Shape, device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    return {"out": str(args.out), "shape_name": args.shape, "shape": shape._asdict(), "dtype": str(dtype),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version(), "cuda": torch.version.cuda},
            "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "block_size": BLOCK, "rows": list(ROWS),
            "budget_s": args.budget_s, "verify_samples": {}, "verify_median_ms": {}, "methods": {},
            "projection": {}, "tau": read_tau(args.tau_from), "tau_source": str(args.tau_from or ""), "checks": [],
            "skipped": [], "elapsed_s": {}}


def write_outputs(report: dict) -> None:
    """Both files after every step, so a run stopped from outside still leaves what it measured."""
    out = Path(report["out"])
    report["projection"] = projection(report)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu-check.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    v, shape = report["versions"], report["shape"]
    about = (f"torch {v['torch']}, transformers {v['transformers']}, CUDA {v['cuda']}; target {shape['layers']} "
             f"layers, hidden {shape['hidden']}, vocab {shape['vocab']}; drafters {shape['draft_layers']} layers, "
             f"block {report['block_size']}; prompt {report['prompt_tokens']} tokens.")
    skipped = [f"- {s['step']}: {s['reason']}" for s in report["skipped"]] or ["- none"]
    lines = [f"# GPU check: {report['device']}, {report['shape_name']} random weights, {report['dtype']}", "", about,
             "", *verify_table(report), "", *methods_table(report), "", "## Skipped", "", *skipped]
    return "\n".join(lines) + "\n"


def verify_table(report: dict) -> list[str]:
    tables = report["verify_median_ms"]
    lines = ["## Verify forward (median ms) by rows (anchor + tree nodes)", "",
             "| rows | " + " | ".join(tables) + " |", "|---" * (len(tables) + 1) + "|"]
    return lines + [f"| {n} | " + " | ".join(f"{t[str(n)]:.2f}" for t in tables.values()) + " |"
                    for n in report["rows"]]


def methods_table(report: dict) -> list[str]:
    header = ("| method | tree | draft | build | verify | commit | verify(tree+1) from table | tau (--tau-from) "
              "| PROJECTED speedup |")
    lines = [f"## Methods: mean ms per round ({report['new_tokens']} new tokens, T=0)", "", header, "|---" * 9 + "|"]
    for method, r in report["methods"].items():
        if "error" in r:
            lines.append(f"| {method} | error: {r['error']} |" + " |" * 7)
            continue
        ms, p = r["mean_ms"], report["projection"].get(method, {})
        lines.append(f"| {method} | {r['mean_tree']:.1f} | {ms['t_draft']:.2f} | {ms['t_build']:.2f} | "
                     f"{ms['t_verify']:.2f} | {ms['t_commit']:.2f} | {p.get('verify_ms_from_table', 0):.2f} | "
                     f"{p.get('tau', 0):.2f} | {p.get('projected_speedup', 0):.2f} |")
    source = report["tau_source"] or "none given (--tau-from JSON), so no projection"
    note = (f"PROJECTED speedup = tau x t_ar_round / (draft + build + verify(tree + 1)); tau: {source}, measured "
            "elsewhere: a projection, not a GPU measurement. "
            "Random weights accept (almost) nothing, so only the timings are measurements of this device.")
    return [*lines, "", note]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m treegen.bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu-check.json and gpu-check.md")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget; later steps are skipped")
    parser.add_argument("--tau-from", type=Path, help="a bench JSON whose acceptance lengths project speedups")
    parser.add_argument("--exact-prompts", type=int, default=EXACT_PROMPTS, help="demo prompts per exactness check")
    parser.add_argument("--exact-tokens", type=int, default=EXACT_TOKENS, help="new tokens per exactness check")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    clock, shape = Clock(args.budget_s), SHAPES[args.shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.shape != "tiny" and device.type != "cuda":
        print(f"gpu-check: the {args.shape} shape needs a CUDA device; use --shape tiny here", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 matmuls crawl on a CPU
    args.out.mkdir(parents=True, exist_ok=True)
    report = new_report(args, shape, device, dtype)
    repeats = 5 if device.type == "cuda" else 3
    for precision in ("fp32", "bf16", "nf4") if device.type == "cuda" else ("fp32", "nf4"):
        exact_checks(report, device.type, precision, clock, args.exact_prompts, args.exact_tokens)
    report["elapsed_s"]["exactness"] = clock.elapsed()
    root = Path(tempfile.mkdtemp(prefix="treegen-gpu-check-"))
    try:
        target = random_target(shape, device, dtype)
        folders = write_drafters(target, shape, root)
        report["elapsed_s"]["target+drafters"] = clock.elapsed()
        record_verify(report, "target", target, repeats)
        report["elapsed_s"]["verify table"] = clock.elapsed()
        write_outputs(report)
        time_methods(target, folders, shape.vocab, clock, report)
        report["elapsed_s"]["methods"] = clock.elapsed()
        quantized_verify(target, root, clock, report, repeats)
        report["elapsed_s"]["end"] = clock.elapsed()
        write_outputs(report)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # checkpoints of gigabytes never stay behind in /tmp
    log(f"done in {clock.elapsed():.0f} s: {args.out / 'gpu-check.md'}")
    return 1 if any(c["status"] == "FAIL" and c["check"].startswith("exact") for c in report["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
