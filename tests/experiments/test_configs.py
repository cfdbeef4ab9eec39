"""Every config in every group composes and instantiates; bad setups fail early with
every reason listed."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from decodelab.cache.base import CacheLayout
from decodelab.experiments import harness
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR


#: the class each conf/cache option builds, by the option's stem (dense-bf16, dense-fp8 ...: dense)
CLASSES = {"dense": "DenseCache", "paged": "PagedCache", "int4": "QuantizedCache", "sliding": "SlidingCache"}

def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("cache", names("cache"))
@pytest.mark.parametrize("decoder", names("decoder"))
def test_every_cache_decoder_combination_checks_and_builds(cache, decoder, tiny_models):
    draft = ["draft=prompt-lookup"] if decoder == "tree" else ["draft=early-exit", "draft.layers=1"]
    cfg = config(f"cache={cache}", f"decoder={decoder}", *draft)
    harness.check(cfg)
    lm = tiny_models["llama"]
    factory, dec = harness.build(cfg, lm)
    built = factory(CacheLayout.of(lm.model), 1, 16)  # the class each yaml's _target_ names
    assert type(built).__name__ == CLASSES[cache.split("-")[0]]  # dense-bf16 ...: dense with a kv_dtype
    assert type(dec).__name__ == {"greedy": "SamplingDecoder", "sampling": "SamplingDecoder",
                                  "speculative": "SpeculativeDecoder", "tree": "TreeSpeculativeDecoder"}[decoder]
    lookahead = {"speculative": 5, "tree": 13}.get(decoder, 0)  # gamma 4 + 1; 1 + width 3 x depth 4
    assert dec.needs_drafter == (decoder in ("speculative", "tree")) and dec.lookahead == lookahead
    if decoder == "speculative":  # the draft caches through the setup's own backend
        assert dec.drafter.cache_factory is factory


@pytest.mark.parametrize("cache", names("cache"))
def test_a_draft_cache_of_its_own_is_built_from_its_option(cache, tiny_models):
    """draft.cache names a conf/cache option: the draft caches through that backend, the
    target through its own; a compiled draft on a target cache that cannot compile checks."""
    cfg = config(f"cache={cache}", "decoder=speculative", "draft=early-exit", "draft.layers=1", "draft.cache=dense",
                 "draft.compile=true")
    harness.check(cfg)
    lm = tiny_models["llama"]
    factory, dec = harness.build(cfg, lm)
    layout = CacheLayout.of(lm.model)
    assert type(dec.drafter.cache_factory(layout, 1, 16)).__name__ == "DenseCache"
    assert type(factory(layout, 1, 16)).__name__ == CLASSES[cache.split("-")[0]]


def test_a_drafter_built_without_a_cache_factory(tiny_models):
    """A conf/draft yaml instantiated by hand (no `cache=` from the harness): `cache: null`
    is the dense default; a cache option's name is refused with how to build it."""
    lm = tiny_models["llama"]
    d = harness.option("draft", "early-exit", layers=1)(target=lm)
    assert d.cache_factory.__name__ == "DenseCache"
    with pytest.raises(SetupError, match="cache 'paged' is a conf/cache option name; build the drafter through"):
        harness.option("draft", "early-exit", layers=1, cache="paged")(target=lm)


@pytest.mark.parametrize("draft", names("draft"))
def test_every_draft_builds(draft, tiny_models):
    overrides = ["decoder=speculative", f"draft={draft}"] + (["draft.layers=1"] if draft == "early-exit" else [])
    target = tiny_models["llama"]
    _, dec = harness.build(config(*overrides), target)
    d = dec.drafter
    if draft == "prompt-lookup":
        assert (d.min_ngram, d.max_ngram) == (1, 3)
        return
    from decodelab.models.quantize import QuantProj

    quantized = {m.weights for m in d.model.modules() if isinstance(m, QuantProj)}
    assert quantized == ({draft.split("-")[0]} if draft.endswith("-self") else set())  # a quantized copy of the target
    if draft == "early-exit":
        assert d.model.n_layers == 1 and d.model.model is target.model  # the target's own first layer
    if draft == "model":  # conf/draft/model.yaml's tiny-llama (SmolLM2's 49152 ids): this 256-id target refuses it
        assert d.model is not target.model and d.model.cfg.vocab_size == 49152
        assert "vocabulary of 49152 tokens, the target 256" in d.problems(target.model, 1, 4)[0]
    else:
        assert d.problems(target.model, 1, 4) == []


