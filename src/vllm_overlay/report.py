"""Per-process state and its JSON report: one file per process, one summary line in the log.

The report says, per patch, what happened in this process (applied, armed until its module is
imported, skipped with the reason, upstream-merged, off, failed with the error), plus the
process's identity, counters and events. It is written at register(), whenever a patch state
changes, by a background flusher while something changed, at exit, and on demand
(``vllm_overlay.flush()``).

The rest of the report is in sections, each owned by the module whose data it is (``SECTIONS``:
budget resolutions, GDN buffers, the runner built, the live engine limits, forward telemetry, an
engine core's gathered rank reports). An owner registers its section with ``section(key, factory)``
and changes the section's data only inside ``with self.changing():`` (the state's lock held, the
report marked for the flusher); ``ProcessState.reset()`` resets every section, and a forked child
calls each section's ``after_fork``.

No secret reaches a report: of the command line only the program's name, its subcommand and the
option names are kept (``argv``), never a value (``--api-key sk-...`` is kept as ``--api-key``);
nothing of the environment is written but the overlay's own server id and tree.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from vllm_overlay import report_files, server_id, settings
from vllm_overlay.errors import OverlayError
from vllm_overlay.logs import LOG  # noqa: F401 - patches import LOG from here too

SCHEMA = 1
FLUSH_EVERY_S = 1.0
WRITE_BACKOFF_MAX_S = 60.0  # while writing fails, the flusher tries at most this seldom


def safe_argv(argv: list[str]) -> list[str]:
    """The command line without a value: the program's base name, a subcommand word right after it
    (``serve``), and each option's name (``--api-key=sk-1`` and ``--api-key sk-1`` both give
    ``--api-key``); every other word (option values, the model, paths) is left out."""
    out = [os.path.basename(argv[0])] if argv else []
    for i, word in enumerate(argv[1:64], start=1):
        if word.startswith("-") and len(word) > 1:
            name = word.split("=", 1)[0]
            if name.lstrip("-").replace("-", "").replace("_", "").isalnum():
                out.append(name)
        elif i == 1 and word.isascii() and word.isalpha() and word.islower():
            out.append(word)
    return out


def _cause(exc: BaseException) -> str:
    """What a failed write's error is, without the names that change from one try to the next (the
    temporary file's random name): its type and, for an OSError, the errno's text."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


