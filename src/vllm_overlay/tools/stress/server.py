"""Server mode: streamed OpenAI-compatible completions over real HTTP against `vllm serve`."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_overlay.tools.stress import http
from vllm_overlay.tools.stress.plan import Plan, UsageError
from vllm_overlay.tools.stress.target import PREFLIGHT_S, ServerError
from vllm_overlay.tools.stress.traffic import prompt
from vllm_overlay.tools.stress.verdict import Outcome


def check_url(url: str, allow_remote: bool) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UsageError(f"--url {url!r}: expected http://HOST:PORT")
    host = parsed.hostname
    try:
        parsed.port
    except ValueError:
        raise UsageError(f"--url {url!r}: the port is not an integer in [1, 65535]") from None
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not loopback and not allow_remote:
        raise UsageError(f"--url {url!r}: {host} is not a loopback address; pass --allow-remote to "
                         "stress a remote server on purpose")
    return url.rstrip("/")


async def _model_and_vocab(session: Any, base: str, limit_s: float) -> tuple[str, int]:
    import aiohttp

    async with session.get(f"{base}/v1/models", timeout=aiohttp.ClientTimeout(total=max(0.1, limit_s))) as resp:
        resp.raise_for_status()
        data = await resp.json()
    model = data["data"][0]["id"]
    return model, 4096


async def _completion(session: Any, base: str, model: str, ids: list[int], max_tokens: int,
                      rid: str, out: Outcome, ttft: dict[str, float]) -> bool:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    tokens = 0
    try:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            if resp.status != 200:
                out.errors.append(f"{rid}: HTTP {resp.status}: {(await resp.text())[:300]}")
                return False
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    out.errors.append(f"{rid}: {chunk['error']}")
                    return False
                for choice in chunk.get("choices", []):
                    n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                    if n and rid not in ttft:
                        ttft[rid] = time.perf_counter() - t0
                    tokens += n
    except Exception as exc:  # noqa: BLE001 - connection lost: the server died
        out.errors.append(f"{rid}: {type(exc).__name__}: {exc}")
        return False
    out.generated_tokens += tokens
    if tokens < max_tokens:
        out.errors.append(f"{rid}: stream ended after {tokens} of {max_tokens} tokens")
        return False
    return True


TOPUP_FACTOR = 4  # top-up waves stop at this many times the planned waves
FLUSH_S = 1.5  # the serving processes flush their telemetry every second
GRACE_S = 30.0  # with --duration: how long requests in flight may take after it (warm-up: after its start)
STALL_S = 300.0  # without --duration: how long a wave (or the warm-up) may go unanswered


class Stalled(Exception):
    """A wave got no complete answer in time: the server accepts connections, its engine does not answer."""


async def _bounded(aws: list[Any], limit: float, what: str, duration_s: float | None) -> list[bool]:
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, limit))
    if pending:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        bound = (f"--duration {duration_s:g} s + {GRACE_S:g} s grace" if duration_s is not None
                 else f"{STALL_S:g} s")
        raise Stalled(f"the server stopped answering: {len(pending)} of {len(tasks)} request(s) of {what} got "
                      f"no complete answer within {bound} (it accepts connections; is its engine stalled?)")
    return [t.result() for t in tasks]


async def _run(base: str, plan: Plan, duration_s: float | None, seed: int,
               progress: Callable[[int, int], None], out: Outcome,
               alive: Callable[[], str | None] | None,
               after_warmup: Callable[[], None] | None,
               topup: TopUp | None, api_key: str | None, preflight_end: float | None) -> None:
    import aiohttp

    rng = random.Random(seed)
    ttft: dict[str, float] = {}
    wave_ids: list[str] = []
    ok: list[bool] = []
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, headers=http.headers(api_key)) as session:
        try:
            left = (preflight_end - time.monotonic()) if preflight_end is not None else PREFLIGHT_S
            model, vocab = await _model_and_vocab(session, base, left)
        except (aiohttp.ClientError, OSError, ValueError, KeyError, IndexError, asyncio.TimeoutError) as exc:
            raise ServerError(f"{base} stopped answering GET /v1/models: {type(exc).__name__}: {exc}") from None

        async def decode_worker(i: int) -> None:
            # one decode stream, renewed until the waves are done: every request completes
            n = 0
            while not stop.is_set():
                rid = f"decode-{i}-{n}"
                good = await _completion(session, base, model, prompt(rng, 32, vocab),
                                         plan.decode_out_tokens, rid, out, ttft)
                ok.append(good)
                n += 1
                if not good:
                    stop.set()

        workers = [asyncio.create_task(decode_worker(i)) for i in range(plan.decode_streams)]
        await asyncio.sleep(0.5)  # let the decode streams start
        # one warm-up wave of the same shape before the clock: a cold server compiles kernels on
        # first use (seen: 104 s for the first MTP wave), which is not what --duration measures
        tw = time.perf_counter()
        warm = [f"warmup-{j}" for j in range(len(plan.shape(0).prompts))]
        try:
            done = await _bounded([
                _completion(session, base, model, prompt(rng, n, vocab),
                            plan.prefill_out_tokens, rid, out, {}) for rid, n in zip(warm, plan.shape(0).prompts)],
                (duration_s + GRACE_S) if duration_s is not None else STALL_S, "the warm-up wave", duration_s)
        except Stalled as exc:
            out.stalled = str(exc)
            await _stop(stop, workers, 0.0)
            return
        ok.extend(done)
        out.warmup_s = time.perf_counter() - tw
        if after_warmup is not None:
            await asyncio.get_running_loop().run_in_executor(None, after_warmup)
        out.generated_tokens = 0  # tokens/s counts what completes after the clock starts
        out.wall_s = 0.0
        t0 = time.perf_counter()
        out.clock_start = t0
        total = plan.waves
        w = 0

        def can_go_on() -> bool:
            if not all(done) or stop.is_set() or (duration_s is not None and time.perf_counter() - t0 > duration_s):
                return False
            if alive is not None and (err := alive()):
                out.engine_error = err
                if err.startswith(DOWN):
                    out.unreachable = err
                return False
            return True

        while True:
            while w < total:
                if not can_go_on():
                    break
                tw = time.perf_counter()
                shape = plan.shape(w)
                ids = [f"wave{w}-{j}" for j in range(len(shape.prompts))]
                limit = (t0 + duration_s + GRACE_S - tw) if duration_s is not None else STALL_S
                try:
                    done = await _bounded([
                        _completion(session, base, model, prompt(rng, n, vocab),
                                    plan.prefill_out_tokens, rid, out, ttft) for rid, n in zip(ids, shape.prompts)],
                        limit, f"wave {w + 1}", duration_s)
                except Stalled as exc:
                    out.stalled = str(exc)
                    break
                ok.extend(done)
                wave_ids.extend(ids)
                out.wave_s.append(time.perf_counter() - tw)
                w += 1
                progress(w, total)
            # Over HTTP a wave's prefills can reach the engine in different steps (each request is
            # tokenized and queued on its own), so a wave may land as several smaller forwards.
            # The band count is read back from telemetry and short waves are made up for.
            if topup is None or w < total or out.stalled or not can_go_on():
                break
            await asyncio.sleep(FLUSH_S)
            got = await asyncio.get_running_loop().run_in_executor(None, topup.band_count)
            top = 1 if topup.top_count is None else await asyncio.get_running_loop().run_in_executor(
                None, topup.top_count)
            limit = TOPUP_FACTOR * plan.waves
            if (got >= topup.min_band and top > 0) or total >= limit:
                if got < topup.min_band:
                    topup.note(f"top-up stopped: {got} band forward(s) of {topup.min_band} needed after "
                               f"{total} waves, the limit ({TOPUP_FACTOR} x the {plan.waves} planned)")
                elif top == 0:
                    topup.note(f"top-up stopped: no forward in the band's top quarter after {total} waves, "
                               f"the limit ({TOPUP_FACTOR} x the {plan.waves} planned)")
                break
            if got < topup.min_band:
                more = min(limit - total, 2 * (topup.min_band - got))
                topup.note(f"{got} band forward(s) so far, {topup.min_band} needed (a wave's prefills reached "
                           f"the engine in different steps): {more} more waves")
            else:  # up to and including the next wave of the top shape (wave w has shapes[w % n])
                n = len(plan.shapes)
                more = min(limit - total, (n - total % n) % n + 1)
                topup.note(f"no forward in the band's top quarter yet (a wave's prefills reached the engine "
                           f"in different steps): {more} more waves")
            out.topup_waves += more
            total += more
        await _stop(stop, workers, 0.0 if out.stalled else GRACE_S)
        if alive is not None and out.unreachable is None and (err := alive()):
            out.engine_error = out.engine_error or err
            if err.startswith(DOWN):
                out.unreachable = err
        out.requests_ok = sum(ok)
        out.requests_failed = len(ok) - sum(ok)
        out.ttft_s = [ttft[r] for r in wave_ids if r in ttft]


async def _stop(stop: asyncio.Event, workers: list[Any], grace: float) -> None:
    """End the decode streams: each finishes its request within ``grace`` s, else it is cancelled."""
    stop.set()
    if not workers:
        return
    _, pending = await asyncio.wait(workers, timeout=grace)
    for t in pending:
        t.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


@dataclass(frozen=True)
class TopUp:
    """Waves are added after the planned ones while ``band_count()`` (band forwards of this run,
    read from the server's telemetry) is below ``min_band`` or ``top_count()`` is 0; ``note``
    prints what is done."""
    band_count: Callable[[], int]
    min_band: int
    note: Callable[[str], None]
    top_count: Callable[[], int] | None = None  # forwards of this run in the band's top quarter


def run(base: str, plan: Plan, duration_s: float | None, seed: int,
        progress: Callable[[int, int], None], alive: Callable[[], str | None] | None = None,
        after_warmup: Callable[[], None] | None = None, topup: TopUp | None = None,
        api_key: str | None = None, preflight_end: float | None = None) -> Outcome:
    out = Outcome()
    asyncio.run(_run(base, plan, duration_s, seed, progress, out, alive, after_warmup, topup, api_key,
                     preflight_end))
    out.wall_s = time.perf_counter() - out.clock_start if out.clock_start is not None else 0.0
    if out.errors and not out.engine_error and out.requests_failed:
        out.engine_error = out.errors[0]
    return out


DOWN = "server is down"  # health_error's words for a server that refuses connections or is gone


def health_error(base: str, api_key: str | None = None) -> str | None:
    """None while the server answers /health with 200, else what went wrong (starting with DOWN
    when nothing answers)."""
    import urllib.error

    try:
        http.get(f"{base}/health", api_key, 10)
        return None
    except urllib.error.HTTPError as exc:
        return f"server health check: HTTP {exc.code}"
    except http.Deadline as exc:
        return f"server health check: {exc}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{DOWN}: {getattr(exc, 'reason', exc)}"
