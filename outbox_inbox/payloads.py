"""Typed payloads: a handler's declared payload type (a dataclass or a pydantic model:
docs/concepts.md, "A typed payload"), decoding into it (`InvalidPayload`: dead at once as
``invalid_payload``), and plain JSON values of such objects for `publish` and `send` (`plain`)."""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

from .errors import ConfigurationError, InvalidPayload


def declared_payload_type(handler: Callable[..., Any], *, batch: bool = False) -> type | None:
    """The type a handler's ``payload`` parameter is annotated with (a `batch` handler: the
    ``T`` of ``payloads: list[T]`` or ``Sequence[T]``), or None without one. Raises
    ConfigurationError for a type that is neither a dataclass nor a pydantic model."""
    name = "payloads" if batch else "payload"
    try:
        parameters = inspect.signature(handler).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return None
    if name not in parameters:
        return None
    wanted = _hints(handler).get(name, inspect.Parameter.empty)
    if batch and wanted not in (inspect.Parameter.empty, Any):
        if typing.get_origin(wanted) not in (list, collections.abc.Sequence):
            raise ConfigurationError(
                f"the payloads of batch handler {getattr(handler, '__qualname__', handler)!r}"
                f" are annotated {wanted!r}: annotate them list[T] with T a dataclass or a"
                " pydantic model (or leave the annotation out)"
            )
        wanted = (typing.get_args(wanted) or (Any,))[0]
    if wanted in (inspect.Parameter.empty, Any):
        return None
    if isinstance(wanted, type) and (dataclasses.is_dataclass(wanted) or _is_pydantic(wanted)):
        return wanted
    what = "payloads of batch handler" if batch else "payload of handler"
    raise ConfigurationError(
        f"the {what} {getattr(handler, '__qualname__', handler)!r} is annotated {wanted!r}:"
        " annotate it with a dataclass or a pydantic model (or leave it out)"
    )


def decode(payload: Any, wanted: type) -> Any:
    """`payload` (JSON values) as an instance of `wanted`; InvalidPayload when it does not fit."""
    if _is_pydantic(wanted):
        try:
            return wanted.model_validate(payload)  # type: ignore[attr-defined]
        except Exception as exc:  # pydantic's ValidationError; pydantic is optional here
            raise InvalidPayload(f"payload is not a valid {wanted.__name__}: {exc}") from exc
    return _dataclass(payload, wanted, "payload")


def plain(payload: Any) -> Any:
    """`payload` as JSON values: a dataclass or a pydantic model is turned into its fields."""
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        return dataclasses.asdict(payload)
    dump = getattr(payload, "model_dump", None)
    if callable(dump) and not isinstance(payload, type):
        return dump(mode="json")
    return payload


def _is_pydantic(wanted: type) -> bool:
    return callable(getattr(wanted, "model_validate", None))


def _hints(thing: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(thing)
    except Exception as exc:  # a forward reference that does not resolve
        raise ConfigurationError(f"cannot read the annotations of {thing!r}: {exc}") from exc


def _dataclass(value: Any, wanted: type, path: str) -> Any:
    if not isinstance(value, dict):
        raise InvalidPayload(f"{path} must be a JSON object for {wanted.__name__}")
    hints = _hints(wanted)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(wanted):
        if not field.init:
            continue
        where = f"{path}.{field.name}"
        if field.name not in value:
            if field.default is dataclasses.MISSING is field.default_factory:  # required
                raise InvalidPayload(f"{where} is missing (required by {wanted.__name__})")
            continue
        values[field.name] = _value(value[field.name], hints.get(field.name, Any), where)
    return wanted(**values)


def _value(value: Any, wanted: Any, path: str) -> Any:
    """`value` checked against (and, for dataclasses, decoded into) the type `wanted`."""
    if wanted is Any:
        return value
    origin = typing.get_origin(wanted)
    if origin in (typing.Union, types.UnionType):
        return _union(value, typing.get_args(wanted), path)
    if isinstance(wanted, type) and dataclasses.is_dataclass(wanted):
        return _dataclass(value, wanted, path)
    if origin in (list, tuple, set, frozenset):
        if not isinstance(value, list):
            raise InvalidPayload(f"{path} must be a JSON array, got {_json_type(value)}")
        (item,) = typing.get_args(wanted)[:1] or (Any,)
        return origin(_value(v, item, f"{path}[{n}]") for n, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise InvalidPayload(f"{path} must be a JSON object, got {_json_type(value)}")
        item = (typing.get_args(wanted) or (str, Any))[1]
        return {k: _value(v, item, f"{path}.{k}") for k, v in value.items()}
    return _scalar(value, wanted, path)


def _union(value: Any, options: tuple[Any, ...], path: str) -> Any:
    if value is None and type(None) in options:
        return None
    problems = []
    for option in (o for o in options if o is not type(None)):
        try:
            return _value(value, option, path)
        except InvalidPayload as exc:
            problems.append(str(exc))
    raise InvalidPayload("; ".join(problems) or f"{path} must not be null")


def _scalar(value: Any, wanted: Any, path: str) -> Any:
    if wanted is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if wanted is int and isinstance(value, bool):
        raise InvalidPayload(f"{path} must be an integer, got a boolean")
    if isinstance(wanted, type) and wanted in (int, str, bool) and not isinstance(value, wanted):
        name = {int: "an integer", str: "a string", bool: "a boolean"}[wanted]
        raise InvalidPayload(f"{path} must be {name}, got {_json_type(value)}")
    return value  # other types are not checked: the handler gets the JSON value as it is


def _json_type(value: Any) -> str:
    scalars = {type(None): "null", bool: "a boolean", int: "a number", float: "a number"}
    names = {**scalars, str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)
