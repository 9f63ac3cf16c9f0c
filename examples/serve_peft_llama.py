"""Serve three PEFT adapters and the base model in one batch of a transformers Llama, offline.

Builds a tiny random ``LlamaForCausalLM`` (no download, no end-of-sequence token,
so every row generates every token), trains nothing but saves three PEFT adapters
with random weights (attention r=8; MLP r=16 with the
embedding and the LM head; rsLoRA r=4), then:

1. wraps a copy of the base model with ``MultiLoRA.from_adapters`` (the modules
   come from the adapters' ``target_modules``; no list typed by hand);
2. runs greedy ``model.generate()`` on four left-padded prompts, one per adapter
   and one on the base model, inside ``mlora.route([...])``;
3. runs PEFT's own ``generate(..., adapter_names=[...])`` on the same prompts,
   and checks the tokens are the same, on every installed backend.

    python examples/serve_peft_llama.py          # exit status 0 when every backend matches PEFT
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lora_core import available_backends
from lora_layers import MultiLoRA

ADAPTERS = {
    "sql": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False),
    "chat": LoraConfig(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"],
                       init_lora_weights=False),
    "math": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"],
                       init_lora_weights=False),
}
ROUTE = ["sql", None, "chat", "math"]  # one adapter per prompt; None: the base model


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def save_adapters(base: LlamaForCausalLM, directory: Path):
    """The PEFT model with the three adapters, and name -> adapter directory."""
    names = list(ADAPTERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notice that it saves the embedding layers too
        peft_model = get_peft_model(copy.deepcopy(base), ADAPTERS[names[0]], adapter_name=names[0])
        for name in names[1:]:
            peft_model.add_adapter(name, ADAPTERS[name])
        with torch.no_grad():  # B at the scale of the base weights (initializer_range 0.02): steer, not swamp
            for param_name, param in peft_model.named_parameters():
                if "lora_B" in param_name or "lora_embedding_B" in param_name:
                    param.mul_(0.05)
        peft_model.eval().save_pretrained(str(directory), selected_adapters=names)
    return peft_model, {name: directory / name for name in names}


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompts of 7 tokens, two of them left-padded to that length."""
    ids = torch.randint(3, 128, (len(ROUTE), 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, pad in [(1, 3), (3, 1)]:
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    base = tiny_llama()
    ids, mask = prompts()
    with tempfile.TemporaryDirectory(prefix="serve-peft-") as tmp:
        peft_model, paths = save_adapters(base, Path(tmp))
        expected = peft_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                       do_sample=False, adapter_names=[a or "__base__" for a in ROUTE])
        ok = True
        for backend in available_backends():
            model = copy.deepcopy(base)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ignoring base-model weights saved with the adapter"
                mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
            with mlora.route(ROUTE):
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                     do_sample=False)
            same = torch.equal(out, expected)
            ok &= same
            print(f"{backend}: wrapped {len(mlora.wrapped)} modules, adapters {mlora.adapters}, "
                  f"max_rank {mlora.slots.max_rank}; tokens {'match' if same else 'DIFFER FROM'} PEFT's")
            for adapter, row in zip(ROUTE, out[:, ids.shape[1]:].tolist()):
                print(f"  {adapter or 'base':>5}: {row}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
