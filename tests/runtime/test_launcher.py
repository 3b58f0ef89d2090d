"""A user's mistake is said once per launch: rank 0 prints its ``error:`` line, every rank
under torchrun writes it to its error file (runtime.launcher.report_error)."""

import json

import pytest

from runtime.launcher import report_error, standalone_env


@pytest.mark.parametrize("rank, printed", [(None, True), ("0", True), ("1", False)])
def test_only_rank_zero_prints_and_every_rank_records(tmp_path, monkeypatch, capsys, rank,
                                                      printed):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    report_error("optim.lr (-1.0) must be > 0")
    line = "error: optim.lr (-1.0) must be > 0"
    assert capsys.readouterr().err == (line + "\n" if printed else "")
    record = json.loads(error_file.read_text())  # torchrun's error-file format
    assert record["message"]["message"] == line
    assert int(record["message"]["extraInfo"]["timestamp"]) > 0


def test_without_an_error_file_every_rank_prints(monkeypatch, capsys):
    """A launcher that gives no error file (not torchrun) still hears of the mistake."""
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "3")
    report_error("data.prefixes is empty")
    assert capsys.readouterr().err == "error: data.prefixes is empty\n"


def test_a_child_process_does_not_inherit_the_error_file():
    """A process started by a rank (a sweep's cell) reports its own mistakes, not into the
    file torchrun reads for the rank."""
    env = standalone_env({"RANK": "1", "TORCHELASTIC_ERROR_FILE": "/x", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}
