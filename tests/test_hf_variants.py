"""GPT-2 checkpoints that transformers wrote, in every variant its GPT2Config can describe: served right or refused.

Each variant is a transformers `GPT2LMHeadModel` with random weights, saved by transformers itself. Our
loader must give the same logits, and the engine (on the model's modules and on our Triton kernels, in
Triton's interpreter here) the same greedy tokens as transformers' `generate`; a field we do not
implement must be refused with its name and value. Where a field changes the arithmetic, the test also
checks that ignoring it would have been caught (the logits would differ), so it cannot pass vacuously.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpt2_platform import checkpoint
from gpt2_platform.engine import kernels
from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.model import GPT2
from gpt2_platform.tokenizer import byte_tokenizer
from gpt2_platform.train import loading
from gpt2_platform.train.config import ModelConfig
from helpers_unit import kernel_step_and_model_step

BASE = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=257, n_positions=128, bos_token_id=256, eos_token_id=256)
# Variant -> its config.json fields, and whether ignoring them changes the logits (so the test proves them).
VARIANTS: dict[str, tuple[dict, bool]] = {
    "default": ({}, False),
    "untied-head": ({"tie_word_embeddings": False}, True),
    "relu": ({"activation_function": "relu"}, True),
    "exact-gelu": ({"activation_function": "gelu"}, True),
    "silu": ({"activation_function": "silu"}, True),
    "gelu-pytorch-tanh": ({"activation_function": "gelu_pytorch_tanh"}, False),  # gelu_new's formula
    "unscaled-attention": ({"scale_attn_weights": False}, True),
    "attention-by-inverse-layer": ({"scale_attn_by_inverse_layer_idx": True}, True),
    # In fp32 the reordered, upcast scores are the same arithmetic; transformers applies the flag only in
    # its eager attention, which is what the reference uses for this variant.
    "reorder-and-upcast": ({"reorder_and_upcast_attn": True}, False),
    "narrow-mlp": ({"n_inner": 96}, False),  # a different weight shape: ignoring it cannot load at all
    "layer-norm-epsilon": ({"layer_norm_epsilon": 0.1}, True),
    "everything-at-once": (
        {
            "tie_word_embeddings": False,
            "activation_function": "silu",
            "scale_attn_by_inverse_layer_idx": True,
            "n_inner": 160,
            "layer_norm_epsilon": 1e-3,
        },
        True,
    ),
}
PROMPTS = ["alice has 3 apples.", "the quick brown fox", "a", "bob gives alice 2 apples. now", "7 + 5 ="]


def save_transformers_model(directory: Path, fields: dict, seed: int = 0, **save_options) -> torch.nn.Module:
    """A random GPT-2 of these config.json fields, saved by transformers' own save_pretrained."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(**BASE, **fields)
    attention = "eager" if fields.get("reorder_and_upcast_attn") else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    with torch.no_grad():
        # Far from the 0.02-std initialisation, so that attention scales, activations and layer-norm
        # epsilons move the logits well past rounding error.
        for name, param in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory, **save_options)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def variant(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_transformers_model(directory, VARIANTS[request.param][0])
    return request.param, reference, directory


def token_batch() -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1))


def test_our_logits_are_transformers_logits_for_its_checkpoint(variant):
    name, reference, directory = variant
    ours = checkpoint.load_pretrained(str(directory)).eval()
    ids = token_batch()
    with torch.no_grad():
        expected = reference(ids).logits
        logits, _ = ours(ids)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    fields, matters = VARIANTS[name]
    if matters:  # the same weights read as the default variant would have been wrong
        # (n_inner is left as it is: another width would not even load the weights.)
        defaults = {field: getattr(type(ours.config)(), field) for field in fields if field != "n_inner"}
        naive = GPT2(dataclasses.replace(ours.config, **defaults)).eval()
        state = ours.state_dict()
        if naive.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        naive.load_state_dict(state, strict=False)
        with torch.no_grad():
            wrong, _ = naive(ids)
        assert not torch.allclose(wrong, expected, rtol=1e-4, atol=1e-4), f"{fields} should change the logits"


def greedy_tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """One prompt alone (our GEMV kernels at batch 1), then all together (cuBLAS around our attention)."""
    params = GenerationParams(max_tokens=8, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    try:
        return [c.token_ids for c in engine.generate(prompts[:1], params)] + [
            c.token_ids for c in engine.generate(prompts, params)
        ]
    finally:
        engine.shutdown()


def transformers_greedy_tokens(reference: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    expected = []
    for prompt in [prompts[0], *prompts]:
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt], device=reference.device),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected.append(out[0, len(prompt) :].tolist())
    return expected


def engine_for(directory: Path, num_prompts: int) -> Engine:
    # On the model's modules: the engine on our kernels is checked for a variant on a GPU
    # (tests/test_gpu.py); in Triton's interpreter it takes a minute, and the kernels' step is checked below.
    config = EngineConfig(max_batch_size=num_prompts, max_seq_len=64, dtype="fp32", decode_kernels="torch")
    return Engine(checkpoint.load_pretrained(str(directory)), byte_tokenizer(), config).start(warmup=False)


