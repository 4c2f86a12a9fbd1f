"""Small builders shared by the CPU unit tests (a tiny GPT-2, random token ids, its transformers twin).

Kept out of conftest.py on purpose: these are plain functions, imported where needed.
"""

from __future__ import annotations

import torch

from gpt2_platform.model import GPT2, preset

TINY_VOCAB = 257
TINY_CONTEXT = 256
# The tiny preset as a transformers GPT2Config, dropout off so train and eval agree.
TINY_HF_CONFIG = dict(
    n_layer=2,
    n_head=2,
    n_embd=64,
    vocab_size=TINY_VOCAB,
    n_positions=TINY_CONTEXT,
    resid_pdrop=0,
    embd_pdrop=0,
    attn_pdrop=0,
)


def tiny_model(seed: int = 0, **overrides: object) -> GPT2:
    """The tiny preset (2 layers, 64 wide) with weights drawn from `seed`."""
    torch.manual_seed(seed)
    return GPT2(preset("tiny", **overrides))


def random_ids(batch: int, length: int, seed: int = 0, vocab_size: int = TINY_VOCAB) -> torch.Tensor:
    """Token ids `(batch, length)` from their own generator (the global RNG is left alone)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def hf_tiny_model(seed: int = 0):
    """A transformers GPT2LMHeadModel of the tiny shape, eager attention, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(**TINY_HF_CONFIG)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def nudge_weights(model: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> torch.nn.Module:
    """Add noise to every tensor, in place: init leaves biases at 0 and LayerNorms at 1, and its
    small weights keep activations where exact and tanh GELU agree to 1e-4, so a comparison of
    fresh models would not notice a dropped bias or the wrong activation."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return model


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Both modules hold bit-identical tensors under the same names."""
    state_a, state_b = a.state_dict(), b.state_dict()
    assert list(state_a) == list(state_b)
    for name, tensor in state_a.items():
        assert torch.equal(tensor, state_b[name]), name


def kernel_step_and_model_step(
    model: GPT2,
    prompts: list[list[int]],
    max_seq_len: int = 128,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[dict, dict]:
    """One decode step after prefilling `prompts` (one slot each), computed twice from the same state:
    by our Triton kernels and by the model's own modules. Each result holds the step's `logits`
    (vocabulary wide), `positions`, `steps` and the KV cache (`kv`) it left."""
    from gpt2_platform.engine import kernels
    from gpt2_platform.engine.runner import ModelRunner

    batch, device = len(prompts), torch.device(device)
    runner = ModelRunner(model, batch, max_seq_len, dtype, device, cuda_graphs=device.type == "cuda")
    decoder = kernels.TritonDecoder(runner.model, runner.head)
    first = runner.prefill(prompts, list(range(batch)))
    runner.staged[:, :batch] = torch.tensor(
        [[f, len(p), 1, 1] for f, p in zip(first, prompts, strict=True)], device=device
    ).T
    before = [t.clone() for t in runner.cache.kv]
    results = []
    with torch.inference_mode():
        for step in (
            lambda: runner._forward(batch, max_seq_len),
            lambda: decoder.forward(
                runner.staged, runner.state.tokens, runner.state.positions, runner.state.steps, runner.cache.kv, batch
            ),
        ):
            for t, saved in zip(runner.cache.kv, before, strict=True):
                t.copy_(saved)
            logits, positions, steps = step()
            results.append(
                dict(
                    logits=logits[:, : model.config.vocab_size].clone(),
                    positions=positions.tolist(),
                    steps=steps.tolist(),
                    kv=[t.clone() for t in runner.cache.kv],
                )
            )
    return results[1], results[0]
