"""Model prices, and the cost of a model call in integer micro-units (promise 10).

A cost ceiling (``limits={"max_cost_micros": n}``) is only a promise if the
loop knows what a call costs, so every model step records ``cost_micros``
beside its tokens and the pre-flight reserve estimates it.  What a model
costs is configuration, not code: vendor price lists change and a table
here would go stale silently, so the :class:`~loop.runtime.Runtime` takes
``pricing={key: Price(...)}`` (the one place that sees every agent, and the
agents a worker rebuilds from a run's record too) and looks a model up by,
most specific first:

* a spec string's text as written (``openai:llama3@http://gpu:8000/v1``),
  then its canonical form, then ``provider:MODEL`` without the base URL
  (``anthropic:claude-sonnet-4-5``), then the bare ``MODEL``;
* a provider object's ``name`` (``anthropic:MODEL`` for the HTTP providers,
  ``scripted`` / ``echo`` for the offline ones), then its ``model``.

The offline models (``echo``, :class:`~loop.providers.ScriptedModel`) cost
nothing unless priced explicitly (a test may price ``"scripted"``).  Any
other model without an entry has *no* price: a run with a cost ceiling is
then refused (see ``Runtime.submit``), never run unenforced.

Units: a :class:`Price` field is micro-units of currency per **million**
tokens of the usage field of the same name, so $3 per million input tokens
is ``Price(input_tokens=3_000_000)``.  Usage follows the loop's normalised
convention (:class:`~loop.providers.Usage`): ``input_tokens`` are the
uncached input tokens, ``cache_read_tokens`` / ``cache_write_tokens`` are
billed separately (Anthropic reports it that way; the OpenAI provider
subtracts ``cached_tokens`` from ``prompt_tokens`` to match).

Arithmetic is integer only: a step's cost is the sum of tokens × price over
the fields, divided by one million and rounded **up** once (never in the
caller's favour, never float drift; the same usage always costs the same,
so a retried usage record finds identical figures).

A pricing file (``surefoot serve|run --pricing FILE``, or the path in
``SUREFOOT_PRICING`` when the flag is absent; :func:`load_pricing`) is one
UTF-8 JSON object, model key -> its :class:`Price` fields, each an integer of
micro-units per million tokens (omitted fields are 0)::

    {
      "anthropic:claude-sonnet-4-5": {"input_tokens": 3000000, "output_tokens": 15000000,
                                      "cache_read_tokens": 300000, "cache_write_tokens": 3750000},
      "openai:llama3": {"input_tokens": 200000, "output_tokens": 200000}
    }

Keys are looked up exactly as ``Runtime(pricing=...)`` keys are (above).  Integers
only, as :class:`Price`: ``3.0``, ``"3.00"`` and ``"$3"`` are refused, not
converted (a decimal or currency string is where a unit mistake hides).  A
file that is not JSON, not an object, repeats a key, names an unknown field
or carries a bad value is refused whole with :class:`PricingFileError`
naming the file, the key and the field; the commands check it before they
open any storage.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .errors import LoopError

__all__ = [
    "Price",
    "FREE",
    "cost_micros",
    "estimate_cost_micros",
    "price_for",
    "check_pricing",
    "PRICED_FIELDS",
    "TOKENS_PER_PRICE_UNIT",
    "MAX_PRICE_MICROS",
    "MAX_PRICING_ENTRIES",
    "model_label",
    "PricingFileError",
    "load_pricing",
    "parse_pricing",
    "pricing_from_option",
    "PRICING_ENV",
    "PRICING_OPTION_HELP",
    "MAX_PRICING_FILE_BYTES",
]

# Prices are quoted per million tokens (as every vendor quotes them).
TOKENS_PER_PRICE_UNIT = 1_000_000
# A sanity bound on one price: a billion currency units per million tokens. A value past it
# is a unit mistake (dollars given as micro-dollars per token...), not a price.
MAX_PRICE_MICROS = 10**15
# Entries in one runtime's pricing table (it catches a table built by mistake, e.g. per run).
MAX_PRICING_ENTRIES = 10_000

# A pricing file larger than this is not a price list (MAX_PRICING_ENTRIES entries of four
# fields fit in well under a megabyte): refused before it is parsed.
MAX_PRICING_FILE_BYTES = 4 * 1024 * 1024
#: The environment variable naming a pricing file, used when ``--pricing`` is absent.
PRICING_ENV = "SUREFOOT_PRICING"
#: ``--pricing``'s help, the same on every command that takes it (argparse: no bare percent signs).
PRICING_OPTION_HELP = (
    "JSON file of model prices, needed for a cost ceiling (max_cost_micros) on any model but the free "
    'echo: {"MODEL_KEY": {"input_tokens": N, "output_tokens": N, "cache_read_tokens": N, '
    '"cache_write_tokens": N}, ...}, each N an integer of micro-units per million tokens ($3/MTok = 3000000; '
    "omitted fields 0). MODEL_KEY: the model spec as written, provider:MODEL, or MODEL. "
    f"Default: the file named by ${PRICING_ENV}, if set"
)

assert TOKENS_PER_PRICE_UNIT > 0 and MAX_PRICE_MICROS > 0 and MAX_PRICING_ENTRIES > 0
assert MAX_PRICING_FILE_BYTES > 0


@dataclass(frozen=True)
class Price:
    """Micro-units of currency per million tokens, per usage field (all default 0).

    ``Price(input_tokens=3_000_000, output_tokens=15_000_000,
    cache_read_tokens=300_000, cache_write_tokens=3_750_000)`` is $3 / $15 /
    $0.30 / $3.75 per million tokens.  A negative, fractional, boolean or
    absurdly large value is a ``ValueError`` naming the field.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"Price.{f.name} must be an int of micro-units per million tokens, got {v!r}")
            if v < 0:
                raise ValueError(f"Price.{f.name} must not be negative, got {v}")
            if v > MAX_PRICE_MICROS:
                raise ValueError(f"Price.{f.name} = {v} is past {MAX_PRICE_MICROS} micro-units per million "
                                 "tokens: a unit mistake?")


