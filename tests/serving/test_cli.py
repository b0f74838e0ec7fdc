"""The `fuselane` command: help, argument errors and the kernel self-check."""

import argparse
import io
import subprocess
import sys

import pytest
import torch

from fuselane.serving import cli
from fuselane.serving.selfcheck import run_selfcheck


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "check" in out


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: fuselane" in capsys.readouterr().out


def test_unknown_family_is_named_with_valid_ones():
    out = io.StringIO()
    assert run_selfcheck(families=["nope"], seed=0, out=out) == 2
    assert "unknown kernel family 'nope'; valid: kv_cache, attention, sampling" in out.getvalue()


def test_bad_option_exits_nonzero():
    proc = subprocess.run(
        [sys.executable, "-m", "fuselane.serving.cli", "check", "--seed", "x"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "invalid int value: 'x'" in proc.stderr


def test_check_kv_cache_passes_and_reports():
    out = io.StringIO()
    rc = run_selfcheck(families=["kv_cache"], seed=1, out=out)
    report = out.getvalue()
    assert rc == 0, report
    assert "fp8-e4m3" in report and "rope (neox)" in report and "0 failed" in report
    import torch
    import triton

    # the stack it ran on, first
    assert f"triton   {triton.__version__} (tested)" in report
    assert f"torch    {torch.__version__}" in report and "\nvllm     " in report
    assert "Hopper warp-specialized kernels off: no CUDA device" in report
    assert "launches: Triton's launcher (interpreter)" in report


def test_tiny_model_subcommand_builds_a_loadable_folder(tmp_path, capsys):
    assert cli.main(["tiny-model", str(tmp_path / "m")]) == 0
    assert "tiny model written to" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "m" / name).is_file(), name


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), line: str = "root"):
    """Every (command path, parser, its help line in the parent's list) of the tree, the root
    included, so that a new subcommand is covered without editing this file."""
    yield path, parser, line
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            lines = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name), lines.get(name))


COMMANDS = list(_commands(cli.build_parser()))


def test_the_tree_has_the_documented_commands():
    paths = {" ".join(path) for path, _, _ in COMMANDS}
    assert {"check", "tiny-model", "bench kernels", "bench serve", "canary deploy", "demo"} <= paths


@pytest.mark.parametrize("path", [path for path, _, _ in COMMANDS], ids=" ".join)
def test_every_command_has_help(path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([*path, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(" ".join(("usage: fuselane", *path))), out[:80]


@pytest.mark.parametrize(
    ("path", "parser", "line"), COMMANDS, ids=[" ".join(c[0]) for c in COMMANDS]
)
def test_help_reads_well(path, parser, line):
    """A one-line help in the parent's list, a description, and a help text on every option."""
    assert line, f"{path}: no help line in `fuselane {' '.join(path[:-1])} --help`"
    assert parser.description, f"{path}: no description"
    bare = [
        a.option_strings or [a.dest]
        for a in parser._actions
        if not a.help and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
    ]
    assert not bare, f"{path}: arguments without help: {bare}"


def test_importing_the_cli_loads_no_heavy_package():
    """`fuselane --help` must work (and be quick) without torch, vLLM, Ray or the serve extra."""
    code = (
        "import sys, fuselane.serving.cli; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'vllm', "
        "'ray', 'httpx', 'yaml', 'tqdm', 'matplotlib', 'prometheus_client', 'pydantic'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_version():
    proc = subprocess.run(
        [sys.executable, "-m", "fuselane.serving.cli", "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.startswith("fuselane "), proc


# Bad arguments: exit status 2 and a message on stderr that says what to fix.
BAD_ARGUMENTS = [
    (["nope"], "invalid choice: 'nope'"),
    (["bench"], "the following arguments are required: BENCHMARK"),
    (["bench", "kernels", "--family", "attn"], "invalid choice: 'attn' (choose from"),
    (["bench", "kernels", "--model", "llama"], "invalid choice: 'llama' (choose from"),
    (["bench", "kernels", "--peers", "vllm,cuda"], "unknown peer 'cuda'"),
    (["bench", "kernels", "--budget", "-5"], "must be >= 0"),
    (["bench", "kernels", "--quick", "--interpret-smoke"], "not allowed with argument"),
    (["bench", "kernels", "--interpret-smoke", "--model", "mistral-7b"], "drop --model"),
    (["bench", "serve"], "the following arguments are required"),
    (["canary", "weight", "1.5"], "must be between 0 and 1"),
    (["demo", "--weight", "x"], "not a number: 'x'"),
    (["tiny-model"], "the following arguments are required: dir"),
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS]
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: the benchmark would run")
def test_bench_kernels_without_a_gpu_says_what_to_do(capsys):
    assert cli.main(["bench", "kernels", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--interpret-smoke" in err
