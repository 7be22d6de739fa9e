"""GGUF targets: a .gguf file (or a folder holding exactly one, and no config.json) is read once through
transformers' GGUF support, dequantized, and saved as a plain safetensors folder in the user's cache; every
later load reads that folder. Nothing heavy is imported at module level (treegen.validate imports this)."""
from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .engine.disk import cache_root as measurements
from .engine.disk import read_table, write_entry

MAGIC = b"GGUF"
PIP = "pip install 'gguf>=0.10'"
CHUNK = 1 << 24          # bytes hashed per read: a GGUF can be many GB
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


QUIET = contextvars.ContextVar("treegen_gguf_quiet", default=False)   # --quiet: no conversion notice


@contextlib.contextmanager
def quiet_conversion():
    """Within this block a first conversion says nothing on stderr (what --quiet asks for)."""
    token = QUIET.set(True)
    try:
        yield
    finally:
        QUIET.reset(token)


class GGUFError(ValueError):
    """A GGUF target that cannot be read or converted; the message is one line for the user."""


@dataclass(frozen=True)
class Header:
    architecture: str
    types: tuple[str, ...]   # the ggml types of the file's tensors (F32, Q4_1, ...)

    @property
    def dtype(self) -> str:
        """The precision kept in the cache: the file's own float type, or float32 for dequantized blocks."""
        if not set(self.types) <= set(FLOAT_TYPES):
            return "float32"
        return next((FLOAT_TYPES[t] for t in ("BF16", "F16") if t in self.types), "float32")

    def describe(self) -> str:
        return f"architecture {self.architecture}, tensor types {', '.join(self.types)}"


def gguf_file(path: Path) -> Path | None:
    """The .gguf file a target path names: the file itself, or the only one in a folder without config.json."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:3]) + (", ..." if len(found) > 3 else "")
        raise GGUFError(f"{path}: holds {len(found)} .gguf files ({names}); name one of them as --target")
    return found[0] if found else None


def check_magic(file: Path) -> None:
    """The first four bytes, read before anything loads: a file that is not GGUF fails at once."""
    try:
        with open(file, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as err:
        raise GGUFError(f"{file.name}: cannot be read ({err.strerror or err})") from None
    if head != MAGIC:
        raise GGUFError(f"{file.name}: not a GGUF file (it does not start with the GGUF magic bytes)")


def cached_target(file: Path) -> Path:
    """The converted folder for this GGUF file, converted first when no earlier load did it."""
    file = file.resolve()
    check_magic(file)
    root = cache_root()
    folder = root / file_key(file, root)
    if (folder / "config.json").is_file():
        return folder
    header = read_header(file)
    if not QUIET.get():
        print(f"treegen: converting {file.name} once into {folder} (first load only)", file=sys.stderr, flush=True)
    convert_atomically(file, folder, header)
    return folder


def cache_root() -> Path:
    """$TREEGEN_CACHE, $XDG_CACHE_HOME/treegen or ~/.cache/treegen (as every measurement), then gguf/."""
    return measurements() / "gguf"


def digest(file: Path) -> str:
    """sha256 of the file's bytes (first 16 hex digits), read in chunks."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()[:16]


def file_key(file: Path, root: Path) -> str:
    """The file's digest, remembered by (path, size, mtime): a file is hashed again only when it changed."""
    st = file.stat()
    stamp = [st.st_size, st.st_mtime_ns]
    entry = read_table(root / "index.json").get(str(file))
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    key = digest(file)
    write_entry(root / "index.json", str(file), {"stamp": stamp, "sha256": key})   # atomic: no half index
    return key


def read_header(file: Path) -> Header:
    """Architecture and tensor types, which also proves the file whole (a truncated one fails here)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"reading a GGUF file needs the gguf package: {PIP}") from None
    try:
        reader = GGUFReader(file)
        field = reader.fields.get("general.architecture")
        if field is None:
            raise ValueError("no general.architecture in its metadata")
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
        types = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
    except Exception as err:  # noqa: BLE001 (the reader raises ValueError, struct.error, IndexError, ...)
        raise GGUFError(f"{file.name}: not a readable GGUF file ({first_line(err)})") from None
    return Header(architecture, types)


def convert_atomically(file: Path, folder: Path, header: Header) -> None:
    """Built in a temporary sibling and moved into place: an interrupted conversion leaves no half folder,
    and a concurrent one that finishes first is kept (its folder holds the same weights)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    except OSError as err:
        raise GGUFError(f"cannot write the GGUF cache {folder.parent} ({err.strerror or err}); "
                        f"set TREEGEN_CACHE to a writable folder") from None
    try:
        convert(file, tmp, header)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert(file: Path, out: Path, header: Header) -> None:
    """Model (dequantized) and tokenizer from the GGUF file, saved into `out` as a transformers folder, with
    the file's tensor types beside them (tensor_types)."""
    model = load_gguf_model(file, header)
    save_plain(plain_copy(model), out)
    load_gguf_tokenizer(file, header).save_pretrained(out)
    (out / TYPES_FILE).write_text(json.dumps(list(header.types)))


TYPES_FILE = "gguf_types.json"   # in a converted folder: the file's tensor types (read_header reads the whole file)


def tensor_types(file: Path, folder: Path) -> tuple[str, ...]:
    """The GGUF file's tensor types, kept in its converted folder; read from the file once where a folder
    converted before they were kept lacks them."""
    kept = folder / TYPES_FILE
    try:
        return tuple(json.loads(kept.read_text()))
    except (OSError, ValueError, TypeError):
        types = read_header(file).types
    tmp = kept.with_suffix(f".{os.getpid()}.tmp")
    try:   # atomic: a concurrent reader sees the whole list or none
        tmp.write_text(json.dumps(list(types)))
        os.replace(tmp, kept)
    except OSError:
        tmp.unlink(missing_ok=True)
    return types


def save_plain(model, out: Path) -> None:
    """config, generation config and one safetensors file, as save_pretrained lays them out; written here
    because save_pretrained writes no weights on a rank other than 0, and every process of a torchrun job may
    be the one that converts its machine's cache."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:   # a tied copy (lm_head = embed_tokens): stored once, as transformers does
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def load_gguf_model(file: Path, header: Header):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, header.dtype)}
    try:  # dense weights even where transformers could keep the blocks packed (with the `kernels` package)
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    try:  # its dequantizing progress bar (a bare tqdm) would land in the user's stderr: the one line says it
        with contextlib.redirect_stderr(io.StringIO()):
            return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, **kwargs)
    except Exception as err:  # noqa: BLE001 (an architecture or quantisation transformers cannot read)
        raise GGUFError(f"{file.name}: transformers cannot read this GGUF ({header.describe()}): "
                        f"{first_line(err)}") from None


def load_gguf_tokenizer(file: Path, header: Header):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as err:  # noqa: BLE001 (a tokenizer type transformers cannot build)
        raise GGUFError(f"{file.name}: transformers cannot build its tokenizer ({header.describe()}): "
                        f"{first_line(err)}") from None


def plain_copy(model):
    """The same weights in a model built from the config without `quantization_config`: transformers refuses
    to save a GGUF-loaded model. Built on the meta device, so no second copy of the weights is made."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
