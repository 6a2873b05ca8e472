"""check_finite: a sample whose states hold NaN/Inf fails with the first bad token named; large finite states
whose sum overflows float32 are not mistaken for non-finite ones."""

from __future__ import annotations

import pytest
import torch

from builder.extract.backends.base import check_finite


def states(n: int = 6, w: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3 * w, generator=g).bfloat16(), torch.randn(n, w, generator=g).bfloat16()


def test_finite_states_pass() -> None:
    aux, final = states()
    assert check_finite("k", aux, final) is None


def test_large_finite_values_whose_sum_overflows_pass() -> None:
    aux, final = states()
    aux[:] = 3.0e38  # bf16 holds it; their float32 sum is +inf
    assert not torch.isfinite(aux.sum(dtype=torch.float32))
    assert check_finite("k", aux, final) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["aux_hidden_state", "hidden_state"])
def test_a_non_finite_value_fails_naming_field_and_token(bad: float, field: str) -> None:
    aux, final = states()
    (aux if field == "aux_hidden_state" else final)[4, 2] = bad
    f = check_finite("k", aux, final)
    assert f is not None and f.reason == "nonfinite"
    assert field in f.message and "token 4" in f.message


def test_opposite_infinities_fail() -> None:
    aux, final = states()
    final[1, 0], final[3, 1] = float("inf"), float("-inf")  # their sum is NaN, not inf
    f = check_finite("k", aux, final)
    assert f is not None and "token 1" in f.message
