import torch

from dynaresize.roles.weight_sync import flatten_params, param_specs, unflatten


def test_flatten_unflatten_is_bit_exact():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    flat = flatten_params(model)
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    state = unflatten(flat.clone(), param_specs(model))
    other = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    other.load_state_dict(state)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_unflatten_rejects_wrong_size():
    model = torch.nn.Linear(2, 2)
    import pytest

    with pytest.raises(ValueError):
        unflatten(torch.zeros(5), param_specs(model))
