"""The tqueue command: run a controller or a storage unit, watch a running cluster, take
rollouts over HTTP, run the simulated demo or the end-to-end benchmark.

An error prints one line, "tqueue: error: ...", and exits with 2 for a wrong command line,
1 for anything else (--debug shows the traceback). Ctrl-C exits with 130, except where it is
the way to stop: the servers, top and ingest exit with 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .config import ControllerConfig, MiB, StorageConfig, field_help

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
INTERRUPTED = 130  # the shell's code for a process ended by SIGINT (128 + 2)


class UsageError(Exception):
    """A command line that cannot run as given: exit code 2, one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"tqueue: error: {message} (see: {self.prog} --help)\n")


def _flag(text: str) -> bool:
    """A boolean option's value: 1/0, true/false, yes/no, on/off (``bool("False")`` is True)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _size(value: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if value >= MiB and value % (1 << shift) == 0:
            return f"{value} = {value >> shift} {unit}"
    return str(value)


def _default_text(action: argparse.Action) -> str:
    """An option's default as ``--help`` and the docs show it ("" where the help says it all:
    switches, no default, an empty string)."""
    default = action.default
    if default is argparse.SUPPRESS or default is None or default == "" or default == [] or isinstance(action, _SWITCHES):
        return ""
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, int) and ("bytes" in action.dest or action.metavar == "BYTES"):
        return _size(default)
    return str(default)


_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._VersionAction, argparse._HelpAction)


class _Formatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        shown = _default_text(action)
        help = action.help or ""
        return f"{help} (default: {shown.replace('%', '%%')})" if shown else help


_METAVARS = {"bind": "ENDPOINT", "host": "HOST", "advertise": "HOST", "auth_dir": "DIR", "name": "NAME", "restore": "DIR",
             "checkpoint_root": "DIR"}


def _metavar(name: str, default: Any) -> str:
    if isinstance(default, bool):
        return "{true,false}"
    if isinstance(default, float):
        return "SECONDS"
    if isinstance(default, int):
        return "BYTES" if name.endswith("bytes") else "N"
    return _METAVARS.get(name, name.upper())


def _config_flags(parser: argparse.ArgumentParser, config: type, skip: Sequence[str]) -> None:
    """One ``--flag`` per scalar field of a config dataclass (``max_parked`` -> ``--max-parked``),
    so that every setting, limits included, can be given to a server started from a shell. The
    help is the field's own (its ``help`` metadata in tqueue/config.py)."""
    for field in dataclasses.fields(config):
        if field.name not in skip:
            parser.add_argument(
                "--" + field.name.replace("_", "-"),
                type=_flag if isinstance(field.default, bool) else type(field.default),
                default=field.default,
                metavar=_metavar(field.name, field.default),
                help=field_help(config, field.name).replace("%", "%%"),
            )
    for old, new in getattr(config, "RENAMED", {}).items():  # an old spelling: works for one release, unlisted
        parser.add_argument("--" + old.replace("_", "-"), dest=new, action=_Renamed, new="--" + new.replace("_", "-"),
                            type=type(next(f.default for f in dataclasses.fields(config) if f.name == new)),
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class _Renamed(argparse.Action):
    """The old spelling of a flag (``new``): it sets the new one's value and warns, as a
    deprecation warning and on stderr (a shell shows no deprecation warning)."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from ._api import REMOVED_IN, deprecated

        deprecated(option_string or self.option_strings[0], self.new, stacklevel=2)
        print(f"tqueue: warning: {option_string} is deprecated and stops working in tqueue {REMOVED_IN}: use {self.new}",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def _common() -> _Parser:
    """The options every command takes, before or after its name. Their defaults are
    SUPPRESS, so that a subcommand's parser leaves a value given before its name alone (the
    actions are shared: set_defaults on one parser would change them for all)."""
    g = _Parser(add_help=False)
    g.add_argument("--log-level", type=str.upper, choices=LEVELS, default=argparse.SUPPRESS, metavar="LEVEL",
                   help=f"log to stderr from this level on: {', '.join(LEVELS)} (default: WARNING)")
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, show its traceback")
    return g


def _version() -> str:
    """The installed distribution's version, as tqueue.__version__ reads it."""
    import importlib.metadata

    try:
        return importlib.metadata.version("tqueue")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path that pip did not install
        return str(sys.modules[__package__ or "tqueue"].__version__)  # the package, imported before its modules


