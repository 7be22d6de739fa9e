"""treegen.bench.llamacpp without building or downloading anything: llama-bench's output parsed (JSON and its
markdown table, from captured samples), treegen's side read from a bench JSON, the record written and
summarised, and the record's table on the docs page."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from treegen.bench import docs as D
from treegen.bench import llamacpp as L
from treegen.bench import pages as P

# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 0 -n 64 -o json`, its stdout (numbers shortened)
JSON_SAMPLE = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC [two cores]",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/x/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama ?B Q4_1",
    "model_size": 92537856,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 99,
    "n_prompt": 0,
    "n_gen": 64,
    "n_depth": 0,
    "test_time": "2026-12-03T18:40:00Z",
    "avg_ns": 276000000,
    "stddev_ns": 4000000,
    "avg_ts": 231.875,
    "stddev_ts": 3.25,
    "samples_ns": [ 272000000, 280000000 ],
    "samples_ts": [ 235.29, 228.57 ]
  }
]
"""

MARKDOWN_SAMPLE = """| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| llama ?B Q4_1                  |  88.25 MiB |   134.52 M | CPU        |       2 |            tg64 |        231.88 ± 3.25 |

build: 0c1e570 (1)
"""


def test_llama_bench_json_is_parsed():
    got = L.parse_llama_bench(JSON_SAMPLE)
    assert got["tokens_per_second"] == pytest.approx(231.875) and got["stddev"] == pytest.approx(3.25)
    assert got["samples"] == [235.29, 228.57] and got["commit"] == "0c1e570" and got["threads"] == 2
    assert got["n_gen"] == 64 and got["model_type"] == "llama ?B Q4_1"


def test_llama_bench_markdown_is_parsed_too():
    got = L.parse_llama_bench(MARKDOWN_SAMPLE)
    assert got["tokens_per_second"] == pytest.approx(231.88) and got["stddev"] == pytest.approx(3.25)
    assert got["commit"] == "0c1e570" and got["build_number"] == 1 and got["threads"] == 2 and got["n_gen"] == 64


def test_output_without_a_decode_row_is_an_error():
    with pytest.raises(L.Failed, match="no decode"):
        L.parse_llama_bench("| model | test | t/s |\n| x | pp512 | 900.00 ± 1.00 |\n")


def bench_json() -> dict:
    ar = {"kind": "treegen", "method": "ar", "tokens_per_second": 20.0, "new_tokens": 256, "runs": 4,
          "wall_time_s": 12.8, "time_split_s": {"prefill": 1.0, "verify": 11.8}, "identical_to_ar": True}
    return {"treegen_version": "0.1.0", "prompts_source": "chat", "prompt_count": 4, "n": 64,
            "machine": {"torch": "2.x"}, "methods": {"ar": ar}}


def test_treegen_side_counts_decode_apart_from_prefill():
    got = L.treegen_numbers(bench_json())
    assert got["tokens_per_second"] == 20.0
    assert got["decode_tokens_per_second"] == pytest.approx((256 - 4) / (12.8 - 1.0))
    assert got["label"] == "ar" and got["prompts"] == 4


def make_record(tmp_path: Path, **kw) -> dict:
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    args = {"gguf": gguf, "threads": 2, "tokens": 64, "llama": L.parse_llama_bench(JSON_SAMPLE),
            "llama_cmd": ["/c/llama-bench", "-m", str(gguf), "-t", "2", "-p", "0", "-n", "64", "-o", "json"],
            "llama_alone": True, "tree": L.treegen_numbers(bench_json()),
            "tree_cmd": ["treegen", "bench", "--target", "smollm2", "--methods", "ar", "--json", "TMP.json"],
            "tree_alone": True, "dtype": "bfloat16", "version": "0.3.36",
            "command": "python -m treegen.bench.llamacpp --threads 2", "cpu": "AMD EPYC +avx512f",
            "date": "2026-12-03T18:40:00+00:00"}
    return L.record(**{**args, **kw})


