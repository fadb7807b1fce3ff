"""The row order of each flattened [B * T, ...] output: rows b * T + t (``x.view(-1, D)`` of a
[B, T, D] input, Hugging Face's order) or t * B + b (time-major, Megatron's [T, B] order).

Shape legend: B batch, T sequence, N = B * T rows, W an output's values per row.

Both orders have the same shape, so the audit tells them apart from what the target does: one
position q alone is changed in every sample (q = T - 1 first) and the rows that moved are read
both ways. A causal field moves at positions >= q only, so in the right order no moved row sits
before q, while in the wrong one some do (row q of sample 0 is row q, position q // B read
time-major; row (T - 1) * B of a time-major field is sample (T - 1) * B // T read the other way).
A change can move no row at all (a pre-gated router routes token t from token t - 1, so nothing
is routed from the last token), or fit both orders (only rows the two readings agree on): then
the next position is tried. A field no position tells (one that leaks, or is random) is read as
b * T + t, and its note says what the changes did, never more.
"""

from __future__ import annotations

from torch import Tensor

from moe.audit.context import Sampler, probe_generator
from moe.audit.runner import Runner, TargetFailure
from moe.audit.target import Outputs, Part

ORDER_POSITIONS = 4
"""Most positions changed (one forward each) to tell the order: T-1, T-2, T-3 and T/2."""


def order_positions(t: int) -> list[int]:
    """The positions changed in turn, latest first; never 0 (every row may move after a change there)."""
    return list(dict.fromkeys(q for q in (t - 1, t - 2, t - 3, t // 2) if q >= 1))[:ORDER_POSITIONS]


def _moved_rows(base: Outputs, moved: Outputs, part: Part) -> Tensor:
    """bool [N]: the rows of one flat output that differ, in the order the target returned them
    (NaN where both have NaN is no change)."""
    a_all, z_all = (base.exact_BTX, moved.exact_BTX) if part.exact else (base.value_BTF, moved.value_BTF)
    a, z = a_all[..., part.start : part.stop], z_all[..., part.start : part.stop]
    same = (a == z) | (a.isnan() & z.isnan()) if not part.exact else a == z
    return (~same).any(-1).reshape(-1)


def _fits(moved_BT: Tensor, q: int) -> bool:
    """Some row moved, and none at a position before q."""
    return bool(moved_BT.any()) and not bool(moved_BT[:, :q].any())


_WHAT_MOVED = {
    "none": "moved none of its rows",
    "both": "moved only rows that fit both orders",
    "neither": "moved rows before the change in either order",
}
"""What a change at a position did to a field whose order it could not tell, by kind."""


def _kind(sample_major: bool, time_major: bool, any_moved: bool) -> str:
    return "none" if not any_moved else "both" if sample_major and time_major else "neither"


def _untold(seen: dict[str, list[int]]) -> str:
    """e.g. "a change at position 15 moved none of its rows; changes at positions 14, 13 moved ..."."""
    parts = []
    for kind, qs in seen.items():
        at = f"a change at position {qs[0]}" if len(qs) == 1 else f"changes at positions {', '.join(map(str, qs))}"
        parts.append(f"{at} {_WHAT_MOVED[kind]}")
    return "; ".join(parts) or "the forward that checks it failed"


def check_flat_order(runner: Runner, example: Tensor, base: Outputs, sampler: Sampler, seed: int) -> list[str]:
    """Tell the order of every flat output of ``base`` (the example's outputs, flat ones read as
    rows b * T + t) with forwards that change one position alone; add each time-major one to
    ``runner.target.time_major`` and return the notes the report prints."""
    at = runner.target
    b, t = example.shape[:2]
    undecided = {p.name: p for p in base.parts if p.name in at.flat_fields}
    if not undecided or b < 2:
        return []
    seen: dict[str, dict[str, list[int]]] = {name: {} for name in undecided}
    notes = []
    for q in order_positions(t):
        x = example.clone()
        x[:, q] = sampler.draw((b, *example.shape[2:]), probe_generator(seed, 9 + 100 * q))
        try:
            moved = runner.forward(x).out
        except TargetFailure:
            break
        for name, part in list(undecided.items()):
            moved_N = _moved_rows(base, moved, part)
            sample_major, time_major = _fits(moved_N.reshape(b, t), q), _fits(moved_N.reshape(t, b).T, q)
            if sample_major != time_major:
                del undecided[name]
                if time_major:
                    at.time_major.add(name)
                    notes.append(
                        f"{name}: rows are t*B+b (time-major): a change at position {q} alone moved rows at "
                        f"positions >= {q} only when read so (read as b*T+t, rows before {q} moved)"
                    )
            else:
                seen[name].setdefault(_kind(sample_major, time_major, bool(moved_N.any())), []).append(q)
        if not undecided:
            break
    for name in undecided:
        notes.append(f"{name}: read as rows b*T+t; its row order could not be told: {_untold(seen[name])}")
    return notes
