"""train/loss.py: the padded head gives the unpadded model's loss and gradients; what cannot run is refused."""

from __future__ import annotations

import pytest
import torch

from gpt2_platform.model import GPT2, preset
from gpt2_platform.train.loss import LMLoss, padded_size


def _loss_and_grads(model: GPT2, tokens: torch.Tensor, loss_fn: LMLoss | None) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :3] = -100  # ignored positions stay ignored
    logits, loss = model(inputs, targets) if loss_fn is None else model(inputs, targets, loss_fn=loss_fn)
    assert (logits is None) == (loss_fn is not None)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("multiple", [1, 64, 128])
def test_a_padded_head_gives_the_loss_and_gradients_of_the_unpadded_model(multiple):
    torch.manual_seed(0)
    model = GPT2(preset("tiny"))  # vocabulary 257: padded to 320 or 384
    tokens = torch.randint(0, 257, (3, 33))
    expected_loss, expected_grads = _loss_and_grads(model, tokens, None)
    loss, grads = _loss_and_grads(model, tokens, LMLoss("logits", multiple))
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    for name, grad in grads.items():
        # the padding's rows exist only inside the loss: the tied embedding's gradient keeps its shape
        assert grad.shape == expected_grads[name].shape
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_padding_sizes():
    assert padded_size(50257, 128) == 50304
    assert padded_size(50257, 64) == 50304
    assert padded_size(50304, 128) == 50304
    assert padded_size(257, 1) == 257


def test_options_that_cannot_run_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="'logits' or 'fused'"):
        LMLoss("chunked")
    with pytest.raises(ValueError, match="at least 1"):
        LMLoss("logits", 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU.*train.loss=logits"):
            LMLoss("fused")


def test_the_training_config_takes_the_loss_options_and_refuses_fused_without_gpus():
    from gpt2_platform.config_loader import ConfigError
    from gpt2_platform.train.config import from_dict

    config = from_dict({"train": {"vocab_multiple": 64}})
    assert (config.train.loss, config.train.vocab_multiple) == ("logits", 64)
    with pytest.raises(ConfigError, match="CUDA GPUs only"):
        from_dict({"train": {"loss": "fused"}})
    with pytest.raises(ConfigError, match="train.loss must be"):
        from_dict({"train": {"loss": "chunked"}})
    with pytest.raises(ConfigError, match="vocab_multiple must be >= 1"):
        from_dict({"train": {"vocab_multiple": 0}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_cross_entropy_matches_torchs_over_the_unpadded_columns(dtype):
    """train/cross_entropy.py in Triton's interpreter (conftest sets it without a GPU): the loss and the
    logits' gradient of F.cross_entropy on the first `vocab` columns; the padding's gradient is zero."""
    from gpt2_platform.train import cross_entropy

    if not cross_entropy.available():
        pytest.skip("triton is not installed")
    torch.manual_seed(0)
    vocab, width = 300, 384
    logits = (3 * torch.randn(24, width)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (24,))
    targets[[2, 7]] = -100
    loss = cross_entropy.cross_entropy(logits, targets, vocab)
    (2.0 * loss).backward()
    reference_logits = logits.detach().float()[:, :vocab].requires_grad_()
    reference = torch.nn.functional.cross_entropy(reference_logits, targets, ignore_index=-100)
    (2.0 * reference).backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(logits.grad[:, :vocab].float(), reference_logits.grad, atol=tolerance, rtol=1e-2)
    assert logits.grad[:, vocab:].abs().max().item() == 0.0
    assert logits.grad[[2, 7]].abs().max().item() == 0.0
