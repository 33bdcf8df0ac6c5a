"""The continuous-batching scheduler on its own: which sequences compute how many tokens each step."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpu_node.engine.scheduler import Scheduler, SchedulerOutput, Sequence, SequenceStatus
from gpu_node.settings import NodeSettings, SchedulerSettings

BLOCK = 4


class CountingAllocator:
    """Device blocks as a counter; ``prefix_tokens`` plays a cached prefix found at admission."""

    def __init__(self, num_blocks: int) -> None:
        self.num_free = num_blocks
        self.prefix_tokens: dict[str, int] = {}
        self.freed: list[str] = []

    def prepare_prefix(self, seq: Sequence) -> None:
        num_cached = self.prefix_tokens.get(seq.seq_id, 0)
        assert self.allocate(seq, num_cached)
        seq.num_computed_tokens = num_cached

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        num_needed = -(-num_tokens // BLOCK) - len(seq.block_table)
        if num_needed > self.num_free:
            return False
        if num_needed > 0:
            self.num_free -= num_needed
            seq.block_table.extend([0] * num_needed)
        return True

    def free(self, seq: Sequence) -> None:
        self.num_free += len(seq.block_table)
        seq.block_table.clear()
        self.freed.append(seq.seq_id)


def new_seq(seq_id: str, num_prompt_tokens: int) -> Sequence:
    return Sequence(seq_id, list(range(num_prompt_tokens)), num_prompt_tokens, needs_prefix=True)


def plan(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(chunk.seq.seq_id, chunk.start, chunk.num_tokens) for chunk in output.chunks]


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule and advance one step; every sampling chunk samples token 7."""
    output = scheduler.schedule()
    scheduler.advance(output, {chunk.seq.seq_id: 7 for chunk in output.chunks if chunk.samples})
    return output


def test_decodes_first_then_prefill_chunks_under_the_token_budget():
    scheduler = Scheduler(CountingAllocator(100), max_num_batched_tokens=8, max_num_seqs=4)
    a, b = new_seq("a", 3), new_seq("b", 2)
    scheduler.add(a)
    scheduler.add(b)
    assert plan(run_step(scheduler)) == [("a", 0, 3), ("b", 0, 2)]
    assert (a.num_tokens, b.num_tokens) == (4, 3)  # each sampled its first token
    long = new_seq("long", 20)
    scheduler.add(long)
    # every step: one decode token per running request first, the long prompt in chunks of what is
    # left
    assert plan(run_step(scheduler)) == [("a", 3, 1), ("b", 2, 1), ("long", 0, 6)]
    assert plan(run_step(scheduler)) == [("a", 4, 1), ("b", 3, 1), ("long", 6, 6)]
    assert plan(run_step(scheduler)) == [("a", 5, 1), ("b", 4, 1), ("long", 12, 6)]
    last = run_step(scheduler)
    assert plan(last) == [("a", 6, 1), ("b", 5, 1), ("long", 18, 2)]
    assert [chunk.samples for chunk in last.chunks] == [True, True, True]
    assert long.num_tokens == 21 and long.num_computed_tokens == 20
    assert plan(run_step(scheduler)) == [("a", 7, 1), ("b", 6, 1), ("long", 20, 1)]


def test_waiting_requests_join_in_arrival_order_up_to_max_num_seqs():
    scheduler = Scheduler(CountingAllocator(100), max_num_batched_tokens=64, max_num_seqs=2)
    for name in ("first", "second", "third"):
        scheduler.add(new_seq(name, 5))
    assert plan(run_step(scheduler)) == [("first", 0, 5), ("second", 0, 5)]
    assert [seq.seq_id for seq in scheduler.waiting] == ["third"]
    scheduler.finish([scheduler.running[0]])
    assert plan(run_step(scheduler)) == [("second", 5, 1), ("third", 0, 5)]


def test_a_cached_prefix_is_not_recomputed():
    allocator = CountingAllocator(100)
    scheduler = Scheduler(allocator, max_num_batched_tokens=64, max_num_seqs=4)
    seq = new_seq("hit", 13)
    allocator.prefix_tokens["hit"] = 12
    scheduler.add(seq)
    assert plan(run_step(scheduler)) == [("hit", 12, 1)]


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_first():
    allocator = CountingAllocator(4)  # 16 tokens of KV
    scheduler = Scheduler(allocator, max_num_batched_tokens=64, max_num_seqs=4)
    old, new = new_seq("old", 7), new_seq("new", 8)
    scheduler.add(old)
    scheduler.add(new)
    assert plan(run_step(scheduler)) == [
        ("old", 0, 7),
        ("new", 0, 8),
    ]  # 2 + 2 blocks: the device is full
    # old's 8th token fits its 2nd block; new's 9th token needs a 5th block: new (the newest) is
    # preempted
    step = run_step(scheduler)
    assert plan(step) == [("old", 7, 1)]
    assert [seq.seq_id for seq in step.preempted] == ["new"]
    assert (
        new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.needs_prefix
    )
    assert (
        new.num_tokens == 9 and new.num_preemptions == 1
    )  # its sampled token is kept for the recompute
    assert allocator.freed == ["new"]
    # old's 9th token needs a 3rd block (the last free one); new, first in line, needs 3 and waits
    assert plan(run_step(scheduler)) == [("old", 8, 1)]
    assert [seq.seq_id for seq in scheduler.waiting] == ["new"] and allocator.num_free == 1
    scheduler.finish([old])
    assert allocator.num_free == 4
    assert plan(run_step(scheduler)) == [("new", 0, 9)]
    assert new.num_tokens == 10 and scheduler.num_preemptions == 1


