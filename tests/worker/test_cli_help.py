"""Every flag of ``dwdp-worker`` (all subcommands) and ``dwdp-operator`` has help text, and ``--help``
prints it (real argparse parsers, real console entry points)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from dwdp_worker.launch.demo import add_demo_arguments
from dwdp_worker.launch.local import add_local_arguments
from dwdp_worker.launch.pod import add_pod_arguments
from dwdp_worker.checkpoint.synth import add_synth_arguments

from .serving_helpers import ROOT, child_env


def _operator_parser():
    sys.path.insert(0, str(ROOT / "operator"))
    from dwdp_operator.cli import _parser

    return _parser()


def _built(add) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add(p)
    return p


PARSERS = {"--local": lambda: _built(add_local_arguments), "pod": lambda: _built(add_pod_arguments),
           "synth": lambda: _built(add_synth_arguments), "demo": lambda: _built(add_demo_arguments),
           "dwdp-operator": _operator_parser}


@pytest.mark.parametrize("name", PARSERS)
def test_every_flag_has_help(name):
    parser = PARSERS[name]()
    missing = [a.option_strings or [a.dest] for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and (not a.help or a.help == argparse.SUPPRESS)]
    assert not missing, f"{name}: flags without help: {missing}"


@pytest.mark.parametrize("argv,needle", [(["-m", "dwdp_worker.launch.cli", "--local", "--help"], "--max-num-tokens"),
                                         (["-m", "dwdp_worker.launch.cli", "pod", "--help"], "--rendezvous-timeout-s"),
                                         (["-m", "dwdp_operator.cli", "--help"], "--metrics-port")])
def test_help_prints_and_exits_zero(argv, needle):
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60,
                         env=child_env({"PYTHONPATH": f"{ROOT / 'worker'}:{ROOT / 'operator'}:{ROOT}"}))
    assert out.returncode == 0, out.stderr
    assert needle in out.stdout
