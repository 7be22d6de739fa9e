"""train/varied.py: the varied training texts never read what the bench measures on."""
from __future__ import annotations

from treegen.train import varied


def fake_site(root):
    (root / "rich").mkdir(parents=True)                 # a bench package: never read
    (root / "rich" / "console.py").write_text("RICH = 1\n")
    pkg = root / "otherpkg"
    (pkg / "_vendor" / "rich").mkdir(parents=True)      # a vendored copy of one: never read either
    (pkg / "_vendor" / "rich" / "console.py").write_text("VENDORED = 1\n")
    (pkg / "core.py").write_text('def greet(name):\n    """Say hello to someone by name, politely and with a '
                                 'newline at the end of the greeting."""\n    return f"hello {name}"\n')
    (pkg / "README.md").write_text("Otherpkg greets people. " * 30)
    (pkg / "LICENSE.txt").write_text("Permission is hereby granted " * 30)
    return root


def test_code_prose_chat_skip_bench_packages_and_vendored_copies(tmp_path):
    texts = varied.build(fake_site(tmp_path))
    code = "\n".join(texts["code"])
    assert "def greet" in code and "RICH" not in code and "VENDORED" not in code
    prose = "\n".join(texts["prose"])
    assert "Otherpkg greets people" in prose and "Permission is hereby" not in prose
    assert len(texts["prose"]) > 1   # the Python reference's topics come too
    assert any(t.startswith("User: ") and "greet" in t and "\nAssistant: Say hello" in t for t in texts["chat"])


def test_write_gives_one_jsonl_per_kind(tmp_path):
    import json

    varied.write({"code": ["a"], "prose": ["b"], "chat": ["c"]}, tmp_path)
    assert [json.loads(line)["text"] for line in (tmp_path / "prose.jsonl").read_text().splitlines()] == ["b"]
