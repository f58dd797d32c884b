"""versions.RELEASES is the one list of releases; every other version fact of a spec (its support rows,
its targets' ranges, the hash keys given to per_release) is a range over it or a selection of it, and
spec.version_problems names each disagreement in one line (the spec, the fact, the release, what is
accepted). core.registry refuses a set of specs with any of them. Each test builds one bad spec."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_overlay import core, versions
from vllm_overlay.errors import OverlayError
from vllm_overlay.patches import gdn_output_prealloc as gdn
from vllm_overlay.patches import hybrid_turboquant as htq
from vllm_overlay.patches import turboquant_v1_kv_shape as kvs
from vllm_overlay.spec import PatchSpec, Rewrite, Support, Target, per_release, version_problems

HTQ_ARGS = f"{htq.ARGS_MODULE}:EngineArgs.create_engine_config"
HTQ_RANGE = "expected exactly the releases its target's range ('<0.22.0') and the 'applies' rows select: 0.20.0-0.20.2"


def one(spec: PatchSpec) -> str:
    problems = version_problems(spec)
    assert len(problems) == 1, problems
    return problems[0]


def _htq_rewrites(hashes: dict[str, str]) -> PatchSpec:
    """hybrid-turboquant with its create_engine_config hashes replaced by ``hashes``."""
    first = htq.REWRITES[0]
    kept = tuple(rw for rw in htq.REWRITES if str(rw.target) != HTQ_ARGS)
    return dataclasses.replace(htq.SPEC, rewrites=per_release(first.target, first.path, first.edits, hashes) + kept)


def _htq_hashes() -> dict[str, str]:
    return {rw.version: rw.sha256 for rw in htq.REWRITES if str(rw.target) == HTQ_ARGS}


def test_the_registry_agrees_with_the_release_list() -> None:
    assert [p for spec in core.specs() for p in version_problems(spec)] == []
    for spec in core.specs():  # applies_on is the one answer; releases() lists the same
        assert spec.releases() == [v for v in versions.RELEASES if spec.applies_on(v)]
        assert not spec.applies_on("0.35.0")


def test_a_release_no_support_row_covers() -> None:
    rows = kvs.SPEC.support
    assert one(dataclasses.replace(kvs.SPEC, support=rows[1:])) == (
        "turboquant-v1-kv-shape: no support row covers 0.20.0, 0.20.1, 0.20.2, 0.22.0, 0.22.1, 0.23.0, 0.24.0; "
        "expected each release of "
        "versions.RELEASES in exactly one row (extend a row, or add one, e.g. 'unsupported')")


def test_a_release_two_support_rows_cover() -> None:
    overlap = dataclasses.replace(kvs.SPEC, support=kvs.SPEC.support + (Support("==0.26.0", "unsupported", "x"),))
    assert one(overlap) == (
        "turboquant-v1-kv-shape: support[5] vllm='==0.26.0' covers 0.26.0, already covered by support[1] "
        "vllm='>=0.25.0,<=0.26.0'; expected each release of versions.RELEASES in exactly one row")


def test_a_support_row_that_matches_no_release() -> None:
    dead = dataclasses.replace(kvs.SPEC, support=kvs.SPEC.support + (Support("==0.21.0", "unsupported", "x"),))
    assert one(dead) == ("turboquant-v1-kv-shape: support[5] vllm='==0.21.0' matches no release of "
                         "versions.RELEASES (0.20.0 to 0.34.0); expected a range that selects at least one")


def test_a_release_added_to_the_list_without_rows_or_hashes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Adding 0.35.0 to RELEASES alone: the registry refuses to load, naming every spec whose rows stop
    before it; with gdn-output-prealloc's row extended, its missing pristine hashes are named."""
    ids = [spec.id for spec in core.specs()]
    monkeypatch.setattr(versions, "RELEASES", versions.RELEASES + ("0.35.0",))
    core._order_checked[0] = ()
    with pytest.raises(OverlayError) as err:
        core.registry()
    for pid in ids:  # every row of every spec stops at 0.34.0
        assert f"{pid}: no support row covers 0.35.0; expected each release" in str(err.value)
    rows = gdn.SPEC.support
    last = dataclasses.replace(rows[-1], vllm=">=0.34.0,<=0.35.0")
    extended = dataclasses.replace(gdn.SPEC, support=rows[:-1] + (last,))
    problems = version_problems(extended)
    assert problems == [
        f"gdn-output-prealloc: target {gdn.MOD_QWEN}:{gdn.CLS_QWEN}.forward_cuda is rewritten but no rewrite "
        "(per_release hash key) is recorded for 0.35.0; expected one for each release its range and the 'applies' "
        "rows select (0.22.0-0.35.0)"]


