"""The Node client (clients/node, on the generated TypeScript SDK) against the shared stack.

Each test runs ``node clients/node/dist/main.js <command>`` against a real gateway of the
shared Qwen2.5-VL stack (``family_stack``: no engine of its own) and checks the JSON it prints
against what the Python gRPC client sees: the same greedy tokens as the monolithic gateway,
google.rpc.BadRequest details decoded from the grpc-status-details-bin trailer, Abort,
deadlines, grpc.reflection.v1 and health. scripts/gen_sdks.sh --check builds the client (CI
runs it before pytest); the fixture builds it when missing. Skipped only without ``node``.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import grpc
import pytest

from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.v1 import common_pb2
from tests.helpers import violations, wait_for_metric

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN_JS = ROOT / "clients" / "node" / "dist" / "main.js"
PROMPT = "What is in this picture?"


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    node = shutil.which("node")
    if node is None:
        print("SKIP test_node_client: `node` is not on PATH (the Node client needs Node 18 or later)")
        pytest.skip("node is not installed")
    if not MAIN_JS.exists():
        subprocess.run([str(ROOT / "scripts" / "gen_sdks.sh"), "--check"], check=True, timeout=900)
    return [node, str(MAIN_JS)]


def run_node(node_client: list[str], command: str, address: str, *args: str, expect_rc: int = 0) -> dict:
    done = subprocess.run([*node_client, command, "--address", address, *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == expect_rc, f"node {command} exited {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    return json.loads(done.stdout)


@pytest.fixture
def image(tmp_path) -> tuple[pathlib.Path, bytes]:
    data = synthetic_image_png(112, 84, seed=61)
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    return path, data


async def test_node_streams_the_monolithic_tokens(family_stack, node_client, image):
    path, data = image
    oracle = await generate(
        family_stack.gateway_stub("monolithic"), chat_request([(data, "image/png"), PROMPT], max_tokens=16, min_tokens=16), timeout=180
    )
    out = run_node(node_client, "generate", family_stack.gateways["epd"].address, "--image", str(path), "--prompt", PROMPT, "--max-tokens", "16", "--min-tokens", "16")
    assert len(oracle.token_ids) == 16
    assert out["tokenIds"] == oracle.token_ids
    assert out["text"] == oracle.text
    finished = out["finished"]
    assert finished["finishReason"] == common_pb2.FinishReason.Name(oracle.finished.finish_reason)
    assert finished["usage"] == {
        "promptTokens": oracle.finished.usage.prompt_tokens,
        "completionTokens": 16,
        "multimodalTokens": oracle.finished.usage.multimodal_tokens,
    }
    assert finished["usage"]["multimodalTokens"] > 0


async def test_node_decodes_bad_request_details(family_stack, node_client):
    address = family_stack.gateways["epd"].address
    # An undecodable image: refused by the encoder, the field mapped back to the public request.
    out = run_node(node_client, "bad-request", address, expect_rc=0)
    assert out["code"] == "INVALID_ARGUMENT"
    assert out["violations"] == [{"field": "messages[0].parts[0].image.data", "description": "is not a decodable image (no image format recognized in its bytes)"}]
    # max_tokens 0 as well: refused at the gateway's edge, every field at once.
    out = run_node(node_client, "bad-request", address, "--max-tokens", "0", expect_rc=0)
    assert out["code"] == "INVALID_ARGUMENT"
    assert out["violations"] == [{"field": "sampling.max_tokens", "description": "must be at least 1"}]
    # The Python client reads the same details from the same trailer.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(family_stack.gateway_stub("epd"), chat_request([(b"not an image", "image/png"), "Describe this."], max_tokens=0), timeout=60)
    assert violations(info.value) == ["sampling.max_tokens"]


async def test_node_aborts_an_in_flight_request(family_stack, node_client, image):
    path, _ = image
    out = run_node(node_client, "abort", family_stack.gateways["epd"].address, "--image", str(path), "--request-id", "node-abort", "--after", "3")
    assert out["code"] is None and out["abortCode"] is None
    finished = out["finished"]
    assert finished["finishReason"] == "FINISH_REASON_ABORT"
    assert 3 <= out["streamedTokens"] < 2000
    # The final message counts what was streamed, and times the request up to the abort.
    assert finished["usage"]["completionTokens"] == out["streamedTokens"]
    assert 0 < finished["timings"]["timeToFirstTokenS"] < finished["timings"]["totalS"]
    assert await wait_for_metric(family_stack.decode.metrics_port, "epd_requests_in_flight", 0.0) == 0.0
    assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0


async def test_node_hits_its_deadline(family_stack, node_client, image):
    path, _ = image
    out = run_node(node_client, "deadline", family_stack.gateways["epd"].address, "--image", str(path), "--deadline-ms", "3000")
    assert out["code"] == "DEADLINE_EXCEEDED"
    assert out["finished"] is None
    assert out["streamedTokens"] < 2000
    assert 3000 <= out["elapsedMs"] < 10_000
    # The deadline reached every stage: decode's stream ended too.
    assert await wait_for_metric(family_stack.decode.metrics_port, "epd_requests_in_flight", 0.0) == 0.0


def test_node_lists_services_by_reflection_v1_and_checks_health(family_stack, node_client):
    out = run_node(node_client, "services", family_stack.gateways["epd"].address)
    assert out["services"] == ["epd.v1.GatewayService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]
    assert out["health"] == {"": "SERVING", "epd.v1.GatewayService": "SERVING"}
