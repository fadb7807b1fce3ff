"""moe.eval.evaluate against a slow reference written out here: every figure it returns (the
teacher-forced loss at the evaluated positions and at all of them, the causal loss, the leakage
gap and its standard error, the training-mode loss, the global balance) recomputed one window and
one prefix at a time in float64, with the log-softmax taken by hand."""

import math

import pytest
import torch
from helpers import small_lm

from moe.balance import balance_summary
from moe.data import eval_offsets, windows
from moe.eval import evaluate

SEQ_LEN, WINDOWS, STRIDE = 12, 4, 3


def nll(logits_V: torch.Tensor, target: int) -> float:
    """-log softmax(logits)[target] in float64."""
    lg = logits_V.double()
    return float(torch.logsumexp(lg, -1) - lg[target])


@torch.no_grad()
def reference(model, val: torch.Tensor) -> dict:
    """Each window alone: its full forward (teacher-forced, eval and train mode) and, for every
    evaluated position t = k-1, 2k-1, ..., a forward of its prefix 0..t (causal)."""
    idx_WT, targets_WT = windows(val, eval_offsets(val.numel(), SEQ_LEN, WINDOWS), SEQ_LEN)
    pos = list(range(STRIDE - 1, SEQ_LEN, STRIDE))
    tf, tf_all, causal, train, diffs = [], [], [], [], []
    tokens_LE = None
    for w in range(WINDOWS):
        model.eval()
        out = model(idx_WT[w : w + 1])
        counts = torch.stack([torch.bincount(r.expert, minlength=r.num_experts) for r in out.routings])
        tokens_LE = counts if tokens_LE is None else tokens_LE + counts
        tf_all += [nll(out.logits[0, t], int(targets_WT[w, t])) for t in range(SEQ_LEN)]
        for t in pos:
            tf.append(nll(out.logits[0, t], int(targets_WT[w, t])))
            causal.append(nll(model(idx_WT[w : w + 1, : t + 1]).logits[0, -1], int(targets_WT[w, t])))
            diffs.append(causal[-1] - tf[-1])
        model.train()
        train_logits = model(idx_WT[w : w + 1]).logits
        train += [nll(train_logits[0, t], int(targets_WT[w, t])) for t in pos]
    model.eval()
    mean_diff = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean_diff) ** 2 for d in diffs) / (len(diffs) - 1))
    return {
        "teacher_forced_loss": sum(tf) / len(tf),
        "teacher_forced_loss_all": sum(tf_all) / len(tf_all),
        "causal_loss": sum(causal) / len(causal),
        "leakage_gap": mean_diff,
        "leakage_gap_se": sd / math.sqrt(len(diffs)),
        "train_mode_loss": sum(train) / len(train),
        "eval_positions": len(tf),
        "tokens_LE": tokens_LE,
    }


def val_tokens() -> torch.Tensor:
    return torch.randint(0, 32, (WINDOWS * SEQ_LEN + 5,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("method", ["recompute", "cache"])
def test_every_figure_of_a_causal_router_is_the_one_window_at_a_time_reference(method):
    model = small_lm("topk", {"top_k": 2}, dtype=torch.float64).eval()
    val = val_tokens()
    got = evaluate(
        model, val, SEQ_LEN, WINDOWS, causal_stride=STRIDE, batch_size=1, with_train_mode=True, causal_method=method
    )
    ref = reference(model, val)
    for key in ("teacher_forced_loss", "teacher_forced_loss_all", "causal_loss", "train_mode_loss"):
        assert got[key] == pytest.approx(ref[key], abs=1e-5), key
    assert got["eval_positions"] == ref["eval_positions"] == WINDOWS * (SEQ_LEN // STRIDE)
    assert got["teacher_forced_loss"] != pytest.approx(got["teacher_forced_loss_all"], abs=1e-4)
    for key, value in balance_summary(ref["tokens_LE"], "global_").items():
        assert got[key] == pytest.approx(value, abs=1e-9), key


def test_leakage_gap_and_its_standard_error_of_a_leaking_router_are_the_reference_ones():
    """Expert choice (capacity a function of T) routes a prefix differently from the full window,
    so the per-position differences vary and the standard error is not zero."""
    model = small_lm("expert_choice", {}, dtype=torch.float64).eval()
    val = val_tokens()
    got = evaluate(model, val, SEQ_LEN, WINDOWS, causal_stride=STRIDE, batch_size=1, causal_method="recompute")
    ref = reference(model, val)
    for key in ("teacher_forced_loss", "causal_loss", "leakage_gap", "leakage_gap_se"):
        assert got[key] == pytest.approx(ref[key], abs=1e-5), key
    assert ref["leakage_gap_se"] > 1e-3
