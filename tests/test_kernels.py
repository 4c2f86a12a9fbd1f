"""The engine's Triton decode kernels against the model's own modules.

Without a GPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), in fp32, so the
kernels' arithmetic is checked to rounding error; tests/test_gpu.py checks them compiled, in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpt2_platform.engine import kernels
from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams, resolve_decode_kernels
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.model import GPT2, preset
from gpt2_platform.tokenizer import byte_tokenizer
from helpers_unit import kernel_step_and_model_step

pytestmark = pytest.mark.skipif(not kernels.available(), reason="triton is not installed (pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def model() -> GPT2:
    torch.manual_seed(0)
    model = GPT2(preset("tiny")).eval()
    with torch.no_grad():  # layer norms and biases away from their 1/0 initialisation, so they count
        for name, param in model.named_parameters():
            if "ln_" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_ln_linear_is_layer_norm_then_linear_then_gelu_or_a_residual_add(model, rows):
    block = model.transformer.h[0]
    x = torch.randn(rows, 64) * 3 + 1
    ln = (block.ln_2.weight, block.ln_2.bias, block.ln_2.eps)
    fc, down = block.mlp.c_fc, block.mlp.c_proj
    expected = F.gelu(fc(block.ln_2(x)), approximate="tanh")
    with torch.no_grad():
        hidden = kernels.ln_linear(x, fc.weight, fc.bias, ln=ln, activation="gelu_tanh")
        assert_close(hidden, expected)
        residual = x.clone()
        out = kernels.ln_linear(hidden, down.weight, down.bias, residual=residual, out=residual)
    assert out is residual  # written in place
    assert_close(residual, x + down(expected))


def test_decode_attention_writes_the_step_and_attends_up_to_each_rows_own_position():
    torch.manual_seed(1)
    heads, dim, span = 2, 32, 64
    kv = torch.randn(4, 2, heads, span, dim)
    qkv = torch.randn(3, 3 * heads * dim)
    # Position 0 (only its own key), inside the first block of 16, and past several blocks.
    positions = torch.tensor([0, 5, 50])
    expected_kv = kv.clone()
    q, k, v = (t.view(3, heads, 1, dim) for t in qkv.split(heads * dim, dim=1))
    expected_kv[torch.arange(3), :, :, positions] = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)
    mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]
    expected = F.scaled_dot_product_attention(q, expected_kv[:3, 0], expected_kv[:3, 1], attn_mask=mask)
    out = kernels.decode_attention(qkv, kv, positions, block_t=16)
    assert_close(out, expected.reshape(3, heads * dim))
    assert_close(kv, expected_kv)  # slot 3, not in the batch, untouched


@pytest.mark.parametrize("slots", [[4, 0, 2], [3]], ids=["three-prompts", "one-prompt"])
def test_a_prefill_view_writes_the_cache_with_the_kernel_where_the_indexed_assignment_does(slots):
    # The keys and values are views of the input projection's (B, T, 3C) output, as the model makes them.
    # One prompt is its own case: its flattened slots are a zero-stride view unless copied.
    from gpt2_platform.engine.cache import KVCache

    torch.manual_seed(2)
    config = preset("tiny")
    batch, width, heads, dim = len(slots), 5, config.n_head, config.n_embd // config.n_head
    qkv = torch.randn(batch, width, 3 * heads * dim)
    q, k, v = (t.view(batch, width, heads, dim).transpose(1, 2) for t in qkv.split(heads * dim, dim=2))
    slots = torch.tensor(slots)
    positions = torch.arange(width)[None, :].expand(batch, width)
    written = {}
    for kernel_write in (False, True):
        cache = KVCache(config, 6, 8, torch.float32, torch.device("cpu"))
        # On CPU the cache would not choose the kernel by itself (it runs here in Triton's interpreter).
        cache.prefill_write_kernel = kernel_write
        view = cache.prefill(slots, positions)
        assert view.write_kernel is kernel_write
        view.attend(0, q, k, v, 1.0)
        written[kernel_write] = cache.kv[0]
    assert written[False].abs().sum() > 0 and torch.equal(written[True], written[False])


@pytest.mark.parametrize("batch", [1, 3, 5], ids=["gemv-1", "gemv-3", "cublas-around-our-attention"])
def test_the_kernels_decode_step_is_the_models_step(model, batch):
    prompts = [[1, 2, 3, 4, 5], [7] * 70, [9, 8], [4] * 33, [100, 50, 25]][:batch]
    ours, expected = kernel_step_and_model_step(model, prompts)
    assert_close(ours["logits"], expected["logits"])
    assert ours["positions"] == expected["positions"] == [len(p) for p in prompts]
    assert ours["steps"] == expected["steps"]
    for got, want in zip(ours["kv"], expected["kv"], strict=True):
        assert_close(got, want)


def test_an_engine_on_the_kernels_generates_what_it_does_on_the_models_modules(model):
    tokenizer = byte_tokenizer()
    prompts = [tokenizer(p)["input_ids"] for p in ("alice has", "the quick brown fox jumps")]
    # Three tokens: the prefill's, then two decode steps on the kernels, the second reading the cache entry the
    # first wrote. Each decode step takes seconds in Triton's interpreter.
    params = GenerationParams(max_tokens=3, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    outputs = {}
    for name in ("torch", "triton"):
        config = EngineConfig(max_batch_size=2, max_seq_len=64, dtype="fp32", decode_kernels=name)
        engine = Engine(model, tokenizer, config).start(warmup=False)
        try:
            assert (engine.runner.decoder is not None) == (name == "triton")
            # One request alone (batch 1: the GEMV kernels), then both together (batch 2).
            outputs[name] = [c.token_ids for c in engine.generate(prompts[:1], params)]
            outputs[name] += [c.token_ids for c in engine.generate(prompts, params)]
        finally:
            engine.shutdown()
    assert outputs["triton"] == outputs["torch"]


def test_decode_kernels_auto_keeps_the_models_modules_where_the_kernels_cannot_run_and_a_wrong_choice_says_why(
    monkeypatch,
):
    assert resolve_decode_kernels("auto", torch.device("cpu")) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs on CUDA GPUs.*use 'torch' or 'auto'"):
        resolve_decode_kernels("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="decode_kernels must be auto, triton or torch"):
        EngineConfig(decode_kernels="cuda")
    assert kernels.unsupported(preset("tiny", n_head=3, n_embd=48)) is None  # head size 16
    odd_heads = preset("tiny", n_head=4, n_embd=48)  # head size 12
    with pytest.raises(ValueError, match="power-of-two head size; this model's is 12"):
        resolve_decode_kernels("triton", torch.device("cpu"), odd_heads)
    assert resolve_decode_kernels("auto", torch.device("cuda"), odd_heads) == "torch"
