"""``surefoot run``'s model options (``--max-tokens``, ``--thinking``, ``--effort``,
``--thinking-display``, ``--interleaved-thinking``, ``--max-tokens-param``).

What each one sends is asserted at the wire: the real command runs as a child process against
the local fake Anthropic / OpenAI server (tests/loop/fake_providers.py, in this test's process),
and the test reads the request body and headers the server received. A combination the model
cannot take is refused with exit 2 and an argparse-style message naming the option and why,
before any storage is opened: the data directory is not created, and an existing one is left
byte for byte as it was. The refusal matrix runs through the command's own ``main`` in this
process (the imports are the slow part of a child); one refusal runs as a real process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import trio

from fake_providers import FakeReply
from loop import cli as loop_cli

REPO = Path(__file__).resolve().parents[2]
PROVIDER_ENV = ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL", "SUREFOOT_PRICING")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PROVIDER_ENV}
    env.update({"ANTHROPIC_API_KEY": "", "OPENAI_API_KEY": "", "PYTHONPATH": str(REPO)})
    return env


async def surefoot_run(data: Path, *args: str) -> trio.CompletedProcess:
    """``surefoot run --data DATA ARGS...`` as a child process (the fake server keeps serving)."""
    cmd = [sys.executable, "-m", "loop.cli", "run", "--data", str(data), *args]
    with trio.fail_after(60):
        return await trio.run_process(cmd, cwd=str(REPO), env=child_env(), capture_stdout=True,
                                      capture_stderr=True, check=False, stdin=b"")


def out(r: trio.CompletedProcess) -> str:
    return r.stdout.decode() + r.stderr.decode()


def snapshot(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``d`` with its size and modification time (what 'untouched' means)."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


# ---------------------------------------------------------------------- what reaches the wire


async def test_budgeted_thinking_and_max_tokens_reach_the_anthropic_request(fake_server, tmp_path):
    fake_server.enqueue(FakeReply(text="thought about it"))
    model = f"anthropic:claude-test@{fake_server.base_url}"
    r = await surefoot_run(tmp_path / "d", "--model", model, "--thinking", "2048", "--max-tokens", "8000", "hello")
    assert r.returncode == 0, out(r)
    assert "thought about it" in r.stdout.decode()
    (req,) = fake_server.requests
    assert req.path == "/v1/messages"
    assert req.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert req.body["max_tokens"] == 8000
    assert "output_config" not in req.body and "anthropic-beta" not in req.headers


async def test_adaptive_thinking_effort_and_display_reach_the_anthropic_request(fake_server, tmp_path):
    fake_server.enqueue(FakeReply(text="adaptive answer"))
    model = f"anthropic:claude-test@{fake_server.base_url}"
    r = await surefoot_run(tmp_path / "d", "--model", model, "--thinking", "adaptive", "--effort", "xhigh",
                           "--thinking-display", "omitted", "--max-tokens", "16000", "hello")
    assert r.returncode == 0, out(r)
    (req,) = fake_server.requests
    assert req.body["thinking"] == {"type": "adaptive", "display": "omitted"}
    assert req.body["output_config"] == {"effort": "xhigh"}
    assert req.body["max_tokens"] == 16000
    assert "anthropic-beta" not in req.headers  # adaptive thinking interleaves without the beta


async def test_interleaved_thinking_sends_the_beta_and_may_pass_max_tokens(fake_server, tmp_path):
    """With the beta and tools (the demo tools are on) the budget may reach or pass max_tokens
    (Anthropic relaxes that rule there): 8000 against the default 4096 is accepted and sent."""
    fake_server.enqueue(FakeReply(text="interleaved"))
    model = f"anthropic:claude-test@{fake_server.base_url}"
    r = await surefoot_run(tmp_path / "d", "--model", model, "--thinking", "8000", "--interleaved-thinking", "hello")
    assert r.returncode == 0, out(r)
    (req,) = fake_server.requests
    assert req.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"
    assert req.body["thinking"] == {"type": "enabled", "budget_tokens": 8000}
    assert req.body["max_tokens"] == 4096 and req.body["tools"]


async def test_max_completion_tokens_for_a_model_that_refuses_max_tokens(fake_server, tmp_path):
    fake_server.refuse_max_tokens = True  # as OpenAI's reasoning models do (400 unsupported_parameter)
    fake_server.enqueue(FakeReply(text="reasoned"))
    model = f"openai:gpt-test@{fake_server.base_url}/v1"
    r = await surefoot_run(tmp_path / "d", "--model", model, "--max-tokens-param", "max_completion_tokens",
                           "--max-tokens", "500", "hello")
    assert r.returncode == 0, out(r)
    assert "reasoned" in r.stdout.decode()
    (req,) = fake_server.requests
    assert req.path == "/v1/chat/completions"
    assert req.body["max_completion_tokens"] == 500 and "max_tokens" not in req.body


async def test_max_tokens_caps_an_openai_compatible_call(fake_server, tmp_path):
    """Without --max-tokens an OpenAI-compatible server gets no cap at all (the first call); with
    it, max_tokens = N (what vLLM needs below its context window)."""
    fake_server.enqueue(FakeReply(text="uncapped"), FakeReply(text="a long answer, cut", output_tokens=900))
    model = f"openai:llama@{fake_server.base_url}/v1"
    r = await surefoot_run(tmp_path / "d", "--model", model, "first")
    assert r.returncode == 0, out(r)
    r = await surefoot_run(tmp_path / "d", "--model", model, "--max-tokens", "300", "second")
    assert r.returncode == 0, out(r)
    first, second = fake_server.requests
    assert "max_tokens" not in first.body and "max_completion_tokens" not in first.body
    assert second.body["max_tokens"] == 300 and "max_completion_tokens" not in second.body


async def test_a_price_keyed_by_the_spec_as_written_survives_a_provider_option(fake_server, tmp_path):
    """A provider option turns the agent's model into a provider object, which the pricing looks up
    as provider:MODEL / MODEL; a price keyed by the spec as written (with its base URL) still
    applies, so a cost ceiling is enforced instead of refused for want of a price."""
    fake_server.enqueue(FakeReply(text="priced", input_tokens=11, output_tokens=7))
    model = f"openai:gpt-test@{fake_server.base_url}/v1"
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({model: {"input_tokens": 3_000_000, "output_tokens": 15_000_000}}))
    data = tmp_path / "d"
    r = await surefoot_run(data, "--model", model, "--max-tokens-param", "max_completion_tokens",
                           "--pricing", str(prices), "--max-cost-micros", "1000000", "--json", "hello")
    assert r.returncode == 0, out(r)
    usage = [json.loads(line)["data"] for line in r.stdout.decode().splitlines()
             if line.startswith("{") and json.loads(line).get("type") == "usage.updated"]
    assert usage and usage[-1]["usage"]["cost_micros"] == 11 * 3 + 7 * 15, usage
    (req,) = fake_server.requests
    assert "max_completion_tokens" in req.body and "max_tokens" not in req.body


# ---------------------------------------------------------------------- refusals


ANTHROPIC = "anthropic:claude-test@http://127.0.0.1:9"
OPENAI = "openai:gpt-test@http://127.0.0.1:9/v1"

#: (arguments, the option named, words of the reason)
REFUSED = [
    (("--thinking", "adaptive"), "--thinking", ["only an anthropic:MODEL model", "'echo'"]),
    (("--model", OPENAI, "--thinking", "2048"), "--thinking", ["only an anthropic:MODEL model", "openai"]),
    (("--model", OPENAI, "--effort", "high"), "--effort", ["only an anthropic:MODEL model"]),
    (("--model", OPENAI, "--thinking-display", "omitted"), "--thinking-display", ["only an anthropic:MODEL model"]),
    (("--interleaved-thinking",), "--interleaved-thinking", ["only an anthropic:MODEL model", "'echo'"]),
    (("--model", ANTHROPIC, "--max-tokens-param", "max_completion_tokens"), "--max-tokens-param",
     ["only an openai:MODEL model", "anthropic"]),
    (("--max-tokens-param", "max_tokens"), "--max-tokens-param", ["only an openai:MODEL model", "'echo'"]),
    (("--model", ANTHROPIC, "--effort", "high"), "--effort", ["needs --thinking adaptive"]),
    (("--model", ANTHROPIC, "--thinking", "2048", "--effort", "high"), "--effort", ["needs --thinking adaptive"]),
    (("--model", ANTHROPIC, "--thinking", "off", "--effort", "low"), "--effort", ["needs --thinking adaptive"]),
    (("--model", ANTHROPIC, "--thinking", "2048", "--thinking-display", "summarized"), "--thinking-display",
     ["needs --thinking adaptive"]),
    (("--model", ANTHROPIC, "--thinking", "adaptive", "--interleaved-thinking"), "--interleaved-thinking",
     ["interleaves reasoning between tool calls by itself"]),
    (("--model", ANTHROPIC, "--interleaved-thinking"), "--interleaved-thinking", ["needs extended thinking on"]),
    (("--model", ANTHROPIC, "--thinking", "1000"), "--thinking", ["1000", "below the API's minimum of 1024"]),
    (("--model", ANTHROPIC, "--thinking", "4096"), "--thinking",
     ["4096", "must be less than the default max_tokens 4096"]),
    (("--model", ANTHROPIC, "--thinking", "3000", "--max-tokens", "3000"), "--thinking",
     ["3000", "must be less than --max-tokens 3000"]),
    (("--model", "bogus"), "--model", ["unknown model spec 'bogus'"]),
]


@pytest.mark.parametrize("args,option,words", REFUSED, ids=[" ".join(a) for a, _, _ in REFUSED])
def test_a_refused_combination_exits_2_naming_the_option_and_opens_nothing(args, option, words, tmp_path, capsys):
    data = tmp_path / "d"
    rc = loop_cli.main(["run", "--data", str(data), *args, "hello"])
    assert rc == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"surefoot run: error: argument {option}: "), captured.err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert captured.out == "" and not data.exists()


@pytest.mark.parametrize("args,words", [
    (("--thinking", "lots"), ["argument --thinking", "not off, adaptive or a budget of thinking tokens: 'lots'"]),
    (("--thinking", "0"), ["argument --thinking", "a thinking budget must be a positive integer, not 0"]),
    (("--max-tokens", "0"), ["argument --max-tokens", "must be a positive integer, not 0"]),
    (("--effort", "extreme"), ["argument --effort", "invalid choice: 'extreme'", "'xhigh'"]),
    (("--thinking-display", "full"), ["argument --thinking-display", "invalid choice: 'full'", "'summarized'"]),
    (("--max-tokens-param", "max_output_tokens"), ["argument --max-tokens-param", "'max_completion_tokens'"]),
])
def test_a_malformed_value_is_argparse_s_own_error(args, words, tmp_path, capsys):
    data = tmp_path / "d"
    with pytest.raises(SystemExit) as e:
        loop_cli.main(["run", "--data", str(data), "--model", ANTHROPIC, *args, "hello"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "surefoot run: error: " in err
    for w in words:
        assert w in err, (w, err)
    assert not data.exists()


async def test_a_refusal_leaves_an_existing_data_directory_untouched(tmp_path):
    """One real process: a data directory with a completed run in it, then a refused command."""
    data = tmp_path / "d"
    r = await surefoot_run(data, "hello")
    assert r.returncode == 0, out(r)
    before = snapshot(data)
    assert before
    r = await surefoot_run(data, "--model", ANTHROPIC, "--thinking", "adaptive", "--effort", "high",
                           "--interleaved-thinking", "again")
    assert r.returncode == 2, out(r)
    assert r.stderr.decode().strip().splitlines() == [
        "surefoot run: error: argument --interleaved-thinking: adaptive thinking interleaves reasoning between "
        "tool calls by itself: drop it, or use --thinking BUDGET"]
    assert r.stdout == b""
    assert snapshot(data) == before


def test_options_that_change_nothing_keep_the_spec_string():
    """--thinking off alone, or --max-tokens alone, need no provider object: the agent keeps the
    spec string (its delivery records it; prices are looked up by it as written)."""
    parser = loop_cli.argparse.ArgumentParser(prog="surefoot")
    loop_cli.add_commands(parser.add_subparsers(dest="command"))
    for argv in (["run", "--model", OPENAI, "--thinking", "off"], ["run", "--model", ANTHROPIC, "--max-tokens", "77"]):
        choice = loop_cli.model_from_args(parser.parse_args(argv))
        assert choice.model == argv[2]
    choice = loop_cli.model_from_args(parser.parse_args(["run", "--model", ANTHROPIC, "--max-tokens", "77"]))
    assert choice.max_tokens == 77 and choice.agent("a", "i").max_tokens == 77
    choice = loop_cli.model_from_args(parser.parse_args(
        ["run", "--model", ANTHROPIC, "--thinking", "2048", "--max-tokens", "9000"]))
    assert choice.model.thinking_budget == 2048 and choice.model.max_tokens == 9000
    assert choice.options == ("--max-tokens 9000", "--thinking 2048")
