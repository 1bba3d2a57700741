"""The ``specfast`` command's dispatch: ``info`` and every subcommand's help."""

import subprocess
import sys

import pytest

import specfast


def cli(*args):
    return subprocess.run([sys.executable, "-m", "specfast.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_info_reports_version_simd_and_threads():
    out = cli("info")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"specfast {specfast.__version__}",
                                       f"simd level: {specfast.simd_level()}",
                                       f"threads: {specfast.get_num_threads()}"]


@pytest.mark.parametrize("command", ["bench", "demo", "generate", "serve-drafter"])
def test_every_subcommand_has_its_options(command):
    out = cli(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: specfast {command}")


def test_unknown_command_is_a_usage_error():
    out = cli("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.parametrize("args, said", [
    (["--top-p", "0"], "top_p=0.0"), (["--temperature", "-1"], "temperature=-1.0"),
    (["--drafter", "ngram:x"], "'ngram:N' takes"),
], ids=["top-p", "temperature", "ngram-spec"])
def test_generate_refuses_bad_settings_before_loading_a_model(args, said):
    out = cli("generate", "--prompt", "hi", "--target", "/nonexistent/model", *args)
    assert out.returncode != 0 and said in out.stderr and "Traceback" not in out.stderr
