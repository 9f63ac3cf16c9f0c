"""The CPU graph simulator: every rule, the seed bug reproduced, replay semantics."""

import threading

import pytest
import torch

from lora_core import is_capturing
from lora_core.testing import CaptureError, GraphSimulator, count_launches

x4 = torch.arange(4.0)

RULE_BREAKERS = {
    "tolist": (lambda x: torch.tensor(x.tolist()) * 2, "Tensor.tolist"),
    "numpy": (lambda x: x + float(x.numpy()[0]), "Tensor.numpy"),
    "cpu": (lambda x: x.cpu() + 1, "Tensor.cpu"),
    "to_cpu": (lambda x: x.to("cpu") + 1, r"Tensor.to\('cpu'\)"),
    "item": (lambda x: x * x[0].item(), r"Tensor.item\(\)"),
    "bool": (lambda x: x * 2 if x[0] > 0 else x, r"bool\(tensor\)"),
    "int": (lambda x: x * int(x[1]), r"int\(tensor\)"),
    "float": (lambda x: x * float(x[1]), r"float\(tensor\)"),
    "index": (lambda x: x * [1.0, 2.0, 3.0, 4.0][x[2].long()], "Python index"),
    "slice_by_tensor": (lambda x: x[: x[2].long()], "aten._local_scalar_dense"),
    "repr": (lambda x: (repr(x), x)[1], r"repr\(tensor\)"),
    "format": (lambda x: (f"{x[0]:.1f}", x)[1], "formatting a tensor"),
    "nonzero": (lambda x: x.nonzero(), "aten.nonzero"),
    "masked_select": (lambda x: torch.masked_select(x, x > 1), "aten.masked_select"),
    "bool_mask_index": (lambda x: x[x > 1], "boolean-mask indexing"),
    "bool_mask_assign": (lambda x: x.clone().index_put_((x > 1,), torch.zeros(())), "boolean-mask assignment"),
    "unique": (lambda x: torch.unique(x), "aten._unique2|aten.unique"),
    "equal": (lambda x: x if torch.equal(x, x) else x, "aten.equal"),
    "allclose": (lambda x: x if torch.allclose(x, x) else x, "aten.allclose"),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x, x.long()), "repeat_interleave with tensor repeats"),
    "lift_fresh": (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), "built from Python data"),
    "cuda_synchronize": (lambda x: (torch.cuda.synchronize(), x * 2)[1], r"torch.cuda.synchronize\(\)"),
}


@pytest.mark.parametrize("rule", sorted(RULE_BREAKERS))
def test_strict_mode_rejects_each_rule_and_names_it(rule):
    fn, match = RULE_BREAKERS[rule]
    sim = GraphSimulator(strict=True)
    with pytest.raises(CaptureError, match=match):
        sim.capture(fn, x4.clone())
    assert len(sim.violations) == 1
    assert "test_graphsim.py" in sim.violations[0].where or rule == "cuda_synchronize"


def test_legal_ops_pass_strict_capture():
    def fn(x, slots):
        out = torch.zeros(4, 3)
        out.index_add_(0, torch.arange(4), x[:, None].expand(4, 3))
        rep = torch.repeat_interleave(x, slots, output_size=8)
        return out.sum(1) + rep[:4] + torch.where(slots > 1, x, 0.0)

    sim = GraphSimulator(strict=True)
    sim.capture(fn, x4.clone(), torch.tensor([2, 2, 2, 2]))
    assert sim.violations == [] and sim.num_ops > 0


