"""``surefoot sim`` through the real command entry point."""

from __future__ import annotations

import re

from server.cli import main


def test_sim_command_prints_the_summary_and_trace(capsys):
    rc = main(["sim", "--scenario", "plain", "--scenario", "kv-cycle", "--seed", "3", "--runs", "4", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"trace: [0-9a-f]{32}", out)
    for row in ("runs", "crash points", "invariant checks", "simulated hours", "runs/s", "crash points/s"):
        assert row in out
    trace = re.search(r"trace: ([0-9a-f]{32})", out).group(1)
    main(["sim", "--scenario", "plain", "--scenario", "kv-cycle", "--seed", "3", "--runs", "4", "--no-progress"])
    assert f"trace: {trace}" in capsys.readouterr().out  # same arguments, same trace


def test_a_failure_prints_the_seed_and_the_replay_command(capsys, break_submission_hash):
    rc = main(["sim", "--scenario", "duplicate", "--seed", "9", "--exhaustive", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "submission_conflict" in out and "seed 9" in out
    cmd = re.search(r"replay: (surefoot sim .*)", out).group(1).strip()
    assert cmd.startswith("surefoot sim --scenario duplicate --seed 9")
    rc2 = main(cmd.split()[1:] + ["--no-progress"])  # the printed command reproduces it
    assert rc2 == 1 and "submission_conflict" in capsys.readouterr().out


def test_a_replay_needs_one_scenario(capsys):
    assert main(["sim", "--seed", "1", "--crash-after", "3", "--no-progress"]) == 2
