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


def test_a_targeted_scenarios_poison_failure_replays_from_its_command(capsys, monkeypatch):
    """A targeted scenario runs by name (never in the default searches), and a run with a sure
    poison prints a replay command that carries it (``--poison``)."""
    import loop.runner

    async def finalise_apart(store, tr, claim):  # (the bite of test_sim_bites: finalised apart)
        raise RuntimeError("planted")

    monkeypatch.setattr(loop.runner.Runner, "finish_exhausted_in_claim", staticmethod(finalise_apart))
    rc = main(["sim", "--scenario", "exhaustion-alone", "--seed", "2", "--poison", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1 and "transcript_tool_results" in out
    cmd = re.search(r"replay: (surefoot sim .*)", out).group(1).strip()
    assert cmd == "surefoot sim --scenario exhaustion-alone --seed 2 --poison 0"
    monkeypatch.undo()
    assert main(cmd.split()[1:] + ["--no-progress"]) == 0  # unbroken: the same run is clean
    capsys.readouterr()
    from sim.session import all_scenarios

    assert "exhaustion-alone" in all_scenarios(targeted=True) and "exhaustion-alone" not in all_scenarios()
