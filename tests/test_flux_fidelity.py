"""Caption fidelity of a text-to-image run: a reader of pictures against the shapes grammar that
is right on every picture of the set (and on what the debug autoencoder gives back of them),
captions held out of training by construction, and the evaluation that draws pictures from them
during training (``eval=fidelity``, logged as ``val/fidelity/*``) and from any checkpoint
(``recipes/flux_fidelity.py``); the engine reaches both through the family's sampler and the
data's reader, naming neither.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_hydra.data.shapes import all_captions, heldout_captions, shapes_dataset
from titan_hydra.data.shapes_reader import CHANCE, METRICS, parse_caption, read_picture, score_pictures
from titan_hydra.errors import ConfigError, DataError
from titan_hydra.config.eval import EvalSettings
from titan_hydra.train.eval import PeriodicEval


def test_the_reader_is_right_on_the_sets_own_pictures_and_their_autoencoded_copies():
    from titan_hydra.models.flux.encoders import DCTAutoencoder

    images, captions = shapes_dataset(300, 64, seed=3)
    assert score_pictures(images, captions) == dict.fromkeys(METRICS, 1.0)
    dct = DCTAutoencoder()  # the debug flavor's latents: the best its samples can be
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    back = ((dct.decode(dct.encode(pixels)).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    assert score_pictures(back.permute(0, 2, 3, 1).numpy(), captions) == dict.fromkeys(METRICS, 1.0)


def test_a_picture_that_ignores_its_caption_scores_chance():
    """Every caption of the grammar scored against one fixed picture: a rate is the share of
    captions that happen to agree with it, chance over the grammar (CHANCE: 1/8 background,
    1/5 place, 1/3 kind)."""
    captions = all_captions()
    assert len(captions) == 8 * 3 * 5 * 7 == 840
    picture, caption = shapes_dataset(1, 64, seed=0)
    rates = score_pictures(np.repeat(picture, len(captions), 0), captions)
    said = parse_caption(caption[0])
    assert rates["shape"] == pytest.approx(1 / 3) and rates["place"] == pytest.approx(1 / 5)
    assert rates["background"] == pytest.approx(CHANCE["background"]) == 1 / 8
    assert CHANCE["background_and_colour"] == 1 / 64 and said.colour != said.background


def test_captions_outside_the_grammar_are_refused_in_one_line():
    assert parse_caption("a red circle at the top left on a blue background").place == "at the top left"
    for bad in ("a red circle", "a pink circle in the centre on a blue background",
                "a red star in the centre on a blue background"):
        with pytest.raises(ValueError, match="is not a caption of the shapes grammar"):
            parse_caption(bad)
    assert read_picture(shapes_dataset(1, 32, 0)[0][0], "in the centre").background in ("red", "green", "blue",
                                                                                          "yellow", "purple", "orange",
                                                                                          "white", "black")


def test_held_out_captions_are_never_drawn_and_holdout_zero_keeps_the_stream():
    held = heldout_captions(0.1)
    assert len(held) == 84 and held == heldout_captions(0.1) and set(held) < set(all_captions())
    _, drawn = shapes_dataset(400, 16, seed=1, holdout=0.1)
    assert not set(drawn) & set(held)
    _, plain = shapes_dataset(2, 16, seed=0)  # the stream every earlier version drew
    assert plain == ["a orange triangle at the top left on a purple background",
                     "a red circle at the bottom right on a green background"]


class _Copier:
    """A 'family' that draws the set's own picture of each caption (or a blank one): the
    evaluation's wiring without a model."""

    name = "copier"

    def __init__(self, blank: bool = False):
        self.blank = blank

    def sample_images(self, model, dataset, prompts, steps, guidance, seed):
        from titan_hydra.data.shapes import PLACES, draw_shape

        out = []
        for p in prompts:
            said = parse_caption(p)
            colour = said.background if self.blank else said.colour
            out.append(draw_shape(64, said.shape, colour, said.background, dict(PLACES)[said.place], 0.4))
        return torch.from_numpy(np.stack(out))


class _Data:
    def heldout_prompts(self, count):
        return heldout_captions(0.1)[:count]

    score_pictures = staticmethod(score_pictures)


def test_fidelity_evaluation_scores_held_out_captions():
    ev = PeriodicEval(EvalSettings(fidelity_every=10, fidelity_prompts=20))
    assert ev.enabled and ev.due(10, False) and not ev.due(5, False) and ev.due(7, True)
    right = ev.fidelity(None, _Copier(), _Data())
    assert right == {f"val/fidelity/{k}": 1.0 for k in METRICS}
    blank = ev.fidelity(None, _Copier(blank=True), _Data())
    assert blank["val/fidelity/background"] == 1.0 and blank["val/fidelity/colour"] == 0.0