def test_a_wrap_target_range_wider_than_its_applies_rows() -> None:
    wider = dataclasses.replace(kvs.SPEC.targets[0], vllm=">=0.24.0,<=0.26.0")
    assert one(dataclasses.replace(kvs.SPEC, targets=(wider, kvs.SPEC.targets[1]))) == (
        f"turboquant-v1-kv-shape: target {kvs.SPEC.targets[0]} vllm='>=0.24.0,<=0.26.0' reaches 0.24.0, where "
        "the patch does not apply; expected a range within its 'applies' rows (0.25.0-0.26.0)")


def test_a_rewrite_target_range_wider_than_its_applies_rows() -> None:
    wider = dataclasses.replace(htq.SPEC.targets[0], vllm="<0.23.0")
    assert one(dataclasses.replace(htq.SPEC, targets=(wider, htq.SPEC.targets[1]))) == (
        f"hybrid-turboquant: target {HTQ_ARGS} vllm='<0.23.0' reaches 0.22.0, 0.22.1, where the patch does not "
        "apply; expected a range within its 'applies' rows (0.20.0-0.20.2)")


def test_a_target_range_that_selects_no_release_it_applies_on() -> None:
    none = dataclasses.replace(kvs.SPEC, targets=(
        Target(kvs.RUNNER_MODULE, kvs.RESHAPE, vllm="==0.33.0", wrapper=kvs._reshape), kvs.SPEC.targets[1]))
    assert one(none) == (
        f"turboquant-v1-kv-shape: target {kvs.SPEC.targets[0]} vllm='==0.33.0' matches no release the patch "
        "applies on; expected a range within its 'applies' rows (0.25.0-0.26.0)")


def test_a_release_it_applies_on_where_nothing_is_installed() -> None:
    narrow = tuple(dataclasses.replace(t, vllm="==0.25.0") for t in kvs.SPEC.targets)
    assert one(dataclasses.replace(kvs.SPEC, targets=narrow)) == (
        "turboquant-v1-kv-shape: applies on 0.25.1-0.26.0, but no target or rewrite of it does there; expected "
        "a target whose range selects each (or a row that does not say 'applies' there)")


def test_a_hash_missing_for_a_release_the_target_applies_on() -> None:
    hashes = _htq_hashes()
    del hashes["0.20.1"]
    assert one(_htq_rewrites(hashes)) == (
        f"hybrid-turboquant: target {HTQ_ARGS} is rewritten but no rewrite (per_release hash key) is recorded "
        "for 0.20.1; expected one for each release its range and the 'applies' rows select (0.20.0-0.20.2)")


def test_a_hash_for_a_release_where_the_patch_does_not_apply() -> None:
    assert one(_htq_rewrites({**_htq_hashes(), "0.22.0": "0" * 64})) == (
        f"hybrid-turboquant: the rewrite of {HTQ_ARGS} recorded for '0.22.0' (a per_release hash key): the patch "
        f"does not apply there (upstream-merged); {HTQ_RANGE}")


