"""How the trainer's weights reach an asynchronous sampler: one interface, a backend per kind of sampler.

`WeightTransfer` plays the role of TRL 1.16's ``WeightTransferProtocol`` (``experimental/async_grpo``) for this
package's asynchronous sampling (`trl_grpo_ext.trl.async_sampling`), with the version bookkeeping the staleness
bound needs: the trainer *publishes* each version of its weights when an optimizer step has made it (``publish``)
and says when it is about to change them (``before_update``); the sampler asks for the version a batch must be drawn
with (``acquire``), which may be older than the trainer's by up to ``max_staleness`` steps.

`InProcessWeights`: the sampler is a copy of the policy in the trainer's process (the CPU default, transformers'
``generate`` in a thread of its own). Versions are handed over copy-on-write: the sampler copies the trainer's
trainable parameters itself, on its own cores, while the trainer's forward and backward only read them; the trainer
copies them aside (``before_update``) only when the optimizer is about to overwrite a version the sampler has been
asked for and not yet taken. At ``sample_ahead: 1`` the sampler is idle when a version appears (the batch it drew
last is the one the trainer is training on), so the trainer copies only if it ends its step before the sampler has
started the next batch. Drawing further ahead, a sampler behind the trainer may still owe batches of several older
versions (at ``sample_ahead: 4`` the first five batches are drawn with version 0, the next with 1, 2, ... while the
trainer moves on): each such version is kept aside until the sampler has taken it, at most ``sample_ahead - 1``
copies of the trainable parameters. A sampler that leaves a version it still owes batches of (an urgent batch of the
current weights drawn first) copies it aside itself before loading the other.

A vLLM server's weights are handed over by the trainer itself between two of the sampler's requests
(`ServerWeights`: TRL's own sync, NCCL on GPUs, a /dev/shm file that the CPU server reloads otherwise,
`trl_grpo_ext.trl.vllm_cpu`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import torch


class WeightTransferError(RuntimeError):
    """A hand-over of weights failed or did not come in time; the message says which version and why."""


class WeightTransfer(Protocol):
    def expect(self, version: int) -> None:
        """A batch was requested that must be drawn with `version` (called by the trainer, at the request)."""

    def publish(self, version: int) -> None:
        """The trainer's weights are now `version` (called by the trainer between optimizer steps)."""

    def before_update(self) -> None:
        """The trainer is about to change its weights (called right before the optimizer step)."""

    def acquire(self, version: int, timeout_s: float) -> tuple[float, float]:
        """Make `version` the sampler's weights (called by the sampler before a batch); returns (seconds waited for
        the version to be published, seconds spent handing it over)."""

    def close(self) -> None:
        """Release what the transfer holds; a sampler waiting in ``acquire`` stops with an error."""


