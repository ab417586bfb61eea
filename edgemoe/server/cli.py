"""`edgemoe serve`: flags, and the process around the app (socket, engine thread, uvicorn, shutdown).

Start-up order: bind the socket (a busy port fails at once, in one line), start uvicorn and the engine
thread together (/health answers 503 while the weights load), print the URL once the model is ready.
Shutdown on SIGINT/SIGTERM: refuse new requests with 503, let those in flight finish for up to
SHUTDOWN_GRACE_S, then end the rest with an error event; a second signal skips the wait.

Only argparse is imported at module level: `edgemoe generate` must not pay for importing the web stack.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from edgemoe.config import ServeConfig, add_flags, check_model_path, flag_values
from edgemoe.errors import EdgeMoEError

SHUTDOWN_GRACE_S = 30.0
DEMO_MODEL_ID = "edgemoe-demo"


def add_serve_parser(sub: argparse._SubParsersAction, engine_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs",
        description="Serve the model over OpenAI- and Anthropic-compatible HTTP APIs (/v1/chat/completions, "
        "/v1/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens, /v1/tokenize, /v1/detokenize, "
        "/v1/models, /health, /metrics), with continuous batching, tool calls and reasoning. A request without "
        "max_tokens may generate up to the end of the context (or of what the KV cache holds; --default-max-tokens "
        "caps it). The KV cache "
        "holds --max-num-seqs sequences of --max-model-len tokens, within 80 percent of the free GPU memory (1 GiB on "
        "the CPU) unless --kv-cache-memory or --kv-cache-tokens sizes it; the server says what it reserved at start.",
    )
    add_flags(p.add_argument_group("server"), ServeConfig)
    engine_flags(p)


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise EdgeMoEError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise EdgeMoEError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_serve(a: argparse.Namespace, engine_kwargs: dict) -> None:
    serve = ServeConfig(**flag_values(a, ServeConfig))  # the cheap checks first: a typo fails before the imports
    model = engine_kwargs.get("model")
    check_model_path(model)
    path = Path(model).resolve() if model else None
    model_id = DEMO_MODEL_ID if path is None else path.stem if path.suffix == ".gguf" else path.name
    sock = _bind(serve.host, serve.port)

    import uvicorn

    from edgemoe.engine.engine import LLMEngine
    from edgemoe.engine.summary import startup_line
    from edgemoe.llm import LLM
    from edgemoe.server.app import ServerConfig, create_app
    from edgemoe.server.engine_loop import EngineLoop
    from edgemoe.server.http import GracefulServer
    from edgemoe.server.metrics import Metrics

    def load() -> LLMEngine:
        engine = LLM(**engine_kwargs, progress=sys.stderr.isatty()).engine
        print(startup_line(engine), file=sys.stderr, flush=True)
        return engine

    metrics = Metrics()
    engine_loop = EngineLoop(load, engine_kwargs["max_num_seqs"], serve.max_queue, metrics)
    config = ServerConfig(
        model_id,
        frozenset({model} if model else ()),
        serve.api_key,
        serve.max_body_bytes,
        serve.tool_parser,
        serve.reasoning_parser,
        serve.default_max_tokens,
    )
    app = create_app(engine_loop, metrics, config)
    uv_config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    server = GracefulServer(uv_config, engine_loop, _url(sock), model_id, SHUTDOWN_GRACE_S)
    engine_loop.start()  # the engine says what it loads, then the start-up line
    try:
        server.run(sockets=[sock])
    finally:
        engine_loop.stop()
        engine_loop.join(timeout=10)
    if engine_loop.error:
        raise EdgeMoEError(engine_loop.error)
