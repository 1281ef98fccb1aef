"""``surefoot run`` / ``surefoot inspect`` as a user runs them: real processes on a data directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def surefoot(*args: str, data, timeout: float = 60, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "loop.cli", args[0], "--data", str(data), *args[1:]]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, stdin=stdin)


def test_run_offline_then_inspect(tmp_path):
    data = tmp_path / "d"
    r = surefoot("run", "hello there", data=data)
    assert r.returncode == 0, r.stderr
    assert "You said: hello there" in r.stdout and "completed" in r.stdout
    r = surefoot("run", '/add {"a": 2, "b": 40}', data=data)
    assert r.returncode == 0, r.stderr
    assert '→ add({"a": 2, "b": 40})' in r.stdout and "← add: 42.0" in r.stdout
    r = surefoot("inspect", data=data)
    assert r.returncode == 0 and "main: 6 messages, 2 runs (completed 2)" in r.stdout
    r = surefoot("inspect", "--json", "main", data=data)
    doc = json.loads(r.stdout)
    assert [x["status"] for x in doc["runs"]] == ["completed", "completed"]
    assert [m["role"] for m in doc["transcript"]] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    assert doc["transcript"][-1]["content"][0]["text"] == "Tool results:\nadd: 42.0"
    assert doc["journal"][-1]["type"] == "run.completed"


def test_approval_parks_without_a_terminal_then_resumes_with_yes(tmp_path):
    data = tmp_path / "d"
    r = surefoot("run", "/approve_action deploy", data=data)
    assert r.returncode == 3 and "parked awaiting approval" in r.stderr
    r = surefoot("inspect", "main", data=data)
    assert "parked" in r.stdout and "awaiting approval" in r.stdout
    r = surefoot("run", "--yes", data=data)
    assert r.returncode == 0, r.stderr
    assert "approved" in r.stdout and "← approve_action: done: deploy" in r.stdout


def _silent_server() -> tuple[socket.socket, int]:
    """A 'model server' that accepts connections and never answers: the run hangs in the model call."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s, s.getsockname()[1]


def _start_hanging_run(data, port: int, message: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loop.cli", "run", "--data", str(data), "--lease-seconds", "1",
           "--model", f"openai:m@http://127.0.0.1:{port}/v1", message]
    # SIGINT back to its default in the child: a test run launched in the background by a shell
    # without job control (`cmd &` in a script, as CI runners may) inherits it ignored, and then
    # Python installs no KeyboardInterrupt handler and the Ctrl-C below would never arrive.
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OPENAI_API_KEY": ""},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = p.stdout.readline()  # "· run xxxx queued"
    assert "queued" in line, (line, p.stderr.read() if p.poll() is not None else "")
    time.sleep(0.5)  # into the model call
    return p


def test_a_second_run_after_ctrl_c_resumes_the_interrupted_run(tmp_path):
    data = tmp_path / "d"
    srv, port = _silent_server()
    try:
        p = _start_hanging_run(data, port, "first question")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 130 and "run `surefoot run` again to resume" in err
    finally:
        srv.close()
    r = surefoot("run", "second question", data=data)  # echo model now
    assert r.returncode == 0, r.stderr
    assert "resuming run" in r.stdout
    assert r.stdout.index("You said: first question") < r.stdout.index("You said: second question")
    doc = json.loads(surefoot("inspect", "--json", "main", data=data).stdout)
    assert [x["status"] for x in doc["runs"]] == ["completed", "completed"]


def test_a_second_run_after_a_kill_takes_over(tmp_path):
    data = tmp_path / "d"
    srv, port = _silent_server()
    try:
        p = _start_hanging_run(data, port, "first question")
        p.kill()
        p.wait(timeout=10)
    finally:
        srv.close()
    r = surefoot("run", "--lease-seconds", "1", data=data)  # no message: just resume
    assert r.returncode == 0, r.stderr
    assert "interrupted earlier; resuming" in r.stdout
    assert "taking over from a stopped process" in r.stdout
    assert "You said: first question" in r.stdout
