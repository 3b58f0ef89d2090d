"""The second Ctrl-C's rule (pretrain/run/stop.py) holds while the main thread is busy: presses
are timed as they arrive, not when Python gets round to the handler. The main thread is held
in a C call that releases the GIL and ignores signals (a pthread mutex another thread holds),
as a long torch op, a collective or a save holds it; the rule's interval is halved to keep the
test short, the margins stay wide. In-process: the exit at once is replaced by a recorder."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import pytest

from pretrain.run import stop

SAME_PRESS_S = 0.5
LIBC = ctypes.CDLL(None)  # CDLL: its calls release the GIL


@pytest.fixture
def installed(monkeypatch):
    """A StopRequest installed in this process; its exits at once recorded, not taken; the
    process's handlers and wakeup fd restored afterwards."""
    exits = []
    monkeypatch.setattr(stop, "SAME_PRESS_S", SAME_PRESS_S)
    monkeypatch.setattr(stop, "_exit_at_once", lambda: exits.append(time.monotonic()))
    handlers = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    try:
        yield stop.StopRequest.install(), exits
    finally:
        stop.ArrivalClock.start().listener = None
        signal.set_wakeup_fd(wakeup)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _busy_main_thread(presses_at: list[float], hold_s: float, start: float | None = None
                      ) -> float:
    """Hold the main thread in C until ``hold_s`` while another thread presses Ctrl-C (SIGINT
    to this process) at each of ``presses_at``: seconds after ``start`` (``time.monotonic()``;
    default: when the hold begins). Returns when the hold ended."""
    start = time.monotonic() if start is None else start
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER (glibc)
    held, ended = threading.Event(), []

    def press():
        LIBC.pthread_mutex_lock(mutex)
        held.set()
        for at in presses_at:
            time.sleep(max(0.0, start + at - time.monotonic()))
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(max(0.0, start + hold_s - time.monotonic()))
        ended.append(time.monotonic())
        LIBC.pthread_mutex_unlock(mutex)

    presser = threading.Thread(target=press)
    presser.start()
    held.wait()
    LIBC.pthread_mutex_lock(mutex)  # blocks here, in C, until the presser lets go
    LIBC.pthread_mutex_unlock(mutex)
    presser.join()
    time.sleep(0.1)  # the clock thread's last stamp
    return ended[0]


def test_two_presses_while_the_main_thread_is_busy_exit_at_once(installed):
    """Two presses twice the interval apart, both before the handler can run: the second exits
    at once, while the main thread is still busy. Timed in the handler, they looked like one
    press (Python runs the handler once for both)."""
    request, exits = installed
    ended = _busy_main_thread([0.0, 2 * SAME_PRESS_S], hold_s=3 * SAME_PRESS_S)
    assert len(exits) == 1 and exits[0] < ended
    assert request.signal_name == "SIGINT"


def test_one_press_relayed_twice_is_one_press_when_the_handler_is_late(installed):
    """One press reaching the process twice (the terminal's and a relay) 50 ms apart, the first
    handled at once, the second only after the busy main thread is back, two intervals
    later: the same press, the run goes on to save. Timed in the handler, that was a second
    press and exited without saving."""
    request, exits = installed
    pressed = time.monotonic()
    os.kill(os.getpid(), signal.SIGINT)
    assert request.signal_name == "SIGINT"  # handled as the call returned
    _busy_main_thread([0.05], hold_s=2 * SAME_PRESS_S, start=pressed)
    assert exits == []