def test_preempting_a_sequence_already_scheduled_this_step_takes_its_chunk_back():
    allocator = CountingAllocator(3)
    scheduler = Scheduler(allocator, max_num_batched_tokens=64, max_num_seqs=4)
    old = Sequence("old", list(range(12)), 12, num_computed_tokens=8, status=SequenceStatus.RUNNING)
    new = Sequence("new", [1, 2], 1, num_computed_tokens=1, status=SequenceStatus.RUNNING)
    assert allocator.allocate(old, 8) and allocator.allocate(new, 1)
    scheduler.running = [old, new]
    # new's decode is scheduled first (it fits its block); old's prompt chunk needs a 3rd block:
    # none is free, so the newest running sequence — new, already in this step — is preempted and
    # its chunk taken back
    step = scheduler.schedule()
    assert plan(step) == [("old", 8, 4)]
    assert [seq.seq_id for seq in step.preempted] == ["new"]
    assert step.num_batched_tokens == 4
    assert scheduler.running == [old] and list(scheduler.waiting) == [new]


def test_abort_frees_blocks_at_once_whether_running_or_waiting():
    allocator = CountingAllocator(10)
    scheduler = Scheduler(allocator, max_num_batched_tokens=8, max_num_seqs=1)
    running, waiting = new_seq("running", 8), new_seq("waiting", 4)
    scheduler.add(running)
    scheduler.add(waiting)
    assert plan(run_step(scheduler)) == [("running", 0, 8)]
    assert allocator.num_free == 8
    scheduler.finish([running, waiting])
    scheduler.finish([running])  # idempotent
    assert allocator.num_free == 10
    assert allocator.freed == ["running", "waiting"]
    assert running.status is waiting.status is SequenceStatus.FINISHED
    assert not scheduler.has_work and scheduler.schedule().is_empty


def test_limits_must_fit_every_decode():
    with pytest.raises(ValueError):
        Scheduler(CountingAllocator(1), max_num_batched_tokens=4, max_num_seqs=8)


def test_scheduler_settings_come_from_the_nested_environment(monkeypatch):
    monkeypatch.setenv("KVLEDGER_NODE_SCHEDULER__MAX_NUM_BATCHED_TOKENS", "256")
    monkeypatch.setenv("KVLEDGER_NODE_SCHEDULER__MAX_NUM_SEQS", "16")
    assert NodeSettings().scheduler == SchedulerSettings(
        max_num_batched_tokens=256, max_num_seqs=16
    )
    monkeypatch.setenv("KVLEDGER_NODE_SCHEDULER__MAX_NUM_SEQS", "512")
    with pytest.raises(
        ValidationError, match="max_num_seqs must not exceed max_num_batched_tokens"
    ):
        NodeSettings()


def test_only_the_head_of_the_queue_holds_blocks_while_waiting():
    allocator = CountingAllocator(4)
    scheduler = Scheduler(allocator, max_num_batched_tokens=64, max_num_seqs=4)
    running = new_seq("running", 8)
    scheduler.add(running)
    assert plan(run_step(scheduler)) == [("running", 0, 8)]
    head = new_seq("head", 6)
    allocator.prefix_tokens["head"] = 4  # its matched prefix holds one block while it waits
    scheduler.add(head)
    assert plan(run_step(scheduler)) == [
        ("running", 8, 1)
    ]  # running took a 3rd block; head (2 blocks) does not fit
    assert head.block_table == [0] and allocator.num_free == 0
    # running needs a 4th block... none is free: it is preempted itself, goes in front of head, and
    # head lets go
    running.token_ids.extend([7] * 3)
    step = scheduler.schedule()
    assert [seq.seq_id for seq in step.preempted] == ["running"]
    assert [seq.seq_id for seq in scheduler.waiting] == ["running", "head"]
    assert head.block_table == [] and head.needs_prefix and allocator.num_free == 4
