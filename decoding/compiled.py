"""A static-shape decode step: T tokens per row through a cache at fixed shapes, so that
one compiled (and, on CUDA, captured) forward serves every step.

On CUDA it is captured once as a CUDA graph (optionally torch.compile'd first) and
replayed, so that small models are not bound by kernel-launch overhead. On a CPU it is
torch.compile'd (inductor) as one graph and called each step (`generate(compile=True)`,
`draft.compile=true`): inductor fuses the hundreds of small ops around the projections
(norms, RoPE, residuals, the MLP's gate) that the eager forward runs one by one, and the
quantized projections' bf16 casts with them.

The step runs the same model forward over the same cache as an eager step; only its plan
differs. Before each step the host books it (`cache.plan`: lengths, a paged row's new
block, a ring's slot positions) and loads the positions into the cache's `static_plan`
(cache/static.py), a plan of fixed-shape device buffers; inside the graph every layer's
`cache.attend(layer, q, k, v, plan)` takes that plan and attends over the backend's whole
storage, masked by position (int4's `HostPlan` instead keeps the eager plan the host booked
and runs the eager int4 attention as one opaque call per layer). Shapes never change, so
one compile serves every step of that model, batch and capacity (`static_capacity` rounds capacities up so that nearby
lengths share it).

Which caches can: those whose `static_plan` succeeds (dense, paged and sliding; int4 on
a CPU, whose plan is a `HostPlan`: its attention one opaque host call per layer inside the
graph, on the eager plan booked before the step); the others refuse with their reason
(int4 on CUDA: a captured graph replays no host work), collected by `static_problems`
before anything is built.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from decodelab.models.errors import SetupError, raise_if

MODES = ("eager", "graph", "compile")


def static_problems(cache, mode: str, tokens: int = 1) -> list[str]:
    """Every reason the static decode step cannot run this cache in this mode."""
    p = []
    try:  # the cache says whether it has a fixed-shape plan, and why not
        cache.static_plan(tokens)
    except SetupError as e:
        p += e.reasons
    if mode not in MODES:
        p.append(f"mode must be one of {list(MODES)}, got {mode!r}")
    elif mode == "graph" and cache.layout.device.type != "cuda":
        p.append("mode=graph captures a CUDA graph: it needs the cache on a CUDA device (use mode=eager)")
    return p


class StaticDecoder:
    """`step(last [B]) -> logits [B, V]`: one greedy-ready decode step at fixed shapes.

    mode: `eager` runs the static forward as is (any device; the reference of the other
    two), `graph` captures it as a CUDA graph on the first step and replays it, `compile`
    runs it through torch.compile first (`backend`, inductor by default) and, on CUDA,
    captures that. The returned logits live in a static buffer: read them before the next
    step. `tokens` T > 1 makes it a step of T tokens per row (a speculative verify of
    gamma + 1), `step(ids [B, T]) -> logits [B, T, V]`."""

    def __init__(self, model, cache, mode: str = "graph", impl: str = "auto", backend: str = "inductor",
                 tokens: int = 1):
        p = static_problems(cache, mode, tokens)
        p += wrapper_problems(cache.layout.device) if mode == "compile" else []
        if p:
            raise SetupError(p)
        self.model, self.cache, self.mode, self.tokens = model, cache, mode, tokens
        self.plan = cache.static_plan(tokens, impl)  # fixed device buffers, refilled before every step
        self.ids = torch.zeros(cache.batch_size, tokens, dtype=torch.long, device=cache.layout.device)  # [B, T]
        fn = self._forward
        if mode == "compile":
            allow_recompiles()
            inductor_cache_dir()
            self.private = torch_private() if self.plan.traced else None  # replay where the probe passed
            options, patches = None, inductor_patches(cache.layout.device)
            if self.private is not None:  # on a CPU: a graph StaticDecoder can call without dynamo (_compiled_call)
                backend = replayable(backend, self.private, patches)
            elif backend == "inductor" and self.plan.traced:
                options = patches  # torch.compile's public options: the same inductor config
            core = getattr(model, "model", model)  # a wrapper (the early-exit draft) holds the Transformer
            if core.lm_head is None and self.plan.traced:
                core.tied_head_t()  # the head copy the traced forward reads
            core.memoize_rope(cache.layout.device)  # memos filled before tracing: no guard on their state
            # on a CPU the whole step is one graph: a graph break is an error, never a silent slow path
            fn = torch.compile(fn, backend=backend, options=options, dynamic=False, fullgraph=self.plan.traced)
        self.fn, self.graph, self.logits = fn, None, None
        self.guarded = False  # a compiled step's first call evaluates every guard (_compiled_call)
        self.replay = None  # (compiled graph, its inputs) once a guarded call has run it (_compiled_call)

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        self.plan.begin()
        logits = self.model(self.ids, self.plan.pos, self.cache, plan=self.plan)  # [B, T, V]
        return logits[:, -1] if self.tokens == 1 else logits

    @torch.no_grad()
    def step(self, last: torch.Tensor) -> torch.Tensor:
        """Feed last [B] (ids [B, T] with `tokens` T) at each row's next positions (from the
        cache's lengths); logits [B, V] ([B, T, V])."""
        pos = self.cache.lengths[:, None] + torch.arange(self.tokens)  # [B, T] host
        self.ids.copy_(last.view(-1, self.tokens), non_blocking=True)  # first: a wrong shape books nothing
        self.plan.book(self.cache, pos)  # host bookkeeping (lengths, blocks, ring slots, int4's plan), then loads
        if self.mode == "compile" and self.cache.layout.device.type != "cuda":
            return self._compiled_call()
        if self.cache.layout.device.type != "cuda" or self.mode == "eager":
            return self.fn()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _compiled_call(self) -> torch.Tensor:
        """The compiled step on a CPU. The first call goes through dynamo and evaluates its
        guards in full (it compiles, or finds this shape's graph), and notes the compiled
        graph it ran and that graph's inputs: this step's own tensors (ids, positions, the
        cache's buffers, all updated in place) and the model's. Later calls call that graph
        on those inputs directly: no guard evaluation and no frame bytecode (SmolLM2, Zen 5:
        an int4 step 7.75 ms replayed against 9.08 ms through dynamo, fp32 26.1 against 27.0;
        experiments/results/compile-paths). What the replay does not see: model state
        replaced after that first call (modules swapped, a tied head's copy rebuilt after an
        in-place edit of the embedding): build a new step after such an edit, or set
        `SKIP_GUARD_EVAL = False`. Where the graph cannot be replayed so (more than the
        logits out, an input that is not a tensor), the caller set a stance of its own
        (force_eager, ...) or torch's internals failed `torch_private`'s probe, every call
        goes through dynamo, guards and all. A guarded call that raises leaves the step
        unguarded: the next call is guarded in full again."""
        if not self.guarded or not SKIP_GUARD_EVAL or self.private is None:
            global _NOTING
            self.guarded, self.replay, _NOTING = False, None, True
            try:
                out = self.fn()
            finally:
                ran, _NOTING = list(_RAN), False
                _RAN.clear()
            self.guarded = True  # only once a fully guarded call has returned
            self.replay = ran[0] if len(ran) == 1 and SKIP_GUARD_EVAL else None
            return out
        if self.replay is not None and self.private.caller_mode() == ("default", None):
            graph, inputs = self.replay
            return graph(*inputs)[0]
        return self.fn()  # through dynamo: the caller's stance applies

    def _capture(self) -> None:
        """Warm up on a side stream (compiles kernels; rewrites this step's own K/V slot
        with the same values), then capture one forward."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.fn()


#: (compiled graph, inputs) of the replayable graphs that ran since `_compiled_call` cleared it
_RAN: list[tuple] = []
_NOTING = False  # whether they note it (during a guarded call only)


def replayable(backend, private: "Private", patches: dict | None = None):
    """`backend` (a torch.compile backend: a name or a callable) whose compiled graphs note
    in `_RAN`, when called, themselves and the inputs dynamo handed them, where that graph
    returns one output and takes only tensors: a step that can be replayed by calling it.
    `patches`: inductor's options where the backend is inductor (`inductor_patches`; None:
    `INDUCTOR_PATCHES`). One wrapper per backend and options (dynamo reuses a compiled graph
    only for the backend object that compiled it)."""
    patches = INDUCTOR_PATCHES if patches is None else patches
    key = (backend, tuple(sorted(patches.items())))
    if key not in _REPLAYABLE:
        _REPLAYABLE[key] = _noting_backend(private.inner_backend(backend, patches))
    return _REPLAYABLE[key]


_REPLAYABLE: dict = {}


#: inductor options of compiled CPU steps: no per-call size, stride and alignment checks of
#: the graph's inputs (hundreds of module tensors, checked at every call, about 10% of an int4
#: SmolLM2 step: 118 -> 130 tok/s, Zen 3); a step's inputs are fixed when it is built
INDUCTOR_PATCHES = {"size_asserts": False, "alignment_asserts": False}
#: how a compiled CPU step's graph calls its operators and kernels, by the name a run's
#: `cpu_wrapper` option or $DECODELAB_CPU_WRAPPER gives (`cpu_wrapper`): "cpp", inductor's C++
#: wrapper (the step's calls made from C++, custom operators through the dispatcher, no Python
#: between them; its entry built at -O1 apart from the kernels at -O3, so that a model's large
#: entry builds quickly), or "python", inductor's Python wrapper. experiments/README.md ("Batch-1 decode
#: at the memory roofline") has what each costs and buys.
CPU_WRAPPERS = {"cpp": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}, "python": {}}
DEFAULT_CPU_WRAPPER = "cpp"


def _missing_options(wrapper: str) -> list[str]:
    """The inductor options of `wrapper` this torch's inductor does not have (an older torch)."""
    from torch._inductor import config

    return [k for k in CPU_WRAPPERS.get(wrapper, {}) if not hasattr(config, k)]


