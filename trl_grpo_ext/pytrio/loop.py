"""GRPO on the PyTRIO client: rollouts, rewards and advantages here; forward/backward, optimizer and sampling remote.

One optimizer step (`GRPOLoop.train_step`), phase by phase, each in its own module:

1. sample (`sampling`): ``save_weights_and_get_sampling_client()`` (the sampler holds the current weights, the
   "old" policy), then ``sample(prompt, num_samples=num_generations)`` per prompt, submitted (``mode: async``: all
   at once) and collected into `types.Rollout`s; with ``environments``, first turns continued through their tool
   calls;
2. score (`scoring`): rewards (`trl_grpo_ext.task.rewards`, aggregated by `trl_grpo_ext.grpo.reward_aggregation`
   as the TRL path does), group advantages (`trl_grpo_ext.grpo.losses.group_advantages`); with dynamic sampling,
   more rounds of 1 and 2 until `GroupFilter` has the step's groups (`GRPOLoop.sample_and_score`); with
   ``distillation``, the teacher's per-token advantages (`teacher`);
3. build batch (`batch.build_train_batch`): one `Datum` per completion (`datums`);
4. step (`optim.optimizer_step`): ``forward_backward(datums, loss_type)`` for the service's built-in
   ``importance_sampling`` / ``ppo``, or ``forward_backward_custom`` with the local loss (`loss`) for ``cispo`` and
   the other losses, then ``optim_step(AdamParams(...))``;
5. log (`metrics.step_metrics`): one row of ``metrics.jsonl`` (and SwanLab).

Around the steps (`GRPOLoop.run`): every ``save_every`` steps a checkpoint (`checkpoints`: weights + optimizer
remotely, `trl_grpo_ext.runs.loop_state` locally); ``resume: true`` continues from there. A service that stops
answering (or restarts and forgets the run) is retried for ``server_retry_budget_s``, saying so
(`connection.ServiceOutage`); once it answers, the loop reconnects and continues from the last saved state, as
``resume: true`` would.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path

from trl_grpo_ext.environments.chat import use_tool_chat_template
from trl_grpo_ext.grpo.async_sampling import asynchronous, sampling_mode
from trl_grpo_ext.grpo.curriculum import CurriculumPromptStream, curriculum_from_tasks
from trl_grpo_ext.grpo.distillation import distillation_of
from trl_grpo_ext.grpo.dynamic_sampling import GroupFilter
from trl_grpo_ext.grpo.loss_table import print_loss_type_notice
from trl_grpo_ext.interrupts import GracefulStop
from trl_grpo_ext.models import check_local_model, is_embedded
from trl_grpo_ext.pytrio import connection
from trl_grpo_ext.pytrio.batch import build_train_batch
from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.checkpoints import save_checkpoint, save_final_weights, start_training_client
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.connection import LOCAL_SERVER_NAME, ServiceLost, ServiceOutage, install_log_redaction, redact
from trl_grpo_ext.pytrio.lookahead import SampleAhead
from trl_grpo_ext.pytrio.metrics import averaged, round_metrics, step_metrics
from trl_grpo_ext.pytrio.optim import optimizer_step
from trl_grpo_ext.pytrio.prompts import PromptStream, PromptTokens, environment_tool_methods, load_tokenizer
from trl_grpo_ext.pytrio.rows import load_train_rows
from trl_grpo_ext.pytrio.run_folder import kept_checkpoint, open_run_folder, output_errors
from trl_grpo_ext.pytrio.sampling import ToolTurns, collect_samples, sampling_client, submit_samples
from trl_grpo_ext.pytrio.scoring import curriculum_outcomes, kept_groups, reward_setup, score_rollouts
from trl_grpo_ext.pytrio.teacher import Teacher, local_sampling_models
from trl_grpo_ext.pytrio.types import ScoredBatch, StepTimes
from trl_grpo_ext.runs import METRICS_FILENAME, PYTRIO_SERVER_DIRNAME
from trl_grpo_ext.runs.loop_state import LoopState, check_resumable, load_loop_state
from trl_grpo_ext.runs.metrics import RunLogger
from trl_grpo_ext.task.data.prompts import use_chat_prompts
from trl_grpo_ext.task.rewards import preflight_rewards, reward_functions

logger = logging.getLogger(__name__)

# pytrio's own retries of a service that does not answer, per call, before the loop's (which say so) take over
PYTRIO_RETRY_WINDOW_S = 5.0


class GRPOLoop:
    """Runs `PyTrioGRPOConfig` against a `pytrio.ServiceClient` (created from pytrio's configuration if not given).

    ``rows``: training rows, each with a ``prompt`` (chat messages or text) plus the columns the reward
    functions read (``answer``); None loads them from the config's dataset.
    """

    def __init__(
        self,
        config: PyTrioGRPOConfig,
        service_client=None,
        rows: list[dict] | None = None,
        tokenizer=None,
    ):
        self.config = config
        self._service = service_client
        self._rows = rows
        self._rows_chat: bool | None = None  # how `_load_rows` built the prompts (None: rows given, kept as they are)
        self._tokenizer = tokenizer
        self.curriculum = None  # `trl_grpo_ext.grpo.curriculum.Curriculum` with ``curriculum: true`` (`prepare`)
        self._checked: tuple[LoopState | None] | None = None  # (resume state,) once `check_inputs` has passed
        # else `_service_client` makes one, and a new one after an outage
        self._given_service = service_client is not None
        spec = distillation_of(config)
        self.teacher = Teacher(config, spec, self._service_client) if spec is not None else None
        self.ahead: SampleAhead | None = None  # asynchronous sampling's batches in flight (`_train` sets it)
        self.extra_stream: PromptStream | None = None  # dynamic sampling's extra rounds' prompts (`prepare`)

    # --- setup -------------------------------------------------------------------------------------------------

    def _service_client(self):
        if self._service is None:
            window = min(PYTRIO_RETRY_WINDOW_S, self.config.server_retry_budget_s)
            self._service = connection.create_service_client(retry_window_s=window)
        return self._service

    def _drop_service(self) -> bool:
        """Release the service client this loop created (its service was lost); False if the loop was given one."""
        if self._given_service:
            return False
        if self._service is not None:
            connection.close_service_client(self._service)
        self._service = None
        if self.teacher is not None:
            self.teacher.drop()  # its client belonged to the lost service
        return True

    def _load_rows(self, chat: bool | None = None) -> list[dict]:
        """The training rows, loaded once: `check_inputs` checks them before the tokenizer is known (chat prompts
        unless ``prompt_format: text``); `prepare` passes the format the tokenizer decides (`use_chat_prompts`), and
        rows built the other way (``auto`` with a tokenizer without a chat template) are built again as text."""
        if self._rows is not None and (chat is None or self._rows_chat in (None, chat)):
            return self._rows
        chat = self.config.prompt_format != "text" if chat is None else chat
        self._rows, self._rows_chat = load_train_rows(self.config, chat=chat), chat
        return self._rows

    def prepare(
        self,
        training_client,
        data_position: int = 0,
        curriculum_state: dict | None = None,
        extra_data_position: int = 0,
    ) -> PromptStream:
        """Tokenizer, reward functions and the prompt stream for ``training_client`` (`run` calls it; so do benches
        that drive `train_step` themselves), and dynamic sampling's second stream (``extra_stream``: another seed,
        as the TRL path's). ``curriculum_state``: a resumed run's saved pass rates."""
        c = self.config
        self.tokenizer = self._tokenizer if self._tokenizer is not None else load_tokenizer(c, training_client)
        tools = {}
        self.tool_turns = None
        if c.environments:  # tools: a template that renders them, each environment's tools for prompts
            use_tool_chat_template(self.tokenizer)
            tools = environment_tool_methods(c)
            self.tool_turns = ToolTurns(c, self.tokenizer, tools)
        self.prompts = PromptTokens(c, self.tokenizer, tools)
        self.rewards = reward_setup(c, self.tokenizer)
        if self.teacher is not None:  # a service without the teacher fails here, before the first step
            self.teacher.check_tokenizer(self.tokenizer)
        rows = self._load_rows(chat=use_chat_prompts(c.prompt_format, self.tokenizer))
        if c.curriculum:
            self.curriculum = curriculum_from_tasks(
                [row.get("task") for row in rows], ema=c.curriculum_ema, floor=c.curriculum_floor
            )
            if curriculum_state is not None:
                self.curriculum.load_state_dict(curriculum_state)
            self.extra_stream = CurriculumPromptStream(rows, self.curriculum, c.seed + 1, extra_data_position)
            return CurriculumPromptStream(rows, self.curriculum, c.seed, data_position)
        self.extra_stream = PromptStream(rows, c.seed + 1, extra_data_position)
        return PromptStream(rows, c.seed, data_position)

    # --- one step: sample -> score -> build batch -> step -> log -------------------------------------------------

    def sample_and_score(self, training_client, stream: PromptStream, step: int, times: StepTimes):
        """The step's rollouts, scored: ``prompts_per_step`` rows from the stream, ``num_generations`` each; with
        ``dynamic_sampling``, more rounds until `GroupFilter` has the step's informative groups (or its budget is
        spent). Returns ``(batch to train on, sampling metrics)``: the metrics average each round's, as TRL's
        logging averages each generation batch's."""
        c = self.config
        sampler = sampling_client(training_client, times)
        groups = GroupFilter(c.prompts_per_step, c.max_generation_batches) if c.dynamic_sampling else None
        batches, metrics = [], []
        while True:
            if not batches and self.ahead is not None and self._ahead_round(sampler, stream, step):
                batches.append(self._drawn_round(sampler, step, times))
            else:
                # dynamic sampling's extra rounds take their prompts from a stream of their own (the TRL path's
                # rule), so the step's own batches follow the data order whether they were drawn ahead or not
                rows = (self.extra_stream if batches else stream).take(c.prompts_per_step)
                first = len(batches) * c.prompts_per_step  # each round's prompts get their own sampling seeds
                batches.append(self._sample_round(sampler, rows, step, first, times))
            metrics.append(self._round_metrics(batches[-1]))
            if groups is None:
                return self._counted(batches[0], step), metrics[0]
            groups.add(batches[-1].degenerate)
            if groups.done:
                break
        step_sampling = averaged(metrics)
        step_sampling.update(groups.metrics())  # frac_degenerate after the filter
        return self._counted(kept_groups(batches, groups.selection(), c.num_generations), step), step_sampling

    def _counted(self, scored: ScoredBatch, step: int) -> ScoredBatch:
        """`scored`, the batch the step trains, its staleness counted (asynchronous sampling; rounds drawn by the
        step's own weights: 0)."""
        if self.ahead is not None:
            for stale, rows in collections.Counter(scored.staleness or [0] * len(scored.rollouts)).items():
                self.ahead.lookahead.trained(step - stale, step, rows)
        return scored

    def _sample_round(self, sampler, rows: list[dict], step: int, first_index: int, times: StepTimes) -> ScoredBatch:
        """One round: ``rows`` sampled (submitted, then collected) and scored."""
        prompt_tokens = [self.prompts(row) for row in rows]
        t0 = time.perf_counter()
        pending = submit_samples(self.config, sampler, rows, prompt_tokens, step, first_index)
        rollouts = collect_samples(self.config, pending, self.tool_turns)
        times.sampling += time.perf_counter() - t0
        t0 = time.perf_counter()
        scored = score_rollouts(self.config, self.rewards, rows, rollouts)
        times.rewards += time.perf_counter() - t0
        return scored

    def _ahead_round(self, sampler, stream: PromptStream, step: int) -> bool:
        """Asynchronous sampling: the batches `sampler` (version `step`) may draw requested ahead; whether this step's
        first round was (a resumed run trains the batches its checkpoint kept, also where it samples on-policy)."""
        if asynchronous(self.config):
            self.ahead.request(sampler, step, stream, self.config.max_steps)
        return self.ahead.has(step)

    def _drawn_round(self, sampler, step: int, times: StepTimes) -> ScoredBatch:
        """The step's first round from the batch requested for it ahead (waited for), scored."""
        t0 = time.perf_counter()
        rows, rollouts, version = self.ahead.take(step, sampler, step)
        times.sampling += time.perf_counter() - t0
        t0 = time.perf_counter()
        scored = score_rollouts(self.config, self.rewards, rows, rollouts)
        scored.staleness = [step - version] * len(rollouts)
        times.rewards += time.perf_counter() - t0
        return scored

    def _round_metrics(self, scored: ScoredBatch) -> dict:
        """A round's metrics; with the curriculum, its update from the round and its weights."""
        metrics = round_metrics(self.config, scored, self.rewards.names)
        if self.curriculum is not None:
            self.curriculum.update(*curriculum_outcomes(self.config, scored))
            metrics.update(self.curriculum.metrics())
        return metrics

    def train_step(self, training_client, stream: PromptStream, step: int) -> dict:
        """One GRPO step (0-based ``step``): sample -> score -> build datums -> step -> metrics; returns its metrics."""
        times = StepTimes()
        t_step, step_started = time.perf_counter(), time.monotonic()
        scored, sampling_metrics = self.sample_and_score(training_client, stream, step, times)
        if self.teacher is not None:
            sampling_metrics = {**sampling_metrics, **self.teacher.distill(scored)}
        batch = build_train_batch(self.config, scored, step)
        learning_rate = self.config.learning_rate_at(step)
        loss_metrics, optim_metrics = optimizer_step(self.config, training_client, batch, learning_rate, times)
        step_time = time.perf_counter() - t_step
        metrics = step_metrics(sampling_metrics, loss_metrics, batch, learning_rate, optim_metrics, step_time, times)
        if asynchronous(self.config):
            metrics.update(self.ahead.step_metrics(step_started, times.save_weights))
        return metrics

    # --- entry point ---------------------------------------------------------------------------------------------

    def check_inputs(self) -> LoopState | None:
        """Check everything bad input can break before a model loads or a file is written: the data (loaded and
        kept), the reward names, the local server's model path, and a resume's recorded state against this config.
        Raises ValueError / FileNotFoundError with one line; returns the state to resume from (None: fresh run)."""
        if self._checked is not None:
            return self._checked[0]
        c = self.config
        print_loss_type_notice(c)  # our cispo is not TRL's: say which one runs, first
        # unknown names, bad reward options, a reward model that is no classifier, a judge that does not answer
        preflight_rewards(reward_functions(c.reward_funcs, c, settings=c))
        self._load_rows()
        if c.pytrio_base_url == LOCAL_SERVER_NAME:
            for model in (c.base_model, *local_sampling_models(c)):
                if not is_embedded(model):
                    check_local_model(model)  # a local-looking path that is not a model folder
        previous = load_loop_state(c.output_dir) if c.resume else None
        if c.resume and previous is None:
            logger.warning("resume: no loop state in %s; starting from step 0", c.output_dir)
        if previous is not None:
            check_resumable(previous, c)
        self._checked = (previous,)
        return previous

    def run(self) -> dict:
        """Train to ``max_steps`` (or resume to it); returns a summary with the final sampler weights' path.

        A service that stops answering or forgets the run is retried for ``server_retry_budget_s``
        (`connection.ServiceOutage` says so); once it answers, a new client continues from the last saved loop
        state, as ``resume: true`` would: the rows logged after that checkpoint are dropped and their steps run
        again, so every step is logged once."""
        install_log_redaction()
        c = self.config
        out = Path(c.output_dir)
        # Before the first write to the run folder (config.yaml, then the metrics truncation below): a failing
        # rerun leaves the previous run's files as they were.
        state = self.check_inputs()
        self._checked = None  # a later run() reads the loop state again
        outage = ServiceOutage(connection.current_base_url(), c.server_retry_budget_s)
        sink = None
        try:
            while True:
                try:
                    restored = state is not None
                    training_client, state = start_training_client(self._service_client(), c, state)
                    if restored:
                        logger.info("resumed at step %d from %s", state.step, state.state_path)
                    stream = self.prepare(
                        training_client, state.data_position, state.curriculum, state.extra_data_position
                    )
                    if sink is None:
                        sink = open_run_folder(c, out)
                    # A resumed run drops the rows logged after its checkpoint (those steps run again); a fresh one
                    # starts empty.
                    with output_errors(out, METRICS_FILENAME):
                        sink.start(state.step)
                    return self._train(training_client, stream, state, sink, outage)
                except ServiceLost as error:
                    if not self._drop_service():  # a client we were given: we cannot make another
                        raise
                    if not outage.wait(error):
                        raise _gave_up(outage, error, out) from None
                    state = load_loop_state(out)  # the last saved state (None: nothing saved, start over)
                    if state is not None:
                        check_resumable(state, c)
        finally:
            if sink is not None:
                sink.close()

    def _checkpoint(self, training_client, state: LoopState, stream: PromptStream, step_done: int) -> None:
        curriculum = self.curriculum.state_dict() if self.curriculum is not None else None
        # the batches drawn ahead, whose prompts the stream's position has passed: kept for the resumed run
        state.ahead = self.ahead.saved() if self.ahead is not None else []
        save_checkpoint(
            self.config, training_client, state, step_done, stream.position, curriculum, self.extra_stream.position
        )

    def _train(self, training_client, stream: PromptStream, state: LoopState, sink: RunLogger, outage) -> dict:
        """Steps ``state.step`` to ``max_steps``, the final checkpoint and sampler weights; returns the summary. Ctrl-C
        stops after the step being trained, with a checkpoint there (`trl_grpo_ext.interrupts.GracefulStop`)."""
        c = self.config
        self.ahead = None
        if asynchronous(c) or state.ahead:
            self.ahead = SampleAhead(c, self.prompts, start=state.step, saved=state.ahead)
        logger.info("sampling: %s", sampling_mode(c))  # as the TRL recipe's startup line
        with GracefulStop("stopping after this step with a checkpoint (resume: true continues it)") as stop:
            return self._steps(training_client, stream, state, sink, outage, stop)

    def _steps(self, training_client, stream, state: LoopState, sink: RunLogger, outage, stop) -> dict:
        c = self.config
        out = Path(c.output_dir)
        for step in range(state.step, c.max_steps):
            metrics = self.train_step(training_client, stream, step)
            step_done = step + 1
            # Logged before the checkpoint: a kill in between re-runs this step and the resume drops the row.
            with output_errors(out, METRICS_FILENAME):
                sink.log(step_done, metrics)
            logger.info(
                "step %d/%d reward=%.3f loss=%s step_time=%.2fs",
                step_done,
                c.max_steps,
                metrics["reward"],
                metrics.get("loss"),
                metrics["step_time"],
            )
            if stop.requested and step_done < c.max_steps:  # Ctrl-C: a checkpoint here, then stop
                self._checkpoint(training_client, state, stream, step_done)
                return {
                    "steps": state.step,
                    "state_path": state.state_path,
                    "stopped": "Ctrl-C",
                    "output_dir": str(out),
                }
            if c.save_every and step_done % c.save_every == 0 and step_done < c.max_steps:
                self._checkpoint(training_client, state, stream, step_done)
            outage.over()

        if state.step < c.max_steps:
            self._checkpoint(training_client, state, stream, c.max_steps)
        save_final_weights(c, training_client, state)
        return {
            "steps": state.step,
            "state_path": state.state_path,
            "sampler_path": state.sampler_path,
            "sampling_mode": sampling_mode(c),
            "output_dir": str(out),
        }


