"""Chat messages → token ids plus per-message cache-scope segments.

Per-message scope (DESIGN §2) needs the token span of every message. Tokenizing the
whole rendered prompt and mapping offsets back would make a message's tokens depend
on the text after it (BPE merges across the boundary), and then a cached public
system prompt would not be a token prefix of the next request that shares it. So the
prompt is built incrementally: the chat template is rendered for ``messages[:i+1]``,
each rendering must extend the previous one (the template is *prefix-stable*), and the
text each message adds is tokenized on its own and appended. A message's tokens thus
depend only on the messages before it, which is exactly what makes prefixes reusable.

Template chrome before a message (BOS, role header) belongs to that message's segment;
the generation prompt (``<|assistant|>\\n`` …) is a final PUBLIC segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from gpu_node.kv_cache_utils import CacheScope, DocumentRef, Segment


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


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """Prompt token ids and the segments tiling them.

    ``segments[i]`` is the span of ``messages[i]``; with a generation prompt there is
    one more, PUBLIC, segment at the end.
    """

    token_ids: list[int]
    segments: list[Segment]


def _render(tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
    conversation = [{"role": message.role, "content": message.content} for message in messages]
    try:
        rendered = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as exc:
        raise ValueError(f"chat template rejected the messages: {exc}") from None
    assert isinstance(rendered, str), f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}"
    return rendered


def _refuse_control_tokens(tokenizer, messages: Sequence[ChatMessage]) -> None:
    """Message content may not spell the template's control tokens.

    Chunks are tokenized with special tokens recognised (the template's chrome needs
    them), so a user writing ``<|system|>`` into a message would otherwise forge a
    role boundary. Refusing is clearer than silently escaping.
    """
    control_tokens = [token for token in tokenizer.all_special_tokens if token]
    for message in messages:
        for token in control_tokens:
            if token in message.content:
                raise ValueError(f"message content contains the reserved control token {token!r}")


def render_prompt(tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> RenderedPrompt:
    """Render ``messages`` with the tokenizer's chat template into tokens and scope segments.

    Raises ValueError for an empty conversation, a message the template rejects, or a
    template that is not prefix-stable (a rendering that does not extend the previous
    one, e.g. a template that reorders messages or always appends a trailer).

    The template is rendered once per message (quadratic in the message count); a
    render costs microseconds per message, far below one prefill token.
    """
    if not messages:
        raise ValueError("a prompt needs at least one message")
    _refuse_control_tokens(tokenizer, messages)
    token_ids: list[int] = []
    segments: list[Segment] = []
    rendered_so_far = ""

    def append(text: str, scope: CacheScope, document: DocumentRef | None) -> None:
        start = len(token_ids)
        if text:
            token_ids.extend(tokenizer.encode(text, add_special_tokens=False))
        segments.append(Segment(start, len(token_ids), scope, document))

    for count in range(1, len(messages) + 1):
        rendered = _render(tokenizer, messages[:count], add_generation_prompt=False)
        if not rendered.startswith(rendered_so_far):
            raise ValueError("chat template is not prefix-stable")
        message = messages[count - 1]
        append(rendered[len(rendered_so_far) :], message.scope, message.document)
        rendered_so_far = rendered
    if add_generation_prompt:
        rendered = _render(tokenizer, messages, add_generation_prompt=True)
        if not rendered.startswith(rendered_so_far):
            raise ValueError("chat template is not prefix-stable")
        append(rendered[len(rendered_so_far) :], CacheScope.PUBLIC, None)
    return RenderedPrompt(token_ids=token_ids, segments=segments)