#: the wrapper a run's `cpu_wrapper` option chose (`use_cpu_wrapper`), ahead of the environment
_CHOSEN: dict = {"wrapper": None}


def cpu_wrapper_problems(name, key: str = "cpu_wrapper", unset: str = "null") -> list[str]:
    """Why `name` (given as `key`; `unset`: how to ask for the default) cannot be the wrapper of
    compiled CPU steps: not one of `CPU_WRAPPERS`, or one whose inductor options this torch
    lacks. None (the default) has none."""
    if name is None:
        return []
    if name not in CPU_WRAPPERS:
        return [f"{key}={name!r} names no wrapper of compiled CPU steps: use one of {list(CPU_WRAPPERS)} "
                f"(or {unset} for {DEFAULT_CPU_WRAPPER!r})"]
    missing = _missing_options(name)
    return [f"{key}={name!r}: this torch ({torch.__version__}) has no inductor option {', '.join(missing)}; "
            "use 'python' or upgrade torch"] if missing else []


def use_cpu_wrapper(name: str | None) -> None:
    """Give the CPU steps compiled from now on in this process the wrapper `name` (a run's
    `cpu_wrapper` option, set where `threads` is; None: back to $DECODELAB_CPU_WRAPPER, else the
    default). SetupError, changing nothing, where `cpu_wrapper_problems` has any."""
    raise_if(cpu_wrapper_problems(name))
    _CHOSEN["wrapper"] = name


