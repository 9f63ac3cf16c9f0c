"""Request scales and weighted mixes (issue #40, parts 1 and 2): one multiplier per request on top of
its slot's scaling, and a request naming several slots with weights (``sum_i w_i * delta_i``), through
every backend op, against lora_core's reference math on every device parameter, both backends.

Batches mix scales of 0, 1 and strengths in (0, 2], ranks of 0, slots of -1 and garbage beyond each
rank; with ``mixed``, about a third of A's requests and half of B's are mixes of 1 to 3 slots
(weights 0, 1 and in (0, 1.5], dicts and lists of pairs), whose further slots run on pair rows: the
reference (``lora_core.reference.adapter_rows``) walks each request's mix independently of the rows'
device layout. Graph devices capture batch A and replay batch B (other requests, other scales and
mixes) and the reverse, the compile device runs B on the code compiled for A (no recompile). The
mixes' own checks (launches, refusals, capacity) are in tests/test_request_mixes.py.
"""

import copy
import importlib.util
import json
import random
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lora_core import available_backends, build_batch_info, get_backend
from lora_core.reference import (
    num_pair_rows,
    reference_lm_head,
    reference_lora_a,
    reference_lora_a_embedding,
    reference_lora_b,
)
from lora_core.reference_experts import reference_experts_lora, reference_experts_lora_a
from lora_core.testing import (
    BatchPair,
    assert_close_to_reference,
    count_launches,
    random_batch_pair,
    random_embedding_weights,
    random_linear_weights,
    random_ranks,
)
from lora_core.testing.expert_cases import random_expert_ids, random_expert_weights

BACKENDS = available_backends()
ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16]
MIXED = pytest.mark.parametrize("mixed", [False, True], ids=["one-slot-each", "mixes"])


def _rows(out, num_tokens, ref_info):
    """A shrink's output without graph-mode padding: its token rows, then the batch's pair rows (none
    without mixes)."""
    return torch.cat([out[:num_tokens], out[num_tokens : num_tokens + num_pair_rows(ref_info)]])


def _linear_case(seed, dtype, device, num_slices, mixed=False):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    L, R, T = rng.randint(2, 5), rng.choice([4, 8]), rng.randint(6, 40)
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks, scaled=True, mixed=mixed)
    widths = [rng.randint(3, 24) for _ in range(num_slices)]
    a, b, offsets = random_linear_weights(gen, num_slots=L, max_rank=R, in_features=rng.randint(4, 48),
                                          slice_widths=widths, lora_ranks=ranks, dtype=dtype,
                                          device=device.torch_device)
    x = torch.randn(T, a.shape[2], generator=gen).to(device.torch_device, dtype)
    base = torch.randn(T, offsets[-1], generator=gen).to(device.torch_device, dtype)
    return pair, a, b, offsets, x, base


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("seed", range(3))
@MIXED
def test_packed_projection_and_shrink_apply_each_requests_scale_and_mix(device, backend_name, dtype, num_slices,
                                                                         seed, mixed):
    pair, a, b, offsets, x, base = _linear_case(seed * 7 + num_slices + 11 * mixed, dtype, device, num_slices, mixed)
    backend = get_backend(backend_name)(device.torch_device)

    def layer(info, x, base):
        backend.prepare_batch(info)
        return backend.run_lora_a(x, a, num_slices), backend.run_packed(x, a, b, offsets, base.clone())

    outs = pair.run(device, layer, x, base)
    for (shrunk, out), ref in zip(outs, pair.reference_infos()):
        want_shrunk = reference_lora_a(x, a, ref, num_slices)
        assert_close_to_reference(_rows(shrunk, x.shape[0], ref), want_shrunk, dtype)
        assert_close_to_reference(out, base.float().cpu() + reference_lora_b(want_shrunk, b, ref, offsets), dtype)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("pruned", [False, True], ids=["every-token", "last-tokens"])
