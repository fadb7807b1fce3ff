"""The whole model's forward, KV cache and decoding, run through the stages of a pipeline, for
evaluation: :func:`moe.eval.evaluate` (teacher-forced and causal losses) and anything else that
calls ``model(idx)`` / ``model(idx, cache=...)`` works on a pipeline-parallel model unchanged.

Every rank of the pipeline group calls the forward with the same token ids. Stage k (on
pipeline rank k mod S) receives the activations [B, T, D] from the rank of stage k-1, runs its
blocks (through its share of the KV cache and the router decode states when decoding) and sends
them on; the rank of the last stage broadcasts the logits [B, T, V] to the group, so every rank
returns them. Forward only: training goes through the schedule (:mod:`moe.parallel.pipeline`).

Shape legend: B batch, T sequence (new tokens), D model width, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.lm import KVCache, ModelOutput, check_token_ids, empty_cache, lm_loss
from moe.parallel.exchange import guarded
from moe.parallel.pipeline import StageModel


class PipelinedLM(nn.Module):
    """``MoETransformer``'s inference interface over a :class:`StageModel` and its pipeline
    process group (every rank of the group must make the same calls)."""

    def __init__(self, stage_model: StageModel, group) -> None:
        super().__init__()
        self.stage = stage_model
        self.cfg = stage_model.cfg
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.me = dist.get_rank()

    def _holder(self, k: int) -> int:
        return self.ranks[k % len(self.ranks)]

    @torch.no_grad()
    def forward(self, idx_BT: Tensor, targets_BT: Tensor | None = None, cache: KVCache | None = None) -> ModelOutput:
        """Logits [B, T, V] of every position of ``idx_BT`` on every rank (see the module
        docstring); with ``cache``, ``idx_BT`` holds the next tokens of the cached sequences."""
        check_token_ids(idx_BT, self.cfg.max_seq_len, cache)  # on every rank: all refuse together
        b, t = idx_BT.shape
        device = idx_BT.device
        x = idx_BT
        last = self.stage.num_stages - 1
        for k in range(self.stage.num_stages):
            holder = self._holder(k)
            if holder != self.me:
                continue
            if k > 0 and self._holder(k - 1) != self.me:
                x = torch.empty(b, t, self.cfg.d_model, device=device)
                src = self._holder(k - 1)
                guarded(
                    "pipeline activation recv", self.group, lambda x=x, src=src: dist.recv(x, src=src, group=self.group)
                )
            x = self.stage.parts[self.stage.stage_ids.index(k)](x, cache)
            if k < last and self._holder(k + 1) != self.me:
                x = x.float().contiguous()
                dst = self._holder(k + 1)
                guarded(
                    "pipeline activation send", self.group, lambda x=x, dst=dst: dist.send(x, dst=dst, group=self.group)
                )
        logits_BTV = (
            x.float().contiguous()
            if self._holder(last) == self.me
            else torch.empty(b, t, self.cfg.vocab_size, device=device)
        )
        guarded(
            "pipeline logits broadcast",
            self.group,
            lambda: dist.broadcast(logits_BTV, src=self._holder(last), group=self.group),
        )
        if cache is not None:
            cache.length += t
        loss = None if targets_BT is None else lm_loss(logits_BTV, targets_BT)
        return ModelOutput(logits=logits_BTV, aux_loss=logits_BTV.new_zeros(()), routings=[], loss=loss)

    def decode_support(self) -> str | None:
        """None if every router of every stage can decode from a cache in the current mode,
        else the first stage's reason (agreed over the group)."""
        reason = None
        for router in self.stage.routers():
            reason = reason or router.decode_support()
        reasons: list[str | None] = [None] * len(self.ranks)
        dist.all_gather_object(reasons, reason, group=self.group)
        return next((r for r in reasons if r is not None), None)

    def init_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """A cache holding this rank's blocks' keys, values and router decode states."""
        blocks = {int(name): block for name, block in self.stage.blocks.items()}
        return empty_cache(self.cfg.n_layers, self.cfg.max_seq_len, blocks, batch_size, max_len, self.decode_support)
