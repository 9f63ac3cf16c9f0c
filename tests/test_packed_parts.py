"""A fused projection of any number of parts loads PEFT adapters trained on the separate
projections: q/k/v plus an output gate (``g_proj``, as in gated attention blocks) fused into
one ``qkvg_proj`` of four uneven slices, served by MultiLoRA, against PEFT's own mixed-batch
forward of the unfused model, on every backend and device parameter (graph devices capture
with batch A and replay batch B)."""

import warnings

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft", reason="the PEFT comparison needs peft (tests/requirements.txt)")

from lora_core import available_backends  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA  # noqa: E402

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 24, 4, 2, 8
PARTS = {"q_proj": HEADS * HEAD_DIM, "k_proj": KV_HEADS * HEAD_DIM, "v_proj": KV_HEADS * HEAD_DIM,
         "g_proj": HEADS * HEAD_DIM}  # slice widths 32, 16, 16, 32
PACKED = {"qkvg_proj": list(PARTS)}
ADAPTERS = {  # "qv" trains only two of the four parts: the others get no delta from it
    "all": dict(r=4, lora_alpha=8, target_modules=[*PARTS, "o_proj"]),
    "qv": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "patterns": dict(r=6, lora_alpha=12, target_modules=[*PARTS, "lm_head"], rank_pattern={"g_proj": 2},
                     alpha_pattern={"k_proj": 3}),
}
BATCH_A = ([4, 4, 4, 4], ["all", None, "patterns", "qv"])  # equal lengths: PEFT's batched mixed forward
BATCH_B = ([2, 9, 1, 4], ["qv", "all", None, "patterns"])


class GatedAttention(nn.Module):
    """Token-wise stand-in for a gated attention block: ``o_proj(sigmoid(q*k) * v * sigmoid(g))``,
    with q, k, v and g either four linears or one fused ``qkvg_proj``."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        if fused:
            self.qkvg_proj = nn.Linear(HIDDEN, sum(PARTS.values()), bias=False)
            self.qkvg_proj.output_sizes = tuple(PARTS.values())
        else:
            for name, width in PARTS.items():
                setattr(self, name, nn.Linear(HIDDEN, width, bias=False))
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        if hasattr(self, "qkvg_proj"):
            q, k, v, g = self.qkvg_proj(x).split(tuple(PARTS.values()), dim=-1)
        else:
            q, k, v, g = (getattr(self, name)(x) for name in PARTS)
        group = HEADS // KV_HEADS
        k, v = k.repeat_interleave(group, dim=-1), v.repeat_interleave(group, dim=-1)
        return self.lm_head(x + self.o_proj(torch.sigmoid(q * k) * v * torch.sigmoid(g)))


def _fused_copy(unfused: GatedAttention) -> GatedAttention:
    state = unfused.state_dict()
    state["qkvg_proj.weight"] = torch.cat([state.pop(f"{name}.weight") for name in PARTS])
    fused = GatedAttention(fused=True)
    fused.load_state_dict(state)
    return fused


@pytest.fixture(scope="module")
def models_and_adapters(tmp_path_factory):
    torch.manual_seed(0)
    base = GatedAttention(fused=False)
    for p in base.parameters():
        nn.init.normal_(p, std=p.shape[1] ** -0.5 if p.shape[0] != VOCAB or p.dim() != 2 else 1.0)
    fused = _fused_copy(base)
    names = list(ADAPTERS)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[names[0]]),
                                adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[name]))
    model.eval()
    out = tmp_path_factory.mktemp("adapters")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not a transformers model" notices
        model.save_pretrained(str(out), selected_adapters=names)
    return model, fused, out


def _peft_logits(model, ids, seq_lens, adapters):
    names = [a or "__base__" for a in adapters]
    with torch.no_grad():
        if len(set(seq_lens)) == 1:
            return model(ids.view(len(seq_lens), seq_lens[0]), adapter_names=names).reshape(-1, VOCAB)
        parts, start = [], 0
        for n, name in zip(seq_lens, names):
            parts.append(model(ids[start : start + n][None], adapter_names=[name])[0])
            start += n
        return torch.cat(parts)


def test_the_fused_copy_is_the_same_model(models_and_adapters):
    peft_model, fused, _ = models_and_adapters
    ids = torch.arange(VOCAB)
    with torch.no_grad(), peft_model.disable_adapter():
        torch.testing.assert_close(fused(ids), peft_model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("backend", available_backends())
def test_a_four_part_fused_projection_loads_adapters_of_the_separate_parts(device, backend, models_and_adapters):
    peft_model, fused, adapter_dir = models_and_adapters
    import copy

    model = copy.deepcopy(fused).to(device.torch_device)
    mlora = MultiLoRA(model, ["qkvg_proj", "o_proj", "lm_head"], max_loras=4, max_rank=8, backend=backend,
                      packed_modules=PACKED)
    for name in ADAPTERS:
        mlora.load_adapter(name, adapter_dir / name)
    wrapped = model.qkvg_proj
    assert wrapped.num_slices == 4 and wrapped.buffers.slice_offsets == (0, 32, 48, 64, 96)
    T = sum(BATCH_A[0])
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(1))
    if device.is_graph:
        mlora.enable_graph(T)
    mlora.set_batch(*BATCH_A)
    out_a, out_b = device.run_two_batches(model, [ids.to(device.torch_device)], lambda: mlora.set_batch(*BATCH_B))
    rtol, atol = TOLERANCES[torch.float32]
    for out, batch in [(out_a, BATCH_A), (out_b, BATCH_B)]:
        expected = _peft_logits(peft_model, ids, *batch)
        torch.testing.assert_close(out.cpu(), expected, rtol=rtol, atol=atol)
    with torch.no_grad(), peft_model.disable_adapter():  # the adapters change the output: the test can fail
        assert not torch.allclose(_peft_logits(peft_model, ids, *BATCH_A), out_a.cpu(), rtol=rtol, atol=atol)
