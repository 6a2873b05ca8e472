"""Several in-process workers on a node with several GPUs: each on its own GPU, not all on the first one.
(This machine has no GPU: the rule is checked as a function of the GPU count the worker reads from torch.)"""

from __future__ import annotations

from builder.extract.model import spread_device


def test_cuda_and_auto_spread_the_workers_over_the_visible_gpus():
    for device in ("cuda", "auto"):
        assert [spread_device(device, w, 8) for w in range(8)] == [f"cuda:{i}" for i in range(8)]
        # more workers than GPUs: round robin
        assert [spread_device(device, w, 3) for w in range(5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]


def test_an_explicit_device_one_gpu_or_none_is_kept():
    assert spread_device("cuda:5", 2, 8) == "cuda:5"  # the user chose the GPU
    assert spread_device("cpu", 3, 8) == "cpu"
    assert spread_device("cuda", 3, 1) == "cuda"
    assert spread_device("auto", 3, 0) == "auto"  # no GPU: the CPU, as before