def test_custom_ops_are_refused_not_trusted():
    @torch.library.custom_op("lora_kit_test::host_peek", mutates_args=())
    def host_peek(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()  # host logic the simulator cannot see through

    with pytest.raises(CaptureError, match="opaque custom op: lora_kit_test::host_peek"):
        GraphSimulator().capture(host_peek, x4.clone())


# ----------------------------------------------------------------- the seed bug
def _shrink_reading_seg_lens_on_host(x, w, seg_lens, slots):
    """Upstream's control-flow shrink: segment bounds come from .tolist() at capture."""
    out = torch.zeros(x.shape[0], w.shape[1])
    start = 0
    for n, s in zip(seg_lens.tolist(), slots.tolist()):
        out[start : start + n] = x[start : start + n] @ w[s].T
        start += n
    return out


def _shrink_static_shapes(x, w, seg_lens, slots):
    """Static-shape version: per-token slots built on the device, one gather, no host reads."""
    token_slots = torch.repeat_interleave(slots, seg_lens, output_size=x.shape[0])
    return torch.einsum("ti,tri->tr", x, w[token_slots])


def _batches():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    w = torch.randn(3, 2, 5, generator=g)  # (slots, rank, in)
    batch_a = (torch.tensor([4, 2]), torch.tensor([0, 1]))
    batch_b = (torch.tensor([1, 3, 2]), torch.tensor([2, 0, 1]))
    return x, w, batch_a, batch_b


def _eager_on_b(x, w, batch_b):
    return _shrink_static_shapes(x, w, *batch_b)


def test_seed_bug_host_read_shrink_is_rejected_in_strict_mode():
    x, w, (seg_a, slots_a), _ = _batches()
    with pytest.raises(CaptureError, match="Tensor.tolist"):
        GraphSimulator(strict=True).capture(_shrink_reading_seg_lens_on_host, x, w, seg_a, slots_a)


def test_seed_bug_lenient_replay_on_a_new_batch_is_stale():
    x, w, batch_a, batch_b = _batches()
    seg, slots = batch_a[0].clone(), batch_a[1].clone()
    sim = GraphSimulator(strict=False)
    out = sim.capture(_shrink_reading_seg_lens_on_host, x, w, seg, slots)
    assert {v.op for v in sim.violations} == {"Tensor.tolist"}
    # refill the same input buffers with batch B (same token count, new segments)
    seg.resize_(3).copy_(batch_b[0])
    slots.resize_(3).copy_(batch_b[1])
    replayed = sim.replay()
    assert replayed is out
    expected = _eager_on_b(x, w, batch_b)
    assert not torch.allclose(replayed, expected), "replay should be stale: segment bounds were baked"
    torch.testing.assert_close(replayed, _eager_on_b(x, w, batch_a))  # it still computes batch A


def test_static_shape_shrink_replays_batch_b_exactly():
    x, w, batch_a, batch_b = _batches()
    seg, slots = torch.tensor([4, 2, 0]), torch.tensor([0, 1, 0])  # 3 segments, last empty
    sim = GraphSimulator(strict=True)
    out = sim.capture(_shrink_static_shapes, x, w, seg, slots)
    torch.testing.assert_close(out, _eager_on_b(x, w, batch_a))
    seg.copy_(batch_b[0])
    slots.copy_(batch_b[1])
    sim.replay()
    torch.testing.assert_close(out, _eager_on_b(x, w, batch_b), rtol=0, atol=0)


# ----------------------------------------------------------- replay semantics
def test_replay_keeps_output_identity_and_overwrites_held_references():
    x = torch.ones(3)
    sim = GraphSimulator()
    out = sim.capture(lambda t: t * 2 + 1, x)
    ptr = out.data_ptr()
    step1 = sim.replay()
    held = step1  # a caller keeping the previous step's output
    x.fill_(5.0)
    step2 = sim.replay()
    assert step2 is out and step2.data_ptr() == ptr
    assert held.tolist() == [11.0, 11.0, 11.0], "a held reference is overwritten, as on CUDA"


def test_rebinding_a_cached_tensor_after_capture_is_stale_on_replay():
    cache = {"scale": torch.full((3,), 2.0)}
    x = torch.ones(3)
    sim = GraphSimulator()
    out = sim.capture(lambda t: t * cache["scale"], x)
    cache["scale"] = torch.full((3,), 3.0)  # a fresh tensor: the captured graph still reads the old one
    sim.replay()
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert (x * cache["scale"]).tolist() == [3.0, 3.0, 3.0]


def test_python_scalars_read_in_lenient_mode_are_baked():
    x, scale = torch.ones(2), torch.tensor(2.0)
    sim = GraphSimulator(strict=False)
    out = sim.capture(lambda t, s: t * s.item(), x, scale)
    scale.fill_(10.0)
    sim.replay()
    assert out.tolist() == [2.0, 2.0]  # stale, exactly what a CUDA graph would give
    assert len(sim.violations) == 1 and "item" in sim.violations[0].rule


def test_replay_that_would_change_an_output_shape_raises():
    x = torch.tensor([0.0, 1.0, 2.0])
    sim = GraphSimulator(strict=False)
    sim.capture(lambda t: t.nonzero(), x)
    x.fill_(1.0)
    with pytest.raises(CaptureError, match="cannot change shape"):
        sim.replay()


def test_is_capturing_is_true_only_inside_a_capture():
    seen = []
    sim = GraphSimulator()
    sim.capture(lambda t: (seen.append(is_capturing()), t + 1)[1], torch.ones(1))
    assert seen == [True] and not is_capturing()


def test_a_capture_is_seen_by_its_own_thread_only_and_nests():
    from lora_core.graphs import simulated_capture

    seen = []
    with simulated_capture():
        with simulated_capture():
            worker = threading.Thread(target=lambda: seen.append(is_capturing()))
            worker.start()
            worker.join()
        assert is_capturing()  # the outer capture is still open
    assert seen == [False] and not is_capturing()


def test_replay_before_capture_and_double_capture_are_errors():
    sim = GraphSimulator()
    with pytest.raises(CaptureError, match="before capture"):
        sim.replay()
    sim.capture(lambda t: t + 1, torch.ones(1))
    with pytest.raises(CaptureError, match="already holds a capture"):
        sim.capture(lambda t: t + 1, torch.ones(1))


# -------------------------------------------------------------- launch counter
def _loop_over_segments(x, w, seg_lens_host):
    out = torch.empty(x.shape[0], w.shape[1])
    start = 0
    for n in seg_lens_host:
        out[start : start + n] = x[start : start + n] @ w[0].T
        start += n
    return out


@pytest.mark.parametrize("segments", [1, 8, 64])
def test_launch_counts_grow_with_a_segment_loop_and_not_when_vectorized(segments):
    x = torch.randn(64, 5)
    w = torch.randn(3, 2, 5)
    seg = [64 // segments] * segments
    loop = count_launches(_loop_over_segments, x, w, seg)
    single = count_launches(_loop_over_segments, x, w, [64])
    vec = count_launches(_shrink_static_shapes, x, w, torch.tensor(seg), torch.zeros(segments, dtype=torch.long))
    vec_one = count_launches(_shrink_static_shapes, x, w, torch.tensor([64]), torch.zeros(1, dtype=torch.long))
    assert loop.ops == segments * single.ops
    assert vec.ops == vec_one.ops and vec.host_reads == 0
    print(f"segments={segments}: loop ops={loop.ops}, vectorized ops={vec.ops}")


def test_launch_counter_counts_host_reads():
    count = count_launches(lambda t: t * t.sum().item() + len(t.tolist()), torch.ones(3))
    assert count.host_reads == 2 and count.ops >= 2
