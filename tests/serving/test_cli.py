"""The `fuselane` command: help, argument errors and the kernel self-check."""

import io
import subprocess
import sys

import pytest

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


def test_tiny_model_subcommand_builds_a_loadable_folder(tmp_path, capsys):
    assert cli.main(["tiny-model", str(tmp_path / "m")]) == 0
    assert "tiny model written to" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "m" / name).is_file(), name


def test_every_subcommand_has_help():
    for argv in (["check"], ["tiny-model"], ["bench"], ["bench", "serve"], ["canary"], ["demo"]):
        proc = subprocess.run(
            [sys.executable, "-m", "fuselane.serving.cli", *argv, "--help"],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, (argv, proc.stderr)
        assert proc.stdout.startswith("usage: fuselane " + " ".join(argv)), proc.stdout[:80]