def test_bad_config_lists_every_reason():
    cfg = config("decoder=speculative", "decoder.gamma=0", "decoder.temperature=-1", "decoder.top_p=2")
    with pytest.raises(SetupError) as e:
        harness.check(cfg)
    assert len(e.value.reasons) == 3


# -- every group, the named setups and experiments, the launchers ---------------------
def test_every_group_option_composes_and_its_target_takes_its_options(tmp_path):
    import inspect

    from hydra.utils import get_method
    from omegaconf import OmegaConf

    for group in ("model", "cache", "decoder", "draft", "workload"):
        for name in names(group):
            spec = OmegaConf.to_container(config(f"{group}={name}")[group])
            fn = get_method(spec.pop("_target_"))
            params = inspect.signature(fn).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            unknown = [k for k in spec if not k.startswith("_") and k not in params]
            assert takes_any or not unknown, f"{group}={name}: {fn.__name__} takes no {unknown}"


@pytest.fixture(scope="module")
def tiny_with_tokenizer():
    from decodelab.models.loading import instantiate_unwrapped

    return instantiate_unwrapped(config("model=tiny-llama", "model.device=cpu").model)


@pytest.mark.parametrize("workload", names("workload"))
def test_every_workload_instantiates_and_yields_prompts(workload, tmp_path, tiny_with_tokenizer):
    from decodelab.models.loading import instantiate_unwrapped

    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "Hi there", "reference": "Hello!"}\n{"prompt": "Bye"}\n')
    extra = {"jsonl": [f"workload.path={f}"], "sharegpt": ["workload.n=2", "workload.max_prompt_tokens=64"],
             "sharegpt-long": ["workload.n=2"], "synthetic": ["workload.lengths=[8,12]"], "agree-prompts": ["workload.n=2"]}[workload]
    lm = tiny_with_tokenizer
    reqs = instantiate_unwrapped(config(f"workload={workload}", *extra).workload)(lm)
    assert len(reqs) == 2 and len({r.id for r in reqs}) == 2
    ids = [r.encode(lm.tokenizer) for r in reqs]
    assert all(len(x) > 0 for x in ids)
    if workload == "synthetic":
        assert [len(x) for x in ids] == [8, 12]
    if workload in ("sharegpt", "sharegpt-long", "agree-prompts"):
        assert all(r.reference and r.chat for r in reqs)
    if workload == "sharegpt-long":  # the prompt text alone 300-500 tokens (chat template: a few more)
        assert all(300 <= len(lm.tokenizer.encode(r.prompt)) <= 500 for r in reqs)


def test_a_packaged_workload_file_that_does_not_exist_is_named():
    from decodelab.models.loading import instantiate_unwrapped

    with pytest.raises(SetupError, match=r"workload.file 'nope.jsonl' is not one of the packaged workload files "
                                         r"\['agree-prompts.jsonl'\]; a file of your own: workload=jsonl"):
        instantiate_unwrapped(config("workload=agree-prompts", "workload.file=nope.jsonl").workload)


@pytest.mark.parametrize("name", names("setup"))
def test_every_named_setup_checks_and_builds(name, tiny_models):
    cfg = config(f"setup={name}", "draft.layers=1")
    harness.check(cfg)
    _, dec = harness.build(cfg, tiny_models["llama"])
    assert cfg.setup_name == name and {"max_abs_dlogit", "max_kl", "min_top1"} <= set(cfg.agreement)
    assert ("speculative" in name) == hasattr(dec, "drafter")


