"""The asyncio engine: requests in, streamed tokens out.

All torch work runs on one dedicated worker thread, so the event loop keeps
serving HTTP, singleflight waiters and metrics while a prefill runs. Requests
interleave at step granularity: every prefill and every decode step is its own
job on that thread. Any failure to restore cached KV falls back to a full
prefill and is counted — the cache is an optimisation, never a reason to fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_node import snapshots
from gpu_node.block_pool import BlockPool, BlockRestoreError, PoolConfig
from gpu_node.kv_cache_manager import KVCacheManager, PrefixPlan
from gpu_node.kv_cache_utils import BlockKey, CacheScope, Principal, compute_block_keys
from gpu_node.layout_sampler import layout_sampler
from gpu_node.metrics import MissReason, NodeMetrics
from gpu_node.model_runner import ModelRunner
from gpu_node.namespace import NamespaceIdentity, compute_namespace
from gpu_node.prompt import ChatMessage, render_prompt
from gpu_node.remote_keys import data_key_provider
from gpu_node.settings import NodeSettings
from gpu_node.versions import VersionRegistry

log = logging.getLogger(__name__)

_EXPIRY_SWEEP_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    principal: Principal
    use_cache: bool = True


@dataclass(frozen=True, slots=True)
class PromptStats:
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_id: int
    text: str


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


@dataclass(slots=True)
class _Prefill:
    cache: object
    logits: torch.Tensor
    num_cached_tokens: int


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
        self.manager = KVCacheManager(pool, metrics, settings.cache.singleflight_wait_s)
        self.snapshot_sink: Callable[[str, tuple[bytes, ...]], None] | None = None
        self.versions = VersionRegistry()
        self.ready = False
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvledger-model")
        # Rendering and tokenizing a prompt is CPU work proportional to the request: on the
        # event loop a huge request would stall health checks, commands and heartbeats, and on
        # the model worker it would stall every other request's decode steps. One thread also
        # bounds how many huge requests are parsed at once.
        self._prompt_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvledger-prompt")
        self._num_snapshot_writes = 0
        self._sweeper: asyncio.Task | None = None

    @classmethod
    def from_settings(cls, settings: NodeSettings) -> AsyncEngine:
        runner = ModelRunner(settings.model_dir, settings.device, settings.dtype, settings.cache.block_size)
        namespace = compute_namespace(settings.model_dir, runner.kv_spec.kv_format, runner.attn_implementation)
        data_dir = Path(settings.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        cache = settings.cache
        config = PoolConfig(
            namespace=namespace.namespace,
            num_device_blocks=cache.num_device_blocks,
            num_host_blocks=cache.num_host_blocks,
            max_disk_blocks=cache.max_disk_blocks,
            disk_dir=data_dir / "blocks",
            ttl_s={CacheScope.PUBLIC: cache.ttl_public_s, CacheScope.TENANT: cache.ttl_tenant_s, CacheScope.USER: cache.ttl_user_s},
            device=settings.device,
        )
        pool = BlockPool(runner.kv_spec, config, data_key_provider(settings, data_dir))
        return cls(runner, namespace, pool, settings, NodeMetrics())

    async def start(self, *, ready: bool = True) -> None:
        """Re-index the disk tier and warm from a snapshot, then report ready.

        ``ready=False`` when the node must first replay ``kvledger.commands``:
        the command consumer sets ``ready`` once it has (docs/design.md §6), since the
        disk tier and snapshot just loaded may hold blocks invalidated meanwhile.
        """
        await self._run(self.pool.load_disk_tier)
        if self.settings.warm_from is not None:
            num_loaded = await self._run(snapshots.load_snapshot, self.pool, Path(self.settings.warm_from))
            log.info("warm start: %d blocks loaded from snapshot", num_loaded)
        self.manager.drain_events()
        self._refresh_tier_gauges()
        self._sweeper = asyncio.create_task(self._sweep_expired())
        self.ready = ready

    async def stop(self) -> None:
        self.ready = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        self._worker.shutdown(wait=True)
        self._prompt_worker.shutdown(wait=True)

    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, function, *args)

    async def run_exclusive(self, function, *args):
        """Run blocking ``function`` on the model worker, after the work queued before it.

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

    async def generate(self, request: GenerationRequest) -> AsyncIterator[PromptStats | TokenDelta | GenerationDone]:
        started = time.perf_counter()
        prompt = await asyncio.get_running_loop().run_in_executor(
            self._prompt_worker, render_prompt, self.runner.tokenizer, request.messages
        )
        token_ids = prompt.token_ids
        if len(token_ids) >= self.max_context_tokens:
            raise PromptTooLongError(len(token_ids), self.max_context_tokens)
        sampling_state = self.runner.sampling_state(request.sampling.temperature, request.sampling.top_p, request.sampling.seed)
        max_new_tokens = min(request.sampling.max_tokens, self.max_context_tokens - len(token_ids))
        if max_new_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

        use_cache = request.use_cache and self.settings.cache.enabled
        await self.pool.key_provider.prefetch(request.principal)
        keys = (
            compute_block_keys(
                self.namespace.namespace, token_ids, prompt.segments, request.principal, self.block_size, now=self.pool.wall_time()
            )
            if use_cache
            else []
        )
        plan = await self.manager.acquire(keys, token_ids, request.principal) if use_cache else PrefixPlan(keys=[])
        try:
            layout_sampler(self).observe(request, prompt, keys, plan.num_hit_blocks)
            prefill = await self._run(self._prefill, plan, token_ids)
        finally:
            self.manager.finish(plan)
            self._refresh_tier_gauges()
        if plan.claimed:
            self.metrics.builds.inc()

        self.metrics.observe_request(len(token_ids), prefill.num_cached_tokens)
        token = self.runner.sample(prefill.logits, sampling_state)
        self.metrics.ttft.observe(time.perf_counter() - started)
        yield PromptStats(len(token_ids), prefill.num_cached_tokens)

        async for item in self._decode(prefill.cache, token, max_new_tokens, sampling_state, request.sampling.stop):
            yield item

    async def _decode(self, cache, token: int, max_new_tokens: int, sampling_state, stop: tuple[str, ...]):
        tokenizer = self.runner.tokenizer
        generated: list[int] = []
        emitted_text = ""
        decode_started = time.perf_counter()
        finish_reason = "length"
        while True:
            if token in self.runner.eos_token_ids:
                finish_reason = "stop"
                break
            generated.append(token)
            text = tokenizer.decode(generated, skip_special_tokens=True)
            stop_at = min((index for index in (text.find(s) for s in stop if s) if index >= 0), default=-1)
            if stop_at >= 0:
                if stop_at > len(emitted_text):
                    yield TokenDelta(token, text[len(emitted_text) : stop_at])
                finish_reason = "stop"
                break
            # hold back an incomplete UTF-8 sequence until its next byte arrives
            if not text.endswith("\ufffd") and len(text) > len(emitted_text):
                yield TokenDelta(token, text[len(emitted_text) :])
                emitted_text = text
            else:
                yield TokenDelta(token, "")
            if len(generated) >= max_new_tokens:
                break
            logits = await self._run(self.runner.decode, token, cache)
            token = self.runner.sample(logits, sampling_state)
        elapsed_s = time.perf_counter() - decode_started
        self.metrics.generated_tokens.inc(len(generated))
        if generated and elapsed_s > 0:
            self.metrics.decode_tokens_per_s.set(len(generated) / elapsed_s)
        yield GenerationDone(finish_reason, len(generated))

    def _prefill(self, plan: PrefixPlan, token_ids: list[int]) -> _Prefill:
        """Worker thread: restore hits, prefill the rest, commit claimed blocks."""
        cache = None
        num_cached_tokens = 0
        if plan.hit_entries:
            restore_started = time.perf_counter()
            try:
                cache = self.runner.restore(self.pool.read_blocks(plan.hit_entries))
                num_cached_tokens = plan.num_hit_blocks * self.block_size
            except BlockRestoreError:
                self.metrics.misses.labels(MissReason.KV_RESTORE_FAILED.value).inc()
            except torch.OutOfMemoryError:
                self.metrics.misses.labels(MissReason.OOM.value).inc()
            except ValueError:
                log.warning("restored KV did not match the model; falling back to full prefill")
                self.metrics.misses.labels(MissReason.KV_RESTORE_FAILED.value).inc()
            self.metrics.restore_latency.observe(time.perf_counter() - restore_started)
        if cache is None:
            cache = self.runner.new_cache()
        prefill_started = time.perf_counter()
        try:
            logits = self.runner.prefill(token_ids[num_cached_tokens:], cache)
        except BaseException:
            self.manager.commit(plan, None)
            raise
        self.metrics.prefill_latency.observe(time.perf_counter() - prefill_started)
        if plan.claimed:
            first = plan.claimed[0].key.index
            span = self.runner.extract_blocks(cache, first, plan.claimed[-1].key.index - first + 1)
            self.manager.commit(plan, span[[entry.key.index - first for entry in plan.claimed]])
        return _Prefill(cache, logits, num_cached_tokens)

    def cache_stats(self) -> dict:
        stats = self.pool.stats()
        registry = self.metrics.registry
        return {
            "namespace": self.namespace.namespace,
            "block_size": self.block_size,
            "block_bytes": self.runner.kv_spec.block_bytes,
            "tiers": {
                tier.value: {"num_entries": stats.num_entries.get(tier, 0), "num_bytes": stats.tier_bytes.get(tier, 0)}
                for tier in stats.num_entries
            },
            "num_evictions": stats.num_evictions,
            "num_requests": registry.get_sample_value("kvledger_requests_total") or 0,
            "hit_ratio_tokens": registry.get_sample_value("kvledger_hit_ratio_tokens") or 0.0,
            "hit_ratio_requests": registry.get_sample_value("kvledger_hit_ratio_requests") or 0.0,
            "misses": {
                reason.value: registry.get_sample_value("kvledger_cache_misses_total", {"reason": reason.value}) or 0
                for reason in MissReason
            },
        }

    @property
    def snapshot_root(self) -> Path:
        return Path(self.settings.data_dir) / "snapshots"

    def snapshot_inventory(self) -> dict[str, list[BlockKey]]:
        """Readable blocks of every snapshot this node holds, by snapshot id (blocking: reads shards)."""
        inventory = {}
        if self.snapshot_root.is_dir():
            for directory in sorted(self.snapshot_root.iterdir()):
                if (directory / snapshots.MANIFEST_NAME).is_file():
                    manifest = snapshots.read_manifest(directory)
                    inventory[manifest.snapshot_id] = snapshots.readable_blocks(directory, self.pool.key_provider.blocking())
        return inventory

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
        return {"snapshot_id": manifest.snapshot_id, "path": str(snapshot_dir), "num_blocks": len(manifest.block_hashes)}
