"""The Python client (clients/python/usage.py) on the ``epd-client`` SDK alone, against the
shared stack.

``scripts/gen_sdks.sh --check`` installs the SDK into its own venv (no vLLM, no torch) and only
type-checks the client there; this runs it, from that venv, against a real gateway of the
shared Qwen2.5-VL stack (``family_stack``: no engine of its own), so the published package is
shown to speak to a live gateway, and checks its output against the services' own client.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.v1 import common_pb2

ROOT = pathlib.Path(__file__).resolve().parents[1]
SDK_PYTHON = ROOT / "sdk" / ".tools" / "bin" / "python"
USAGE = ROOT / "clients" / "python" / "usage.py"
PROMPT = "What is in this picture?"


@pytest.fixture(scope="module")
def sdk_python() -> str:
    """The SDK venv's interpreter: the package and its gRPC runtime, no torch, vLLM or NIXL
    (``gen_sdks.sh --check`` asserts that). ``usage.py`` run by it imports ``epd.v1`` from there:
    a script's own folder, not the working directory, heads ``sys.path``."""
    if not SDK_PYTHON.exists():
        subprocess.run([str(ROOT / "scripts" / "gen_sdks.sh"), "--check"], check=True, timeout=900)
    return str(SDK_PYTHON)


def run_usage(sdk_python: str, address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sdk_python, str(USAGE), "--gateway", address, *args], capture_output=True, text=True, timeout=240)


async def test_python_sdk_streams_the_monolithic_reply(family_stack, sdk_python, tmp_path):
    data = synthetic_image_png(112, 84, seed=63)
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    oracle = await generate(family_stack.gateway_stub("monolithic"), chat_request([(data, "image/png"), PROMPT], max_tokens=16), timeout=180)
    done = run_usage(sdk_python, family_stack.gateways["epd"].address, "--image", str(path), "--max-tokens", "16", PROMPT)
    assert done.returncode == 0, f"stdout: {done.stdout}\nstderr: {done.stderr}"
    finish = common_pb2.FinishReason.Name(oracle.finished.finish_reason)
    assert done.stdout == f"{oracle.text}\n[{len(oracle.token_ids)} tokens, finish={finish}, prompt_tokens={oracle.finished.usage.prompt_tokens}]\n"


def test_python_sdk_decodes_bad_request_details(family_stack, sdk_python, tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"not an image")
    done = run_usage(sdk_python, family_stack.gateways["epd"].address, "--image", str(path))
    assert done.returncode == 1, f"stdout: {done.stdout}\nstderr: {done.stderr}"
    assert (
        done.stderr
        == "error: INVALID_ARGUMENT\n  messages[0].parts[0].image.data: is not a decodable image (no image format recognized in its bytes)\n"
    )
