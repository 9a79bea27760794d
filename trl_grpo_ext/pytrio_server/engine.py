"""The model side of the local PyTRIO server: one transformers model, one PEFT LoRA adapter per training run.

`ModelEngine` loads the model once and serves every training run and sampler on it. Its parts, one module each:
`adapters` (LoRA adapters per run and sampler slots, `LoraSnapshot`), `forward` (forward / forward_backward on
right-padded batches, prefix-shared through `trl_grpo_ext.prefix`) and `decoding` (sampling, decode batches). This
module holds what ties them: the model, the locks, the training runs and their optimizer steps.
PEFT's active adapter is state of the model object, so each use of a model object holds its lock. Sampling has a
model object of its own over the same weights (`for_sampling`, `model_sides`), so it runs while training holds the
other; with ``concurrent_sampling=False`` one object and one lock serve both.
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings

import torch

from trl_grpo_ext.compat import cache_keyword
from trl_grpo_ext.cpu.precision import bf16_autocast, resolve_precision
from trl_grpo_ext.cpu.threads import govern_cpu_threads
from trl_grpo_ext.prefix import packed_unsupported_reason
from trl_grpo_ext.pytrio_server.adapters import LoraAdapters, LoraSettings, LoraSnapshot, TrainingRun
from trl_grpo_ext.pytrio_server.base_model import served_base
from trl_grpo_ext.pytrio_server.decoding import SampleSpec, Sampling, default_stop_ids
from trl_grpo_ext.pytrio_server.errors import EngineError
from trl_grpo_ext.pytrio_server.forward import MIN_SHARED_PREFIX, ForwardBackward
from trl_grpo_ext.pytrio_server.images import ImageInputs, is_image_text, load_image_processor
from trl_grpo_ext.pytrio_server.logprobs import LOGIT_CHUNK, TokenLogprobs, checkpointing_exact, split_head_exact
from trl_grpo_ext.pytrio_server.memory import MemoryModel
from trl_grpo_ext.pytrio_server.model_sides import ModelLock, shared_weights_copy, thread_shares
from trl_grpo_ext.pytrio_server.optimizer_state import state_problems
from trl_grpo_ext.pytrio_server.sample_params import SampleLimits, check_spec

logger = logging.getLogger(__name__)


class ModelEngine(LoraAdapters, ForwardBackward, Sampling, TokenLogprobs, ImageInputs):
    """Loads `model_path` once and serves training runs and samplers on it.

    An image-text checkpoint (`images.is_image_text`: a Qwen-VL style ``...ForConditionalGeneration``) is loaded
    with its vision tower and image processor, and takes image chunks (`images`), unless `vision` is false; any
    other model is loaded as a causal LM and takes token chunks only."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str | None = None,
        dtype: str = "float32",
        max_batch_tokens: int = 4096,
        share_prefix: bool = True,
        min_shared_prefix: int = MIN_SHARED_PREFIX,
        checkpoint_tokens: int = 1024,
        bf16: str | bool | None = "auto",
        bf16_sampling: bool = False,
        vision: bool = True,
        concurrent_sampling: bool = True,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        self.model_path = str(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        # compute precision (`trl_grpo_ext.cpu.precision`): with fp32 weights, bf16 autocast in forward/backward where
        # the CPU has bf16 matrix units (auto) or bf16 is forced; the LoRA weights and their Adam state stay fp32.
        # Off the CPU `auto` keeps fp32 (the server's behaviour before).
        self.precision = resolve_precision(bf16, on_cpu=self.device.type == "cpu")
        self.autocast_bf16 = bool(self.precision.bf16) and torch_dtype == torch.float32
        # Sampling (and compute_logprobs, the sampler's numbers) stays fp32 unless `bf16_sampling`: bf16 rounding of
        # a shared decode step would make a request's tokens depend on its batch-mates (padding, batch size), and
        # the advertised guarantee is that they do not. With it, the frozen base linears are stored in bf16 and
        # every forward of the model (sampling, training, a direct call) runs in bf16 autocast.
        self.sample_bf16 = self.autocast_bf16 and bool(bf16_sampling)
        config = AutoConfig.from_pretrained(self.model_path)
        # the vision tower too (AutoModelForCausalLM would load the text part only)
        if vision and is_image_text(config):
            model = AutoModelForImageTextToText.from_pretrained(self.model_path, dtype=torch_dtype)
            self.image_processor = load_image_processor(self.model_path, config)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype)
        # what checkpoints record as their base (`base_model`): the model as loaded, before any cast or LoRA layer
        self.base_model = served_base(self.model_path, model)
        if self.sample_bf16:
            bf16_frozen_linears(model)
        model.to(self.device)
        model.eval()  # no dropout: forward and forward_backward must see the same function
        for p in model.parameters():
            p.requires_grad_(False)
        sampling_tree = shared_weights_copy(model) if concurrent_sampling else None  # before any PEFT layer
        for tree in (model, sampling_tree):
            if tree is not None and self.sample_bf16:
                tree.forward = _in_autocast(tree.forward, self.device.type)
        # on the CPU: fewer threads while other processes are busy (with two sides, their locks share the count)
        governor = govern_cpu_threads(model, hook=sampling_tree is None)
        self.base = model
        # read before PEFT wraps the layers: LoRA-wrapped linears are no longer nn.Linear
        self._linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.peft = None
        self.lock = ModelLock()
        self.runs: dict[str, TrainingRun] = {}
        self._slots: dict[str, str] = {}  # LoRA shape key -> sampler adapter name
        self._slot_content: dict[str, int] = {}  # sampler adapter -> uid of the snapshot loaded in it
        self.stop_ids = default_stop_ids(model, self.tokenizer)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        text_config = model.config.get_text_config()
        self.max_seq_len = int(getattr(text_config, "max_position_embeddings", 0) or 0) or None
        # padded tokens per forward/backward batch: bounds the (batch, length, vocab) logits held for backward
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        # forward/backward: rows sharing >= min_shared_prefix leading tokens encode them once (`forward._plan`)
        self.share_prefix = bool(share_prefix)
        self.min_shared_prefix = max(1, int(min_shared_prefix))
        self.prefix_sharing_reason = packed_unsupported_reason(model)  # None where the packed forward is exact
        self.cache_kw = cache_keyword(model)
        # log-probs from hidden states, the output layer a chunk of positions at a time (`logprobs`), where exact
        self.split_head = split_head_exact(model, self.vocab_size)
        # plain forward/backward chunks above `checkpoint_tokens` padded tokens recompute the layers in backward
        self.can_checkpoint = checkpointing_exact(model)
        self.checkpoint_tokens = max(1, int(checkpoint_tokens))
        self.memory_model = MemoryModel.from_model(model, LOGIT_CHUNK)  # bytes of a request, for admission
        # what sampler snapshots run on: this engine, or its sampling side (`model_sides`)
        self.for_sampling = self if sampling_tree is None else self._sampling_side(sampling_tree, governor)

    def _sampling_side(self, tree: torch.nn.Module, governor) -> ModelEngine:
        """This engine's sampling side: its attributes over `tree` (the same weights), with a lock, PEFT wrapper and
        sampler slots of its own; it trains nothing. On a CPU each side takes its share of the threads
        (`model_sides.thread_shares` of the count at start, or of the governor's while it follows the load)."""
        side = copy.copy(self)
        side.base, side.peft, side.runs, side._slots, side._slot_content = tree, None, {}, {}, {}
        side.for_sampling = side
        if self.device.type != "cpu":
            side.lock = ModelLock()
            logger.info("PyTRIO local server: sampling runs beside training (a lock each; one %s)", self.device)
            return side
        start = torch.get_num_threads()
        total = (lambda: governor.check()) if governor is not None else (lambda: start)
        side.lock = ModelLock(lambda: thread_shares(total())[0])
        self.lock = ModelLock(lambda: thread_shares(total())[1])
        sampling, training = thread_shares(start)
        logger.info(
            "PyTRIO local server: sampling runs beside training, on %d and %d of %d CPU threads%s", sampling,
            training, start, " (fewer while other processes keep cores busy)" if governor is not None else "",
        )  # fmt: skip
        return side

    def _autocast(self):
        return bf16_autocast(self.autocast_bf16, self.device.type)

    def forward(self, *args, **kwargs):
        with self._autocast():
            return super().forward(*args, **kwargs)

    def sample_limits(self, max_num_samples: int = 2**31) -> SampleLimits:
        """What a sample request may ask of this model (the server adds its `max_num_samples`)."""
        return SampleLimits(self.vocab_size, self.max_seq_len, max_num_samples)

    def check_sample(self, spec: SampleSpec) -> SampleSpec:
        """`spec`, or `EngineError` for a request this engine cannot sample (before it joins a batch)."""
        return check_spec(spec, self.sample_limits())

    def check_lengths(self, lengths: list[int]) -> None:
        """`EngineError` for an item longer than the model's context (its positions have no embedding)."""
        longest = max(lengths, default=0)
        if self.max_seq_len and longest > self.max_seq_len:
            raise EngineError(
                "sequence_too_long", f"an item of {longest} tokens exceeds the model's context of {self.max_seq_len}"
            )

    # ---------------------------------------------------------------- training runs
    def create_run(self, run_id: str, lora: LoraSettings, source: LoraSnapshot | None = None, load_optimizer=False):
        with self.lock:
            if run_id in self.runs:
                raise EngineError("run_already_initialized", f"training run {run_id} is already initialized")
            if source is not None and source.lora.shape_key != lora.shape_key:
                raise EngineError("checkpoint_mismatch", f"checkpoint LoRA {source.lora} does not match {lora}")
            adapter = "run_" + run_id.replace("-", "_")
            self._add_adapter(adapter, lora)
            try:
                run = self._new_run(run_id, adapter, lora, source, load_optimizer)
            except Exception:
                self._delete_adapter(adapter)  # a refused source leaves no adapter behind
                raise
            self.runs[run_id] = run
            return run

    def _new_run(self, run_id: str, adapter: str, lora: LoraSettings, source: LoraSnapshot | None, load_optimizer):
        """The `TrainingRun` of the new adapter `adapter`, its weights (and optimizer state) from `source`."""
        if source is not None:
            self._import(adapter, source.weights)
        params = self._adapter_params(adapter)
        for _, p in params:
            p.requires_grad_(False)
        optimizer = torch.optim.AdamW([p for _, p in params], lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        run = TrainingRun(run_id, adapter, lora, params, optimizer)
        if source is not None:
            run.step = source.step
            if load_optimizer:
                if source.optimizer is None:
                    raise EngineError("checkpoint_has_no_optimizer", "checkpoint holds no optimizer state")
                problem = state_problems(source.optimizer, params)
                if problem:
                    raise EngineError("checkpoint_mismatch", f"optimizer state does not fit the adapter: {problem}")
                # a copy: torch keeps same-device tensors as they are, and Adam updates its moments in
                # place, which would otherwise rewrite the checkpoint for the next run restored from it
                optimizer.load_state_dict(copy.deepcopy(source.optimizer["state_dict"]))
        return run

    def _run(self, run_id: str) -> TrainingRun:
        run = self.runs.get(run_id)
        if run is None:
            raise EngineError("run_not_initialized", f"training run {run_id} has no initialized trainer")
        return run

    def snapshot(self, run_id: str, with_optimizer: bool) -> LoraSnapshot:
        with self.lock:
            run = self._run(run_id)
            optimizer = None
            if with_optimizer:
                optimizer = {
                    "state_dict": copy.deepcopy(run.optimizer.state_dict()),
                    "param_names": [n for n, _ in run.params],
                }
            return LoraSnapshot(run.lora, self._export(run.adapter), optimizer, run.step)

    def optim_step(self, run_id: str, adam: dict) -> dict[str, float]:
        with self.lock:
            run = self._run(run_id)
            params = [p for _, p in run.params]
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
            clip = float(adam.get("grad_clip_norm", 0.0))
            if clip > 0 and grads:
                torch.nn.utils.clip_grad_norm_(params, clip)
            for group in run.optimizer.param_groups:
                group["lr"] = float(adam["learning_rate"])
                group["betas"] = (float(adam["beta1"]), float(adam["beta2"]))
                group["eps"] = float(adam["eps"])
                group["weight_decay"] = float(adam["weight_decay"])
            if grads:
                run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.step += 1
            tokens, run.pending_tokens = run.pending_tokens, 0
            return {
                "grad_norm": grad_norm,
                "learning_rate": float(adam["learning_rate"]),
                "step": float(run.step),
                "train_tokens": float(tokens),
            }

    def drop_run(self, run_id: str) -> None:
        with self.lock:
            run = self.runs.pop(run_id, None)
            if run is not None and self.peft is not None:
                self._delete_adapter(run.adapter)

    def _delete_adapter(self, adapter: str) -> None:
        with warnings.catch_warnings():  # PEFT warns when the deleted adapter was the active one
            warnings.simplefilter("ignore", UserWarning)
            self.peft.delete_adapter(adapter)


def _in_autocast(forward, device_type: str):
    """`forward` in bf16 autocast: a model whose frozen linears are stored in bf16 computes in autocast whoever
    calls it (fp32 activations would meet bf16 weights outside it)."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with bf16_autocast(True, device_type):
            return forward(*args, **kwargs)

    return wrapped


def bf16_frozen_linears(model) -> None:
    """The frozen base model's linear weights in bf16, before PEFT wraps them: bf16 autocast would cast them to
    exactly these values at every call (autocast caches casts of trainable weights only), so this is the same
    computation without the per-call cast, in half the memory. A weight tied to the input embeddings (the output
    layer of SmolLM2) stays fp32: the embedding lookup is not autocast."""
    tied = model.get_input_embeddings().weight
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not tied:
            module.weight.data = module.weight.data.to(torch.bfloat16)
            if module.bias is not None:
                module.bias.data = module.bias.data.to(torch.bfloat16)
