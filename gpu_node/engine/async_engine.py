"""The asyncio engine: requests in, streamed tokens out, run as one continuously batched model.

``generate`` renders the prompt, looks its prefix up under the caller's scope
(:class:`KVCacheManager`: scoped keys, tombstones, versions, singleflight) and
hands the request to the step loop. The step loop is one asyncio task that runs
each engine step as one job on the model worker thread:

1. take new and aborted requests from the inbox;
2. :class:`~gpu_node.engine.scheduler.Scheduler` picks one decode token per running
   request plus prefill chunks of waiting ones under the token budget,
   preempting the newest request when device blocks run out;
3. one model forward over all of them, KV read and written in place in the
   pool's device tier (:mod:`gpu_node.engine.paged_kv`, :mod:`gpu_node.engine.paged_attention`);
4. one batched sampling call, incremental detokenization, stop checks, commits
   of finished prefix blocks, and per-request outputs back to the loop.

Other pool work that must not interleave with a step (snapshots, TTL sweeps,
disk re-index) is queued on the same worker between steps. A request whose
client goes away is aborted at the next step boundary: its slot and blocks are
freed at once. The cache is an optimisation, never a reason to fail: a hit that
cannot be used (tombstoned, corrupt, no device room) is recomputed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from events.schema import subject_digest
from gpu_node.cache.kv_cache_manager import KVCacheManager, PrefixPlan
from gpu_node.cache.kv_memory import TierPlan, measure_available, plan_tiers
from gpu_node.cache.layout_sampler import layout_sampler
from gpu_node.cache.namespace import NamespaceIdentity, compute_namespace
from gpu_node.cache.peers import PeerKeys, PeerPuller, PullFailed, PullHint, open_pulled
from gpu_node.engine.detokenizer import IncrementalDetokenizer
from gpu_node.engine.model_runner import ModelRunner, StepChunk, intra_op_threads
from gpu_node.engine.paged_kv import PagedKV
from gpu_node.engine.sampling import SamplingState, make_sampling_state, sample_batch
from gpu_node.engine.scheduler import Scheduler, SchedulerOutput, Sequence
from gpu_node.keys.crypto import until_key_service_answers
from gpu_node.keys.node_identity import node_signing_key
from gpu_node.keys.remote_keys import data_key_provider
from gpu_node.metrics import MissReason, NodeMetrics
from gpu_node.pool import snapshots
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.vocabulary import CacheEntry, PoolConfig, ReplicaSource
from gpu_node.settings import NodeSettings
from identity.node_credentials import issue_node_credential
from prefix_keys.blocks import BlockKey, CacheScope, Principal, compute_block_keys
from prefix_keys.prompt import ChatMessage, render_prompt
from prefix_keys.versions import VersionRegistry

log = logging.getLogger(__name__)

_EXPIRY_SWEEP_INTERVAL_S = 5.0
_GAUGE_REFRESH_S = 0.05
_STALL_RETRY_S = 0.5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end generation like end of sequence does (vLLM's ``stop_token_ids``); not part of
    the output."""
    min_tokens: int = 0
    """No stop (end of sequence, stop token or stop string) before this many generated tokens (vLLM's ``min_tokens``)."""
    ignore_eos: bool = False
    """Generate past the model's end-of-sequence tokens (they then count as output), up to
    ``max_tokens``."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    principal: Principal
    use_cache: bool = True
    pull_hint: PullHint | None = None
    """A peer said to hold this prefix (``gpu_node.cache.peers``): missing blocks it holds are pulled, not computed."""


@dataclass(frozen=True, slots=True)
class PromptStats:
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_id: int
    text: str
    num_completion_tokens: int
    """The request's completion tokens so far, this one included when it counts (an end-of-sequence
    token does not)."""


@dataclass(frozen=True, slots=True)
class GenerationDone:
    finish_reason: str
    num_completion_tokens: int


class PromptTooLongError(ValueError):
    def __init__(self, num_prompt_tokens: int, max_context_tokens: int) -> None:
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens; this model's context is {max_context_tokens} tokens "
            f"(prompt plus at least one generated token)"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_context_tokens = max_context_tokens


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One engine step as the model worker timed it (:attr:`AsyncEngine.step_sink`)."""

    num_seqs: int
    """Sequences in the step's batch (decodes and prefill chunks)."""
    num_tokens: int
    forward_s: float
    """The model forward alone (:meth:`ModelRunner.forward`)."""
    overhead_s: float
    """The rest of the step on the worker: inbox, scheduling, step tensors, sampling, detokenizing,
    hand-off to the loop."""
    overhead_cpu_s: float
    """The worker thread's CPU time in that rest: ``overhead_s`` less waits (for the interpreter lock, for a core)."""


