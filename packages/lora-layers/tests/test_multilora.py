"""MultiLoRA and the wrappers: shapes, the LM head views, graph refill, and errors that name the problem."""

import pytest
import torch
from torch import nn

from lora_core import save_peft_adapter
from lora_core.reference import reference_lm_head
from lora_layers import LMHeadWithLoRA, LoRAContext, MultiLoRA, TinyConfig, TinyDecoder
from lora_cuda import TorchNativeBackend

CONFIG = TinyConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1)


def _adapter(tmp_path, name, r=4, modules=("q_proj", "v_proj"), shape_in=16, **kw):
    g = torch.Generator().manual_seed(len(name))
    weights = {}
    for m in modules:
        out = {"q_proj": 16, "v_proj": 8, "lm_head": 40}.get(m, 16)
        weights[f"model.layers.0.self_attn.{m}" if m.endswith("proj") else m] = (
            torch.randn(r, shape_in, generator=g), torch.randn(out, r, generator=g))
    return save_peft_adapter(tmp_path / name, weights, lora_alpha=2 * r, **kw)


def _mlora(**kw):
    model = TinyDecoder(CONFIG)
    return model, MultiLoRA(model, ["q_proj", "v_proj", "lm_head"], max_loras=2, max_rank=8, **kw)


def test_leading_dims_are_kept_and_base_rows_match_the_base_model(tmp_path):
    model, mlora = _mlora()
    ids = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        base = TinyDecoder(CONFIG)(ids)
        mlora.load_adapter("a", _adapter(tmp_path, "a"))
        mlora.set_batch([6, 6], [None, "a"])
        out = model(ids)
    assert out.shape == (2, 6, 40)
    torch.testing.assert_close(out[0], base[0])
    assert not torch.allclose(out[1], base[1])


def test_lm_head_accepts_every_token_or_the_last_of_each_request():
    ctx = LoRAContext(TorchNativeBackend(), num_slots=2, max_rank=4, dtype=torch.float32, device="cpu")
    head = LMHeadWithLoRA(nn.Linear(8, 10, bias=False), ctx)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 8, generator=g), torch.randn(10, 3, generator=g)
    head.set_lora(1, [(a, b)])
    from lora_core import build_batch_info

    info = build_batch_info([3, 0, 2], [1, 0, None], [0, 3], [0.0, 2.0], device="cpu")
    ctx.backend.prepare_batch(info)
    for rows, pruned in [(5, False), (2, True)]:
        hidden = torch.randn(rows, 8, generator=g)
        expected = reference_lm_head(hidden, head.base_layer.weight, head.buffers.a, head.buffers.b, info, pruned)
        torch.testing.assert_close(head(hidden), expected)
    with pytest.raises(ValueError, match=r"got 3 rows; expected every token \(5\) or the last token of each request \(2\)"):
        head(torch.randn(3, 8))


def test_graph_mode_refills_one_batch_in_place(tmp_path):
    model, mlora = _mlora()
    mlora.load_adapter("a", _adapter(tmp_path, "a"))
    info = mlora.enable_graph(8)
    ptr = info.token_slots.data_ptr()
    assert mlora.set_batch([3, 5], ["a", None]) is info and info.token_slots.data_ptr() == ptr
    assert info.token_slots.tolist() == [0, 0, 0, -1, -1, -1, -1, -1]
    mlora.load_adapter("b", _adapter(tmp_path, "b", r=2))
    assert info.lora_ranks.tolist() == [4, 2]


def test_unload_frees_the_slot_and_zeroes_it(tmp_path):
    model, mlora = _mlora()
    slot = mlora.load_adapter("a", _adapter(tmp_path, "a"))
    mlora.unload_adapter("a")
    assert mlora.slots.loaded == {} and not mlora.wrapped["model.layers.0.self_attn.q_proj"].buffers.a[slot].any()
    assert mlora.load_adapter("b", _adapter(tmp_path, "b")) == slot


def test_errors_name_the_problem(tmp_path):
    model, mlora = _mlora()
    mlora.load_adapter("a", _adapter(tmp_path, "a"))
    mlora.load_adapter("b", _adapter(tmp_path, "b"))
    with pytest.raises(RuntimeError, match=r"all 2 adapter slots are in use \(a, b\)"):
        mlora.load_adapter("c", _adapter(tmp_path, "c"))
    mlora.unload_adapter("b")
    with pytest.raises(ValueError, match="rank 16, more than max_rank = 8"):
        mlora.load_adapter("big", _adapter(tmp_path, "big", r=16))
    with pytest.raises(ValueError, match="targets 'model.layers.0.self_attn.k_proj', which is not wrapped"):
        mlora.load_adapter("k", _adapter(tmp_path, "k", modules=("k_proj",)))
    with pytest.raises(ValueError, match=r"does not fit module 'model.layers.0.self_attn.q_proj'.*lora_a\[0\] must have shape"):
        mlora.load_adapter("w", _adapter(tmp_path, "w", shape_in=7))
    assert mlora.slots.loaded == {"a": 0}  # failed loads leave nothing behind
    with pytest.raises(ValueError, match=r"adapter 'nope' is not loaded \(loaded: a\)"):
        mlora.set_batch([2], ["nope"])
    with pytest.raises(ValueError, match="x has 4 rows but the batch info was built for 3 tokens"):
        mlora.set_batch([1, 2], ["a", None])
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target_modules \['nope'\] match no submodule"):
        MultiLoRA(TinyDecoder(CONFIG), ["nope"])
    with pytest.raises(ValueError, match="unknown LoRA backend 'cutlass'"):
        MultiLoRA(TinyDecoder(CONFIG), ["q_proj"], backend="cutlass")
    with pytest.raises(RuntimeError, match="call MultiLoRA.set_batch"):
        _mlora()[0](torch.zeros(2, dtype=torch.long))


def test_unwrap_restores_the_original_modules():
    model = TinyDecoder(CONFIG)
    original = model.model.layers[0].self_attn.q_proj
    mlora = MultiLoRA(model, ["q_proj", "embed_tokens"])
    assert model.model.layers[0].self_attn.q_proj is not original
    mlora.unwrap()
    assert model.model.layers[0].self_attn.q_proj is original


def test_a_backend_instance_must_live_where_the_model_does():
    model = TinyDecoder(CONFIG)
    with pytest.raises(ValueError, match="backend runs on meta but the model's LoRA buffers live on cpu"):
        MultiLoRA(model, ["q_proj"], backend=TorchNativeBackend("meta"))
    mlora = MultiLoRA(model, ["q_proj"], backend=TorchNativeBackend("cpu", graph_kernel="blocked"))
    assert mlora.backend.graph_kernel == "blocked"


@pytest.mark.parametrize("name", ["cpu", "cpu:0", torch.device("cpu", 0)], ids=str)
def test_every_name_of_a_device_resolves_to_the_device_its_tensors_report(name):
    """The backend, the layers' context and MultiLoRA keep the device tensors made there report
    (``cpu`` for ``cpu:0``; ``cuda:0`` for ``cuda`` on a GPU host), so nothing compares unequal."""
    backend = TorchNativeBackend(name)
    ctx = LoRAContext(backend, num_slots=2, max_rank=4, dtype=torch.float32, device=name)
    mlora = MultiLoRA(TinyDecoder(CONFIG), ["q_proj"], backend=backend, device=name)
    tensor_device = torch.empty(0, device=name).device
    assert backend.device == ctx.device == mlora.context.device == tensor_device
