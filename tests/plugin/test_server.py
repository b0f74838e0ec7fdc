"""vLLM's OpenAI server with FUSELANE_KERNELS=all, in its default multi-process layout.

`python -m vllm.entrypoints.openai.api_server` runs an API-server process, an engine-core
process and a worker process, each of which loads the plugin through the entry point. The
test checks, on 127.0.0.1 only: the log of the worker (the process running the model) shows
fuselane's backend chosen; /v1/completions and /v1/chat/completions answer, streaming and
not; the greedy completion equals the stock in-process engine's tokens (the kernels ran right
in the worker).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from .engine_runner import PROMPTS
from .engines import compared_prefix, engine_dtype, engine_env

START_TIMEOUT_S = 300
MAX_TOKENS = 12  # engine_runner's default, so the stock run is the reference


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model), "--dtype", engine_dtype(),
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "512", "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    env = engine_env("all")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default: engine in its own processes
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"server exited with {proc.returncode}:\n{log_path.read_text()[-6000:]}"
                )
            try:
                if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"server not up in {START_TIMEOUT_S} s:\n{log_path.read_text()[-6000:]}"
                )
            time.sleep(1)
        yield base, str(tiny_model), log_path
    finally:
        # The server and the engine processes it started share its session.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _post(base: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{base}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(base: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    return chunks


def test_every_engine_process_loads_fuselane(server):
    _, _, log_path = server
    log = log_path.read_text()
    # vLLM prefixes each line with its process: "(EngineCore pid=12)", "(VllmWorker-0 pid=34)".
    registered = re.findall(r"\(([\w-]+) pid=(\d+)\)[^\n]*fuselane plugin registered", log)
    assert any(name.startswith("EngineCore") for name, _ in registered), registered
    assert any("Worker" in name for name, _ in registered), registered
    assert len({pid for _, pid in registered}) >= 2, registered
    chosen = re.findall(r"\(([\w-]+) pid=\d+\)[^\n]*fuselane: attention backend CUSTOM", log)
    assert chosen and all("Worker" in name for name in chosen), chosen
    assert "fuselane kernels active: attention, kv_cache" in log


def test_completions_greedy_equals_stock_engine(server, stock_run):
    base, model, _ = server
    stock = stock_run[0]
    for i in (1, 2):  # a short prompt and a long one
        body = {
            "model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        choice = _post(base, "/v1/completions", body)["choices"][0]
        assert choice["prompt_token_ids"] == stock["prompt_ids"][i]
        n = compared_prefix(stock, i)
        assert choice["token_ids"][:n] == stock["greedy"][i][:n]
        assert len(choice["token_ids"]) == MAX_TOKENS


def test_completions_streaming_matches_non_streaming(server):
    base, model, _ = server
    body = {
        "model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    whole = _post(base, "/v1/completions", body)["choices"][0]["text"]
    chunks = _stream(base, "/v1/completions", body)
    assert len(chunks) > 1
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole


def test_chat_completions_streaming_and_not(server):
    base, model, _ = server
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    reply = _post(base, "/v1/chat/completions", body)
    assert reply["choices"][0]["message"]["role"] == "assistant"
    content = reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    chunks = _stream(base, "/v1/chat/completions", body)
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed == content and content
