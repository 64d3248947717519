"""Serving chat: ``serve``, and ``schema`` for the protocols it speaks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from infra.telemetry import configure_telemetry
from learners.queue import configure as configure_celery
from macaron import wiring
from macaron.cli.common import console, settings, steps
from server.entrypoints.schemas import export as export_schemas


def serve(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option(help="Port (default MACARON_HTTP_PORT).")] = None,
    rollouts: Annotated[
        bool,
        typer.Option(
            help="Also take rollout jobs from the Celery queue `rollout` and sample them on this "
            "server's engine while chat leaves it idle (needs Redis: `macaron up` or "
            "MACARON_REDIS_URL)."
        ),
    ] = False,
) -> None:
    """Serve chat: the WebSocket protocol at /v1/ws, the OpenAI-compatible API at /v1 and the
    web UI at /, on MACARON_BIND_HOST (127.0.0.1 unless configured), and Prometheus metrics at
    /metrics (a key with the metrics scope). Answers with the model in this process, or through
    the vLLM replicas of MACARON_VLLM_URLS when MACARON_ENGINE=vllm."""
    cfg = settings(ctx)
    configure_telemetry(cfg, "macaron-server")
    with steps("starting") as step:
        server = wiring.chat_server(cfg, step)
        if rollouts:
            step("starting the rollout lane")
            try:
                configure_celery(cfg)
                server.serve_rollouts(cfg)
            except BaseException:
                server.close()
                raise
    chosen = port or cfg.http_port
    console.print(f"serving on http://{cfg.bind_host}:{chosen}/ (Ctrl-C stops)")
    try:
        uvicorn.run(
            server.app,
            host=cfg.bind_host,
            port=chosen,
            ws_max_size=cfg.max_frame_bytes,
            log_level="warning",
        )
    finally:
        server.close()


def schema(
    folder: Annotated[Path, typer.Argument(help="Where to write them.")] = Path("docs/schema"),
) -> None:
    """Write the JSON Schemas of protocol v1, HCP v1 and the GenUI catalogue."""
    for path in export_schemas(folder):
        console.print(f"wrote {path}")
