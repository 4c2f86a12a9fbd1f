"""What only a CUDA GPU can show: bf16 and compile on the device, NCCL workers, MFU and peak memory.

Skipped without CUDA; run on a GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from gpt2_platform.engine.modes import Pick, SamplingMode
from gpt2_platform.model import GPT2, preset
from gpt2_platform.train.config import OptimConfig
from gpt2_platform.train.parallelize import parallelize
from gpt2_platform.train.step import TrainStep, build_optimizer, resolve_precision

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_auto_precision_is_bf16_and_the_optimizer_fused_on_gpu():
    device = torch.device("cuda")
    assert resolve_precision("auto", device).name == "bf16"
    optimizer = build_optimizer(GPT2(preset("tiny")).to(device), OptimConfig(), device)
    assert optimizer.defaults["fused"] is True


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compiled_mixed_precision_step_learns_a_batch_on_gpu(precision):
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT2(preset("tiny")).to(device)
    step = TrainStep(
        parallelize(model, device, compile_mode="default"),
        build_optimizer(model, OptimConfig(lr=3e-3, weight_decay=0.0), device),
        resolve_precision(precision, device),
        device,
        grad_clip=1.0,
    )
    tokens = torch.randint(0, 257, (8, 65), device=device)
    losses = [step([(tokens[:, :-1], tokens[:, 1:])], lr=3e-3)[0].item() for _ in range(30)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0


def test_ray_train_job_on_gpu_reports_mfu_and_peak_memory(ray_cluster, corpus, tmp_path):
    from gpt2_platform.train.trainer import fit

    config = tiny_config(corpus, tmp_path, "scaling.use_gpu=true", "train.precision=auto", "train.max_steps=10")
    result = fit(config)
    assert result.metrics["step"] == 10
    assert 0 < result.metrics["mfu"] < 1
    assert result.metrics["peak_mem_gib"] > 0


def test_engine_with_cuda_graphs_matches_transformers_greedy_in_fp32(tmp_path):
    from transformers import AutoModelForCausalLM

    from gpt2_platform import checkpoint
    from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams
    from gpt2_platform.engine.sampling import SamplingParams
    from gpt2_platform.tokenizer import byte_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    checkpoint.save_pretrained(model, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").cuda().eval()
    engine = Engine(model, byte_tokenizer(), EngineConfig(max_batch_size=8, max_seq_len=128, dtype="fp32")).start()
    try:
        assert engine.runner.use_graphs and engine.runner.graphs, "decode steps should be captured as CUDA graphs"
        prompts = [[5, 6, 7], list(range(10, 40)), [100] * 17]
        params = GenerationParams(max_tokens=32, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
        results = engine.generate(prompts, params)
        # One at a time too: batch 1 runs the GEMV kernels (with programmatic dependent launch on Hopper).
        alone = [engine.generate([prompt], params)[0] for prompt in prompts]
        for prompt, result, single in zip(prompts, results, alone, strict=True):
            assert single.token_ids == result.token_ids
            with torch.no_grad():
                reference = hf.generate(
                    torch.tensor([prompt], device="cuda"),
                    max_new_tokens=32,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(prompt) :].tolist()
            assert result.token_ids == reference
    finally:
        engine.shutdown()


@pytest.mark.parametrize("batch", [1, 3, 70], ids=["gemv", "cublas", "eager-prefill"])
def test_logprobs_and_echo_from_cuda_graphs_match_transformers_in_fp32(tmp_path, batch):
    # The log-probability modes' graphs (decode and prefill, captured on first use) and the echo prefill, on the GPU
    # paths the CPU tests do not reach: our Triton kernels at batch 1, cuBLAS above, an eager prefill past
    # the graphed limit (64 prompts) at 70.
    from transformers import AutoModelForCausalLM

    from gpt2_platform import checkpoint
    from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams
    from gpt2_platform.engine.sampling import SamplingParams
    from gpt2_platform.tokenizer import byte_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    checkpoint.save_pretrained(model, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").cuda().eval()
    config = EngineConfig(max_batch_size=80, max_seq_len=128, dtype="fp32")
    engine = Engine(model, byte_tokenizer(), config).start(modes=("greedy",))
    prompts = [list(range(3 + i % 50, 20 + i % 50 + i % 7)) for i in range(batch)]
    greedy = SamplingParams(temperature=0.0)
    try:
        results = engine.generate(
            prompts, GenerationParams(max_tokens=12, ignore_eos=True, sampling=greedy, logprobs=2)
        )
        scored = engine.generate(prompts, GenerationParams(max_tokens=0, logprobs=2, echo=True))
        assert any(mode.logprobs for _, _, mode in engine.runner.graphs)
    finally:
        engine.shutdown()
    for prompt, result, score in zip(prompts, results, scored, strict=True):
        tokens = prompt + result.token_ids
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([tokens], device="cuda")).logits[0].double(), dim=-1).cpu()
        got = [lp for lp, _ in result.logprobs]
        want = [expected[len(prompt) - 1 + i, t].item() for i, t in enumerate(result.token_ids)]
        assert got == pytest.approx(want, abs=1e-4)
        assert all(top[0][0] == t for t, (_, top) in zip(result.token_ids, result.logprobs, strict=True))
        prompt_got = [entry[0] for entry in score.prompt_logprobs[1:]]
        assert prompt_got == pytest.approx([expected[i, t].item() for i, t in enumerate(prompt[1:])], abs=1e-4)


@pytest.mark.parametrize(
    "sampling", [(0.0, 0, 1.0), (0.9, 0, 1.0), (0.9, 20, 0.8)], ids=["greedy", "plain", "filtered"]
)
def test_a_prefill_replayed_as_a_graph_fills_the_cache_and_picks_as_the_eager_one(sampling):
    from gpt2_platform.engine.runner import ModelRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    device = torch.device("cuda")
    graphed = ModelRunner(model, 4, 128, torch.float32, device, cuda_graphs=True)
    eager = ModelRunner(model, 4, 128, torch.float32, device, cuda_graphs=False)
    temperature, top_k, top_p = sampling
    # Lengths in three width buckets; the longer prompt first, so the shorter one's padding holds stale tokens.
    prompts = [list(range(1, 100)), [7, 8, 9], list(range(40, 60))]
    for slot, prompt in enumerate(prompts):
        for runner in (graphed, eager):
            runner.set_sampling(slot, temperature, top_k, top_p, seed=slot)
        assert graphed.prefill([prompt], [slot]) == eager.prefill([prompt], [slot])
        for ours, theirs in zip(graphed.cache.kv, eager.cache.kv, strict=True):
            torch.testing.assert_close(ours[slot, :, :, : len(prompt)], theirs[slot, :, :, : len(prompt)])
    mode = SamplingMode(Pick("greedy" if temperature == 0 else ("filtered" if top_k else "plain")), logprobs=False)
    assert {(1, 16, mode), (1, 32, mode), (1, 128, mode)} <= set(graphed.graph_cache.prefill)
    # Several prompts admitted together: one replay of the graph of their batch bucket (4, so one padding
    # row, which must land in the scratch slot, not in slot 1) and their longest prompt's width.
    for runner in (graphed, eager):
        runner.set_sampling(3, 0.0, 0, 1.0, seed=3)  # and a greedy row beside the others' mode
    slot_1 = [t[1].clone() for t in graphed.cache.kv]
    state_1 = [graphed.state.tokens[1].item(), graphed.state.positions[1].item(), graphed.state.steps[1].item()]
    slots = [2, 0, 3]
    assert graphed.prefill(prompts, slots) == eager.prefill(prompts, slots)
    for slot, prompt in zip(slots, prompts, strict=True):
        for ours, theirs in zip(graphed.cache.kv, eager.cache.kv, strict=True):
            torch.testing.assert_close(ours[slot, :, :, : len(prompt)], theirs[slot, :, :, : len(prompt)])
        # Each slot is left as a decode step reads it: the first token, the position after the prompt, step 1.
        for runner in (graphed, eager):
            assert runner.state.positions[slot].item() == len(prompt) and runner.state.steps[slot].item() == 1
        assert graphed.state.tokens[slot].item() == eager.state.tokens[slot].item()
    for before, after in zip(slot_1, graphed.cache.kv, strict=True):
        assert torch.equal(before, after[1]), "a padding row of the prefill graph wrote into slot 1"
    assert [graphed.state.tokens[1].item(), graphed.state.positions[1].item(), graphed.state.steps[1].item()] == state_1
    assert any(key[0] == 4 for key in graphed.graph_cache.prefill)


def test_a_prefill_and_a_decode_step_copy_their_inputs_from_pinned_memory_only():
    """A copy from pageable memory holds the host until the device has run everything queued before it, so
    the engine's host work stops overlapping the device's (torch copies a strided slice of a pinned buffer
    through a pageable temporary)."""
    from torch.profiler import ProfilerActivity, profile

    from gpt2_platform.engine.runner import ModelRunner

    torch.manual_seed(0)
    runner = ModelRunner(GPT2(preset("tiny")), 8, 64, torch.bfloat16, torch.device("cuda"), cuda_graphs=True)
    runner.warmup(("greedy",))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # 3 prompts (a graph of 4 rows) of a width shorter than the buffer's rows; then a step of 3 active
        # slots (batch bucket 4 of the 9 columns of the staged buffer).
        first = runner.start_prefill([[1, 2, 3], [4, 5], list(range(6, 20))], [0, 1, 2]).tokens()
        tokens = runner.launch(3, [0, 1, 2], 14).tokens()
        torch.cuda.synchronize()
    copies = [e.key for e in prof.key_averages() if e.key.startswith("Memcpy HtoD")]
    assert copies and not [name for name in copies if "Pageable" in name], copies
    assert len(first) == 3 and len(tokens) == 3


def test_packed_prefill_graphs_fill_the_cache_as_the_padded_graphs_do_in_bf16():
    # Variable-length flash attention takes no fp32: bf16, with its tolerance, against the padded path.
    from gpt2_platform.engine.prefill import PACKED_PREFILL_MIN_PROMPTS
    from gpt2_platform.engine.runner import ModelRunner

    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    device = torch.device("cuda")
    runners = {
        packed: ModelRunner(model, 64, 128, torch.bfloat16, device, cuda_graphs=True, packed_prefill=packed)
        for packed in (True, False)
    }
    with pytest.raises(ValueError, match="engine.packed_prefill=true needs bf16 or fp16"):
        ModelRunner(model, 8, 64, torch.float32, device, cuda_graphs=True, packed_prefill=True)
    assert next(model.parameters()).dtype == torch.bfloat16  # the refused engine left the shared model alone
    packed, padded = runners[True], runners[False]
    for runner in runners.values():
        runner.warmup(("greedy",))
    # With packing, padded graphs of more than 16 rows would never replay: warm-up leaves them out.
    assert max(key[0] for key in padded.graph_cache.prefill) == 64
    assert max(key[0] for key in packed.graph_cache.prefill) == PACKED_PREFILL_MIN_PROMPTS
    untouched = [t[63].clone() for t in packed.cache.kv]  # a slot no prompt goes to
    for count, offset in ((PACKED_PREFILL_MIN_PROMPTS + 20, 0), (PACKED_PREFILL_MIN_PROMPTS, 3)):
        prompts = [
            [(11 * i + 3 * j + offset) % 250 + 1 for j in range(1 + (37 * i + offset) % 127)] for i in range(count)
        ]
        slots = [(5 * i + offset) % 63 for i in range(count)]  # distinct, never slot 63
        firsts = [runner.prefill(prompts, slots) for runner in (packed, padded)]
        agree = sum(a == b for a, b in zip(*firsts, strict=True))
        assert agree >= count - 2, firsts  # bf16: a near-tie may flip
        for slot, prompt in zip(slots, prompts, strict=True):
            for ours, theirs in zip(packed.cache.kv, padded.cache.kv, strict=True):
                torch.testing.assert_close(
                    ours[slot, :, :, : len(prompt)], theirs[slot, :, :, : len(prompt)], atol=3e-2, rtol=3e-2
                )
            assert packed.state.positions[slot].item() == len(prompt) and packed.state.steps[slot].item() == 1
    # Two graphs (64 prompts' bucket, 16's), each replayed once; padding wrote only into the scratch slot.
    assert packed.packed_prefills == 2 and len(packed.graph_cache.packed) == 2 and padded.packed_prefills == 0
    for before, after in zip(untouched, packed.cache.kv, strict=True):
        assert torch.equal(before, after[63])


def test_a_packed_prefill_in_an_engine_that_compiles_nothing_does_not_import_dynamo():
    # Importing torch._dynamo takes seconds; `varlen_attn`'s wrapper did it on the first packed prefill, which
    # a batch job ran mid-job. A fresh process: this one may have imported dynamo for other tests.
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys
import torch
from gpt2_platform.engine.prefill import PACKED_PREFILL_MIN_PROMPTS
from gpt2_platform.engine.runner import ModelRunner
from gpt2_platform.model import GPT2, preset
runner = ModelRunner(GPT2(preset("tiny")), 64, 128, torch.bfloat16, torch.device("cuda"), cuda_graphs=True,
                     packed_prefill=True)
runner.warmup(("greedy",))
count = PACKED_PREFILL_MIN_PROMPTS + 4
runner.prefill([[1 + i % 200] * (10 + i) for i in range(count)], list(range(count)))
assert runner.packed_prefills == 1
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""
    platform = Path(__file__).resolve().parents[1] / "platform"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(platform), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dynamo imported: False" in done.stdout


def test_engine_bf16_sampling_is_reproducible_per_seed_on_gpu():
    from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams
    from gpt2_platform.engine.sampling import SamplingParams
    from gpt2_platform.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    engine = Engine(GPT2(preset("tiny")), byte_tokenizer(), EngineConfig(max_batch_size=16, max_seq_len=128)).start()
    try:
        params = GenerationParams(
            max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=0.8, top_k=50, seed=3)
        )
        (alone,) = engine.generate([[1, 2, 3]], params)
        crowd = engine.generate([[i, i + 1] for i in range(10)] + [[1, 2, 3]], params)
        assert crowd[-1].token_ids == alone.token_ids
        assert engine.runner.model.transformer.wte.weight.dtype == torch.bfloat16
    finally:
        engine.shutdown()


def test_a_sampling_mode_left_out_of_the_warm_up_is_captured_on_first_use():
    from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams
    from gpt2_platform.engine.sampling import SamplingParams
    from gpt2_platform.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    config = EngineConfig(max_batch_size=4, max_seq_len=64, dtype="bf16")
    sampled = GenerationParams(max_tokens=8, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=5))
    results = []
    for modes in (("greedy", "plain", "filtered"), ("greedy",)):
        engine = Engine(model, byte_tokenizer(), config).start(modes=modes)
        try:
            assert {mode for _, _, mode in engine.runner.graphs} == {SamplingMode(Pick(m), False) for m in modes}
            assert engine.stats()["captures_on_use"] == 0  # warm-up's captures are not counted as first use
            results.append(engine.generate([[1, 2, 3]], sampled)[0].token_ids)
            assert SamplingMode(Pick.PLAIN, False) in {mode for _, _, mode in engine.runner.graphs}
            stats = engine.stats()
            if modes == ("greedy",):  # the plain mode's decode graph (at least) was captured on first use
                assert stats["captures_on_use"] >= 1 and stats["capture_on_use_s"] > 0
            else:
                assert stats["captures_on_use"] == 0
        finally:
            engine.shutdown()
    assert results[0] == results[1]


def test_compiled_graphs_of_every_sampling_mode_match_the_eager_graphs_on_gpu():
    # What holds `compile` back as a serving default: every mode's compiled graph, checked on a GPU.
    from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams
    from gpt2_platform.engine.sampling import SamplingParams
    from gpt2_platform.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    requests = [
        ([1, 2, 3], GenerationParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0))),
        ([4, 5], GenerationParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.9, seed=7))),
        (
            [6],
            GenerationParams(
                max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.9, top_p=0.8, seed=8)
            ),
        ),
    ]
    outputs = []
    for compile_step in (False, True):
        config = EngineConfig(max_batch_size=4, max_seq_len=32, dtype="fp32", compile=compile_step)
        engine = Engine(model, byte_tokenizer(), config).start()
        try:
            alone = [engine.generate([prompt], params)[0].token_ids for prompt, params in requests]
            together = engine.generate([p for p, _ in requests], [params for _, params in requests])
            assert [c.token_ids for c in together] == alone
            assert {mode for _, _, mode in engine.runner.graphs} == {SamplingMode(pick, False) for pick in Pick}
            outputs.append(alone)
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]


# The shapes of the GPT2Config variants our kernels implement (tests/test_hf_variants.py checks them against
# transformers on the CPU), on GPT-2 124M's width.
KERNEL_VARIANTS = {
    "gpt2": {},
    "untied-silu-inverse-layer-narrow": dict(
        tie_word_embeddings=False, activation_function="silu", scale_attn_by_inverse_layer_idx=True, n_inner=2048
    ),
    "relu-unscaled": dict(activation_function="relu", scale_attn_weights=False),
    "exact-gelu": dict(activation_function="gelu"),
}


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("batch", [1, 4, 8, 64, 256], ids=["gemv-1", "gemv-4", "cublas-8", "cublas-64", "cublas-256"])
def test_the_triton_decode_kernels_match_the_models_modules_in_bf16_on_gpu(batch, variant):
    from helpers_unit import kernel_step_and_model_step

    torch.manual_seed(0)
    model = GPT2(preset("gpt2", **KERNEL_VARIANTS[variant]))
    prompts = [torch.randint(0, 50257, (int(n),)).tolist() for n in torch.randint(1, 200, (batch,))]
    ours, expected = kernel_step_and_model_step(model, prompts, 256, torch.bfloat16, "cuda")
    ours, logits = ours["logits"].float(), expected["logits"].float()
    # bf16: the fused kernels round in other places than cuBLAS and torch's layer norm. So a row may pick
    # another token than the model's modules where two are within that rounding, and only there.
    tolerance = 0.03 * logits.abs().max()
    assert (ours - logits).abs().max() < tolerance
    picked = logits.gather(1, ours.argmax(-1, keepdim=True))[:, 0]
    assert (picked >= logits.max(-1).values - tolerance).all()


def test_an_engine_on_gpu_generates_transformers_greedy_tokens_for_a_transformers_variant(tmp_path):
    from gpt2_platform import checkpoint
    from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams
    from gpt2_platform.engine.sampling import SamplingParams
    from gpt2_platform.tokenizer import byte_tokenizer
    from test_hf_variants import PROMPTS, VARIANTS, save_transformers_model, transformers_greedy_tokens

    reference = save_transformers_model(tmp_path, VARIANTS["everything-at-once"][0]).cuda()
    tokenizer = byte_tokenizer()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    config = EngineConfig(max_batch_size=8, max_seq_len=64, dtype="fp32")  # kernels and CUDA graphs: auto
    engine = Engine(checkpoint.load_pretrained(str(tmp_path)), tokenizer, config).start()
    params = GenerationParams(max_tokens=8, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    try:
        assert engine.runner.decoder is not None
        ours = [c.token_ids for c in engine.generate(prompts[:1], params)]
        ours += [c.token_ids for c in engine.generate(prompts, params)]
    finally:
        engine.shutdown()
    assert ours == transformers_greedy_tokens(reference, prompts)


def test_programmatic_dependent_launch_gives_the_same_logits_as_plain_launches_in_cuda_graphs():
    """PDL lets a kernel start before the previous one ends: a read before its gdc_wait would race."""
    from gpt2_platform.bench.generation import fed_step
    from gpt2_platform.engine import kernels
    from gpt2_platform.engine.runner import ModelRunner

    device = torch.device("cuda")
    if not kernels.pdl_supported(device):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    tokens = {}
    for pdl in (False, True):
        torch.manual_seed(0)  # the same weights for both
        runner = ModelRunner(
            GPT2(preset("gpt2")), 8, 256, torch.bfloat16, device, cuda_graphs=True, decode_kernels="triton"
        )
        runner.decoder.pdl = pdl
        with torch.inference_mode():
            # Batch 1 runs our GEMV kernels back to back; batch 8 our kernels after cuBLAS GEMMs.
            steps = [
                fed_step(runner, [11 + (t + row) % 50 for row in range(batch)], [t] * batch, [1] * batch)
                for batch in (1, 8)
                for t in range(100)
            ]
        tokens[pdl] = steps
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("multiple", [1, 128])
def test_the_fused_loss_gives_the_plain_losses_and_gradients_on_gpu(multiple):
    """liger's fused head + cross-entropy (padding masked by a -inf bias) against the model's own logits,
    in fp32 where the two must agree to rounding, and in bf16 for the loss."""
    pytest.importorskip("liger_kernel")
    from gpt2_platform.train.loss import LMLoss

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT2(preset("gpt2", n_layer=2)).to(device)
    tokens = torch.randint(0, 50257, (4, 257), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :5] = -100

    def run(loss_fn, dtype):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
            _, loss = model(inputs, targets) if loss_fn is None else model(inputs, targets, loss_fn=loss_fn)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fused = LMLoss("fused", multiple)
    plain_loss, plain_grads = run(None, torch.float32)
    fused_loss, fused_grads = run(fused, torch.float32)
    assert fused_loss == pytest.approx(plain_loss, abs=1e-4)
    for name, grad in fused_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-5, rtol=1e-3, msg=name)
    assert run(fused, torch.bfloat16)[0] == pytest.approx(run(None, torch.bfloat16)[0], abs=5e-3)


def test_the_triton_cross_entropy_matches_torchs_on_gpt2s_padded_vocabulary_on_gpu():
    from gpt2_platform.train.cross_entropy import cross_entropy

    torch.manual_seed(0)
    logits = (4 * torch.randn(512, 50304, device="cuda")).bfloat16().requires_grad_()
    targets = torch.randint(0, 50257, (512,), device="cuda")
    targets[:9] = -100
    loss = cross_entropy(logits, targets, 50257)
    loss.backward()
    reference_logits = logits.detach().float()[:, :50257].requires_grad_()
    reference = torch.nn.functional.cross_entropy(reference_logits, targets)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(logits.grad[:, :50257].float(), reference_logits.grad, atol=1e-6, rtol=1e-2)
    assert logits.grad[:, 50257:].abs().max().item() == 0.0