#: The offline models' price (and any model priced at nothing).
FREE = Price()

#: The usage fields a price applies to (the Price's fields, in order).
PRICED_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Price))


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def cost_micros(price: Price, usage: Mapping[str, Any]) -> int:
    """The cost of one call's ``usage`` at ``price``, in micro-units, rounded up.

    Fields of ``usage`` a price does not name (``cost_micros`` itself, provider
    extras) are ignored; a priced field that is not a non-negative int is a
    ``ValueError`` (a usage record must never be guessed at)."""
    total = 0
    for name in PRICED_FIELDS:
        n = usage.get(name, 0)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"usage field {name!r} must be a non-negative int, got {n!r}")
        total += n * getattr(price, name)
    return _ceil_div(total, TOKENS_PER_PRICE_UNIT)


def estimate_cost_micros(price: Price, input_tokens: int, output_tokens: int) -> int:
    """The pre-flight estimate of a call: the input estimate at the input price plus the
    output estimate at the output price (cache discounts are not assumed), rounded up."""
    return cost_micros(price, {"input_tokens": max(0, input_tokens), "output_tokens": max(0, output_tokens)})


def check_pricing(pricing: Mapping[str, Price] | None) -> dict[str, Price]:
    """A runtime's pricing table, checked: non-empty string keys, :class:`Price` values."""
    if pricing is None:
        return {}
    if not isinstance(pricing, Mapping):
        raise ValueError(f"pricing is a mapping of model -> Price, got {type(pricing).__name__}")
    if len(pricing) > MAX_PRICING_ENTRIES:
        raise ValueError(f"at most {MAX_PRICING_ENTRIES} pricing entries")
    out: dict[str, Price] = {}
    for k, v in pricing.items():
        if not isinstance(k, str) or not k.strip():
            raise ValueError(f"a pricing key is a model name or spec string, got {k!r}")
        if not isinstance(v, Price):
            raise ValueError(f"pricing[{k!r}] must be a loop.Price, got {type(v).__name__}")
        out[k.strip()] = v
    return out


def _keys_for(model: Any) -> list[str]:
    """Lookup keys for a model spec string or provider object, most specific first."""
    if isinstance(model, str):
        from .providers import parse_model_spec  # (providers import nothing of this module)

        keys = [model.strip()]
        try:
            ms = parse_model_spec(model)
        except Exception:  # noqa: BLE001 — a bad spec fails where the provider is made; no price here
            return keys
        keys.append(str(ms))
        if ms.model is not None:
            keys += [f"{ms.kind}:{ms.model}", ms.model]
        return keys
    keys = []
    for attr in ("name", "model"):
        v = getattr(model, attr, None)
        if isinstance(v, str) and v:
            keys.append(v)
    return keys


def model_label(model: Any) -> str:
    """How an error names a model: its spec string, else its provider's name."""
    if isinstance(model, str):
        return model
    return str(getattr(model, "name", None) or type(model).__name__)