@pytest.mark.parametrize("name", names("experiment"))
def test_every_named_experiment_composes_and_checks(name):
    from decodelab.experiments.bench import check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"experiment={name}"], return_hydra_config=True)
    assert cfg.name == name and cfg.hydra.sweeper.params  # a sweep holding only its deltas
    cfg_run = config(f"experiment={name}")
    check(cfg_run)  # its deltas are valid options


@pytest.mark.parametrize("name", names("preset"))
def test_every_micro_preset_composes_and_checks(name):
    """conf/preset: decodelab-micro's named sweeps, each its deltas over micro.yaml plus the
    sweep, valid for every combination of its swept values."""
    import itertools

    from decodelab.experiments.micro import check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        params = compose(config_name="micro", overrides=[f"preset={name}"], return_hydra_config=True)
        params = params.hydra.sweeper.params
        assert params  # a sweep holding only its deltas
        for values in itertools.product(*(str(v).split(",") for v in params.values())):
            chosen = [f"{k}={v}" for k, v in zip(params, values)]
            check(compose(config_name="micro", overrides=[f"preset={name}", *chosen]))  # raises SetupError if not


@pytest.mark.parametrize("launcher", ["parallel", "local", "slurm"])
def test_launcher_configs_compose(launcher):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert "Launcher" in cfg.hydra.launcher._target_


def test_precheck_lists_unknown_groups_keys_and_bad_values_together(capsys):
    from decodelab.experiments.bench import check
    from decodelab.experiments.cli import precheck

    with pytest.raises(SystemExit) as e:
        precheck(["cache=pagd", "decoder=speculative", "decoder.gamma=0", "decoder.temprature=0.5",
                  "max_new_token=3"], "config", check)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid setup (4 problem(s))" in err
    assert "no such cache; the options are dense, dense-bf16, dense-fp16, dense-fp8, int4, paged, paged-fp8, sliding" in err
    assert "did you mean decoder.temperature?" in err and "did you mean max_new_tokens?" in err
    assert "gamma must be an integer >= 1, got 0" in err


def test_precheck_lets_a_good_config_through(capsys):
    from decodelab.experiments.bench import check
    from decodelab.experiments.cli import precheck

    precheck(["cache=paged", "decoder=speculative", "decoder.gamma=3", "-m", "cache.block_size=32"], "config", check)
    assert capsys.readouterr().err == ""  # returned (no exit), nothing reported


def test_one_value_for_a_list_option_becomes_a_one_element_list():
    from hydra import compose, initialize_config_dir

    from decodelab.experiments.cli import as_lists

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="serve")
    argv = ["rates=2", "rates=1,inf", "backends=paged", "rates=[1,2]", "rates=null", "requests=3",
            "+rates2=4", "-m", "backends='paged'"]
    assert as_lists(cfg, argv) == ["rates=[2]", "rates=[1],[inf]", "backends=[paged]", "rates=[1,2]",
                                   "rates=null", "requests=3", "+rates2=4", "-m", "backends=['paged']"]


@pytest.mark.parametrize("arg, message", [
    ("rates=abc", "rates must be a list of numbers or inf, e.g. rates=[0.5,1,inf], got ['abc']"),
    ("rates=[1,abc]", "rates must be a list of numbers or inf, e.g. rates=[0.5,1,inf], got [1, 'abc']"),
    ("rates=[0]", "rates must be > 0 requests/s"),
])
def test_bad_serve_rates_are_named_before_any_work(arg, message):
    from decodelab.experiments.cli import precheck
    from decodelab.experiments.serve import check

    argv = precheck([arg, "model=tiny-llama"], "serve", check)  # what the console script hands Hydra
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="serve", overrides=argv)
    with pytest.raises(SetupError) as e:
        check(cfg)
    assert message in str(e.value)


