"""Load benchmark of ``picompile serve``: 1, 4 and 16 concurrent clients against one server on 127.0.0.1.

    python benchmarks/serve.py ART [--clients 1,4,16] [--requests 2] [--max-tokens 32] [--prompt-len 16]
                               [--batch-ffn MODE[,MODE…]] [--rounds 1] [--time-limit S] [--json]

Starts ``picompile serve ART --port 0 --max-batch <most clients>`` (127.0.0.1 only; one server per
``--batch-ffn`` mode named, auto / per-request / union), then per concurrency level runs that many clients, each
sending ``--requests`` streaming completions one after the other (prompts: seeded random token ids, greedy,
``ignore_eos`` so every request is ``--max-tokens`` long). Bounded: at most ``clients × requests`` requests per
level and round and ``--time-limit`` seconds in all. Reports per level the aggregate decode tok/s (all tokens
after each request's first, over the level's wall time), p50/p95 time to first token, and checks that no request
was lost or truncated. A first level of warm-up requests builds the batched step for each batch size before
anything is timed. With several modes or ``--rounds`` > 1 the servers take turns level by level (mode order
reversed every round, so the machine's drift hits all alike) and each figure is the median over rounds: this
VM's memory bandwidth moves from minute to minute, so modes are compared side by side, not run after run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def start_server(art: str, max_batch: int, batch_ffn: str = "auto") -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "picompile", "serve", art, "--host", "127.0.0.1", "--port", "0",
           "--model-name", "bench", "--max-batch", str(max_batch), "--max-queue", str(4 * max_batch),
           "--batch-ffn", batch_ffn]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:
        if "http://127.0.0.1:" in line:
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def one_request(base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    usage: dict[str, int] | None = None
    finish = None
    done = False
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600.0) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.read()[:200]!r}"}
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c.get("text") and first is None:
                    first = time.perf_counter()
                finish = c.get("finish_reason") or finish
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else 0
    return {"ttft": (first or end) - t0, "seconds": end - t0, "tokens": tokens, "done": done, "finish": finish}


def level(base: str, clients: int, requests: int, max_tokens: int, prompt_len: int, seed: int,
          deadline: float) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [[[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(requests)] for _ in range(clients)]
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for p in prompts[i]:
            if time.perf_counter() > deadline:
                with lock:
                    results.append({"error": "time limit"})
                continue
            r = one_request(base, p, max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r and r["done"] and r["tokens"] == max_tokens]
    ttfts = sorted(r["ttft"] for r in ok)
    decode_tokens = sum(r["tokens"] - 1 for r in ok)
    q = statistics.quantiles(ttfts, n=20) if len(ttfts) >= 2 else ttfts * 19
    return {"clients": clients, "requests": len(results), "complete": len(ok),
            "lost_or_truncated": len(results) - len(ok), "wall_s": wall, "decode_tok_s": decode_tokens / wall,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None, "ttft_p95_s": q[18] if ttfts else None,
            "errors": sorted({r["error"] for r in results if "error" in r})[:3]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole run at most")
    ap.add_argument("--batch-ffn", default="auto",
                    help="the server's --batch-ffn, or several comma-separated, side by side (default auto, "
                         "as the server's)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every level and mode (medians reported)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    modes = args.batch_ffn.split(",")
    if any(not 1 <= c <= 64 for c in levels) or not 1 <= args.requests <= 16 or not 1 <= args.max_tokens <= 512:
        raise SystemExit("clients 1..64, requests 1..16, max-tokens 1..512")
    if not 1 <= args.rounds <= 9 or any(m not in ("auto", "per-request", "union") for m in modes) \
            or len(set(modes)) != len(modes):
        raise SystemExit("rounds 1..9; --batch-ffn: distinct modes among auto, per-request, union")
    deadline = time.perf_counter() + args.time_limit
    servers: dict[str, tuple[subprocess.Popen[str], str]] = {}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for m in modes:
            servers[m] = start_server(args.artifact, max(levels), m)
            for c in levels:  # warm-up: every batch size's step graph built before timing
                level(servers[m][1], c, 1, 4, args.prompt_len, 99, deadline)
        for r in range(args.rounds):
            for c in levels:
                for m in (modes if r % 2 == 0 else modes[::-1]):
                    runs.setdefault((m, c), []).append(
                        level(servers[m][1], c, args.requests, args.max_tokens, args.prompt_len, 7 + c + 100 * r, deadline))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)
    rows = []
    for (m, c), rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) if all(x[k] is not None for x in rs) else None
               for k in ("decode_tok_s", "ttft_p50_s", "ttft_p95_s")}
        rows.append({"batch_ffn": m, "clients": c, "rounds": len(rs), "requests": sum(x["requests"] for x in rs),
                     "complete": sum(x["complete"] for x in rs),
                     "lost_or_truncated": sum(x["lost_or_truncated"] for x in rs), **med,
                     "decode_tok_s_rounds": [x["decode_tok_s"] for x in rs],
                     "errors": sorted({e for x in rs for e in x["errors"]})[:3]})
    for r in rows:
        one = next((o["decode_tok_s"] for o in rows if o["batch_ffn"] == r["batch_ffn"] and o["clients"] == 1), None)
        r["vs_one_client"] = r["decode_tok_s"] / one if one else None
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0 if all(r["lost_or_truncated"] == 0 for r in rows) else 1
    print(f"{'batch-ffn':>11} {'clients':>7} {'requests':>8} {'complete':>8} {'decode tok/s':>12} {'× 1 client':>10} "
          f"{'TTFT p50 s':>10} {'TTFT p95 s':>10}  rounds")
    for r in rows:
        print(f"{r['batch_ffn']:>11} {r['clients']:>7} {r['requests']:>8} {r['complete']:>8} {r['decode_tok_s']:>12.2f} "
              f"{r['vs_one_client'] or 0:>10.2f} {r['ttft_p50_s'] or 0:>10.3f} {r['ttft_p95_s'] or 0:>10.3f}  "
              + " ".join(f"{v:.1f}" for v in r["decode_tok_s_rounds"])
              + (f"  errors: {r['errors']}" if r["errors"] else ""))
    return 0 if all(r["lost_or_truncated"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
