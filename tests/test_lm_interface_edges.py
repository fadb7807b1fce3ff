"""The causal-LM interface (:mod:`moe.lm`) and :func:`moe.generation.generate` at their edges:
int32 token ids, a cache of another batch size, the loss of low-precision logits, and the
logits returned by a generation that adds no token.

References: the int64 forward of the same ids, a float64 cross-entropy computed by hand, and
the full-sequence forward of the prompt.
"""

import pytest
import torch
from helpers import small_lm

from moe.generation import generate
from moe.lm import KVCache, check_token_ids, lm_loss


def test_int32_token_ids_are_taken_as_int64_ones_are():
    """The docstring of check_token_ids: int64 or int32 ids; both give the same logits."""
    model = small_lm("topk", {"top_k": 2}).eval()
    ids = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        got = model(ids.to(torch.int32)).logits
    assert torch.equal(got, want)
    check_token_ids(ids.to(torch.int32), max_seq_len=9)


def test_token_ids_of_a_smaller_batch_than_the_cache_are_refused():
    """All B sequences of a cache advance together: another batch size, smaller or larger, is refused."""
    cache = KVCache(batch_size=2, max_len=8, keys=[None], values=[None], router_states=[None])
    for b in (1, 3):
        with pytest.raises(ValueError, match="cache is for batch size 2"):
            check_token_ids(torch.zeros(b, 1, dtype=torch.long), cache=cache)
    check_token_ids(torch.zeros(2, 8, dtype=torch.long), cache=cache)  # fills it exactly


def test_lm_loss_of_bf16_logits_is_computed_in_fp32():
    """The loss of bf16 logits is the fp32 cross-entropy of those very values (float64 reference
    by hand: logsumexp minus the target's logit), not a bf16-rounded one."""
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 5, 50, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, 50, (3, 5), generator=gen)
    x = logits.double()
    per_pos = torch.logsumexp(x, -1) - x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = lm_loss(logits, targets)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - per_pos.mean().item()) < 1e-5
    each = lm_loss(logits, targets, reduction="none")
    assert each.dtype == torch.float32 and each.shape == (3, 5)
    torch.testing.assert_close(each.double(), per_pos, atol=1e-5, rtol=0)


def test_return_logits_of_a_generation_adding_no_token_are_positions_0_to_t_minus_2():
    """S = T + 0 positions: the docstring's [B, S-1-c, V] logits, those of the full forward at
    positions 0..T-2 (the last position predicts a token never drawn)."""
    model = small_lm("topk", {"top_k": 2}).eval()
    ids = torch.randint(0, 32, (2, 6))
    out, logits = generate(model, ids, 0, context=32, temperature=0, return_logits=True)
    assert torch.equal(out, ids)
    with torch.no_grad():
        full = model(ids).logits.float()
    assert logits.shape == (2, 5, 32)
    torch.testing.assert_close(logits, full[:, :-1], atol=1e-5, rtol=0)
