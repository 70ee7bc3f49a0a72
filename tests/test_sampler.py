"""Sampler edge cases."""

import torch

from sfcl.engine.sampler import sample


def test_sampler_degenerate_settings_do_not_raise():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    out = sample(logits, [1e-320, 0.7, 1.0], [1.0, 1e-320, 1e-9], [None, torch.Generator().manual_seed(0),
                                                                   torch.Generator().manual_seed(0)])
    assert out.tolist() == [1, 0, 2]  # tiny temperature = greedy; tiny top_p keeps only the top token
