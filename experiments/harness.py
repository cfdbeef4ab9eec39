"""The one harness every entry point stands on.

- a setup from configs: `check(cfg)` before any weights load (every reason at once),
  `load_model(cfg)` (threads, the pinned git revision), `build(cfg, lm)` (cache factory,
  decoder with its drafter), `cache_factory(name)` (a conf/cache option by name);
- `Timer`: wall-clock intervals that synchronize the model's device first (a GPU runs
  asynchronously: an unsynchronized clock times the launch, not the work);
- `run_conditions`: hardware, threads, versions, git revision, recorded with every figure;
- results: `results.jsonl` in one schema, written atomically under the entry point's
  Hydra output directory (all under `outputs/`), which `experiments.report` reads:
  `{"kind": "prompt", "run": ID, ...}` lines (per prompt or per step, optional) and one
  `{"kind": "summary", "entry", "run", "finished", "setup": {...}, "metrics": {...},
  "conditions": {...}, "config": {...}}` line per table row.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from decodelab.cache.base import CacheLayout
from decodelab.decoding.compiled import (cpu_wrapper, cpu_wrapper_chosen, cpu_wrapper_problems, static_problems,
                                         use_cpu_wrapper)
from decodelab.decoding.generate import compile_problems, sync
from decodelab.decoding.text import compiled_capacity
from decodelab.experiments.cli import group_options
from decodelab.models.errors import SetupError, raise_if
from decodelab.models.loading import CONF_DIR, added_key_problems, instantiate_option, instantiate_unwrapped

log = logging.getLogger("decodelab.harness")
#: torch's CPU threads when this module loaded: what `threads: null` gives a run (and gives back
#: after an earlier run in the same process, e.g. a multirun job, set its own)
DEFAULT_THREADS = torch.get_num_threads()
RESULTS = "results.jsonl"


# -- run conditions -------------------------------------------------------------------------
@functools.cache
def git_rev() -> str:
    """The revision this process runs: HEAD at the first call (entry points call it as
    they start), `-dirty` when tracked files differed from it then."""
    try:
        rev = _git("rev-parse", "--short", "HEAD") or "unknown"
        return rev + ("-dirty" if rev != "unknown" and _git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:
        return "unknown"


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5).stdout.strip()


def run_conditions(model=None) -> dict:
    """Hardware, threads, versions, git revision and the wrapper a compiled CPU step gets
    (`cpu_wrapper`), recorded with every figure; with a
    model, its dtype, device, matmul and the kernels that compute its quantized weights
    (`weight_kernel`: `native-int8`, `_weight_int8pack_mm`, ...; None for unquantized ones);
    given the LoadedModel, also where its weights came from (`model_source`, `model_path`,
    and `dequantized_from`: the GGUF's quantized types its fp32 weights were decoded from)."""
    source = dict(getattr(model, "source", None) or {})
    model = getattr(model, "model", model)  # a LoadedModel's Transformer
    versions = {}
    for pkg in ("torch", "transformers", "optimum-quanto", "triton", "llama-cpp-python"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    cond = {"git": git_rev(), "python": platform.python_version(), "cpu": cpu_name(),
            "llc_MiB": round(last_level_cache_bytes() / 2**20, 1),
            "threads": torch.get_num_threads(), "cpu_wrapper": cpu_wrapper(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None, **versions}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        cond |= {"sms": p.multi_processor_count, "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                 "cuda_runtime": torch.version.cuda}
    if model is not None:
        wq = getattr(model, "weight_quantization", None) or {}
        cond.update(dtype=str(model.dtype).removeprefix("torch."), device=str(model.device),
                    matmul=getattr(model, "matmul", None), weights=wq.get("weights", "none"),
                    weight_kernel=",".join(wq.get("kernels") or []) or None)
    if source:
        cond["model_source"] = source["source"]
        cond |= {"model_path": source["path"]} if "path" in source else {}
        if "dequantized_from" in source:
            cond["dequantized_from"] = ",".join(source["dequantized_from"]) or None
    return cond


def cpu_name() -> str:
    """The CPU's model name, family and model numbers (a virtual machine's model name may
    not tell one generation from another) and widest vector ISA (from /proc/cpuinfo where
    there is one), e.g. `AMD EPYC (family 25 model 1) avx2`."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in info.splitlines()  # noqa: E731
                              if ":" in ln and ln.split(":", 1)[0].strip() == key), "")
    isa = next((f for f in ("avx512f", "avx2", "avx") if f in field("flags").split()), "")
    fam, model = field("cpu family"), field("model")
    gen = f"(family {fam} model {model})" if fam and model else ""
    return " ".join(x for x in (field("model name") or platform.machine(), gen, isa) if x)


# -- timing ---------------------------------------------------------------------------------
class Timer:
    """`with timer: ...` adds one interval to `timer.seconds`, synchronizing the device
    before the clock starts and before it stops."""

    def __init__(self, device="cpu"):
        self.device, self.seconds = torch.device(device), []

    def __enter__(self) -> "Timer":
        sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync(self.device)
        self.seconds.append(time.perf_counter() - self._t0)

    def median(self) -> float:
        return sorted(self.seconds)[len(self.seconds) // 2]


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (Linux sysfs, cpu0's caches; 0 where it
    reports none): a machine whose last-level cache holds a model's weights serves them from
    there, not from memory (run conditions, `llc_MiB`)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        sizes += [int(digits) * unit] if digits.isdigit() else []
    return max(sizes, default=0)


def read_bandwidth(device="cpu", mib: int | None = None, repeats: int = 7) -> list[float]:
    """The machine's memory read bandwidth as this run sees it (its threads, its device): a
    streaming read of a `mib` MiB fp32 tensor (`x.sum()`), GB/s per timed read, `repeats` of
    them after one untimed; the denominator of a roofline. By default 256 MiB, or on a CPU
    twice its last-level cache where that is larger (a Xeon's 300 MiB L3 would otherwise
    serve much of the read), so that it reads memory, not a cache."""
    if mib is None:
        llc = last_level_cache_bytes() if torch.device(device).type == "cpu" else 0
        mib = max(256, -(-2 * llc // 2**20))
    x = torch.ones(mib * 2**18, device=device)  # mib MiB of fp32
    x.sum()
    timer = Timer(device)
    for _ in range(repeats):
        with timer:
            x.sum()
    return [x.numel() * 4 / s / 1e9 for s in timer.seconds]


def decode_s(token_times: list[float]) -> float:
    """First to last generated token of one output (its decode phase; 0 for one token)."""
    return token_times[-1] - token_times[0] if len(token_times) > 1 else 0.0


# -- a setup from configs ---------------------------------------------------------------------
def collect(reasons: list[str], fn):
    """fn(), or None with its SetupError's reasons added to `reasons`."""
    try:
        return fn()
    except SetupError as e:
        reasons += e.reasons
        return None


def gather(*checks) -> list:
    """Every check's result (None where it failed); one SetupError with the reasons of
    every check that failed."""
    reasons = []
    results = [collect(reasons, fn) for fn in checks]
    raise_if(reasons)
    return results


def _probe_layout(device: str = "cpu") -> CacheLayout:
    """A small stand-in layout for checking cache options before the model is known
    (head_dim 64 like most checkpoints; the real layout is checked again at build time),
    on the run's device type where a backend's capabilities depend on it (int4's compiled
    step: CPU only)."""
    return CacheLayout(2, 1, 64, torch.float32, torch.device(device), (None, None), 0.125)


def _probe_device(cfg: DictConfig) -> str:
    """The device the run's model will use, for `_probe_layout` (cpu where it does not
    resolve: the model's own checks name that problem)."""
    from decodelab.models.loading import resolve_device

    try:
        return str(resolve_device((cfg.get("model") or {}).get("device", "auto")))
    except Exception:  # noqa: BLE001 - reported by model_problems
        return "cpu"


def declared(spec, trait: str, default=False):
    """What the class or factory a config's `_target_` names declares about itself
    (`needs_drafter` of a decoder, `quantizes_target` of a drafter), before building it."""
    from hydra.utils import get_object

    target = spec.get("_target_") if spec is not None else None
    try:
        return getattr(get_object(target), trait, default) if target else default
    except Exception as e:  # an import path that does not resolve
        raise SetupError(f"_target_ {target!r} does not resolve ({type(e).__name__}: {e}); give an import path "
                         "of a class or function, as in the yaml files of conf/") from None


def int_problems(cfg, minimums: dict[str, int], nullable: tuple[str, ...] = ("threads",)) -> list[str]:
    """Each option of `cfg` an integer >= its minimum (or null, where that is allowed)."""
    out = []
    for key, lo in minimums.items():
        v = cfg.get(key)
        if not (v is None and key in nullable) and not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
            out.append(f"{key} must be {'null or ' * (key in nullable)}an integer >= {lo}, got {v!r}")
    return out


def list_problems(cfg, examples: dict[str, str]) -> dict[str, str]:
    """key: the problem, for each option of `cfg` named in `examples` (key: an example value)
    that is not a list (the console scripts turn `key=v` into `key=[v]`; a config composed
    another way may still hold one)."""
    from omegaconf import ListConfig

    return {k: f"{k} must be a list, got {v!r}; write " + (f"{k}=[{v}]" if v is not None else f"e.g. {k}=[{e}]")
            for k, e in examples.items() if not isinstance(v := cfg.get(k), (list, ListConfig))}


def model_path_problems(spec, key: str = "model") -> list[str]:
    """A model by path (conf/model/hf.yaml, gguf.yaml): the path given, and there."""
    if "path" not in spec or "_target_" not in spec:
        return []
    path, folder = spec.get("path"), spec["_target_"].endswith("load_hf_dir")
    what = "a Hugging Face model folder (config.json, *.safetensors, tokenizer)" if folder else "a .gguf file"
    if not path:
        return [f"{key}.path is required: {key}.path={'DIR' if folder else 'FILE'}, {what}"]
    there = Path(str(path)).expanduser()
    if not (there.is_dir() if folder else there.is_file()):
        return [f"{key}.path {path} is not {what}" + ("" if there.exists() else " (it does not exist)")]
    return []


def model_problems(spec, key: str = "model") -> list[str]:
    """The non-architecture options of a conf/model spec (its weights node, matmul)."""
    from decodelab.models.loading import added_key_problems, model_option_problems

    return added_key_problems(spec, where=f"{key}.") + model_path_problems(spec, key) + model_option_problems(
        spec.get("weights", "none"), spec.get("matmul", "auto"), spec.get("dtype"), spec.get("device"), key)


def draft_problems(cfg: DictConfig) -> list[str]:
    """A draft model's options; a draft that quantizes the target, of a target quantized already."""
    from decodelab.models.quantize import WEIGHT_TYPES, kind_of, option_problems

    draft = cfg.get("draft") or {}
    p = added_key_problems({k: draft[k] for k in draft if k != "model"}, where="draft.")
    p += model_problems(draft.model, "draft.model") if draft.get("model") is not None else []
    if not declared(draft, "quantizes_target"):
        return p
    p += option_problems(draft.get("weights", "int8"), "draft.weights")  # before the target loads
    if (target := kind_of(cfg.model.get("weights"))) in WEIGHT_TYPES and target != "none":
        p.append(f"draft={kind_of(draft.get('weights', 'int8'))}-self quantizes the target, but the target is "
                 f"quantized already (model.weights.kind={target}); use model.weights.kind=none, or another draft "
                 "(early-exit, prompt-lookup)")
    return p


def check(cfg: DictConfig) -> None:
    """Every problem of the model options, decoder, draft and cache configs, before weights load."""
    with cpu_wrapper_chosen(cfg.get("cpu_wrapper")):  # what compiles, checked with the run's wrapper
        _check_setup(cfg)


def _check_setup(cfg: DictConfig) -> None:
    reasons = model_problems(cfg.model)
    needs_drafter = declared(cfg.decoder, "needs_drafter")
    kw = {"drafter": None} if needs_drafter else {}
    decoder = collect(reasons, lambda: instantiate_unwrapped(cfg.decoder, **kw))
    if needs_drafter:
        reasons += draft_problems(cfg)
    factory = collect(reasons, lambda: instantiate_unwrapped(cfg.cache))
    device = _probe_device(cfg)
    probe = collect(reasons, lambda: factory(_probe_layout(device), 1, 128)) if factory else None
    if cfg.get("compile") is not None and not isinstance(cfg.compile, bool):  # (1 == True: not `in`)
        reasons.append(f"compile must be true or false, got {cfg.compile!r}")
    elif cfg.get("compile") and decoder is not None and probe is not None:
        reasons += compile_problems(probe, decoder)
        if needs_drafter and cfg.get("compare_greedy"):  # bench's greedy beside it runs the compiled step
            reasons += [f"compare_greedy=true with compile=true (greedy through the compiled step): {r}"
                        for r in static_problems(probe, "compile")]
    draft = (cfg.get("draft") or {}) if needs_drafter else {}
    draft_probe = probe
    if draft.get("cache") is not None:  # the draft's own backend
        name = draft.cache
        if name not in group_options("cache"):
            reasons.append(f"draft.cache must be null (the target's backend) or a cache option "
                           f"({', '.join(group_options('cache'))}), got {name!r}")
            draft_probe = None
        else:
            draft_probe = collect(reasons, lambda: cache_factory(name)(_probe_layout(device), 1, 128))
    draft_compile = draft.get("compile")
    if draft_compile is not None and not isinstance(draft_compile, bool):
        reasons.append(f"draft.compile must be true or false, got {draft_compile!r}")
    elif (draft_compile or (draft_compile is not None and cfg.get("compile") is True)) and draft_probe is not None:
        hint = "" if draft.get("cache") is not None else " (or give the draft a cache of its own: draft.cache=dense)"
        key = "draft.compile=true" if draft_compile else "compile=true (which compiles the draft's steps)"
        reasons += [f"{key}: {r}{hint}" for r in static_problems(draft_probe, "compile")]
    lookahead = getattr(decoder, "rollback_needed", 0) if decoder is not None else 0
    if probe is not None and lookahead and probe.rollback_limit < lookahead:
        reasons.append(f"cache {cfg.cache._target_} can roll back {probe.rollback_limit} tokens but the decoder's "
                       f"gamma (a tree decoder: its nodes) needs {lookahead}; raise the cache's rollback/residual or "
                       "lower gamma")
    if draft_probe is not None and draft_probe is not probe and lookahead and draft_probe.rollback_limit < lookahead:
        reasons.append(f"draft.cache {type(draft_probe).__name__} can roll back {draft_probe.rollback_limit} tokens "
                       f"but the decoder's gamma needs {lookahead}; lower gamma or choose another draft.cache")
    raise_if(reasons)


def draft_cache(cfg: DictConfig, factory):
    """The draft's cache factory: its own backend where `draft.cache` names one (a conf/cache
    option), else the target's `factory`."""
    name = (cfg.get("draft") or {}).get("cache")
    return cache_factory(name) if name is not None else factory


def compiles(cfg: DictConfig) -> bool:
    """Whether the run compiles a decode step (`compile`, or its drafter's `draft.compile`)."""
    return bool(cfg.get("compile")) or bool(declared(cfg.decoder, "needs_drafter")
                                            and (cfg.get("draft") or {}).get("compile"))


def capacity(cfg: DictConfig, model, batch_size: int, need: int, factory) -> int:
    """A run's cache capacity for `need` positions: rounded up where a step compiles (so
    prompts of nearby lengths share a compile) and the rounded cache still fits
    (`decoding.text.compiled_capacity`), else `need`."""
    return compiled_capacity(model, batch_size, need, factory) if compiles(cfg) else need


def run_option_problems(cfg: DictConfig) -> list[str]:
    """The process-wide options every entry point takes: `threads` (null or >= 1) and
    `cpu_wrapper` (null, or a name of decoding.compiled.CPU_WRAPPERS this torch has)."""
    return int_problems(cfg, {"threads": 1}) + cpu_wrapper_problems(cfg.get("cpu_wrapper"))


def load_model(cfg: DictConfig):
    """The target model of `cfg.model` with `cfg.threads` torch threads (null: torch's default,
    `DEFAULT_THREADS`, whatever an earlier run in this process set) and `cfg.cpu_wrapper` the
    wrapper of the CPU steps it compiles (null: $DECODELAB_CPU_WRAPPER, else the default); pins
    the git revision the run starts with."""
    git_rev()
    torch.set_num_threads(int(cfg.threads) if cfg.get("threads") else DEFAULT_THREADS)
    use_cpu_wrapper(cfg.get("cpu_wrapper"))
    return instantiate_unwrapped(cfg.model)


def build(cfg: DictConfig, lm):
    """(cache factory, decoder) for the loaded target `lm`; a decoder that declares
    `needs_drafter` gets the drafter of `cfg.draft`, caching through the target's backend
    unless `draft.cache` names its own."""
    factory = instantiate_unwrapped(cfg.cache)
    kw = {}
    if declared(cfg.decoder, "needs_drafter"):
        kw["drafter"] = instantiate_unwrapped(cfg.draft)(target=lm, cache=draft_cache(cfg, factory))
    decoder = instantiate_unwrapped(cfg.decoder, **kw)
    log.info("cache: %s | decoder: %s", cfg.cache._target_, decoder)
    return factory, decoder


def option(group: str, name: str, where: str = "", **overrides):
    """conf/<group>/<name>.yaml instantiated (a factory where the yaml is `_partial_`), with
    option overrides (an override its target does not take is refused, named `where`+key)."""
    raise_if([] if name in group_options(group) else
             [f"no {group} option {name!r}; the options are {', '.join(group_options(group))}"])
    return instantiate_option(group, name, where, **overrides)


def cache_factory(name: str, **options):
    """The cache factory of conf/cache/<name>.yaml, with option overrides."""
    from decodelab.cache.factory import backend

    return backend(name, **options)


# -- results ----------------------------------------------------------------------------------
def summary(entry: str, run: str, setup: dict, metrics: dict, conditions: dict, cfg=None) -> dict:
    """One summary record (a table row) of the results schema."""
    config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    return {"kind": "summary", "entry": entry, "run": run, "finished": datetime.now(timezone.utc).isoformat(),
            "setup": setup, "metrics": metrics, "conditions": conditions, "config": config}


def run_id(prefix: str) -> str:
    """An ID no other run repeats (report dedupes by ID): prefix, start time and process."""
    return f"{prefix}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%f}-{os.getpid()}"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """All records or nothing: a temporary file, fsynced, renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


CLAIM = ".claim"


@contextlib.contextmanager
def claimed(out: Path):
    """Claim the run directory `out` while the body runs: an exclusive lock (flock) on
    `out/.claim`, which holds "host pid" for the message. Yields None when this process
    holds it, else the holder's text (so two identical sweeps into one directory run each
    job once). The kernel drops the lock when its process ends, however it ends (kill -9),
    so a claim never outlives its process. The file stays (deleting a locked file would let
    a third process lock a new one beside it)."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    with open(out / CLAIM, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            yield fh.read().strip() or "another process"
            return
        fh.seek(0)
        fh.truncate()
        fh.write(f"{socket.gethostname()} {os.getpid()}")
        fh.flush()
        try:
            yield None
        finally:
            fh.truncate(0)  # closing the file releases the lock


def hydra_app(config_name: str, run):
    """The Hydra app of an entry point: `run(cfg, output directory)`; a SetupError (a bad
    option or input) prints every reason and exits 2, with no traceback; a run that
    returns a non-zero int exits with it."""
    import hydra

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=config_name)
    def main(cfg: DictConfig) -> None:
        mark_run(output_dir())
        try:
            code = run(cfg, output_dir())
        except SetupError as e:
            print(f"error: {e}", file=sys.stderr)
            remove_if_unused(output_dir())
            sys.exit(2)
        if type(code) is int and code:
            if multirun():  # a sweep's other jobs still run; Hydra raises this at the end (exit 1)
                raise RunFailed(f"this job exited {code} (its reasons are above); the sweep's other jobs run on")
            sys.exit(code)
    return main


class RunFailed(RuntimeError):
    """A sweep's job that finished without a result worth reading (its exit status under a
    single run): raised, not exited, so that Hydra runs the sweep's other jobs first."""


def multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def entry_points(config_name: str, run, check):
    """(main, cli) of an entry point: `main` is `hydra_app(config_name, run)`; `cli`, its
    console script, first reports every unknown option or key with the problems `check(cfg)`
    finds (exit 2, before any weights load), then runs `main`."""
    main = hydra_app(config_name, run)

    def cli() -> None:
        from decodelab.experiments.cli import precheck

        sys.argv[1:] = precheck(sys.argv[1:], config_name, check)
        main()
    return main, cli


_STARTED = time.time()  # this process's start, near enough: before Hydra makes any run folder
MARK = "decodelab-run-"  # + pid, in a run folder's .hydra/: which processes ran in it


def mark_run(folder: Path) -> None:
    """Note in `folder`'s .hydra/ that this process runs there (`remove_if_unused` reads it)."""
    with contextlib.suppress(OSError):
        if (folder / ".hydra").is_dir():
            (folder / ".hydra" / f"{MARK}{os.getpid()}").touch()


def remove_if_unused(folder: Path) -> None:
    """Delete the run folder Hydra made for this process's run, refused before it wrote
    anything: one that holds Hydra's own `.hydra/` configs (with this process's `mark_run`)
    and nothing else but log files, all made since this process started. Kept: a folder
    holding anything else (results written before the refusal), one another process runs in
    too (two runs started in the same second share `outputs/<entry>/<time>`), one that held
    an earlier run, one without this process's mark, the working directory or one above it."""
    folder, here = folder.resolve(), Path.cwd().resolve()
    mine = folder / ".hydra" / f"{MARK}{os.getpid()}"
    if folder == here or folder in here.parents or not mine.is_file():
        return  # not a run folder Hydra made for this process (generate runs in `.`, no .hydra/): never touched
    files = [f for f in folder.rglob("*") if f.is_file()]
    others = [f for f in files if f.name.startswith(MARK) and f != mine]  # a run started in the same second
    older = [f for f in files if f.stat().st_mtime < _STARTED - 2]  # a folder that held a run before this one
    if others or older or not all(f.suffix == ".log" or ".hydra" in f.relative_to(folder).parts for f in files):
        mine.unlink(missing_ok=True)
        return
    shutil.rmtree(folder, ignore_errors=True)
    for parent in folder.parents:  # outputs/serve, outputs: where this run made them empty
        if parent == here or here not in parent.parents:
            break
        try:
            parent.rmdir()
        except OSError:  # not empty
            break


def output_dir() -> Path:
    """This Hydra job's output directory (outputs/<entry>/...)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)

