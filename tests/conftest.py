"""Shared test setup: never touch the network, keep CPU threads modest, deterministic seeds."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread: the tiny models' matrices are small, and on a loaded 2-core machine OpenMP's spin-waiting
# with 2 threads made tiny ops stall (test files ran 10-15x slower).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
