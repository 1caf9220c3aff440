"""The torch engine's batched processing (engines/torch_engine/processing.py): penalties from
counts it keeps on the device, filled from a row's history only the first time the row is seen;
bias and grammar masks for the whole batch at once."""

import numpy as np
import pytest
import torch

from engines.base import SamplingParams
from engines.processing import Processing
from engines.runtime.plan import PENDING, RowSampling, ScheduledSeq
from engines.torch_engine.processing import RowProcessor
from tests.engines.helpers import processing_rule

VOCAB = 16


def row(seq_id, params, prompt, generated, grammar=None):
    sampling = RowSampling.of(params, 0, Processing.of(params, grammar))
    return ScheduledSeq(seq_id, (0,), 0, (0,), True, sampling, len(generated),
                        history=(prompt, generated))


def test_counts_follow_sampled_tokens_not_the_history_after_the_first_step():
    """The history is read once; later steps count the tokens the processor was told were
    sampled, so a history the host has not caught up with (a pipelined step) does not matter."""
    params = SamplingParams(max_tokens=8, repetition_penalty=1.5, presence_penalty=0.5,
                            frequency_penalty=0.25, logit_bias=((2, 1.0),))
    plain = SamplingParams(max_tokens=8)
    proc = RowProcessor(VOCAB, "cpu")
    torch.manual_seed(0)
    prompt, generated = [1, 4], [3, 3]
    for token in (5, 3, 5, 9):
        logits = torch.randn(2, VOCAB)
        rows = [row(7, params, prompt, [99] * 50), row(8, plain, [1], [])]  # history ignored
        if token == 5 and generated == [3, 3]:
            rows[0] = row(7, params, prompt, list(generated))  # the first sight reads it
        x, counted = proc.apply(logits, rows)
        assert torch.allclose(x[0], processing_rule(logits[0].clone(), params, prompt, generated))
        assert torch.equal(x[1], logits[1])  # a row without processing is left alone
        proc.count(counted, torch.tensor([token, 0]))
        generated.append(token)


def test_a_released_sequence_s_slot_starts_afresh_for_the_next():
    params = SamplingParams(max_tokens=8, frequency_penalty=1.0)
    proc = RowProcessor(VOCAB, "cpu")
    logits = torch.zeros(1, VOCAB)
    _, counted = proc.apply(logits, [row(1, params, [2], [6, 6])])
    proc.count(counted, torch.tensor([6]))
    proc.release([1])
    x, _ = proc.apply(logits, [row(2, params, [2], [])])
    assert torch.equal(x[0], torch.zeros(VOCAB))  # nothing of sequence 1's counts left
    x, _ = proc.apply(logits, [row(1, params, [2], [4])])  # back after a preemption
    assert x[0, 4] == -1.0 and x[0, 6] == 0.0


def test_a_batch_s_inputs_are_kept_while_its_rows_stay_and_made_anew_when_they_change():
    """The same rows a step later reuse the inputs made for them (no host work); rows in
    another order, a row gone or a sequence released get new ones, each row still processed
    by its own settings."""
    biased = SamplingParams(max_tokens=8, logit_bias=((3, 5.0),))
    other = SamplingParams(max_tokens=8, logit_bias=((9, -2.0),), presence_penalty=1.0)
    proc = RowProcessor(VOCAB, "cpu")
    logits = torch.zeros(2, VOCAB)

    settings = {1: biased, 2: other}

    def check(rows):
        x, _ = proc.apply(logits[: len(rows)], rows)
        for i, r in enumerate(rows):
            want = processing_rule(logits[i].clone(), settings[r.seq_id], [1], [2])
            assert torch.allclose(x[i], want)
        return proc._kept

    pair = [row(1, biased, [1], [2]), row(2, other, [1], [2])]
    first = check(pair)
    assert check([row(1, biased, [1], [2]), row(2, other, [1], [2])]) is first
    swapped = check(pair[::-1])
    assert swapped is not first
    assert check(pair[1:]) is not swapped
    kept = proc._kept
    proc.release([1])
    assert check(pair[1:]) is not kept


def test_slots_grow_with_the_batch():
    params = SamplingParams(max_tokens=8, presence_penalty=1.0)
    proc = RowProcessor(VOCAB, "cpu")
    rows = [row(i, params, [0], [i % VOCAB]) for i in range(20)]
    x, _ = proc.apply(torch.zeros(20, VOCAB), rows)
    for i in range(20):
        assert x[i, i % VOCAB] == -1.0 and (x[i] != 0).sum() == 1


class Mask:
    """A grammar stand-in: allows the tokens it was made with, whatever came before; its
    tokenizer has 21 tokens."""

    vocab_size = 21

    def __init__(self, allowed):
        self.allowed = allowed


class Masks:
    """A MaskFiller stand-in for Mask grammars; keeps what each call was asked."""

    def __init__(self):
        self.asked = []

    def take(self, rows, out):
        self.asked.append([(list(generated), in_flight) for _, generated, in_flight in rows])
        return [(mask, i) for i, (mask, _, _) in enumerate(rows)]

    def compute(self, todo, out):
        for mask, i in todo:
            bits = np.zeros(out.shape[1] * 32, dtype=bool)
            bits[mask.allowed] = True
            out[i] = np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("vocab", [16, 21, 40])
@pytest.mark.parametrize("overlap", [False, True])
def test_grammar_masks_of_the_batch_go_over_in_one_and_mask_their_own_rows(vocab, overlap):
    """The masks in llguidance's layout (32 tokens a word) cut to the model's vocabulary, or
    padded past the tokenizer's 21 tokens with refusals; computed at once or on the worker."""
    masks = Masks()
    proc = RowProcessor(vocab, "cpu", masks)
    params = SamplingParams(max_tokens=8)
    logits = torch.randn(3, vocab)
    rows = [row(0, params, [0], [3], Mask([1, 20 % vocab])), row(1, params, [0], []),
            row(2, params, [0], [4, 5], Mask([0, 9]))]
    rows[2].tokens = (PENDING,)  # its last token is in flight
    step = proc.begin(logits, rows, in_flight={2: 6}.__getitem__, overlap=overlap)
    assert (step.masks is not None) == overlap
    x, _ = proc.finish(step)
    # Once for the batch; the token in flight joins.
    assert masks.asked == [[([3], None), ([4, 5], 6)]]
    assert torch.isfinite(x[0]).nonzero().view(-1).tolist() == sorted({1, 20 % vocab})
    assert torch.equal(x[1], logits[1])
    assert torch.isfinite(x[2]).nonzero().view(-1).tolist() == [0, 9]
    proc.close()


def test_to_device_keeps_values_and_type_on_the_cpu():
    from engines.torch_engine.transfer import to_device

    out = to_device([[1.5], [2.0]], torch.float32, torch.device("cpu"))
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert out.view(-1).tolist() == [1.5, 2.0]
