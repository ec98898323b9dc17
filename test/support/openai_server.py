"""``vllm serve`` in a test: a free port, the server started in a process of its own and waited for until healthy,
JSON posts to it. Used by both vLLM suites (test/vllm: vLLM 0.13 + vllm-neuron 0.4.1; test/vllm_neuron: vLLM 0.24 on
the harness platform)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def post_stream(url: str, body: dict) -> list[dict]:
    """A streaming post (``"stream": true``): the server-sent events' JSON bodies, in order, ``[DONE]`` left out."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def post_error(url: str, body: dict) -> tuple[int, str]:
    """The HTTP status and body of a post the server must refuse (fails the test when it answers 200)."""
    import urllib.error

    try:
        post(url, body)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    pytest.fail(f"the server answered {body} instead of refusing it")


def _reasoning(d: dict) -> str | None:
    """A message's or delta's thinking: ``reasoning_content`` (vLLM 0.13, beside its copy ``reasoning``) or
    ``reasoning`` (vLLM >= 0.24 dropped the old name)."""
    r = d.get("reasoning_content")
    return d.get("reasoning") if r is None else r


def chat_turn(url: str, body: dict, stream: bool = False) -> tuple:
    """``(reasoning, content, [(name, args)], finish_reason)`` of a chat completion at ``url`` (``.../v1``), streamed
    or not; a streamed one is assembled from its deltas (tool calls by index, arguments parsed as JSON)."""
    if not stream:
        choice = post(f"{url}/chat/completions", body)["choices"][0]
        msg = choice["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]
        return _reasoning(msg) or None, msg.get("content") or None, calls, choice["finish_reason"]
    return assemble_stream(post_stream(f"{url}/chat/completions", body))


def assemble_stream(events) -> tuple:
    """A streamed chat completion's events (JSON bodies) as ``(reasoning, content, [(name, args)], finish_reason)``:
    tool calls by index, their arguments parsed as JSON."""
    reasoning, content, calls, finish = "", "", {}, None
    for event in events:
        assert "error" not in event, event
        choice = event["choices"][0]
        delta = choice["delta"]
        reasoning += _reasoning(delta) or ""
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            c["name"] += (tc.get("function") or {}).get("name") or ""
            c["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return reasoning or None, content or None, calls, finish


@contextlib.contextmanager
def serving(cmd: list[str], port: int, env: dict, log_path: Path, cwd=None, timeout: float = 300):
    """Run ``cmd`` (a server on 127.0.0.1:``port``, output to ``log_path``) until its ``/health`` answers; yields, then
    stops it. A server that exits or stays down for ``timeout`` seconds fails the test with its log's tail."""
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    try:
        deadline = time.time() + timeout
        while True:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited ({server.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"vllm serve did not come up in {timeout:.0f} s:\n" + log_path.read_text()[-4000:])
                time.sleep(2)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
