"""Evaluation through the lm-eval harness (titan_hydra/evaluation.py, recipes/eval.py): the
harness's bits per byte on the built-in held-out corpus agree with the project's own validation
loss converted to bits per byte; log-likelihoods equal a direct computation; the local
multiple-choice task scores a JSONL; bad tasks are refused in one line."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")
from helpers import compose_cfg  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
import eval as eval_recipe  # noqa: E402
from generate import load_model  # noqa: E402

SEQ = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A debug_tiny model (seq 64) trained 30 steps, saved at the end."""
    from titan_hydra.train.pretrain import run

    path = tmp_path_factory.mktemp("eval_ckpt")
    cfg = compose_cfg(["experiment=debug_tiny", "checkpoint=default", "checkpoint.interval=0", "training.steps=30",
                       "training.val_freq=0", f"training.seq_len={SEQ}", "optimizer.lr=3e-3",
                       "cluster.threads_per_proc=1"])
    run(cfg, str(path / "run"))
    return path / "run" / "checkpoint" / "step-30"


def test_harness_bits_per_byte_agree_with_validation_loss(checkpoint):
    """Our validation loss over the whole held-out split (mean NLL per token, seq 64 windows)
    converted with the split's tokens per byte, against the harness's bits_per_byte from rolling
    log-likelihoods in 64-token windows. They differ only in window alignment (documents vs the
    packed stream) and the BOS/EOS targets: measured 3.5396 vs 3.5399 (0.01%); the bar is 3%."""
    from titan_hydra.data import corpus
    from titan_hydra.data.tokenizer import Tokenizer
    from titan_hydra.train.pretrain import build_dataset

    _, _, model = load_model(checkpoint)
    cfg = compose_cfg(["experiment=debug_tiny", f"training.seq_len={SEQ}"])
    losses, weights = [], []
    with torch.no_grad():
        for inputs, labels in build_dataset(cfg).loader("val", 16, infinite=False):
            losses.append(F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten()).item())
            weights.append(labels.numel())
    val_loss = sum(l * w for l, w in zip(losses, weights)) / sum(weights)
    docs = corpus.builtin_documents("val")
    tok = Tokenizer("builtin")
    n_tokens = sum(len(ids) for ids in tok.encode_batch(docs))
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    ours = val_loss * n_tokens / n_bytes / math.log(2)
    scores = eval_recipe.evaluate(checkpoint, ["builtin_ppl"], max_seq_len=SEQ, batch_size=32)["builtin_ppl"]
    print(f"bits per byte: harness {scores['bits_per_byte']:.4f}, validation loss {ours:.4f}")
    assert abs(scores["bits_per_byte"] - ours) / ours < 0.03, (scores, ours, val_loss)
    assert scores["byte_perplexity"] == pytest.approx(2 ** scores["bits_per_byte"], rel=1e-6)
    assert ours < math.log2(2048) * n_tokens / n_bytes  # trained below uniform: the comparison means something


def test_loglikelihood_equals_a_direct_computation(checkpoint):
    from titan_hydra.data.tokenizer import Tokenizer
    from titan_hydra.evaluation import TitanLM

    _, args, model = load_model(checkpoint)
    tok = Tokenizer("builtin")
    lm = TitanLM(model, tok, args.max_seq_len, batch_size=2)

    class Req:
        def __init__(self, *a):
            self.args = a

    reqs = [Req("def main(", "self):"), Req("import", " os\n"), Req("x = 1", " + 2")]
    got = lm.loglikelihood(reqs)
    for (ctx, cont), (lp, greedy) in zip([r.args for r in reqs], got):
        c, t = [tok.bos_id] + tok.encode(ctx), tok.encode(cont)
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([c + t[:-1]])).float(), dim=-1)[0]
        ref = sum(logp[len(c) - 1 + i, t[i]].item() for i in range(len(t)))
        assert lp == pytest.approx(ref, abs=1e-4)
        assert greedy == all(logp[len(c) - 1 + i].argmax().item() == t[i] for i in range(len(t)))
    assert lm.generate_until([Req("def ", {"until": ["\n"], "max_gen_toks": 8})])[0].count("\n") == 0


def test_local_multiple_choice_and_bad_tasks(checkpoint, capsys):
    scores = eval_recipe.evaluate(checkpoint, [f"jsonl_mc:{REPO / 'recipes/eval_tasks/tiny_mc.jsonl'}"])
    acc = scores["jsonl_mc_tiny_mc"]["acc"]
    assert 0.0 <= acc <= 1.0 and acc * 8 == round(acc * 8)  # 8 questions
    capsys.readouterr()  # the harness's progress bars
    for tasks, message in [("no_such_task_xyz", "unknown task(s) ['no_such_task_xyz']"),
                           ("jsonl_mc:/nowhere.jsonl", "/nowhere.jsonl does not exist")]:
        assert eval_recipe.main([str(checkpoint), "--tasks", tasks]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err, err
