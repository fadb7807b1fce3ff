"""Hash routing (router ``hash``, ``ModelConfig.hash_layers``; DeepSeek-V4's first layers): the
table, the weights against a per-token float64 reference, the token ids through the model, the
KV cache, record / replay and the audit (in Python and through ``moe-audit --input tokens``),
both ways: the real thing clean, a planted variant that reads the next token's id caught."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from helpers import small_lm
from torch import nn

import moe
from moe.audit import audit
from moe.audit import cli as audit_cli
from moe.model import MoETransformer, preset
from moe.training import TrainConfig

V, E = 32, 4


def test_table_rows_are_distinct_uniform_experts_fixed_by_the_seed():
    r = moe.build_router("hash", d_model=8, num_experts=8, top_k=2, vocab_size=4096, table_seed=3)
    t = r.tid2eid
    assert t.shape == (4096, 2) and t.dtype == torch.int64
    assert bool((t[:, 0] != t[:, 1]).all()) and int(t.min()) >= 0 and int(t.max()) < 8
    # every expert equally likely: 1024 of the 8192 slots each; binomial sd ~30, allow 5 sd
    counts = torch.bincount(t.reshape(-1), minlength=8)
    assert (counts - 1024).abs().max() < 150, counts
    again = moe.build_router("hash", d_model=16, num_experts=8, top_k=2, vocab_size=4096, table_seed=3)
    other = moe.build_router("hash", d_model=8, num_experts=8, top_k=2, vocab_size=4096, table_seed=4)
    assert torch.equal(again.tid2eid, t) and not torch.equal(other.tid2eid, t)
    with torch.device("meta"):  # a model built on the meta device gets the same table
        meta = moe.build_router("hash", d_model=8, num_experts=8, top_k=2, vocab_size=4096, table_seed=3)
    assert torch.equal(meta.tid2eid, t)


@pytest.mark.parametrize("options", [{}, {"gate": "sigmoid", "route_scale": 2.5}, {"normalize": False}])
def test_routing_is_the_table_weighted_by_the_gate_against_a_float64_reference(options):
    torch.manual_seed(0)
    r = moe.build_router("hash", d_model=6, num_experts=E, vocab_size=V, router_dtype="fp64", **options)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    ids = torch.randint(0, V, (2, 5))
    out = r(x, token_ids_BT=ids)
    w = r.gate.weight.detach().double()
    want = torch.zeros(2, 5, E, dtype=torch.float64)
    for b in range(2):
        for t in range(5):
            logits = [float(x[b, t] @ w[e]) for e in range(E)]
            if options.get("gate") == "sigmoid":
                score = [1 / (1 + math.exp(-v)) for v in logits]
            else:
                score = [math.exp(v) / sum(math.exp(u) for u in logits) for v in logits]
            chosen = r.tid2eid[ids[b, t]].tolist()
            mass = sum(score[e] for e in chosen) if options.get("normalize", True) else 1.0
            for e in chosen:
                want[b, t, e] = score[e] / mass * options.get("route_scale", 1.0)
    torch.testing.assert_close(out.dense(), want, rtol=1e-12, atol=1e-12)
    assert out.stats["tokens_per_expert"].sum() == 2 * 5 * 2 and out.aux_loss > 0  # the z-loss alone
    out.dense().sum().backward()
    assert r.gate.weight.grad.abs().sum() > 0  # the gate still learns


def test_bad_input_and_refused_options_raise_one_line_errors():
    r = moe.build_router("hash", d_model=4, num_experts=E)
    with pytest.raises(ValueError, match="routes by token id"):
        r(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="shape"):
        r(torch.randn(1, 3, 4), token_ids_BT=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="balance loss"):
        moe.build_router("hash", d_model=4, num_experts=E, aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="balance_rate"):
        moe.build_router("hash", d_model=4, num_experts=E, balance_rate=0.1)
    with pytest.raises(ValueError, match="dense blocks"):
        preset("tiny", n_layers=2, moe_every=2, hash_layers=1)
    with pytest.raises(ValueError, match="exceeds n_layers"):
        preset("tiny", hash_layers=3)
    with pytest.raises(ValueError, match="no pipeline_parallel"):
        TrainConfig.flat(pipeline_parallel=2, model={"hash_layers": 1})
    checked = moe.build_router("hash", d_model=4, num_experts=E, vocab_size=8, check_finite=True)
    with pytest.raises(ValueError, match="vocab_size=8"):
        checked(torch.randn(1, 2, 4), token_ids_BT=torch.tensor([[1, 8]]))


def test_a_training_step_reads_nothing_on_the_host(monkeypatch):
    """As tests/test_decode.py checks every router of helpers.ROUTER_CONFIGS (which call routers
    without token ids): no .item(), bool(), .tolist(), int(), float() or bincount."""
    monkeypatch.delenv("MOE_DEBUG", raising=False)
    router = moe.build_router("hash", d_model=16, num_experts=E, vocab_size=V)
    x, ids = torch.randn(2, 12, 16, requires_grad=True), torch.randint(0, V, (2, 12))
    calls = []
    for method in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda *a, m=method, f=original, **k: calls.append(m) or f(*a, **k))
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: calls.append("bincount"))
    routing = router.train()(x, token_ids_BT=ids)
    (routing.weight.sum() + routing.aux_loss).backward()
    router.update_after_step()
    router.eval()(x, token_ids_BT=ids)
    monkeypatch.undo()
    assert calls == [], calls


def test_hash_layers_route_the_first_blocks_by_the_models_token_ids():
    model = small_lm("topk", {"top_k": 2, "gate": "sigmoid"}, hash_layers=1)
    first, second = model.routers()
    assert first.name == "hash" and second.name == "topk"
    assert first.vocab_size == V and first.gate_fn == "sigmoid" and first.top_k == 2
    idx = torch.randint(0, V, (3, 9))
    out = model(idx)
    mask = out.routings[0].mask().view(-1, E)
    want = torch.zeros_like(mask).scatter_(1, first.tid2eid[idx.reshape(-1)], True)
    assert torch.equal(mask, want)
    both = small_lm("hash", {}, hash_layers=0)  # every block hash: each its own table
    assert not torch.equal(both.routers()[0].tid2eid, both.routers()[1].tid2eid)
    assert model.num_parameters(active=True) < model.num_parameters()


@pytest.mark.parametrize("hash_layers", [1, 2])
def test_kv_cache_decoding_equals_the_full_forward(hash_layers):
    model = small_lm("topk", {"top_k": 2}, hash_layers=hash_layers, max_seq_len=40).eval()
    prompt = torch.randint(0, V, (2, 5))
    seq, logits = model.generate(prompt, 12, temperature=0, return_logits=True)
    full = model(seq[:, :-1]).logits  # the logits of every forwarded position
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-5)  # fp32, as tests/test_decode.py
    cache = model.init_cache(2)
    chunks = torch.cat([model(seq[:, a:b], cache=cache).logits for a, b in [(0, 7), (7, 8), (8, 16)]], 1)
    torch.testing.assert_close(chunks, model(seq[:, :16]).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_record_and_replay_are_the_recorded_forward_bit_for_bit(mode):
    model = small_lm("topk", {"top_k": 2}, torch.float64, hash_layers=1).train(mode == "train")
    idx, targets = torch.randint(0, V, (3, 10)), torch.randint(0, V, (3, 10))
    params = [p for p in model.parameters() if p.requires_grad]

    def run():
        out = model(idx, targets)
        return out, torch.autograd.grad(out.loss + out.aux_loss, params)

    with moe.record_routing(model) as record:
        out, grads = run()
    assert torch.equal(record.experts[:, :, 0].long().sort(-1).values, model.routers()[0].tid2eid[idx].sort(-1).values)
    with moe.replay_routing(model, record):
        again, regrads = run()
    assert torch.equal(out.logits, again.logits) and torch.equal(out.aux_loss, again.aux_loss)
    assert all(torch.equal(g, h) for g, h in zip(grads, regrads))
    with torch.no_grad():  # replay needs no ids: another table routes the recorded experts
        model.routers()[0].tid2eid.copy_(model.routers()[0].tid2eid.roll(1, dims=1).add(1).remainder(E))
    with moe.replay_routing(model, record):
        assert torch.equal(model(idx, targets).logits, out.logits)


class NextIdHash(nn.Module):
    """A planted leak: the model's hash blocks are given the *next* position's ids (position t
    routed by token t+1), while its routers keep claiming causality."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = MoETransformer(preset("tiny", d_model=32, n_layers=2, hash_layers=2), init_seed=0)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        shifted_BT = torch.cat([idx_BT[:, 1:], idx_BT[:, :1]], 1)
        x_BTD = self.lm.forward_blocks(self.lm.embed_tokens(idx_BT), None, None, shifted_BT)
        return self.lm.output_logits(x_BTD)


