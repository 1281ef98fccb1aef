"""JSON schemas from Python signatures, and a small validator.

Two jobs, both needed without a network or a third-party validator:

* derive the schema a model sees for a tool from its typed signature
  (str/int/float/bool/None, list/tuple/set, dict, Optional/Union, Literal,
  Enum, TypedDict, dataclass), with the docstring as the description and
  Google-style ``Args:`` entries as parameter descriptions;
* validate a value against a schema (tool arguments from the model, and a
  run's final answer against its ``result_schema``) and convert validated
  arguments back into the declared Python types (dataclasses, TypedDicts,
  enums, tuples) before the tool is called.

The validator covers the JSON Schema subset models and result schemas use in
practice: type, enum, const, properties, required, additionalProperties,
items, anyOf/oneOf/allOf, min/max (Length, Items, imum), pattern.  Unknown
keywords are ignored, as the spec says.
"""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import enum
import inspect
import re
import types
import typing
from typing import Any, Callable, Literal, Mapping, Union, get_args, get_origin

from .errors import ToolSchemaError

__all__ = [
    "schema_for_type",
    "schema_for_function",
    "validate",
    "coerce",
    "parse_docstring",
    "MAX_SCHEMA_DEPTH",
]

# Recursive types (a dataclass containing itself) stop here instead of looping.
MAX_SCHEMA_DEPTH = 16
# Errors reported by one validation (a model that sends garbage gets a short list).
MAX_VALIDATION_ERRORS = 20

assert MAX_SCHEMA_DEPTH > 0 and MAX_VALIDATION_ERRORS > 0

_NoneType = type(None)


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__total__") and hasattr(tp, "__annotations__")


def schema_for_type(tp: Any, *, _depth: int = 0, _where: str = "value") -> dict[str, Any]:
    """The JSON schema of a Python type annotation."""
    if _depth > MAX_SCHEMA_DEPTH:
        raise ToolSchemaError(f"{_where}: type nests deeper than {MAX_SCHEMA_DEPTH} (recursive type?)")
    d = _depth + 1
    if tp is Any or tp is inspect.Parameter.empty:
        return {}
    if tp is _NoneType or tp is None:
        return {"type": "null"}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp in (list, tuple, set, frozenset):
        return {"type": "array"}
    if tp is dict:
        return {"type": "object"}
    origin = get_origin(tp)
    args = get_args(tp)
    if origin is typing.Annotated:
        base = schema_for_type(args[0], _depth=d, _where=_where)
        for extra in args[1:]:
            if isinstance(extra, str):
                base = {**base, "description": extra}
            elif isinstance(extra, Mapping):
                base = {**base, **extra}
        return base
    if origin is Literal:
        values = list(args)
        s: dict[str, Any] = {"enum": values}
        kinds = {type(v) for v in values}
        if len(kinds) == 1:
            k = kinds.pop()
            t = {str: "string", int: "integer", bool: "boolean", float: "number"}.get(k)
            if t:
                s["type"] = t
        return s
    if origin in (Union, types.UnionType):
        non_null = [a for a in args if a is not _NoneType]
        subs = [schema_for_type(a, _depth=d, _where=_where) for a in non_null]
        if len(non_null) < len(args):
            subs.append({"type": "null"})
        if len(subs) == 1:
            return subs[0]
        return {"anyOf": subs}
    if origin in (list, set, frozenset, cabc.Sequence, cabc.Iterable, cabc.Set):
        s = {"type": "array"}
        if args:
            s["items"] = schema_for_type(args[0], _depth=d, _where=_where)
        if origin in (set, frozenset, cabc.Set):
            s["uniqueItems"] = True
        return s
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": schema_for_type(args[0], _depth=d, _where=_where)}
        return {
            "type": "array",
            "prefixItems": [schema_for_type(a, _depth=d, _where=_where) for a in args],
            "minItems": len(args),
            "maxItems": len(args),
        }
    if origin in (dict, cabc.Mapping):
        s = {"type": "object"}
        if len(args) == 2:
            if args[0] is not str:
                raise ToolSchemaError(f"{_where}: dict keys must be str for JSON, got {args[0]!r}")
            s["additionalProperties"] = schema_for_type(args[1], _depth=d, _where=_where)
        return s
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [m.value for m in tp]
        return schema_for_type(Literal[tuple(values)], _depth=d, _where=_where) if values else {"enum": []}
    if _is_typeddict(tp):
        hints = typing.get_type_hints(tp, include_extras=True)
        required = sorted(getattr(tp, "__required_keys__", hints.keys()))
        props = {k: schema_for_type(v, _depth=d, _where=f"{_where}.{k}") for k, v in hints.items()}
        s = {"type": "object", "properties": props, "required": [k for k in hints if k in required], "additionalProperties": False}
        if tp.__doc__:
            s["description"] = inspect.cleandoc(tp.__doc__)
        return s
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp, include_extras=True)
        props = {}
        required = []
        for f in dataclasses.fields(tp):
            if not f.init:
                continue
            props[f.name] = schema_for_type(hints.get(f.name, Any), _depth=d, _where=f"{_where}.{f.name}")
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
        s = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        doc = tp.__doc__
        if doc and not doc.startswith(tp.__name__ + "("):  # skip the auto-generated signature doc
            s["description"] = inspect.cleandoc(doc)
        return s
    raise ToolSchemaError(f"{_where}: no JSON schema for type {tp!r}; give the tool an explicit schema")


