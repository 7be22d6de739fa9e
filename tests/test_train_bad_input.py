"""Training commands: bad values are usage errors before anything loads, no empty --out is left behind, and
a run stopped by SIGINT/SIGTERM resumes exactly where an uninterrupted run would be."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from treegen.cli import cli


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n" * 4)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "text.pt").write_text("not a tensor")
    (tmp_path / "prog").write_bytes(b"\x7fELF\x02\x01\x01\0\0\0" + bytes(range(256)) * 4)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    (tmp_path / "out.txt").write_text("a file, not a folder")
    return tmp_path


BAD = {
    "steps 0": ("--steps 0", "--steps"),
    "steps -1 batch 0": ("--steps -1 --batch 0", "--steps"),
    "batch 0": ("--batch 0", "--batch"),
    "lr 0": ("--lr 0", "--lr"),
    "gamma 0": ("--gamma 0", "--gamma"),
    "empty data": ("--data {tmp}/empty.txt", "empty"),
    "missing data": ("--data {tmp}/none.txt", "no such file"),
    "missing stream": ("--data {tmp}/none.pt", "cannot read a token stream"),
    "text as stream": ("--data {tmp}/text.pt", "cannot read a token stream"),
    "block above seq-len": ("--block-size 64 --seq-len 32", "--block-size"),
    "too many anchors": ("--seq-len 32 --block-size 16 --anchors 20", "--anchors"),
    "target layers": ("--target-layers 1,x", "--target-layers"),
    "missing target": ("--target ./nowhere", "no such folder"),
    "resume nothing": ("--resume", "nothing to resume"),
    "binary data": ("--data {tmp}/prog", "a binary file (NUL bytes), not training text"),
    "latin-1 data": ("--data {tmp}/latin1.txt", "not UTF-8 text (byte 3)"),
    "out is a file": ("--out {tmp}/out.txt", "is a file"),
    "huge batch": ("--batch 100000000", "--batch"),
    "huge seq-len": ("--seq-len 100000000", "--seq-len"),
    "huge anchors": ("--anchors 100000", "--anchors"),
    "huge layers": ("--layers 100000", "--layers"),
    "huge block": ("--block-size 100000", "--block-size"),
}


@pytest.mark.parametrize("command", ["treeflash", "domino", "vp-drafter"])
def test_every_trainer_refuses_a_file_as_out_before_loading(command, corpus, tiny_model_dir):
    result = CliRunner().invoke(cli, ["train", command, "--target", str(tiny_model_dir),
                                      "--out", str(corpus / "out.txt")])
    assert result.exit_code == 2 and "is a file" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("case", sorted(BAD))
def test_train_dflash_usage_errors(case, corpus, tiny_model_dir, monkeypatch):
    monkeypatch.setattr("treegen.train.pipeline.train_dflash_pipeline", lambda *a, **k: pytest.fail("ran"))
    extra, phrase = BAD[case]
    out = corpus / "out"
    data = [] if "--data" in extra else ["--data", str(corpus / "text.txt")]
    given_out = [] if "--out" in extra else ["--out", str(out)]
    args = ["train", "dflash", "--target", str(tiny_model_dir), *data, *given_out, *extra.format(tmp=corpus).split()]
    result = CliRunner().invoke(cli, args)   # through the top group, as a user runs it
    assert result.exit_code == 2, result.output
    assert phrase in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_train_dflash_passes_gamma_on(corpus, tiny_model_dir, monkeypatch):
    seen = {}
    monkeypatch.setattr("treegen.train.pipeline.train_dflash_pipeline", lambda target, data, out, cfg, **k: seen.update(
        gamma=cfg.gamma))
    base = ["train", "dflash", "--target", str(tiny_model_dir), "--data", str(corpus / "text.txt")]
    for extra, gamma in (([], None), (["--gamma", "2.5"], 2.5)):
        result = CliRunner().invoke(cli, [*base, "--out", str(corpus / f"out{gamma}"), *extra])
        assert result.exit_code == 0 and seen["gamma"] == gamma, result.output   # None: by block size


def test_short_data_is_one_line_and_leaves_no_folder(corpus, tiny_model_dir):
    out = corpus / "out"
    args = ["train", "dflash", "--target", str(tiny_model_dir), "--data", str(corpus / "text.txt"), "--out", str(out),
            "--seq-len", "512", "--block-size", "8", "--anchors", "4", "--steps", "2", "--layers", "1"]
    result = CliRunner().invoke(cli, args)   # through the top group, as a user runs it
    assert result.exit_code == 1 and "the training data is" in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()


def run_fit(ckpt, steps: int, stop_at: int | None = None, resume: bool = False):
    from treegen.train.common import STOP, Schedule, fit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    seen = []

    def step_loss(g):
        x = torch.randn(8, 4, generator=g)
        seen.append(x.sum().item())
        if stop_at is not None and len(seen) == stop_at:
            STOP.set()   # what the SIGINT/SIGTERM handler does
        return ((model(x) - x) ** 2).mean(), 8, ""

    STOP.clear()
    try:
        fit(model, opt, Schedule(1e-2, steps, warmup=2), gen, ckpt, step_loss, resume=resume, ckpt_every=1000)
    finally:
        STOP.clear()
    return model.state_dict(), seen


def test_interrupted_training_resumes_exactly(tmp_path):
    whole, seen = run_fit(tmp_path / "a.pt", 10)
    with pytest.raises(KeyboardInterrupt):
        run_fit(tmp_path / "b.pt", 10, stop_at=4)
    resumed, rest = run_fit(tmp_path / "b.pt", 10, resume=True)
    assert rest == seen[4:]                                    # the same batches, none skipped or repeated
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_sigterm_stops_a_run_at_a_step_boundary(tmp_path):
    import os
    import signal

    from treegen.train.common import STOP
    from treegen.train.guards import stop_signals

    with stop_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        assert STOP.is_set()
    assert not STOP.is_set() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
