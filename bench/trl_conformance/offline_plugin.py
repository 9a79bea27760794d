"""pytest plugin for running TRL's GRPO tests offline on a CPU machine (``-p offline_plugin``), the same for both
variants (TRL's classes and this package's):

- ``datasets.load_dataset("trl-internal-testing/zen", ...)`` returns the stand-in of `fixtures.zen_dataset`
  (models and tokenizers come from the hub cache `fixtures` filled);
- TRL's configs default ``bf16`` to True, which transformers refuses without a bf16 accelerator: where there is
  none, an unset ``bf16`` means False (a test that sets bf16 itself keeps its value);
- each test gets at most ``TRL_CONFORMANCE_TEST_TIMEOUT`` seconds (default 300), so one hung test cannot hold the
  run: it fails with a TimeoutError.
"""

from __future__ import annotations

import os
import signal

import datasets
import pytest
from fixtures import zen_dataset

_load_dataset = datasets.load_dataset


def _offline_load_dataset(path, name=None, *args, split=None, **kwargs):
    if path == "trl-internal-testing/zen":
        data = zen_dataset(name)
        return data if split is None else data[split]
    return _load_dataset(path, name, *args, split=split, **kwargs)


# Before the test module runs `from datasets import load_dataset` (plugins load before test collection).
datasets.load_dataset = _offline_load_dataset


def _bf16_only_where_supported():
    from transformers.utils import is_torch_bf16_gpu_available
    from trl.trainer.base_config import _BaseConfig

    if is_torch_bf16_gpu_available():
        return
    post_init = _BaseConfig.__post_init__

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = False
        post_init(self)

    _BaseConfig.__post_init__ = __post_init__


_bf16_only_where_supported()


class _TestTimeout(Exception):
    pass


def _timed_out(signum, frame):
    raise _TestTimeout(f"test exceeded TRL_CONFORMANCE_TEST_TIMEOUT={os.environ.get('TRL_CONFORMANCE_TEST_TIMEOUT')}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    seconds = int(os.environ.get("TRL_CONFORMANCE_TEST_TIMEOUT", "300"))
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
