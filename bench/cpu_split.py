"""PostgreSQL per batch: the CPU each drain costs the client and the server, per event.

Runs ``compare.py``'s own contenders with its own setup and workers, in this process, on a fresh
schema each time, ``--events`` events in batches of 100: the minimal per-batch loop
(``ref-batch-1``), outboxkit's own statements sent by a plain loop (``bare-batch-1``) and
outboxkit's poller (``per_batch``, without and with ``prefetch``: ``kit-batch-1``,
``kit-batch-1p``), the four alternating for ``--rounds`` rounds; each drain is checked as
``compare.py`` checks it. For each: this process's CPU time (``time.process_time``: every thread
of it) and the server's (the CPU time every ``postgres`` process of this machine spent: the
backends, the WAL writer, the checkpointer), both from the worker's start barrier, and the wall
time ``compare.py`` times, in µs per event, medians.

Two pollers on two cores share the machine's CPU with the server: the sum of the two is what a
drain costs there. Not a throughput figure (``compare.py`` is); where the time goes. Needs the
server on this machine (it refuses to run otherwise).

    python bench/cpu_split.py
    python bench/cpu_split.py --events 20000 --rounds 7
    python bench/cpu_split.py --writes --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import compare
from _common import pg_schema, pg_url_default

BATCH = compare.BATCH
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def server_cpu() -> float:
    """Seconds of CPU (user + system) every ``postgres`` process of this machine has used."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        if name.startswith("postgres"):
            fields = text[text.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


Split = tuple[float, float, float]  # client CPU, server CPU, wall (seconds)

DRAINS = {
    "minimal loop": "ref-batch-1",
    "outboxkit's statements": "bare-batch-1",
    "poller": "kit-batch-1",
    "poller, prefetch": "kit-batch-1p",
}
"""What is measured: ``compare.py``'s contenders of these names, run by its own workers."""

WRITING_DRAINS = {
    "loop, tx per event": "ref-w-tx-1",
    "statements, per event": "bare-w-tx-1",
    "poller, per_event": "kit-w-tx-1",
    "loop, savepoints": "ref-w-batch-sp",
    "loop, no savepoints": "ref-w-batch",
    "statements, per batch": "bare-w-batch-1",
    "poller, per_batch": "kit-w-batch-1",
}
"""With ``--writes``: the handler writes one row through its connection (``compare.py``'s
``pg-w-*`` workloads)."""


class _Counters:
    """Both CPU counters, read as the worker starts (``wait``: its start barrier, after its
    connections are open, as the clock of ``compare.py`` starts) and as its drain ends
    (``ended``: ``Job.on_end``, before it closes them, while the backends still live)."""

    def __init__(self) -> None:
        self.start = self.end = (0.0, 0.0)

    def wait(self) -> None:
        self.start = (time.process_time(), server_cpu())

    def ended(self) -> None:
        self.end = (time.process_time(), server_cpu())


def drain(url: str, name: str, events: int) -> Split:
    """``compare.py``'s contender ``name`` drains ``events`` in this process, on a fresh schema:
    its client CPU, the server's, and its wall time (from the start barrier to the last
    settle).

    Raises:
        RuntimeError: the drain did not handle, settle and record every event exactly once.
    """
    contender = compare.CONTENDERS[name]
    with pg_schema(url, "outboxkit_cpu_split") as schema:
        compare.prepare_pg(url, contender, schema, events)
        counters = _Counters()
        job = compare.Job(contender, url, schema, on_end=counters.ended)
        drained = compare.pg_worker(contender)(job, counters)  # type: ignore[arg-type]
        wall = drained.ended - drained.started
        outcome = compare.pg_outcome(url, contender, schema, wall, drained.handled)
    problems = outcome.problems(events)
    if problems:
        raise RuntimeError("; ".join(problems))
    (client, server), (client_0, server_0) = counters.end, counters.start
    return client - client_0, server - server_0, wall


def run(
    url: str, events: int, rounds: int, drains: dict[str, str] = DRAINS
) -> dict[str, list[Split]]:
    """Every drain ``rounds`` times, alternating, the order rotating each round."""
    names = list(drains)
    splits: dict[str, list[Split]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            splits[name].append(drain(url, drains[name], events))
    return splits


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pg-url", default=pg_url_default())
    parser.add_argument(
        "--writes",
        action="store_true",
        help="the handler writes one row through its connection: per event and per batch",
    )
    args = parser.parse_args()
    if args.events < 1 or args.rounds < 1:
        parser.error("--events and --rounds must be at least 1")
    if server_cpu() == 0:
        parser.error("no postgres process on this machine: the server's CPU cannot be read")
    print(
        f"per batch of {BATCH}, {args.events:,} events, {args.rounds} rounds; µs per event, medians"
    )
    drains = WRITING_DRAINS if args.writes else DRAINS
    for name, got in run(args.pg_url, args.events, args.rounds, drains).items():
        client, server, wall = (
            statistics.median(split[i] for split in got) / args.events * 1e6 for i in range(3)
        )
        print(
            f"  {name:<24} client CPU {client:6.1f}  server CPU {server:6.1f}"
            f"  both {client + server:6.1f}  wall {wall:6.1f}"
        )


if __name__ == "__main__":
    main()
