"""``launch.port``: the slurm job's rendezvous port is its own unless something holds it, then
the next free one; a bad BASE or a full range is one error line and exit 2."""

import socket

import pytest

from launch import port


@pytest.fixture
def held():
    """A port a listening socket holds (on every address), and a free one after it."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        taken = s.getsockname()[1]
        if taken >= 65000:  # leave room for the ports after it
            pytest.skip("the kernel gave a port at the top of the range")
        yield taken


def test_a_free_port_is_its_own_answer(held):
    free = port.first_free(held + 1)
    assert free is not None and free > held and port.is_free(free)


def test_a_held_port_gives_the_next_free_one(held, capsys):
    assert not port.is_free(held)
    assert port.main([str(held)]) == 0
    answer = int(capsys.readouterr().out)
    assert answer > held and port.is_free(answer)


def test_a_range_with_no_free_port_is_one_error_line(held, capsys, monkeypatch):
    monkeypatch.setattr(port, "SPAN", 1)
    assert port.first_free(held, span=1) is None
    assert port.main([str(held)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no free TCP port from {held} to {held}" in err
    assert "RDZV_PORT" in err


@pytest.mark.parametrize("argv", [[], ["80"], ["x"], ["70000"], ["20000", "1"]])
def test_a_bad_base_is_one_error_line(argv, capsys):
    assert port.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: python -m launch.port BASE") and err.count("\n") == 1
