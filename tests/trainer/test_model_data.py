"""TinyLM, the MLP builder, the generated corpus and the dataset; and that TinyLM learns from it."""
from __future__ import annotations


import math

import pytest
import torch

from p2pft.trainer.data import ByteTokenizer, TextDataset, generate_corpus
from p2pft.trainer.model import TinyLM, build_mlp_for_params, count_params, model_config_for


# ----------------------------------------------------------------------------- data
def test_corpus_is_deterministic_ascii_of_exact_length() -> None:
    a = generate_corpus(50_000, seed=3)
    assert len(a) == 50_000
    assert a == generate_corpus.__wrapped__(50_000, seed=3)  # not just the cache answering
    assert a != generate_corpus(50_000, seed=4)
    text = a.decode("ascii")
    assert text.count(".") > 1_000 and text.count("\n") > 100
    words = text.split()
    assert len(set(words)) > 100  # a real vocabulary, not a repeated phrase


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "The cats sleep.\nDoes Anna sing? caf\u00e9"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.encode("").numel() == 0
    with pytest.raises(ValueError, match="\\[0, 256\\)"):
        tok.decode([300])


def test_dataset_samples_are_deterministic_windows_and_wrap() -> None:
    ds = TextDataset(seq_len=16, n_samples=100, seed=1)
    again = TextDataset(seq_len=16, n_samples=100, seed=1)
    s = ds.sample(7)
    assert s.shape == (17,) and s.dtype == torch.long
    assert torch.equal(s, again.sample(7))
    assert torch.equal(ds.sample(7 + 100), s)
    # The n samples are a shuffle of the n consecutive windows of the corpus.
    corpus = generate_corpus(100 * 16 + 1, 1)
    windows = {corpus[k * 16:k * 16 + 17] for k in range(100)}
    seen = [bytes(ds.sample(i).tolist()) for i in range(100)]
    assert set(seen) == windows
    assert seen != [corpus[k * 16:k * 16 + 17] for k in range(100)]  # shuffled
    batch = ds.batch([3, 150, 3])
    assert batch.shape == (3, 17)
    assert torch.equal(batch[0], batch[2]) and torch.equal(batch[1], ds.sample(50))
    assert torch.equal(ds.batch(torch.arange(2)), ds.batch([0, 1]))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"seq_len": 0}, "seq_len"), ({"seq_len": 8, "n_samples": 0}, "n_samples"), ({"seq_len": 8, "seed": "x"}, "seed")],
)
def test_dataset_rejects_bad_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TextDataset(**kwargs)


def test_dataset_rejects_bad_index() -> None:
    ds = TextDataset(seq_len=8, n_samples=10)
    with pytest.raises(ValueError, match="non-negative"):
        ds.sample(-1)
    with pytest.raises(ValueError, match="at least one"):
        ds.batch([])


# ----------------------------------------------------------------------------- model
def test_model_sizes() -> None:
    assert 100_000 <= count_params(model_config_for("tiny").build()) <= 300_000
    assert 2_000_000 <= count_params(model_config_for("small").build()) <= 5_000_000
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        model_config_for("huge")


def test_init_is_deterministic_given_seed() -> None:
    cfg = model_config_for("tiny")
    torch.manual_seed(5)
    a = cfg.build()
    torch.manual_seed(5)
    b = TinyLM.from_config(cfg)
    torch.manual_seed(6)
    c = cfg.build()
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)


def test_forward_is_causal_and_initial_loss_is_uniform() -> None:
    torch.manual_seed(0)
    model = TinyLM(vocab_size=50, d_model=32, n_layers=2, n_heads=4, seq_len=12)
    tokens = torch.randint(0, 50, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 50)
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 50
    other = model(changed)
    assert torch.allclose(logits[:, :8], other[:, :8], atol=1e-6)
    assert not torch.allclose(logits[:, 8:], other[:, 8:])
    loss = model.loss(torch.randint(0, 50, (4, 13)))
    assert loss.dim() == 0 and abs(loss.item() - math.log(50)) < 0.1


@pytest.mark.parametrize(
    "kwargs, message",
    [({"d_model": 30}, "divisible"), ({"n_layers": 0}, "n_layers"), ({"dropout": 1.0}, "dropout")],
)
def test_model_rejects_bad_config(kwargs: dict, message: str) -> None:
    args = {"vocab_size": 50, "d_model": 32, "n_layers": 1, "n_heads": 4, "seq_len": 8} | kwargs
    with pytest.raises(ValueError, match=message):
        TinyLM(**args)


def test_model_rejects_too_long_input() -> None:
    model = TinyLM(vocab_size=50, d_model=32, n_layers=1, n_heads=4, seq_len=8)
    with pytest.raises(ValueError, match="exceeds the model's seq_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("n_params", [5_000, 1_000_000, 50_000_000])
def test_mlp_has_requested_size(n_params: int) -> None:
    mlp = build_mlp_for_params(n_params)
    assert abs(count_params(mlp) - n_params) <= 0.02 * n_params
    width = mlp[0].in_features
    assert mlp(torch.ones(2, width)).shape == (2, width)


def test_mlp_rejects_impossible_size() -> None:
    with pytest.raises(ValueError, match="too small"):
        build_mlp_for_params(3, n_layers=4)


# ----------------------------------------------------------------------------- learning
def test_tiny_lm_learns_the_corpus() -> None:
    """200 AdamW steps take the held-out loss from uniform (ln 256 = 5.55) past unigram statistics."""
    torch.manual_seed(0)
    cfg = model_config_for("tiny")
    model = cfg.build()
    ds = TextDataset(cfg.seq_len, n_samples=4096)
    held_out = ds.batch(range(4000, 4096))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.0)
    with torch.no_grad():
        before = model.loss(held_out).item()
    for step in range(200):
        opt.zero_grad()
        model.loss(ds.batch(range(step * 8, step * 8 + 8))).backward()
        opt.step()
    with torch.no_grad():
        after = model.loss(held_out).item()
    assert before > 5.3
    # Character unigram entropy of this text is about 2.9 nats; below it the model uses context.
    assert after < 2.6, f"held-out loss {before:.2f} -> {after:.2f}"
