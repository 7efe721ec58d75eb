"""Shared builders for capture tests: tiny requests and a tiny target with tied embeddings."""

import pytest
import torch

from specforge_core.capture.base import TargetRequest


def make_request(lengths, local=None, seed=0, vocab=500) -> TargetRequest:
    """Random token rows of the given lengths (loss on the second half), keeping ``local`` rows."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    local = slice(0, len(lengths)) if local is None else local
    return TargetRequest.from_rows(ids, masks, local, [f"task{i}" for i in range(len(lengths))])


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory):
    from fixtures.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-tied"), arch="llama", tie_word_embeddings=True)