@contextlib.contextmanager
def cpu_wrapper_chosen(name: str | None):
    """Within: `cpu_wrapper` answers as a run whose `cpu_wrapper` option is `name` will once
    `use_cpu_wrapper` applies it (its checks run before that: a valid name chosen, else, None
    or a name with problems that `cpu_wrapper_problems` reports, the environment's), whatever an
    earlier run in this process chose; restored after."""
    before = _CHOSEN["wrapper"]
    _CHOSEN["wrapper"] = None if cpu_wrapper_problems(name) else name
    try:
        yield
    finally:
        _CHOSEN["wrapper"] = before


def cpu_wrapper() -> str:
    """The wrapper compiled CPU steps get: the one `use_cpu_wrapper` chose, else
    $DECODELAB_CPU_WRAPPER where set (read at each call; one of `CPU_WRAPPERS`, else
    `wrapper_problems` says so), else `DEFAULT_CPU_WRAPPER` where this torch's inductor has its
    options, else "python"."""
    asked = _CHOSEN["wrapper"] or os.environ.get("DECODELAB_CPU_WRAPPER")
    if asked:
        return asked
    return DEFAULT_CPU_WRAPPER if not _missing_options(DEFAULT_CPU_WRAPPER) else "python"


def wrapper_problems(device: torch.device | str = "cpu") -> list[str]:
    """Why a step compiled on `device` cannot have the wrapper `cpu_wrapper` names (none off
    a CPU: a CUDA step replays as a CUDA graph)."""
    if torch.device(device).type != "cpu":
        return []
    if _CHOSEN["wrapper"]:  # only a wrapper without problems is ever chosen
        return []
    return cpu_wrapper_problems(cpu_wrapper(), "DECODELAB_CPU_WRAPPER", "unset it")


