"""vLLM's own chat path as an oracle: ``LLM.chat``, what ``vllm serve`` runs for a chat request,
given the same messages (media as data URLs, which vLLM loads itself) and greedy sampling.

It runs in a worker process of its own (:class:`LlmChatOracle`), each checkpoint's engine in that
process, one after another, so the test process never imports an engine. Each family's chats run
once a session, when its first test asks (the suite runs a family's tests together, beside its
stack), so only the families a run selects start an engine.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import pathlib
import select
import subprocess
import sys
import traceback
from collections.abc import Callable

_URL_PART = {"image": "image_url", "video": "video_url", "audio": "audio_url"}


def chat_messages(messages: list[tuple[str, list]]) -> list[dict]:
    """OpenAI-style messages for ``LLM.chat``: ``(role, parts)`` pairs, each part a text or
    ``(bytes, mime_type)`` as :func:`epd.client.content_part` takes it."""

    def part(value) -> dict:
        if isinstance(value, str):
            return {"type": "text", "text": value}
        data, mime_type = value
        kind = _URL_PART[mime_type.split("/")[0]]
        return {"type": kind, kind: {"url": f"data:{mime_type};base64,{base64.b64encode(data).decode()}"}}

    return [{"role": role, "content": [part(p) for p in parts]} for role, parts in messages]


# One family's engine start and chats, on a loaded 2-core host.
_JOB_TIMEOUT_S = 900


class LlmChatOracle:
    """vLLM's answers to each key's chats, computed on first use and kept for the session.

    One worker process serves them all: it imports vLLM once (about 13 s on a loaded host) and
    builds each family's engine in turn, its engine core in that process.
    """

    def __init__(self, scratch: pathlib.Path):
        self._log_path = scratch / "llm-chat.log"
        self._worker: subprocess.Popen | None = None
        self._answers: dict[str, dict[str, dict]] = {}

    def answers(self, key: str, job: Callable[[], dict]) -> dict[str, dict]:
        """Chat name -> ``token_ids`` and ``prompt_token_ids`` for ``job()``: ``model`` (a
        checkpoint directory), ``dtype``, ``limit_mm_per_prompt`` and ``chats`` (name ->
        ``messages`` from :func:`chat_messages`, ``max_tokens``, ``min_tokens``)."""
        if key not in self._answers:
            self._answers[key] = self._ask(job())
        return self._answers[key]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stdin.close()  # the worker's end of input: it exits
            try:
                self._worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._worker.kill()
                self._worker.wait()

    def _ask(self, job: dict) -> dict[str, dict]:
        worker = self._started()
        worker.stdin.write(json.dumps(job) + "\n")
        worker.stdin.flush()
        readable, _, _ = select.select([worker.stdout], [], [], _JOB_TIMEOUT_S)
        line = worker.stdout.readline() if readable else ""
        assert line, f"the LLM.chat worker gave no answer for {job['model']} within {_JOB_TIMEOUT_S} s:\n{self._log_tail()}"
        answer = json.loads(line)
        assert "error" not in answer, f"LLM.chat failed on {job['model']}:\n{answer.get('error')}\n{self._log_tail()}"
        return answer

    def _started(self) -> subprocess.Popen:
        if self._worker is None or self._worker.poll() is not None:
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
            with self._log_path.open("a") as log:
                self._worker = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        return self._worker

    def _log_tail(self) -> str:
        return self._log_path.read_text(errors="replace")[-6000:] if self._log_path.exists() else ""


def _answer(job: dict) -> dict[str, dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=4096,  # EPD's engines' (EngineConfig.max_model_len)
        enforce_eager=True,
        limit_mm_per_prompt=job["limit_mm_per_prompt"],
        kv_cache_memory_bytes=64 * 2**20,
        seed=0,
    )
    answers = {}
    for name, chat in job["chats"].items():
        sampling = SamplingParams(temperature=0.0, max_tokens=chat["max_tokens"], min_tokens=chat["min_tokens"])
        (output,) = llm.chat(chat["messages"], sampling, use_tqdm=False)
        answers[name] = {"token_ids": list(output.outputs[0].token_ids), "prompt_token_ids": list(output.prompt_token_ids)}
    del llm
    gc.collect()
    return answers


def _serve() -> None:
    """Answers one job a line from stdin, one answer a line; vLLM's own output goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        try:
            answer = _answer(json.loads(line))
        except Exception:
            answer = {"error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