def price_for(pricing: Mapping[str, Price], model: Any) -> Price | None:
    """The price of ``model`` (a spec string or provider object) in ``pricing``; :data:`FREE`
    for an unpriced offline model; None when it has no price."""
    keys = _keys_for(model)
    for k in keys:
        p = pricing.get(k)
        if p is not None:
            return p
    from .providers import EchoModel, ScriptedModel

    if isinstance(model, (EchoModel, ScriptedModel)) or (isinstance(model, str) and model.strip() == "echo"):
        return FREE
    return None


# ---------------------------------------------------------------------- pricing files


class PricingFileError(LoopError, ValueError):
    """A pricing file cannot be used: unreadable, not JSON, or not a valid table.  The
    message names the file and, for a bad entry, its key and field: it is what a command
    prints (one line) before it exits without opening anything."""


_INTEGERS_ONLY = "integers only ($3 per million tokens is 3000000; no decimals, no currency strings)"


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a key given twice is refused (json keeps the last one silently, and a
    price list with two prices for one model is a mistake whichever the author meant)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise PricingFileError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _parse_entry(key: str, entry: Any) -> Price:
    """One entry's :class:`Price`; its field values are checked by ``Price`` itself."""
    if not isinstance(entry, dict):
        raise PricingFileError(f"{key!r} must be an object of usage field -> int (fields: "
                               f"{', '.join(PRICED_FIELDS)}), got {json.dumps(entry)}")
    unknown = [f for f in entry if f not in PRICED_FIELDS]
    if unknown:
        raise PricingFileError(f"{key!r}: unknown field {unknown[0]!r} (fields: {', '.join(PRICED_FIELDS)})")
    try:
        return Price(**entry)
    except ValueError as e:
        hint = f" — {_INTEGERS_ONLY}" if "must be an int" in str(e) else ""
        raise PricingFileError(f"{key!r}: {e}{hint}") from None


def parse_pricing(text: str) -> dict[str, Price]:
    """A pricing table from a pricing file's text (the format is in the module docstring).

    Raises :class:`PricingFileError` naming the key and field of the first bad entry."""
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except PricingFileError:
        raise
    except ValueError as e:  # JSONDecodeError, or an integer past the interpreter's digit limit
        raise PricingFileError(f"not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise PricingFileError("must be a JSON object of model key -> {field: int micro-units per million "
                               f"tokens}}, got {type(doc).__name__ if doc is not None else 'null'}")
    table = {k: _parse_entry(k, v) for k, v in doc.items()}
    try:
        out = check_pricing(table)  # the runtime's own checks of the table: keys, size
    except ValueError as e:
        raise PricingFileError(str(e)) from None
    if len(out) != len(table):
        # check_pricing strips keys: "gpt" and " gpt " are one key, priced twice
        raise PricingFileError("two keys are the same model key once surrounding spaces are removed: "
                               + ", ".join(repr(k) for k in table if k != k.strip()))
    return out


def load_pricing(path: str | os.PathLike[str]) -> dict[str, Price]:
    """The pricing table in the JSON file at ``path`` (format: the module docstring).

    Every problem is a :class:`PricingFileError` whose message starts with the file's name:
    unreadable, larger than :data:`MAX_PRICING_FILE_BYTES`, not UTF-8, not JSON, not an
    object, a repeated key, an entry that is not an object, an unknown field, a value that
    is not a non-negative int within :data:`MAX_PRICE_MICROS` (``Price``'s own check)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            raw = f.read(MAX_PRICING_FILE_BYTES + 1)
    except OSError as e:
        raise PricingFileError(f"pricing file {name!r}: cannot read it: {e.strerror or e}") from None
    if len(raw) > MAX_PRICING_FILE_BYTES:
        raise PricingFileError(f"pricing file {name!r}: larger than {MAX_PRICING_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8-sig")  # a BOM some editors write is not worth refusing
    except UnicodeDecodeError as e:
        raise PricingFileError(f"pricing file {name!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return parse_pricing(text)
    except PricingFileError as e:
        raise PricingFileError(f"pricing file {name!r}: {e}") from None


def pricing_from_option(path: str | None, environ: Mapping[str, str] | None = None) -> dict[str, Price]:
    """The pricing table a command runs with: ``--pricing PATH`` when given, else the file
    named by ``$SUREFOOT_PRICING`` (unset or empty: no table, so only the offline models
    are priced).  Raises :class:`PricingFileError` (the env var named when it was the source)."""
    if path is not None:
        return load_pricing(path)
    env = os.environ if environ is None else environ
    from_env = env.get(PRICING_ENV, "").strip()
    if not from_env:
        return {}
    try:
        return load_pricing(from_env)
    except PricingFileError as e:
        raise PricingFileError(f"{e} (from ${PRICING_ENV})") from None
