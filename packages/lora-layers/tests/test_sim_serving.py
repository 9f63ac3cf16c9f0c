"""What lora-sim wraps and its merged reference, written once over lora_layers.packing."""

import torch

from lora_layers import TinyConfig, TinyDecoder
from lora_layers.packing import LLAMA_PACKED_MODULES
from lora_layers.sim import make_synthetic_adapters, merged_reference_models
from lora_layers.sim.serving import PROJECTIONS, packed_modules, target_modules


def test_targets_follow_the_packed_map():
    assert target_modules(TinyConfig(fused=True)) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                                      "embed_tokens", "lm_head"]
    assert target_modules(TinyConfig(fused=False)) == [*PROJECTIONS, "embed_tokens", "lm_head"]
    assert packed_modules(TinyConfig(fused=True)) == LLAMA_PACKED_MODULES
    assert packed_modules(TinyConfig(fused=False)) is None


def test_the_merged_reference_of_a_fused_model_matches_the_unfused_one(tmp_path):
    unfused_config = TinyConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                num_key_value_heads=1, fused=False)
    fused_config = TinyConfig(**{**unfused_config.to_dict(), "fused": True})
    paths = make_synthetic_adapters(unfused_config, tmp_path)
    unfused = merged_reference_models(TinyDecoder(unfused_config), paths)
    fused = merged_reference_models(TinyDecoder(fused_config).fuse_from(TinyDecoder(unfused_config)), paths)
    ids = torch.arange(10)
    for name in [None, *paths]:
        torch.testing.assert_close(fused[(name, 1.0)](ids), unfused[(name, 1.0)](ids))
    assert not torch.allclose(unfused[("r16", 1.0)](ids), unfused[(None, 1.0)](ids))
