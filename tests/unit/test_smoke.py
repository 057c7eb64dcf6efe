import pytest
import torch

import asyncgraph

pytestmark = pytest.mark.usefixtures("leak_check")


async def test_linear_matches_eager() -> None:
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    ep = torch.export.export(model, (x,))
    async with asyncgraph.Executor(ep) as ex:
        out = await ex.execute(x)
    torch.testing.assert_close(out, model(x))
