"""moe.eval.evaluate's causal_batch_size: how many sequences are decoded together when the
causal loss is measured. For a batch-pooled router it decides the number (the reference: each
window's prefixes recomputed alone, one forward per prefix); for a batch-invariant one it does
not."""

import pytest
import torch

from moe.eval import EvalConfig, evaluate
from moe.lm import lm_loss
from moe.model import MoETransformer, preset


def tiny(router: str, options: dict) -> MoETransformer:
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_heads=4, moe_d_ff=32, num_experts=4, max_seq_len=24, router=router, router_options=options)
    return MoETransformer(preset("tiny", **cfg)).eval()


def alone_by_hand(model: MoETransformer, val: torch.Tensor, seq_len: int, num_windows: int) -> float:
    """The causal loss of each window decoded alone: for every window and position t, a forward
    of that window's prefix 0..t by itself, the loss of its last position; the mean."""
    from moe.data import eval_offsets, windows

    idx_WT, targets_WT = windows(val, eval_offsets(val.numel(), seq_len, num_windows), seq_len)
    losses = []
    with torch.no_grad():
        for w in range(num_windows):
            for t in range(seq_len):
                logits = model(idx_WT[w : w + 1, : t + 1]).logits[:, -1]
                losses.append(float(lm_loss(logits, targets_WT[w : w + 1, t], reduction="none")))
    return sum(losses) / len(losses)


def test_a_batch_pooled_router_decoded_alone_is_what_each_sequence_alone_gets():
    model = tiny("expert_choice", {"capacity_factor": 0.5, "group": "batch"})
    val = torch.randint(0, 256, (3000,))
    kw = dict(seq_len=12, num_windows=4, batch_size=4)
    alone = evaluate(model, val, causal_batch_size=1, **kw)
    together = evaluate(model, val, **kw)
    assert alone["causal_loss"] == pytest.approx(alone_by_hand(model, val, 12, 4), abs=1e-9)
    assert abs(alone["causal_loss"] - together["causal_loss"]) > 1e-4  # the pool changed the number
    assert alone["teacher_forced_loss"] == together["teacher_forced_loss"]  # the teacher-forced batch is unchanged
    assert alone["leakage_gap"] == pytest.approx(alone["causal_loss"] - alone["teacher_forced_loss"], abs=1e-12)


def test_a_batch_invariant_router_gets_the_same_causal_loss_at_any_decode_batch():
    model = tiny("topk", {"top_k": 2})
    val = torch.randint(0, 256, (3000,))
    kw = dict(seq_len=12, num_windows=5, batch_size=5)
    together = evaluate(model, val, **kw)["causal_loss"]
    for b in (1, 2, 7):
        assert evaluate(model, val, causal_batch_size=b, **kw)["causal_loss"] == pytest.approx(together, abs=1e-6)


def test_causal_batch_size_is_checked():
    with pytest.raises(ValueError, match="causal_batch_size must be a positive integer, got 0"):
        EvalConfig(causal_batch_size=0)
    with pytest.raises(ValueError, match="causal_batch_size must be a positive integer"):
        evaluate(tiny("topk", {}), torch.randint(0, 256, (500,)), 8, 2, causal_batch_size=-1)
