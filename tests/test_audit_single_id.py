"""One special id in the future, not only floods of it. On 7dc4c10 the adversarial futures held a
named id at every future position (7 to 15 copies) and never once, so a block whose routing
switches when a row holds exactly one separator was called clean in both modes.

Shapes: B=4, T=16, D=16, E=4, a vocabulary of 32000 ids (uniform random ids almost never hit one given id), separator id 7.
"""

from __future__ import annotations

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit

B, T, D, E, V = 4, 16, 16, 4, 32000
SEP = 7


class PromptResponseRouter(nn.Module):
    """Token ids -> hidden states of a top-1 MoE block that routes a row holding a prompt and a
    response (exactly one separator id between them) with its own gate, any other row (pretraining
    text, several turns) with the shared one, as code that fine-tunes on instruction pairs might:
    the switch counts separators over the whole row, so a separator after position t changes how
    tokens at or before t are routed."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, D)
        self.shared_gate = nn.Linear(D, E, bias=False)
        self.pair_gate = nn.Linear(D, E, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(E, D, D) / D**0.5)

    def forward(self, input_ids: Tensor) -> Tensor:
        h_BTD = self.embed(input_ids)
        is_pair_B = (input_ids == SEP).sum(1) == 1
        logits_BTE = torch.where(is_pair_B[:, None, None], self.pair_gate(h_BTD), self.shared_gate(h_BTD))
        expert_BT = logits_BTE.argmax(-1)
        return h_BTD + torch.tanh(torch.einsum("btd,btde->bte", h_BTD, self.w_EDD[expert_BT]))


def test_a_switch_on_exactly_one_separator_is_found():
    x = torch.randint(SEP + 1, V, (B, T), generator=torch.Generator().manual_seed(0))
    report = audit(PromptResponseRouter(), x, special_ids=[SEP])
    assert report.leaks_in == ["train", "eval"], report.summary()
    found = report.probe("adversarial_future", "eval").found_by
    assert found is not None and found.startswith(f"id {SEP} (named) at position"), found
