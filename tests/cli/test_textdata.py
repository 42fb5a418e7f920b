"""The offline text corpus and its next-character windows."""

import numpy as np

from jaxcomm.cli.textdata import CharBatches, build_vocab, encode, load_corpus


def test_windows_predict_the_next_character():
    text = load_corpus()
    batches = CharBatches.from_corpus(context=16, holdout=0.1)
    assert len(batches.train) + len(batches.test) == len(text)
    inputs, targets = batches.sample(np.random.default_rng(0), (3, 5))
    assert inputs.shape == (3, 5, 16) and targets.shape == (3, 5)
    # Every window is a contiguous slice of the training text followed by its target.
    vocab = batches.vocab
    train_text = "".join(vocab[i] for i in batches.train)
    for window, target in zip(inputs.reshape(-1, 16), targets.reshape(-1), strict=True):
        chunk = "".join(vocab[i] for i in window) + vocab[target]
        assert chunk in train_text


def test_vocab_keeps_frequent_characters_and_encode_marks_the_rest():
    vocab = build_vocab("aaabbc" * 10 + "z", min_count=10)
    assert vocab == "\0abc"
    ids = encode("cabz", vocab)
    assert list(ids) == [3, 1, 2, 0]
    # Every id of the real corpus's training split occurs in it (no never-trained row).
    batches = CharBatches.from_corpus()
    counts = np.bincount(batches.train, minlength=batches.vocab_size)
    assert counts.min() > 0


def test_held_out_is_fixed_and_disjoint_from_training():
    holdout, context = 0.1, 8
    batches = CharBatches.from_corpus(context=context, holdout=holdout)
    a, b = batches.held_out(64), batches.held_out(64)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[0].max() < batches.vocab_size
    # The split, rebuilt from the corpus: training is the first 90%, held out the rest, and
    # no position belongs to both.
    text = load_corpus()
    cut = int(len(text) * (1 - holdout))
    ids = encode(text, batches.vocab)
    np.testing.assert_array_equal(batches.train, ids[:cut])
    np.testing.assert_array_equal(batches.test, ids[cut:])
    # Every held-out window (with its target) lies in the held-out text (windows drawn from
    # the training split mostly would not: that is the bug this catches).
    held_text = "".join(batches.vocab[i] for i in ids[cut:])
    for window, target in zip(a[0], a[1], strict=True):
        chunk = "".join(batches.vocab[i] for i in window) + batches.vocab[target]
        assert chunk in held_text, chunk
