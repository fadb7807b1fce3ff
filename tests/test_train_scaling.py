"""The trainer's scale-out switches, through ``train()``: activation checkpointing gives the
losses and gradient norms of the run without it, ``--compile`` those of eager, alone and with
full checkpointing (slow: inductor compiles on CPU), selective checkpointing of compiled blocks
and unknown modes are refused in one line, and the model
the trainer places is the single-process initialisation for the seed (built on the meta
device, materialised after placement)."""

import pytest

from moe.model import MoETransformer
from moe.training import TrainConfig, train
from moe.training.build import model_config
from moe.training.cli import main

SMALL = dict(
    steps=4,
    seq_len=32,
    batch_size=4,
    max_bytes=200_000,
    eval_windows=2,
    eval_batch_size=2,
    causal_stride=16,
    warmup_steps=1,
    log_every=0,
    progress=False,
    eval_every=0,
    model={"d_model": 32, "moe_d_ff": 64},
)
KEYS = ("loss", "aux_loss", "grad_norm")


def curves(**options) -> list[tuple[float, ...]]:
    return [tuple(r[k] for k in KEYS) for r in train(TrainConfig.flat(**SMALL, **options)).history]


def assert_curves_close(got, want, rel: float, what: str) -> None:
    assert len(got) == len(want) == SMALL["steps"]
    for step, (g, w) in enumerate(zip(got, want), 1):
        for key, a, b in zip(KEYS, g, w):
            assert abs(a - b) <= rel * abs(b), f"{what}: step {step} {key} {a!r} vs {b!r}"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_losses_and_gradients_of_the_plain_run(mode):
    options = dict(router_options={"balance_rate": 0.01})  # router state updated in the forward
    assert_curves_close(curves(activation_checkpointing=mode, **options), curves(**options), 1e-6, mode)


@pytest.mark.slow
def test_compiled_blocks_give_the_losses_of_eager():
    # fp32 sums in another order (all experts at once, fused kernels): well below 1e-5
    assert_curves_close(curves(compile=True), curves(), 1e-5, "compiled")


@pytest.mark.slow
def test_compiled_and_checkpointed_blocks_give_the_losses_of_eager():
    options = dict(router_options={"balance_rate": 0.01})  # router state updated in the forward
    got = curves(compile=True, activation_checkpointing="full", **options)
    assert_curves_close(got, curves(**options), 1e-5, "compiled + full checkpointing")


def test_the_placed_model_is_the_single_process_initialisation():
    res = train(TrainConfig.flat(**{**SMALL, "steps": 1}, lr=1e-12, weight_decay=0.0, grad_clip=0.0))
    want = MoETransformer(model_config(TrainConfig.flat(**SMALL).model, 256), init_seed=0)
    for (name, got), ref in zip(res.model.state_dict().items(), want.state_dict().values()):
        d = (got - ref).abs().max()
        assert d < 1e-9, f"{name}: max {d:.3e} (one step at lr 1e-12 moves a weight by about 1e-12)"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--compile", "--activation-checkpointing", "selective"],
            "use activation_checkpointing full with compile",
        ),
        (
            ["--activation-checkpointing", "some"],
            "activation_checkpointing must be one of none, full, selective, got 'some'",
        ),
    ],
)
def test_bad_combinations_are_one_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "1", "--no-progress", "--wandb-mode", "disabled", *args])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.count("\n") == 0 and message in err, err