class GenerationError(RuntimeError):
    """The model step carrying a request failed; the request ends with this error."""


_SEQ_IDS = itertools.count()


@dataclass(eq=False)
class _Request:
    """One request in the engine: its sequence plus what its stream needs.

    Outputs go to ``outbox`` on the loop; ``wake`` is set while the stream waits
    for them. A plain deque and one future per wait instead of an
    ``asyncio.Queue``: a step hands every stream its items with one call on the
    loop, and a stream that fell behind takes all of its items in one wake-up.
    """

    seq: Sequence
    plan: PrefixPlan
    sampling: SamplingState
    max_new_tokens: int
    detokenizer: IncrementalDetokenizer
    arrived: float
    outbox: deque = field(default_factory=deque)
    wake: asyncio.Future | None = None
    num_completion_tokens: int = 0
    started_output: bool = False
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    finished: bool = False


class AsyncEngine:
    def __init__(
        self,
        runner: ModelRunner,
        namespace: NamespaceIdentity,
        pool: BlockPool,
        settings: NodeSettings,
        metrics: NodeMetrics,
    ) -> None:
        self.runner = runner
        self.namespace = namespace
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.block_size = runner.kv_spec.block_size
        self.model_name = settings.model_name or runner.model_dir.name
        self.max_context_tokens = runner.max_context_tokens
        # A sequence must fit the device tier alone, or preemption could not make it progress: on a
        # node whose device tier holds fewer tokens than the model's context, this is the node's
        # context length.
        self.max_sequence_tokens = min(
            self.max_context_tokens, pool.config.num_device_blocks * self.block_size
        )
        self.manager = KVCacheManager(pool, metrics, settings.cache.singleflight_wait_s)
        self.paged_kv = PagedKV(pool, self.manager, metrics)
        self.scheduler = Scheduler(
            self.paged_kv,
            settings.scheduler.max_num_batched_tokens,
            settings.scheduler.max_num_seqs,
        )
        self.snapshot_sink: Callable[[str, tuple[bytes, ...]], None] | None = None
        self.step_sink: Callable[[StepTiming], None] | None = None
        """Called on the model worker with every step's :class:`StepTiming` (benchmarks); must be quick."""
        self.versions = VersionRegistry()
        self.peer_puller: PeerPuller | None = None
        """Pulls claimed blocks from peers (``peers.urls`` set); None: this node never pulls."""
        self.peer_keys: PeerKeys | None = None
        """The coordinator's node registry as a holder checks pullers against it; None: this node serves no pulls."""
        self.ready = False
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvledger-model")
        # Rendering and tokenizing a prompt is CPU work proportional to the request: on the
        # event loop a huge request would stall health checks, commands and heartbeats, and on
        # the model worker it would stall every other request's decode steps. One thread also
        # bounds how many huge requests are parsed at once.
        self._prompt_worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvledger-prompt"
        )
        self._num_snapshot_writes = 0
        self._sweeper: asyncio.Task | None = None
        self._stepper: asyncio.Task | None = None
        # Filled on the loop, drained by the worker at the start of each step (deque appends/pops
        # are atomic).
        self._inbox: deque[tuple[str, _Request]] = deque()
        self._requests: dict[str, _Request] = {}  # worker thread only
        # Worker jobs queued by _run and not yet started (deque appends/pops are atomic): a burst of
        # steps returns the worker to them at the next step boundary.
        self._jobs_waiting: deque = deque()
        self._gauges_refreshed_at = 0.0
        self._work = asyncio.Event()
        # Set by a step (worker) that could schedule nothing because the device tier is referenced
        # by requests not yet in the inbox; read by the step loop between bursts. See _step.
        self._stalled = False
        # The last step's forward (worker only): set by _execute, read and cleared by _step_burst;
        # its overhead_cpu_s holds the forward's CPU time on this thread until then.
        self._last_timing: StepTiming | None = None
        self.metrics.kv_blocks_total.set(pool.config.num_device_blocks)

    @classmethod
    def from_settings(cls, settings: NodeSettings) -> AsyncEngine:
        runner = ModelRunner(
            settings.model_dir, settings.device, settings.dtype, settings.cache.block_size
        )
        namespace = compute_namespace(
            settings.model_dir, runner.kv_spec.kv_format, runner.attn_implementation
        )
        data_dir = Path(settings.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        cache = settings.cache
        # Measured now that the weights are loaded: the device tier takes a share of what they left.
        tiers = plan_tiers(
            cache,
            runner.kv_spec,
            measure_available(settings.device),
            torch.device(settings.device).type,
        )
        log.info("%s", tiers.describe(runner.max_context_tokens))
        config = PoolConfig(
            namespace=namespace.namespace,
            num_device_blocks=tiers.num_device_blocks,
            num_host_blocks=tiers.num_host_blocks,
            max_disk_blocks=tiers.max_disk_blocks,
            disk_dir=data_dir / "blocks",
            ttl_s={
                CacheScope.PUBLIC: cache.ttl_public_s,
                CacheScope.TENANT: cache.ttl_tenant_s,
                CacheScope.USER: cache.ttl_user_s,
            },
            device=settings.device,
        )
        pool = BlockPool(runner.kv_spec, config, data_key_provider(settings, data_dir))
        engine = cls(runner, namespace, pool, settings, NodeMetrics())
        if settings.peers.urls:
            engine.peer_puller = PeerPuller(
                settings.node_id, node_signing_key(settings), settings.peers
            )
        if settings.coordinator_url is not None:
            node_key, node_id = node_signing_key(settings), settings.node_id
            engine.peer_keys = PeerKeys(
                settings.coordinator_url,
                lambda: issue_node_credential(node_key, node_id),
                settings.peers.key_cache_s,
                settings.data_keys.timeout_s,
            )
        return engine

    @property
    def tier_plan(self) -> TierPlan:
        """The pool's capacities as blocks, tokens and bytes."""
        config = self.pool.config
        spec = self.runner.kv_spec
        return TierPlan(
            config.num_device_blocks,
            config.num_host_blocks,
            config.max_disk_blocks,
            spec.block_size,
            spec.block_bytes,
        )

    async def start(self, *, ready: bool = True) -> None:
        """Re-index the disk tier and warm from a snapshot, then report ready.

        ``ready=False`` when the node must first replay ``kvledger.commands``:
        the command consumer sets ``ready`` once it has (docs/design.md §6), since the
        disk tier and snapshot just loaded may hold blocks invalidated meanwhile.
        The re-index waits for the key service to answer for sealed block files
        rather than delete files whose keys it cannot ask for now.
        """
        await until_key_service_answers(
            lambda: self._run(self.pool.load_disk_tier), "disk tier re-index"
        )
        if self.settings.warm_from is not None:
            num_loaded = await self._run(
                snapshots.load_snapshot, self.pool, Path(self.settings.warm_from)
            )
            log.info("warm start: %d blocks loaded from snapshot", num_loaded)
        self.manager.drain_events()
        self._refresh_tier_gauges()
        self._sweeper = asyncio.create_task(self._sweep_expired())
        self._stepper = asyncio.create_task(self._step_loop(), name="kvledger-steps")
        self.ready = ready

    async def stop(self) -> None:
        self.ready = False
        for task in (self._sweeper, self._stepper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._stepper is not None:
            deliveries, woken = await self._run(
                self._fail_all, GenerationError("the node is shutting down")
            )
            self._after_step(deliveries, woken, 0, 0)
        self._worker.shutdown(wait=True)
        self._prompt_worker.shutdown(wait=True)
        if self.peer_keys is not None:
            await self.peer_keys.aclose()

    async def _run(self, function, *args):
        """Queue ``function`` on the model worker; a burst of steps running there yields to it at the next step boundary."""
        self._jobs_waiting.append(function)
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, self._job, function, *args
        )

    def _job(self, function, *args):
        self._jobs_waiting.popleft()
        return function(*args)

    async def run_exclusive(self, function, *args):
        """Run blocking ``function`` on the model worker, between engine steps.

        For node work that must not interleave with a snapshot write: removing
        invalidated blocks from snapshots runs here, so a snapshot being written
        when a command arrives is complete (manifest written) before it is scanned.
        """
        return await self._run(function, *args)

    async def _sweep_expired(self) -> None:
        """TTL deletes bytes even for blocks nobody asks for again."""
        while True:
            await asyncio.sleep(_EXPIRY_SWEEP_INTERVAL_S)
            num_expired = await self._run(self.pool.expire)
            if num_expired:
                self.metrics.expirations.inc(num_expired)
                self.manager.drain_events()
                self._refresh_tier_gauges()

    def _refresh_tier_gauges(self) -> None:
        stats = self.pool.stats()
        for tier, num_entries in stats.num_entries.items():
            self.metrics.tier_entries.labels(tier.value).set(num_entries)
        for tier, num_bytes in stats.tier_bytes.items():
            self.metrics.tier_bytes.labels(tier.value).set(num_bytes)
        num_used, num_total = self.pool.device_usage()
        self.metrics.kv_blocks_used.set(num_used)
        self.metrics.kv_usage.set(num_used / num_total if num_total else 0.0)

    # --- requests (event loop) -------------------------------------------------------------

    def _sampling_state(self, params: SamplingParams) -> SamplingState:
        stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.runner.eos_token_ids
        )
        return make_sampling_state(
            params.temperature,
            params.top_p,
            params.seed,
            vocab_size=self.runner.config.vocab_size,
            stop_token_ids=stop_token_ids,
            min_tokens=params.min_tokens,
        )

    async def generate(
        self, request: GenerationRequest
    ) -> AsyncIterator[PromptStats | TokenDelta | GenerationDone]:
        arrived = time.perf_counter()
        prompt = await asyncio.get_running_loop().run_in_executor(
            self._prompt_worker, render_prompt, self.runner.tokenizer, request.messages
        )
        token_ids = prompt.token_ids
        if len(token_ids) >= self.max_context_tokens:
            raise PromptTooLongError(len(token_ids), self.max_context_tokens)
        sampling_state = self._sampling_state(request.sampling)
        if len(token_ids) >= self.max_sequence_tokens:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; this node's device KV memory holds {self.max_sequence_tokens} tokens per request"
            )
        # Capped like at the model's context: the request ends with finish_reason "length" where the
        # device tier is full.
        max_new_tokens = min(request.sampling.max_tokens, self.max_sequence_tokens - len(token_ids))
        if max_new_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

        use_cache = request.use_cache and self.settings.cache.enabled
        await self.pool.key_provider.prefetch(request.principal)
        keys = (
            compute_block_keys(
                self.namespace.namespace,
                token_ids,
                prompt.segments,
                request.principal,
                self.block_size,
                now=self.pool.wall_time(),
                creator_subject_id=self._creator_digest(request.principal),
            )
            if use_cache
            else []
        )
        plan = (
            await self.manager.acquire(keys, token_ids, request.principal)
            if use_cache
            else PrefixPlan(keys=[])
        )
        if request.pull_hint is not None and plan.claimed:
            try:
                await self._pull_prefix(plan, request)
            except BaseException:
                self.manager.finish(plan)
                raise
        if plan.claimed:
            self.metrics.builds.inc()
        seq = Sequence(f"{next(_SEQ_IDS)}", list(token_ids), len(token_ids), needs_prefix=True)
        handle = _Request(
            seq,
            plan,
            sampling_state,
            max_new_tokens,
            IncrementalDetokenizer(self.runner.tokenizer, request.sampling.stop),
            arrived,
        )
        self._submit("add", handle)
        try:
            # Inside the try: the engine owns the plan now, so a failure here still aborts and
            # releases it.
            layout_sampler(self).observe(request, prompt, keys, plan.num_hit_blocks)
            loop = asyncio.get_running_loop()
            outbox = handle.outbox
            while True:
                while not outbox:
                    handle.wake = loop.create_future()
                    await handle.wake
                item = outbox.popleft()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, GenerationDone):
                    return
        finally:
            if not handle.finished:
                self._submit("abort", handle)

    async def _pull_prefix(self, plan: PrefixPlan, request: GenerationRequest) -> None:
        """Pull the claimed blocks the hinted peer holds into the pool, so the request computes only
        the rest.

        Only the claimed run right after the hit is asked for (blocks another request is
        building are its to build). Whatever fails falls back to computing them, counted
        by reason; the checks and their order are :mod:`gpu_node.cache.peers`'.
        """
        hint = request.pull_hint
        assert hint is not None, "a pull needs a hint"
        targets: list[CacheEntry] = []
        for entry in plan.claimed:
            if (
                entry.key.index != plan.num_hit_blocks + len(targets)
                or entry.key.index >= hint.num_blocks
            ):
                break
            targets.append(entry)
        if self.peer_puller is not None:
            targets = targets[: self.peer_puller.settings.max_pull_blocks]
        if not targets:
            return
        started = time.perf_counter()
        outcome = await self._pull_into(plan, request, hint, targets)
        self.metrics.peer_pulls.labels(outcome).inc()
        self.metrics.peer_pull_seconds.observe(time.perf_counter() - started)

    async def _pull_into(
        self,
        plan: PrefixPlan,
        request: GenerationRequest,
        hint: PullHint,
        targets: list[CacheEntry],
    ) -> str:
        """Pull ``targets`` from the hinted peer and adopt what arrived into ``plan``; the outcome's
        label."""
        if self.peer_puller is None or not self.peer_puller.knows(hint.node_id):
            return "unknown_peer"
        namespace = self.namespace.namespace
        try:
            records = await self.peer_puller.fetch(
                hint.node_id,
                namespace,
                [entry.block_hash for entry in targets],
                self.runner.kv_spec,
            )
        except PullFailed as failure:
            return failure.reason
        # Off the pool's lock, so a key this node does not hold yet (a tenant it never served) is
        # fetched here rather than failing the pull.
        kvs, failure_reason = await asyncio.to_thread(
            open_pulled,
            records,
            targets,
            self.pool.key_provider.blocking(),
            namespace,
            self.runner.kv_spec,
        )
        # Checked again now that the pull is over: a command that arrived meanwhile moved the
        # registry.
        if (
            self.versions.is_retired(namespace)
            or self.versions.check(request.principal, request.messages) is not None
        ):
            return "stale"
        if not kvs:
            return failure_reason or "mismatch"
        source = ReplicaSource(hint.node_id, self.pool.wall_time())
        committed = await self._run(self._commit_pulled, targets[: len(kvs)], kvs, source)
        if len(committed) < len(kvs):
            # commit_build discarded this claim (tombstoned during the pull): nothing is built into
            # it any more.
            discarded = targets[len(committed)]
            plan.claimed.remove(discarded)
            self.manager.wake([discarded.block_hash])
        num_adopted = self.manager.adopt_pulled(plan, committed)
        self.manager.drain_events()
        self.metrics.peer_pulled_blocks.inc(num_adopted)
        if num_adopted < len(kvs):
            return "discarded"
        # A holder that held only part of the run served that part: the rest is computed, as any
        # miss.
        return failure_reason or "pulled"

    def _commit_pulled(
        self, targets: list[CacheEntry], kvs: list[torch.Tensor], source: ReplicaSource
    ) -> list[CacheEntry]:
        """Commit pulled KV into the claimed entries (model worker); the run committed. A discarded one ends it."""
        committed: list[CacheEntry] = []
        for entry, kv in zip(targets, kvs, strict=True):
            if not self.pool.commit_build(entry, kv, source):
                break
            committed.append(entry)
        return committed

    def _submit(self, action: str, handle: _Request) -> None:
        self._inbox.append((action, handle))
        self._work.set()

    def _can_step(self) -> bool:
        """Whether a step has work: requests to take in, or scheduled sequences that are not stalled
        waiting for them."""
        return bool(self._inbox) or (self.scheduler.has_work and not self._stalled)

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._stalled:
                # The next request's arrival ends a stall; retrying after a while covers references
                # released otherwise.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), _STALL_RETRY_S)
                self._stalled = False
            else:
                await self._work.wait()
            self._work.clear()
            while self._can_step():
                try:
                    # Not through _run: a burst is not a job that other bursts would wait for.
                    await loop.run_in_executor(self._worker, self._step_burst, loop)
                except Exception as exc:  # noqa: BLE001 - whatever broke, no stream may be left waiting
                    # A broken step (an invariant, not a model error) must not leave every stream
                    # hanging.
                    log.error("engine step failed outside the model: %s", type(exc).__name__)
                    deliveries, woken = await self._run(
                        self._fail_all, GenerationError("generation failed")
                    )
                    self._after_step(
                        deliveries, woken, len(self.scheduler.running), len(self.scheduler.waiting)
                    )

    def _step_burst(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run steps back to back on the worker while there is work and no other worker job waits
        (model worker).

        Each step's outputs go to the loop as soon as the step ends, and the next
        step starts at once: a round trip through the event loop per token would
        leave the worker idle between steps (a large share of a small model's
        decode step). Snapshot writes, TTL sweeps and other :meth:`_run` jobs
        still run between steps: the burst ends when one is queued.
        """
        while self._can_step() and not self._jobs_waiting:
            started, started_cpu = time.perf_counter(), time.thread_time()
            deliveries, woken = self._step()
            loop.call_soon_threadsafe(
                self._after_step,
                deliveries,
                woken,
                len(self.scheduler.running),
                len(self.scheduler.waiting),
            )
            timing = self._last_timing
            if timing is not None:
                self._last_timing = None
                overhead_s = time.perf_counter() - started - timing.forward_s
                self.metrics.step_overhead.observe(overhead_s)
                if self.step_sink is not None:
                    overhead_cpu_s = time.thread_time() - started_cpu - timing.overhead_cpu_s
                    self.step_sink(
                        StepTiming(
                            timing.num_seqs,
                            timing.num_tokens,
                            timing.forward_s,
                            overhead_s,
                            overhead_cpu_s,
                        )
                    )

    def _after_step(
        self,
        deliveries: list[tuple[_Request, list]],
        woken: list[bytes],
        num_running: int,
        num_waiting: int,
    ) -> None:
        """A step's effects on the event loop: wake singleflight waiters, stream outputs, publish pool events, refresh gauges."""
        self.manager.wake(woken)
        for handle, items in deliveries:
            handle.outbox.extend(items)
            if handle.wake is not None:
                if not handle.wake.done():
                    handle.wake.set_result(None)
                handle.wake = None
        self.manager.drain_events()
        now = time.monotonic()
        # The tier gauges take the pool's lock: at most every _GAUGE_REFRESH_S while busy, and
        # always once idle.
        if now >= self._gauges_refreshed_at + _GAUGE_REFRESH_S or not (num_running or num_waiting):
            self._gauges_refreshed_at = now
            self._refresh_tier_gauges()
        self.metrics.requests_running.set(num_running)
        self.metrics.requests_waiting.set(num_waiting)

    # --- one step (model worker) -------------------------------------------------------------

    def _fail_all(self, error: GenerationError) -> tuple[list[tuple[_Request, list]], list[bytes]]:
        """End every request the engine holds (queued in the inbox or scheduled) with ``error``."""
        deliveries: dict[_Request, list] = {}
        self._take_inbox()
        for handle in list(self._requests.values()):
            self._finish(handle, error, deliveries)
        woken, self.paged_kv.woken = self.paged_kv.woken, []
        return list(deliveries.items()), woken

    def _step(self) -> tuple[list[tuple[_Request, list]], list[bytes]]:
        """One engine step; everything but the model forward on one intra-op thread
        (:func:`intra_op_threads`)."""
        with intra_op_threads(1):
            return self._step_single_threaded()

    def _step_single_threaded(self) -> tuple[list[tuple[_Request, list]], list[bytes]]:
        deliveries: dict[_Request, list] = {}
        self._take_inbox()
        output = self.scheduler.schedule()
        if output.preempted:
            self.metrics.preemptions.inc(len(output.preempted))
        # Nothing runs and the head of the queue cannot get its blocks although every other
        # scheduled sequence let go of its own (Scheduler.schedule): the rest of the device tier is
        # referenced by requests the event loop admitted after this step took the inbox (a request
        # references its hits before it is handed over). The engine waits for them instead of
        # failing the head: once queued they let go too, and the head, which fits the device tier
        # alone (max_sequence_tokens), starts. No request fails for lack of device blocks.
        self._stalled = (
            output.is_empty
            and not output.preempted
            and not self.scheduler.running
            and bool(self.scheduler.waiting)
        )
        if not output.is_empty:
            try:
                self._execute(output, deliveries)
            except Exception as exc:  # noqa: BLE001 - a failed forward ends the requests in it, not the engine
                log.error("engine step failed: %s", type(exc).__name__)
                for chunk in output.chunks:
                    handle = self._requests.get(chunk.seq.seq_id)
                    if handle is not None and not handle.finished:
                        self._finish(handle, GenerationError("generation failed"), deliveries)
        woken, self.paged_kv.woken = self.paged_kv.woken, []
        return list(deliveries.items()), woken

    def _take_inbox(self) -> None:
        while self._inbox:
            action, handle = self._inbox.popleft()
            if action == "add":
                self._requests[handle.seq.seq_id] = handle
                self.paged_kv.register(handle.seq, handle.plan)
                self.scheduler.add(handle.seq)
            elif not handle.finished:
                self._finish(handle, None, {})

    def _execute(self, output: SchedulerOutput, deliveries: dict[_Request, list]) -> None:
        chunks = output.chunks
        step_chunks = [
            StepChunk(
                chunk.seq.token_ids[chunk.start : chunk.start + chunk.num_tokens],
                chunk.start,
                chunk.seq.block_table,
                chunk.samples,
            )
            for chunk in chunks
        ]
        prepared = self.runner.prepare(step_chunks, self.pool.device_kv)
        started, started_cpu = time.perf_counter(), time.thread_time()
        logits = self.runner.forward(prepared)
        forward_s = time.perf_counter() - started
        self._last_timing = StepTiming(
            len(chunks), output.num_batched_tokens, forward_s, 0.0, time.thread_time() - started_cpu
        )
        sampling = [chunk for chunk in chunks if chunk.samples]
        handles = [self._requests[chunk.seq.seq_id] for chunk in sampling]
        states = [handle.sampling for handle in handles]
        tokens = (
            sample_batch(logits, states, [handle.num_completion_tokens for handle in handles])
            if sampling
            else []
        )
        self.scheduler.advance(
            output, {chunk.seq.seq_id: token for chunk, token in zip(sampling, tokens, strict=True)}
        )
        self.metrics.iteration_tokens.observe(output.num_batched_tokens)
        if any(chunk.start < chunk.seq.num_prompt_tokens for chunk in chunks):
            self.metrics.prefill_latency.observe(forward_s)
        block_size = self.block_size
        for chunk in chunks:
            # A claimed block can only have become complete in a step whose chunk reached a block
            # boundary.
            if (chunk.start + chunk.num_tokens) // block_size != chunk.start // block_size:
                self.paged_kv.commit_computed(chunk.seq)
        now = time.perf_counter()
        for handle, token in zip(handles, tokens, strict=True):
            self._emit(handle, token, now, deliveries)

    def _emit(
        self, handle: _Request, token: int, now: float, deliveries: dict[_Request, list]
    ) -> None:
        items = deliveries.setdefault(handle, [])
        if not handle.started_output:
            handle.started_output = True
            handle.first_token_at = now
            num_cached_tokens = self.paged_kv.of(handle.seq).num_cached_tokens
            self.metrics.observe_request(handle.seq.num_prompt_tokens, num_cached_tokens)
            self.metrics.prefix_cache_queries.inc(handle.seq.num_prompt_tokens)
            self.metrics.prefix_cache_hits.inc(num_cached_tokens)
            self.metrics.ttft.observe(now - handle.arrived)
            items.append(PromptStats(handle.seq.num_prompt_tokens, num_cached_tokens))
        else:
            self.metrics.inter_token_latency.observe(now - handle.last_token_at)
        handle.last_token_at = now
        if token in handle.sampling.stop_token_ids:
            held_back = handle.detokenizer.flush()
            if held_back:
                items.append(TokenDelta(token, held_back, handle.num_completion_tokens))
            self._finish(handle, GenerationDone("stop", handle.num_completion_tokens), deliveries)
            return
        handle.num_completion_tokens += 1
        text, stopped = handle.detokenizer.push(
            token, check_stop=handle.num_completion_tokens >= handle.sampling.min_tokens
        )
        if stopped:
            if text:
                items.append(TokenDelta(token, text, handle.num_completion_tokens))
            self._finish(handle, GenerationDone("stop", handle.num_completion_tokens), deliveries)
            return
        if handle.num_completion_tokens >= handle.max_new_tokens:
            items.append(
                TokenDelta(token, text + handle.detokenizer.flush(), handle.num_completion_tokens)
            )
            self._finish(handle, GenerationDone("length", handle.num_completion_tokens), deliveries)
        else:
            items.append(TokenDelta(token, text, handle.num_completion_tokens))

    def _finish(
        self,
        handle: _Request,
        last: GenerationDone | BaseException | None,
        deliveries: dict[_Request, list],
    ) -> None:
        """End a request: free its slot and blocks now; ``last`` (None for an abort) goes to its
        stream."""
        handle.finished = True
        self.scheduler.finish([handle.seq])
        self.paged_kv.forget(handle.seq)
        del self._requests[handle.seq.seq_id]
        if isinstance(last, GenerationDone):
            self.metrics.generated_tokens.inc(handle.num_completion_tokens)
            now = time.perf_counter()
            self.metrics.e2e_latency.observe(now - handle.arrived)
            if handle.num_completion_tokens > 1 and now > handle.first_token_at:
                self.metrics.decode_tokens_per_s.set(
                    (handle.num_completion_tokens - 1) / (now - handle.first_token_at)
                )
        if last is not None:
            deliveries.setdefault(handle, []).append(last)

    def cache_stats(self) -> dict:
        stats = self.pool.stats()
        registry = self.metrics.registry
        return {
            "namespace": self.namespace.namespace,
            "block_size": self.block_size,
            "block_bytes": self.runner.kv_spec.block_bytes,
            "tiers": {
                tier.value: {
                    "num_entries": stats.num_entries.get(tier, 0),
                    "num_bytes": stats.tier_bytes.get(tier, 0),
                }
                for tier in stats.num_entries
            },
            "capacity": self.tier_plan.tier_stats(),
            "max_concurrency": {
                "context_tokens": self.max_context_tokens,
                "num_requests": round(self.tier_plan.max_concurrency(self.max_context_tokens), 2),
            },
            "num_evictions": stats.num_evictions,
            "num_requests": registry.get_sample_value("kvledger_requests_total") or 0,
            "hit_ratio_tokens": registry.get_sample_value("kvledger_hit_ratio_tokens") or 0.0,
            "hit_ratio_requests": registry.get_sample_value("kvledger_hit_ratio_requests") or 0.0,
            "misses": {
                reason.value: registry.get_sample_value(
                    "kvledger_cache_misses_total", {"reason": reason.value}
                )
                or 0
                for reason in MissReason
            },
        }

    @property
    def snapshot_root(self) -> Path:
        return Path(self.settings.data_dir) / "snapshots"

    def snapshot_inventory(self) -> dict[str, list[BlockKey]]:
        """Readable blocks of every snapshot this node holds, by snapshot id (blocking: reads
        shards)."""
        inventory = {}
        for directory in snapshots.complete_snapshots(self.snapshot_root):
            manifest = snapshots.read_manifest(directory)
            inventory[manifest.snapshot_id] = snapshots.readable_blocks(
                directory, self.pool.key_provider.blocking()
            )
        return inventory

    def _creator_digest(self, principal: Principal) -> str | None:
        """The keyed digest recorded as the creator of the blocks ``principal``'s request builds.

        ``None`` on a node without the subject key (no ledger, no erasure commands to match it).
        """
        subject_key = self.settings.subject_key
        if subject_key is None:
            return None
        return subject_digest(
            subject_key.get_secret_value().encode(), principal.tenant_id, principal.subject_id
        )

    def may_hold_snapshots(self) -> bool:
        """Whether a snapshot exists under :attr:`snapshot_root` or is being written.

        Lets an invalidation skip the snapshot pass (a hop to the model worker)
        on a node without snapshots. Called on the event loop, where writes are
        started, so a write queued before the call is seen.
        """
        if self._num_snapshot_writes:
            return True
        root = self.snapshot_root
        return root.is_dir() and any(root.iterdir())

    async def write_snapshot(self) -> dict:
        snapshot_dir = self.snapshot_root / uuid.uuid4().hex
        self._num_snapshot_writes += 1
        try:
            manifest = await self._run(snapshots.write_snapshot, self.pool, snapshot_dir)
        finally:
            self._num_snapshot_writes -= 1
        self.manager.drain_events()
        if self.snapshot_sink is not None:
            self.snapshot_sink(manifest.snapshot_id, manifest.block_hashes)
        return {
            "snapshot_id": manifest.snapshot_id,
            "path": str(snapshot_dir),
            "num_blocks": len(manifest.block_hashes),
        }
