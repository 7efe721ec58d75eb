"""Process settings of a training rank: the CPU ones fill in what the user left unset and never
override it; a CUDA rank runs its host ops on one thread."""

import ctypes.util
import os

import pytest
import torch

from specforge_core.system.distributed import close_distributed, init_distributed
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


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("device, threads", [
    ("cpu", 2),  # a CPU rank computes on the host: it keeps its pool
    pytest.param("cuda", 1, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
])
def test_a_cuda_rank_runs_its_host_ops_on_one_thread_a_cpu_rank_keeps_its_pool(restore_threads, device, threads):
    torch.set_num_threads(2)
    init_distributed(device, timeout_s=30)
    try:
        assert torch.get_num_threads() == threads
    finally:
        close_distributed()
