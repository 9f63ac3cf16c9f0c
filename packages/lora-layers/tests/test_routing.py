"""Per-call routing (MultiLoRA.route, adapter_names=), wrapping from the adapters, replacing and
evicting adapters, grad mode, and the Conv1D layer kind, on the seeded TinyDecoder (no transformers)."""

import json

import pytest
import torch
from torch import nn

from lora_core import save_peft_adapter
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder
from lora_layers.layers import LAYER_TYPES, Conv1DWithLoRA, is_conv1d

CONFIG = TinyConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2)
OUT = {"q_proj": 16, "k_proj": 8, "v_proj": 8, "o_proj": 16, "down_proj": 16}


def _adapter(tmp_path, name, r=4, modules=("q_proj", "v_proj"), layers=(0, 1), scale=1.0, **config):
    """A PEFT-format adapter on ``modules`` of ``layers`` (and ``lm_head``), seeded by its name."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    weights = {}
    for m in modules:
        if m == "lm_head":
            weights["lm_head"] = (torch.randn(r, 16, generator=g), torch.randn(40, r, generator=g) * scale)
            continue
        block = "mlp" if m == "down_proj" else "self_attn"
        fan_in = 24 if m == "down_proj" else 16
        for layer in layers:
            weights[f"model.layers.{layer}.{block}.{m}"] = (torch.randn(r, fan_in, generator=g) / 4,
                                                            torch.randn(OUT[m], r, generator=g) * scale)
    path = save_peft_adapter(tmp_path / name, weights, lora_alpha=2 * r)
    if config:
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return path


def _served(tmp_path, **kw):
    model = TinyDecoder(CONFIG)
    mlora = MultiLoRA(model, ["q_proj", "v_proj", "lm_head"], max_loras=3, max_rank=8, **kw)
    mlora.load_adapter("a", _adapter(tmp_path, "a"))
    mlora.load_adapter("b", _adapter(tmp_path, "b", r=8, modules=("q_proj", "lm_head")))
    return model, mlora


def _per_request(model, mlora, ids, adapters):
    """The reference: one request at a time through set_batch."""
    rows = []
    for row, adapter in zip(ids, adapters):
        mlora.set_batch([row.numel()], [adapter])
        rows.append(model(row))
    return torch.stack(rows)


IDS = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_a_route_describes_each_call_from_its_input(tmp_path):
    model, mlora = _served(tmp_path)
    route = ["a", None, "b"]
    want = _per_request(model, mlora, IDS, route)
    want_step = _per_request(model, mlora, IDS[:, -1:], route)
    with mlora.route(route):
        prefill = model(IDS)
        assert mlora.backend.batch_info.seq_lens == (5, 5, 5)
        step = model(IDS[:, -1:])  # a decode step: one token per row
        assert mlora.backend.batch_info.seq_lens == (1, 1, 1)
    torch.testing.assert_close(prefill, want)
    torch.testing.assert_close(step, want_step)
    assert not torch.equal(prefill[0], prefill[1]) and not torch.equal(prefill[2], prefill[1])


@torch.no_grad()
def test_each_adapter_covers_its_beams_and_peft_names_work(tmp_path):
    model, mlora = _served(tmp_path)
    beams = IDS.repeat_interleave(2, dim=0)  # how generate() expands rows for num_beams=2
    with mlora.route(["a", "__base__", "b"]):
        out = model(beams)
    assert mlora.backend.batch_info.request_slots == (0, 0, -1, -1, 1, 1)
    torch.testing.assert_close(out, _per_request(model, mlora, beams, ["a", "a", None, None, "b", "b"]))
    # PEFT's per-call keyword: taken off the call before the model's forward sees it
    torch.testing.assert_close(model(IDS, adapter_names=["a", None, "b"]), out[::2])
    with mlora.route(["b"]):  # a 1-D input is one request
        torch.testing.assert_close(model(IDS[0]), _per_request(model, mlora, IDS[:1], ["b"])[0])


def test_routes_nest_and_name_what_is_wrong(tmp_path):
    model, mlora = _served(tmp_path)
    with mlora.route(["a", None, "b"]):
        with mlora.route([None]):
            assert mlora._route == [None]
        assert mlora._route == ["a", None, "b"]
        with pytest.raises(ValueError, match="the route has 3 adapters but the model was called with 2 rows"):
            model(IDS[:2])
    assert mlora._route is None
    with pytest.raises(ValueError, match=r"adapter 'nope' is not loaded \(loaded: a, b\)"):
        with mlora.route(["a", "nope"]):
            pass
    with pytest.raises(TypeError, match="one adapter name"):
        with mlora.route("a"):
            pass
    with pytest.raises(ValueError, match=r"needs \(B, S\) token ids"):
        with mlora.route(["a"]):
            model(IDS[None])


@torch.no_grad()
def test_repeated_layouts_reuse_their_batch_until_the_adapters_change(tmp_path):
    model, mlora = _served(tmp_path)
    first = mlora.set_batch([1, 1, 1], ["a", None, "b"])
    assert mlora.set_batch([1, 1, 1], ["a", None, "b"]) is first
    with pytest.raises(ValueError, match="seq_lens"):  # a cached layout never skips the checks
        mlora.set_batch([1.0, 1, 1], ["a", None, "b"])
    before = model(IDS[:, 0])
    mlora.load_adapter("b", _adapter(tmp_path, "b2", r=2, modules=("v_proj",)), replace=True)
    fresh = mlora.set_batch([1, 1, 1], ["a", None, "b"])
    assert fresh is not first and fresh.lora_ranks_host[1] == 2
    after = model(IDS[:, 0])
    torch.testing.assert_close(after[:2], before[:2])
    torch.testing.assert_close(after[2:], _per_request(model, mlora, IDS[2:, :1], ["b"])[:, 0])


def test_reloading_needs_replace_and_full_slots_follow_the_eviction_policy(tmp_path):
    model, mlora = _served(tmp_path)
    path = _adapter(tmp_path, "c")
    with pytest.raises(ValueError, match=r"'a' is already loaded in slot 0; pass replace=True"):
        mlora.load_adapter("a", path)
    assert mlora.load_adapter("a", path, replace=True) == 0
    mlora.load_adapter("c", path)
    with pytest.raises(RuntimeError, match=r"all 3 adapter slots are in use \(a, b, c\).*eviction='lru'"):
        mlora.load_adapter("d", path)

    model, mlora = _served(tmp_path, eviction="lru")
    mlora.load_adapter("c", path)
    mlora.set_batch([1, 1], ["b", "c"])
    mlora.set_batch([1], ["a"])
    assert mlora.load_adapter("d", path) == 1  # b was used least recently
    assert mlora.adapters == {"a": 0, "d": 1, "c": 2}
    with mlora.route(["a", "d", "c"]):
        with pytest.raises(RuntimeError, match="hold adapters of the active route"):
            mlora.load_adapter("e", path)
    with pytest.raises(ValueError, match="eviction must be one of"):
        MultiLoRA(TinyDecoder(CONFIG), ["q_proj"], eviction="fifo")


def test_grad_mode_serves_the_same_output_without_autograd(tmp_path):
    model, mlora = _served(tmp_path)
    with torch.no_grad(), mlora.route(["a", None, "b"]):
        want = model(IDS)
    with mlora.route(["a", None, "b"]):
        got = model(IDS)  # grad mode on: the backends' out= ops would refuse autograd
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not got.requires_grad  # the LM head is wrapped: no graph reaches the logits

    model = TinyDecoder(CONFIG)
    mlora = MultiLoRA(model, ["q_proj"], max_loras=1, max_rank=4)
    mlora.load_adapter("a", _adapter(tmp_path, "a1", modules=("q_proj",)))
    with mlora.route(["a", None, "a"]):
        model(IDS).sum().backward()  # unwrapped layers still train; wrapped ones get no gradient
    assert model.lm_head.weight.grad is not None
    assert mlora.wrapped["model.layers.0.self_attn.q_proj"].base_layer.weight.grad is None


@torch.no_grad()
def test_from_adapters_wraps_what_their_configs_target(tmp_path):
    paths = {"a": _adapter(tmp_path, "a"),
             "b": _adapter(tmp_path, "b", r=8, modules=("down_proj",), layers=(1,), layers_to_transform=[1])}
    model = TinyDecoder(CONFIG)
    mlora = MultiLoRA.from_adapters(model, paths)
    assert sorted(mlora.wrapped) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                     "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                                     "model.layers.1.self_attn.v_proj"]
    assert (mlora.slots.num_slots, mlora.slots.max_rank, mlora.adapters) == (2, 8, {"a": 0, "b": 1})
    hand = TinyDecoder(CONFIG)
    by_hand = MultiLoRA(hand, ["q_proj", "v_proj", "down_proj"], max_loras=2, max_rank=8)
    for name, path in paths.items():
        by_hand.load_adapter(name, path)
    with mlora.route(["a", None, "b"]), by_hand.route(["a", None, "b"]):
        torch.testing.assert_close(model(IDS), hand(IDS), rtol=0, atol=0)


@torch.no_grad()
def test_adapters_loaded_later_wrap_what_they_add(tmp_path):
    model = TinyDecoder(CONFIG)
    mlora = MultiLoRA.from_adapters(model, {"a": _adapter(tmp_path, "a")}, max_loras=2)
    with mlora.route(["a", None, None]):
        before = model(IDS)
    with pytest.raises(ValueError, match="rank 8, more than max_rank = 4.*pass a larger max_rank"):
        mlora.load_adapter("big", _adapter(tmp_path, "big", r=8))
    mlora.load_adapter("k", _adapter(tmp_path, "k", modules=("k_proj", "lm_head")))
    assert "model.layers.1.self_attn.k_proj" in mlora.wrapped and "lm_head" in mlora.wrapped
    with mlora.route(["a", None, "k"]):
        after = model(IDS)
    torch.testing.assert_close(after[:2], before[:2], rtol=0, atol=0)  # the new wrappers hold zeros for "a"
    assert not torch.equal(after[2], before[2])
    mlora.unload_adapter("k")
    mlora.enable_graph(15)
    with pytest.raises(ValueError, match="in graph mode the wrapped modules are fixed"):
        mlora.load_adapter("o", _adapter(tmp_path, "o", modules=("o_proj",)))


def test_from_adapters_warns_about_targets_without_weights(tmp_path):
    path = _adapter(tmp_path, "a", modules=("q_proj",), target_modules=["q_proj", "k_proj"])
    with pytest.warns(UserWarning, match=r"target_modules match 2 module\(s\) it holds no LoRA weights for "
                                         r"\(model.layers.0.self_attn.k_proj, model.layers.1.self_attn.k_proj\)"):
        mlora = MultiLoRA.from_adapters(TinyDecoder(CONFIG), {"a": path})
    assert all(name.endswith("q_proj") for name in mlora.wrapped)
    with pytest.raises(TypeError, match="must map adapter names"):
        MultiLoRA.from_adapters(TinyDecoder(CONFIG), [path])


class Conv1D(nn.Module):
    """transformers' Conv1D, duck-typed (lora_layers never imports transformers): weight (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


