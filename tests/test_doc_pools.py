"""Document expert pools (EMO): a hand-worked case and a per-token Python reference in float64
(pairs exact, weights to 1e-12: a softmax over 4 entries rounds at ~1e-16, a wrong pool moves a
whole pair); the audit finds the whole-document pool's leak and none in the prefix pool, with
the EOS id among its futures; decoding by chunks and through the KV cache, and replay."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import (
    SUBPROCESS_ENV,
    assert_cache_decoding_is_the_full_forward,
    assert_replay_is_the_recorded_forward,
    identity_router,
    small_lm,
)
from helpers import assignments as pairs
from helpers import hand_logits as rows
from torch import nn

import moe
from moe.audit import audit

EOS, V, D, E = 9, 12, 16, 4


def reference(logits_TE: torch.Tensor, ids_T: list[int], pool: int, k: int, pool_from: str, m: int) -> dict:
    """{(t, expert): weight} for one sequence, one token at a time."""
    probs = torch.softmax(logits_TE, -1).tolist()
    t_len, e = len(probs), len(probs[0])
    starts = [t for t in range(t_len) if t == 0 or ids_T[t - 1] == EOS]
    out = {}
    for t in range(t_len):
        start = max(s for s in starts if s <= t)
        end = min([s for s in starts if s > t] + [t_len])
        read = range(start, end) if pool_from == "document" else range(start, min(t, start + m - 1) + 1)
        sums = [sum(probs[i][j] for i in read) for j in range(e)]
        kept = sorted(range(e), key=lambda j: (-sums[j], j))[:pool]
        masked = {j: math.exp(logits_TE[t, j].item()) for j in kept}
        score = {j: v / sum(masked.values()) for j, v in masked.items()}
        top = sorted(kept, key=lambda j: (-score[j], j))[:k]
        for j in top:
            out[(t, j)] = score[j] / sum(score[c] for c in top)
    return out


def test_hand_case_pools_from_the_whole_document_or_its_prefix():
    # documents: positions 0-1 (token 1 is the EOS) and 2-4. Position 2 prefers expert 0, then 3;
    # positions 3 and 4 prefer experts 2 and 3 equally and strongly.
    x = rows([3, 0, 0, 0], [0, 3, 0, 0], [2, 0, 0, 1], [0, 0, 5, 5], [0, 0, 5, 5])
    ids = torch.tensor([[1, EOS, 2, 3, 4]])
    options = dict(top_k=1, document_expert_pool=2, eos_token_id=EOS)
    doc = identity_router("doc_pool", 4, pool_from="document", **options)
    prefix = identity_router("doc_pool", 4, pool_from="prefix", **options)
    # the whole second document sums to experts 3 and 2 first: position 2 loses its favourite
    assert pairs(doc(x, token_ids_BT=ids)) == [(0, 0), (1, 1), (2, 3), (3, 2), (4, 2)]
    # its prefix at position 2 is position 2 alone (pool {0, 3}); at 3, positions 2-3 (pool {3, 0})
    assert pairs(prefix(x, token_ids_BT=ids)) == [(0, 0), (1, 1), (2, 0), (3, 3), (4, 2)]
    # without the ids the sequence is one document: position 1's favourite is outside the pool {0, 3}
    assert pairs(doc(x)) == [(0, 0), (1, 3), (2, 0), (3, 3), (4, 3)]


@pytest.mark.parametrize("pool_from,m", [("document", 16), ("prefix", 3), ("prefix", 16)])
def test_routing_equals_the_per_token_reference(pool_from, m):
    gen = torch.Generator().manual_seed(0)
    x = 2 * torch.randn(2, 14, 6, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V, (2, 14), generator=gen)
    ids[0, [3, 4, 10]] = EOS  # an empty-looking document of one token, and one at the end
    ids[1, 13] = EOS
    r = identity_router(
        "doc_pool", 6, top_k=2, document_expert_pool=3, eos_token_id=EOS, pool_from=pool_from, pool_prefix=m
    )
    out = r(x, token_ids_BT=ids).dense()
    for b in range(2):
        want = reference(x[b], ids[b].tolist(), 3, 2, pool_from, m)
        got = {(t, j): out[b, t, j].item() for t, j in out[b].nonzero().tolist()}
        assert set(got) == set(want), b
        assert max(abs(got[p] - want[p]) for p in want) < 1e-12


class DocPoolTarget(nn.Module):
    """Token ids -> embedding -> the router, given the ids: the dense routing weights."""

    def __init__(self, **options) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.router = moe.build_router("doc_pool", d_model=D, num_experts=E, eos_token_id=EOS, **options)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.router(self.embed(idx_BT), token_ids_BT=idx_BT).dense()


def test_audit_finds_the_whole_document_leak_and_none_in_the_prefix_pool():
    idx = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(0))
    idx[:, 4] = EOS
    leaky = audit(DocPoolTarget(pool_from="document"), idx, trials=1, special_ids=(EOS,), agreement=False)
    assert leaky.claims_hold and leaky.leaks_in == ["train", "eval"], leaky.table()
    causal = audit(DocPoolTarget(pool_from="prefix", pool_prefix=3), idx, trials=1, special_ids=(EOS,), agreement=False)
    assert causal.claims_hold and not causal.leaks, causal.table()
    assert causal.batch_invariant and causal.decode_consistent, causal.table()


def test_prefix_pool_decodes_chunk_by_chunk_as_the_full_forward():
    target = DocPoolTarget(pool_from="prefix", pool_prefix=3, top_k=2).double()
    idx = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(1))
    idx[0, [2, 6]] = EOS
    idx[1, 8] = EOS  # chunks below end on an EOS (position 2, 8) and start after one
    x = target.embed(idx)
    full = target.router(x, token_ids_BT=idx)
    state = target.router.init_decode_state(2)
    chunks = [(0, 3), (3, 4), (4, 9), (9, 13)]
    decoded = [target.router(x[:, s:e], decode_state=state, token_ids_BT=idx[:, s:e]).dense() for s, e in chunks]
    assert torch.equal(torch.cat(decoded, 1), full.dense())
    assert state.position == 13
    whole = moe.build_router("doc_pool", d_model=D, num_experts=E, pool_from="document").eval()
    with pytest.raises(ValueError, match="not decode-consistent"):
        whole.init_decode_state(2)


def test_model_kv_cache_decoding_equals_the_full_forward_and_replays():
    # the model passes no ids (each sequence is one document): the prefix pool lives in the cache
    model = small_lm("doc_pool", {"top_k": 2, "document_expert_pool": 2, "pool_prefix": 4}).eval()
    idx = torch.randint(0, 32, (2, 10))
    assert_cache_decoding_is_the_full_forward(model, idx)
    model = small_lm("doc_pool", {"top_k": 2, "pool_from": "document"}, torch.float64).train()
    assert_replay_is_the_recorded_forward(model, idx, idx)
    prefix = small_lm("doc_pool", {"top_k": 2}).eval()
    with moe.record_routing(prefix) as record, torch.no_grad():
        prefix.generate(idx[:, :3], 4, temperature=0)
    with pytest.raises(ValueError, match="doc_pool replays full forwards only"), moe.replay_routing(prefix, record):
        prefix.generate(idx[:, :3], 4, temperature=0)


def test_the_model_passes_its_ids_so_an_eos_id_ends_a_document_in_the_model_and_its_cache():
    """A model's prefix pools read the ids it is given: with the EOS id in the input the routing
    differs from the same model without an EOS id (one document per sequence), and it decodes
    through the KV cache as its full forward does."""
    eos = 7
    idx = torch.randint(8, 32, (2, 12))
    idx[:, 5] = eos
    options = {"top_k": 2, "document_expert_pool": 2, "pool_prefix": 2}
    torch.manual_seed(0)
    with_eos = small_lm("doc_pool", {**options, "eos_token_id": eos}).eval()
    torch.manual_seed(0)
    without = small_lm("doc_pool", options).eval()
    with torch.no_grad():
        a, b = with_eos(idx).routings[0].mask(), without(idx).routings[0].mask()
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.equal(a[:, 6:], b[:, 6:])  # pools reset after the EOS
    assert_cache_decoding_is_the_full_forward(with_eos, idx)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"document_expert_pool": 1}, r"document_expert_pool=1 must be in \[top_k=2, num_experts=4\]"),
        ({"document_expert_pool": 5}, "document_expert_pool=5 must be in"),
        ({"pool_from": "sequence"}, "pool_from must be one of 'document', 'prefix'"),
        ({"pool_prefix": 0}, "pool_prefix must be"),
        ({"num_expert_groups": 2, "num_limited_groups": 1}, "grouped routing and balance_rate are refused"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        moe.build_router("doc_pool", d_model=8, num_experts=4, **options)


def test_token_ids_must_match_the_input():
    r = moe.build_router("doc_pool", d_model=8, num_experts=4, eos_token_id=EOS)
    with pytest.raises(ValueError, match=r"token_ids_BT must be integer ids of shape \[B, T\] = \[2, 5\]"):
        r(torch.randn(2, 5, 8), token_ids_BT=torch.zeros(2, 4, dtype=torch.long))


TARGET_FILE = """
import torch
from torch import nn