def test_a_serve_check_names_a_rates_option_that_is_not_a_list():
    from hydra import compose, initialize_config_dir

    from decodelab.experiments.serve import check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="serve", overrides=["rates=2", "model=tiny-llama"])  # composed without precheck
    with pytest.raises(SetupError, match=r"rates must be a list, got 2; write rates=\[2\]"):
        check(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["cache=paged", "+cache.block_sizee=4"],
     "cache.block_sizee: decodelab.cache.paged.PagedCache takes no option 'block_sizee'; did you mean "
     "cache.block_size? its options are: block_size, num_blocks, memory_budget_mb, prefix_caching, impl"),
    (["decoder=speculative", "draft=early-exit", "+draft.layerz=1"],
     "draft.layerz: decodelab.decoding.drafters.early_exit takes no option 'layerz'; did you mean draft.layers?"),
    (["decoder=speculative", "draft=model", "+draft.model.seeed=1"], "draft.model.seeed: "),
    (["+model.foo=1"], "model.foo: decodelab.models.loading.random_model takes no option 'foo'"),
])
def test_an_added_key_the_target_does_not_take_is_refused_before_weights_load(overrides, message):
    """`+group.key=v` passes the unknown-key check on purpose; the target's signature refuses it
    in the entry point's check, which runs before any model is built (a `_partial_` cache
    factory would otherwise fail only when called, with a TypeError)."""
    from decodelab.experiments.bench import check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=["model=tiny-llama", *overrides])
    with pytest.raises(SetupError) as e:
        check(cfg)
    assert message in str(e.value)


@pytest.mark.parametrize("backends", ["[paged]", "[dense]"])  # served or not: checked
def test_serve_refuses_a_backend_option_its_cache_does_not_take(backends):
    from decodelab.experiments.serve import check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="serve", overrides=["model=tiny-llama", f"backends={backends}",
                                                      "+backend_options.paged={block_sizee: 4}"])
    with pytest.raises(SetupError, match=r"backend_options\.paged\.block_sizee: decodelab\.cache\.paged\."
                                         r"PagedCache takes no option 'block_sizee'; did you mean "
                                         r"backend_options\.paged\.block_size"):
        check(cfg)


def test_a_target_taking_any_keyword_takes_an_added_key():
    from decodelab.models.loading import added_key_problems

    assert added_key_problems({"_target_": "builtins.dict", "anything": 1}) == []
    assert added_key_problems({"_target_": "collections.OrderedDict", "x": 1}) == []  # C signature: left to hydra
    assert "takes no option 'x'" in added_key_problems({"_target_": "fractions.Fraction", "x": 1})[0]


def test_serve_names_backend_options_of_a_backend_that_does_not_exist():
    from decodelab.experiments.serve import check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="serve", overrides=["model=tiny-llama", "+backend_options.pagd={block_size: 4}"])
    with pytest.raises(SetupError, match=r"backend_options\.pagd: no cache backend 'pagd'; the options are"):
        check(cfg)


@pytest.mark.parametrize("argv", [["--cfg", "job"], ["-c", "job"], ["--info", "defaults"], ["--help"],
                                  ["--shell-completion", "install=bash"]])
def test_hydras_own_flags_reach_hydra_as_written(argv):
    from decodelab.experiments.bench import check
    from decodelab.experiments.cli import precheck

    assert precheck(argv, "config", check) == argv


@pytest.mark.parametrize("how", ["--config-dir={d}", "-cd {d}", "hydra.searchpath=[file://{d}]"])
def test_a_users_own_config_folder_is_composed_and_checked(tmp_path, how, capsys):
    """`--config-dir DIR` and `hydra.searchpath`: the user's `model/mine.yaml` is an option
    like the packaged ones; a key it lacks and a folder that does not exist are named."""
    from decodelab.experiments.bench import check
    from decodelab.experiments.cli import precheck
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text((CONF_DIR / "model" / "tiny-llama.yaml").read_text())
    argv = [*how.format(d=tmp_path).split(), "model=mine", "max_new_tokens=3"]
    assert precheck(argv, "config", check) == argv and capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        precheck([*how.format(d=tmp_path).split(), "model=mine", "model.dtyp=float32"], "config", check)
    assert "model.dtyp: unknown config key; did you mean model.dtype?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        precheck([*how.format(d=tmp_path / "nope").split(), "model=mine"], "config", check)
    err = capsys.readouterr().err
    assert f"config folder {tmp_path / 'nope'} (--config-dir or hydra.searchpath) is not a directory" in err
    assert "model=mine: no such model" in err


def test_a_key_every_option_of_a_swept_group_lacks_is_named_with_the_option(capsys):
    from decodelab.experiments.bench import check
    from decodelab.experiments.cli import precheck

    with pytest.raises(SystemExit):
        precheck(["-m", "cache=paged,dense", "cache.block_size=32"], "config", check)
    assert "cache.block_size: unknown config key for cache=dense;" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        precheck(["-m", "cache=choice(dense,pagd)"], "config", check)
    assert "cache=pagd: no such cache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        precheck(["cache=choice(dense"], "config", check)  # Hydra's parser refuses it: its own message
    assert "no viable alternative at input" in capsys.readouterr().err


@pytest.mark.parametrize("sweep", ["cache=choice(dense,paged)", "cache=glob(*)", "decoder.temperature=range(0,1,0.5)"])
def test_hydras_sweep_functions_pass_the_precheck(sweep, capsys):
    from decodelab.experiments.bench import check
    from decodelab.experiments.cli import precheck

    assert precheck(["-m", sweep], "config", check) == ["-m", sweep] and capsys.readouterr().err == ""


def test_a_choice_of_a_group_option_that_does_not_exist_is_named(capsys):
    from decodelab.experiments.bench import check
    from decodelab.experiments.cli import precheck

    with pytest.raises(SystemExit):
        precheck(["-m", "cache=choice(dense,pagd)"], "config", check)
    assert ("cache=pagd: no such cache; the options are dense, dense-bf16, dense-fp16, dense-fp8, int4, paged, paged-fp8, "
            "sliding") in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["-m", "cache=choice(int4,paged)", "cache.impl=reference"],
                                  ["-m", "cache=glob(p*)", "cache.block_size=32"]])
def test_a_group_swept_by_a_function_takes_keys_of_its_options(argv, capsys):
    from decodelab.experiments.bench import check
    from decodelab.experiments.cli import precheck

    assert precheck(argv, "config", check) == argv and capsys.readouterr().err == ""


def test_as_lists_leaves_interpolations_escapes_and_quoted_sweeps_as_written():
    from decodelab.experiments.cli import as_lists

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        serve, gen = compose(config_name="serve"), compose(config_name="generate")
    kept = ["rates=${oc.env:R,1}", "backends=${x}"]
    assert as_lists(serve, kept) == kept
    assert as_lists(gen, ["stop=a\\,b", "stop='a','b'", "stop=ab"]) == ["stop=a\\,b", "stop='a','b'", "stop=[ab]"]


def _entry_checks():
    """(config name, its entry point's check) of every console script."""
    from decodelab.experiments import agree, bench, generate, micro, serve

    return {"config": bench.check, "generate": generate.check, "micro": micro.check, "serve": serve.check,
            "agree": lambda cfg: agree.check_all(cfg, [])}