@torch.no_grad()
def test_a_conv1d_is_wrapped_like_a_linear_of_its_transposed_weight(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("c_attn", Conv1D(48, 16))
    assert is_conv1d(model.c_attn) and not is_conv1d(nn.Linear(2, 2))
    assert LAYER_TYPES.index(Conv1DWithLoRA) < len(LAYER_TYPES) - 1
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 16, generator=g), torch.randn(48, 4, generator=g)
    path = save_peft_adapter(tmp_path / "c", {"c_attn": (a, b)}, lora_alpha=8)
    mlora = MultiLoRA.from_adapters(model, {"c": path})
    assert isinstance(model.c_attn, Conv1DWithLoRA)
    x = torch.randn(2, 3, 16)
    base = x @ mlora.wrapped["c_attn"].base_layer.weight + mlora.wrapped["c_attn"].base_layer.bias
    with mlora.route(["c", None]):
        out = model(x)
    torch.testing.assert_close(out[1], base[1])
    torch.testing.assert_close(out[0], base[0] + 2.0 * x[0] @ a.T @ b.T)


def test_eviction_counts_a_mixs_adapters_as_used_and_keeps_those_of_an_active_mix(tmp_path):
    """A weighted mix uses each of its adapters: set_batch records them for LRU, and an active route's mix
    protects them from eviction."""
    path = _adapter(tmp_path, "c")
    model, mlora = _served(tmp_path, eviction="lru")
    mlora.load_adapter("c", path)
    mlora.set_batch([1, 1], ["a", {"b": 0.5, "c": 0.5}])
    mlora.set_batch([1], [{"c": 1.0, "a": 0.2}])
    assert mlora.load_adapter("d", path) == 1  # b, used only in the older mix, least recently
    with mlora.route([{"a": 0.5, "d": 0.5}, "c"]):
        with pytest.raises(RuntimeError, match="hold adapters of the active route"):
            mlora.load_adapter("e", path)
    with mlora.route([[("a", 0.5), ("d", 0.5)]]):
        assert mlora.load_adapter("e", path) == 2  # c is not in the route
