"""``dwdp-worker``: the worker's command line.

    dwdp-worker --local --model DIR --groups G --dwdp-size D [...]   local launcher (embedded default)
    dwdp-worker pod [--max-num-tokens …]                              pod entrypoint (env contract)
    dwdp-worker synth ARCH --out DIR [...]                            write a tiny synthetic checkpoint
    dwdp-worker demo                                                  end-to-end demo on CPU

Exit codes: 0 success/drained, 1 a rank died or the server failed, 2 bad arguments or environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

SUBCOMMANDS = ("pod", "synth", "demo")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _usage() -> str:
    return __doc__.split("\n\n")[1]


def _exit_now(code: int) -> int:
    """End a front at once: its ranks are stopped and its sockets closed; the interpreter's teardown (seconds
    of garbage collection over torch/transformers objects, measured 3 s on 2 cores) would only delay the exit
    a pod restart waits for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    if cmd == "synth":
        from ..checkpoint.synth import add_synth_arguments, synth_main

        p = argparse.ArgumentParser(prog="dwdp-worker synth", description="write a seeded tiny MoE checkpoint")
        add_synth_arguments(p)
        return synth_main(p.parse_args(argv[1:]))
    if cmd == "pod":
        from .pod import add_pod_arguments, run_pod

        p = argparse.ArgumentParser(prog="dwdp-worker pod",
                                    description="pod entrypoint: reads the operator's env (docs/ENV_CONTRACT.md)")
        add_pod_arguments(p)
        args = p.parse_args(argv[1:])
        _setup_logging(args.log_level)
        return _exit_now(run_pod(args))
    if cmd == "demo":
        from .demo import add_demo_arguments, run_demo

        p = argparse.ArgumentParser(prog="dwdp-worker demo",
                                    description="tiny synthetic model → local DWDP group on CPU → one request")
        add_demo_arguments(p)
        return run_demo(p.parse_args(argv[1:]))
    if "--local" in argv:
        from .local import add_local_arguments, run_local

        p = argparse.ArgumentParser(prog="dwdp-worker --local",
                                    description="run G groups × D ranks as local processes behind one HTTP port")
        add_local_arguments(p)
        args = p.parse_args(argv)
        _setup_logging(args.log_level)
        return _exit_now(run_local(args))
    if argv and argv[0] in ("-h", "--help"):
        print("usage:\n" + _usage())
        return 0
    print("dwdp-worker: error: say what to run\nusage:\n" + _usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
