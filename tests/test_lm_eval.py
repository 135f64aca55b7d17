"""The lm-evaluation-harness model `metrale-jax` on the built-in model (float32), offline: loglikelihood equal to
model.score for the same tokens and to a float64 log-softmax of model.forward (greedy flags to its argmax),
loglikelihood_rolling by disjoint windows, generate_until through the engine with `until` strings, and the harness
itself (simple_evaluate and its command line) on a local multiple-choice task and a local generate_until task that
the test writes (task YAML over a JSON file)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from metrale_jax.builtin import builtin_model_dir, load_builtin
from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.runtime import SamplingParams
from metrale_jax.eval.lm_eval_adapter import MetraleLM
from metrale_jax.scoring import windows
from tests import numpy_refs_model as ref

MC = [{"question": "And God said, Let there be", "choices": [" light", " fish", " seventy"], "answer": 0},
      {"question": "In the beginning God created the heaven and the", "choices": [" earth", " cat"], "answer": 0},
      {"question": "Jesus", "choices": [" wept.", " laughed."], "answer": 0}]
GEN = [{"prompt": "And God said unto Moses,", "target": "x"}, {"prompt": "Blessed are the", "target": "y"}]


@pytest.fixture(scope="module")
def model():
    return load_builtin(dtype=np.float32)


@pytest.fixture(scope="module")
def lm(model):
    return MetraleLM(model=model, batch_size=3, progress=False)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub access: the harness's datasets read local JSON, their cache in the test's folder."""
    for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}.items():
        monkeypatch.setenv(k, v)


