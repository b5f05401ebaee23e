"""The ``tqueue`` command: run servers, the demo, and (later) benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from .config import ControllerConfig, StorageConfig


def _flag(text: str) -> bool:
    """A boolean option's value: 1/0, true/false, yes/no, on/off (``bool("False")`` is True)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _config_flags(parser: argparse.ArgumentParser, config: type, skip: Sequence[str]) -> None:
    """One ``--flag`` per scalar field of a config dataclass (``max_parked`` -> ``--max-parked``),
    so that every setting, limits included, can be given to a server started from a shell."""
    for field in dataclasses.fields(config):
        if field.name not in skip:
            parser.add_argument(
                "--" + field.name.replace("_", "-"),
                type=_flag if isinstance(field.default, bool) else type(field.default),
                default=field.default,
                help=f"{config.__name__}.{field.name} (default {field.default})",
            )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqueue", description=__doc__)
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("controller", help="run a controller")
    c.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint (port 0: OS picks)")
    c.add_argument("--policy", action="append", default=[], metavar="NAME=MODULE:ATTR", help="load a batch policy")
    _config_flags(c, ControllerConfig, ("bind", "policies"))
    c.add_argument("--watch-stdin", action="store_true", help="stop when stdin closes")

    s = sub.add_parser("storage-unit", help="run a storage unit")
    s.add_argument("--controller", required=True, help="the controller's address")
    s.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint (port 0: OS picks)")
    s.add_argument("--host", default="", help="host name for placement (default: this machine)")
    _config_flags(s, StorageConfig, ("controller", "bind", "host"))
    s.add_argument("--watch-stdin", action="store_true", help="stop when stdin closes")

    b = sub.add_parser("bench", help="end-to-end benchmark against peers (source checkout)", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of benchmarks/e2e.py (--help there)")

    st = sub.add_parser("status", help="partitions, tasks, units and waiting calls of a running cluster")
    st.add_argument("controller", help="the controller's address")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    tp = sub.add_parser("top", help="a live view of the status")
    tp.add_argument("controller", help="the controller's address")
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default 1)")
    tp.add_argument("--iterations", type=int, default=0, help="frames to draw (default: until Ctrl-C)")

    i = sub.add_parser("ingest", help="HTTP ingestion for rollout fleets that push (docs/ingest.md)")
    i.add_argument("controller", help="the controller's address")
    i.add_argument("--host", default="127.0.0.1", help="HTTP host to bind (default 127.0.0.1)")
    i.add_argument("--port", type=int, default=8470, help="HTTP port (default 8470; 0: the OS picks)")
    i.add_argument("--token-file", default="", help="file holding the bearer token (default: $TQUEUE_INGEST_TOKEN)")
    i.add_argument("--no-auth", action="store_true", help="accept posts without a token (trusted networks only)")
    i.add_argument("--max-body", type=int, default=64 << 20, help="bytes of one request body (default 64 MiB)")
    i.add_argument("--experts-shape", default="", metavar="LAYERS,TOP_K", help="shape of SGLang routed experts")

    d = sub.add_parser("demo", help="simulated GRPO data flow on a local cluster")
    from .demo import add_arguments

    add_arguments(d)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # every later argument belongs to the benchmark script
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s",
    )
    if getattr(args, "auth_dir", None) == "":  # servers take their keys from the environment too
        args.auth_dir = os.environ.get("TQUEUE_AUTH_DIR", "")
    if args.command == "controller":
        from .launch._serve import run

        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ControllerConfig) if f.name != "policies"}
        run(ControllerConfig(**options, policies=tuple(args.policy)), watch_stdin=args.watch_stdin)
        return 0
    if args.command == "storage-unit":
        from .launch._serve import run

        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(StorageConfig)}
        run(StorageConfig(**options), watch_stdin=args.watch_stdin)
        return 0
    if args.command == "status":
        from .launch._status import status

        return status(args.controller, as_json=args.json)
    if args.command == "top":
        from .launch._status import top

        return top(args.controller, interval=args.interval, iterations=args.iterations)
    if args.command == "ingest":
        return _ingest(args)
    if args.command == "demo":
        if args.engine:
            from .bridges.demo import run_engine_demo

            return run_engine_demo(args)
        from .demo import run_demo

        return run_demo(args)
    return 2


def _bench(argv: list[str]) -> int:
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    script = root / "benchmarks" / "e2e.py"
    if not script.exists():
        print("tqueue bench runs benchmarks/e2e.py from a source checkout; none found next to the package", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("benchmarks.e2e", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks.e2e"] = module
    spec.loader.exec_module(module)
    return int(module.main(argv))


def _ingest(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    token = None
    if not args.no_auth:
        if args.token_file:
            with open(args.token_file) as f:
                token = f.read().strip()
        else:
            token = os.environ.get("TQUEUE_INGEST_TOKEN", "").strip()
        if not token:
            print("tqueue ingest: give a bearer token (--token-file, or $TQUEUE_INGEST_TOKEN), or --no-auth", file=sys.stderr)
            return 2
    shape = None
    if args.experts_shape:
        layers, top_k = (int(x) for x in args.experts_shape.split(","))
        shape = (layers, top_k)

    async def serve() -> None:
        from .bridges.ingest import Ingest
        from .client import AsyncClient

        async with AsyncClient(args.controller) as client:
            server = Ingest(client, token=token, max_body=args.max_body, experts_shape=shape)
            url = await server.start(args.host, args.port)
            print(f"tqueue ingest: serving {url} for the controller at {args.controller}", flush=True)
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            try:
                await stop.wait()
            finally:
                await server.stop()

    asyncio.run(serve())
    return 0
