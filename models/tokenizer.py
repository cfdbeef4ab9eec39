"""The checkpoint's tokenizer (from transformers) with chat templates and EOS ids."""

from __future__ import annotations

from pathlib import Path

from decodelab.models.errors import SetupError


class Tokenizer:
    """Thin wrapper: `encode(text, chat=...)`, `decode(ids)`, `eos_ids`, `vocab()`."""

    def __init__(self, hf_tokenizer, model_eos_ids: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        ids = set(model_eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_ids: tuple[int, ...] = tuple(sorted(ids))

    @classmethod
    def from_dir(cls, path: str | Path, model_eos_ids: tuple[int, ...] = ()) -> "Tokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), model_eos_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of `text`; with `chat`, of a one-turn conversation ready for the reply."""
        if not chat:
            return list(self.hf.encode(text, add_special_tokens=True))
        if not self.has_chat_template:
            raise SetupError("this tokenizer has no chat template; use chat_template=false")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def vocab(self) -> dict[str, int]:
        """token string -> id; two tokenizers are interchangeable iff these are equal."""
        return self.hf.get_vocab()

    def __len__(self) -> int:
        return len(self.hf)