def test_audit_finds_hash_layers_causal_and_the_next_id_variant_leaking():
    honest = MoETransformer(preset("tiny", d_model=32, n_layers=2, hash_layers=1), init_seed=0)
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    report = audit(honest, idx, trials=1, agreement=False)
    assert report.claims == moe.Claims(True, True, True, True) and not report.leaks, report.table()
    assert not report.violations and not report.unshown, report.table()
    leaky = audit(NextIdHash(), idx, trials=1, agreement=False)
    assert leaky.leaks and leaky.violations, leaky.table()  # claimed causal, shown leaking


def test_moe_audit_cli_passes_token_ids_to_the_hash_layers(tmp_path, capsys):
    target = tmp_path / "targets.py"
    target.write_text(
        textwrap.dedent(
            f"""
            from moe.model import MoETransformer, preset
            import sys
            sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
            from test_hash_router import NextIdHash

            def honest():
                return MoETransformer(preset("tiny", d_model=32, n_layers=2, hash_layers=2), init_seed=0)
            """
        )
    )
    flags = ["--input", "tokens:2,12,256", "--modes", "eval", "--trials", "1", "--no-agreement", "--no-progress"]
    assert audit_cli.main(["--target", f"{target}:honest", *flags]) == 0, capsys.readouterr()
    assert audit_cli.main(["--target", f"{target}:NextIdHash", *flags]) == 1, capsys.readouterr()
