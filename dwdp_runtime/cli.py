"""The ``dwdp`` console script: tools around the DWDP runtime, one subcommand each.

Subcommands register themselves with an ``add_subparser(sub)`` that sets ``func``; ``main``
returns its exit code. Today: ``plan`` (``dwdp_runtime.planner.cli``). Importing this module
never imports torch.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from .planner import cli as plan_cli

    parser = argparse.ArgumentParser(prog="dwdp", description="DWDP tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    plan_cli.add_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `dwdp plan --json | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
