"""Runs last (file order): every boot of this session left the installed vLLM untouched."""

from __future__ import annotations

from conftest import vllm_tree_digest


def test_installed_vllm_files_unchanged(vllm_digest_before: str) -> None:
    assert vllm_tree_digest() == vllm_digest_before