def _gave_up(outage: ServiceOutage, error: BaseException, out: Path) -> PyTrioLoopError:
    last = " ".join(redact(error).split())  # one line, whatever the client's message looked like
    return PyTrioLoopError(
        f"the PyTRIO service at {outage.base_url} did not answer for {outage.elapsed():.0f} s "
        f"(server_retry_budget_s={outage.budget_s:g}); stopped, {kept_checkpoint(out)}: rerun with resume: true "
        f"once it is back. Last error: {last}"
    )


def run_from_config(config: PyTrioGRPOConfig, loop: GRPOLoop | None = None, **kwargs) -> dict:
    """Connect as ``pytrio_base_url`` says (``local``: start the local server first) and train ``loop`` (default:
    ``GRPOLoop(config, **kwargs)``). Its inputs are checked before the local server loads the model."""
    install_log_redaction()
    loop = loop or GRPOLoop(config, **kwargs)
    loop.check_inputs()
    if config.pytrio_base_url == LOCAL_SERVER_NAME:
        # Checkpoints live beside the run, so a resumed run's fresh server finds the earlier process's states. The
        # recipe is the operator of its own server: it keeps the newest 3 of each kind per run (and always what its
        # loop state resumes from), as it did before the server's default became keeping everything, and sums the
        # loss over tokens (`build_train_batch` normalises the advantages itself). A distillation teacher other than
        # the base model is served beside it for sampling and log-probs.
        storage = str(Path(config.output_dir) / PYTRIO_SERVER_DIRNAME)
        options = {"storage_dir": storage, "keep_checkpoints": 3, "loss_normalization": "sum"}
        options["sampling_models"] = local_sampling_models(config)
        with connection.local_server(config.base_model, **options) as server:
            connection.configure_client(base_url=server.base_url, api_key=server.api_key)
            return loop.run()
    if config.pytrio_base_url:
        connection.configure_client(base_url=config.pytrio_base_url)
    return loop.run()
