"""`loss_type: cispo` is this package's two-sided CISPO and TRL's one-sided one under `trl.GRPOConfig`: both recipes
say which one runs, at startup, through `grpo.loss_table.print_loss_type_notice`."""

import importlib.util
from pathlib import Path

from trl_grpo_ext.grpo.loss_table import LOSS_TYPES, loss_type_notice, trl_meaning
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cispo_is_the_only_name_trl_gives_another_loss():
    assert {loss.name: trl_meaning(loss.name).name for loss in LOSS_TYPES if trl_meaning(loss.name)} == {
        "cispo": "trl_cispo"
    }


def test_the_notice_names_our_cispo_its_bounds_and_trl_cispo():
    notice = loss_type_notice(PyTrioGRPOConfig(loss_type="cispo", cispo_clip_low=0.5, cispo_clip_high=1.28))
    assert notice.startswith("loss_type cispo: this package's two-sided CISPO")
    assert "[0.5, 1.28]" in notice and "TRL's one-sided cispo" in notice and "loss_type trl_cispo" in notice
    assert loss_type_notice(PyTrioGRPOConfig(loss_type="ppo")) is None


def test_the_trl_recipe_prints_it_before_anything_loads(tmp_path, capsys):
    from trl_grpo_ext.trl.config import GRPOConfig

    main = load("gsm8k_grpo").main
    args = ["--output_dir", str(tmp_path), "--model_name_or_path", str(tmp_path / "no-such-model")]
    assert main(args + ["--loss_type", "cispo", "--cispo_clip_high", "1.28"]) == 2  # fails on the model path, after
    out, err = capsys.readouterr()
    assert "no-such-model" in err
    notice = loss_type_notice(GRPOConfig(str(tmp_path), loss_type="cispo", cispo_clip_high=1.28, use_cpu=True))
    assert notice in out.splitlines() and "[0.0, 1.28]" in notice
    assert main(args + ["--loss_type", "trl_cispo", "--epsilon_high", "1.2"]) == 2
    assert "loss_type" not in capsys.readouterr().out


def test_the_pytrio_loop_prints_it_before_anything_loads(tmp_path, capsys, monkeypatch):
    import trl_grpo_ext.pytrio.connection as connection

    def no_server(*args, **kwargs):
        raise AssertionError("the local server started before the inputs were checked")

    monkeypatch.setattr(connection, "local_server", no_server)
    main = load("gsm8k_pytrio").main
    missing = ["--dataset_name", str(tmp_path / "missing.jsonl")]
    assert main(["--output_dir", str(tmp_path / "run"), "--loss_type", "cispo", *missing]) == 2
    out, err = capsys.readouterr()
    assert "missing.jsonl" in err
    assert loss_type_notice(PyTrioGRPOConfig(loss_type="cispo")) in out.splitlines()
    assert main(["--output_dir", str(tmp_path / "run"), "--loss_type", "importance_sampling", *missing]) == 2
    assert "loss_type" not in capsys.readouterr().out


def test_the_two_cispos_clip_as_their_names_say():
    """Ours clips the ratio on both sides ([cispo_clip_low, cispo_clip_high]); TRL's (`trl_cispo`) only above."""
    import torch

    from trl_grpo_ext.grpo.loss_table import ratio_bounds
    from trl_grpo_ext.grpo.losses import policy_loss
    from trl_grpo_ext.trl.config import GRPOConfig

    ours = PyTrioGRPOConfig(loss_type="cispo", cispo_clip_low=0.5, cispo_clip_high=2.0)
    low, high = ratio_bounds(ours)
    assert (low, high) == (0.5, 2.0)
    # the loss's weight on log p is the clipped ratio, on each side: 0.25 -> 0.5, 4 -> 2
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.25, 4.0]]).log()
    loss, metrics = policy_loss("cispo", logp, old, torch.ones(1), clip_low=low, clip_high=high)
    torch.testing.assert_close(loss, -torch.tensor([[0.5, 2.0]]) * logp)
    assert metrics["clip_low_frac"].item() == 0.5 and metrics["clip_high_frac"].item() == 0.5
    theirs = GRPOConfig(
        output_dir="unused", report_to="none", use_cpu=True, bf16=False, loss_type="trl_cispo", epsilon_high=4.0
    )
    assert ratio_bounds(theirs) == (None, 4.0)  # one-sided: no lower bound
