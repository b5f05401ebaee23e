"""The ``tqueue`` command: run servers, the demo, and (later) benchmarks."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqueue", description=__doc__)
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("controller", help="run a controller")
    c.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint (port 0: OS picks)")
    c.add_argument("--watch-stdin", action="store_true", help="stop when stdin closes")

    s = sub.add_parser("storage-unit", help="run a storage unit")
    s.add_argument("--controller", required=True, help="the controller's address")
    s.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint (port 0: OS picks)")
    s.add_argument("--host", default="", help="host name for placement (default: this machine)")
    s.add_argument("--trim-delay", type=float, default=5.0, help="idle seconds before freed memory goes back to the OS")
    s.add_argument("--watch-stdin", action="store_true", help="stop when stdin closes")

    d = sub.add_parser("demo", help="simulated GRPO data flow on a local cluster")
    from .demo import add_arguments

    add_arguments(d)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "controller":
        from .config import ControllerConfig
        from .launch._serve import run

        run(ControllerConfig(bind=args.bind), watch_stdin=args.watch_stdin)
        return 0
    if args.command == "storage-unit":
        from .config import StorageConfig
        from .launch._serve import run

        run(
            StorageConfig(controller=args.controller, bind=args.bind, host=args.host, trim_delay=args.trim_delay),
            watch_stdin=args.watch_stdin,
        )
        return 0
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    return 2
