"""The offline text corpus and its next-character windows."""

import numpy as np

from jaxcomm.textdata import VOCAB, CharBatches, encode, load_corpus


def test_windows_predict_the_next_character():
    text = load_corpus()
    batches = CharBatches.from_corpus(context=16, holdout=0.1)
    assert len(batches.train) + len(batches.test) == len(text)
    inputs, targets = batches.sample(np.random.default_rng(0), (3, 5))
    assert inputs.shape == (3, 5, 16) and targets.shape == (3, 5)
    # Every window is a contiguous slice of the training text followed by its target.
    train_text = "".join(VOCAB[i] for i in batches.train)
    for window, target in zip(inputs.reshape(-1, 16), targets.reshape(-1), strict=True):
        chunk = "".join(VOCAB[i] for i in window) + VOCAB[target]
        assert chunk in train_text


def test_encode_is_invertible_on_ascii_and_marks_unknowns():
    ids = encode("def f(x):\n\treturn x")
    assert "".join(VOCAB[i] for i in ids) == "def f(x):\n\treturn x"
    assert list(encode("é")) == [0]


def test_held_out_is_fixed_and_disjoint_from_training():
    batches = CharBatches.from_corpus(context=8)
    a, b = batches.held_out(64), batches.held_out(64)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[0].max() < len(VOCAB)