def test_fidelity_needs_a_drawing_family_and_held_out_data():
    from titan_hydra.models.registry import get_family

    ev = EvalSettings(fidelity_every=10)
    with pytest.raises(ConfigError, match=r"eval.fidelity_every=10: model family 'llama3' draws no pictures"):
        ev.check(get_family("llama3"))
    with pytest.raises(ConfigError, match="holds no captions out"):
        ev.check_data(object())
    with pytest.raises(ConfigError, match="eval.fidelity_every=-1 must be >= 0"):
        EvalSettings(fidelity_every=-1)
    with pytest.raises(ConfigError, match=r"^eval\.fidelity_prompts=0 must be > 0"):  # its own line, not the above's
        EvalSettings(fidelity_every=10, fidelity_prompts=0)


def test_the_data_refuses_holdout_it_cannot_honour(tmp_path):
    from titan_hydra.data.image_caption import ImageCaptionDataset

    with pytest.raises(DataError, match=r"data.holdout=0.1 .* needs data.source=shapes"):
        ImageCaptionDataset(source="folder", path=str(tmp_path), holdout=0.1, examples=object())


def test_word_tokens_give_each_word_of_the_grammar_its_own_id():
    """The debug recipe's text path (data.examples.tokenizer=words): a token per word, every word of
    the grammar distinct, through the same tiny T5/CLIP encoders as bytes."""
    from titan_hydra.models.flux.encoders import FluxEncoders, WordTokenizer

    words = sorted({w for c in all_captions() for w in c.split()})
    ids = {w: int(WordTokenizer()([w], 2)[0][0, 0]) for w in words}
    assert len(words) == 22 and len(set(ids.values())) == 22 and min(ids.values()) >= 2
    tokens, mask = WordTokenizer()(["a red circle in the centre on a blue background"], 16)
    assert int(mask.sum()) == 11 and tokens[0, 10] == WordTokenizer.eos_id
    enc = FluxEncoders.tiny(16, 8, tokens="words")
    context, pooled = enc.encode_text(["a red circle", "a blue circle"], 16)
    assert context.shape == (2, 16, 16) and pooled.shape == (2, 8) and not torch.equal(pooled[0], pooled[1])
    assert enc.identity.endswith(":words") and not FluxEncoders.tiny(16, 8).identity.endswith(":words")
    with pytest.raises(ValueError, match="data.examples.tokenizer='bpe' must be one of bytes, words"):
        FluxEncoders.tiny(16, 8, tokens="bpe")


def test_the_sweep_report_tabulates_fidelity(tmp_path):
    """val/fidelity/* (logged on eval rows, apart from val/loss) become a column each, last value."""
    import json

    from titan_hydra.analysis import sweep as jobs, sweep_report

    run = tmp_path / "0"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- data.examples.timestep_shift=10\n")
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2)] + [{"step": 2, "val/loss": 0.5}]
    rows += [{"step": s, "val/fidelity/background": b, "val/fidelity/colour": c} for s, b, c in ((1, 0.5, 0.1), (2, 0.9, 0.3))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    [row] = jobs.collect(tmp_path)
    assert row.fidelity_curves == {"background": [(1, 0.5), (2, 0.9)], "colour": [(1, 0.1), (2, 0.3)]}
    jobs.label_rows([row])
    sweep_report.write_tables([row], tmp_path)
    table = (tmp_path / "report.md").read_text()
    assert "| fidelity background | fidelity colour |" in table and "| 0.900 | 0.300 |" in table
    assert (tmp_path / "report.csv").read_text().splitlines()[0].endswith("val/fidelity/background,val/fidelity/colour")


def test_the_fidelity_table_and_the_labelled_grid():
    from titan_hydra.analysis import fidelity

    rates = {**dict.fromkeys(METRICS, 0.5), "background_and_colour": 0.85, "prompts": 2}
    assert "| background_and_colour | 85.0% | 1.6% |" in fidelity.table(rates)
    images, captions = shapes_dataset(4, 64, seed=0)
    grid = fidelity.labelled_grid(images, captions[:2], rates, per_prompt=2)
    assert grid.size[1] == 2 * (128 + fidelity.LINE + 6) and grid.size[0] > 2 * 128
    step, found = fidelity.last_fidelity([{"step": 5, "val/fidelity/background": 0.2},
                                                     {"step": 10, "val/loss": 1.0},
                                                     {"step": 10, **{f"val/fidelity/{k}": 0.85 for k in METRICS}}])
    assert step == 10 and found == dict.fromkeys(METRICS, 0.85)
    row = fidelity.row_table({"cpu": "x", "threads": 2, "steps": 10, "wall_s": 60.0, "fidelity": found})
    assert "| x | 2 | 10 | 60 | 85% | 85% | 85% | 85% | 85% | yes |" in row
    with pytest.raises(RuntimeError, match="logged no val/fidelity"):
        fidelity.last_fidelity([{"step": 1, "loss": 1.0}])