def test_the_engine_generates_transformers_greedy_tokens_for_its_checkpoint(variant):
    _, reference, directory = variant
    prompts = [byte_tokenizer()(p)["input_ids"] for p in PROMPTS]
    ours = greedy_tokens(engine_for(directory, len(prompts)), prompts)
    assert ours == transformers_greedy_tokens(reference, prompts)


triton_only = pytest.mark.skipif(not kernels.available(), reason="triton is not installed (pip install -e '.[dev]')")


# Each kernel code path a variant reaches, once (Triton's interpreter is slow): the activations in our GEMV
# kernel (batch 1) and after the cuBLAS GEMM (batch 5); the attention scale and the layer norms' epsilon
# in both kinds of layer; the untied head and n_inner within everything-at-once. The default variant's
# step is tests/test_kernels.py's.
KERNEL_CASES = [
    *((name, batch) for name in ("relu", "exact-gelu", "silu", "everything-at-once") for batch in (1, 5)),
    ("unscaled-attention", 1),
    ("layer-norm-epsilon", 5),
]


@triton_only
@pytest.mark.parametrize("name, batch", KERNEL_CASES, ids=[f"{name}-batch-{batch}" for name, batch in KERNEL_CASES])
def test_our_decode_kernels_step_is_the_models_step_for_a_variant(tmp_path, name, batch):
    # The model's step equals transformers' (above); the kernels' step must equal the model's.
    save_transformers_model(tmp_path, VARIANTS[name][0])
    prompts = [byte_tokenizer()(p)["input_ids"] for p in PROMPTS][:batch]
    ours, expected = kernel_step_and_model_step(checkpoint.load_pretrained(str(tmp_path)).eval(), prompts, 64)
    torch.testing.assert_close(ours["logits"], expected["logits"], rtol=1e-5, atol=1e-5)


def test_our_save_of_a_variant_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    save_transformers_model(tmp_path / "theirs", VARIANTS["everything-at-once"][0])
    ours = checkpoint.load_pretrained(str(tmp_path / "theirs")).eval()
    checkpoint.save_pretrained(ours, tmp_path / "ours")
    assert "lm_head.weight" in load_file(str(tmp_path / "ours" / checkpoint.WEIGHTS_NAME))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], reloaded(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_sharded_checkpoint_loads_from_its_index(tmp_path):
    reference = save_transformers_model(tmp_path, {"tie_word_embeddings": False}, max_shard_size="60KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / checkpoint.WEIGHTS_INDEX_NAME).is_file()
    ours = checkpoint.load_pretrained(str(tmp_path)).eval()
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], reference(ids).logits, rtol=1e-4, atol=1e-4)
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"names shards that are not in .*{shards[-1]}"):
        checkpoint.load_pretrained(str(tmp_path))


def edit_config(directory: Path, **fields: object) -> None:
    path = directory / checkpoint.CONFIG_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"activation_function": "quick_gelu"},
            r"activation_function='quick_gelu' is not implemented; supported: gelu_new",
        ),
        ({"activation_function": "gelu_10"}, r"activation_function='gelu_10' is not implemented"),
        ({"add_cross_attention": True}, r"add_cross_attention=True is not implemented"),
        ({"model_type": "gpt_neo"}, r"checkpoint is a 'gpt_neo' model; only GPT-2"),
    ],
    ids=["quick-gelu", "clipped-gelu", "cross-attention", "not-gpt2"],
)
def test_a_config_field_we_do_not_implement_is_refused_by_name_in_every_flow(tmp_path, fields, message):
    save_transformers_model(tmp_path, {})
    edit_config(tmp_path, **fields)
    config_path = re.escape(f"{tmp_path / checkpoint.CONFIG_NAME}: ")
    with pytest.raises(ValueError, match=config_path + message):  # serving and batch load through here
        checkpoint.load_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=message):  # training's init_from, before any worker starts
        loading.model_config(ModelConfig(init_from=str(tmp_path)))


def test_a_head_that_contradicts_tie_word_embeddings_is_refused(tmp_path):
    untied = tmp_path / "untied"
    save_transformers_model(untied, {"tie_word_embeddings": False})
    edit_config(untied, tie_word_embeddings=True)  # config says tied, the file holds its own head
    with pytest.raises(ValueError, match="lm_head.weight that differs from transformer.wte.weight.*set tie_word"):
        checkpoint.load_pretrained(str(untied))
    tied = tmp_path / "tied"
    save_transformers_model(tied, {})
    edit_config(tied, tie_word_embeddings=False)  # config says untied, the file has no head
    with pytest.raises(ValueError, match="tie_word_embeddings is false, but the weights hold no lm_head.weight"):
        checkpoint.load_pretrained(str(tied))


def test_serving_and_batch_refuse_such_a_checkpoint_before_anything_starts(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpt2_platform.serve.app import gpt2_deployment
    from test_batch import generate_main

    model = tmp_path / "model"
    save_transformers_model(model, {})
    byte_tokenizer().save_pretrained(model)
    edit_config(model, activation_function="quick_gelu")
    message = "activation_function='quick_gelu' is not implemented"
    with pytest.raises(ValueError, match=message):  # the app builder: Serve never sees a deployment
        gpt2_deployment({"model": str(model)})
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["alice has"]}), prompts)
    code = generate_main(["--input", str(prompts), "--output", str(tmp_path / "out"), "--model", str(model)])
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in out, out
    assert not (tmp_path / "out").exists()
