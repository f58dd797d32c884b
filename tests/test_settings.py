"""Every setting: defaults, accepted values, named errors, legacy aliases."""

from __future__ import annotations

import os

import pytest

from vllm_overlay import settings
from vllm_overlay.errors import SettingError


def test_defaults() -> None:
    assert settings.value("VLLM_OVERLAY", {}) is True
    assert settings.value("VLLM_OVERLAY_STRICT", {}) is False
    assert settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP", {}) == 0
    assert settings.value("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", {}) is None
    assert settings.value("VLLM_OVERLAY_MEMORY_HEADROOM", {}) is True
    assert settings.value("VLLM_OVERLAY_MEMORY_HEADROOM", {"VLLM_OVERLAY_MEMORY_HEADROOM": "0"}) is False
    assert settings.resolve("VLLM_OVERLAY_ENABLE", {}).source == "default"
    assert settings.value("VLLM_OVERLAY_REPORT_DIR", {}).endswith(f"vllm-overlay-reports-{os.geteuid()}")


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("VLLM_OVERLAY_PROFILE_RUN_CAP", "4k", "VLLM_OVERLAY_PROFILE_RUN_CAP='4k': expected an integer in [0, 1048576] (0 disables the cap)"),
        ("VLLM_OVERLAY_PROFILE_RUN_CAP", "-1", "expected an integer in [0, 1048576]"),
        ("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "0", "VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET='0': expected an integer in [1, 1048576]"),
        ("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "1048577", "expected an integer in [1, 1048576]"),
        ("VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS", "8192.0", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS='8192.0'"),
        ("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP", "lots", "VLLM_OVERLAY_PREFILL_CHUNK_CLAMP='lots'"),
        ("VLLM_OVERLAY_STRICT", "maybe", "VLLM_OVERLAY_STRICT='maybe': expected 1 or 0"),
        ("VLLM_OVERLAY", "2", "VLLM_OVERLAY='2': expected 1 or 0"),
        ("VLLM_OVERLAY_ENABLE", "gdn_output!", "VLLM_OVERLAY_ENABLE='gdn_output!'"),
        ("VLLM_OVERLAY_TEST_BUFFER_ROWS", "x", "VLLM_OVERLAY_TEST_BUFFER_ROWS='x'"),
        ("VLLM_OVERLAY_TEST_GUARD", "off-ish", "VLLM_OVERLAY_TEST_GUARD='off-ish'"),
        ("VLLM_OVERLAY_MEMORY_HEADROOM", "512MiB",
         "VLLM_OVERLAY_MEMORY_HEADROOM='512MiB': expected 1 or 0 (0 turns the correction off: UNSAFE"),
    ],
)
def test_bad_values_name_variable_value_and_range(name: str, raw: str, expected: str) -> None:
    with pytest.raises(SettingError) as err:
        settings.resolve(name, {name: raw})
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("alias", "primary"),
    [
        ("GENESIS_PROFILE_RUN_CAP_M", "VLLM_OVERLAY_PROFILE_RUN_CAP"),
        ("GENESIS_PREALLOC_TOKEN_BUDGET", "VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET"),
        ("GENESIS_GDN_MAX_BATCHED_TOKENS", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS"),
    ],
)
def test_legacy_aliases(alias: str, primary: str) -> None:
    r = settings.resolve(primary, {alias: "4096"})
    assert (r.value, r.source) == (4096, f"alias {alias}")
    r = settings.resolve(primary, {alias: "4096", primary: "4096"})
    assert (r.value, r.source) == (4096, f"env {primary}")
    with pytest.raises(SettingError) as err:
        settings.resolve(primary, {alias: "4096", primary: "8192"})
    assert primary in str(err.value) and alias in str(err.value) and "disagree" in str(err.value)
    with pytest.raises(SettingError) as err:
        settings.resolve(primary, {alias: "four"})
    assert f"{alias}='four'" in str(err.value)


def test_unknown_overlay_variable_is_an_error() -> None:
    with pytest.raises(SettingError) as err:
        settings.validate_all({"VLLM_OVERLAY_PROFILE_CAP": "1"})
    assert "VLLM_OVERLAY_PROFILE_CAP" in str(err.value) and "VLLM_OVERLAY_PROFILE_RUN_CAP" in str(err.value)


def test_booleans_and_lists() -> None:
    assert settings.value("VLLM_OVERLAY", {"VLLM_OVERLAY": "off"}) is False
    assert settings.value("VLLM_OVERLAY_ENABLE", {"VLLM_OVERLAY_ENABLE": " a-b , c "}) == ("a-b", "c")
    assert settings.value("VLLM_OVERLAY_REPORT_DIR", {"VLLM_OVERLAY_REPORT_DIR": "/x/y"}) == "/x/y"


def test_every_setting_is_documented() -> None:
    for s in settings.SETTINGS:
        assert s.help and s.accepted and s.name.startswith("VLLM_OVERLAY")


def test_full_width_digits_and_near_miss_aliases_stop_start_up() -> None:
    with pytest.raises(SettingError, match=r"VLLM_OVERLAY_PROFILE_RUN_CAP='４０９６': expected an integer"):
        settings.validate_all({"VLLM_OVERLAY_PROFILE_RUN_CAP": "４０９６"})
    with pytest.raises(SettingError, match="did you mean GENESIS_PROFILE_RUN_CAP_M"):
        settings.validate_all({"GENESIS_PROFILE_RUN_CAP": "4096"})
    settings.validate_all({"GENESIS_PROFILE_RUN_CAP_M": "4096", "GENESIS_UNRELATED_THING": "1"})  # kept working


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("VLLM_OVERLAY_PROFILE_RUN_CAP", "-0", "VLLM_OVERLAY_PROFILE_RUN_CAP='-0': expected an integer in [0, 1048576]"),
        ("VLLM_OVERLAY_SERVER_ID", "ümlaut", "VLLM_OVERLAY_SERVER_ID='ümlaut': expected 1 to 128 characters from a-z"),
        ("VLLM_OVERLAY_REPORT_DIR", "/etc/passwd", "VLLM_OVERLAY_REPORT_DIR='/etc/passwd': /etc/passwd is a regular file, "
                                                   "not a directory; expected a directory"),
        ("VLLM_OVERLAY_REPORT_DIR", "/dev/null", "/dev/null is a character device, not a directory"),
        ("VLLM_OVERLAY_REPORT_DIR", "/etc/passwd/reports", "cannot be created: /etc/passwd is not a directory"),
        ("VLLM_OVERLAY_REPORT_DIR", "/x" * 2500, "... (5000 characters): expected a directory, or a path to create "
                                                 "one at (an absolute or relative path of at most 4096 characters"),
        ("VLLM_OVERLAY_MOE_CONFIG_DIR", "/etc/passwd", "VLLM_OVERLAY_MOE_CONFIG_DIR='/etc/passwd': /etc/passwd is not a "
                                                       "folder; expected an existing folder"),
        ("VLLM_OVERLAY_MOE_CONFIG_DIR", "/no/such/folder", "/no/such/folder does not exist; expected an existing folder"),
        ("VLLM_OVERLAY_DECODE_GEMV_CONFIGS", "/no/such.json", "/no/such.json does not exist; expected a JSON file"),
        ("VLLM_OVERLAY_DECODE_GEMV_CONFIGS", "/etc", "/etc is not a regular file"),
    ],
)
def test_start_up_and_doctor_check_values_and_the_files_they_name(name: str, raw: str, expected: str) -> None:
    problems = settings.startup_problems({name: raw})
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize(("content", "expected"), [
    ("{not json", "is not a usable table: cannot read a JSON config table"),
    ('{"devices": {"NVIDIA H200": {"2048x4096": [3, 64, 4, 1]}}}', "expected [BLOCK_N, BLOCK_K, num_warps, num_stages]"),
    ('{"devices": {}}', "names no device"),
    ('{"devices": {"": {"2048x4096": [32, 64, 4, 1]}}}', "device '' has an empty name or no shape"),
])
def test_a_decode_gemv_table_is_read_at_start_up(tmp_path, content: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    table = tmp_path / "t.json"
    table.write_text(content)
    (line,) = settings.startup_problems({"VLLM_OVERLAY_DECODE_GEMV_CONFIGS": str(table)})
    assert line.startswith(f"VLLM_OVERLAY_DECODE_GEMV_CONFIGS='{table}': {table} ") and expected in line, line
    table.write_text('{"devices": {"NVIDIA H200": {"2048x4096": [32, 64, 4, 1]}}}')
    assert settings.startup_problems({"VLLM_OVERLAY_DECODE_GEMV_CONFIGS": str(table)}) == []


def test_off_judges_no_other_setting_and_says_they_were_ignored(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess

    from conftest import PY, clean_env

    bad = {"VLLM_OVERLAY_PROFILE_RUN_CAP": "4k", "VLLM_OVERLAY_ENABLE": "no-such-patch"}
    assert settings.startup_problems(bad) and settings.startup_problems({"VLLM_OVERLAY": "0", **bad}) == []
    p = subprocess.run([PY, "-c", "from vllm_overlay import core; core.register(); print(core.STATE.counts())"],
                       capture_output=True, text=True, timeout=120,
                       env=clean_env(VLLM_OVERLAY="0", VLLM_OVERLAY_REPORT_DIR=str(tmp_path), **bad))
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [ln for ln in p.stderr.splitlines() if "ignored" in ln]
    assert "VLLM_OVERLAY=0: the overlay is off" in line and "VLLM_OVERLAY_ENABLE, VLLM_OVERLAY_PROFILE_RUN_CAP" in line
    assert "'applied': 0" in p.stdout
