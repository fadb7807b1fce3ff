"""``causal_moe_kernels.launch.next_pow2``, which sizes the kernels' expert and column tiles:
the smallest power of two at least n (1 for n <= 1), by hand; a larger tile still computes the
same numbers, only with more padding, so the kernel tests cannot see it."""

from __future__ import annotations

from causal_moe_kernels.launch import next_pow2


def test_next_pow2_is_the_smallest_power_of_two_at_least_n():
    assert [next_pow2(n) for n in range(10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert next_pow2(1024) == 1024 and next_pow2(1025) == 2048