class InProcessWeights:
    """`WeightTransfer` to a sampler model in this process: copy-on-write hand-over of the trainable parameters.

    ``trainer_params`` and ``sampler_params`` pair each trainable parameter of the trainer's model with the same
    parameter of the sampler's copy (frozen parameters never change, so they are never copied)."""

    def __init__(self, trainer_params: list[torch.Tensor], sampler_params: list[torch.Tensor], version: int = 0):
        if len(trainer_params) != len(sampler_params):
            raise ValueError(f"{len(trainer_params)} trainer parameters for {len(sampler_params)} sampler parameters")
        for a, b in zip(trainer_params, sampler_params, strict=True):
            if a.shape != b.shape:
                raise ValueError(f"parameter shapes differ: trainer {tuple(a.shape)}, sampler {tuple(b.shape)}")
        self._trainer = trainer_params
        self._sampler = sampler_params
        self._cond = threading.Condition()
        self._live: int | None = version  # the version the trainer's parameters hold now (None: being updated)
        self._staged: dict[int, list[torch.Tensor]] = {}  # versions copied aside before an update, until taken
        self._loaded = version  # the sampler's copy starts as the trainer's weights
        self._wanted: Counter[int] = Counter()  # versions of requests the sampler has not taken yet
        self._closed = False
        self.staged_copies = 0  # times the trainer copied a version aside (the cost copy-on-write could not avoid)

    def expect(self, version: int) -> None:
        with self._cond:
            self._wanted[version] += 1

    def publish(self, version: int) -> None:
        with self._cond:
            self._live = version
            self._cond.notify_all()

    def before_update(self) -> None:
        with self._cond:  # the sampler copies under this lock: an update cannot start in the middle of its copy
            live = self._live
            if live is not None and self._wanted[live] and self._loaded != live and live not in self._staged:
                self._staged[live] = [p.detach().clone() for p in self._trainer]
                self.staged_copies += 1
            self._live = None

    def acquire(self, version: int, timeout_s: float) -> tuple[float, float]:
        t0 = time.monotonic()
        with self._cond:
            while not self._closed and self._loaded != version and version not in self._sources():
                if not self._cond.wait(timeout=max(0.0, timeout_s - (time.monotonic() - t0))):
                    if time.monotonic() - t0 >= timeout_s:
                        raise WeightTransferError(
                            f"version {version} of the weights was not published within {timeout_s:g} s "
                            f"(the trainer holds version {self._live})"
                        )
            if self._closed:
                raise WeightTransferError(f"the weight transfer closed while the sampler waited for version {version}")
            waited = time.monotonic() - t0
            t1 = time.monotonic()
            if self._loaded != version:
                still_owed = self._wanted[self._loaded] and self._loaded not in self._staged
                if still_owed and self._loaded != self._live:  # the only copy of it is the sampler's own
                    self._staged[self._loaded] = [p.detach().clone() for p in self._sampler]
                    self.staged_copies += 1
                source = self._trainer if self._live == version else self._staged[version]
                with torch.no_grad():
                    for dst, src in zip(self._sampler, source, strict=True):
                        dst.copy_(src)
                self._loaded = version
            if self._wanted[version]:
                self._wanted[version] -= 1
            # What is no longer wanted will not be asked for again.
            for taken in [v for v in self._staged if not self._wanted[v]]:
                del self._staged[taken]
            return waited, time.monotonic() - t1

    def _sources(self) -> set[int]:
        versions = {self._live} if self._live is not None else set()
        return versions | set(self._staged)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._staged.clear()
            self._cond.notify_all()


class ServerWeights:
    """`WeightTransfer` to a sampling server (vLLM): ``sync()`` pushes the trainer's current weights (TRL's
    ``sync_weights``). The server has one copy of the weights, so the trainer hands a version over itself, when the
    sampler is between requests (`trl_grpo_ext.trl.async_sampling` calls ``publish`` only then); ``acquire`` only
    checks that the version a request names is the one on the server."""

    def __init__(self, sync: Callable[[], None], version: int | None = None):
        self._sync = sync
        self._on_server = version  # None: unknown (the server's own, e.g. a resumed run's base model) until synced
        self._closed = False
        self.sync_seconds = 0.0

    def expect(self, version: int) -> None:
        pass

    def publish(self, version: int) -> None:
        if version == self._on_server:
            return
        t0 = time.monotonic()
        try:
            self._sync()
        except Exception as error:  # noqa: BLE001 - any failure of the hand-over stops the run with its reason
            raise WeightTransferError(
                f"handing version {version} of the weights to the sampling server failed: {type(error).__name__}: "
                f"{error}"
            ) from error
        self._on_server = version
        self.sync_seconds += time.monotonic() - t0

    def before_update(self) -> None:
        pass

    def acquire(self, version: int, timeout_s: float) -> tuple[float, float]:
        if self._closed:
            raise WeightTransferError(f"the weight transfer closed while the sampler waited for version {version}")
        if version != self._on_server:
            raise WeightTransferError(
                f"a batch needs version {version} of the weights but the sampling server holds {self._on_server}"
            )
        return 0.0, 0.0

    def close(self) -> None:
        self._closed = True
