"""What a request to the admin endpoint carries, decoded into its type: the query string and
the JSON body, each field checked. Anything else is a :class:`BadRequest` (400) naming the
parameter or field at fault, so that an operator's typo is told, not ignored."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec
from aiohttp import web

T = TypeVar("T")


class BadRequest(Exception):
    """A query parameter or body field is invalid: 400, naming it."""

    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


def decode_query(request: web.Request, t: type[T]) -> T:
    """The query string as a ``t``: unknown, repeated or invalid parameters are a 400 naming
    the parameter (values are strings; numbers are converted)."""
    allowed = _field_names(t)
    given: dict[str, str] = {}
    for key in request.query:
        if key not in allowed:
            raise BadRequest(f"unknown query parameter {key!r}"
                             + (f"; this route takes {', '.join(allowed)}" if allowed
                                else "; this route takes none"), key)
        values = request.query.getall(key)
        if len(values) > 1:
            raise BadRequest(f"query parameter {key!r} is given {len(values)} times; give it "
                             "once", key)
        given[key] = values[0]
    return _convert(given, t, strict=False)


async def decode_body(request: web.Request, t: type[T]) -> T:
    """The JSON body as a ``t``: anything else is a 400 naming the field at fault."""
    raw = await request.read()
    if not raw.strip():
        raise BadRequest("a JSON body is required (Content-Type: application/json)")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}"[:300]) from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {_json_type(body)}")
    known = _field_names(t)
    for key in body:
        if key not in known:
            raise BadRequest(f"unknown field {key!r}; fields: {', '.join(known)}", key)
    # JSON Schema counts 3.0 as an integer; the types (and Python) would not
    body = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in body.items()}
    return _convert(body, t, strict=True)


def _field_names(t: type) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(t)]


def _convert(values: dict[str, Any], t: type[T], *, strict: bool) -> T:
    try:
        return msgspec.convert(values, t, strict=strict)
    except msgspec.ValidationError as exc:
        field = str(exc).rpartition("at `$.")[2].rstrip("`") if "at `$." in str(exc) else None
        if field is None or field not in values:
            raise BadRequest(str(exc)) from None
        raise BadRequest(f"{field} must be {_expected(t, field)}, got {values[field]!r}"[:200],
                         field) from None


def _expected(t: type, field: str) -> str:
    """What a field accepts, in words, from its type (constraints included)."""
    info = next(f for f in msgspec.inspect.type_info(t).fields  # type: ignore[union-attr]
                if f.encode_name == field).type
    if isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):
        info = next(x for x in info.types if not isinstance(x, msgspec.inspect.UnsetType))
    if isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.IntType):
        if info.ge is not None and info.le is not None:
            return f"an integer from {info.ge} to {info.le}"
        return "an integer"
    if isinstance(info, msgspec.inspect.StrType):
        return "a string"
    return "valid"


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
