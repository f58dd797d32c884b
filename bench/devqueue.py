"""GPU jobs run one after another on the device machine, across device calls (stdlib only).

  python3 bench/devqueue.py run JOBS.json --deadline S [--only ID,ID]   # on the device machine
  python3 bench/devqueue.py unpack DIR... --into DEST                    # here, after the calls

A device call runs at most 10 minutes and returns at most 8 files; a job (a boot of the 35B geometry
and its measurements, a tuning run) does not fit call boundaries. `run` starts a runner in its own
process session, which runs the jobs of JOBS.json one after another and goes on between calls while
the machine is held; `run` itself waits until every job has ended or S seconds have passed, then packs
each started job into `$OUT/ID.tgz` (its folder, its log and the paths it `keep`s, as they are at that
moment: a running job's partial files too) and writes `$OUT/queue-NAME.json` (each job's state, rc and
seconds). It prints `queue NAME: all ended` (exit 0) or `NOT DONE: run the same command again in the
next call` (exit 10); a bad JOBS.json or argument exits 2. The same command in the next call finds the
runner (or restarts it: a job whose runner died is run once more) and waits on.

JOBS.json:
  {"name": "issue18", "env": {"NAME": "VALUE"},
   "jobs": [{"id": "tune-decode", "timeout": 420, "cmd": "bash command", "keep": ["/tmp/moe-configs"]}, ...]}

Each job runs `bash -c CMD` from the checkout root (the one the latest `run` came from) with the
runner's environment (that of the `run` that started it) plus `env`,
`OUT` and `QUEUE_JOB_DIR` set to its own folder (/tmp/queue/NAME/ID; $QUEUE_STATE_DIR moves /tmp/queue)
and `QUEUE_DATE` (the UTC date, YYYYMMDD, when the queue first started: one tag for every result of
the queue), in its own process group, ended (TERM, then KILL) at `timeout` seconds. Its rc is recorded
and the next job starts whatever it was; between two jobs the runner waits until the GPU's used memory
stops falling (nvidia-smi), so a job never boots beside what the last one left. At most 7 jobs: with
the status file, 8 files come back.

`unpack` takes the folders the calls brought back, picks each job's newest pack (by the time it was
packed) and extracts it into DEST/ID/ (`out/`: the job's folder; `keep/`: its kept paths under their
absolute path; `pack.json`: its state when packed).
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MAX_JOBS = 7  # + queue-NAME.json = the 8 files a device call returns
MAX_PACKED_FILE = 12 << 20  # bytes: a bigger file is left out of a pack (a call returns 16 MiB a file)
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,60}")
ENDED = ("done", "timeout", "failed")
MAX_ATTEMPTS = 2  # a job whose runner died mid-job runs once more


def say(msg: str) -> None:
    print(f"queue: {time.strftime('%H:%M:%S')} {msg}", flush=True)


def state_root() -> str:
    return os.environ.get("QUEUE_STATE_DIR") or "/tmp/queue"


def write_json(path: str, data: Any) -> None:
    """Whole or not at all: a reader never sees half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str, default: Any) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


class JobsError(ValueError):
    """JOBS.json or --only is not what `run` accepts."""


