"""Chat messages → token ids plus per-message cache-scope segments.

Per-message scope (see docs/architecture.md) needs the token span of every message.
Tokenizing the whole rendered prompt and mapping offsets back would make a message's
tokens depend on the text after it (BPE merges across the boundary), and then a cached
public system prompt would not be a token prefix of the next request that shares it.
So the prompt is cut into per-message *chunks*: chunk ``i`` is what rendering
``messages[:i+1]`` adds to the rendering of ``messages[:i]`` (the template must be
*prefix-stable*: each rendering extends the previous one), and each chunk is tokenized
on its own. A message's tokens thus depend only on the messages before it, which is
exactly what makes prefixes reusable.

Template chrome before a message (BOS, role header) belongs to that message's segment;
the generation prompt (``<|assistant|>\\n`` …) is a final PUBLIC segment.

Cost is linear in the request: a caller controls the message count, and rendering
every prefix (quadratic) let one request with thousands of messages hold the node for
minutes. Short conversations still render every prefix (exact, and cheap at that
size); long ones render once while tracing where the template's loop steps to each
message, and check those cut points against real prefix renderings at a bounded number
of places (:func:`_traced_cuts`).

The tokenizer is anything shaped like :class:`ChatTokenizer`: the node passes the
transformers tokenizer it loaded, a router the files of the same model directory
(:func:`prefix_keys.model_files.load_chat_tokenizer`); both render with
:mod:`prefix_keys.chat_template` and encode with the same ``tokenizers`` backend.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, SupportsIndex

from tokenizers import Tokenizer

from prefix_keys.blocks import CacheScope, DocumentRef, Segment
from prefix_keys.chat_template import TemplateError, compile_chat_template, template_variables

MAX_EXACT_MESSAGES = 64
"""Up to this many messages every prefix is rendered (at most ~2,000 message renders)."""

NUM_CHECKED_CUTS = 16
"""How many traced cut points of a longer conversation are checked against a prefix render."""


class ChatTokenizer(Protocol):
    """What rendering needs of a tokenizer: the attributes a transformers fast tokenizer has.

    ``chat_template`` is the template text, or transformers' mapping of named templates
    (``default`` is used); ``special_tokens_map`` the named special tokens a template sees
    (``bos_token`` …); ``all_special_tokens`` every control token message content may not
    spell; ``backend_tokenizer`` the ``tokenizers`` encoder.
    """

    @property
    def chat_template(self) -> str | Mapping[str, str] | None: ...

    @property
    def special_tokens_map(self) -> Mapping[str, str]: ...

    @property
    def all_special_tokens(self) -> Sequence[str]: ...

    @property
    def backend_tokenizer(self) -> Tokenizer: ...


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message and who may share its KV. Scope defaults to USER: safe by default."""

    role: str
    content: str
    scope: CacheScope = CacheScope.USER
    document: DocumentRef | None = None

    def __post_init__(self) -> None:
        if self.document is not None and self.scope != CacheScope.TENANT:
            raise ValueError(f"a document message is tenant scope, not {self.scope.label}")


def request_message(
    role: str,
    content: str,
    scope: CacheScope,
    document: DocumentRef | None,
) -> ChatMessage:
    """A message of an OpenAI-style request as the template renders it and the keys scope it.

    ``developer`` is OpenAI's newer name for the ``system`` role, and a document is tenant
    scope whatever scope the request states (the node refuses a contrary explicit scope
    before this; a router only needs the keys the node would compute).
    """
    role = "system" if role == "developer" else role
    if document is not None:
        scope = CacheScope.TENANT
    return ChatMessage(role, content, scope, document)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """Prompt token ids and the segments tiling them.

    ``segments[i]`` is the span of ``messages[i]``; with a generation prompt there is
    one more, PUBLIC, segment at the end.
    """

    token_ids: list[int]
    segments: list[Segment]


def _conversation(messages: Sequence[ChatMessage]) -> list[dict]:
    return [{"role": message.role, "content": message.content} for message in messages]


def _template_source(tokenizer: ChatTokenizer) -> str:
    """The template ``apply_chat_template`` picks: the only one, or the one named ``default``."""
    template = tokenizer.chat_template
    if isinstance(template, Mapping):
        template = template.get("default")
    if not isinstance(template, str):
        raise ValueError("this model has no (default) chat template")
    return template


def _render(
    tokenizer: ChatTokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
) -> str:
    template = compile_chat_template(_template_source(tokenizer))
    special_tokens = tokenizer.special_tokens_map
    variables = template_variables(_conversation(messages), add_generation_prompt, special_tokens)
    try:
        return template.render(**variables)
    except TemplateError as exc:
        raise ValueError(f"chat template rejected the messages: {exc}") from None


def _refuse_control_tokens(tokenizer: ChatTokenizer, messages: Sequence[ChatMessage]) -> None:
    """Message content may not spell the template's control tokens.

    Chunks are tokenized with special tokens recognised (the template's chrome needs
    them), so a user writing ``<|system|>`` into a message would otherwise forge a
    role boundary. Refusing is clearer than silently escaping. One alternation keeps
    the scan one pass over the content.
    """
    control_tokens = sorted(
        (token for token in tokenizer.all_special_tokens if token), key=len, reverse=True
    )
    if not control_tokens:
        return
    pattern = re.compile("|".join(re.escape(token) for token in control_tokens))
    for message in messages:
        found = pattern.search(message.content)
        if found is not None:
            raise ValueError(
                f"message content contains the reserved control token {found.group()!r}"
            )