def test_a_hash_outside_its_targets_range() -> None:
    """gdn-output-prealloc applies on 0.22.0, but its 0.20.x layer's forward_cuda target stops at 0.22.0."""
    extra = per_release(Target(gdn.MOD_020, f"{gdn.CLS_020}.forward_cuda"), gdn.PATH_020, (gdn._MAIN,),
                        {"0.22.0": "0" * 64})
    line = one(dataclasses.replace(gdn.SPEC, rewrites=gdn.SPEC.rewrites + extra))
    assert line == (f"gdn-output-prealloc: the rewrite of {gdn.MOD_020}:{gdn.CLS_020}.forward_cuda recorded for "
                    "'0.22.0' (a per_release hash key): outside its target's range; expected exactly the releases "
                    "its target's range ('<0.22.0') and the 'applies' rows select: 0.20.0-0.20.2")


def test_a_hash_for_a_version_that_is_no_release() -> None:
    line = one(_htq_rewrites({**_htq_hashes(), "0.21.0": "0" * 64}))
    assert line == (f"hybrid-turboquant: the rewrite of {HTQ_ARGS} recorded for '0.21.0' (a per_release hash "
                    f"key): not a release of versions.RELEASES (0.20.0 to 0.34.0); {HTQ_RANGE}")


def test_a_hash_given_twice_for_one_release() -> None:
    first = htq.REWRITES[0]
    twice = per_release(first.target, first.path, first.edits, {"0.20.2": "1" * 64})
    assert one(dataclasses.replace(htq.SPEC, rewrites=htq.SPEC.rewrites + twice)) == (
        f"hybrid-turboquant: the rewrite of {HTQ_ARGS} recorded for '0.20.2' (a per_release hash key): recorded "
        f"twice; {HTQ_RANGE}, each once")


def test_a_rewrite_of_a_function_no_target_rewrites() -> None:
    stray = per_release(Target(htq.ARGS_MODULE, "EngineArgs.other"), "engine/arg_utils.py", (), {"0.20.0": "0" * 64})
    assert one(dataclasses.replace(htq.SPEC, rewrites=htq.SPEC.rewrites + stray)) == (
        f"hybrid-turboquant: the rewrite of {htq.ARGS_MODULE}:EngineArgs.other recorded for '0.20.0' (a "
        "per_release hash key) changes a function no target of the spec rewrites; expected a "
        f"Target({htq.ARGS_MODULE!r}, 'EngineArgs.other') without a wrapper in its targets")


def test_a_rewrite_whose_own_range_is_not_its_release() -> None:
    rw = htq.REWRITES[0]
    odd = Rewrite(dataclasses.replace(rw.target, vllm="<0.22.0"), rw.version, rw.path, rw.sha256, rw.edits)
    assert one(dataclasses.replace(htq.SPEC, rewrites=(odd,) + htq.SPEC.rewrites[1:])) == (
        f"hybrid-turboquant: the rewrite of {HTQ_ARGS} recorded for '0.20.0' (a per_release hash key): its "
        "target says vllm='<0.22.0'; expected '==0.20.0' (what per_release writes)")


def test_the_registry_refuses_a_spec_whose_facts_disagree(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Checked once per set of specs when the registry loads: the error names the spec, the fact and the release."""
    hashes = _htq_hashes()
    del hashes["0.20.2"]
    monkeypatch.setattr(htq, "SPEC", _htq_rewrites(hashes))
    core._order_checked[0] = ()
    with pytest.raises(OverlayError, match=r"version facts disagree with versions.RELEASES .*hybrid-turboquant: "
                                           r"target vllm.engine.arg_utils:EngineArgs.create_engine_config is "
                                           r"rewritten but no rewrite \(per_release hash key\) is recorded for 0.20.2"):
        core.registry()


def test_releases_of_a_status_name_what_is_accepted() -> None:
    assert htq.SPEC.releases("upstream-merged")[0] == "0.22.0"
    with pytest.raises(ValueError, match=r"PatchSpec.releases\(status='merged'\): expected one of applies, "
                                         "upstream-merged, not-needed, unsupported"):
        htq.SPEC.releases("merged")