def _parser() -> argparse.ArgumentParser:
    common = _common()
    p = _Parser(prog="tqueue", description=__doc__, parents=[common], formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"tqueue {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common], formatter_class=_Formatter, **kwargs)

    c = command("controller", "run a controller: it prints its ready line, then serves until SIGTERM or Ctrl-C")
    c.add_argument("--policy", action="append", default=[], metavar="NAME=MODULE:ATTR",
                   help=field_help(ControllerConfig, "policies") + "; one per --policy, which repeats")
    _config_flags(c, ControllerConfig, ("policies",))
    c.add_argument("--watch-stdin", action="store_true", help="also stop when stdin closes (a launcher's child)")

    s = command("storage-unit", "run a storage unit: it registers with the controller, prints its ready line and serves")
    s.add_argument("--controller", required=True, metavar="ADDR", help=field_help(StorageConfig, "controller"))
    _config_flags(s, StorageConfig, ("controller",))
    s.add_argument("--watch-stdin", action="store_true", help="also stop when stdin closes (a launcher's child)")

    st = command("status", "partitions, tasks, storage units and waiting calls of a running cluster")
    st.add_argument("controller", metavar="ADDR", help="the controller's address")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    tp = command("top", "the status of a running cluster, redrawn every interval, with rates")
    tp.add_argument("controller", metavar="ADDR", help="the controller's address")
    tp.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="seconds between frames")
    tp.add_argument("--iterations", type=int, default=0, metavar="N", help="frames to draw (0: until Ctrl-C)")

    ck = command("checkpoint", "write a running cluster's data plane into DIRECTORY (docs/api.md, save_checkpoint)")
    ck.add_argument("controller", metavar="ADDR", help="the controller's address")
    ck.add_argument("directory", metavar="DIRECTORY",
                    help="where the checkpoint goes: a name under the servers' --checkpoint-root where they have one, "
                    "else a path, the same on the controller's and every unit's host")
    ck.add_argument("--metadata", default="null", metavar="JSON", help="JSON kept in the manifest, given back by restore")
    rs = command("restore", "load the checkpoint in DIRECTORY into a cluster, beside its partitions (docs/api.md, load_checkpoint)")
    rs.add_argument("controller", metavar="ADDR", help="the controller's address")
    rs.add_argument("directory", metavar="DIRECTORY",
                    help="a checkpoint that save_checkpoint or tqueue checkpoint wrote, named as it was named there")
    rs.add_argument("--replace", action="store_true",
                    help="replace the live partitions that have a checkpoint partition's name (default: refuse the load)")

    i = command("ingest", "HTTP ingestion for rollout fleets that push (docs/ingest.md)")
    i.add_argument("controller", metavar="ADDR", help="the controller's address")
    i.add_argument("--host", default="127.0.0.1", help="HTTP host to bind")
    i.add_argument("--port", type=int, default=8470, metavar="PORT", help="HTTP port (0: the OS picks)")
    i.add_argument("--token-file", default="", metavar="FILE",
                   help="file holding the bearer token (default: the TQUEUE_INGEST_TOKEN environment variable)")
    i.add_argument("--no-auth", action="store_true", help="accept posts without a token (trusted networks only)")
    i.add_argument("--max-body", type=int, default=64 * MiB, metavar="BYTES", help="bytes of one request body")
    i.add_argument("--experts-shape", type=_pair, default=None, metavar="LAYERS,TOP_K",
                   help="shape of SGLang's routed experts per token, to store them as a tensor field")

    d = command("demo", "a simulated GRPO data flow on a local cluster, or the main job with a real engine")
    from .demos.simulated import add_arguments

    add_arguments(d)
    command("bench", "the end-to-end benchmark against the peers, from a source checkout (tqueue bench --help)",
            add_help=False)
    return p