def load_jobs(path: str, only: str = "") -> dict[str, Any]:
    """The queue, validated: one JobsError naming the file, the field, the value and what is accepted."""
    try:
        with open(path) as f:
            q = json.load(f)
    except OSError as exc:
        raise JobsError(f"{path}: cannot be read ({exc})") from None
    except ValueError as exc:
        raise JobsError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(q, dict) or not isinstance(q.get("jobs"), list) or not q["jobs"]:
        raise JobsError(f'{path}: expected {{"name": ..., "jobs": [{{"id", "timeout", "cmd"}}, ...]}}')
    name = q.get("name")
    if not isinstance(name, str) or not ID_RE.fullmatch(name):
        raise JobsError(f"{path}: name {name!r}: expected letters, digits, '.', '_' or '-'")
    env = q.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise JobsError(f"{path}: env {env!r}: expected an object of NAME: VALUE strings")
    if len(q["jobs"]) > MAX_JOBS:
        raise JobsError(f"{path}: {len(q['jobs'])} jobs: expected at most {MAX_JOBS} (a device call returns 8 files: "
                        "one pack per job and the status)")
    seen = set()
    for i, job in enumerate(q["jobs"]):
        where = f"{path}: jobs[{i}]"
        if not isinstance(job, dict):
            raise JobsError(f"{where}: expected an object with id, timeout, cmd")
        jid = job.get("id")
        if not isinstance(jid, str) or not ID_RE.fullmatch(jid) or jid in seen:
            raise JobsError(f"{where}: id {jid!r}: expected a new name of letters, digits, '.', '_' or '-'")
        seen.add(jid)
        t = job.get("timeout")
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise JobsError(f"{where} ({jid}): timeout {t!r}: expected whole seconds >= 1")
        if not isinstance(job.get("cmd"), str) or not job["cmd"].strip():
            raise JobsError(f"{where} ({jid}): cmd {job.get('cmd')!r}: expected a bash command")
        keep = job.get("keep", [])
        if not isinstance(keep, list) or not all(isinstance(k, str) and os.path.isabs(k) for k in keep):
            raise JobsError(f"{where} ({jid}): keep {keep!r}: expected a list of absolute paths")
    if only:
        ids = [x.strip() for x in only.split(",") if x.strip()]
        unknown = [x for x in ids if x not in seen]
        if unknown or not ids:
            raise JobsError(f"--only {only!r}: expected job ids from {path}: {', '.join(j['id'] for j in q['jobs'])}")
        q["jobs"] = [j for j in q["jobs"] if j["id"] in ids]
    return q


def qdir(q: dict[str, Any]) -> str:
    return os.path.join(state_root(), q["name"])


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return True


def status(q: dict[str, Any]) -> dict[str, Any]:
    return read_json(os.path.join(qdir(q), "status.json"), {})


def set_status(q: dict[str, Any], jid: str, **kv: Any) -> None:
    path = os.path.join(qdir(q), "status.json")
    st = read_json(path, {})
    st.setdefault(jid, {}).update(kv)
    write_json(path, st)


def gpu_used_mib() -> list[int] | None:
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    vals = [int(x) for x in text.split() if x.strip().isdigit()]
    return vals or None


def settle_gpu(limit: float = 30) -> None:
    """Until the GPUs' used memory stops falling (a dead process's memory is freed within seconds)."""
    t0, last = time.time(), gpu_used_mib()
    while last is not None and time.time() - t0 < limit:
        time.sleep(2)
        now = gpu_used_mib()
        if now == last:
            break
        last = now


def group_alive(pgid: int) -> bool:
    """Some process of the group is running (zombies, which wait to be reaped, are not)."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


def end_group(pid: int) -> None:
    """TERM to the job's process group, KILL to what is left after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        if not group_alive(pid):
            return
        try:
            os.killpg(pid, sig)
        except OSError:
            return
        t0 = time.time()
        while time.time() - t0 < wait and group_alive(pid):
            time.sleep(0.5)


