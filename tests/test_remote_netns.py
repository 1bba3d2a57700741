"""The drafter on a host of its own: a network namespace joined to this one by
a veth pair, a delaying proxy in between, and the drafter process killed with
SIGKILL mid-generation. Needs root and ``ip netns`` (CI runs as root); skips
with the reason otherwise."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("grpc")

from specfast.decoder import SpeculativeDecoder  # noqa: E402
from specfast.remote import RemoteDrafter  # noqa: E402
from specfast.remote.proxy import DelayProxy  # noqa: E402

from test_decoder import PROMPTS, one_thread, reference, tiny_model  # noqa: E402,F401

NS = f"sf-drafter-{os.getpid()}"
HOST_IP, DRAFTER_IP = "10.213.7.1", "10.213.7.2"


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    veth = f"sfv{os.getpid() % 100000}"
    try:
        _ip("netns", "add", NS)
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"cannot create a network namespace here: {e}")
    try:
        _ip("link", "add", veth + "h", "type", "veth", "peer", "name", veth + "d")
        _ip("link", "set", veth + "d", "netns", NS)
        _ip("addr", "add", f"{HOST_IP}/24", "dev", veth + "h")
        _ip("link", "set", veth + "h", "up")
        _ip("netns", "exec", NS, "ip", "addr", "add", f"{DRAFTER_IP}/24", "dev", veth + "d")
        _ip("netns", "exec", NS, "ip", "link", "set", veth + "d", "up")
        _ip("netns", "exec", NS, "ip", "link", "set", "lo", "up")
        yield NS
    finally:
        subprocess.run(["ip", "link", "del", veth + "h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def start_drafter(ns, port):
    """``specfast serve-drafter`` in the namespace, bound to its own address."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "specfast.cli", "serve-drafter",
         "--drafter", "ngram", "--host", DRAFTER_IP, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    if "specfast drafter" not in line:
        proc.kill()
        raise RuntimeError(f"the drafter did not start: {line}{proc.stdout.read()}")
    return proc


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0)


def test_drafter_in_another_namespace_killed_mid_run(netns, target):
    proc = start_drafter(netns, 50061)
    try:
        with DelayProxy((DRAFTER_IP, 50061), delay=0.0025, listen=(HOST_IP, 0)) as proxy:
            d = RemoteDrafter(f"{HOST_IP}:{proxy.port}", vocab_size=target.vocab_size,
                              timeout=2.0, retry=0.2)
            dec = SpeculativeDecoder(target, d, k=4)
            emitted = []

            def kill_midway(i, tokens, text):
                emitted.extend(tokens)
                if len(emitted) >= 40 and proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()

            out = dec.generate(PROMPTS, 40, stream=kill_midway)
            assert proc.poll() is not None  # it really died mid-run
            for prompt, g in zip(PROMPTS, out):
                assert g.tokens == reference(target, prompt, 40, temperature=0.0)
            assert d.stats.steps > 0 and d.stats.local_steps > 0 and d.stats.failures
            rtt = sorted(d.stats.round_trips)[len(d.stats.round_trips) // 2]
            assert rtt >= 0.005  # the proxy's 2.5 ms each way
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drafter_restarted_in_its_namespace_is_used_again(netns, target):
    proc = start_drafter(netns, 50062)
    d = RemoteDrafter(f"{DRAFTER_IP}:50062", vocab_size=target.vocab_size, timeout=2.0,
                      retry=0.1)
    dec = SpeculativeDecoder(target, d, k=4)
    try:
        first = [g.tokens for g in dec.generate(PROMPTS, 30)]
        proc.kill()
        proc.wait()
        alone = [g.tokens for g in dec.generate(PROMPTS, 30)]
        assert alone == first and d.stats.failures
        proc = start_drafter(netns, 50062)
        sessions = d.stats.sessions
        for _ in range(50):
            again = [g.tokens for g in dec.generate(PROMPTS, 30)]
            assert again == first
            if d.stats.sessions > sessions:
                break
            time.sleep(0.1)
        assert d.stats.sessions > sessions
    finally:
        proc.kill()
        proc.wait()
