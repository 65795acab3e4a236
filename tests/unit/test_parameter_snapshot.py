"""ParameterSnapshot: a replaced Parameter object is seen without walking the module tree;
in-place updates and ``.data`` moves are not replacements."""

from __future__ import annotations

import torch

from mcore_refit.model import ParameterSnapshot


def _chunks() -> list[torch.nn.Module]:
    return [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)),
            torch.nn.Linear(4, 2, bias=False)]


def test_in_place_updates_and_data_moves_are_not_replacements():
    chunks = _chunks()
    snapshot = ParameterSnapshot(chunks)
    with torch.no_grad():
        chunks[0][0].weight.add_(1.0)
    chunks[1].weight.data = torch.zeros(2, 4)
    assert not snapshot.replaced()


def test_a_new_parameter_object_in_any_chunk_is_a_replacement():
    chunks = _chunks()
    snapshot = ParameterSnapshot(chunks)
    chunks[1].weight = torch.nn.Parameter(chunks[1].weight.detach().clone())
    assert snapshot.replaced()
    assert not ParameterSnapshot(chunks).replaced()


def test_replacements_map_the_old_object_to_the_new():
    chunks = _chunks()
    snapshot = ParameterSnapshot(chunks)
    old = chunks[0][1].bias
    chunks[0][1].bias = torch.nn.Parameter(torch.ones(4))
    assert snapshot.replacements() == {id(old): chunks[0][1].bias}
