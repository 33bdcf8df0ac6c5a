"""A compiled decoder of kv-events records: msgspec structs generated from the pydantic contract.

Validating a 50-block ``BlockStored`` with :func:`events.schema.parse_event` was the largest CPU
cost of the coordinator's kv-events consumer (docs/benchmarks.md, "Ledger ingest"). This module
decodes the same records with msgspec, whose C decoder checks structure, types, integer bounds,
string and list lengths, literals and unknown fields, and then builds the *same* pydantic objects
``parse_event`` would (same classes, field values, ``model_fields_set``, timezone objects), so
everything downstream — the signature check over ``identity.signing.signed_bytes``, routing, the
ledger handler — sees no difference and verifies the same bytes.

The contract stays defined in one place, ``events.schema``: the structs are generated from the
models' fields at import (:func:`_compiled`); what msgspec cannot check exactly is checked by the
contract's own code — patterns and timestamps by pydantic's validator of the field's annotated type,
``AfterValidator`` functions such as ``check_identifier`` called as they are, and the models'
``after`` validators (scope consistency, part ranges, ...) run on the built objects; and the
generator refuses (AssertionError at import) any annotation, constraint or validator it has no exact
translation for, so a change to the contract cannot silently leave this decoder behind.

The fast path only ever *accepts*: a record it does not accept — invalid, of another topic's
type, or in a form it does not handle (a unix-number ``created_at``, which pydantic takes) — goes
to ``parse_event``, which accepts it or raises its own :class:`~events.schema.EventValidationError`.
Refusals and their messages (what a dead letter says) are therefore the contract's by
construction; ``tests/events/test_kv_decoder.py`` proves by property tests that whatever the fast
path accepts, ``parse_event`` accepts as an identical object.
"""

from __future__ import annotations

import enum
import itertools
import types
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import msgspec
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    Strict,
    StringConstraints,
    TypeAdapter,
)
from pydantic.fields import FieldInfo

from events.schema import EVENT_TYPES, Envelope, parse_event
from events.topics import KV_EVENTS, TYPES_BY_TOPIC

Expression = Callable[[str], str]
"""Turns the Python expression of one decoded msgspec value into the expression of the value pydantic would hold."""

_NAMESPACE: dict[str, Any] = {
    "UNSET": msgspec.UNSET,
    "new": object.__new__,
    "set_attribute": object.__setattr__,
}
"""What the generated builders refer to by name: validators, builders of nested models, defaults."""


def _named(value: Any, hint: str) -> str:
    """The name under which the generated code refers to ``value``."""
    name = f"{hint}_{len(_NAMESPACE)}"
    _NAMESPACE[name] = value
    return name


def _call(function: Callable[[Any], Any], hint: str) -> Expression:
    name = _named(function, hint)
    return lambda value: f"{name}({value})"


_variables = itertools.count()


def _flattened(metadata: list[Any]) -> list[Any]:
    """``metadata`` with the constraints of nested ``Field(...)`` objects in their place."""
    flat: list[Any] = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            assert item.annotation is None and item.is_required() and not item._attributes_set, (
                f"unsupported nested field {item!r}"
            )
            flat.extend(_flattened(item.metadata))
        else:
            flat.append(item)
    return flat


def _chain(validators: list[Expression]) -> Expression | None:
    if not validators:
        return None

    def chained(value: str) -> str:
        for validate in validators:
            value = validate(value)
        return value

    return chained


def _string(annotation: Any, metadata: list[Any]) -> tuple[Any, Expression | None]:
    """A string field: msgspec checks its type and length; its pattern and validators are the
    contract's own.

    A pattern is checked by pydantic's validator of the annotated type itself (``TypeAdapter``, the
    regex engine the contract runs), not translated for Python's ``re``: the engines differ (``$``
    before a final newline, for one), and Python's is slower on the digest pattern than the call.
    """
    meta: dict[str, Any] = {}
    validators: list[Expression] = []
    pattern = False
    for item in metadata:
        if isinstance(item, Strict):
            continue  # from JSON, pydantic's lax str takes strings only too
        if isinstance(item, StringConstraints):
            unsupported = {"strip_whitespace", "to_upper", "to_lower", "strict", "ascii_only"}
            assert all(getattr(item, name) is None for name in unsupported), (
                f"unsupported string constraint {item!r}"
            )
            for name in ("min_length", "max_length"):
                if getattr(item, name) is not None:
                    meta[name] = getattr(item, name)
            pattern = pattern or item.pattern is not None
        elif type(item).__name__ == "_PydanticGeneralMetadata":
            assert set(vars(item)) == {"pattern"}, f"unsupported string constraint {item!r}"
            pattern = True
        elif isinstance(item, AfterValidator):
            validators.append(_call(item.func, "check"))  # type: ignore[arg-type]  # the contract's take the value alone
        else:
            raise AssertionError(f"no compiled form for string metadata {item!r}")
    if pattern:
        # The contract's validator of the whole annotated type: pattern, then the validators in order.
        validators = [
            _call(TypeAdapter(Annotated[(annotation, *metadata)]).validate_python, "pattern")
        ]
    return (Annotated[str, msgspec.Meta(**meta)] if meta else str), _chain(validators)