class ProcessState:
    """This process's identity (pid, instance, role, ranks), status (patches, registration, timings,
    carry-over), counters, events and the writer's state; the rest of the report is in ``sections``,
    each owned by the module whose data it is (``section()``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.sections: dict[str, Section] = {}  # report key -> its owner's section, in registration order
        self.reset()

    def reset(self) -> None:
        """Back to a fresh process's state, every section included (tests start from here)."""
        with self.lock:
            self._reset_own()
            for sec in self.sections.values():
                sec.reset()

    def _reset_own(self) -> None:
        self.pid = os.getpid()
        self.instance = os.urandom(4).hex()  # in the file name: unique even where pids repeat
        self.started = time.time()
        self.registered = False
        self.register_calls = 0
        self.load_apply_s: float | None = None  # register(): decisions, hooks, patches of imported modules
        self.hook_apply_s = 0.0  # patches applied later, when vLLM imported their modules
        self.vllm_version: str | None = None
        self.platform: str | None = None
        # a release newer than the matrix (carry.py): the matrix release whose rows were carried over,
        # and the record of every wanted patch's checks
        self.carried_from: str | None = None
        self.carry: dict[str, Any] | None = None
        self.patches: dict[str, dict[str, Any]] = {}
        self.counters: dict[str, int] = {"guard_checks": 0, "guard_trips": 0}
        self.events: list[str] = []
        self.worker_rank: int | None = None
        self.tp_rank: int | None = None
        self.dirty = False
        self.last_written = 0.0  # time.time() of the last report on disk
        self.write_error: tuple[str, str] | None = None  # (path, error) while writing fails
        self.write_cause: str | None = None  # the error without file names: a new one is logged again
        self.write_failures = 0  # consecutive failed writes
        self.next_write_at = 0.0  # the flusher's next try while writing fails (backoff)
        self.forked_from: int | None = None
        self.summary_role: str | None = None  # the role the last summary line named

    # ---- state changes -------------------------------------------------------------------
    def set_patch(self, patch_id: str, status: str, **fields: Any) -> None:
        with self.lock:
            rec = self.patches.setdefault(patch_id, {})
            rec.update(fields)
            rec["status"] = status
            self.dirty = True

    def event(self, text: str) -> None:
        with self.lock:
            self.events.append(text)
            self.dirty = True

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] = self.counters.get(key, 0) + n
            self.dirty = True

    # ---- identity ------------------------------------------------------------------------
    def role(self) -> str:
        name = multiprocessing.current_process().name
        title = ""
        try:
            import setproctitle  # type: ignore[import-not-found]

            title = setproctitle.getproctitle()
        except Exception:  # noqa: BLE001 - optional, role falls back to the process name
            pass
        parts = []
        if "EngineCore" in name or "EngineCore" in title:
            parts.append("engine core")
        if self.worker_rank is not None:
            parts.append(f"worker rank {self.worker_rank}")
        if parts:
            return " + ".join(parts)
        if "Worker" in name or "Worker" in title:
            return "worker"
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        main_name = getattr(main_spec, "name", "") or (sys.argv[0] if sys.argv else "")
        if main_name == "vllm.model_executor.models.registry":  # vLLM inspects a model class in a subprocess
            return "model inspection"
        if ("APIServer" in title or "APIServer" in name or (len(sys.argv) > 1 and sys.argv[1] == "serve")
                or "api_server" in main_name):
            return "api server"
        return "driver"

    def counts(self) -> dict[str, int]:
        out = {"applied": 0, "armed": 0, "skipped": 0, "off": 0, "upstream-merged": 0, "failed": 0}
        for rec in self.patches.values():
            # an entry holding a patch's data but no decision (a patch function called in a process
            # where the plugin did not decide that patch) has no status to count
            if "status" in rec:
                out[rec["status"]] = out.get(rec["status"], 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        if self is STATE:
            load_owners()  # before the lock: an owner's import registers its section
        with self.lock:
            return {
                "schema": SCHEMA,
                "pid": self.pid,
                "instance": self.instance,
                "forked_from": self.forked_from,
                "host": socket.gethostname(),
                "server_id": settings.value("VLLM_OVERLAY_SERVER_ID"),
                "server_tree": settings.value("VLLM_OVERLAY_SERVER_TREE"),
                "role": self.role(),
                "tp_rank": self.tp_rank,
                "argv": safe_argv(sys.argv),
                "started": self.started,
                "written": time.time(),
                "vllm_version": self.vllm_version,
                "platform": self.platform,
                **({"carry": self.carry} if self.carry is not None else {}),
                "register_calls": self.register_calls,
                "load_apply_s": self.load_apply_s,
                "hook_apply_s": self.hook_apply_s,
                "counts": self.counts(),
                "patches": self.patches,
                "counters": self.counters,
                "events": self.events[-200:],
                **self.section_json(),
            }

    def section_json(self) -> dict[str, Any]:
        """Each section's key and JSON; a section whose ``to_json()`` is None is left out."""
        with self.lock:
            out = {}
            for key, sec in self.sections.items():
                value = sec.to_json()
                if value is not None:
                    out[key] = value
            return out

    # ---- output --------------------------------------------------------------------------
    def report_path(self) -> str:
        directory = settings.value("VLLM_OVERLAY_REPORT_DIR")
        key = server_id.file_key(settings.value("VLLM_OVERLAY_SERVER_ID"))
        return os.path.join(directory, report_files.name(key, os.getpid(), self.instance))

    def snapshot(self) -> str:
        """The report as JSON text, serialised while holding the lock (a consistent snapshot:
        no dict changes size under the serialiser), with ``dirty`` cleared in the same critical
        section, so an update made after it marks the state dirty again and is written later."""
        if self is STATE:
            load_owners()  # before the lock: an owner's import registers its section
        with self.lock:
            data = json.dumps(self.to_json(), indent=1, sort_keys=True)
            self.dirty = False
            return data

    def write(self) -> str | None:
        data, tmp, path = None, None, "?"
        try:
            path = self.report_path()
            data = self.snapshot()
            res = settings.resolve("VLLM_OVERLAY_REPORT_DIR")
            report_files.prepare(os.path.dirname(path), default=not res.is_set)  # re-checked: it may be replaced
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".overlay-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, path)
            tmp = None
            self.last_written = time.time()
            if self.write_error is not None:
                LOG.info("report written again to %s after %d failed attempt(s)", path, self.write_failures)
            self.write_error, self.write_cause, self.write_failures = None, None, 0
            _ensure_flusher()  # later changes (a section's, a counter's) reach the file within a second
            return path
        except Exception as exc:  # noqa: BLE001 - a report failure must not kill serving
            if tmp is not None:
                try:
                    os.unlink(tmp)  # never leave a temporary file behind
                except OSError:
                    pass
            if data is not None:
                self.dirty = True  # not on disk: the flusher tries again, backing off
            self._failed(path, f"{type(exc).__name__}: {exc}", _cause(exc))
            _ensure_flusher()
            return None

    def _failed(self, path: str, error: str, cause: str) -> None:
        """One WARNING per distinct cause (naming the variable and the path), then backoff."""
        self.write_failures += 1
        self.next_write_at = time.time() + min(WRITE_BACKOFF_MAX_S, FLUSH_EVERY_S * 2 ** min(self.write_failures, 10))
        if self.write_error is None or self.write_cause != cause:
            LOG.warning("could not write the report to %s (VLLM_OVERLAY_REPORT_DIR=%s): %s; retrying with "
                        "backoff up to every %.0f s, silently until it works or the error changes "
                        "(/metrics: vllm_overlay_report_write_failing 1)",
                        path, os.path.dirname(path), error, WRITE_BACKOFF_MAX_S)
        self.write_error, self.write_cause = (path, error), cause

    def set_identity(self, worker_rank: int | None, tp_rank: int | None) -> None:
        """Record the worker's ranks once known. A summary line written before them named an
        earlier role: it is followed by one with the final role, so the log's last word is right."""
        with self.lock:
            self.worker_rank, self.tp_rank = worker_rank, tp_rank
            self.dirty = True
            relog = self.summary_role is not None and self.summary_role != self.role()
        if relog:
            self.log_summary(note=f"role now known (was {self.summary_role})")

    def log_summary(self, note: str = "") -> None:
        c = self.counts()
        try:
            path = self.report_path()
        except Exception as exc:  # noqa: BLE001 - VLLM_OVERLAY=0 leaves a bad report setting unjudged
            path = f"none ({exc})"
        role = self.role()
        self.summary_role = role
        with self.lock:
            waiting = "; ".join(
                f"{pid} waits for {', '.join(rec.get('pending_modules') or ['?'])}"
                for pid, rec in sorted(self.patches.items()) if rec.get("status") == "armed")
        LOG.info(
            "pid %d role %s: %d applied, %d armed (module not imported yet%s), %d skipped, "
            "%d off, %d upstream-merged, %d failed; report %s%s",
            self.pid, role, c["applied"], c["armed"], f": {waiting}" if waiting else "", c["skipped"], c["off"],
            c["upstream-merged"], c["failed"], path, f" ({note})" if note else "",
        )


STATE = ProcessState()

_flusher_lock = threading.Lock()
_flusher: threading.Thread | None = None


def _flush_loop() -> None:
    while True:
        time.sleep(FLUSH_EVERY_S)
        if STATE.write_error is not None and time.time() < STATE.next_write_at:
            continue  # writing fails: back off
        if STATE.dirty or time.time() - STATE.last_written > report_files.REFRESH_S:
            STATE.write()  # a live process's file never gets old enough to be pruned


def _ensure_flusher() -> None:
    global _flusher
    if _flusher is not None and _flusher.is_alive():
        return
    with _flusher_lock:
        if _flusher is None or not _flusher.is_alive():
            _flusher = threading.Thread(target=_flush_loop, name="vllm-overlay-flush", daemon=True)
            _flusher.start()


# ---- what a patch says in its own report entry ----------------------------------------------
# A patch module writes its entry (``patches[id]`` of the report) only through these; the entry's
# status is core's (decided, armed, applied, failed, reverted: STATE.set_patch).


def patch_note(patch_id: str, **fields: Any) -> None:
    """Set ``fields`` in the report entry of ``patch_id`` (its status stays as it is)."""
    with STATE.lock:
        STATE.patches.setdefault(patch_id, {}).update(fields)
        STATE.dirty = True


def patch_append(patch_id: str, name: str, item: Any) -> None:
    """Append ``item`` to the list ``name`` of the report entry of ``patch_id`` (made empty first)."""
    with STATE.lock:
        STATE.patches.setdefault(patch_id, {}).setdefault(name, []).append(item)
        STATE.dirty = True


def patch_put(patch_id: str, name: str, key: str, value: Any) -> None:
    """Set ``key`` of the mapping ``name`` of the report entry of ``patch_id`` (made empty first)."""
    with STATE.lock:
        STATE.patches.setdefault(patch_id, {}).setdefault(name, {})[key] = value
        STATE.dirty = True


def patch_entry(patch_id: str) -> dict[str, Any]:
    """A copy of the report entry of ``patch_id`` (its top level; empty when it has none)."""
    with STATE.lock:
        return dict(STATE.patches.get(patch_id, {}))


# ---- sections: the parts of the report their owners keep ------------------------------------
# Each section is one key of the report, kept by the module whose data it is. The modules that own
# one are listed here, so every report carries every key, whatever the process imported: they are
# imported (once) before a report is assembled.

SECTIONS: dict[str, str] = {
    "budgets": "vllm_overlay.budget",  # each distinct token-budget resolution
    "buffers": "vllm_overlay.patches._gdn_buffers",  # gdn-output-prealloc's buffers
    "engine_config": "vllm_overlay.patches.forward_telemetry",  # the live limits of the runner
    "runner": "vllm_overlay.patches._runner",  # the model runner the worker built
    "ranks": "vllm_overlay.patches.rank_reports",  # an engine core's gathered worker reports
    "telemetry": "vllm_overlay.telemetry",  # forward sizes: real, dummy, profile
}
_owners_loaded = False


def load_owners() -> None:
    """Import every module of ``SECTIONS`` (each registers its section on import)."""
    global _owners_loaded
    if _owners_loaded:
        return
    for module in dict.fromkeys(SECTIONS.values()):
        importlib.import_module(module)
    _owners_loaded = True


class Section:
    """One key of the report, kept by the module that owns its data. A subclass holds its data as
    attributes, sets them up in ``reset()``, changes them only inside ``with self.changing():``, and
    returns its JSON from ``to_json()`` (None leaves the key out); ``after_fork(parent)`` is what a
    forked child keeps (nothing, unless the subclass says otherwise)."""

    key = ""  # set by section()

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        raise NotImplementedError

    def to_json(self) -> Any:
        raise NotImplementedError

    def after_fork(self, parent: int) -> None:
        self.reset()

    @contextlib.contextmanager
    def changing(self, start_flusher: bool = False) -> Iterator[None]:
        """Hold the state's lock while the section changes and mark the report for the flusher
        (``start_flusher``: start it now, for data that keeps changing while nothing else writes)."""
        with STATE.lock:
            yield
            STATE.dirty = True
        if start_flusher:
            _ensure_flusher()


class Items(Section):
    """A section that is a list of entries (dicts); its owner keeps each entry it adds and changes it
    with ``note``."""

    def reset(self) -> None:
        self.items: list[dict[str, Any]] = []

    def to_json(self) -> list[dict[str, Any]]:
        return self.items

    def add(self, item: dict[str, Any]) -> None:
        with self.changing():
            self.items.append(item)

    def note(self, item: dict[str, Any], **fields: Any) -> None:
        """Set ``fields`` in ``item`` (an entry ``add`` listed, or one not listed yet)."""
        with self.changing():
            item.update(fields)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


class Fields(Section):
    """A section that is one mapping of fields."""

    def reset(self) -> None:
        self.fields: dict[str, Any] = {}

    def to_json(self) -> dict[str, Any]:
        return self.fields

    def replace(self, fields: dict[str, Any]) -> None:
        with self.changing():
            self.fields = dict(fields)

    def note(self, **fields: Any) -> None:
        """Set ``fields`` (the others stay)."""
        with self.changing():
            self.fields = {**self.fields, **fields}

    def get(self, name: str, default: Any = None) -> Any:
        with STATE.lock:
            return self.fields.get(name, default)

    def copy(self) -> dict[str, Any]:
        with STATE.lock:
            return dict(self.fields)

    def __len__(self) -> int:
        return len(self.fields)


S = TypeVar("S", bound=Section)


def section(key: str, factory: Callable[[], S]) -> S:
    """Register the section of the report under ``key`` (one of ``SECTIONS``) and return it: made
    with ``factory`` the first time; the same object again for the same key and class (a module
    imported twice)."""
    if key not in SECTIONS:
        raise OverlayError(f"report section key={key!r}: not one of SECTIONS ({', '.join(sorted(SECTIONS))}); "
                           "list the key and its owner module in report.SECTIONS")
    with STATE.lock:
        have = STATE.sections.get(key)
        if have is not None:
            made = type(have)
            if isinstance(factory, type) and (made.__module__, made.__qualname__) == (factory.__module__,
                                                                                     factory.__qualname__):
                return have  # type: ignore[return-value]
            raise OverlayError(f"report section key={key!r}: already registered by {made.__module__}."
                               f"{made.__qualname__}; one owner per key")
        sec = factory()
        if not isinstance(sec, Section):
            raise OverlayError(f"report section key={key!r}: factory={factory!r} made a {type(sec).__name__}, "
                               "not a report.Section")
        sec.key = key
        STATE.sections[key] = sec
        return sec


def flush() -> str | None:
    """Write this process's report now; returns its path."""
    return STATE.write()


def _after_fork_in_child() -> None:
    """A forked child gets its own state, locks and flusher. It keeps, as copies, what its memory
    inherited from the parent (the patches in place, and what each section's ``after_fork`` keeps:
    budgets resolved before the fork, marked with the parent's pid); its counters start at zero."""
    global _flusher, _flusher_lock
    import copy

    parent = STATE.pid
    patches, version, platform = copy.deepcopy(STATE.patches), STATE.vllm_version, STATE.platform
    carried_from, carried = STATE.carried_from, copy.deepcopy(STATE.carry)
    registered = STATE.registered
    STATE.lock = threading.RLock()
    STATE._reset_own()
    STATE.forked_from = parent
    STATE.patches, STATE.vllm_version, STATE.platform = patches, version, platform
    STATE.carried_from, STATE.carry = carried_from, carried
    for sec in STATE.sections.values():
        sec.after_fork(parent)  # a module's own fork handler runs after this one (it imports this module)
    STATE.registered = registered
    _flusher = None
    _flusher_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _at_exit() -> None:
    if STATE.registered:
        STATE.write()