def runner(jobs_path: str, only: str) -> int:
    """The detached runner: each job not yet ended, in order."""
    q = load_jobs(jobs_path, only)
    d = qdir(q)
    info = read_json(os.path.join(d, "runner.json"), {})
    info.update(pid=os.getpid(), started=time.time(), finished=None)
    write_json(os.path.join(d, "runner.json"), info)
    for job in q["jobs"]:
        jid = job["id"]
        st = status(q).get(jid, {})
        if st.get("state") in ENDED or st.get("attempts", 0) >= MAX_ATTEMPTS:
            continue
        jdir = os.path.join(d, jid)
        os.makedirs(jdir, exist_ok=True)
        env = {**os.environ, **q.get("env", {}), "OUT": jdir, "QUEUE_JOB_DIR": jdir, "QUEUE_DATE": info["date"]}
        # the checkout the latest `run` came from (each device call brings the working tree again)
        root = read_json(os.path.join(d, "runner.json"), {}).get("root") or ROOT
        root = root if os.path.isdir(root) else ROOT
        log = open(os.path.join(jdir, "job.log"), "a")
        log.write(f"queue: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} start: {job['cmd']}\n")
        log.flush()
        t0 = time.time()
        proc = subprocess.Popen(["bash", "-c", job["cmd"]], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        set_status(q, jid, state="running", pid=proc.pid, started=t0, attempts=st.get("attempts", 0) + 1,
                   timeout=job["timeout"])
        try:
            rc: int | str = proc.wait(timeout=job["timeout"])
            state = "done"
        except subprocess.TimeoutExpired:
            end_group(proc.pid)
            proc.wait()
            rc, state = "timeout", "timeout"
        end_group(proc.pid)  # whatever the job left in its group (a server it started without setsid)
        log.write(f"queue: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} ended: rc {rc} after "
                  f"{time.time() - t0:.1f} s\n")
        log.close()
        set_status(q, jid, state=state, rc=rc, ended=time.time(), wall_s=round(time.time() - t0, 1))
        settle_gpu()
    info["finished"] = time.time()
    write_json(os.path.join(d, "runner.json"), info)
    return 0


def ensure_runner(q: dict[str, Any], jobs_path: str, only: str) -> None:
    d = qdir(q)
    os.makedirs(d, exist_ok=True)
    info = read_json(os.path.join(d, "runner.json"), {})
    if alive(info.get("pid")) and not info.get("finished"):
        say(f"{q['name']}: the runner is running (pid {info['pid']})")
        return
    st = status(q)
    for job in q["jobs"]:  # a job left "running" by a runner that is gone runs once more
        rec = st.get(job["id"], {})
        if rec.get("state") == "running" and not alive(rec.get("pid")):
            set_status(q, job["id"], state="interrupted")
            say(f"{q['name']}: {job['id']} was interrupted (its runner is gone); it runs again"
                if rec.get("attempts", 0) < MAX_ATTEMPTS else
                f"{q['name']}: {job['id']} was interrupted twice; not run again")
    if all(status(q).get(j["id"], {}).get("state") in ENDED for j in q["jobs"]):
        return
    info = {"date": info.get("date") or time.strftime("%Y%m%d", time.gmtime()), "jobs_file": jobs_path, "root": ROOT}
    write_json(os.path.join(d, "runner.json"), info)
    argv = [sys.executable, os.path.abspath(__file__), "_runner", jobs_path] + (["--only", only] if only else [])
    with open(os.path.join(d, "runner.log"), "a") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    info = read_json(os.path.join(d, "runner.json"), info)
    if not info.get("pid"):  # the runner writes its own pid too; whichever comes first, no second runner starts
        info["pid"] = proc.pid
        write_json(os.path.join(d, "runner.json"), info)
    say(f"{q['name']}: runner started (pid {proc.pid}), {len(q['jobs'])} job(s), tag date {info['date']}")


def log_tail(path: str, n: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-n:]
    except OSError:
        return []


def job_tail(q: dict[str, Any], jid: str, n: int) -> list[str]:
    """The end of a job's own log, then of the newest other *.log in its folder (a child process's log,
    e.g. bench.py's boot and workloads, which the job's own log shows only at its end)."""
    jdir = os.path.join(qdir(q), jid)
    lines = log_tail(os.path.join(jdir, "job.log"), n)
    others = [p for p in glob.glob(os.path.join(jdir, "**", "*.log"), recursive=True)
              if os.path.basename(p) != "job.log"]
    if others:
        newest = max(others, key=os.path.getmtime)
        lines += [f"[{os.path.basename(newest)}] {ln}" for ln in log_tail(newest, n)]
    return lines


def files_of(base: str, arc: str) -> list[tuple[str, str]]:
    """(path, name in the pack) of every file under `base` (a folder or one file)."""
    if os.path.isfile(base):
        return [(base, arc)]
    out = []
    for dirpath, _, files in os.walk(base):
        for name in sorted(files):
            full = os.path.join(dirpath, name)
            out.append((full, os.path.join(arc, os.path.relpath(full, base))))
    return out


def pack(q: dict[str, Any], out: str) -> list[str]:
    """$OUT/ID.tgz per started job and $OUT/queue-NAME.json; the files written."""
    os.makedirs(out, exist_ok=True)
    st = status(q)
    written = []
    stamp = time.time()
    for job in q["jobs"]:
        jid = job["id"]
        jdir = os.path.join(qdir(q), jid)
        if not os.path.isdir(jdir):
            continue
        left_out = []
        path = os.path.join(out, f"{jid}.tgz")
        with tarfile.open(path, "w:gz") as tar:
            for full, arc in [*files_of(jdir, "out"), *(f for k in job.get("keep", []) for f in files_of(k, "keep" + k))]:
                try:
                    size = os.path.getsize(full)
                    if size > MAX_PACKED_FILE:
                        left_out.append(f"{full} ({size} bytes)")
                        continue
                    tar.add(full, arcname=arc)
                except OSError:
                    continue  # removed while packing
            manifest = {"queue": q["name"], "job": jid, "cmd": job["cmd"], "packed": stamp,
                        "packed_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp)),
                        "status": st.get(jid, {}), "left_out": left_out}
            data = json.dumps(manifest, indent=1).encode()
            info = tarfile.TarInfo("pack.json")
            info.size, info.mtime = len(data), int(stamp)
            tar.addfile(info, io.BytesIO(data))
        written.append(path)
    path = os.path.join(out, f"queue-{q['name']}.json")
    write_json(path, {"queue": q["name"], "packed_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp)),
                      "runner": read_json(os.path.join(qdir(q), "runner.json"), {}), "status": st,
                      "jobs": [j["id"] for j in q["jobs"]]})
    written.append(path)
    return written


def describe(q: dict[str, Any], jid: str) -> str:
    rec = status(q).get(jid, {})
    s = rec.get("state", "not started")
    if s == "running":
        return f"running for {time.time() - rec['started']:.0f} s (attempt {rec.get('attempts')}, limit {rec.get('timeout')} s)"
    if s in ENDED:
        return f"{s}, rc {rec.get('rc')}, {rec.get('wall_s')} s"
    return s


def cmd_run(a: argparse.Namespace) -> int:
    t_end = time.time() + a.deadline
    try:
        q = load_jobs(a.jobs, a.only)
    except JobsError as exc:
        print(f"queue: {exc}", file=sys.stderr)
        return 2
    out = os.environ.get("OUT")
    if not out:
        print("queue: run: $OUT is not set (the device call's folder for files to bring back)", file=sys.stderr)
        return 2
    ensure_runner(q, a.jobs, a.only)
    path = os.path.join(qdir(q), "runner.json")
    write_json(path, {**read_json(path, {}), "root": ROOT})  # where the runner starts the next job
    seen = {j["id"]: status(q).get(j["id"], {}).get("state", "not started") for j in q["jobs"]}
    while True:
        st = status(q)
        for job in q["jobs"]:  # what changed while we watched; a job that ended shows its log's end
            jid = job["id"]
            now = st.get(jid, {}).get("state", "not started")
            if seen[jid] != now:
                say(f"{q['name']}: {jid}: {describe(q, jid)}")
                if now in ENDED:
                    for line in job_tail(q, jid, a.tail):
                        print("  | " + line[-300:], flush=True)
                seen[jid] = now
        pending = [j["id"] for j in q["jobs"] if st.get(j["id"], {}).get("state") not in ENDED
                   and not (st.get(j["id"], {}).get("state") == "interrupted"
                            and st[j["id"]].get("attempts", 0) >= MAX_ATTEMPTS)]
        info = read_json(os.path.join(qdir(q), "runner.json"), {})
        if not pending or time.time() >= t_end:
            break
        if not alive(info.get("pid")) and not info.get("finished"):
            ensure_runner(q, a.jobs, a.only)  # the runner died: start another, the job runs once more
        time.sleep(min(a.poll, max(0.2, t_end - time.time())))
    running = [j["id"] for j in q["jobs"] if status(q).get(j["id"], {}).get("state") == "running"]
    for jid in running:  # what the job is doing now
        for line in job_tail(q, jid, a.tail):
            print(f"  {jid} | " + line[-300:], flush=True)
    files = pack(q, out)
    for job in q["jobs"]:
        say(f"{q['name']}: {job['id']}: {describe(q, job['id'])}")
    say(f"{q['name']}: packed {', '.join(os.path.basename(f) for f in files)}")
    if pending:
        say(f"{q['name']}: NOT DONE: run the same command again in the next call ({', '.join(pending)} left)")
        return 10
    say(f"{q['name']}: all ended")
    return 0


def cmd_unpack(a: argparse.Namespace) -> int:
    """The newest pack of each job among the folders given, extracted into DEST/ID/."""
    best: dict[str, tuple[float, str]] = {}
    for d in a.dirs:
        for path in glob.glob(os.path.join(d, "**", "*.tgz"), recursive=True):
            try:
                with tarfile.open(path) as tar:
                    member = tar.extractfile("pack.json")
                    man = json.load(member) if member else None
            except (OSError, tarfile.TarError, KeyError, ValueError):
                continue
            if not man or "job" not in man:
                continue
            if man["job"] not in best or man["packed"] > best[man["job"]][0]:
                best[man["job"]] = (man["packed"], path)
    if not best:
        print(f"queue: unpack: no job pack (ID.tgz with a pack.json) under {', '.join(a.dirs)}", file=sys.stderr)
        return 2
    for jid, (_, path) in sorted(best.items()):
        dest = os.path.join(a.into, jid)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        with tarfile.open(path) as tar:
            for m in tar.getmembers():  # plain files under this folder only
                if not m.isfile() or m.name.startswith("/") or ".." in m.name.split("/"):
                    continue
                tar.extract(m, dest)
        man = read_json(os.path.join(dest, "pack.json"), {})
        say(f"unpack: {jid}: {path} (packed {man.get('packed_utc')}, {man.get('status', {}).get('state')}, "
            f"rc {man.get('status', {}).get('rc')}) -> {dest}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    r = sub.add_parser("run", help="start the runner if needed, wait, pack every started job into $OUT")
    r.add_argument("jobs", help="JOBS.json")
    r.add_argument("--deadline", type=float, required=True, help="seconds from now to return by (packing included)")
    r.add_argument("--only", default="", help="these job ids only (comma-separated), in the file's order")
    r.add_argument("--poll", type=float, default=10.0, help=argparse.SUPPRESS)
    r.add_argument("--tail", type=int, default=12,
                   help="log lines shown of a job that ended or is running (its own log and its newest other log)")
    rr = sub.add_parser("_runner")
    rr.add_argument("jobs")
    rr.add_argument("--only", default="")
    u = sub.add_parser("unpack", help="the newest pack of each job among DIRs, into DEST/ID/")
    u.add_argument("dirs", nargs="+")
    u.add_argument("--into", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.step == "run":
        return cmd_run(a)
    if a.step == "_runner":
        return runner(a.jobs, a.only)
    return cmd_unpack(a)


if __name__ == "__main__":
    sys.exit(main())
