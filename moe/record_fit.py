"""Whether a routing record fits a model's routers: refused in one line naming what does not fit,
or, where a mismatch is legitimate (a capacity that dropped slots), said.

Shape legend: B sequences, S positions, L MoE layers, K slots per (token, layer), E experts.

A record replays into a router only if, in every MoE layer:

* it was made for as many experts (``RoutingRecord.num_experts``, kept by ``record_routing`` and
  in the saved file; an engine's array carries none, so only its expert ids are checked) and
  names no expert past the layer's E;
* no token lists one expert twice in its slots (it would run that expert twice);
* each token has as many experts as the router routes: exactly ``top_k`` for ``topk`` (without
  null experts) and ``quantile``; at most ``top_k`` for ``capacity`` and ``topk`` with null
  experts (fewer is what a capacity drop or a null choice records: replayed as recorded, with a
  warning saying how many tokens); at most E for the routers whose tokens get a varying number
  (expert choice, thresholds, top-p, ReMoE, SeqTopK).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from moe.routing import Router

EXACTLY_TOP_K = ("topk", "quantile")
"""Routers that give every token exactly ``top_k`` experts (``topk`` without null experts)."""
AT_MOST_TOP_K = ("topk", "capacity")
"""Routers that give every token at most ``top_k`` (capacity drops, null experts)."""


def slot_rule(router: Router) -> tuple[bool, int]:
    """(exact, k): the router gives each token exactly (``exact``) or at most k experts."""
    if router.name in EXACTLY_TOP_K and not getattr(router, "null_experts", 0):
        return True, router.top_k
    if router.name in AT_MOST_TOP_K:
        return False, router.top_k
    return False, router.num_experts


def check_record_fits(
    experts_BSLK: Tensor, record_experts: list[int] | None, routers: list[Router], padding_BS: Tensor | None = None
) -> None:
    """ValueError naming the first MoE layer the record does not fit (see the module docstring);
    a warning for tokens with fewer experts than a capacity router's ``top_k``. Positions marked
    in ``padding_BS`` hold no token and are not counted."""
    if experts_BSLK.shape[2] != len(routers):
        raise ValueError(f"the record holds {experts_BSLK.shape[2]} MoE layers, the model has {len(routers)}")
    narrower = []
    for layer, router in enumerate(routers):
        slots_BSK = experts_BSLK[:, :, layer].long()
        where = f"MoE layer {layer} ({router.name!r}, {router.num_experts} experts)"
        if record_experts is not None and record_experts[layer] != router.num_experts:
            raise ValueError(f"{where}: the record was made by a model with {record_experts[layer]} experts there")
        highest = int(slots_BSK.max()) if slots_BSK.numel() else -1
        if highest >= router.num_experts:
            raise ValueError(f"{where}: the record names expert {highest}")
        _check_distinct(slots_BSK, where)
        filled_BS = (slots_BSK >= 0).sum(-1)
        if padding_BS is not None:
            filled_BS = filled_BS[~padding_BS.to(filled_BS.device)]
        exact, k = slot_rule(router)
        most, fewest = (int(filled_BS.max()), int(filled_BS.min())) if filled_BS.numel() else (0, 0)
        rule = f"{'exactly' if exact else 'at most'} {k} per token"
        if most > k:
            raise ValueError(f"{where} routes {rule}; the record gives a token {most}: a record of another top_k")
        if exact and fewest < k:
            count = int((filled_BS < k).sum())
            raise ValueError(
                f"{where} routes {rule}; {count} of {filled_BS.numel()} recorded tokens have fewer (as few as "
                f"{fewest}): a record of another top_k, or one with empty rows (fill them from the path that routed them)"
            )
        if fewest < k and router.name in AT_MOST_TOP_K:
            narrower.append(f"layer {layer}: {int((filled_BS < k).sum())} of {filled_BS.numel()}")
    if narrower:
        warnings.warn(
            f"replaying tokens with fewer recorded experts than top_k ({'; '.join(narrower)}): capacity drops or null "
            "choices, replayed as recorded",
            stacklevel=4,  # check_record_fits <- replay_routing <- contextlib's __enter__ <- the user's with
        )


def _check_distinct(slots_BSK: Tensor, where: str) -> None:
    """ValueError naming the first token whose slots list one expert twice."""
    if slots_BSK.shape[-1] < 2:
        return
    ordered_BSK = slots_BSK.sort(-1).values
    twice_BSK = (ordered_BSK[..., 1:] == ordered_BSK[..., :-1]) & (ordered_BSK[..., 1:] >= 0)
    if bool(twice_BSK.any()):
        b, s, slot = (int(i) for i in torch.nonzero(twice_BSK)[0])
        raise ValueError(
            f"{where}: sequence {b}, position {s} lists expert {int(ordered_BSK[b, s, slot])} twice in its slots"
        )
