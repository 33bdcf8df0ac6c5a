"""Continuous-batching scheduler: which sequences compute how many tokens in the next model step.

Pure bookkeeping (no torch): requests join and leave the running batch at step
boundaries. Each step carries one decode token for every running sequence that
has finished its prompt, then prefill chunks of running sequences still inside
their prompt, then prefill chunks of waiting sequences in arrival order (FCFS),
all under ``max_num_batched_tokens`` and ``max_num_seqs``. Decodes go first, so
a long prompt delays them by at most one chunk, never by its whole prefill.

KV memory is the allocator's business (``gpu_node.engine.paged_kv``): the scheduler
asks it to cover a sequence's next tokens with device blocks. When it cannot,
the newest running sequence is preempted: its blocks are freed and it goes back
to the front of the waiting queue to be recomputed (its generated tokens are
kept, so recomputation continues where it stopped). A request is never failed
for lack of blocks while an older one holds them. Waiting sequences may hold
blocks (the hits referenced when their request was admitted, the head's matched
prefix); when nothing runs and the head cannot start, the others let go.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and progress. ``token_ids`` is the prompt followed by the generated tokens.

    ``num_computed_tokens`` have their KV in the sequence's blocks; the next
    step computes from there. ``block_table[i]`` is the device slot holding
    tokens ``i * block_size ..``. ``needs_prefix`` is set when the sequence
    (re)enters the waiting queue without blocks: the allocator matches its
    cached prefix again before it is scheduled.
    """

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    needs_prefix: bool = False
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


class BlockAllocator(Protocol):
    """Device KV memory as the scheduler sees it (implemented over the block pool by
    ``gpu_node.engine.paged_kv``)."""

    def prepare_prefix(self, seq: Sequence) -> None:
        """Make the sequence's cached prefix resident on the device and set ``num_computed_tokens`` to it."""

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend ``seq.block_table`` to cover its first ``num_tokens`` tokens; False (nothing taken) when out of blocks."""

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` and empty its block table."""


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` from ``start`` are computed this step; ``samples``: the step
    yields its next token."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step: chunks in batch order (decodes first), and the sequences preempted to make room."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self, allocator: BlockAllocator, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
        self.allocator = allocator
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[
            Sequence
        ] = []  # arrival order: the last one is the newest, preempted first
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table, (
            "a new sequence waits and holds no blocks"
        )
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        decoding = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        prefilling = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        for seq in itertools.chain(decoding, prefilling):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted by an earlier sequence of this step, or no budget left for chunks
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.allocator.allocate(seq, seq.num_computed_tokens + num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                for index, chunk in enumerate(chunks):
                    if (
                        chunk.seq is victim
                    ):  # scheduled earlier in this step (decodes go before chunks)
                        budget += chunk.num_tokens
                        del chunks[index]
                        break
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chunks.append(ScheduledChunk.of(seq, num_tokens))
                budget -= num_tokens
        # No admission in a step that had to preempt: memory is short, and the preempted go first
        # next time.
        while (
            self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.needs_prefix:
                self.allocator.prepare_prefix(seq)
                seq.needs_prefix = False
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self.allocator.allocate(seq, seq.num_computed_tokens + num_tokens):
                if self.running or len(self.waiting) == 1:
                    break
                # Nothing runs, so only waiting sequences hold blocks (hits referenced at request
                # admission): they let go and match again later, so the head can always start.
                for other in list(self.waiting)[1:]:
                    self._release(other)
                if not self.allocator.allocate(seq, seq.num_computed_tokens + num_tokens):
                    break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk.of(seq, num_tokens))
            budget -= num_tokens
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.waiting and self.waiting[0].block_table:
            # Only the head of the queue may hold blocks (its matched prefix) while it waits: the
            # head can then always be admitted once the running sequences are gone.
            self._release(self.waiting[0])
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Free a sequence's blocks and make it match its prefix again when next admitted."""
        self.allocator.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.needs_prefix = True

    def advance(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Record a finished step: chunks' tokens are computed; ``sampled`` appends each sampling
        chunk's token.

        A chunk whose sequence left the scheduler during the step (aborted) is skipped.
        """
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            assert seq.num_computed_tokens == chunk.start, (
                "a sequence advances only by the chunk scheduled for it"
            )
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                seq.token_ids.append(sampled[seq.seq_id])

    def finish(self, seqs: Iterable[Sequence]) -> None:
        """Remove finished or aborted sequences (running or waiting) and free their blocks at once.
        Idempotent."""
        for seq in seqs:
            if seq.status is SequenceStatus.FINISHED:
                continue
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self.allocator.free(seq)
            seq.status = SequenceStatus.FINISHED
