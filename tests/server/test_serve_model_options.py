"""``surefoot serve``'s model options, the same ones ``surefoot run`` takes (defined and checked
once, in ``loop.cli``), applied to the agent serve serves.

A real ``serve`` process on a loopback port, its model the local fake Anthropic / OpenAI server
(tests/loop/fake_providers.py, in this test's process): a message posted over HTTP reaches the
model with the options in its request. A combination the model cannot take stops the command
with exit 2 and an argparse-style message before the store is opened (no data directory).
"""

from __future__ import annotations

import httpx
import trio

from server.cli import build_parser
from server_helpers import ServeProcess, free_port, wait_settled
from test_server_pricing import AUTH, Serve, child_env, run_cli  # (puts tests/loop on sys.path)

from fake_providers import FakeProviderServer, FakeReply  # noqa: E402


def env() -> dict[str, str]:
    return child_env(ANTHROPIC_API_KEY="", ANTHROPIC_BASE_URL="")


async def post_and_settle(s: ServeProcess, conversation: str, message: str) -> dict:
    async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=10) as c:
        r = await c.post(f"/v1/conversations/{conversation}/messages", json={"message": message})
        assert r.status_code == 202, r.text
        return await wait_settled(c, r.json()["run_id"])


async def test_serve_sends_adaptive_thinking_effort_display_and_max_tokens(tmp_path, nursery):
    fake = FakeProviderServer()
    await nursery.start(fake.serve)
    fake.enqueue(FakeReply(text="served with options"))
    s = Serve(tmp_path, tmp_path / "data", "--model", f"anthropic:claude-test@{fake.base_url}",
              "--thinking", "adaptive", "--effort", "high", "--thinking-display", "summarized",
              "--max-tokens", "12000", env=env())
    try:
        await s.healthy()
        run = await post_and_settle(s, "opts", "hello")
        assert run["status"] == "completed", run
    finally:
        assert await s.stop() == 0, s.stderr()
    (req,) = fake.requests
    assert req.body["thinking"] == {"type": "adaptive", "display": "summarized"}
    assert req.body["output_config"] == {"effort": "high"}
    assert req.body["max_tokens"] == 12000
    assert ("--max-tokens 12000 --thinking adaptive --effort high --thinking-display summarized"
            in s.stderr()), s.stderr()


async def test_serve_sends_max_completion_tokens(tmp_path, nursery):
    fake = FakeProviderServer()
    await nursery.start(fake.serve)
    fake.refuse_max_tokens = True  # an OpenAI reasoning model: max_tokens is a 400
    fake.enqueue(FakeReply(text="reasoned"))
    s = Serve(tmp_path, tmp_path / "data", "--model", f"openai:gpt-test@{fake.base_url}/v1",
              "--max-tokens-param", "max_completion_tokens", "--max-tokens", "700", env=env())
    try:
        await s.healthy()
        run = await post_and_settle(s, "oa", "hello")
        assert run["status"] == "completed", run
    finally:
        assert await s.stop() == 0, s.stderr()
    (req,) = fake.requests
    assert req.body["max_completion_tokens"] == 700 and "max_tokens" not in req.body


async def test_serve_refuses_an_option_its_model_cannot_take_before_opening_anything(tmp_path):
    data = tmp_path / "data"
    r = await trio.to_thread.run_sync(lambda: run_cli(
        "serve", "--data", str(data), "--port", str(free_port()), "--thinking", "adaptive", env=env()))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "surefoot serve: error: argument --thinking: only an anthropic:MODEL model takes it, not 'echo' "
        "(the echo provider has no such option)"]
    assert not data.exists()


def test_serve_refusals_in_process(tmp_path, capsys):
    data = tmp_path / "data"
    for args, line in [
        (("--model", "openai:m@http://127.0.0.1:9/v1", "--thinking", "2048"),
         "argument --thinking: only an anthropic:MODEL model takes it"),
        (("--max-tokens-param", "max_completion_tokens"), "argument --max-tokens-param: only an openai:MODEL model"),
        (("--model", "anthropic:m@http://127.0.0.1:9", "--effort", "max"), "argument --effort: needs --thinking adaptive"),
        (("--model", "anthropic:m@http://127.0.0.1:9", "--thinking", "5000"),
         "argument --thinking: a budget of 5000 tokens must be less than the default max_tokens 4096"),
    ]:
        parsed = build_parser().parse_args(["serve", "--data", str(data), "--port", str(free_port()), *args])
        assert parsed.func(parsed) == 2, args
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"surefoot serve: error: {line}"), (args, err)
        assert out == "" and not data.exists()


def test_lease_seconds_is_checked_on_both_commands_and_reaches_serves_runtime(tmp_path, capsys, monkeypatch):
    import server.serve as serve_mod

    data = tmp_path / "data"
    for command in ("serve", "run"):
        for bad in ("0", "-1", "nan", "inf", "soon"):
            try:
                build_parser().parse_args([command, "--data", str(data), "--lease-seconds", bad, *(["hi"] if command == "run" else [])])
            except SystemExit as e:
                assert e.code == 2, (command, bad)
            else:
                raise AssertionError(f"{command} --lease-seconds {bad} was accepted")
            err = capsys.readouterr().err
            assert "argument --lease-seconds:" in err and ("positive number of seconds" in err or "not a number" in err), err
    assert not data.exists()

    seen: dict = {}

    async def fake_serve_store(url, **kw):
        seen.update(kw, url=url)
        return 0

    monkeypatch.setattr(serve_mod, "serve_store", fake_serve_store)
    parsed = build_parser().parse_args(["serve", "--data", str(data), "--port", str(free_port()), "--lease-seconds", "2.5"])
    assert parsed.func(parsed) == 0
    assert seen["lease_seconds"] == 2.5 and seen["url"] == f"lmdb:{data}"
    parsed = build_parser().parse_args(["serve", "--data", str(data), "--port", str(free_port())])
    assert parsed.func(parsed) == 0
    assert seen["lease_seconds"] is None  # the runtime's default