_ARGS_HEADERS = ("args:", "arguments:", "parameters:", "params:")
_SECTION_HEADERS = ("returns:", "return:", "raises:", "yields:", "examples:", "example:", "notes:", "note:")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    desc: list[str] = []
    params: dict[str, str] = {}
    section = "desc"
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        low = stripped.lower()
        if low in _ARGS_HEADERS:
            section, current = "args", None
            continue
        if low in _SECTION_HEADERS:
            section, current = "other", None
            continue
        if section == "desc":
            desc.append(line)
        elif section == "args":
            m = re.match(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", stripped)
            if m and not line.startswith((" " * 8, "\t\t")):
                current = m.group(1).lstrip("*")
                params[current] = m.group(3).strip()
            elif current and stripped:
                params[current] = (params[current] + " " + stripped).strip()
    return "\n".join(desc).strip(), params


def schema_for_function(
    fn: Callable[..., Any], *, skip: Callable[[inspect.Parameter, Any], bool] | None = None
) -> tuple[str, dict[str, Any]]:
    """(description, parameters schema) for ``fn``'s signature and docstring.

    ``skip(param, annotation)`` excludes parameters the runtime supplies
    itself (the tool context).  ``*args``/``**kwargs`` are refused: a model
    cannot be told what to put in them.
    """
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as e:  # unresolvable forward reference: say which function
        raise ToolSchemaError(f"{getattr(fn, '__qualname__', fn)}: cannot resolve type hints: {e}") from e
    description, param_docs = parse_docstring(inspect.getdoc(fn))
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, p in sig.parameters.items():
        ann = hints.get(name, p.annotation)
        if skip is not None and skip(p, ann):
            continue
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise ToolSchemaError(f"{fn.__qualname__}: *{name} cannot be described to a model")
        s = dict(schema_for_type(ann, _where=f"{fn.__qualname__}({name})"))
        if name in param_docs and "description" not in s:
            s["description"] = param_docs[name]
        if p.default is inspect.Parameter.empty:
            required.append(name)
        elif _jsonable(p.default):
            s["default"] = p.default
        props[name] = s
    schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return description, schema


def _jsonable(v: Any) -> bool:
    if v is None or isinstance(v, (str, bool, int, float)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_jsonable(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _jsonable(x) for k, x in v.items())
    return False


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, (list, tuple)),
    "object": lambda v: isinstance(v, dict),
}


def validate(value: Any, schema: Mapping[str, Any] | bool, *, path: str = "$") -> list[str]:
    """Errors (empty when valid) of ``value`` against ``schema``, each with its JSON path."""
    errors: list[str] = []
    _validate(value, schema, path, errors)
    return errors[:MAX_VALIDATION_ERRORS]


