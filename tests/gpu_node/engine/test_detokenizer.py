"""Incremental detokenization on the tiny model's tokenizer: same text as a full decode, stop strings, held-back UTF-8."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from gpu_node.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def test_deltas_concatenate_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        detokenizer = IncrementalDetokenizer(tokenizer)
        text = "".join(detokenizer.push(token_id)[0] for token_id in token_ids)
        full = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert text == detokenizer.text
        assert full.startswith(text) and (text == full or full.endswith("\ufffd"))


def test_stop_string_across_tokens_cuts_the_text_before_it(tokenizer):
    token_ids = tokenizer.encode(
        "the handbook says each tenant keeps its own cache", add_special_tokens=False
    )
    detokenizer = IncrementalDetokenizer(tokenizer, ("ten" + "ant keeps",))
    for token_id in token_ids:
        _, stopped = detokenizer.push(token_id)
        if stopped:
            break
    assert stopped and detokenizer.text == "the handbook says each "


def test_a_possible_stop_prefix_is_held_back_and_flushed_when_no_stop_follows(tokenizer):
    token_ids = tokenizer.encode("the handbook says each tenant", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, ("tenant keeps",))
    deltas = [detokenizer.push(token_id) for token_id in token_ids]
    assert not any(stopped for _, stopped in deltas)
    assert "".join(delta for delta, _ in deltas) == "the handbook says each "
    assert detokenizer.flush() == "tenant"
    assert detokenizer.text == "the handbook says each tenant"


def test_incomplete_utf8_is_held_back_until_complete(tokenizer):
    token_ids = tokenizer.encode("café ☕ ok", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(token_id)[0] for token_id in token_ids]
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert all("\ufffd" not in delta for delta in deltas)
