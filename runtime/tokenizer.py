"""Text <-> token ids and chat formatting, from the tokenizer files inside an artifact."""

from __future__ import annotations

from pathlib import Path

import transformers

from mlc_spec.errors import UserError


class Tokenizer:
    def __init__(self, artifact_dir: str | Path):
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(str(artifact_dir))
        except (OSError, ValueError) as err:
            raise UserError(f"cannot load the tokenizer of {artifact_dir}: {err}") from None

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not self._tok.chat_template:
            raise UserError("this model's tokenizer has no chat template; use generate()")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already wrote any special tokens (BOS, role markers) as text.
        return self._tok.encode(text, add_special_tokens=False)
