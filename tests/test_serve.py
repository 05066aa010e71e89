"""``picompile serve``: the server started on 127.0.0.1 on a free port, the real ``openai`` client against it.

Models list, completions and chat completions (streaming and not), stop strings, usage; 8 concurrent greedy
clients each get exactly the text they get alone; malformed requests get the right status and an OpenAI
error body; a client gone mid-stream frees its slot at once; SIGTERM ends the process with no request left
hanging (the last test: it stops the module's server)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

TEMPLATE = ("{% for m in messages %}{{ '<|endoftext|>' if loop.first else '' }}{{ m['role'] | upper }}:\n"
            "{{ m['content'] }}\n\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
MODEL = "default"
START_TIMEOUT = 180.0


class Server:
    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.port = proc, port
        self.base = f"http://127.0.0.1:{port}"

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, timeout=60.0)

    def health(self) -> dict[str, Any]:
        import httpx

        return httpx.get(f"{self.base}/health", timeout=10.0).json()


@pytest.fixture(scope="module")
def server(default_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tpl = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    tpl.write_text(TEMPLATE)
    cmd = [sys.executable, "-m", "picompile", "serve", str(default_artifact), "--host", "127.0.0.1", "--port", "0",
           "--model-name", MODEL, "--template", str(tpl), "--max-batch", "8", "--max-queue", "16",
           "--shutdown-grace", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = None
        deadline = time.monotonic() + START_TIMEOUT
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line:
                if proc.poll() is not None:
                    break
                continue
            if "http://127.0.0.1:" in line:
                port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        if port is None:
            proc.kill()
            raise RuntimeError(f"the server did not start: {proc.stderr.read() if proc.stderr else ''}")
        yield Server(proc, port)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_models_completions_and_usage(server: Server, default_artifact: Path) -> None:
    from picompile.formats.tokenizers import load_tokenizer

    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    tok = load_tokenizer("hf", default_artifact / "tokenizer")
    r = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode("ROMEO:")) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12 and r.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # stop strings: the text ends before the first one, finish_reason "stop"
    stop = r.choices[0].text[4:7]
    s = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
    assert r.choices[0].text.startswith(s.choices[0].text)
    # seeded sampling is reproducible
    a, b = (client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=10, temperature=0.9, top_p=0.9,
                                      seed=7).choices[0].text for _ in range(2))
    assert a == b


def test_chat_completions(server: Server, default_artifact: Path) -> None:
    from transformers import AutoTokenizer

    client = server.client()
    messages = [{"role": "user", "content": "Good morrow, cousin."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    ref = AutoTokenizer.from_pretrained(str(default_artifact / "tokenizer"))
    ids = ref.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_concurrent_greedy_equals_alone(server: Server) -> None:
    client = server.client()
    prompts = ["ROMEO:", "JULIET:\nO", "First Citizen:", "KING RICHARD:", "Nurse:", "MERCUTIO:\nNay",
               "HAMLET:", "To be, or not"]

    def ask(p: str) -> str:
        return client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text

    alone = [ask(p) for p in prompts]
    before = server.health()["steps"]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    health = server.health()
    assert together == alone
    assert health["max_batch_seen"] > 1 and health["steps"] - before < 8 * 24  # they did decode together


def test_malformed_requests(server: Server) -> None:
    import httpx

    url = f"{server.base}/v1/completions"
    cases: list[tuple[Any, int, str]] = [
        (b"{not json", 400, "not valid JSON"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 422, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 422, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 12}, 422, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 422, "temperature"),
        ({"model": MODEL, "prompt": 5}, 422, "prompt"),
        ({"model": MODEL}, 422, "prompt"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "context"),
        ({"model": MODEL, "prompt": [5] * 300}, 400, "context"),
        ({"model": MODEL, "prompt": [99999]}, 400, "outside the vocabulary"),
        ({"model": MODEL, "prompt": "hi", "n": 3}, 422, "n"),
    ]
    for body, status, text in cases:
        kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(url, headers={"content-type": "application/json"}, timeout=30.0, **kw)
        assert r.status_code == status, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert text in err["message"] and err["type"], (body, err)
    r = httpx.post(f"{server.base}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30.0)
    assert r.status_code == 422 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "bot"}]},
                   timeout=30.0)
    assert r.status_code == 422 and "error" in r.json()
    import openai

    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="hi")


def test_disconnected_stream_frees_its_slot(server: Server) -> None:
    import httpx

    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 250, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30.0) as http:
        with http.stream("POST", f"{server.base}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert server.health()["active"] == 1
        # the connection is closed here, long before 250 tokens
    deadline = time.monotonic() + 5.0
    while server.health()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    h = server.health()
    assert h["active"] == 0 and h["free_slots"] == 8
    steps = h["steps"]
    time.sleep(0.3)
    assert server.health()["steps"] == steps  # nothing is decoding for the gone client


def test_sigterm_shuts_down_cleanly(server: Server) -> None:
    """Last: SIGTERM with a long stream in flight; the stream ends (finished or cancelled, then [DONE]) and the
    process exits 0 within the grace period and a margin."""
    import httpx

    events: list[str] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 250, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60.0) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(30)
    t.join(30)
    assert not t.is_alive() and rc == 0
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length")
