"""A worker rank's process: ``python -m dsv4.parallel.worker --rank R --world-size W --store HOST:PORT ...``.

Started by the driver (``RankGroup.launch``); it joins the groups, serves the driver's steps, and exits with
0 when told to stop. On any error it records its message for the driver (first failure wins) and exits
with 1 at once: it never waits in a collective that cannot complete.
"""

from __future__ import annotations

import argparse
import logging
import signal

from .. import env


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="dsv4.parallel.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of the driver's TCPStore")
    p.add_argument("--device", default="cpu", help="the driver's device (rank r uses cuda:base+r on CUDA)")
    p.add_argument("--parent", type=int, default=None, help="the driver's pid (exit if it dies)")
    a = p.parse_args(argv)
    # Ctrl-C in a terminal reaches every process of the foreground group: the driver alone decides what it
    # means (a report of what finished, then a stop message); a worker interrupted mid-step would fail the run
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=env.text(env.LOG_LEVEL, "WARNING"))
    host, port = a.store.rsplit(":", 1)
    from .comm import RankGroup
    from .driver import run_worker

    run_worker(lambda: RankGroup.join_as_worker(a.rank, a.world_size, (host, int(port)), a.device, a.parent))


if __name__ == "__main__":
    main()