import moe


class Target(nn.Module):
    def __init__(self, pool_from):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(12, 16)
        self.router = moe.build_router("doc_pool", d_model=16, num_experts=4, eos_token_id=9, pool_from=pool_from)

    def forward(self, idx):
        return self.router(self.embed(idx), token_ids_BT=idx).dense()


def whole():
    return Target("document")


def prefix():
    return Target("prefix")
"""


@pytest.mark.slow
@pytest.mark.parametrize("name,code,leaks", [("whole", 1, ["train", "eval"]), ("prefix", 0, [])])
def test_moe_audit_command_with_the_eos_id_as_a_special_id(tmp_path, name, code, leaks):
    """``moe-audit --special-ids 9`` on a user target built around doc_pool (two subprocesses,
    about 15 s each on a loaded machine): exit 1 and the leak in both modes for EMO's whole-document
    pool (a user target's leak), exit 0 for the prefix pool; the claims hold either way."""
    target = tmp_path / "target.py"
    target.write_text(TARGET_FILE)
    out = tmp_path / "audit.json"
    argv = ["--target", f"{target}:{name}", "--input", "tokens:3,10,12", "--special-ids", "9", "--trials", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "moe.audit", *argv, "--json", str(out)],
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
    (report,) = json.loads(out.read_text())["targets"]
    assert report["leaks_in"] == leaks and not report["violations"] and not report["unshown"], report
