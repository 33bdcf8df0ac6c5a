"""Where prompts leave the cached prefix: a bounded, content-free sample for ``kvledger advise``.

Opt-in (``cache.layout_sample_size`` > 0; ``KVLEDGER_NODE_CACHE__LAYOUT_SAMPLE_SIZE``). For each
of the last ``layout_sample_size`` cacheable requests the node keeps the layout of its rendered
prompt — per segment (one per message, plus the generation prompt): index, role, cache scope,
token span and a hash — and where the request first missed the cache (the segment holding the
first block that was not a hit). ``kvledger advise`` finds the segments that differ on most
requests while later ones repeat (a timestamp in a system message before a long document) and
what moving them to the end would gain (docs/operations.md, "Prompt layout").

Never text: a segment's hash is an HMAC under a key drawn at random when the sampler is
created, of the segment's token ids and of whose cache it would be shared in (scope, tenant,
subject, document), truncated to 16 bytes. Hashes can be compared with each other on one node
for as long as it runs, and with nothing else: not across nodes, not with a guessed prompt's
hash (no one outside the process has the key). Roles are the API's closed set. The sample is
served only with the operator's metrics token (``GET /v1/cache/layout``), like the other views
that mix every tenant's traffic (docs/security.md).

Bounded: a ring of ``layout_sample_size`` requests, each with at most :data:`MAX_SEGMENTS`
segments (the rest counted, not described).
"""

from __future__ import annotations

import hmac
import secrets
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from hashlib import sha256

from prefix_keys.blocks import BlockKey, CacheScope, Principal, Segment, pack_token_ids

MAX_SEGMENTS = 64
"""Segments described per sampled request; a longer conversation's later segments are only counted."""

HASH_BYTES = 16
ROLES = frozenset({"system", "user", "assistant"})
GENERATION_ROLE = "generation"
"""Role of the segment after the last message: the template's generation prompt."""


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    index: int
    role: str
    scope: str
    start: int
    num_tokens: int
    hash: str


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first block that was not a hit: its token offset and the segment holding it."""

    segment_index: int
    token_offset: int
    role: str
    scope: str


@dataclass(frozen=True, slots=True)
class LayoutSample:
    num_prompt_tokens: int
    num_hit_tokens: int
    """Tokens of the prefix the cache held at lookup (whole blocks)."""
    num_segments: int
    segments: tuple[SegmentLayout, ...]
    divergence: Divergence | None
    """None when every cacheable block was a hit."""


class LayoutSampler:
    """A ring of the last ``capacity`` requests' layouts; ``capacity`` 0 keeps nothing (the
    default)."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity < 0 or block_size < 1:
            raise ValueError("capacity must not be negative and block_size must be positive")
        self.capacity = capacity
        self.block_size = block_size
        self._samples: deque[LayoutSample] = deque(maxlen=capacity or None)
        self._key = secrets.token_bytes(32)
        self.num_observed = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def observe(self, request, prompt, keys: Sequence[BlockKey], num_hit_blocks: int) -> None:
        """Record one request's layout: ``request`` a ``GenerationRequest`` (messages, principal),
        ``prompt`` its ``RenderedPrompt`` (token ids, segments), ``keys`` its block keys of which
        the first ``num_hit_blocks`` were hits.

        A no-op when sampling is off or nothing of the prompt is cacheable.
        """
        if not self.capacity or not keys:
            return
        messages, principal = request.messages, request.principal
        token_ids, segments = prompt.token_ids, prompt.segments
        described = []
        divergence = None
        first_miss = num_hit_blocks * self.block_size if num_hit_blocks < len(keys) else None
        for index, segment in enumerate(segments):
            role = _role(messages, index)
            if index < MAX_SEGMENTS:
                described.append(
                    SegmentLayout(
                        index,
                        role,
                        segment.scope.label,
                        segment.start,
                        segment.end - segment.start,
                        self._hash(segment, principal, token_ids[segment.start : segment.end]),
                    )
                )
            if (
                first_miss is not None
                and divergence is None
                and segment.start <= first_miss < segment.end
            ):
                divergence = Divergence(index, first_miss, role, segment.scope.label)
        self._samples.append(
            LayoutSample(
                len(token_ids),
                num_hit_blocks * self.block_size,
                len(segments),
                tuple(described),
                divergence,
            )
        )
        self.num_observed += 1

    def _hash(self, segment: Segment, principal: Principal, token_ids: Sequence[int]) -> str:
        audience = [segment.scope.label]
        if segment.scope >= CacheScope.TENANT:
            audience.append(principal.tenant_id)
        if segment.scope == CacheScope.USER:
            audience.append(principal.subject_id)
        if segment.document is not None:
            audience.append(segment.document.tag)
        mac = hmac.new(self._key, "\x00".join(audience).encode() + b"\x00", sha256)
        mac.update(pack_token_ids(token_ids))
        return mac.digest()[:HASH_BYTES].hex()

    def snapshot(self) -> dict:
        """The sample as ``GET /v1/cache/layout`` serves it, oldest request first."""
        return {
            "enabled": self.enabled,
            "capacity": self.capacity,
            "block_size": self.block_size,
            "num_observed": self.num_observed,
            "samples": [
                asdict(sample) | {"segments": [asdict(segment) for segment in sample.segments]}
                for sample in self._samples
            ],
        }


def _role(messages: Sequence, index: int) -> str:
    if index >= len(messages):
        return GENERATION_ROLE
    role = messages[index].role
    return role if role in ROLES else "other"


_SAMPLERS: weakref.WeakKeyDictionary[object, LayoutSampler] = weakref.WeakKeyDictionary()


def layout_sampler(engine) -> LayoutSampler:
    """The sampler of ``engine``, created on first use from its settings (several engines may live in one process).

    Kept beside the engine rather than in it: the engine calls :meth:`LayoutSampler.observe`
    once per request and the HTTP layer serves :meth:`LayoutSampler.snapshot`; neither needs more.
    """
    sampler = _SAMPLERS.get(engine)
    if sampler is None:
        sampler = _SAMPLERS[engine] = LayoutSampler(
            engine.settings.cache.layout_sample_size, engine.block_size
        )
    return sampler
