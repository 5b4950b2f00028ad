"""``moe-ep conformance --fuzz N --seed S`` (moe_ep_conformance.fuzz): it finds a
planted bug, shrinks it, prints the one command that reproduces it, and a seed
draws the same cases again."""

from __future__ import annotations

import argparse
import shlex

import pytest

import moe_ep_spec
from moe_ep_conformance import cli
from moe_ep_conformance.fuzz import case_from_json, case_to_json, fuzz

try:  # tests/ may or may not be a package
    from . import mutants
except ImportError:
    import mutants


def _args(**kw):
    base = dict(backend=None, fuzz=None, seed=0, fuzz_case=None, timeout=60.0, device="cpu")
    base.update(kw)
    return argparse.Namespace(**base)


def test_fuzz_finds_a_planted_bug_and_prints_the_command(capsys):
    failures = fuzz([mutants.RouterWeightTwice()], 20, 1)
    assert len(failures) == 1, "the fuzz must find the router weight applied twice"
    f = failures[0]
    out = capsys.readouterr().out
    assert "FUZZ FAILURE mutant-router-weight-twice" in out and f"reproduce: {f.command}" in out, out
    assert f.command.startswith("moe-ep conformance --backend mutant-router-weight-twice --fuzz-case "), f.command
    # Shrunk: a small layer.
    assert f.case.num_ranks <= 2 and f.case.hidden <= 64 and f.case.num_topk <= 2, f.case
    # The printed command's JSON gives back the same case, which fails again.
    case = case_from_json(shlex.split(f.command)[-1])
    assert case == f.case and case_to_json(case) == case_to_json(f.case)
    backend = mutants.RouterWeightTwice()
    registry = moe_ep_spec.get_registry()
    registry.register(backend)
    try:
        assert cli._run_fuzz(_args(backend=[backend.name], fuzz_case=case_to_json(case))) == 1
    finally:
        registry.unregister(backend.name)


def test_a_seed_reproduces_its_cases():
    drawn = []

    class Recording(type(moe_ep_spec.get_backend("reference"))):
        name = "recording-reference"

        def forward(self, config, inputs):
            drawn.append(config)
            return super().forward(config, inputs)

    assert fuzz([Recording()], 8, 7, log=lambda *a: None) == []
    first = list(drawn)
    drawn.clear()
    assert fuzz([Recording()], 8, 7, log=lambda *a: None) == []
    assert drawn == first and first, "the same seed must draw the same cases"


def test_bad_fuzz_arguments_are_errors():
    with pytest.raises(moe_ep_spec.ConfigError, match="--fuzz-case"):
        case_from_json("{not json")
    with pytest.raises(moe_ep_spec.ConfigError, match="--fuzz-case"):
        case_from_json('{"op": "forward", "colour": 1}')
    with pytest.raises(moe_ep_spec.ConfigError, match="--fuzz must be >= 1"):
        fuzz([moe_ep_spec.get_backend("reference")], 0, 1)
