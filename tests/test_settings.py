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