def inductor_patches(device: torch.device | str) -> dict:
    """Inductor's options for a step compiled on `device`: `INDUCTOR_PATCHES`, and on a CPU
    those of `cpu_wrapper` (SetupError where `wrapper_problems` has any)."""
    raise_if(wrapper_problems(device))
    return INDUCTOR_PATCHES | (CPU_WRAPPERS[cpu_wrapper()] if torch.device(device).type == "cpu" else {})


def _noting_backend(inner_backend):
    """A torch.compile backend: `inner_backend`'s compiled graph, wrapped to note itself and
    its inputs in `_RAN` while `_NOTING` (a replayable graph only)."""
    def compile_noting(gm, example_inputs):
        compiled = inner_backend(gm, example_inputs)
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if len(outputs) != 1 or not all(isinstance(x, torch.Tensor) for x in example_inputs):
            return compiled

        def run(*inputs):
            if _NOTING:
                _RAN.append((compiled, inputs))
            return compiled(*inputs)
        return run
    return compile_noting


class Private(NamedTuple):
    """What the replay takes from torch's internals (`torch_private`)."""

    inner_backend: Callable  # (a backend name or callable, inductor's options) -> the compiler function dynamo calls
    caller_mode: Callable[[], tuple]  # () -> (stance, forced backend) the caller set


@functools.cache
def torch_private() -> Private | None:
    """THE one use of torch's private compile internals (tests/decoding/test_compiled.py
    fails loudly when this probe fails): inductor's compiler function called with the
    step's options (`inductor_patches`; a custom backend cannot pass torch.compile's
    `options`), a backend looked up by name, and the stance the caller set (a replay must not bypass
    `force_eager`). Probed once per process on the installed torch: a tiny function
    compiled through the noting backend must note one graph whose replay gives what the
    call gave. None where anything is missing or differs: steps then go through dynamo
    every call (public APIs only, guards evaluated each step)."""
    global _NOTING
    try:
        from torch._dynamo import eval_frame, lookup_backend
        from torch._inductor.compile_fx import compile_fx

        def inner_backend(backend, patches: dict):
            if backend == "inductor":
                return lambda gm, inputs: compile_fx(gm, inputs, config_patches=patches)
            return lookup_backend(backend) if isinstance(backend, str) else backend

        def caller_mode() -> tuple:
            return eval_frame._stance.stance, eval_frame._stance.backend

        caller_mode()
        import inspect

        if "config_patches" not in inspect.signature(compile_fx).parameters:  # what inner_backend passes
            return None
        probe = torch.compile(lambda x: x * 2 + 1, backend=_noting_backend(inner_backend("eager", {})), fullgraph=True)
        x = torch.arange(3.0)
        _NOTING = True
        try:
            with torch.compiler.set_stance("default"):  # whatever the caller set around the first step
                out = probe(x)
        finally:
            ran, _NOTING = list(_RAN), False
            _RAN.clear()
        graph, inputs = ran[0]
        ok = len(ran) == 1 and torch.equal(graph(*inputs)[0], out) and torch.equal(out, x * 2 + 1)
    except Exception:  # noqa: BLE001 - any change in those internals means: do without them
        return None
    return Private(inner_backend, caller_mode) if ok else None


#: compiled steps one process may hold (each model x batch x capacity compiles once)
RECOMPILE_LIMIT = 64
#: after a compiled CPU step's first call, call its compiled graph directly (False: through
#: dynamo with every guard on every step, 1.3 ms a step slower for SmolLM2 int4, Zen 5)
SKIP_GUARD_EVAL = True


