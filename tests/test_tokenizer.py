"""The runtime's tokenizer (``tokenizers`` and jinja2) against transformers' reading of the same
files: the same ids for a text, the same text for ids, the same chat prompts. And the runtime
keeps transformers and torch out of its process, which is what it is built that way for."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers

from mlc_spec.errors import UserError
from mlc_spec.runtime.tokenizer import Tokenizer

TEXTS = [
    "",
    " Hello, 世界! 😀👍🏽 naïve café — ünïcödé\n\tdef f(x):\n        return x  # 日本語のテキスト",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "   leading and trailing spaces   \n\n\n",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>\n<|endoftext|>",
    "don't, we'll; I'm <b>bold</b> &amp; 🇫🇷",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that reverses a string."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 😀"}],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And <b>3 + 3</b>?"},
    ],
    [{"role": "user", "content": "an <|im_end|> in the text", "name": None}],
]
SHIPPED = [
    "smollm2_tokenizer_dir",
    pytest.param("qwen_tokenizer_dir", marks=pytest.mark.qwen),
]


@pytest.fixture(params=SHIPPED)
def both(request) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    path = request.getfixturevalue(request.param)
    return Tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def test_encode_decode_and_vocabulary_match_transformers(both):
    ours, theirs = both
    assert ours.vocab == theirs.get_vocab()
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    special = [i for i, t in theirs.added_tokens_decoder.items() if t.special]
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, len(theirs), 24).tolist()
        ids[rng.integers(0, 24)] = int(rng.choice(special))
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids


def test_chat_prompts_match_transformers(both):
    ours, theirs = both
    for messages in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(messages) == text
        assert ours.apply_chat_template(messages) == theirs.encode(text, add_special_tokens=False)


# Reads special tokens and tools, escapes with tojson, stops a loop with break, raises.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tool messages here') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | tojson }}\n"
    "{% if loop.index == 2 %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    "{% if tools is none and documents is none %}{{ eos_token }}{% endif %}"
)


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A word-level tokenizer whose chat template uses what transformers gives templates."""
    words = ["<unk>", "<s>", "</s>", "user", "assistant", "system", "hi", "there"]
    tok = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("templated_tok")
    fast.save_pretrained(out)
    return out


def test_template_helpers_match_transformers(templated):
    ours, theirs = Tokenizer(templated), transformers.AutoTokenizer.from_pretrained(templated)
    conversations = CONVERSATIONS + [[{"role": "user", "content": {"nested": ["<é>", 1]}}]]
    for messages in conversations:
        text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(messages) == text
    with pytest.raises(UserError, match="no tool messages here"):
        ours.apply_chat_template([{"role": "tool", "content": "{}"}])


def test_template_sources_and_errors(templated, tmp_path):
    """The template is read from the config where no chat_template.jinja is (also as a list
    of named templates); a missing or broken one fails chat with a clear error, not loading;
    a broken tokenizer.json fails loading with one."""
    messages = [{"role": "user", "content": "hi"}]
    config = json.loads((templated / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer.json").write_bytes((templated / "tokenizer.json").read_bytes())
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}]
    for template in (TEMPLATE, named):
        config["chat_template"] = template
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        assert Tokenizer(tmp_path).render_chat(messages) == Tokenizer(templated).render_chat(
            messages
        )
    for template, error in [(None, "no chat template"), ("{% for %}", "does not parse")]:
        config["chat_template"] = template
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizer = Tokenizer(tmp_path)
        assert tokenizer.encode("hi there") == [6, 7]  # generating from text still works
        with pytest.raises(UserError, match=error):
            tokenizer.apply_chat_template(messages)
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(UserError, match="cannot load the tokenizer"):
        Tokenizer(tmp_path)


def test_runtime_process_imports_neither_torch_nor_transformers(tiny_llama, tiny_llama_draft):
    """An LLM with a draft model loads, generates and chats without importing torch (which
    TVM's FFI would import) or transformers; torch still imports and works afterwards, and so
    does the engine."""
    script = textwrap.dedent(
        f"""
        import sys
        from mlc_spec import LLM, SamplingParams

        llm = LLM({str(tiny_llama.artifact)!r}, draft_model={str(tiny_llama_draft.artifact)!r})
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        first = llm.chat([{{"role": "user", "content": "w5 w9"}}], params)[0]
        print(sorted({{"torch", "transformers"}} & set(sys.modules)))
        import torch

        assert torch.ones(3).sum().item() == 3
        again = llm.chat([{{"role": "user", "content": "w5 w9"}}], params)[0]
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
