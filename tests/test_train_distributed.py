"""Training on any device and under torchrun: a 2-process gloo run (CPU) of `treegen train dflash` and of
`train treeflash` gives the weights a 1-process run gives with the same global batch and seed; a 2-process
run stopped by SIGTERM and resumed gives the weights of an uninterrupted one; --device and --dtype on every
trainer; no device or precision hard-coded under treegen/train."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import TINY_CORPUS
from safetensors.torch import load_file

from treegen.cli import cli
from treegen.train.cli import train

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "treegen", "train"]
SHAPE = ["--seq-len", "32", "--anchors", "4", "--batch", "4", "--device", "cpu", "--dtype", "fp32"]
STEPS = 60    # long enough that a SIGTERM sent at step 10 lands mid-run


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    """The tiny target, a corpus, and a tiny DFlash drafter for the TreeFlash head to sit on."""
    from test_dflash import tiny_drafter_config
    from transformers import AutoModelForCausalLM

    from treegen.models.checkpoint import save_dflash
    from treegen.models.dflash import DFlashDrafter

    root = tmp_path_factory.mktemp("ddp")
    (root / "corpus.txt").write_text("".join(TINY_CORPUS) * 4)
    torch.manual_seed(0)
    save_dflash(DFlashDrafter(tiny_drafter_config(AutoModelForCausalLM.from_pretrained(tiny_model_dir))),
                root / "dflash")
    return root, tiny_model_dir


def dflash_args(setup, out: Path) -> list[str]:
    root, target = setup
    return ["dflash", "--target", str(target), "--data", str(root / "corpus.txt"), "--out", str(out),
            "--layers", "1", "--block-size", "4", "--steps", str(STEPS), *SHAPE]


def treeflash_args(setup, out: Path) -> list[str]:
    root, target = setup
    return ["treeflash", "--target", str(target), "--drafter", str(root / "dflash"), "--data",
            str(root / "corpus.txt"), "--out", str(out), "--steps", "8", *SHAPE]


def one_process(args: list[str]) -> None:
    result = CliRunner().invoke(train, args)
    assert result.exit_code == 0, result.output


def two_processes(args: list[str], log: Path | None = None) -> subprocess.Popen:
    """torchrun's run of `treegen train ARGS`; its stderr to `log` (a pipe to read as it goes without one)."""
    err = open(log, "w") if log else subprocess.PIPE   # noqa: SIM115 (the process holds it)
    run = subprocess.Popen(TORCHRUN + args, env=env(), stderr=err, stdout=subprocess.DEVNULL, text=True)
    run.log = log
    return run


def finished(run: subprocess.Popen) -> str:
    _, err = run.communicate(timeout=300)
    err = run.log.read_text() if run.log else err
    assert run.returncode == 0, err[-3000:]
    return err


def assert_same_weights(a: Path, b: Path) -> None:
    one, two = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(one) == set(two)
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def runs(setup):
    """The 2-process runs that nothing else waits on, started together (they overlap the tests' own work)."""
    root = setup[0]
    started = {"dflash": two_processes(dflash_args(setup, root / "dflash-2"), root / "dflash-2.log"),
               "treeflash": two_processes(treeflash_args(setup, root / "treeflash-2"), root / "treeflash-2.log")}
    yield started
    for run in started.values():
        if run.poll() is None:
            run.kill()


def test_two_processes_train_the_weights_one_process_trains(setup, runs):
    root = setup[0]
    one_process(dflash_args(setup, root / "dflash-1"))
    one_process(treeflash_args(setup, root / "treeflash-1"))
    err = finished(runs["dflash"])
    assert err.count(f"trained {STEPS} steps") == 1   # rank 0 alone logs
    assert_same_weights(root / "dflash-1", root / "dflash-2")
    finished(runs["treeflash"])
    assert_same_weights(root / "treeflash-1", root / "treeflash-2")


def test_a_stopped_two_process_run_resumes_to_the_uninterrupted_weights(setup, runs):
    root = setup[0]
    out = root / "dflash-stopped"
    run = two_processes(dflash_args(setup, out))
    for line in run.stderr:   # SIGTERM to torchrun once rank 0 reports step 10; it passes it to every rank
        if re.match(r"step\s+10\b", line):
            run.send_signal(signal.SIGTERM)
            break
    err = run.communicate(timeout=120)[1]
    stopped = re.search(r"stopped at step (\d+)", err)
    assert stopped and 10 <= int(stopped.group(1)) < STEPS, err[-3000:]
    finished(two_processes(dflash_args(setup, out) + ["--resume"], root / "resumed.log"))
    if runs["dflash"].poll() is None:
        finished(runs["dflash"])
    assert_same_weights(root / "dflash-2", out)


def test_every_trainer_takes_device_and_dtype():
    trainers = [name for name in train.commands if name != "tokenizer"]
    assert {"dflash", "treeflash", "domino", "vp-drafter", "target"} <= set(trainers)
    for name in trainers:
        text = CliRunner().invoke(train, [name, "--help"]).output
        assert "--device" in text and "--dtype" in text, name


def test_precision_names_are_the_loops():
    from treegen.train.cli import PRECISION_NAMES
    from treegen.train.common import PRECISIONS

    assert PRECISION_NAMES == list(PRECISIONS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_and_exit_2_before_loading(monkeypatch, tmp_path):
    monkeypatch.setattr("treegen.train.pipeline.train_dflash_pipeline", lambda *a, **k: pytest.fail("ran"))
    result = CliRunner().invoke(cli, ["train", "dflash", "--target", "demo", "--data", str(tmp_path), "--out",
                                      str(tmp_path / "out"), "--device", "cuda"])
    assert result.exit_code == 2 and "no CUDA device" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_generators_refuse_cuda_without_cuda_in_one_line(capsys):
    from treegen.train.varied import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as stop:
        main(["--out", "/nonexistent", "--device", "cuda"])
    assert stop.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_no_device_or_precision_is_hard_coded_under_train():
    """"cpu" / "fp32" appear only where --device / --dtype name their choices and defaults."""
    allowed = re.compile(r"click\.(option|Choice)|^(DEVICES|PRECISIONS|PRECISION_NAMES) =")
    literal = re.compile(r"""["'](cpu|fp32|float32)["']""")
    found = [f"{path.name}:{n}: {line.strip()}"
             for path in sorted((Path(__file__).parents[1] / "treegen" / "train").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if literal.search(line) and not allowed.search(line)]
    assert not found, found


def test_autocast_only_where_asked_and_the_target_as_served():
    from treegen.train.common import Runtime, native_bf16, runtime

    cpu = torch.device("cpu")
    assert runtime("cpu", "fp32").precision == torch.float32
    assert runtime("cpu", "auto").precision == (torch.bfloat16 if native_bf16(cpu) else torch.float32)
    from treegen.loading import resolve_dtype

    bf16 = Runtime(cpu, torch.bfloat16)
    assert bf16.target_dtype == str(resolve_dtype("auto", cpu)).removeprefix("torch.")   # as `chat` serves it
    assert Runtime(cpu, torch.float32).target_dtype == "float32"
    with bf16.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with Runtime(cpu, torch.float32).autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_the_global_batch_splits_evenly_or_not_at_all():
    from treegen.train.common import Runtime

    cpu = torch.device("cpu")
    batch = {"ids": torch.arange(8).view(4, 2), "allowed": None}
    halves = [Runtime(cpu, torch.float32, rank, 2).shard(batch) for rank in (0, 1)]
    assert torch.equal(torch.cat([h["ids"] for h in halves]), batch["ids"]) and halves[1]["allowed"] is None
    with pytest.raises(ValueError, match="divide"):
        Runtime(cpu, torch.float32, 0, 2).check_batch(3)


def test_a_worker_ends_with_its_code_and_its_output_flushed():
    """A torchrun worker ends by os._exit (no interpreter teardown for gloo's threads to abort in): with its
    exit code and every line it printed, as a plain process ends by sys.exit."""
    script = ("import sys; from treegen.exit import as_worker, end\n"
              "if sys.argv[1] == 'worker': as_worker()\n"
              "print('out', end=''); print('err', end='', file=sys.stderr); end(3)")
    for mode in ("worker", "plain"):
        done = subprocess.run([sys.executable, "-c", script, mode], check=False, capture_output=True, text=True,
                              timeout=60)
        assert (done.returncode, done.stdout, done.stderr) == (3, "out", "err"), mode
