"""The Go client (clients/go, on the generated Go SDK) against the shared stack.

``scripts/gen_sdks.sh --check`` only compiles it, and a compiled Go SDK can still fail every
call at run time (grpc-go's codec and Debian's golang/protobuf 1.3 could not read the generated
APIv2 messages: each call panicked). So the client runs here against a real gateway of the
shared Qwen2.5-VL stack (``family_stack``: no engine of its own), and its output is checked
against what the Python client sees. The fixture builds the client in module mode, offline
(:mod:`devkit.go_build`), as the SDK check does. Skipped only without ``go``.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from devkit.go_build import build
from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.v1 import common_pb2

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = "What is in this picture?"


@pytest.fixture(scope="module")
def go_client(tmp_path_factory) -> str:
    if shutil.which("go") is None:
        print("SKIP test_go_client: `go` is not on PATH (scripts/gen_sdks.sh installs Debian's Go)")
        pytest.skip("go is not installed")
    if not (ROOT / "sdk" / "go" / "epd" / "v1").is_dir():
        subprocess.run([str(ROOT / "scripts" / "gen_sdks.sh"), "--check"], check=True, timeout=900)
    binary = tmp_path_factory.mktemp("go-client") / "epd-generate"
    build(ROOT / "clients" / "go", binary)
    return str(binary)


def run_go(go_client: str, address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([go_client, "-gateway", address, "-timeout", "3m", *args], capture_output=True, text=True, timeout=240)


async def test_go_streams_the_monolithic_reply(family_stack, go_client, tmp_path):
    data = synthetic_image_png(112, 84, seed=62)
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    oracle = await generate(family_stack.gateway_stub("monolithic"), chat_request([(data, "image/png"), PROMPT], max_tokens=16), timeout=180)
    done = run_go(go_client, family_stack.gateways["epd"].address, "-image", str(path), "-prompt", PROMPT, "-max-tokens", "16")
    assert done.returncode == 0, f"stdout: {done.stdout}\nstderr: {done.stderr}"
    usage = oracle.finished.usage
    finish = common_pb2.FinishReason.Name(oracle.finished.finish_reason)
    expected = f"{oracle.text}\n[finish={finish} prompt_tokens={usage.prompt_tokens} completion_tokens={len(oracle.token_ids)}]\n"
    assert done.stdout == expected


def test_go_decodes_bad_request_details(family_stack, go_client, tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"not an image")
    done = run_go(go_client, family_stack.gateways["epd"].address, "-image", str(path))
    assert done.returncode == 1, f"stdout: {done.stdout}\nstderr: {done.stderr}"
    assert done.stderr == (
        "error: InvalidArgument: invalid media: messages[0].parts[0].image.data is not a decodable image (no image format recognized in its bytes)\n"
        "  messages[0].parts[0].image.data: is not a decodable image (no image format recognized in its bytes)\n"
    )
