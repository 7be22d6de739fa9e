"""Presets: loading, validation with one-line errors, path resolution, immutable merging. No model needed."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from treegen import presets
from treegen.presets import Preset, PresetError, Sampling


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_shipped_presets_load_and_are_listed():
    found = presets.available()
    assert {"ar", "pld"} <= set(found)
    for name in ("ar", "pld"):
        p = presets.load(name)
        assert p.method == name and p.description and p.target is None


def test_packaged_folder_is_found_without_the_checkout(monkeypatch):
    monkeypatch.setattr(presets, "CHECKOUT_PRESETS", Path("/nonexistent"))
    assert presets.available()["pld"].name == "pld.yaml"


def test_env_folder_comes_first(tmp_path, monkeypatch):
    write(tmp_path, "pld.yaml", "description: mine\nmethod: pld\n")
    monkeypatch.setenv(presets.ENV_PATH, str(tmp_path))
    assert presets.load("pld").description == "mine"


def test_sampling_fields_are_the_api_defaults():
    assert {f.name for f in dataclasses.fields(Sampling)} == set(presets.api_defaults())


def test_relative_paths_resolve_against_the_preset_file(tmp_path):
    (tmp_path / "models" / "t").mkdir(parents=True)
    (tmp_path / "d").mkdir()
    path = write(tmp_path, "x.yaml", "description: x\ntarget: ./models/t\ndrafter: d\nmethod: ar\n")
    p = presets.load(str(path))
    assert p.target == str((tmp_path / "models" / "t").resolve())
    assert p.drafter == str((tmp_path / "d").resolve())


def test_hub_ids_stay_as_written(tmp_path):
    path = write(tmp_path, "x.yaml", "description: x\ntarget: Qwen/Qwen3-8B\nmethod: ar\n")
    assert presets.load(str(path)).target == "Qwen/Qwen3-8B"


BAD = {
    "unknown key": ("descripton: x\nmethod: ar\n", "descripton"),
    "unknown sampling key": ("method: ar\nsampling: {temprature: 1}\n", "sampling.temprature"),
    "wrong type": ("method: ar\nsampling: {temperature: hot}\n", "sampling.temperature"),
    "bool for an int": ("method: ar\nsampling: {top_k: true}\n", "sampling.top_k"),
    "missing path": ("method: ar\ntarget: ./nowhere\n", "target"),
    "unknown method": ("method: warp\n", "method"),
    "unknown option": ("method: pld\nmethod_options: {ngram: 3}\n", "method_options"),
    "bad option type": ("method: pld\nmethod_options: {draft_len: long}\n", "method_options"),
    "no method": ("description: x\n", "method"),
    "malformed": ("method: [ar\n", "malformed YAML"),
    "not a mapping": ("- ar\n", "expected a mapping"),
    "options not a mapping": ("method: pld\nmethod_options: [1]\n", "method_options"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_presets_fail_in_one_line_naming_file_and_key(tmp_path, case):
    text, key = BAD[case]
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(PresetError) as err:
        presets.load(str(path))
    message = str(err.value)
    assert str(path) in message and key in message and "\n" not in message


@pytest.mark.parametrize("name, message", [
    ("treflash", "unknown preset 'treflash' (did you mean treeflash?); `treegen presets` lists the"),
    ("smollm2-dflsh", "(did you mean smollm2-dflash?)"),
    ("zzzz", "unknown preset 'zzzz'; `treegen presets` lists the"),
])
def test_unknown_name_suggests_the_near_one_in_one_short_line(name, message):
    with pytest.raises(PresetError) as err:
        presets.load(name)
    assert message in str(err.value) and "..." not in str(err.value) and len(str(err.value)) < 150


@pytest.mark.parametrize("name, pair, read", [
    ("dflash", "smollm2", "smollm2-dflash"), ("pld", "smollm2", "smollm2-pld"),
    ("ddtree-32", "smollm2", "ddtree-32"),          # no smollm2 twin: the demo pair's, said by a notice
    ("smollm2-ar", "smollm2", "smollm2-ar"), ("dflash", "demo", "dflash"), ("dflash", None, "dflash"),
    ("./dflash.yaml", "smollm2", "./dflash.yaml"),
])
def test_a_preset_name_reads_as_the_pair_in_use(name, pair, read):
    assert presets.on_pair(name, pair) == read


def test_unknown_name_and_missing_file():
    with pytest.raises(PresetError, match="no such preset file"):
        presets.load("missing/x.yaml")


def test_flags_make_a_new_config_and_leave_the_preset_alone():
    base = presets.load("pld")
    merged = base.with_flags(target="t", temperature=0.5, seed=None, max_new_tokens=7)
    assert merged.target == "t" and merged.sampling.temperature == 0.5 and merged.sampling.max_new_tokens == 7
    assert merged.method_options == base.method_options
    assert base.target is None and base.sampling == Sampling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        merged.target = "x"
    with pytest.raises(TypeError):
        merged.method_options["draft_len"] = 3


def test_another_method_drops_the_preset_options():
    assert dict(presets.load("pld").with_flags(method="ar").method_options) == {}
    assert dict(presets.load("pld").with_flags(method="pld").method_options)


def test_resolved_sampling_fills_the_api_defaults():
    resolved = Sampling(temperature=0.7).resolved()
    assert resolved == {**presets.api_defaults(), "temperature": 0.7}


def test_show_round_trips(tmp_path):
    shown = presets.to_yaml(presets.load("pld"))
    again = presets.load(str(write(tmp_path, "pld.yaml", shown)))
    assert presets.resolved_dict(again) == yaml.safe_load(shown)
    assert again.method_options["min_ngram"] == 1  # the method's own default, filled in by show


def test_default_preset_is_the_api_defaults():
    p = Preset()
    assert p.method is None and p.target is None and p.sampling.given() == {}
