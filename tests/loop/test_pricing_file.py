"""Pricing files (loop.pricing.load_pricing) and ``surefoot run --pricing`` as a user runs it.

The loader is checked on real files in tmp_path; the command in real subprocesses on a real
data directory, with the offline echo model priced explicitly and with an OpenAI-compatible
model served by the fake provider (a local HTTP server speaking the real wire format), so the
recorded cost can be compared with what the file's price says, to the micro-unit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from fake_providers import FakeReply
from loop import Price
from loop.errors import LoopError
from loop.pricing import (
    MAX_PRICE_MICROS,
    MAX_PRICING_ENTRIES,
    MAX_PRICING_FILE_BYTES,
    PRICED_FIELDS,
    PRICING_ENV,
    PricingFileError,
    cost_micros,
    load_pricing,
    pricing_from_option,
)

REPO = Path(__file__).resolve().parent.parent.parent
SONNET = {"input_tokens": 3_000_000, "output_tokens": 15_000_000, "cache_read_tokens": 300_000,
          "cache_write_tokens": 3_750_000}


def write(tmp_path: Path, content: str | bytes, name: str = "prices.json") -> Path:
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return p


# ---------------------------------------------------------------------- the loader


def test_a_valid_file_round_trips_every_value(tmp_path):
    doc = {
        "anthropic:claude-sonnet-4-5": SONNET,
        "openai:llama3@http://gpu:8000/v1": {"input_tokens": 200_000, "output_tokens": 250_000},
        "gpt-4o-mini": {"output_tokens": 600_000},
        "echo": {},
        "huge": {"input_tokens": MAX_PRICE_MICROS},
    }
    table = load_pricing(write(tmp_path, json.dumps(doc, indent=2)))
    assert set(table) == set(doc)
    for key, fields in doc.items():
        assert table[key] == Price(**fields), key
        # omitted fields are 0; given ones are exactly the integers written
        assert {f: getattr(table[key], f) for f in PRICED_FIELDS} == {f: fields.get(f, 0) for f in PRICED_FIELDS}
    assert cost_micros(table["anthropic:claude-sonnet-4-5"], {"input_tokens": 1_000, "output_tokens": 100}) == 4_500
    # a path-like works, a UTF-8 BOM is tolerated, an empty object is an empty table
    assert load_pricing(write(tmp_path, b"\xef\xbb\xbf" + json.dumps({"m": SONNET}).encode(), "bom.json")) == {
        "m": Price(**SONNET)}
    assert load_pricing(str(write(tmp_path, "{}", "empty.json"))) == {}


BAD = [
    # (file content, words the message must contain)
    ("{not json", ["not valid JSON", "line 1"]),
    ("", ["not valid JSON"]),
    ('[{"input_tokens": 1}]', ["must be a JSON object", "got list"]),
    ("null", ["must be a JSON object", "got null"]),
    ('{"gpt": 3000000}', ["'gpt'", "must be an object of usage field", "input_tokens"]),
    ('{"gpt": {"input": 3}}', ["'gpt'", "unknown field 'input'", "input_tokens, output_tokens"]),
    ('{"gpt": {"input_tokens": 3, "total_tokens": 9}}', ["'gpt'", "unknown field 'total_tokens'"]),
    ('{"gpt": {"output_tokens": -1}}', ["'gpt'", "output_tokens", "negative"]),
    ('{"gpt": {"input_tokens": 3.5}}', ["'gpt'", "input_tokens", "3.5", "integers only"]),
    ('{"gpt": {"input_tokens": 3000000.0}}', ["'gpt'", "input_tokens", "integers only"]),
    ('{"gpt": {"input_tokens": "3.00"}}', ["'gpt'", "input_tokens", "'3.00'", "integers only"]),
    ('{"gpt": {"input_tokens": "$3"}}', ["'gpt'", "input_tokens", "integers only"]),
    ('{"gpt": {"cache_read_tokens": true}}', ["'gpt'", "cache_read_tokens", "True"]),
    ('{"gpt": {"input_tokens": null}}', ["'gpt'", "input_tokens", "None"]),
    ('{"gpt": {"input_tokens": NaN}}', ["'gpt'", "input_tokens", "integers only"]),
    (json.dumps({"gpt": {"cache_write_tokens": MAX_PRICE_MICROS + 1}}), ["'gpt'", "cache_write_tokens", "unit mistake"]),
    ('{"gpt": {"input_tokens": 1}, "gpt": {"input_tokens": 2}}', ["duplicate key 'gpt'"]),
    ('{"gpt": {"input_tokens": 1}, " gpt ": {"input_tokens": 2}}', ["same model key", "' gpt '"]),
    ('{"": {"input_tokens": 1}}', ["pricing key", "''"]),
    ('{"   ": {}}', ["pricing key"]),
]


@pytest.mark.parametrize("content,words", BAD, ids=[b[0][:40] for b in BAD])
def test_each_bad_input_is_refused_naming_the_problem(tmp_path, content, words):
    path = write(tmp_path, content)
    with pytest.raises(PricingFileError) as info:
        load_pricing(path)
    msg = str(info.value)
    assert msg.startswith(f"pricing file {str(path)!r}: "), msg
    for w in words:
        assert w in msg, (w, msg)
    assert "\n" not in msg  # one line on a terminal
    # it fits the loop's hierarchy and is still the ValueError that check_pricing/Price raise
    assert isinstance(info.value, LoopError) and isinstance(info.value, ValueError)


def test_unreadable_oversized_and_non_utf8_files_are_refused(tmp_path):
    with pytest.raises(PricingFileError, match="cannot read it: No such file"):
        load_pricing(tmp_path / "missing.json")
    with pytest.raises(PricingFileError, match="cannot read it"):
        load_pricing(tmp_path)  # a directory
    with pytest.raises(PricingFileError, match=f"larger than {MAX_PRICING_FILE_BYTES} bytes"):
        load_pricing(write(tmp_path, b" " * (MAX_PRICING_FILE_BYTES + 1), "big.json"))
    with pytest.raises(PricingFileError, match="not UTF-8"):
        load_pricing(write(tmp_path, b'{"m\xff": {}}', "latin.json"))
    with pytest.raises(PricingFileError, match="not valid JSON"):
        load_pricing(write(tmp_path, '{"m": {"input_tokens": ' + "9" * 5000 + "}}", "digits.json"))
    many = {f"m{i}": {} for i in range(MAX_PRICING_ENTRIES + 1)}
    with pytest.raises(PricingFileError, match=f"at most {MAX_PRICING_ENTRIES}"):
        load_pricing(write(tmp_path, json.dumps(many), "many.json"))


def test_the_flag_wins_over_the_environment_variable(tmp_path):
    a = write(tmp_path, json.dumps({"a": {"input_tokens": 1}}), "a.json")
    b = write(tmp_path, json.dumps({"b": {"input_tokens": 2}}), "b.json")
    assert pricing_from_option(str(a), {PRICING_ENV: str(b)}) == {"a": Price(input_tokens=1)}
    assert pricing_from_option(None, {PRICING_ENV: str(b)}) == {"b": Price(input_tokens=2)}
    assert pricing_from_option(None, {}) == {}
    assert pricing_from_option(None, {PRICING_ENV: "  "}) == {}  # set but empty: unset
    # the flag's good file is used even when the environment names a bad one (never read)
    assert pricing_from_option(str(a), {PRICING_ENV: str(tmp_path / "missing.json")}) == {"a": Price(input_tokens=1)}
    with pytest.raises(PricingFileError, match=r"missing\.json.*\(from \$SUREFOOT_PRICING\)"):
        pricing_from_option(None, {PRICING_ENV: str(tmp_path / "missing.json")})


# ---------------------------------------------------------------------- surefoot run --pricing


def surefoot(*args: str, data: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "loop.cli", args[0], "--data", str(data), *args[1:]]
    full_env = {k: v for k, v in os.environ.items() if k != PRICING_ENV}
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, env=full_env,
                          stdin=subprocess.DEVNULL)


def run_usage(data: Path) -> list[dict]:
    r = surefoot("inspect", "--json", "main", data=data)
    assert r.returncode == 0, r.stderr
    return [x["usage"] for x in json.loads(r.stdout)["runs"]]


def test_run_prices_the_echo_model_from_the_flag_or_the_environment(tmp_path):
    """echo is free unless priced: priced explicitly, each run records tokens x the file's price
    (rounded up once); the flag's file wins over $SUREFOOT_PRICING's; a ceiling below the
    estimate stops the run before the call."""
    data = tmp_path / "d"
    flag = write(tmp_path, json.dumps({"echo": {"input_tokens": 7_000_000, "output_tokens": 11_000_000}}), "flag.json")
    env = write(tmp_path, json.dumps({"echo": {"input_tokens": 1_000_000}}), "env.json")

    r = surefoot("run", "--pricing", str(flag), "--max-cost-micros", "1000000", "hello", data=data,
                 env={PRICING_ENV: str(env)})
    assert r.returncode == 0, r.stderr
    assert "You said: hello" in r.stdout
    r = surefoot("run", "hello again", data=data, env={PRICING_ENV: str(env)})
    assert r.returncode == 0, r.stderr
    r = surefoot("run", "free now", data=data)
    assert r.returncode == 0, r.stderr

    first, second, third = run_usage(data)
    assert first["input_tokens"] > 0 and first["output_tokens"] > 0
    assert first["cost_micros"] == 7 * first["input_tokens"] + 11 * first["output_tokens"]
    assert second["cost_micros"] == second["input_tokens"]  # $SUREFOOT_PRICING's price
    assert "cost_micros" not in third and third["input_tokens"] > 0  # no pricing: echo is free
    r = surefoot("inspect", "main", data=data)
    assert f"cost {first['cost_micros']} micros" in r.stdout

    # a ceiling the first call's estimate would pass: the call is not made, the run fails usage_limit
    r = surefoot("run", "--pricing", str(flag), "--max-cost-micros", "10", "too dear", data=data)
    assert r.returncode == 1 and "usage_limit" in r.stdout and "past its ceiling of 10" in r.stdout, r.stdout


async def test_run_prices_an_openai_model_exactly(tmp_path, fake_server):
    """A model that needs a price: without one a cost ceiling is refused before anything is
    opened; with the file the run completes and costs exactly the provider's usage x price."""
    data = tmp_path / "d"
    model = f"openai:gpt-test@{fake_server.base_url}/v1"
    prices = write(tmp_path, json.dumps({"openai:gpt-test": {"input_tokens": 3_000_000, "output_tokens": 15_000_000}}))
    env = {"OPENAI_API_KEY": ""}

    r = await trio.to_thread.run_sync(lambda: surefoot("run", "--model", model, "--max-cost-micros", "5000", "hi",
                                                       data=data, env=env))
    assert r.returncode == 2 and "needs a price for model" in r.stderr and "gpt-test" in r.stderr, r.stderr
    assert not data.exists() and fake_server.requests == []

    fake_server.enqueue(FakeReply(text="priced answer", input_tokens=11, output_tokens=7))
    r = await trio.to_thread.run_sync(lambda: surefoot("run", "--model", model, "--pricing", str(prices),
                                                       "--max-cost-micros", "5000", "hi", data=data, env=env))
    assert r.returncode == 0, r.stderr
    assert "priced answer" in r.stdout and len(fake_server.requests) == 1
    (usage,) = await trio.to_thread.run_sync(run_usage, data)
    assert usage["input_tokens"] == 11 and usage["output_tokens"] == 7
    assert usage["cost_micros"] == 11 * 3 + 7 * 15 == 138


@pytest.mark.parametrize("how,content,words", [
    ("flag", '{"echo": {"input_tokens": 2.5}}', ["'echo'", "input_tokens", "integers only"]),
    ("env", '{"echo": {"inptu_tokens": 2}}', ["'echo'", "unknown field 'inptu_tokens'", "$SUREFOOT_PRICING"]),
    ("flag", "{oops", ["not valid JSON"]),
])
def test_run_with_a_bad_file_exits_before_opening_anything(tmp_path, how, content, words):
    data = tmp_path / "d"
    bad = write(tmp_path, content)
    args, env = (("--pricing", str(bad)), None) if how == "flag" else ((), {PRICING_ENV: str(bad)})
    r = surefoot("run", *args, "hello", data=data, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"surefoot run: pricing file {str(bad)!r}: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert r.stdout == "" and not data.exists()


def test_run_help_documents_the_pricing_file():
    r = subprocess.run([sys.executable, "-m", "loop.cli", "run", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for w in ("--pricing FILE", "micro-units per million tokens", "SUREFOOT_PRICING", "--max-cost-micros N",
              '"input_tokens": N'):
        assert w in text, w
