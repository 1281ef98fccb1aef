"""``surefoot serve --pricing FILE`` / ``$SUREFOOT_PRICING`` as a real process on a loopback port.

A submission's ``limits.max_cost_micros`` needs a price for the server's model: without one it is
refused 422 before anything is stored; with the file the run is accepted and its recorded cost
is the provider's usage x the file's price, to the micro-unit (read back with ``surefoot inspect``
once the server has stopped). The only fake is the hosted model: a local HTTP server speaking
OpenAI's streaming wire format (tests/loop/fake_providers.py), in this test's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from loop.runtime import Runtime
from server.cli import build_parser
from server_helpers import TOKEN, ServeProcess, free_port, wait_settled

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "loop"))  # the fake provider server, shared with the loop tests

from fake_providers import FakeProviderServer, FakeReply  # noqa: E402

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PRICING_ENV = "SUREFOOT_PRICING"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PRICING_ENV}
    env.update({"SUREFOOT_TOKEN": TOKEN, "PYTHONPATH": str(ROOT), "OPENAI_API_KEY": ""}, **extra)
    return env


def Serve(tmp: Path, data: Path, *extra: str, env: dict[str, str] | None = None) -> ServeProcess:
    """A ``python -m server.cli serve`` child on a port the kernel picks; stderr to a file."""
    return ServeProcess([sys.executable, "-m", "server.cli", "serve", "--data", str(data), "--port", "0",
                         "--workers", "1", "--log-level", "warning", *extra],
                        tmp=tmp, env=env or child_env(), cwd=ROOT)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=env or child_env(),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


async def recorded_usage(data: Path, conversation: str) -> list[dict]:
    """Each run's recorded usage totals, oldest first (what ``surefoot inspect`` shows), read from
    the data directory the stopped server left."""
    async with Runtime.open(f"lmdb:{data}", workers=0) as rt:
        return [await rt.usage(r.run_id) for r in await rt.runs(conversation)]


def snapshot(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``d`` with its size and modification time (what 'untouched' means)."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def write(tmp: Path, name: str, doc: object | str) -> Path:
    p = tmp / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


async def test_serve_prices_its_model_from_the_pricing_file(tmp_path, nursery):
    fake = FakeProviderServer()
    await nursery.start(fake.serve)
    model = f"openai:gpt-test@{fake.base_url}/v1"
    prices = write(tmp_path, "prices.json", {"openai:gpt-test": {"input_tokens": 3_000_000, "output_tokens": 15_000_000}})
    data = tmp_path / "data"
    ceiling = {"message": "hello", "limits": {"max_cost_micros": 1_000_000}}

    # 1. no pricing: the model has no price, so a cost ceiling is refused (nothing stored, no call made)
    s = Serve(tmp_path, data, "--model", model)
    try:
        await s.healthy()
        async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=10) as c:
            r = await c.post("/v1/conversations/priced/messages", json=ceiling)
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["code"] == "missing_price" and "gpt-test" in err["message"] and "price" in err["message"], err
            assert "priced" not in (await c.get("/v1/conversations")).json()["conversations"]
    finally:
        assert await s.stop() == 0, s.stderr()
    assert fake.requests == []

    # 2. --pricing (winning over a $SUREFOOT_PRICING that names a file that is not there): accepted,
    #    the run completes, and costs exactly the provider's usage at the file's price
    fake.enqueue(FakeReply(text="priced answer", input_tokens=11, output_tokens=7))
    s = Serve(tmp_path, data, "--model", model, "--pricing", str(prices),
              env=child_env(**{PRICING_ENV: str(tmp_path / "absent.json")}))
    try:
        await s.healthy()
        async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=10) as c:
            r = await c.post("/v1/conversations/priced/messages", json=ceiling)
            assert r.status_code == 202, r.text
            run = await wait_settled(c, r.json()["run_id"])
            assert run["status"] == "completed", run
    finally:
        assert await s.stop() == 0, s.stderr()
    assert "priced models: 1" in s.stderr()
    assert len(fake.requests) == 1
    (usage,) = await recorded_usage(data, "priced")
    assert (usage["input_tokens"], usage["output_tokens"]) == (11, 7)
    assert usage["cost_micros"] == 11 * 3 + 7 * 15 == 138

    # 3. a bad pricing file (by flag or by $SUREFOOT_PRICING): exit 2 with one stderr line naming
    #    the problem, before the store is opened: the data directory is byte-for-byte as it was,
    #    and a data directory that did not exist is not created. One real process; the other
    #    cases through the same command function in this process (imports are the slow part).
    before = snapshot(data)
    assert before
    bad_field = write(tmp_path, "field.json", {"openai:gpt-test": {"prompt_tokens": 3}})
    r = await trio.to_thread.run_sync(lambda: run_cli("serve", "--data", str(data), "--port", str(free_port()),
                                                       "--model", model, env=child_env(**{PRICING_ENV: str(bad_field)})))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"surefoot serve: pricing file {str(bad_field)!r}: 'openai:gpt-test': unknown field 'prompt_tokens' "
        "(fields: input_tokens, output_tokens, cache_read_tokens, cache_write_tokens) (from $SUREFOOT_PRICING)"]
    assert snapshot(data) == before


def test_serve_with_a_bad_pricing_file_opens_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(PRICING_ENV, raising=False)
    data = tmp_path / "data"
    bad_float = write(tmp_path, "float.json", {"openai:gpt-test": {"input_tokens": 3.0}})
    not_json = write(tmp_path, "broken.json", '{"echo": {"input_tokens": 1}')
    for args, words in [
        (("--pricing", str(bad_float)), ["'openai:gpt-test'", "input_tokens", "got 3.0", "integers only"]),
        (("--pricing", str(not_json)), ["not valid JSON"]),
        (("--pricing", str(tmp_path / "absent.json")), ["absent.json", "cannot read it"]),
        (("--pricing", str(tmp_path)), ["cannot read it"]),
    ]:
        parsed = build_parser().parse_args(["serve", "--data", str(data), "--port", str(free_port()), *args])
        assert parsed.func(parsed) == 2, args
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("surefoot serve: pricing file "), err
        for w in words:
            assert w in lines[0], (w, lines[0])
        assert out == "" and not data.exists()


async def test_serve_prices_the_echo_model_from_the_environment(tmp_path):
    """echo is free unless priced; priced by the file $SUREFOOT_PRICING names, a run under a cost
    ceiling records a non-zero cost of exactly its tokens at that price."""
    prices = write(tmp_path, "echo.json", {"echo": {"input_tokens": 7_000_000, "output_tokens": 11_000_000}})
    data = tmp_path / "data"
    s = Serve(tmp_path, data, env=child_env(**{PRICING_ENV: str(prices)}))
    try:
        await s.healthy()
        async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=10) as c:
            r = await c.post("/v1/conversations/e/messages",
                             json={"message": "hello", "limits": {"max_cost_micros": 1_000_000}})
            assert r.status_code == 202, r.text
            assert (await wait_settled(c, r.json()["run_id"]))["status"] == "completed"
            # a ceiling below the first call's estimate: accepted, and the call is never made
            r = await c.post("/v1/conversations/e/messages", json={"message": "again", "limits": {"max_cost_micros": 1}})
            assert r.status_code == 202, r.text
            run = await wait_settled(c, r.json()["run_id"])
            assert run["status"] == "failed" and run["outcome"]["error"]["type"] == "usage_limit", run
    finally:
        assert await s.stop() == 0, s.stderr()
    first, second = await recorded_usage(data, "e")
    assert first["input_tokens"] > 0 and first["output_tokens"] > 0
    assert first["cost_micros"] == 7 * first["input_tokens"] + 11 * first["output_tokens"] > 0
    assert second.get("cost_micros", 0) == 0 and second.get("total_tokens", 0) == 0  # refused before the call


def test_serve_help_documents_pricing():
    r = run_cli("serve", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for w in ("--pricing FILE", "micro-units per million tokens", "SUREFOOT_PRICING", "refused 422",
              '"output_tokens": N'):
        assert w in text, w
