"""The small-batch linear kernel agrees with nn.Linear and swaps in and out cleanly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from selfspec.core import kernels


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48)
    expected = lin(x)
    kernels.install(lin)
    assert type(lin) is kernels.SmallBatchLinear
    got = lin(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_install_and_uninstall_touch_only_plain_linears():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Custom(4, 4), nn.Sequential(nn.Linear(4, 2)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert kernels.install(model) == 2
    assert type(model[2]) is Custom
    assert model.state_dict().keys() == state.keys()
    assert kernels.uninstall(model) == 2
    assert type(model[0]) is nn.Linear and type(model[3][0]) is nn.Linear
