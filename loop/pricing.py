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
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

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
]

# Prices are quoted per million tokens (as every vendor quotes them).
TOKENS_PER_PRICE_UNIT = 1_000_000
# A sanity bound on one price: a billion currency units per million tokens. A value past it
# is a unit mistake (dollars given as micro-dollars per token...), not a price.
MAX_PRICE_MICROS = 10**15
# Entries in one runtime's pricing table (it catches a table built by mistake, e.g. per run).
MAX_PRICING_ENTRIES = 10_000

assert TOKENS_PER_PRICE_UNIT > 0 and MAX_PRICE_MICROS > 0 and MAX_PRICING_ENTRIES > 0


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