def _validate(v: Any, s: Mapping[str, Any] | bool, path: str, out: list[str]) -> None:
    if len(out) >= MAX_VALIDATION_ERRORS:
        return
    if s is True or s is None:
        return
    if s is False:
        out.append(f"{path}: no value is allowed here")
        return
    t = s.get("type")
    if t is not None:
        ts = [t] if isinstance(t, str) else list(t)
        if not any(_TYPE_CHECKS.get(x, lambda _v: True)(v) for x in ts):
            out.append(f"{path}: expected {' or '.join(ts)}, got {type(v).__name__}")
            return
    if "enum" in s and not any(_json_equal(v, e) for e in s["enum"]):
        out.append(f"{path}: {v!r} is not one of {list(s['enum'])!r}")
    if "const" in s and not _json_equal(v, s["const"]):
        out.append(f"{path}: must equal {s['const']!r}")
    if isinstance(v, str):
        if "minLength" in s and len(v) < s["minLength"]:
            out.append(f"{path}: shorter than {s['minLength']}")
        if "maxLength" in s and len(v) > s["maxLength"]:
            out.append(f"{path}: longer than {s['maxLength']}")
        if "pattern" in s and re.search(s["pattern"], v) is None:
            out.append(f"{path}: does not match {s['pattern']!r}")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in s and v < s["minimum"]:
            out.append(f"{path}: below minimum {s['minimum']}")
        if "maximum" in s and v > s["maximum"]:
            out.append(f"{path}: above maximum {s['maximum']}")
        if "exclusiveMinimum" in s and v <= s["exclusiveMinimum"]:
            out.append(f"{path}: not above {s['exclusiveMinimum']}")
        if "exclusiveMaximum" in s and v >= s["exclusiveMaximum"]:
            out.append(f"{path}: not below {s['exclusiveMaximum']}")
    if isinstance(v, (list, tuple)):
        if "minItems" in s and len(v) < s["minItems"]:
            out.append(f"{path}: fewer than {s['minItems']} items")
        if "maxItems" in s and len(v) > s["maxItems"]:
            out.append(f"{path}: more than {s['maxItems']} items")
        prefix = s.get("prefixItems") or []
        for i, item in enumerate(v):
            if i < len(prefix):
                _validate(item, prefix[i], f"{path}[{i}]", out)
            elif "items" in s:
                _validate(item, s["items"], f"{path}[{i}]", out)
        if s.get("uniqueItems"):
            seen: list[Any] = []
            for item in v:
                if any(_json_equal(item, x) for x in seen):
                    out.append(f"{path}: items are not unique")
                    break
                seen.append(item)
    if isinstance(v, dict):
        props = s.get("properties") or {}
        for k in s.get("required") or []:
            if k not in v:
                out.append(f"{path}: missing required property {k!r}")
        addl = s.get("additionalProperties", True)
        for k, item in v.items():
            if k in props:
                _validate(item, props[k], f"{path}.{k}", out)
            elif addl is False:
                out.append(f"{path}: unexpected property {k!r}")
            elif isinstance(addl, Mapping):
                _validate(item, addl, f"{path}.{k}", out)
    if "allOf" in s:
        for sub in s["allOf"]:
            _validate(v, sub, path, out)
    if "anyOf" in s:
        if not any(not validate(v, sub, path=path) for sub in s["anyOf"]):
            out.append(f"{path}: matches none of anyOf")
    if "oneOf" in s:
        n = sum(1 for sub in s["oneOf"] if not validate(v, sub, path=path))
        if n != 1:
            out.append(f"{path}: matches {n} of oneOf (exactly one required)")
    if "not" in s and not validate(v, s["not"], path=path):
        out.append(f"{path}: matches a schema it must not")


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def coerce(value: Any, tp: Any) -> Any:
    """Turn a validated JSON value into the declared Python type (best effort).

    Dataclasses are constructed, enums looked up, tuples/sets built; anything
    else is passed through unchanged (JSON values already are the types).
    """
    if tp is Any or tp is inspect.Parameter.empty or value is None:
        return value
    origin = get_origin(tp)
    args = get_args(tp)
    if origin is typing.Annotated:
        return coerce(value, args[0])
    if origin in (Union, types.UnionType):
        for a in args:
            if a is _NoneType:
                continue
            try:
                if not validate(value, schema_for_type(a)):
                    return coerce(value, a)
            except ToolSchemaError:
                continue
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type) and isinstance(value, dict):
        hints = typing.get_type_hints(tp)
        return tp(**{k: coerce(v, hints.get(k, Any)) for k, v in value.items()})
    if _is_typeddict(tp) and isinstance(value, dict):
        hints = typing.get_type_hints(tp)
        return {k: coerce(v, hints.get(k, Any)) for k, v in value.items()}
    if origin in (list, cabc.Sequence, cabc.Iterable) and isinstance(value, (list, tuple)):
        return [coerce(x, args[0]) if args else x for x in value]
    if origin in (set, frozenset) and isinstance(value, (list, tuple)):
        return origin(coerce(x, args[0]) if args else x for x in value)
    if tp in (set, frozenset, tuple) and isinstance(value, (list, tuple)):
        return tp(value)
    if origin is tuple and isinstance(value, (list, tuple)):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(x, args[0]) for x in value)
        return tuple(coerce(x, a) for x, a in zip(value, args))
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return {k: coerce(v, args[1]) for k, v in value.items()}
    return value
