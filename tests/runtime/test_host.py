"""Process settings for CPU training: they fill in what the user left unset and never override it."""

import ctypes.util
import os

import pytest

from specforge_core.system.host import keep_freed_memory, prefer_passive_omp_wait


def test_passive_omp_wait_is_the_default_but_a_users_policy_stands(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    prefer_passive_omp_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    prefer_passive_omp_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.skipif("libc.so" not in (ctypes.util.find_library("c") or ""), reason="glibc only")
def test_freed_memory_is_kept_on_glibc_unless_the_user_tuned_malloc(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert keep_freed_memory() is True
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False