def _requests(kind, args):
    return [Instance(kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _forward_logprobs(model, ids):
    logits = np.asarray(model.forward(np.asarray([ids], np.int32)))[0]
    return ref.log_softmax(logits), logits


def test_loglikelihood_is_model_score_and_the_forward_reference(model, rng):
    """batch_size 1: each pair is scored alone, as the model.score call below scores it, so the two agree to the
    bit (in larger batches XLA's matmuls of other shapes round differently, ~1e-7 relative)."""
    lm = MetraleLM(model=model, batch_size=1, progress=False)
    tok = model.tokenizer
    greedy = model.generate(["And God said"], max_new_tokens=6)[0].text
    noise = "".join(map(chr, rng.integers(97, 123, 7)))
    pairs = [("And God said", greedy), ("And God said ", noise), ("", "In the beginning"), ("Jesus", " wept.")]
    got = lm.loglikelihood(_requests("loglikelihood", pairs))
    assert got[0][1] is True and got[1][1] is False                # the model's own continuation is greedy
    rows = []
    for ctx, cont in pairs:
        c = ctx.rstrip()
        cids = tok.encode(c) if c else [tok.bos_id]
        rows.append((cids, cids + (tok.encode(c + ctx[len(c):] + cont)[len(cids):] if c else
                                   tok.encode(cont, add_bos=False))))
    # the float64 reference from one forward over the right-padded rows (causal: the padding reaches no earlier
    # logit), one compile instead of one per length
    padded = np.zeros((len(rows), max(len(ids) for _, ids in rows)), np.int32)
    for i, (_, ids) in enumerate(rows):
        padded[i, :len(ids)] = ids
    all_logits = np.asarray(model.forward(padded))
    for (cids, ids), (ll, is_greedy), logits in zip(rows, got, all_logits):
        n = len(ids) - len(cids)
        score = np.asarray(model.score(np.asarray([ids], np.int32)))[0]
        assert ll == float(np.sum(score[-n:], dtype=np.float64))        # the library's score, exactly
        logits = logits[:len(ids)]
        lp = ref.log_softmax(logits)
        pos = np.arange(len(cids) - 1, len(ids) - 1)
        assert ll == pytest.approx(lp[pos, ids[len(cids):]].sum(), abs=2e-4)
        assert is_greedy == bool((logits[pos].argmax(-1) == ids[len(cids):]).all())


def test_loglikelihood_rolling_scores_disjoint_windows(model, rng):
    tok = model.tokenizer
    text = "".join(map(chr, rng.integers(97, 123, 150)))
    small = MetraleLM(model=model, max_length=64, batch_size=1, progress=False)
    (got,) = small.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    ids = [tok.bos_id] + tok.encode(text, add_bos=False)
    want = 0.0
    rows = windows(len(ids), 1, 64, 63)
    assert len(rows) == 3
    for start, end, first in rows:
        lp, _ = _forward_logprobs(model, ids[start:end])
        want += sum(lp[t - start - 1, ids[t]] for t in range(first, end))
    assert got == pytest.approx(want, abs=5e-4)
    (whole,) = MetraleLM(model=model, batch_size=1, progress=False).loglikelihood_rolling(_requests("loglikelihood_rolling",
                                                                                      [(text,)]))
    assert whole == float(np.sum(np.asarray(model.score(np.asarray([ids], np.int32))), dtype=np.float64))


def test_generate_until_is_the_engine_cut_at_until(model, lm):
    args = [("And God said unto Moses,", {"until": ["\n", ","], "max_gen_toks": 40}),
            ("Blessed are the", {"until": ["."], "max_gen_toks": 12, "do_sample": False}),
            ("Jesus", {"until": ["<|endoftext|>"], "max_gen_toks": 5, "do_sample": True, "temperature": 0.8})]
    got = lm.generate_until(_requests("generate_until", args))
    # the references in one model.generate call (one engine to compile, not four): a row's tokens do not depend on
    # the rows beside it (tests/model/test_model.py) and each request samples its own seeded stream, so each row is
    # what its prompt alone gives. The two greedy prompts run for 40 tokens: where the `until` strings fall, and,
    # cut to max_gen_toks tokens, the greedy continuation of that length (a byte tokenizer: one character a token).
    free = model.generate([a[0] for a in args], [SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40),
                                                 SamplingParams(max_new_tokens=5, temperature=0.8, seed=0)])
    for (ctx, kw), g, f in zip(args, got, free[:2]):
        cut = min([f.text.find(u) for u in kw["until"] if u in f.text] or [len(f.text)])
        want = model.tokenizer.decode(f.tokens[:kw["max_gen_toks"]])
        assert len(want) <= kw["max_gen_toks"] and f.text.startswith(want)
        assert g == want[:min(cut, len(want))]
    assert got[2] == free[2].text                                      # sampled as the task asks, seed 0


@pytest.mark.parametrize("field, kwargs", [
    ("batch_size", {"batch_size": "0"}), ("batch_size", {"batch_size": "many"}), ("max_length", {"max_length": "1"}),
    ("max_gen_toks", {"max_gen_toks": 2.5}), ("seed", {"seed": "x"}),
])
def test_bad_model_args_name_their_field(model, field, kwargs):
    """The harness passes model_args as text: "0" and "many" were int()'s ValueError or a batch size of 0."""
    with pytest.raises(ConfigError) as e:
        MetraleLM(model=model, progress=False, **kwargs)
    assert e.value.field == field, str(e.value)


def test_refused_requests_leave_nothing_queued(lm):
    """A generate_until batch is checked whole before any request is queued (the first one would otherwise stay
    in the engine, never popped, taking a slot from every later batch); an empty continuation is named."""
    args = [("And", {"until": ["."], "max_gen_toks": 4}), ("Blessed", {"until": ["."], "max_gen_toks": 10 ** 6})]
    with pytest.raises(ConfigError, match="max_gen_toks: 1000000 new tokens leave no room"):
        lm.generate_until(_requests("generate_until", args))
    engine = lm._get_engine()
    assert not engine.queue and not engine.running and not engine.requests
    with pytest.raises(ShapeError, match=r"requests\[1\]: the continuation '' encodes to no tokens"):
        lm.loglikelihood(_requests("loglikelihood", [("And God", " said"), ("And God", "")]))


def _write_tasks(d):
    (d / "mc.json").write_text(json.dumps(MC))
    (d / "gen.json").write_text(json.dumps(GEN))
    (d / "mc.yaml").write_text(f"""task: metrale_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.json'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (d / "gen.yaml").write_text(f"""task: metrale_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'gen.json'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: [","]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")


def _mc_accuracy(lm):
    """The task's accuracy recomputed from the model's own loglikelihood: the best-scored choice is right."""
    right = 0
    for doc in MC:
        scores = lm.loglikelihood(_requests("loglikelihood", [(doc["question"], c) for c in doc["choices"]]))
        right += int(np.argmax([s for s, _ in scores]) == doc["answer"])
    return right / len(MC)


def test_simple_evaluate_runs_a_local_multiple_choice_and_generate_task(model, lm, tmp_path, offline):
    _write_tasks(tmp_path)
    assert get_model("metrale-jax") is MetraleLM                          # registered on import
    # include_defaults=False: only the two local tasks are indexed (indexing the harness's thousands of built-in task
    # YAMLs took 6.6 s and none of them runs here; the command-line test below goes through the default index)
    out = simple_evaluate(model=lm, tasks=["metrale_mc", "metrale_gen"], task_manager=TaskManager(
        include_path=str(tmp_path), include_defaults=False), log_samples=True)
    assert out["results"]["metrale_mc"]["acc,none"] == pytest.approx(_mc_accuracy(lm))
    gens = [s["resps"][0][0] for s in sorted(out["samples"]["metrale_gen"], key=lambda s: s["doc_id"])]
    want = [g.text for g in model.generate([d["prompt"] for d in GEN], max_new_tokens=24, stop=[","])]
    assert gens == want


def test_the_lm_eval_command_line_runs_the_registered_model(lm, tmp_path, offline):
    """`python -m metrale_jax.eval` is the harness's own command line with `metrale-jax` registered."""
    _write_tasks(tmp_path)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "metrale_jax.eval", "run", "--model", "metrale-jax", "--model_args",
                        f"pretrained={builtin_model_dir()},dtype=float32,progress=False", "--tasks", "metrale_mc",
                        "--include_path", str(tmp_path), "--batch_size", "4", "--output_path", str(out)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    acc = json.loads(results.read_text())["results"]["metrale_mc"]["acc,none"]
    assert acc == pytest.approx(_mc_accuracy(lm)) and "metrale_mc" in p.stdout