@pytest.mark.parametrize("seed", range(2))
@MIXED
def test_lm_head_applies_each_requests_scale_and_mix_to_its_rows(device, backend_name, pruned, seed, mixed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ranks = random_ranks(rng, 3, 8)
    lens_a, lens_b = [3, 1, 4, 2], [2, 2, 5, 1]  # non-empty requests: the pruned rows are one per request
    slots_a, slots_b = ([{0: 0.7, 2: 0.3}, None, 2, [(1, 1.0), (2, 0.5), (0, 1.2)]],
                        [2, {1: 0.25}, [(0, 0.5), (1, 0.5)], 0]) if mixed else ([0, None, 2, 1], [2, 1, 0, 0])
    pair = BatchPair(ranks, (lens_a, slots_a, [0.3, 1.0, 0.0, 1.7]), (lens_b, slots_b, [1.0, 0.5, 2.0, 0.0]))
    rows = 4 if pruned and not device.is_graph else sum(lens_a)  # a capture takes the capacity's rows
    a, b, _ = random_linear_weights(gen, num_slots=3, max_rank=8, in_features=16, slice_widths=[24],
                                    lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    hidden = torch.randn(rows, 16, generator=gen).to(device.torch_device)
    weight = torch.randn(24, 16, generator=gen).to(device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)

    def head(info, hidden):
        backend.prepare_batch(info)
        return backend.run_lm_head(hidden, a, b, hidden @ weight.T, pruned=pruned)

    real = 4 if pruned else rows  # the pruned rows: one per request, then the capture's padding
    for out, ref in zip(pair.run(device, head, hidden), pair.reference_infos()):
        want = reference_lm_head(hidden[:real], weight, a, b, ref, pruned)
        assert_close_to_reference(out[:real], want, torch.float32)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("seed", range(2))
@MIXED
def test_embedding_applies_each_requests_scale_and_mix(device, backend_name, seed, mixed):
    rng, gen = random.Random(seed + 5 * mixed), torch.Generator().manual_seed(seed)
    ranks = random_ranks(rng, 4, 8)
    V, T, D = 50, 24, 12
    pair = random_batch_pair(rng, T, ranks, scaled=True, mixed=mixed)
    a, b = random_embedding_weights(gen, num_slots=4, max_rank=8, vocab_total=V, embedding_dim=D,
                                    lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    ids = torch.randint(-2, V + 2, (T,), generator=gen).to(device.torch_device)  # out-of-vocab ids too
    base = torch.randn(T, D, generator=gen).to(device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)

    def embedding(info, ids, base):
        backend.prepare_batch(info)
        shrunk = backend.run_lora_a_embedding(ids, a, V)
        return shrunk, backend.run_lora_b(shrunk, b, (0, D), base.clone())

    for (shrunk, out), ref in zip(pair.run(device, embedding, ids, base), pair.reference_infos()):
        want = reference_lora_a_embedding(ids, a, ref, V)
        assert_close_to_reference(_rows(shrunk, T, ref), want, torch.float32)
        assert_close_to_reference(out, base.cpu() + reference_lora_b(want, b, ref, (0, D)), torch.float32)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("seed", range(2))
@MIXED
def test_experts_apply_each_requests_scale_and_mix(device, backend_name, top_k, seed, mixed):
    rng, gen = random.Random(seed + 9 * mixed), torch.Generator().manual_seed(seed)
    L, E, R, T, H, out_features = 3, 4, 8, 18, 12, 10
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks, scaled=True, mixed=mixed)
    a, b = random_expert_weights(gen, num_slots=L, num_experts=E, max_rank=R, in_features=H,
                                 out_features=out_features, lora_ranks=ranks, dtype=torch.float32,
                                 device=device.torch_device)
    ids = random_expert_ids(rng, gen, T, top_k, E).to(device.torch_device)
    x = torch.randn(T, top_k, H, generator=gen).to(device.torch_device)
    base = torch.randn(T, top_k, out_features, generator=gen).to(device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)

    def experts(info, x, base):
        backend.prepare_batch(info)
        return backend.run_experts_lora_a(x, ids, a), backend.run_experts_lora(x, ids, a, b, base.clone())

    for (shrunk, out), ref in zip(pair.run(device, experts, x, base), pair.reference_infos()):
        assert_close_to_reference(_rows(shrunk, T, ref), reference_experts_lora_a(x, ids, a, ref), torch.float32)
        assert_close_to_reference(out, base.float().cpu() + reference_experts_lora(x, ids, a, b, ref), torch.float32)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_scale_of_zero_gives_exactly_the_base_output(device, backend_name):
    """A request at scale 0 gets its base rows back bit for bit, beside requests with a delta."""
    gen = torch.Generator().manual_seed(0)
    ranks = [4, 8]
    pair = BatchPair(ranks, ([3, 2, 4], [0, 1, 1], [0.0, 1.0, 0.0]), ([4, 3, 2], [1, 0, 1], [0.5, 0.0, 0.0]))
    a, b, offsets = random_linear_weights(gen, num_slots=2, max_rank=8, in_features=16, slice_widths=[12, 8],
                                          lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    x = torch.randn(9, 16, generator=gen).to(device.torch_device)
    base = torch.randn(9, 20, generator=gen).to(device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)

    def layer(info, x, base):
        backend.prepare_batch(info)
        return backend.run_packed(x, a, b, offsets, base.clone())

    out_a, out_b = pair.run(device, layer, x, base)
    base = base.cpu()
    assert torch.equal(out_a.cpu()[:3], base[:3]) and torch.equal(out_a.cpu()[5:], base[5:])
    assert not torch.equal(out_a.cpu()[3:5], base[3:5])
    assert torch.equal(out_b.cpu()[4:], base[4:]) and not torch.equal(out_b.cpu()[:4], base[:4])


def _packed_launches(backend_name):
    """``launches(seq_lens, slot_ids, rows=9, **batch)``: what ``run_packed`` launches on the first ``rows`` of
    one packed projection's inputs (3 slots of ranks 4, 8 and 0, two slices) for that batch."""
    gen = torch.Generator().manual_seed(0)
    ranks = [4, 8, 0]
    a, b, offsets = random_linear_weights(gen, num_slots=3, max_rank=8, in_features=16, slice_widths=[12, 8],
                                          lora_ranks=ranks, dtype=torch.float32, device="cpu")
    x, base = torch.randn(12, 16, generator=gen), torch.randn(12, 20, generator=gen)
    backend = get_backend(backend_name)("cpu")

    def launches(seq_lens, slot_ids, rows=9, **batch):
        backend.prepare_batch(build_batch_info(seq_lens, slot_ids, ranks, [2.0, 0.5, 1.0], device="cpu", **batch))
        return count_launches(lambda: backend.run_packed(x[:rows], a, b, offsets, base[:rows].clone()))
    return launches


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_batch_without_scales_launches_what_it_did_before(backend_name):
    """Every scale 1 (or none given): no multiply is launched; request scales cost one elementwise
    product of the shrink's ``T x c*R`` output per op, and no matrix product grows."""
    launches = _packed_launches(backend_name)
    plain, ones = launches([3, 2, 4], [0, 1, None]), launches([3, 2, 4], [0, 1, None], scales=[1.0, 1, 1.0])
    scaled = launches([3, 2, 4], [0, 1, None], scales=[0.5, 1.0, 0.0])
    forced = launches([3, 2, 4], [0, 1, None], with_scales=True)
    assert ones.ops == plain.ops and ones.by_op == plain.by_op
    assert scaled.ops == forced.ops == plain.ops + 1
    assert scaled.matmul_macs == plain.matmul_macs and scaled.host_reads == plain.host_reads


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_mix_runs_the_matrix_products_of_its_pair_rows_as_requests_and_a_batch_without_mixes_none(backend_name):
    """A batch without mixes (a one-slot mix included) launches what it did. A mixed batch runs each
    kernel once over its token rows and pair rows: the matrix products of the same rows served as
    requests of their own (not every adapter on every token), and, since its kernels read ``x`` and add
    their deltas by each row's token row, launches only the two gathers of those rows' indices more
    (tests/test_pair_row_kernels.py), and no host read."""
    launches = _packed_launches(backend_name)
    plain = launches([3, 2, 4], [0, 1, None])
    one_slot_mix = launches([3, 2, 4], [{0: 1.0}, 1, None])
    assert one_slot_mix.ops == plain.ops and one_slot_mix.by_op == plain.by_op
    mixed = launches([3, 2, 4], [{0: 0.5, 1: 1.0}, 1, None])  # 3 pair rows of slot 1, reading rows 0-2
    as_requests = launches([3, 2, 4, 3], [0, 1, None, 1], rows=12, scales=[0.5, 1.0, 1.0, 1.0])
    assert mixed.matmul_macs == as_requests.matmul_macs > plain.matmul_macs
    assert mixed.ops == as_requests.ops + 2 and mixed.host_reads == plain.host_reads == 0


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_the_experts_op_checks_b_against_a_with_request_scales_too(backend_name):
    """With request scales the fused experts op runs as its halves; A's and B's expert counts are still
    checked against each other (the halves alone would give the missing experts' pairs no delta)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 4, 4, 8, generator=gen), torch.randn(2, 2, 6, 4, generator=gen)  # B: 2 experts, A: 4
    x, ids = torch.randn(3, 2, 8, generator=gen), torch.tensor([[0, 3], [1, 2], [3, 0]])
    backend = get_backend(backend_name)("cpu")
    for scales in (None, [0.5, 1.0]):
        backend.prepare_batch(build_batch_info([2, 1], [0, 1], [4, 2], [1.0, 2.0], device="cpu", scales=scales))
        with pytest.raises(ValueError, match=r"b_weights must have shape \(2, 4, out, 4\)"):
            backend.run_experts_lora(x, ids, a, b)


def test_scales_as_a_tensor_or_an_array_route_and_reuse_their_cached_batch(tmp_path):
    """``route`` takes the host sequences ``set_batch`` takes (a CPU tensor, a NumPy array), and an
    eager batch given scales as a tensor is found in the batch cache by their values."""
    from lora_core import save_peft_adapter
    from lora_layers import MultiLoRA, TinyConfig, TinyDecoder

    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1)).eval()
    mlora = MultiLoRA(model, ["q_proj"], max_loras=1, max_rank=4)
    q = model.model.layers[0].self_attn.q_proj
    mlora.load_adapter("a", save_peft_adapter(tmp_path / "a", {"model.layers.0.self_attn.q_proj": (
        torch.randn(4, q.in_features), torch.randn(q.out_features, 4))}, r=4, lora_alpha=4))
    ids = torch.randint(0, 32, (2, 3))
    outs = []
    for scales in ([0.5, 0.0], torch.tensor([0.5, 0.0]), np.array([0.5, 0.0])):
        with mlora.route(["a", "a"], scales), torch.no_grad():
            outs.append(model(ids))
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    first = mlora.set_batch([3, 3], ["a", "a"], torch.tensor([0.5, 0.0]))
    assert mlora.set_batch([3, 3], ["a", "a"], torch.tensor([0.5, 0.0])) is first


@pytest.mark.parametrize("scales, message", [
    ([1.0, -0.5], r"scales\[1\] \(request 1\) must be >= 0, got -0.5"),
    ([float("nan"), 1.0], r"scales\[0\] \(request 0\) must be a finite float, got nan"),
    ([1.0, float("inf")], r"scales\[1\] \(request 1\) must be a finite float, got inf"),
    ([1.0, 1e39], r"scales\[1\] \(request 1\) must be finite in float32"),
    ([1.0, "0.5"], r"scales\[1\] \(request 1\) must be a finite float, got '0.5'"),
    ([1.0], r"scales must have one entry per request; got 1 for 2 requests"),
])
def test_bad_scales_are_refused_naming_the_request(scales, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        build_batch_info([2, 3], [0, None], [4], [1.0], device="cpu", scales=scales)


def test_a_graph_batch_takes_scales_only_when_built_with_them():
    graph = build_batch_info([4], [0], [4], [1.0], device="cpu", use_graph=True, max_tokens=8)
    graph.refill([2, 2], [0, None], scales=[1.0, 1.0])  # all 1: nothing to apply
    with pytest.raises(ValueError, match=r"^scales: this graph-mode batch was built without request scales.*"
                                         r"build it with with_scales=True$"):
        graph.refill([2, 2], [0, None], scales=[0.5, 1.0])
    assert graph.request_scales == (1.0, 1.0)  # the rejected refill changed nothing
    with pytest.raises(ValueError, match=r"^scales: a graph-mode batch applies request scales only when built "
                                         r"with with_scales=True"):
        build_batch_info([4], [0], [4], [1.0], device="cpu", use_graph=True, max_tokens=8, scales=[0.5])
    scaled = build_batch_info([4], [0], [4], [1.0], device="cpu", use_graph=True, max_tokens=8, with_scales=True)
    scaled.refill([3, 1], [0, 0], scales=[0.25, 2.0])
    assert scaled.token_scales_cpu.tolist() == [0.25] * 3 + [2.0] + [0.0] * 4
    assert scaled.lm_head_view(pruned=True).token_scales_cpu[:2].tolist() == [0.25, 2.0]


def test_the_request_scales_benchmark_checks_then_times_every_variant(capsys, tmp_path):
    """examples/bench_request_scales.py in smoke sizes: its checks pass (scales of 1 change nothing
    beyond rounding; scale 0 equals the base row) and it reports every variant's ratio."""
    path = ROOT / "examples" / "bench_request_scales.py"
    spec = importlib.util.spec_from_file_location("example_bench_request_scales", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^decode \(8 x 1 tokens\), time / no scales: scales, all 1 \d+\.\d{3} \(", out, re.M), out
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert set(results) == {"decode", "prefill"}
    assert all(len(figure["samples"]) == 3 for phase in results.values() for figure in phase.values())


def doc_example_namespace(tmp_path, doc):
    """``docs/<doc>``'s python block run on a tiny Llama with two PEFT adapters, "style" and "math" (on
    ``q_proj`` and ``v_proj``), loaded as the docs name them: the block's namespace."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
    peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")
    from lora_layers import MultiLoRA

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, pad_token_id=0)).eval()
    for name in ("style", "math"):
        peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).save_pretrained(str(tmp_path / name))
    mlora = MultiLoRA.from_adapters(model, {"style": tmp_path / "style", "math": tmp_path / "math"})
    (code,) = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / doc).read_text(), re.S)
    namespace = {"model": model, "mlora": mlora, "input_ids": torch.randint(3, 64, (3, 4)), "torch": torch}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, f"docs/{doc}", "exec"), namespace)
    return namespace


def test_the_example_of_request_scales_md_runs(tmp_path):
    """docs/request-scales.md's block, on a tiny Llama with two PEFT adapters named as there."""
    assert doc_example_namespace(tmp_path, "request-scales.md")["out"].shape == (3, 12)