@pytest.mark.parametrize("name", ["config", "generate", "micro", "serve", "agree"])
def test_every_entry_point_refuses_a_cpu_wrapper_or_threads_that_names_none(name, tiny_models):
    """cpu_wrapper and threads, the options every entry point takes and sets for the whole
    process (harness.load_model), are checked by each before its model loads: a wrapper that
    is not one, and fewer than one thread, named with the fix; cpu_wrapper=python passes."""
    check = _entry_checks()[name]
    own = ["prompt=Hello"] if name == "generate" else []  # (no prompt: generate reads stdin)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        bad = compose(config_name=name, overrides=["model=tiny-llama", "cpu_wrapper=cxx", "threads=0", *own])
        good = compose(config_name=name, overrides=["model=tiny-llama", "cpu_wrapper=python", "threads=1", *own])
    with pytest.raises(SetupError) as e:
        check(bad)
    assert "cpu_wrapper='cxx' names no wrapper of compiled CPU steps: use one of ['cpp', 'python']" in str(e.value)
    assert "threads must be null or an integer >= 1, got 0" in str(e.value)
    check(good)


def test_the_cpu_wrapper_option_is_set_for_the_process_when_the_model_loads(tiny_models, monkeypatch, tmp_path):
    """load_model applies cfg.cpu_wrapper ahead of $DECODELAB_CPU_WRAPPER (which the tests set
    to python), records it in the run conditions, and null gives the environment's back."""
    from decodelab.decoding import compiled

    monkeypatch.setattr(compiled, "_CHOSEN", {"wrapper": None})  # restored after the test
    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "python")
    monkeypatch.setattr(harness, "instantiate_unwrapped", lambda spec: tiny_models["llama"])
    lm = harness.load_model(config("model=tiny-llama", "cpu_wrapper=cpp"))
    assert compiled.cpu_wrapper() == "cpp" and compiled.inductor_patches("cpu")["cpp_wrapper"] is True
    assert harness.run_conditions(lm)["cpu_wrapper"] == "cpp"
    harness.load_model(config("model=tiny-llama"))
    assert compiled.cpu_wrapper() == "python" and "cpp_wrapper" not in compiled.inductor_patches("cpu")
    with pytest.raises(SetupError, match=r"cpu_wrapper='cxx' names no wrapper"):
        compiled.use_cpu_wrapper("cxx")
    assert compiled.cpu_wrapper() == "python"  # a refused choice changes nothing


@pytest.mark.parametrize("name", ["config", "serve"])
def test_what_compiles_is_checked_with_the_runs_own_wrapper(name, tiny_models, monkeypatch):
    """The checks run before load_model applies cpu_wrapper: they take the run's option all the
    same (not $DECODELAB_CPU_WRAPPER, nor an earlier run's choice in this process), the
    environment's where the option is null, and leave the process's choice as it was."""
    from decodelab.decoding import compiled

    check = _entry_checks()[name]
    monkeypatch.setattr(compiled, "_CHOSEN", {"wrapper": None})  # restored after the test
    monkeypatch.setenv("DECODELAB_CPU_WRAPPER", "cxx")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        ours = compose(config_name=name, overrides=["model=tiny-llama", "compile=true", "cpu_wrapper=python"])
        env = compose(config_name=name, overrides=["model=tiny-llama", "compile=true"])
    check(ours)  # the option's python, though the environment names none
    compiled.use_cpu_wrapper("cpp")  # an earlier job's choice
    with pytest.raises(SetupError, match=r"DECODELAB_CPU_WRAPPER='cxx' names no wrapper"):
        check(env)  # null: the environment's, refused before anything loads
    assert compiled.cpu_wrapper() == "cpp"  # the earlier choice, restored


def test_threads_null_gives_torchs_default_back_after_an_earlier_run_set_its_own(tiny_models, monkeypatch):
    """Jobs of a multirun share the process: a job with threads=null runs with torch's default
    threads, not the count an earlier job set."""
    import torch

    monkeypatch.setattr(harness, "instantiate_unwrapped", lambda spec: tiny_models["llama"])
    monkeypatch.setattr(harness, "DEFAULT_THREADS", 2)
    before = torch.get_num_threads()
    try:
        harness.load_model(config("model=tiny-llama", "threads=1"))
        assert torch.get_num_threads() == 1
        harness.load_model(config("model=tiny-llama"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
