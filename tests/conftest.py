"""Test set-up: where there is no GPU, kernels run on the CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it happens here, at the top
of the first module pytest loads. On a GPU machine the interpreter stays off: `gpu`-marked
tests run real kernels there, and the CPU-interpreter tests are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the suite out of the developer's ~/.cache/flashgen: rendered kernels go to a
    session folder (FLASHGEN_CACHE_DIR), and the default user database is one nobody tuned
    (XDG_CACHE_HOME; FLASHGEN_DB unset), so results never depend on a local tuning run.
    Subprocesses the tests start inherit both."""
    root = tmp_path_factory.mktemp("flashgen-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHGEN_CACHE_DIR", str(root / "flashgen"))
        patch.setenv("XDG_CACHE_HOME", str(root))
        patch.delenv("FLASHGEN_DB", raising=False)
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    cpu_only = pytest.mark.skip(reason="CPU-interpreter test; this run has a GPU")
    for item in items:
        is_gpu = "gpu" in item.keywords
        if is_gpu and not HAS_GPU:
            item.add_marker(needs_gpu)
        elif not is_gpu and HAS_GPU and "interpreter" in item.keywords:
            item.add_marker(cpu_only)