class _TracedConversation(list[dict]):
    """The conversation as the template sees it, noting how much output was written whenever it steps to a message.

    A chat template writes one message per iteration of its loop over ``messages``;
    when the loop steps to message ``i``, everything written so far belongs to the
    messages before it. A template that scans the messages first (e.g. for the system
    prompt) iterates more than once; the last pass is the one that writes them, so the
    last step to a message wins. Slices (``messages[1:]``) stay traced.
    """

    def __init__(
        self,
        items: Iterable[dict],
        index_of: dict[int, int],
        cuts: list[int | None],
        written: list[int],
    ) -> None:
        super().__init__(items)
        self._index_of = index_of
        self._cuts = cuts
        self._written = written

    def __iter__(self) -> Iterator[dict]:
        for item in list.__iter__(self):
            self._cuts[self._index_of[id(item)]] = self._written[0]
            yield item

    def __getitem__(self, key: SupportsIndex | slice) -> Any:
        if isinstance(key, slice):
            return _TracedConversation(
                list.__getitem__(self, key), self._index_of, self._cuts, self._written
            )
        return list.__getitem__(self, key)


def _traced_cuts(
    tokenizer: ChatTokenizer,
    messages: Sequence[ChatMessage],
    rendered: str,
) -> list[int]:
    """Cut points of ``rendered`` (the whole conversation) from one traced rendering, spot-checked.

    Raises ValueError when the traced rendering differs from ``rendered`` or a checked
    cut is not where rendering the prefix puts it: that template cannot be split this
    way, and the caller must send fewer messages. The template gets the same variables
    as :func:`_render` gives it; the equality check with ``rendered`` catches any
    difference the tracing makes.
    """
    unsplittable = ValueError(
        f"this model's chat template cannot be split per message beyond {MAX_EXACT_MESSAGES} messages"
    )
    conversation = _conversation(messages)
    cuts: list[int | None] = [None] * len(messages)
    written = [0]
    traced = _TracedConversation(
        conversation, {id(item): index for index, item in enumerate(conversation)}, cuts, written
    )
    template = compile_chat_template(_template_source(tokenizer))
    pieces = []
    try:
        variables = template_variables(traced, False, tokenizer.special_tokens_map)
        for piece in template.generate(**variables):
            pieces.append(piece)
            written[0] += len(piece)
    except TemplateError as exc:
        raise ValueError(f"chat template rejected the messages: {exc}") from None
    resolved = [cut for cut in cuts[1:] if cut is not None]
    if "".join(pieces) != rendered or len(resolved) != len(cuts) - 1:
        raise unsplittable
    num_cuts = len(resolved)
    checked = {0, 1, 2, num_cuts - 1} | {
        num_cuts * step // NUM_CHECKED_CUTS for step in range(NUM_CHECKED_CUTS)
    }
    for position in sorted(checked):
        prefix = _render(tokenizer, messages[: position + 1], add_generation_prompt=False)
        if not rendered.startswith(prefix):
            raise ValueError("chat template is not prefix-stable")
        if len(prefix) != resolved[position]:
            raise unsplittable
    return resolved


def _exact_cuts(
    tokenizer: ChatTokenizer,
    messages: Sequence[ChatMessage],
    rendered: str,
) -> list[int]:
    """Cut points of ``rendered`` from rendering every proper prefix (quadratic: short conversations
    only)."""
    cuts = []
    for count in range(1, len(messages)):
        prefix = _render(tokenizer, messages[:count], add_generation_prompt=False)
        if not rendered.startswith(prefix):
            raise ValueError("chat template is not prefix-stable")
        cuts.append(len(prefix))
    return cuts


def render_prompt(
    tokenizer: ChatTokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
) -> RenderedPrompt:
    """Render ``messages`` with the tokenizer's chat template into tokens and scope segments.

    Raises ValueError for an empty conversation, a message the template rejects, or a
    template that is not prefix-stable (a rendering that does not extend the previous
    one, e.g. a template that reorders messages or always appends a trailer).

    Blocking and CPU-bound (linear in the request): callers on an event loop run it in
    a worker thread.
    """
    if not messages:
        raise ValueError("a prompt needs at least one message")
    _refuse_control_tokens(tokenizer, messages)
    rendered = _render(tokenizer, messages, add_generation_prompt=False)
    find_cuts = _exact_cuts if len(messages) <= MAX_EXACT_MESSAGES else _traced_cuts
    cuts = [0, *find_cuts(tokenizer, messages, rendered), len(rendered)]
    if any(later < earlier for earlier, later in itertools.pairwise(cuts)):
        raise ValueError("chat template is not prefix-stable")
    chunks = [rendered[start:end] for start, end in itertools.pairwise(cuts)]
    scopes: list[tuple[CacheScope, DocumentRef | None]] = [
        (message.scope, message.document) for message in messages
    ]
    if add_generation_prompt:
        with_prompt = _render(tokenizer, messages, add_generation_prompt=True)
        if not with_prompt.startswith(rendered):
            raise ValueError("chat template is not prefix-stable")
        chunks.append(with_prompt[len(rendered) :])
        scopes.append((CacheScope.PUBLIC, None))
    # One batch call: the same ids as encoding each chunk alone, without a call per message.
    # transformers' ``tokenizer(chunks, add_special_tokens=False)`` is this very call.
    encodings = tokenizer.backend_tokenizer.encode_batch(chunks, add_special_tokens=False)
    chunk_ids = [encoding.ids for encoding in encodings]
    token_ids: list[int] = []
    segments: list[Segment] = []
    for ids, (scope, document) in zip(chunk_ids, scopes, strict=True):
        start = len(token_ids)
        token_ids.extend(ids)
        segments.append(Segment(start, len(token_ids), scope, document))
    return RenderedPrompt(token_ids=token_ids, segments=segments)