def allow_recompiles() -> None:
    """Let torch.compile keep up to `RECOMPILE_LIMIT` compiled steps (its default, 8,
    is reached by a benchmark that compiles several models at several capacities), and
    make going past that an error: dynamo would otherwise run the step eagerly, silently
    slow. Sets torch._dynamo's process-wide config."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    cfg.fail_on_recompile_limit_hit = True


#: torch's compile cache (inductor's generated code and built libraries) when the user did
#: not choose one with TORCHINDUCTOR_CACHE_DIR: a folder under DECODELAB_CACHE
INDUCTOR_FOLDER = "inductor"


def inductor_cache_dir() -> str:
    """The folder inductor caches compiled artifacts in: TORCHINDUCTOR_CACHE_DIR where the
    user set it, else (set now, for this process) `INDUCTOR_FOLDER` under DECODELAB_CACHE.
    Importing torch._dynamo writes torch's own default (a folder in /tmp) into the variable:
    that value counts as unset."""
    from decodelab.models.loading import cache_root

    now = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if now is None or os.path.abspath(now) == _torch_default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = now = str(cache_root() / INDUCTOR_FOLDER)
    return now


def _torch_default_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # what torch writes there
    except ImportError:  # another torch: its documented default
        import getpass
        import tempfile

        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return os.path.abspath(default_cache_dir())


#: how a loader reports a damaged library (a permission or disk-space error is not damage)
LOAD_FAILURES = ("file too short", "invalid elf", "not a dynamic", "file format not recognized", "wrong elf class",
                 "cannot open shared object", "no such file or directory", "truncated")


def damaged_artifact(err: BaseException, folder: str) -> tuple[str, BaseException] | None:
    """(the cached file under `folder`, the error) where a failed compile could not load or
    rebuild an artifact of torch's compile cache: an ImportError or OSError naming it that
    reads as a damaged file (`LOAD_FAILURES`: a zero-byte `.so` left by a compile killed part
    way), or a C++ compile of a file there while the folder holds a zero-byte library
    (inductor rebuilding around damaged entries); else None (a real compile error)."""
    seen, pattern = set(), re.escape(folder.rstrip("/")) + r"/[^\s:'\"]+"
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if isinstance(err, (ImportError, OSError)):
            low = text.lower()
            damaged = any(m in low for m in LOAD_FAILURES)
        else:
            damaged = type(err).__name__ == "CppCompileError" and _zero_byte_library(folder)
        m = re.search(pattern, text) if damaged else None
        if m:
            return m.group(0), err
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    return None


def _zero_byte_library(folder: str) -> bool:
    with contextlib.suppress(OSError):
        return any(f.stat().st_size == 0 for f in Path(folder).rglob("*.so"))
    return False


def _fresh_compile_cache(folder: str, bad: str, err: BaseException) -> None:
    """After `bad` (under `folder`, the compile cache) failed to load: a fresh cache for the
    retry, said on stderr. Our own folder (under DECODELAB_CACHE) is deleted and made anew, so
    later runs find it sound too; a folder the user chose is left as it is (it is theirs to
    delete) and this process compiles into ours."""
    from decodelab.models.loading import cache_root

    fresh = str(cache_root() / INDUCTOR_FOLDER)
    ours = os.path.abspath(folder) == os.path.abspath(fresh)
    if ours:
        gone = f"{folder}.damaged-{os.getpid()}-{time.time_ns()}"
        with contextlib.suppress(OSError):  # atomic: a process compiling now recreates an empty one
            os.replace(folder, gone)
        shutil.rmtree(gone, ignore_errors=True)
    then = ("deleted the compile cache folder and compiling again in a fresh one" if ours else
            f"compiling again in decodelab's own folder {fresh} (delete {folder}, the TORCHINDUCTOR_CACHE_DIR "
            "you set, to drop the damaged entry)")
    print(f"decodelab: torch's compile cache entry {bad} could not be loaded or rebuilt ({type(err).__name__}: "
          f"{str(err).strip().splitlines()[0][:200]}): damaged, left by a compile that did not finish; {then}",
          file=sys.stderr)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
    _forget_inductor_memos()


def _forget_inductor_memos() -> None:
    """Clear what inductor memoized in this process from the damaged cache, so that the retry
    decides afresh: which vector ISA builds (probed once per process by building and loading a
    small library in the cache folder: a damaged probe reads as no vector ISA, and the code then
    compiled against the wrong header fails) and the C++ and Python modules it loaded. These are
    torch's private modules: a torch without them is left as it is (the retry may then fail,
    and is refused naming the folder)."""
    try:
        from torch._inductor import codecache, cpu_vec_isa

        for cls in [cpu_vec_isa.VecISA, *_subclasses(cpu_vec_isa.VecISA)]:
            for f in vars(cls).values():
                getattr(f, "cache_clear", lambda: None)()
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        codecache.CppCodeCache.cache_clear()
        codecache.PyCodeCache.cache_clear()
    except (ImportError, AttributeError):
        pass


def _subclasses(cls) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def compiled_step(model, cache, backend: str = "inductor", tokens: int = 1) -> "StaticDecoder":
    """A `StaticDecoder` of `cache` in mode `compile` (`tokens` per row and step),
    compiled now: one step on the emptied cache (zero tokens from position 0), which the
    closing `reset` forgets, so that no request pays the compile. Shapes already compiled
    (this model, batch, capacity and tokens) only rebuild the wrapper. A cached artifact that
    fails to load (a damaged compile cache) is named and the compile retried once in a fresh
    cache folder (`_fresh_compile_cache`); a second failure is refused naming the folder."""
    first = torch.zeros(cache.batch_size, tokens, dtype=torch.long, device=cache.layout.device)

    def build() -> StaticDecoder:
        cache.reset()
        dec = StaticDecoder(model, cache, mode="compile", backend=backend, tokens=tokens)
        dec.step(first)
        return dec

    dec = compile_retrying(build)
    cache.reset()
    dec.guarded = False  # the first real step (after a prefill) is guarded in full once more
    return dec


def compile_retrying(build):
    """`build()` (which compiles), retried once in a fresh compile cache folder where it
    failed on a damaged cached artifact (`damaged_artifact`, `_fresh_compile_cache`); a
    second such failure is refused naming the folder; any other error propagates."""
    for attempt in (1, 2):
        folder = inductor_cache_dir()
        try:
            return build()
        except Exception as e:
            found = damaged_artifact(e, folder)
            if found is None:
                raise
            if attempt == 2:
                said = " ".join(str(found[1]).strip().splitlines()[:2])[:300]
                raise SetupError(f"the compiled decode step failed on {found[0]} in torch's compile cache twice, "
                                 f"the second time in a fresh folder ({type(found[1]).__name__}: {said}); delete "
                                 f"{folder} (rm -r {folder}) and run again, or set TORCHINDUCTOR_CACHE_DIR to "
                                 "another folder") from e
            _fresh_compile_cache(folder, *found)


def compiled_verify(model, cache, decoder, backend: str = "inductor") -> "StaticDecoder | None":
    """The compiled verify of a speculative `decoder` over `cache`: a static step of its
    gamma + 1 tokens per row (`compiled_step(..., tokens=)`), compiled now, where the decoder
    verifies a fixed number of tokens (`verify_tokens`: not adaptive, no drafter that reads
    the target's hidden states) and the cache plans a step of that many (`static_problems`);
    else None (the verify stays eager). The runner runs a verify through it where it fits:
    every row verifies exactly that many tokens (`ModelRunner.verify`)."""
    tokens = getattr(decoder, "verify_tokens", None)
    if not tokens or static_problems(cache, "compile", tokens):
        return None
    return compiled_step(model, cache, backend, tokens=tokens)


def static_capacity(need: int, limit: int, multiple: int = 256) -> int:
    """A cache capacity for a compiled step: `need` rounded up to a multiple of
    `multiple` (no more than `limit`, the model's context), so that requests of nearby
    lengths share one compiled step instead of compiling one each."""
    return max(need, min(limit, -(-need // multiple) * multiple))


@torch.no_grad()
def greedy_decode(step, first: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens per row [B, n] from `step(last) -> logits`, starting by feeding first [B]."""
    out, last = [], first
    for _ in range(n):
        last = step(last).argmax(-1)
        out.append(last)
    return torch.stack(out, 1)
