"""lora_vllm.mapping without vLLM: the vectorized slot lookup and run lengths against plain loops."""

import numpy as np
import pytest

from lora_vllm import StepMapping, lora_slots, run_lengths


@pytest.mark.parametrize("seed", range(5))
def test_slots_and_offsets_match_a_loop(seed):
    rng = np.random.default_rng(seed)
    held = [5, None, 9, 2, None][: rng.integers(1, 6)]
    ids = rng.choice([0] + [i for i in held if i is not None], size=int(rng.integers(0, 60)))
    rows = rng.choice([0] + [i for i in held if i is not None], size=int(rng.integers(0, 9)))
    step = StepMapping.from_vllm(ids.tolist(), rows.tolist(), held, len(held) + 1, 100)
    slot = {i: s for s, i in enumerate(held) if i is not None}
    assert step.token_slots.tolist() == [slot[i] if i > 0 else -1 for i in ids]
    assert step.embedding_offsets.tolist() == [slot[i] * 100 if i > 0 else 0 for i in ids]
    n = len(rows)
    assert step.row_offsets_padded.tolist() == [r + n * (slot[i] if i > 0 else len(held)) for r, i in enumerate(rows)]


def test_an_id_no_slot_holds_is_a_key_error_naming_it():
    with pytest.raises(KeyError, match="7"):
        lora_slots([5, 7], [5, None])
    with pytest.raises(KeyError, match="3"):
        lora_slots([3], [])
    assert lora_slots([0, 0], []).tolist() == [-1, -1]


def test_run_lengths():
    lens, values = run_lengths(np.array([3, 3, -1, -1, -1, 3, 0]))
    assert lens.tolist() == [2, 3, 1, 1] and values.tolist() == [3, -1, 3, 0]
    lens, values = run_lengths(np.zeros(0, dtype=np.int64))
    assert lens.size == 0 and values.size == 0
