"""``picompile serve ART``: an OpenAI-compatible HTTP server (``picompile.serve.app``) on uvicorn."""
from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path
from typing import Any

from picompile.cli.common import console, finite_float, int_range
from picompile.cli.run import add_load_arguments, load_kwargs
from picompile.errors import PicompileError


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API (/v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health)")
    s.add_argument("artifact")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int_range(0, 65535), default=8000, help="port (default 8000; 0 = any free one)")
    s.add_argument("--model-name", help="the model id clients name (default: the artifact directory's name)")
    s.add_argument("--template", metavar="FILE", help="a Jinja chat template for /v1/chat/completions, instead of "
                                                      "the tokenizer's own (needed when it has none)")
    s.add_argument("--max-batch", type=int_range(1, 256), default=8,
                   help="requests decoded together at most, each with a KV cache of its own (default 8)")
    s.add_argument("--max-queue", type=int_range(0, 1 << 16), default=64,
                   help="requests waiting for a slot at most; beyond, 503 (default 64)")
    s.add_argument("--prefill-chunk", type=int_range(1, 1 << 16), default=128,
                   help="prompt tokens prefilled per engine iteration, between decode steps (default 128)")
    s.add_argument("--batch-ffn", choices=("auto", "per-request", "union"), default="auto",
                   help="a batched step's sparse FFN and predictors: once on the union of the batch's neurons, each "
                        "request masked by its own, where that gives each request its lone output bit for bit (float "
                        "ReLU FFNs), else per request (auto, the default); per request with the one-token kernels "
                        "always (per-request); or the union for every FFN, exact only where auto takes it (union)")
    s.add_argument("--shutdown-grace", type=finite_float(0.0, 3600.0), default=5.0,
                   help="seconds requests in flight may run after SIGTERM before they are cancelled (default 5)")
    s.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    add_load_arguments(s)
    s.set_defaults(fn=cmd)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PicompileError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def cmd(args: argparse.Namespace) -> int:
    import uvicorn

    import picompile
    from picompile.serve.app import ServerState, create_app
    from picompile.serve.chat import read_template
    from picompile.serve.scheduler import Scheduler

    if args.compile:
        raise PicompileError("serve runs the eager graph (its batched decode step is built at load); drop --compile")
    template = read_template(args.template)
    session = picompile.load(args.artifact, verify=not args.no_verify, **load_kwargs(args, to_stderr=True))
    try:
        scheduler = Scheduler(session, args.max_batch, args.max_queue, args.prefill_chunk,
                              union_ffn={"auto": None, "union": True, "per-request": False}[args.batch_ffn])
    except RuntimeError as e:
        raise PicompileError(f"cannot serve this artifact: {e}") from None
    name = args.model_name or Path(args.artifact).resolve().name
    state = ServerState(session, scheduler.start(), name, template, int(time.time()))
    app = create_app(state)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # SIGTERM / SIGINT: stop admitting, then finish
            scheduler.close(args.shutdown_grace)
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()  # a clean shutdown: exit 0, not the signal re-raised afterwards

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(args.shutdown_grace) + 5,
                            access_log=False, lifespan="off")
    server = Server(config)
    print(f"picompile serve: model {name!r} on http://{host}:{port}/v1 (max batch {args.max_batch})", flush=True)
    server.run(sockets=[sock])
    scheduler.close(0.0)
    scheduler.join(10.0)
    console().print("[dim]picompile serve: stopped[/dim]")
    sys.stdout.flush()
    return 0
