"""Offline mode: an in-process vLLM engine (with the overlay), driven step by step."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

from vllm_overlay.tools.stress.plan import Plan
from vllm_overlay.tools.stress.traffic import prompt
from vllm_overlay.tools.stress.verdict import Outcome


class _NoTokenizerWarmup(logging.Filter):
    """vLLM 0.32's LLM() warms up the chat template even with skip_tokenizer_init=True and logs the
    resulting ValueError with its whole traceback, in a run that is fine. Keep it as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.getMessage().startswith("Chat template warmup failed") and "skip_tokenizer_init" in str(exc):
            record.msg, record.args, record.exc_info, record.exc_text = (
                "Chat template warmup skipped: no tokenizer (skip_tokenizer_init=True)", (), None, None)
        return True


def build_engine(model: str, engine_args: dict[str, Any]) -> Any:
    # The engine core runs in this process and steps only when we call step(): a wave's k
    # prompts are all queued before the step that schedules them, so they share one forward.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    kwargs = dict(engine_args)
    kwargs.setdefault("skip_tokenizer_init", True)
    if os.path.isfile(os.path.join(model, "config.json")) and not any(
        os.path.exists(os.path.join(model, f)) for f in ("model.safetensors", "model.safetensors.index.json",
                                                         "pytorch_model.bin")
    ):
        kwargs.setdefault("load_format", "dummy")  # a config-only model directory
    renderer_log = logging.getLogger("vllm.renderers.base")
    quiet = _NoTokenizerWarmup()
    renderer_log.addFilter(quiet)
    try:
        return LLM(model=model, **kwargs)
    finally:
        renderer_log.removeFilter(quiet)


def vocab_size(llm: Any) -> int:
    try:
        return int(llm.llm_engine.model_config.get_vocab_size())
    except Exception:  # noqa: BLE001
        return 4096


def run(llm: Any, plan: Plan, duration_s: float | None, seed: int,
        progress: Callable[[int, int], None], after_warmup: Callable[[], None] | None = None) -> Outcome:
    """Keep ``plan.decode_streams`` decode streams running (each renewed when it ends, until the
    waves are done) and send the waves one after another, stepping the engine ourselves.

    One warm-up wave of the same shape runs first (kernels compile on first use); the clock,
    ``duration_s`` and the timings start after it, once ``after_warmup()`` has returned."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    vocab = vocab_size(llm)
    rng = random.Random(seed)
    out = Outcome()
    dec_params = SamplingParams(max_tokens=plan.decode_out_tokens, temperature=0, ignore_eos=True,
                                detokenize=False)
    pre_params = SamplingParams(max_tokens=plan.prefill_out_tokens, temperature=0, ignore_eos=True,
                                detokenize=False)
    submitted: dict[str, float] = {}
    current = {i: f"decode-{i}-0" for i in range(plan.decode_streams)}  # each stream's live request
    first_token: dict[str, float] = {}
    finished: set[str] = set()
    wave_ids: set[str] = set()
    streams = {i: 0 for i in range(plan.decode_streams)}  # stream -> generation
    renewing = True

    def add(rid: str, n: int, params: Any) -> None:
        engine.add_request(rid, {"prompt_token_ids": prompt(rng, n, vocab)}, params)
        submitted[rid] = time.perf_counter()

    def step() -> None:
        for o in engine.step():
            rid = o.request_id
            toks = len(o.outputs[0].token_ids) if o.outputs else 0
            if toks and rid not in first_token:
                first_token[rid] = time.perf_counter()
            if o.finished:
                finished.add(rid)
                out.generated_tokens += toks
                if toks == 0:
                    out.errors.append(f"{rid}: finished without a token")
                if rid.startswith("decode-") and renewing:
                    i = int(rid.split("-")[1])
                    streams[i] += 1
                    current[i] = f"decode-{i}-{streams[i]}"
                    add(current[i], 32, dec_params)

    t0 = time.perf_counter()
    try:
        for i in streams:
            add(f"decode-{i}-0", 32, dec_params)
        while any(f"decode-{i}-0" not in first_token for i in streams):
            step()
        warm = [f"warmup-{j}" for j in range(len(plan.shape(0).prompts))]
        for rid, n in zip(warm, plan.shape(0).prompts):
            add(rid, n, pre_params)
        while not all(rid in finished for rid in warm):
            step()
        out.warmup_s = time.perf_counter() - t0
        if after_warmup is not None:
            after_warmup()
        out.generated_tokens = 0  # tokens/s counts what completes after the clock starts
        t0 = time.perf_counter()
        for w in range(plan.waves):
            if duration_s is not None and time.perf_counter() - t0 > duration_s:
                break
            tw = time.perf_counter()
            # a renewed decode stream's prompt would share the wave's step: let it prefill first,
            # so the wave's step is the planned forward (decodes + the prompts' first chunks)
            while any(rid not in first_token and rid not in finished for rid in current.values()):
                step()
            shape = plan.shape(w)
            ids = [f"wave{w}-{j}" for j in range(len(shape.prompts))]
            for rid, n in zip(ids, shape.prompts):
                add(rid, n, pre_params)
            wave_ids.update(ids)
            while not all(rid in finished for rid in ids):
                step()
            out.wave_s.append(time.perf_counter() - tw)
            progress(w + 1, plan.waves)
        renewing = False
        while engine.has_unfinished_requests():
            step()
    except Exception as exc:  # noqa: BLE001 - the engine died: that is the verdict
        out.engine_error = f"{type(exc).__name__}: {exc}"
    out.wall_s = time.perf_counter() - t0
    out.ttft_s = [first_token[r] - submitted[r] for r in wave_ids if r in first_token]
    out.requests_ok = sum(1 for r in submitted if r in finished)
    out.requests_failed = len(submitted) - out.requests_ok
    return out
