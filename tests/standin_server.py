"""A stand-in HTTP server on a loopback port for the harness's server mode, where a real `vllm
serve` cannot be made to fail the way a test needs (answer junk, serve no model, stall with
/health still 200). Each route's behaviour is a field the test sets; /metrics can be served by the
overlay's real collector over a report directory (``metrics_from``)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any


class StandIn:
    def __init__(self) -> None:
        self.models: tuple[int, Any] = (200, {"data": [{"id": "stand-in"}]})
        self.metrics: tuple[int, str] = (200, "")
        self.metrics_from: tuple[str, str] | None = None  # (report dir, server id): the real collector
        self.completion: str = "ok"  # "ok" | "hang"
        self.api_key: str | None = None  # set: /v1/* answers 401 without "Authorization: Bearer KEY", as vLLM's
        self.on_completion: Callable[[dict[str, Any]], None] | None = None
        self.completions = 0
        self.url = ""
        self.loop = asyncio.new_event_loop()
        self._runner: Any = None
        self._closed = False
        self._close_lock = threading.Lock()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _metrics_text(self) -> str:
        if self.metrics_from is None:
            return self.metrics[1]
        from prometheus_client import CollectorRegistry, generate_latest

        from vllm_overlay import metrics

        reg = CollectorRegistry()
        reg.register(metrics.OverlayCollector(*self.metrics_from))
        return generate_latest(reg).decode()

    def _serve(self, ready: threading.Event) -> None:
        from aiohttp import web

        def refused(req: web.Request) -> bool:
            return self.api_key is not None and req.headers.get("Authorization") != f"Bearer {self.api_key}"

        async def models(req: web.Request) -> web.Response:
            if refused(req):
                return web.json_response({"error": "Unauthorized"}, status=401)
            status, body = self.models
            if isinstance(body, str):
                return web.Response(status=status, text=body, content_type="text/html")
            return web.json_response(body, status=status)

        async def metrics(_req: web.Request) -> web.Response:
            return web.Response(status=self.metrics[0], text=self._metrics_text(), content_type="text/plain")

        async def health(_req: web.Request) -> web.Response:
            return web.Response(text="")

        async def completions(req: web.Request) -> web.StreamResponse:
            if refused(req):
                return web.json_response({"error": "Unauthorized"}, status=401)
            body = await req.json()
            self.completions += 1
            if self.on_completion is not None:
                self.on_completion(body)
            if self.completion == "hang":
                await self._release.wait()  # until close(): a stalled engine
                raise web.HTTPServiceUnavailable()
            resp = web.StreamResponse()
            await resp.prepare(req)
            for _ in range(body["max_tokens"]):
                await resp.write(f"data: {json.dumps({'choices': [{'token_ids': [7], 'text': 'x'}]})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def start() -> None:
            self._release = asyncio.Event()
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_get("/metrics", metrics)
            app.router.add_get("/health", health)
            app.router.add_post("/v1/completions", completions)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self) -> None:
        """Stop listening (new connections are refused) and end the loop; a second call is a no-op."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True

        async def stop() -> None:
            self._release.set()
            await self._runner.shutdown()
            await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
