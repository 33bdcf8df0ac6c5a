"""The engine's per-step fast paths compute the same attention as the general paths, and a step burst yields to worker jobs."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.ledger import eventually
from test_engine import ALICE, complete, engine, long_text, system, user  # noqa: F401 - engine is a fixture

from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.engine.model_runner import ModelRunner, StepChunk, _num_common_leading
from gpu_node.engine.paged_attention import RowIndex, row_view

BLOCK = 16


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(tiny_model_dir, block_size=BLOCK)


def fresh_table(runner: ModelRunner, num_blocks: int = 128) -> torch.Tensor:
    spec = runner.kv_spec
    return torch.zeros(
        (num_blocks, spec.num_layers, 2, spec.num_kv_heads, spec.block_size, spec.head_dim)
    )


def test_common_leading_blocks_are_the_longest_shared_prefix_up_to_the_cap():
    assert _num_common_leading([[1, 2, 3, 4], [1, 2, 9, 4]], max_blocks=3) == 2
    assert _num_common_leading([[1, 2, 3], [1, 2, 3], [1, 7, 3]], max_blocks=2) == 1
    assert (
        _num_common_leading([[1, 2, 3], [1, 2, 3]], max_blocks=2) == 2
    )  # the cap keeps each sequence's last block its own
    assert _num_common_leading([[5, 6], [6, 5]], max_blocks=1) == 0


def test_decodes_sharing_leading_blocks_equal_each_decode_alone(runner):
    """Three sequences on one 160-token prefix (10 shared blocks) and suffixes of different lengths."""
    table = fresh_table(runner)
    generator = torch.Generator().manual_seed(0)
    shared = list(range(1, 11))
    runner.execute(
        [
            StepChunk(
                torch.randint(10, 1000, (160,), generator=generator).tolist(), 0, shared, False
            )
        ],
        table,
    )
    decodes = []
    for index, num_suffix_tokens in enumerate((5, 17, 30)):
        block_table = shared + list(range(20 + 3 * index, 23 + 3 * index))
        suffix = torch.randint(10, 1000, (num_suffix_tokens,), generator=generator).tolist()
        runner.execute([StepChunk(suffix, 160, block_table, False)], table)
        decodes.append(StepChunk([7], 160 + num_suffix_tokens, block_table, True))
    batched = runner.execute(decodes, table)
    for row, chunk in enumerate(decodes):
        alone = runner.execute([chunk], table)[0]
        assert torch.allclose(batched[row], alone, atol=1e-4), f"decode {row} differs in a batch"
        assert int(batched[row].argmax()) == int(alone.argmax())


def test_lone_decode_equals_the_same_decode_in_a_padded_batch(runner):
    """The unmasked lone-decode path against the masked padded batch (distinct tables, different
    lengths)."""
    table = fresh_table(runner)
    generator = torch.Generator().manual_seed(1)
    chunks = []
    for index, num_tokens in enumerate((21, 50)):
        block_table = list(range(1 + 4 * index, 5 + 4 * index))
        runner.execute(
            [
                StepChunk(
                    torch.randint(10, 1000, (num_tokens,), generator=generator).tolist(),
                    0,
                    block_table,
                    False,
                )
            ],
            table,
        )
        chunks.append(StepChunk([9], num_tokens, block_table, True))
    batched = runner.execute(chunks, table)
    for row, chunk in enumerate(chunks):
        assert torch.allclose(batched[row], runner.execute([chunk], table)[0], atol=1e-4)


async def test_a_worker_job_runs_between_steps_while_requests_decode(engine: AsyncEngine):  # noqa: F811 - the fixture
    """Steps run back to back on the worker, but a queued job (snapshot, sweep, command) does not wait for the batch to drain."""
    prompts = [[system(), user(long_text(20, offset))] for offset in range(4)]
    streams = [
        asyncio.ensure_future(complete(engine, prompt, ALICE, max_tokens=200)) for prompt in prompts
    ]
    await eventually(
        lambda: bool(engine.scheduler.running), timeout_s=30, what="requests running", poll_s=0.001
    )
    still_decoding = await asyncio.wait_for(
        engine.run_exclusive(lambda: bool(engine.scheduler.running)), 30
    )
    completions = await asyncio.gather(*streams)
    assert still_decoding, "the job waited until every request had finished"
    assert all(completion.token_ids for completion in completions)


def test_row_index_names_each_tokens_key_and_value_in_every_layer(runner):
    """The rows of (block table, position) are the table's own [slot, layer, k/v, head, offset]
    elements."""
    table = torch.randn(12, *fresh_table(runner, 1).shape[1:])
    rows = RowIndex(table)
    block_table = torch.tensor([[7, 2, 11], [3, 0, 5]])
    num_tokens = 2 * BLOCK + 5
    indices = rows.context_rows(
        block_table, num_tokens
    )  # [layers, 2 sequences, 2, kv_heads, tokens]
    gathered = row_view(table)[indices]
    _, num_layers, _, num_kv_heads, _, _ = table.shape
    for layer in range(num_layers):
        for seq in range(2):
            for position in (0, BLOCK - 1, BLOCK, num_tokens - 1):
                slot = int(block_table[seq, position // BLOCK])
                for kv in range(2):
                    for head in range(num_kv_heads):
                        expected = table[slot, layer, kv, head, position % BLOCK]
                        assert torch.equal(gathered[layer, seq, kv, head, position], expected)
    assert rows.fits(torch.zeros(99, *table.shape[1:])) and not rows.fits(
        torch.zeros(12, 3, *table.shape[2:])
    )
