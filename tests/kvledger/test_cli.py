"""The ``kvledger`` command line as a user meets it: help everywhere, a version, and one-line
errors."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvledger.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("kvledger",)):
    """Every (command path, action) in the parser tree, subcommands included."""
    for action in parser._actions:
        yield path, action
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, subparser in action.choices.items():
                yield (
                    (*path, name),
                    argparse.Namespace(option_strings=[name], help=helps.get(name), dest=name),
                )
                yield from _walk(subparser, (*path, name))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _assert_one_line_error(
    run: subprocess.CompletedProcess, exit_code: int, *fragments: str
) -> str:
    assert run.returncode == exit_code, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def test_every_command_and_option_has_help():
    missing = [
        f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
        for path, action in _walk(build_parser())
        # a subcommand group is checked through its commands, each of which must have help
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and not (action.help or "").strip()
    ]
    assert missing == []


def test_the_walk_sees_nested_commands():
    """The help test above would pass vacuously if the walk missed subcommands."""
    paths = {path for path, _ in _walk(build_parser())}
    assert {
        ("kvledger", "cost", "model"),
        ("kvledger", "publish", "erasure-requested"),
        ("kvledger", "bench", "erasure"),
    } <= paths


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvledger {metadata.version('kvledger')}\n"


def test_bad_flag_is_one_line_exit_2():
    line = _assert_one_line_error(
        _run("cost", "model", "--prompt-tokens", "ten"),
        2,
        "kvledger cost model: error:",
        "invalid int value: 'ten'",
    )
    assert line.endswith("(see kvledger cost model --help)")
    _assert_one_line_error(
        _run("no-such-command"), 2, "kvledger: error:", "invalid choice: 'no-such-command'"
    )
    _assert_one_line_error(
        _run("up", "--no-such-flag"), 2, "unrecognized arguments: --no-such-flag"
    )


def test_missing_receipt_file_is_one_line_exit_2(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text('{"keys": []}')
    _assert_one_line_error(
        _run("verify-receipt", str(tmp_path / "absent.json"), "--public-key", str(keys)),
        2,
        "absent.json",
    )


def test_missing_stack_file_is_one_line_exit_2(tmp_path):
    _assert_one_line_error(
        _run("namespace", "retire", "ns-1", "--stack", str(tmp_path / "nowhere.json")),
        2,
        "kvledger: error:",
        f"no stack file at {tmp_path / 'nowhere.json'}",
    )


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_coordinator_nobody_listens_on_is_one_line_exit_1():
    url = f"http://127.0.0.1:{_unused_port()}"
    _assert_one_line_error(
        _run("namespace", "retire", "ns-1", "--coordinator-url", url, "--token", "t"),
        1,
        "kvledger: error: cannot reach",
        url,
    )


def test_unexpected_errors_keep_their_traceback(monkeypatch):
    """Only expected failures are shortened: a bug must stay visible."""

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr("kvledger.cost.kv_cli", broken)
    with pytest.raises(KeyError):
        main(["cost", "kv", "--config", "config.json", "--tokens", "1"])


def test_a_command_s_own_error_is_one_line_exit_2(tmp_path):
    """CliError raised in a command module reaches ``main()`` as the same class under ``python -m
    kvledger.cli``."""
    (tmp_path / "stack.json").write_text("{}")
    _assert_one_line_error(
        _run(
            "erasure",
            "status",
            "0d6c1c9e-8d5b-4a57-9d6c-2f1f5a0e5b00",
            "--tenant",
            "acme",
            "--stack",
            str(tmp_path),
        ),
        2,
        "kvledger: error: pass --coordinator-url",
    )


def test_status_reads_the_backlog_from_a_prometheus_exposition():
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    from kvledger.status import backlog, parse_samples

    registry = CollectorRegistry()
    Gauge("kvledger_outbox_pending", "pending", registry=registry).set(7)
    dead = Gauge("kvledger_ledger_dead_letter_records", "dead", ["topic"], registry=registry)
    dead.labels("kvledger.erasures").set(2)
    dead.labels('odd"topic').set(1)
    lag = Histogram("kvledger_ledger_ingest_lag_seconds", "lag", registry=registry)
    lag.observe(0.25)
    lag.observe(0.75)
    stalled = Gauge("kvledger_consumer_stalled", "stalled", ["group"], registry=registry)
    stalled.labels("kvledger-coordinator-invalidations").set(1)
    stalled.labels("kvledger-coordinator").set(0)
    figures = backlog(parse_samples(generate_latest(registry).decode()))
    assert figures == {
        "outbox_pending": 7,
        "dead_letters": {"kvledger.erasures": 2, 'odd"topic': 1},
        "ingest_lag_s": 0.5,
        "stalled_groups": ["kvledger-coordinator-invalidations"],
    }
    assert backlog(parse_samples("# only comments\nnot a sample line\n")) == {
        "outbox_pending": None,
        "dead_letters": {},
        "ingest_lag_s": None,
        "stalled_groups": [],
    }
