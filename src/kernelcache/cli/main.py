"""The ``kernelcache`` command: a thin layer over the public API.

Imports stay inside the commands so that ``kernelcache nvcc`` (a compiler
launcher on every build's critical path) pays for none of them. Bad
arguments print a clear message and exit with status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernelcache.settings import Settings

#: Subcommands implemented by other modules, handed their arguments untouched.
DELEGATED = ("demo", "nvcc")


def _size(text: str) -> int:
    from kernelcache.errors import ConfigError
    from kernelcache.units import parse_size

    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _age(text: str) -> float:
    from kernelcache.errors import ConfigError
    from kernelcache.units import parse_age

    try:
        return parse_age(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: use a whole number >= 0")
    return int(text)


# A limit of 0 would empty the cache without asking, while KERNELCACHE_MAX_SIZE=0
# means "no cap" (issue 20): 0 is refused, and `clear` named.
_ZERO = "0 would remove every entry: use `kernelcache clear` (KERNELCACHE_MAX_SIZE=0 means no cap)"


def _limit_size(text: str) -> int:
    size = _size(text)
    if size == 0:
        raise argparse.ArgumentTypeError(_ZERO)
    return size


def _limit_count(text: str) -> int:
    count = _count(text)
    if count == 0:
        raise argparse.ArgumentTypeError(_ZERO)
    return count


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a --dir after the command must not be reset by the command's default.
    common.add_argument(
        "--dir", default=argparse.SUPPRESS, help="cache directory (overrides KERNELCACHE_DIR)"
    )
    parser = argparse.ArgumentParser(
        prog="kernelcache",
        description="Inspect and maintain a kernelcache directory.",
        epilog="Sizes take units K, M, G, T (5G); ages take s, m, h, d, w (30d).",
    )
    parser.add_argument("--dir", help="cache directory (overrides KERNELCACHE_DIR)")
    parser.add_argument("--version", action="version", version=f"kernelcache {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    p = command("stats", "hits, misses, errors, size and time saved, per tier")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--zero", action="store_true", help="start a new period (lifetime totals stay)")
    p.add_argument(
        "--format",
        choices=("table", "json", "openmetrics"),
        default="table",
        help="openmetrics: Prometheus text format, lifetime counters per tier and integration",
    )
    p.add_argument(
        "--days",
        type=_count,
        nargs="?",
        const=30,
        metavar="N",
        help="seconds saved per day over the last N days (default 30), with a text chart",
    )
    p = command("ls", "list entries")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--sort",
        choices=("size", "age", "hits"),
        default="age",
        help="largest first: biggest, least recently used, most hit (default: age)",
    )
    p = command("show", "one entry: metadata, artifacts, sizes, checksums")
    p.add_argument("key")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("verify", "check every entry's checksums")
    p.add_argument("--fix", action="store_true", help="remove entries that fail")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("prune", "remove least recently used entries down to limits (local tiers)")
    p.add_argument("--max-size", type=_limit_size, metavar="SIZE", help="keep at most SIZE (5G)")
    p.add_argument("--max-entries", type=_limit_count, metavar="N", help="keep at most N entries")
    p.add_argument("--older-than", type=_age, metavar="AGE", help="remove entries unused for AGE")
    p.add_argument("--dry-run", action="store_true", help="remove nothing; say what would go")
    p.add_argument("--remote", action="store_true", help="the team tier (Redis) too")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("clear", "remove every entry (local tiers)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--remote", action="store_true", help="the team tier (Redis) too")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("export", "write entries to one bundle file")
    p.add_argument("file")
    p.add_argument("--since", type=_age, metavar="AGE", help="only entries used within AGE")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("import", "add every entry of a bundle file (all or nothing)")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--inductor",
        action="store_true",
        help="FILE is a torch.compiler.save_cache_artifacts() blob: store its FX graph and "
        "AOTAutograd entries for kernelcache.inductor",
    )
    p = command("config", "every setting (core, Triton, launcher), its value and its source")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("explain", "why a key missed: its fields against the nearest stored entries")
    p.add_argument("what", nargs="*", help="a KEY, or -- nvcc ARGS... (a launcher command line)")
    p.add_argument(
        "--last-miss", metavar="KIND", help="the last compile of nvcc, nvrtc, triton, ..."
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("doctor", "check this machine's set-up: one line per check, with its fix")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("server", "the nvcc launcher's server of this cache directory")
    p.add_argument("action", choices=("status", "stop"), help="show it, or stop it")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("setup", "make what a tool needs to compile through the cache")
    p.add_argument("tool", choices=("deepgemm",), help="deepgemm: DG_JIT_NVCC_COMPILER's shim")
    p.add_argument("--nvcc", help="the nvcc behind it (default: $CUDA_HOME/bin/nvcc, PATH)")
    sub.add_parser("demo", help="run the demonstration (arguments are passed on)")
    sub.add_parser("nvcc", help="compile through the cache: kernelcache nvcc ARGS...")
    return parser


def _version() -> str:
    from kernelcache import __version__

    return __version__


def _split_delegated(argv: list[str]) -> tuple[str | None, list[str], str | None]:
    """``(command, its args, --dir)`` for ``demo``/``nvcc``, whose args argparse must not see."""
    index, directory = 0, None
    while index < len(argv):
        arg = argv[index]
        if arg == "--dir" and index + 1 < len(argv):
            directory, index = argv[index + 1], index + 2
        elif arg.startswith("--dir="):
            directory, index = arg[len("--dir=") :], index + 1
        else:
            break
    if index < len(argv) and argv[index] in DELEGATED:
        return argv[index], argv[index + 1 :], directory
    return None, argv, None


def _delegate(command: str, rest: list[str], directory: str | None) -> int:
    if directory is not None:  # an argument: resolved once, here (the variable must be absolute)
        os.environ["KERNELCACHE_DIR"] = os.path.abspath(os.path.expanduser(directory))
    if command == "nvcc":
        from kernelcache.nvcc.front import main as nvcc_main

        return int(nvcc_main(["nvcc", *rest]))
    from kernelcache.demo import main as demo_main

    return int(demo_main(rest))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    delegated, rest, directory = _split_delegated(argv)
    if delegated is not None:
        return _delegate(delegated, rest, directory)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: 2 for bad arguments, 0 for --help
        return exc.code if isinstance(exc.code, int) else 2
    from kernelcache.errors import ConfigError, KernelCacheError

    try:
        if args.command == "doctor":  # it reports bad settings: it cannot start by loading them
            from kernelcache.cli.doctor import cmd_doctor

            return cmd_doctor(args)
        from kernelcache.settings import Settings

        settings = Settings.load(dir=args.dir)
        return int(COMMANDS[args.command](args, settings))
    except ConfigError as exc:
        print(f"kernelcache: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `kernelcache ls | head`: the reader left. Point stdout at /dev/null so
        # the interpreter's final flush does not complain, and exit quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KernelCacheError, OSError) as exc:
        print(f"kernelcache: error: {exc}", file=sys.stderr)
        return 1


def _lazy(module: str, name: str) -> Any:
    """A command implemented in another CLI module, imported only when it runs."""

    def run(args: argparse.Namespace, settings: Settings) -> int:
        from importlib import import_module

        return int(getattr(import_module(f"kernelcache.{module}"), name)(args, settings))

    return run


COMMANDS = {
    "stats": _lazy("cli.stats", "cmd_stats"),
    "ls": _lazy("cli.listing", "cmd_ls"),
    "show": _lazy("cli.listing", "cmd_show"),
    "config": _lazy("cli.config", "cmd_config"),
    "verify": _lazy("cli.maint", "cmd_verify"),
    "prune": _lazy("cli.maint", "cmd_prune"),
    "clear": _lazy("cli.maint", "cmd_clear"),
    "export": _lazy("cli.maint", "cmd_export"),
    "import": _lazy("cli.maint", "cmd_import"),
    "server": _lazy("cli.server", "cmd_server"),
    "explain": _lazy("cli.explain", "cmd_explain"),
    "setup": _lazy("cli.setup", "cmd_setup"),
}
