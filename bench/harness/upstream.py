"""The static upstream every gateway row proxies to (nginx answering a fixed chat completion, from `nginx/`), the
request the load generators send, and the one real request that checks a target before it is measured."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from bench.harness.processes import Procs, Service, free_port, wait_http

NGINX_TEMPLATES = Path(__file__).resolve().parents[1] / "nginx"

API_KEY = "sk-bench-portcullis-0123456789abcdef"
MODEL = "bench-model"

CHAT_COMPLETION = {
    "id": "chatcmpl-bench0001",
    "object": "chat.completion",
    "created": 1700000000,
    "model": MODEL,
    "system_fingerprint": "fp_bench",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello! This is a fixed benchmark completion."},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
}
MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}
REQUEST = {
    "model": MODEL,
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
    "max_tokens": 16,
    "temperature": 0.0,
    "stream": False,
}


def check_chat(port: int, key: str | None = API_KEY, request: dict | None = None) -> dict:
    """One real request: must be 200 with a chat.completion body. Also confirms a wrong key is refused (auth on)."""
    import httpx

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    request = request or REQUEST
    response = httpx.post(url, json=request, headers={"authorization": f"Bearer {key}"} if key else {}, timeout=30)
    if response.status_code != 200:
        raise RuntimeError(f"check of :{port} answered {response.status_code}: {response.text[:500]}")
    body = response.json()
    if body.get("object") != "chat.completion" or not body.get("choices"):
        raise RuntimeError(f"check of :{port} answered an unexpected body: {response.text[:500]}")
    refused = httpx.post(url, json=request, headers={"authorization": "Bearer sk-wrong-key"}, timeout=30)
    return {
        "status": response.status_code,
        "wrong_key_status": refused.status_code,
        "content": body["choices"][0]["message"]["content"],
        "cache": response.headers.get("x-portcullis-cache"),
    }


def render(template: str, **values: object) -> str:
    text = (NGINX_TEMPLATES / template).read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", str(value))
    leftover = re.findall(r"@[A-Z_]+@", text)
    if leftover:
        raise RuntimeError(f"{template}: unfilled placeholders {leftover}")
    return text


def start_nginx(procs: Procs, tmp: Path, name: str, template: str, **values: object) -> Service:
    port = free_port()
    conf = tmp / f"{name}.conf"
    conf.write_text(render(template, PREFIX=tmp, PORT=port, **values))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    service = procs.start(
        name, [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / f"{name}-error.log")], port, tmp / f"{name}.out"
    )
    return service


def start_static_upstream(procs: Procs, tmp: Path, name: str = "static") -> Service:
    """The static upstream every gateway row proxies to: nginx answering a fixed chat.completion and model list,
    ready for requests."""
    compact = {"separators": (",", ":")}
    static = start_nginx(
        procs,
        tmp,
        name,
        "static.conf.tmpl",
        CHAT_COMPLETION=json.dumps(CHAT_COMPLETION, **compact),
        MODELS=json.dumps(MODELS, **compact),
    )
    wait_http(static, "/v1/models", 15)
    return static
