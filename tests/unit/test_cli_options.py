"""One vocabulary on the command line: every command that takes a concept spells it the same,
ExecutorConfig's field name where there is one; earlier spellings still parse, unshown."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from asyncgraph.cli.main import app
from asyncgraph.cli.options import OLD_SPELLINGS

ROOT: Any = typer.main.get_command(app)
COMMANDS: dict[str, Any] = dict(ROOT.commands)

# concept -> (the one spelling, the Python names commands have used for it)
CONCEPTS = {
    "execution frames": ("--max-concurrent-executions",
                         {"frames", "max_frames", "max_concurrent_executions"}),
    "worker threads": ("--max-parallel-ops", {"parallel", "parallel_ops", "max_parallel_ops"}),
    "input files": ("--input", {"inputs", "input"}),
    "random inputs": ("--random", {"random", "use_random"}),
    "seed": ("--seed", {"seed"}),
    "torch threads": ("--threads", {"threads", "intra_op_threads"}),
    "modules to import": ("--import", {"imports"}),
    "compiled packages": ("--trust-compiled", {"trust_compiled"}),
}
MODEL_COMMANDS = ("run", "trace", "check", "profile", "stress", "serve")


def _options(command: Any) -> dict[str, Any]:
    """The command's options by Python name (typer vendors click: no isinstance here)."""
    return {p.name: p for p in command.params if p.param_type_name == "option" and p.name}


@pytest.mark.parametrize("concept", list(CONCEPTS))
def test_every_command_spells_a_concept_the_same(concept: str) -> None:
    spelling, names = CONCEPTS[concept]
    seen = 0
    for command_name, command in COMMANDS.items():
        for name, option in _options(command).items():
            if name in names:
                seen += 1
                assert spelling in option.opts, (
                    f"asyncgraph {command_name}: {concept} is {option.opts}, not {spelling}")
    assert seen >= 2, f"{concept}: taken by {seen} command(s); nothing to compare"


@pytest.mark.parametrize("concept", ["input files", "random inputs", "seed", "torch threads",
                                     "modules to import", "compiled packages"])
def test_every_command_that_loads_a_model_takes_the_shared_options(concept: str) -> None:
    spelling, _ = CONCEPTS[concept]
    takes = "input" in concept or "random" in concept or concept == "seed"
    for command_name in MODEL_COMMANDS:
        if takes and command_name in ("serve", "stress"):
            continue  # their inputs come from requests or are generated per execution
        opts = {o for p in _options(COMMANDS[command_name]).values() for o in p.opts}
        assert spelling in opts, f"asyncgraph {command_name} lacks {spelling}"


@pytest.mark.parametrize(("old", "current"), sorted(OLD_SPELLINGS.items()))
def test_an_old_spelling_parses_as_the_current_one_and_is_not_in_help(
    old: str, current: str, capsys: pytest.CaptureFixture[str]
) -> None:
    takers = [n for n, c in COMMANDS.items()
              if any(current in p.opts for p in _options(c).values())]
    assert takers, f"no command takes {current}"
    for name in takers:
        command = COMMANDS[name]
        args = ["model.pt2", old, "3"] if name != "serve" else [old, "3"]
        with command.make_context(name, args, resilient_parsing=False) as ctx:
            param = next(p for p in _options(command).values() if current in p.opts)
            assert ctx.params[param.name] == 3, (name, old)
        assert f"{old} is now spelled {current}" in capsys.readouterr().err
        assert old not in CliRunner().invoke(app, [name, "--help"]).output.split(), name


@pytest.mark.parametrize("command", [*COMMANDS])
def test_help_fits_80_columns_and_names_no_source_file(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output, result.output  # nothing cut short
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert ".py" not in result.output, result.output
    assert "[bench]" not in result.output and "bench extra" not in result.output


@pytest.mark.parametrize("args", [
    ["serve", "--version-policy", "latest:x"],
    ["serve", "m.pt2", "--version-policy", "latest:2"],
    ["serve", "m.pt2", "--model-control", "sometimes"],
    ["serve", "m.pt2", "--batch-delay-ms", "3"],
])
def test_serve_refuses_a_bad_or_inapplicable_option_value(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "error:" in result.output and args[-2] in result.output, result.output