def test_the_record_is_written_and_summarised(tmp_path):
    rec = make_record(tmp_path)
    out = tmp_path / "docs" / "llamacpp-smollm2.json"
    L.write(rec, out)
    back = json.loads(out.read_text())
    assert back == rec and "methods" not in back        # not a treegen bench JSON: its own table in the docs
    assert back["llamacpp"]["commit"] == "0c1e570" and back["treegen"]["dtype"] == "bfloat16"
    assert back["threads"] == 2 and back["machine"]["cpu"] == "AMD EPYC +avx512f"
    assert back["llamacpp"]["command"].startswith("/c/llama-bench -m ") and "-GGML_AMX=OFF" not in back
    assert "-DGGML_AMX=OFF" in back["llamacpp"]["cmake_flags"]
    decode = (256 - 4) / (12.8 - 1.0)
    assert back["llamacpp_over_treegen"] == pytest.approx(231.875 / decode)
    assert L.summary(back) == (f"llama.cpp 232 tok/s, treegen ar {decode:.1f} tok/s in bfloat16 "
                               f"({231.875 / decode:.1f}x behind) on 2 threads")
    assert L.summary(make_record(tmp_path, tree_alone=False)).endswith("(NOT measured alone)")


def test_the_record_shows_on_the_benchmarks_page(tmp_path):
    folder = tmp_path / "docs" / "benchmarks"
    L.write(make_record(tmp_path), folder / "llamacpp-smollm2.json")
    (folder / "stray-llamacpp.json").write_text(json.dumps({"llamacpp": {}}))
    (folder / P.MANIFEST).write_text("side_by_side: [llamacpp-*.json]\n")
    data = D.Data(tmp_path)
    assert [s.name for s in data.side] == ["llamacpp-smollm2.json"]
    table = "\n".join(D.pair_side(data, "smollm2", ""))
    assert "### llama.cpp side by side" in table and "0c1e570" in table and "bfloat16" in table
    assert "python -m treegen.bench.llamacpp --threads 2" in table
    assert data.unused() == ["llamacpp-smollm2.json", "stray-llamacpp.json"]   # no SmolLM2 table to follow
    (folder / "smollm2-chat-t0.json").write_text(json.dumps(
        {"date": "2026-12-03", "target": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "prompts_source": "chat",
         "temperature": 0.0, "methods": {"ar": {"method": "ar", "preset": None, "tokens_per_second": 20.0,
                                                "speedup_vs_ar": {"median": 1.0}}}}))
    data = D.Data(tmp_path)
    assert data.unused() == ["stray-llamacpp.json"]      # a record no page shows is reported
    page = D.current_tables(data, None, "")
    assert page.index("## The SmolLM2 pair") < page.index("### chat, T=0") < page.index("### llama.cpp side by side")


def test_the_newest_days_records_show_together(tmp_path):
    """One run per weight form (`--dtype int8 --out ...`): every record of the newest day shows after the pair's
    tables, each naming treegen's weight form; an older day's record is superseded."""
    folder = tmp_path / "docs" / "benchmarks"
    L.write(make_record(tmp_path), folder / "llamacpp-smollm2.json")
    L.write(make_record(tmp_path, dtype="int8", date="2026-12-03T19:00:00+00:00"), folder / "llamacpp-smollm2-int8.json")
    L.write(make_record(tmp_path, date="2026-12-01T10:00:00+00:00"), folder / "llamacpp-smollm2-old.json")
    (folder / P.MANIFEST).write_text("side_by_side: [llamacpp-*.json]\n")
    (folder / "smollm2-chat-t0.json").write_text(json.dumps(
        {"date": "2026-12-03", "target": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "prompts_source": "chat",
         "temperature": 0.0, "methods": {"ar": {"method": "ar", "preset": None, "tokens_per_second": 20.0,
                                                "speedup_vs_ar": {"median": 1.0}}}}))
    data = D.Data(tmp_path)
    table = "\n".join(D.pair_side(data, "smollm2", ""))
    assert table.count("### llama.cpp side by side") == 1 and "| int8 |" in table and "| bfloat16 |" in table
    assert data.unused() == ["llamacpp-smollm2-old.json"]


def test_int8_weights_are_named_so():
    assert L.treegen_dtype("int8") == "int8"
    assert L.treegen_dtype("fp32") == "float32"
