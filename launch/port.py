"""``python -m launch.port BASE``: the first TCP port from BASE that nothing on this host holds.

A slurm job's nodes meet at its first node, on a port every node must know before any of them
starts: ``20000 + job id mod 20000``, a function of the job alone. Two jobs sharing a first
node whose ids are 20,000 apart, or any other program on that port, would make the second
job's rendezvous store fail to listen (or its other nodes reach the wrong job's store). The
job's batch shell runs on that first node, so it asks here for the first free port from the
job's own, and passes the answer to every node on the srun command line.
"""

from __future__ import annotations

import socket
import sys

SPAN = 100  # ports tried from BASE


def is_free(port: int) -> bool:
    """Whether a listening socket could bind ``port`` on every address of this host now (a
    port another socket holds, also one lingering in TIME_WAIT, counts as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def first_free(base: int, span: int = SPAN) -> int | None:
    """The first free port of ``base`` .. ``base + span - 1``, None if every one is taken."""
    return next((p for p in range(base, min(base + span, 65536)) if is_free(p)), None)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit() or not 1024 <= int(argv[0]) <= 65535:
        print(f"error: python -m launch.port BASE: BASE must be a port number from 1024 to "
              f"65535, got {' '.join(argv) or 'nothing'}", file=sys.stderr)
        return 2
    base = int(argv[0])
    port = first_free(base, SPAN)
    if port is None:
        print(f"error: no free TCP port from {base} to {base + SPAN - 1} on "
              f"{socket.gethostname()}; set RDZV_PORT to one that is", file=sys.stderr)
        return 2
    print(port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
