"""A model directory's tokenizer and chat template, read from its files with ``tokenizers`` alone.

A router computes a request's block keys without the node's ML stack: it loads
``tokenizer.json`` (the ``tokenizers`` encoder), the named special tokens and added tokens of
``tokenizer_config.json``, and the chat template, as transformers' ``AutoTokenizer`` would
from the same directory. The node loads the directory with transformers; the golden test
(tests/prefix_keys) holds the two to the same keys. The template precedence is also the one
the namespace digests (``gpu_node.cache.namespace``), so it lives here once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""transformers' named special tokens (``SPECIAL_TOKENS_ATTRIBUTES``): a template sees them."""

_EXTRA_SPECIAL_TOKEN_KEYS = ("extra_special_tokens", "additional_special_tokens")


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def chat_templates(model_dir: Path, tokenizer_config: dict | None) -> dict[str, str]:
    """The chat template(s) transformers loads from ``model_dir``, by name.

    Mirrors the loader's precedence: ``chat_template.jinja`` (plus any named templates in
    ``additional_chat_templates/``) wins over ``tokenizer_config.json``'s ``chat_template``
    (a string, or a list of ``{name, template}``). Empty when the model has none.
    """
    templates: dict[str, str] = {}
    default_file = model_dir / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if not templates and tokenizer_config is not None:
        configured = tokenizer_config.get("chat_template")
        if isinstance(configured, str):
            templates["default"] = configured
        elif isinstance(configured, list):
            for item in configured:
                named = isinstance(item, dict) and isinstance(item.get("name"), str)
                if not (named and "template" in item):
                    where = f"{model_dir}/tokenizer_config.json"
                    raise ValueError(f"{where}: malformed chat_template list")
                templates[item["name"]] = item["template"]
    return templates


@dataclass(frozen=True, slots=True)
class ChatTokenizerFiles:
    """A :class:`prefix_keys.prompt.ChatTokenizer` built from files, without transformers."""

    chat_template: Mapping[str, str]
    special_tokens_map: Mapping[str, str]
    all_special_tokens: Sequence[str]
    backend_tokenizer: Tokenizer


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_tokens(config: Mapping) -> list[AddedToken]:
    """``added_tokens_decoder``'s tokens, which transformers adds to the encoder when it loads."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError("tokenizer_config.json: added_tokens_decoder must be an object")
    tokens = []
    for _, entry in sorted(decoder.items(), key=lambda item: int(item[0])):
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError("tokenizer_config.json: malformed added_tokens_decoder entry")
        tokens.append(
            AddedToken(
                entry["content"],
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", not entry.get("special", False))),
                special=bool(entry.get("special", False)),
            )
        )
    return tokens


def load_chat_tokenizer(model_dir: Path) -> ChatTokenizerFiles:
    """The tokenizer and chat template of ``model_dir`` as a router renders prompts with them.

    Needs ``tokenizer.json`` (the fast-tokenizer file every supported model directory has;
    ``kvledger model init`` writes one). Truncation and padding are switched off, as
    transformers switches them off for a plain ``tokenizer(texts)`` call. ValueError for a
    directory without a tokenizer.json or with malformed JSON.
    """
    model_dir = Path(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{model_dir} holds no tokenizer.json")
    backend = Tokenizer.from_file(str(tokenizer_file))
    backend.no_truncation()
    backend.no_padding()
    config = read_json_object(model_dir / "tokenizer_config.json") or {}
    config = {**(read_json_object(model_dir / "special_tokens_map.json") or {}), **config}
    added = [token for token in _added_tokens(config) if backend.token_to_id(token.content) is None]
    backend.add_tokens([token for token in added if not token.special])
    backend.add_special_tokens([token for token in added if token.special])
    named = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    special_tokens_map = {name: text for name, text in named.items() if text is not None}
    extra: list[str] = []
    for key in _EXTRA_SPECIAL_TOKEN_KEYS:
        values = config.get(key) or []
        extra.extend(text for text in map(_token_text, values) if text is not None)
    all_special_tokens = list(dict.fromkeys([*special_tokens_map.values(), *extra]))
    return ChatTokenizerFiles(
        chat_template=chat_templates(model_dir, config),
        special_tokens_map=special_tokens_map,
        all_special_tokens=all_special_tokens,
        backend_tokenizer=backend,
    )


KEYING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""The files :func:`load_chat_tokenizer` reads besides the chat template(s)."""


def keying_digest(model_dir: Path) -> str:
    """SHA-256 over everything a request's token ids depend on in ``model_dir``: the files
    :func:`load_chat_tokenizer` reads (by name, each length-prefixed) and the chat templates
    transformers loads. A node advertises it and a router compares its own model directory's:
    equal digests (with the node's namespace and block size) mean equal block keys."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(b"kvledger/keying/v1\x00")
    parts = [
        (name, (model_dir / name).read_bytes())
        for name in KEYING_FILES
        if (model_dir / name).is_file()
    ]
    templates = chat_templates(model_dir, read_json_object(model_dir / "tokenizer_config.json"))
    parts.append(("templates", json.dumps(templates, sort_keys=True, ensure_ascii=False).encode()))
    for name, data in parts:
        for field in (name.encode(), data):
            digest.update(len(field).to_bytes(8, "little"))
            digest.update(field)
    return digest.hexdigest()
