"""The one console command, ``kvroute``, and its subcommands.

Each subcommand lives in its own module with a ``main(argv) -> int`` function; this file only
dispatches, so ``kvroute --help`` stays fast and a new subcommand is one line in ``COMMANDS``. A
Ctrl-C that a subcommand does not take itself ends here, as one line and exit code 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.serve", "run the router (OpenAI-compatible gateway in front of vLLM pods)"),
    "sidecar": ("sidecar.cli", "run the prefill/decode sidecar beside a decode pod"),
    "sim": ("simulator.cli", "run simulated vLLM pods (HTTP, KV events, NIXL, metrics; no GPU)"),
    "replay": ("replay.cli", "replay a trace or synthetic workload against a target and report"),
    "simulate": ("whatif.cli", "a workload through the router's own decisions against pod models, in simulated time"),
    "plan": ("whatif.plan", "recommend aggregated or P/D (and the split) for a workload by simulating each"),
    "demo": ("fleet.demo", "start a local simulated fleet and the router, replay, print a report"),
    "events": ("indexer.cli", "print a pod's decoded KV-cache event stream as JSON lines"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="KV-cache-aware router for vLLM fleets.",
    )
    from router import __version__

    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help/version or an error for unknown commands
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        return int(module.main(argv[1:]) or 0)
    except KeyboardInterrupt:  # Ctrl-C: a line and the shell's code for it, not a stack trace
        print(f"kvroute {argv[0]}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
