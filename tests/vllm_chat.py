"""vLLM's own chat path as an oracle: ``LLM.chat``, what ``vllm serve`` runs for a chat request,
given the same messages (media as data URLs, which vLLM loads itself) and greedy sampling.

It runs in a process of its own (``run_llm_chat``), each checkpoint's engine in that process, one
after another, so the test process never imports an engine. :class:`LlmChatOracle` runs each
family's chats once a session, when its first test asks (the suite runs a family's tests
together, beside its stack), so only the families a run selects start an engine.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

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


def run_llm_chat(jobs: list[dict], scratch: pathlib.Path) -> dict[str, dict[str, dict]]:
    """Each job: ``model`` (a checkpoint directory), ``dtype``, ``limit_mm_per_prompt`` and
    ``chats`` (name -> ``messages`` from :func:`chat_messages`, ``max_tokens``, ``min_tokens``).
    Returns model -> chat name -> ``token_ids`` and ``prompt_token_ids``."""
    jobs_file, results_file = scratch / "jobs.json", scratch / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    done = subprocess.run([sys.executable, __file__, str(jobs_file), str(results_file)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(results_file.read_text())


class LlmChatOracle:
    """vLLM's answers to each key's chats, computed on first use and kept for the session."""

    def __init__(self, scratch: pathlib.Path):
        self._scratch = scratch
        self._answers: dict[str, dict[str, dict]] = {}

    def answers(self, key: str, job: Callable[[], dict]) -> dict[str, dict]:
        """Chat name -> ``token_ids`` and ``prompt_token_ids`` for ``job()`` (see :func:`run_llm_chat`)."""
        if key not in self._answers:
            scratch = self._scratch / key.replace("@", "-")
            scratch.mkdir()
            spec = job()
            self._answers[key] = run_llm_chat([spec], scratch)[spec["model"]]
        return self._answers[key]


def _run(jobs: list[dict]) -> dict[str, dict[str, dict]]:
    from vllm import LLM, SamplingParams

    results: dict[str, dict[str, Any]] = {}
    for job in jobs:
        llm = LLM(
            model=job["model"],
            dtype=job["dtype"],
            max_model_len=4096,  # EPD's engines' (EngineConfig.max_model_len)
            enforce_eager=True,
            limit_mm_per_prompt=job["limit_mm_per_prompt"],
            kv_cache_memory_bytes=64 * 2**20,
            seed=0,
        )
        results[job["model"]] = {}
        for name, chat in job["chats"].items():
            sampling = SamplingParams(temperature=0.0, max_tokens=chat["max_tokens"], min_tokens=chat["min_tokens"])
            (output,) = llm.chat(chat["messages"], sampling, use_tqdm=False)
            results[job["model"]][name] = {"token_ids": list(output.outputs[0].token_ids), "prompt_token_ids": list(output.prompt_token_ids)}
        del llm
    return results


if __name__ == "__main__":
    jobs_path, results_path = sys.argv[1:3]
    pathlib.Path(results_path).write_text(json.dumps(_run(json.loads(pathlib.Path(jobs_path).read_text()))))
