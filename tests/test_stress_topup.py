"""Server mode's top-up waves, against a stand-in OpenAI-compatible server on a loopback port.

A stand-in, not `vllm serve`: whether a wave's prefills reach the engine in one step is up to the
timing of a real server and cannot be chosen by a test. The stand-in answers /v1/models and
streamed /v1/completions; the band count the harness reads back is a function of the waves
served, so the test decides how many waves landed in the band. The real server's path through
the same code is tests/test_stress.py::test_server_mode_passes_and_reads_the_servers_reports."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

from vllm_overlay.tools.stress import server
from vllm_overlay.tools.stress.plan import Limits, make_plan


class StandIn:
    """Counts the wave prefill requests (ids are not sent: a wave prefill asks for
    plan.prefill_out_tokens tokens, a decode stream for plan.decode_out_tokens)."""

    def __init__(self, prefill_out_tokens: int) -> None:
        self.prefill_out_tokens = prefill_out_tokens
        self.prefills = 0
        self.url = ""
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _serve(self) -> None:
        from aiohttp import web

        async def models(_req: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "stand-in"}]})

        async def completions(req: web.Request) -> web.StreamResponse:
            body = await req.json()
            if body["max_tokens"] == self.prefill_out_tokens:
                self.prefills += 1
            resp = web.StreamResponse()
            await resp.prepare(req)
            for _ in range(body["max_tokens"]):
                chunk = {"choices": [{"token_ids": [7], "text": "x"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def start() -> None:
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", completions)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()


@pytest.fixture(scope="module")
def plan_and_server() -> Iterator[tuple[object, StandIn]]:
    plan = make_plan(1024, 2048, Limits(2048, 8192, 32), 10, None)
    assert plan.prefill_out_tokens != plan.decode_out_tokens
    yield plan, StandIn(plan.prefill_out_tokens)


def run(plan, standin: StandIn, landed_per_wave: float, monkeypatch,  # type: ignore[no-untyped-def]
        top_count=None) -> tuple[object, list[str]]:
    monkeypatch.setattr(server, "FLUSH_S", 0.0)
    notes: list[str] = []
    standin.prefills = 0
    waves = [0]  # timed waves served (the warm-up wave is not the run's: the harness subtracts it too)

    def band_count() -> int:
        return int(waves[0] * landed_per_wave)

    def progress(done: int, _total: int) -> None:
        waves[0] = done

    out = server.run(standin.url, plan, None, 0, progress,
                     topup=server.TopUp(band_count, 10, notes.append, top_count))
    return out, notes


def test_no_topup_when_the_planned_waves_landed(plan_and_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    plan, standin = plan_and_server
    out, notes = run(plan, standin, 1.0, monkeypatch)
    assert out.topup_waves == 0 and notes == [] and len(out.wave_s) == plan.waves
    assert out.requests_failed == 0


def test_short_waves_are_made_up_for_and_said(plan_and_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    plan, standin = plan_and_server
    out, notes = run(plan, standin, 0.4, monkeypatch)  # 16 waves -> 6 band forwards: 8 more -> 9: 2 more
    assert out.topup_waves > 0 and len(out.wave_s) == plan.waves + out.topup_waves
    assert notes and "band forward(s) so far, 10 needed" in notes[0] and "more waves" in notes[0]
    assert int((len(out.wave_s)) * 0.4) >= 10


def test_topup_stops_at_its_limit_and_says_so(plan_and_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    plan, standin = plan_and_server
    out, notes = run(plan, standin, 0.0, monkeypatch)  # nothing ever lands
    assert len(out.wave_s) == server.TOPUP_FACTOR * plan.waves
    assert "top-up stopped" in notes[-1] and f"{server.TOPUP_FACTOR} x the {plan.waves} planned" in notes[-1]


def test_waves_are_added_until_the_top_quarter_is_reached(plan_and_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    plan, standin = plan_and_server
    tops = iter([0, 0, 1])  # no top-quarter forward after the planned waves, nor after one more cycle
    out, notes = run(plan, standin, 1.0, monkeypatch, top_count=lambda: next(tops))
    assert out.topup_waves > 0 and all("top quarter" in n for n in notes) and len(notes) == 2
    # each top-up ends on a wave of the top shape (shape 0): wave w has shapes[w % n]
    assert (len(out.wave_s) - 1) % len(plan.shapes) == 0
    out, notes = run(plan, standin, 1.0, monkeypatch, top_count=lambda: 0)
    assert len(out.wave_s) == server.TOPUP_FACTOR * plan.waves and "no forward in the band's top quarter" in notes[-1]
