"""The built-in model's MTP head (trained by tools/train_tiny.py --mtp-only onto the frozen main model): it
loads, and MTP speculation on held-out KJV prompts gives the greedy output of speculation off while the
engine accepts a substantial fraction of the drafts.

Measured on the shipped bf16 weights (these 4 prompts, 32 new tokens, 2 drafts a step): acceptance 66/112 = 0.59;
the test asks for >= 0.25."""

from pathlib import Path

import numpy as np
import pytest

from metrale_jax.builtin import builtin_model_dir, load_builtin
from metrale_jax.runtime import Engine, Executables, SpeculativeConfig
from tests.runtime.conftest import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]
MIN_ACCEPTANCE = 0.25
NEW, PROMPT_BYTES, K = 32, 48, 2


@pytest.fixture(scope="module")
def model():
    return load_builtin()


def heldout_prompts(model, n: int) -> list[list[int]]:
    """n passages of PROMPT_BYTES bytes at evenly spaced line starts of the held-out split, encoded."""
    text = (ROOT / "data" / "kjv" / "heldout.txt").read_bytes()
    lines = np.flatnonzero(np.frombuffer(text, np.uint8)[:-1] == ord("\n")) + 1
    picked = lines[np.linspace(0, len(lines) - 20, n).astype(int)]
    return [model.tokenizer.encode(text[s:s + PROMPT_BYTES].decode("utf-8", "ignore")) for s in picked]


def test_builtin_model_has_a_trained_mtp_head(model):
    c = model.config
    assert c.num_nextn_predict_layers == 1 and model.mtp is not None and model.mtp.num_steps == 1
    assert set(c.mtp_hybrid_override_pattern) <= set("*-E")
    assert "mtp" in __import__("json").loads((builtin_model_dir() / "train_log.json").read_text())


def test_mtp_speculation_matches_greedy_and_accepts_drafts(model):
    prompts = heldout_prompts(model, 4)
    common = dict(max_slots=4, max_len=PROMPT_BYTES + NEW + K + 8, batch_buckets=(4,), token_buckets=(64,),
                  eos_ids=[], executables=Executables(compiler_options=FAST_COMPILE))
    want = [g.tokens for g in Engine(model, **common).generate(prompts, NEW)]
    eng = Engine(model, speculative=SpeculativeConfig(method="mtp", num_draft=K), **common)
    got = [g.tokens for g in eng.generate(prompts, NEW)]
    assert got == want
    assert all(len(t) == NEW for t in got)
    drafted, accepted = eng.counters["drafted_tokens"], eng.counters["accepted_tokens"]
    print(f"MTP k={K}: accepted {accepted}/{drafted} = {accepted / drafted:.2f}")
    assert drafted >= len(prompts) * (NEW // (K + 1))
    assert accepted / drafted >= MIN_ACCEPTANCE
