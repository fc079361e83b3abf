"""The real pair: Qwen2.5-Coder-0.5B-Instruct drafting for the 1.5B-Instruct on code.

Tiny and truncated drafts prove losslessness but say little about acceptance; a same-family draft
on code should agree with its target most of the time, or speculation cannot pay off.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mlc_spec import LLM, SamplingParams

pytestmark = pytest.mark.qwen

SCRIPT = Path(__file__).parents[1] / "scripts" / "prepare_qwen_pair.py"
# HumanEval-style: a signature and a docstring with doctests, completed as raw text.
PROMPTS = [
    'def is_palindrome(text: str) -> bool:\n    """ Return True if text reads the same '
    "backwards.\n    >>> is_palindrome('level')\n    True\n    >>> is_palindrome('abc')\n"
    '    False\n    """\n',
    "from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n"
    '    """ Return the largest element seen so far at each position.\n'
    '    >>> running_max([1, 3, 2, 5, 4])\n    [1, 3, 3, 5, 5]\n    """\n',
]
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=False)
SIZE = {"max_batch_size": 1, "max_total_len": 4096}


@pytest.fixture(scope="module")
def qwen_pair() -> tuple[Path, Path]:
    """(draft, target) artifacts, compiled on first use by the same code as the script."""
    spec = importlib.util.spec_from_file_location("prepare_qwen_pair", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.prepare_pair(show_progress=False)


def test_draft_is_lossless_and_mostly_accepted_on_code(qwen_pair):
    draft, target = qwen_pair
    reference = [o.outputs[0].token_ids for o in LLM(target, **SIZE).generate(PROMPTS, PARAMS)]
    spec = {"method": "draft", "num_speculative_tokens": 4}
    llm = LLM(target, draft_model=draft, speculative=spec, **SIZE)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
    assert llm.metrics()["acceptance_rate"] > 0.5
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages
