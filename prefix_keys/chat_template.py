"""Chat templates rendered as transformers' ``apply_chat_template`` renders them, with jinja2 alone.

A block key hashes token ids, and a message's token ids depend on the text its chat template
writes around it. A router that rendered a template even slightly differently from the node
(another whitespace rule, an HTML-escaping ``tojson``) would compute keys no node holds, so
this module reproduces transformers' environment (``utils/chat_template_utils.py``,
``_cached_compile_jinja_template``) rather than jinja2's defaults: a sandbox that forbids
mutating what the template is given (templates come from model repositories: untrusted
code), ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, and a restricted ``dict`` and
``namespace``. The ``{% generation %}`` tag of transformers' assistant-mask tracker is
parsed (some templates use it) and renders its body unchanged, as it does there when no
mask is asked for. The node renders through this module too, so there is one renderer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateError", "compile_chat_template", "template_variables"]


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: marks the assistant's text; renders it as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    """How a template refuses its input (e.g. an unknown role): a TemplateError to the caller."""
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (jinja2's own escapes ``<>&'``)."""
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


class _TemplateDict:
    """``dict(...)`` for templates, without the ``dict`` type itself (no type hackery)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore names: a template cannot reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # jinja2's own signature trick: ``self`` is positional, so ``namespace(self=...)`` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            message = f"chat templates cannot store underscore attributes on a namespace: {name!r}"
            raise SecurityError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template, cached by its text: a node renders every request with the same one.

    ValueError when ``source`` is not valid jinja (a model directory is operator input).
    """
    try:
        return _environment().from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from None


def template_variables(
    messages: list[dict],
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
) -> dict[str, Any]:
    """What ``apply_chat_template`` hands a template for a chat without tools or documents.

    The named special tokens (``bos_token`` …) come first, as there, so a message list or
    flag always wins over a token of the same name.
    """
    return {
        **special_tokens,
        "messages": messages,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
