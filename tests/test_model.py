"""gpt2_platform.model: parity with transformers' GPT-2, the presets' real shapes, input checks, FLOPs."""

from __future__ import annotations

import pytest
import torch
import transformers

from gpt2_platform.checkpoint import from_hf_state_dict
from gpt2_platform.model import GPT2, PRESETS, flops_per_token, preset
from helpers_unit import TINY_CONTEXT, hf_tiny_model, nudge_weights, random_ids, tiny_model

# GPT-2 small as published: 124,439,808 parameters with the tied head counted once.
GPT2_SMALL_PARAMS = 124_439_808


@pytest.fixture(scope="module")
def twins() -> tuple[torch.nn.Module, GPT2]:
    """A transformers GPT2LMHeadModel and our GPT2 holding the same weights, both in eval mode."""
    hf = nudge_weights(hf_tiny_model(seed=0))
    ours = tiny_model(seed=1)  # different init, so the copy below is what makes them equal
    result = ours.load_state_dict(from_hf_state_dict(hf.state_dict()))
    assert not result.missing_keys and not result.unexpected_keys
    return hf, ours.eval()


def test_twins_are_the_expected_classes(twins) -> None:
    hf, _ = twins
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert hf.config._attn_implementation == "eager"


def test_logits_match_transformers(twins) -> None:
    hf, ours = twins
    ids = random_ids(3, 48, seed=1)
    with torch.no_grad():
        expected = hf(ids).logits
        logits, loss = ours(ids)
    assert loss is None
    assert logits.shape == (3, 48, 257) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_logits_match_transformers_at_full_context(twins) -> None:
    hf, ours = twins
    ids = random_ids(1, TINY_CONTEXT, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], hf(ids).logits, atol=1e-4, rtol=0)


def test_loss_matches_transformers(twins) -> None:
    # transformers shifts labels inside; we take next-token targets explicitly.
    hf, ours = twins
    ids = random_ids(2, 33, seed=3)
    with torch.no_grad():
        expected = hf(ids, labels=ids).loss
        _, loss = ours(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)


def test_lm_head_is_tied_to_the_token_embedding() -> None:
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        model.transformer.wte.weight[5].fill_(0.25)
    assert torch.equal(model.lm_head.weight[5], torch.full((64,), 0.25))


def test_targets_with_ignore_index_are_skipped() -> None:
    model = tiny_model().eval()
    ids = random_ids(2, 16, seed=4)
    targets = ids.clone()
    targets[:, 8:] = -100
    with torch.no_grad():
        _, masked = model(ids, targets)
        _, first_half = model(ids[:, :8], targets[:, :8])
    torch.testing.assert_close(masked, first_half, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", [name for name in PRESETS if name != "tiny"])
def test_presets_have_the_shapes_of_the_released_models(name: str) -> None:
    config = PRESETS[name]
    reference = transformers.GPT2Config(
        n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd, vocab_size=config.vocab_size
    )
    assert (config.vocab_size, config.n_positions) == (50257, 1024)
    # Built on the meta device: shapes without memory or init time.
    with torch.device("meta"):
        ours = GPT2(preset(name))
        hf = transformers.AutoModelForCausalLM.from_config(reference)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())


def test_gpt2_preset_matches_transformers_default_config() -> None:
    with torch.device("meta"):
        ours = GPT2(preset("gpt2"))
        hf = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config())
    expected = sum(p.numel() for p in hf.parameters())
    assert expected == GPT2_SMALL_PARAMS
    assert ours.num_params() == expected
    embeddings = ours.transformer.wte.weight.numel() + ours.transformer.wpe.weight.numel()
    assert ours.num_params(non_embedding=True) == expected - embeddings


def test_preset_overrides_fields() -> None:
    config = preset("tiny", dropout=0.1)
    assert config.dropout == 0.1 and config.n_layer == 2
    assert PRESETS["tiny"].dropout == 0.0


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="gpt3") as error:
        preset("gpt3")
    for name in PRESETS:
        assert name in str(error.value)


def test_sequence_longer_than_context_is_rejected() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=f"{TINY_CONTEXT + 1}.*{TINY_CONTEXT}"):
        model(random_ids(1, TINY_CONTEXT + 1))


def test_head_count_must_divide_width() -> None:
    with pytest.raises(ValueError, match="n_head"):
        preset("tiny", n_head=3)


@pytest.mark.parametrize("name", ["tiny", "gpt2", "gpt2-xl"])
@pytest.mark.parametrize("seq_len", [64, 1024])
def test_flops_per_token_is_6n_plus_attention(name: str, seq_len: int) -> None:
    config = preset(name)
    with torch.device("meta"):
        model = GPT2(config)
    params_without_wpe = model.num_params() - model.transformer.wpe.weight.numel()
    expected = 6 * params_without_wpe + 12 * config.n_layer * config.n_embd * seq_len
    assert flops_per_token(config, seq_len) == expected