def _pair(text: str) -> tuple[int, int]:
    try:
        layers, top_k = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYERS,TOP_K (two integers), got {text!r}") from None
    return layers, top_k


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("tqueue: interrupted", file=sys.stderr)
        return INTERRUPTED
    except UsageError as exc:
        print(f"tqueue: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if "--debug" in argv:  # looked for anywhere, also where the command line did not parse
            import traceback

            traceback.print_exc()
        print(f"tqueue: error: {_describe(exc)}", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _describe(exc: Exception) -> str:
    """One line for an error: its message where it is one of the errors a user meets (tqueue's
    own, a missing extra, the system's), else its type too, and where to look further."""
    from .errors import TQueueError

    if isinstance(exc, (TQueueError, ImportError, OSError)):
        return _one_line(exc)
    return f"{type(exc).__name__}: {_one_line(exc)} (--debug shows the traceback)"


def _run(argv: list[str]) -> int:
    parser = _parser()
    bench = _split_bench(argv)
    if bench is not None:  # every argument of the benchmark goes to its own parser
        own, rest = bench
        _logging(getattr(parser.parse_args([*own, "bench"]), "log_level", "WARNING"))
        return _bench(rest)
    args = parser.parse_args(argv)
    _logging(getattr(args, "log_level", "WARNING"))
    run: Callable[[argparse.Namespace], int] = _COMMANDS[args.command]
    return run(args)


def _logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")


def _split_bench(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """For ``tqueue [OPTIONS] bench ARGS``: tqueue's own options (from anywhere) and the
    benchmark's arguments; None for another command."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "--log-level" else 1
    if argv[i : i + 1] != ["bench"]:
        return None
    own, rest = argv[:i], list[str]()
    j = i + 1
    while j < len(argv):
        if argv[j] == "--log-level":
            own += argv[j : j + 2]
            j += 2
            continue
        (own if argv[j] == "--debug" or argv[j].startswith("--log-level=") else rest).append(argv[j])
        j += 1
    return own, rest


def _servers_auth(args: argparse.Namespace) -> str:
    return args.auth_dir or os.environ.get("TQUEUE_AUTH_DIR", "")  # servers take their keys from the environment too


def _controller(args: argparse.Namespace) -> int:
    from .launch._serve import run

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ControllerConfig) if f.name != "policies"}
    options["auth_dir"] = _servers_auth(args)
    run(ControllerConfig(**options, policies=tuple(args.policy)), watch_stdin=args.watch_stdin)
    return 0


def _storage_unit(args: argparse.Namespace) -> int:
    from .launch._serve import run

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(StorageConfig)}
    options["auth_dir"] = _servers_auth(args)
    run(StorageConfig(**options), watch_stdin=args.watch_stdin)
    return 0


def _status(args: argparse.Namespace) -> int:
    from .launch._status_text import status

    return status(args.controller, as_json=args.json)


def _top(args: argparse.Namespace) -> int:
    from .launch._status_text import top

    return top(args.controller, interval=args.interval, iterations=args.iterations)


def _demo(args: argparse.Namespace) -> int:
    from .demos.simulated import resolve_arguments

    wrong = resolve_arguments(args)
    if wrong:
        raise UsageError(wrong)
    if args.engine:
        from .demos.engine import run_engine_demo

        return run_engine_demo(args)
    from .demos.simulated import run_demo

    return run_demo(args)


def _bench_module() -> Any:
    """benchmarks/e2e.py of the source checkout this package runs from."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    script = root / "benchmarks" / "e2e.py"
    if not script.exists():
        raise UsageError("tqueue bench runs benchmarks/e2e.py from a source checkout; none found next to the package")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # the script imports its siblings as the package benchmarks
    spec = importlib.util.spec_from_file_location("benchmarks.e2e", script)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot load {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks.e2e"] = module
    spec.loader.exec_module(module)
    return module


def _bench(argv: list[str]) -> int:
    return int(_bench_module().main(argv, prog="tqueue bench"))


def _checkpoint(args: argparse.Namespace) -> int:
    import json

    from .client import Client

    try:
        metadata = json.loads(args.metadata)
    except ValueError as exc:
        raise UsageError(f"--metadata is JSON: {exc}") from None
    with Client(args.controller) as client:
        info = client.checkpoints.save(args.directory, metadata=metadata)
    print(
        f"tqueue checkpoint: {info.manifest}: {info.partitions} partitions, {info.samples} samples, "
        f"{info.payload_bytes} payload bytes in {info.seconds:.2f} s (loops held {1e3 * info.pause:.1f} ms at most)"
    )
    return 0


def _restore(args: argparse.Namespace) -> int:
    import json

    from .client import Client

    with Client(args.controller) as client:
        metadata = client.checkpoints.load(args.directory, replace=args.replace)
        parts = len(client.status().partitions)
    print(f"tqueue restore: {parts} partitions from {args.directory}; metadata {json.dumps(metadata)}")
    return 0


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
            raise UsageError("tqueue ingest needs a bearer token (--token-file, or $TQUEUE_INGEST_TOKEN), or --no-auth")

    async def serve() -> None:
        from .bridges.ingest import Ingest
        from .client import AsyncClient

        async with AsyncClient(args.controller) as client:
            server = Ingest(client, token=token, max_body=args.max_body, experts_shape=args.experts_shape)
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


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "controller": _controller,
    "storage-unit": _storage_unit,
    "status": _status,
    "top": _top,
    "checkpoint": _checkpoint,
    "restore": _restore,
    "ingest": _ingest,
    "demo": _demo,
}


def reference() -> str:
    """Every command's arguments as Markdown tables: the generated section of
    docs/operations.md (the tests check that the two agree)."""
    parser = _parser()
    commands: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands = dict(action.choices)
    out = [_table("tqueue", parser)]
    for name, sub in commands.items():
        if name == "bench":
            try:
                sub = _bench_module().make_parser(prog="tqueue bench")
            except UsageError:
                continue
        out.append(_table(f"tqueue {name}", sub))
    return "\n".join(out)


def _table(title: str, parser: argparse.ArgumentParser) -> str:
    about = " ".join((parser.description or "").strip().split("\n\n")[0].split())
    rows = [f"### `{title}`", "", about, "",
            "| argument | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            rows += [f"| `{name}` | | {sub.description} |" for name, sub in action.choices.items()]
            continue
        if isinstance(action, argparse._HelpAction) and title != "tqueue":
            continue  # every command has it, said once in the first table
        if action.help == argparse.SUPPRESS:
            continue  # an old spelling (_Renamed): unlisted, as in --help
        name = ", ".join(action.option_strings) or str(action.metavar or action.dest)
        if action.option_strings and action.nargs != 0:
            choices = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else ""
            name += f" {action.metavar or choices or action.dest.upper()}"
        help = (action.help or "") % {"prog": parser.prog, "default": action.default}
        rows.append(f"| `{name}` | {_default_text(action)} | {help.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
