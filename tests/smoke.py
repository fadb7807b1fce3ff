"""The quick tier, ``pytest -m smoke`` (about a minute): did the install work. A few tests of
the suite that touch each part a user meets first (the routers, ``MoELayer``, the model and
decoding, the audit and ``moe-audit``, the trainer, the kernels' reference and, where their
extras are installed, the Triton kernels and the Hugging Face swap), marked here so that their
files stay as they are. ``conftest.py`` marks them; ``tests/test_smoke_tier.py`` checks each
still exists. The full suite stays the README's test command.
"""

from __future__ import annotations

import pytest

SMOKE = (
    "tests/test_routers.py::test_registry_lists_builtins",
    "tests/test_layer.py::test_layer_matches_naive_loop_in_float64",
    "tests/test_layer.py::test_layer_trains",
    "tests/test_model.py::test_forward_shapes_and_aux",
    "tests/test_model.py::test_causal_router_model_is_causal_and_expert_choice_is_not",
    "tests/test_decode.py::test_cached_forward_in_chunks_equals_full_forward",
    "tests/test_reference.py::test_scatter_sum_equals_the_slot_ordered_loop",
    "tests/test_audit_assert.py::test_a_causal_layer_passes_and_returns_its_report",
    "tests/test_audit_assert.py::test_a_leaky_layer_raises_with_the_table",
    "tests/test_audit_cli.py::test_causal_target_exits_0",
    "tests/test_audit_cli.py::test_leaky_target_exits_1_and_writes_json",
    "tests/test_train_cli.py::test_user_errors_are_one_line_and_exit_2",
    "tests/test_opt_in_extras.py::test_an_unasked_run_with_no_folder_writes_no_wandb_into_the_working_directory",
    "tests/test_kernels.py::test_moe_ffn_bitwise_reproducible",
    "tests/test_hf_integration.py::test_topk_swap_reproduces_the_family",
    "tests/test_docs.py::test_python_block_runs_alone[README.md#0]",
    "tests/test_docs.py::test_python_block_runs_alone[README.md#1]",
    "tests/test_install_wheel.py::test_a_missing_kernel_attribute_names_our_package",
)
"""Test node ids: a function's id marks every parametrization of it, an id with ``[...]`` one."""


def mark_smoke(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in SMOKE or item.nodeid.split("[")[0] in SMOKE:
            item.add_marker(pytest.mark.smoke)
