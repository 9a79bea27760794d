"""On-policy distillation's teacher on the PyTRIO path: a second sampling client (``create_sampling_client`` with
the teacher's base model and checkpoint), its tokenizer checked against the student's, and its log-probs of every
sampled completion made per-token advantages by `trl_grpo_ext.grpo.distillation` (`Teacher.distill`, the phase
between score and build batch)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trl_grpo_ext.grpo.distillation import DistillationSpec, distillation_of, tokenizer_mismatch
from trl_grpo_ext.pytrio.calls import PyTrioLoopError, call
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.connection import redact
from trl_grpo_ext.pytrio.logprobs import completion_logprobs
from trl_grpo_ext.pytrio.types import ScoredBatch

logger = logging.getLogger(__name__)


def local_sampling_models(config: PyTrioGRPOConfig) -> tuple[str, ...]:
    """The base models the local server serves besides ``base_model``: a distillation teacher that is another
    model (a teacher checkpoint, ``teacher_model_path``, is an adapter of ``base_model`` and needs none)."""
    spec = distillation_of(config)
    if spec is None or spec.teacher_model_path or spec.teacher == config.base_model:
        return ()
    return (spec.teacher,)


class Teacher:
    """The teacher of a ``distillation`` block. ``service_client``: the loop's current service client (a new one
    after an outage, when `drop` has let the old teacher client go)."""

    def __init__(self, config: PyTrioGRPOConfig, spec: DistillationSpec, service_client: Callable[[], object]):
        self.config = config
        self.spec = spec
        self._service_client = service_client
        self._client = None

    def client(self):
        """The teacher's sampling client: ``create_sampling_client(base_model=teacher, model_path=...)``."""
        if self._client is None:
            spec = self.spec
            self._client = call(
                self._service_client().create_sampling_client,
                f"create_sampling_client (teacher {spec.teacher!r})",
                base_model=spec.teacher,
                model_path=spec.teacher_model_path,
            )
        return self._client

    def drop(self) -> None:
        """Forget the client: it belonged to a service that was lost."""
        self._client = None

    def check_tokenizer(self, student_tokenizer) -> None:
        """The teacher's tokenizer (its sampling client's ``get_tokenizer``) against the student's: one line naming
        both when they differ. A teacher whose tokenizer cannot be loaded here is trusted, with a warning."""
        teacher = self.client()  # a service without the teacher fails here, before the first step
        try:
            teacher_tokenizer = teacher.get_tokenizer()
        except Exception as error:  # noqa: BLE001 - e.g. a hosted model's tokenizer while offline
            logger.warning("distillation: the teacher's tokenizer could not be loaded to compare with the student's "
                           "(%s: %s); they must be the same", type(error).__name__, redact(error))  # fmt: skip
            return
        mismatch = tokenizer_mismatch(teacher_tokenizer, student_tokenizer, self.spec.teacher, self.config.base_model)
        if mismatch:
            raise PyTrioLoopError(mismatch)

    def distill(self, scored: ScoredBatch) -> dict:
        """The teacher's log-probs of every sampled completion (``compute_logprobs`` on prompt + completion), made
        per-token advantages by `trl_grpo_ext.grpo.distillation` (the student's log-probs: the sampler's); sets
        ``scored.token_advantages`` and returns the ``distill/*`` metrics."""
        from trl_grpo_ext.grpo.distillation import distillation_row_advantages  # torch: first step

        t0 = time.perf_counter()
        c = self.config
        teacher_logps = completion_logprobs(
            self.client(), scored.rollouts, "teacher", c.request_timeout_s, c.mode == "async"
        )
        student = [list(r.completion_logprobs) for r in scored.rollouts]
        scored.token_advantages, metrics = distillation_row_advantages(
            student, teacher_logps, self.spec, scored.advantages
        )
        metrics["time/teacher_logprobs"] = time.perf_counter() - t0
        return metrics