_INT_BOUNDS = {
    annotated_types.Ge: "ge",
    annotated_types.Le: "le",
    annotated_types.Gt: "gt",
    annotated_types.Lt: "lt",
}


def _integer(metadata: list[Any]) -> tuple[Any, Expression | None]:
    meta: dict[str, Any] = {}
    strict = False
    for item in metadata:
        if isinstance(item, Strict):
            strict = item.strict
        elif type(item) in _INT_BOUNDS:
            name = _INT_BOUNDS[type(item)]
            meta[name] = getattr(item, name)
        else:
            raise AssertionError(f"no compiled form for integer metadata {item!r}")
    # msgspec takes JSON integers only; a lax pydantic int would also take "3" (the fallback would
    # decide those), but the contract keeps every integer strict, and a lax one is worth a look
    # here.
    assert strict, "a lax int field in the contract"
    return (Annotated[int, msgspec.Meta(**meta)] if meta else int), None


def _length(metadata: list[Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, annotated_types.MinLen):
            meta["min_length"] = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            meta["max_length"] = item.max_length
        else:
            raise AssertionError(f"no compiled form for list metadata {item!r}")
    return meta


def _compiled_type(annotation: Any, metadata: list[Any]) -> tuple[Any, Expression | None]:
    """The msgspec type that decodes what ``annotation`` (with ``metadata``) accepts, and the
    expression of its value.

    The msgspec type may be stricter than pydantic's (the fallback decides then), never looser.
    """
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        return _compiled_type(base, [*extra, *metadata])
    metadata = _flattened(metadata)
    if origin in (Union, types.UnionType):
        assert not metadata, f"unsupported metadata on a union: {metadata!r}"
        args = get_args(annotation)
        assert len(args) == 2 and type(None) in args, (
            f"only X | None unions are compiled, not {annotation!r}"
        )
        inner, inner_value = _compiled_type(next(arg for arg in args if arg is not type(None)), [])
        if inner_value is None:
            return inner | None, None
        return inner | None, lambda value: f"(None if {value} is None else {inner_value(value)})"
    if annotation is str:
        return _string(annotation, metadata)
    if annotation is int:
        return _integer(metadata)
    assert not metadata or origin is list, f"unsupported metadata {metadata!r} on {annotation!r}"
    if annotation is AwareDatetime:
        # Text only (the fallback takes pydantic's unix numbers), parsed by the contract's own
        # validator.
        return str, _call(TypeAdapter(AwareDatetime).validate_python, "datetime")
    if annotation is uuid.UUID:
        return uuid.UUID, None
    if origin is Literal:
        values = get_args(annotation)
        assert all(type(value) in (str, int) or isinstance(value, enum.Enum) for value in values), (
            f"unsupported literal {annotation!r}"
        )
        plain = tuple(value.value if isinstance(value, enum.Enum) else value for value in values)
        by_plain = {value.value: value for value in values if isinstance(value, enum.Enum)}
        if not by_plain:
            return Literal[plain], None
        # pydantic holds the literal's own value (a Tier member for "disk"); msgspec a plain str.
        members = _named(by_plain, "members")
        return Literal[plain], lambda value: f"{members}[{value}]"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation, None
    if origin is list:
        (item,) = get_args(annotation)
        item_type, item_value = _compiled_type(item, [])
        meta = _length(metadata)
        list_type = Annotated[list[item_type], msgspec.Meta(**meta)] if meta else list[item_type]  # type: ignore[valid-type]
        if item_value is None:
            return list_type, None
        each = f"item_{next(_variables)}"
        # An empty list (the common case of a block's auth scopes or documents) skips the
        # comprehension's call.
        return (
            list_type,
            lambda value: f"([{item_value(each)} for {each} in {value}] if {value} else {value})",
        )
    if origin is tuple:
        args = get_args(annotation)
        assert args and Ellipsis not in args, f"only fixed tuples are compiled, not {annotation!r}"
        compiled = [_compiled_type(arg, []) for arg in args]
        tuple_type = tuple[tuple(each for each, _ in compiled)]  # type: ignore[misc,valid-type]
        if all(value is None for _, value in compiled):
            return tuple_type, None

        def elements(value: str) -> str:
            parts = [
                f"{value}[{i}]" if element is None else element(f"{value}[{i}]")
                for i, (_, element) in enumerate(compiled)
            ]
            return "(" + ", ".join(parts) + ",)"

        return tuple_type, elements
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        struct, build = _compiled(annotation)
        return struct, _call(build, "build_" + annotation.__name__)
    raise AssertionError(f"no compiled form for {annotation!r}")


_IMMUTABLE_DEFAULTS = (type(None), bool, int, str)


def _after_validators(
    model: type[BaseModel], allowed_before: frozenset[str]
) -> list[Callable[[Any], Any]]:
    """The ``after`` model validators of ``model``; AssertionError for any decorator the fast path
    cannot honour."""
    decorators = model.__pydantic_decorators__
    assert model.model_config.get("extra") == "forbid", f"{model.__name__} must forbid extra fields"
    unsupported = {
        "validators": decorators.validators,
        "root_validators": decorators.root_validators,
        "field_serializers": decorators.field_serializers,
        "model_serializers": decorators.model_serializers,
        "computed_fields": decorators.computed_fields,
    }
    assert not any(unsupported.values()), (
        f"{model.__name__} has decorators the compiled decoder does not run"
    )
    assert set(decorators.field_validators) <= allowed_before, (
        f"{model.__name__} has field validators the compiled decoder does not run"
    )
    after = []
    for name, decorator in decorators.model_validators.items():
        if decorator.info.mode == "after":
            after.append(decorator.func)
        else:
            assert name in allowed_before, (
                f"{model.__name__}.{name} is a {decorator.info.mode} validator the compiled decoder does not run"
            )
    return after


def _builder(
    model: type[BaseModel], overrides: dict[str, Any], allowed_before: frozenset[str] = frozenset()
) -> tuple[list[tuple[Any, ...]], Callable[[Any], Any]]:
    """The struct fields of ``model`` and the generated function turning a decoded struct into
    ``model``'s instance.

    The instance is made as pydantic's validator makes it — every field in ``__dict__`` in
    declaration order, ``__pydantic_fields_set__`` the fields the record named, no extra or private
    values — and then passed through the model's ``after`` validators. Generated code (one function
    per model, no loop over fields) because this runs for every block of every record."""
    struct_fields: list[tuple[Any, ...]] = []
    required: list[str] = []
    lines: list[str] = []
    entries: list[str] = []
    for name, info in model.model_fields.items():
        assert info.alias is None and info.validation_alias is None, (
            f"{model.__name__}.{name}: aliases are not compiled"
        )
        assert info.default_factory is None, (
            f"{model.__name__}.{name}: default factories are not compiled"
        )
        if name in overrides:
            field_type, value = overrides[name], None
        else:
            field_type, value = _compiled_type(info.annotation, list(info.metadata))
        decoded = f"decoded.{name}"
        if info.is_required():
            struct_fields.append((name, field_type))
            required.append(name)
            entries.append(f"{name!r}: {decoded if value is None else value(decoded)}")
            continue
        assert isinstance(info.default, _IMMUTABLE_DEFAULTS), (
            f"{model.__name__}.{name}: a mutable default is not compiled"
        )
        struct_fields.append((name, field_type | msgspec.UnsetType, msgspec.UNSET))
        default = _named(info.default, "default")
        lines += [
            f"    {name} = {decoded}",
            f"    if {name} is UNSET:",
            f"        {name} = {default}",
            "    else:",
            f"        fields_set.add({name!r})",
        ]
        if value is not None:
            lines.append(f"        {name} = {value(name)}")
        entries.append(f"{name!r}: {name}")
    validators = [
        _named(validate, f"after_{model.__name__}")
        for validate in _after_validators(model, allowed_before)
    ]
    model_name = _named(model, model.__name__)
    source = "\n".join(
        [
            "def build(decoded):",
            f"    fields_set = {set(required)!r}" if required else "    fields_set = set()",
            *lines,
            f"    instance = new({model_name})",
            "    set_attribute(instance, '__dict__', {" + ", ".join(entries) + "})",
            "    set_attribute(instance, '__pydantic_fields_set__', fields_set)",
            "    set_attribute(instance, '__pydantic_extra__', None)",
            "    set_attribute(instance, '__pydantic_private__', None)",
            *[f"    instance = {validate}(instance)" for validate in validators],
            "    return instance",
        ]
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<kv_decoder build {model.__name__}>", "exec"), _NAMESPACE, namespace)  # noqa: S102 - source generated above from the models
    return struct_fields, namespace["build"]


_COMPILED: dict[type[BaseModel], tuple[type[msgspec.Struct], Callable[[Any], Any]]] = {}


def _compiled(model: type[BaseModel]) -> tuple[type[msgspec.Struct], Callable[[Any], Any]]:
    """The struct generated from ``model`` and its builder (cached: nested models are shared)."""
    if model not in _COMPILED:
        struct_fields, build = _builder(model, {})
        struct = msgspec.defstruct(
            model.__name__, struct_fields, kw_only=True, forbid_unknown_fields=True, gc=False
        )
        _COMPILED[model] = (struct, build)
    return _COMPILED[model]


ENVELOPE_BEFORE_VALIDATORS = frozenset({"_typed_payload", "_rfc3339_text"})
"""The envelope's ``before`` validators, which the fast path stands in for: ``_typed_payload`` (the
payload is decoded with the model ``type`` names) and ``_rfc3339_text`` (``occurred_at`` must be
text, and the compiled decoder takes only text for a timestamp). A new one fails the import until it
is honoured here."""


def _envelope_decoder() -> tuple[msgspec.json.Decoder, Callable[[Any], Any]]:
    # The payload stays raw JSON, decoded by the struct of the model its ``type`` names.
    struct_fields, build = _builder(Envelope, {"payload": msgspec.Raw}, ENVELOPE_BEFORE_VALIDATORS)
    struct = msgspec.defstruct(
        "Envelope", struct_fields, kw_only=True, forbid_unknown_fields=True, gc=False
    )
    return msgspec.json.Decoder(struct), build


_ENVELOPE, _BUILD_ENVELOPE = _envelope_decoder()

FAST_TYPES: frozenset[str] = TYPES_BY_TOPIC[KV_EVENTS]
"""The event types the compiled decoder reads itself: the kv-events topic's (every other type goes to ``parse_event``)."""

_PAYLOADS: dict[str, tuple[msgspec.json.Decoder, Callable[[Any], Any]]] = {}
for _type in sorted(FAST_TYPES):
    _struct, _build = _compiled(EVENT_TYPES[_type])
    _PAYLOADS[_type] = (msgspec.json.Decoder(_struct), _build)

_REFUSED = (msgspec.DecodeError, msgspec.ValidationError, ValueError, AssertionError)
"""What the fast path's decoding and the contract's validators raise for a record they do not accept
(pydantic's ``ValidationError``, from the timestamp validator, is a ValueError)."""


def decode_fast(value: bytes) -> Envelope | None:
    """The envelope of ``value`` if the compiled decoder accepts it, else None (``parse_event``
    decides)."""
    try:
        decoded = _ENVELOPE.decode(value)
        payload_decoder = _PAYLOADS.get(decoded.type)
        if payload_decoder is None:
            return None
        decoder, build_payload = payload_decoder
        decoded.payload = build_payload(
            decoder.decode(decoded.payload)
        )  # the envelope's builder takes it as is
        envelope: Envelope = _BUILD_ENVELOPE(decoded)
    except _REFUSED:
        return None
    return envelope


def decode_kv_event(value: bytes) -> Envelope:
    """``parse_event(value)``, decoded by the compiled decoder when it can: the same envelope, or the same error."""
    envelope = decode_fast(value)
    if envelope is None:
        return parse_event(value)
    return envelope
