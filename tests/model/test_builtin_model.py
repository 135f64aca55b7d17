"""The built-in model shipped in the package: it loads with the expected config, and on held-out KJV
text it beats a unigram byte model (frequencies from the training split) by a wide margin.

Measured on the shipped bf16 weights (16 held-out windows of 256 bytes): 1.618 bits/byte against the
unigram's 4.358, a ratio of 0.37; the test asks for <= 0.75."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from metrale_jax.builtin import builtin_model_dir, checkpoint_dtype, load_builtin
from metrale_jax.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "kjv"
WINDOWS, LENGTH = 16, 256
RATIO_LIMIT = 0.75          # model bits/byte <= 0.75 x unigram bits/byte


@pytest.fixture(scope="module")
def model():
    return load_builtin()


@pytest.fixture(scope="module")
def heldout_rows():
    """BOS + 256 bytes at 16 evenly spaced line starts of heldout.txt: [16, 257] ids."""
    data = np.frombuffer((DATA / "heldout.txt").read_bytes(), np.uint8)
    starts = np.concatenate([[0], np.flatnonzero(data[:-1] == ord("\n")) + 1])
    starts = starts[starts + LENGTH <= len(data)]
    picked = starts[np.linspace(0, len(starts) - 1, WINDOWS).astype(int)]
    rows = np.stack([data[s:s + LENGTH] for s in picked]).astype(np.int32) + ByteTokenizer.offset
    return np.concatenate([np.full((WINDOWS, 1), ByteTokenizer.bos_id, np.int32), rows], axis=1)


def test_packaged_files_and_config(model):
    d = builtin_model_dir()
    assert d.parent.parent == Path(__import__("metrale_jax").__file__).parent    # inside the package
    for f in ("config.json", "model.safetensors", "byte_tokenizer.json", "train_log.json"):
        assert (d / f).is_file(), f
    c = model.config
    assert set(c.hybrid_override_pattern) == set("M*-E"), c.hybrid_override_pattern
    assert c.vocab_size == ByteTokenizer.vocab_size and isinstance(model.tokenizer, ByteTokenizer)
    assert c.chunk_size < LENGTH                      # the trained length ran the chunked SSD path
    assert c.n_routed_experts >= 4 and c.num_experts_per_tok >= 2
    assert model.dtype == checkpoint_dtype(d)
    assert (d / "model.safetensors").stat().st_size < 8 * 2**20


def test_heldout_bits_per_byte_beat_unigram(model, heldout_rows):
    train = np.frombuffer((DATA / "train.txt").read_bytes(), np.uint8)
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0             # add-one smoothed
    unigram = float(-np.log2(counts / counts.sum())[heldout_rows[:, 1:] - ByteTokenizer.offset].mean())
    logprobs = np.asarray(model.score(heldout_rows), np.float64)                     # [16, 256] nats
    bits = float(-logprobs.mean() / math.log(2))
    print(f"built-in model {bits:.3f} bits/byte, unigram {unigram:.3f} bits/byte, ratio {bits / unigram:.3f}")
    assert 4.0 < unigram < 4.8                                                     # English text, sanity
    assert bits <= RATIO_LIMIT * unigram, f"{bits:.3f} bits/byte vs unigram {unigram:.3f}"
    # the same figure the training log recorded for the saved weights: these are the logged weights
    log = json.loads((builtin_model_dir() / "train_log.json").read_text())
    assert log["saved"]["heldout_windows"] == WINDOWS
    assert abs(log["saved"]["heldout_bits_per_byte"] - bits) < 5e-3, log["saved"]
