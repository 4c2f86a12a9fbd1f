"""LoRA (lora.py) and its peft-format adapters (adapter.py): adapters sit in the forward and train alone under
activation checkpointing, compile, DDP and FSDP2; what we write peft loads onto transformers' GPT-2 with our
logits, what peft writes we load, merged exports load in transformers alone, and bad adapters are refused in
one line."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from conftest import REPO_ROOT, free_port
from gpt2_platform import checkpoint, demo_data
from gpt2_platform.adapter import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    export_lora,
    save_merged,
    write_adapter,
)
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.lora import TARGETS, LoraConfig, apply_lora, lora_modules, merge_lora
from gpt2_platform.model import GPT2
from gpt2_platform.tokenizer import byte_tokenizer
from gpt2_platform.train.parallelize import apply_activation_checkpointing, parallelize
from helpers_unit import hf_tiny_model, nudge_weights, random_ids, tiny_model

RANK, ALPHA = 4, 8.0


def lora_model(seed: int = 0, config: LoraConfig | None = None, **overrides: object) -> GPT2:
    """The tiny model (nudged, so biases and norms count) with adapters whose B is random: a fresh B of
    zeros would leave the logits as they were, whatever the adapters' wiring."""
    model = apply_lora(nudge_weights(tiny_model(seed, **overrides), seed), config or LoraConfig(r=RANK, alpha=ALPHA))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.copy_(0.1 * torch.randn(module.lora_B.weight.shape, generator=generator))
    return model.eval()


def save_base(model: GPT2, directory: Path) -> Path:
    """The model's base weights (without its adapters) as a Hugging Face directory with the byte tokenizer."""
    base = {name: t for name, t in model.state_dict().items() if ".lora_" not in name}
    plain = GPT2(model.config)
    plain.load_state_dict(base)
    return checkpoint.save_pretrained(plain, directory, extra=lambda d: byte_tokenizer().save_pretrained(d))


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out[0]


def test_config_names_the_field_in_its_errors_and_takes_peft_names() -> None:
    assert LoraConfig().targets == list(TARGETS)
    assert LoraConfig(targets=["c_proj"]).targets == ["attn.c_proj", "mlp.c_proj"]  # peft's c_proj is both
    assert LoraConfig(targets=["mlp.c_fc", "c_attn"]).targets == ["attn.c_attn", "mlp.c_fc"]
    for fields, field in [
        (dict(r=0), "model.lora.r"),
        (dict(r=2.5), "model.lora.r"),
        (dict(alpha=0), "model.lora.alpha"),
        (dict(dropout=1.0), "model.lora.dropout"),
        (dict(targets=["q_proj"]), "model.lora.targets"),
        (dict(targets=[]), "model.lora.targets"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            LoraConfig(**fields)


def test_adapters_are_in_the_forward_and_alone_trainable() -> None:
    ids = random_ids(2, 16)
    base = nudge_weights(tiny_model()).eval()
    before = logits(base, ids)
    names = list(base.state_dict())
    apply_lora(base, LoraConfig(r=RANK, alpha=ALPHA))
    # A fresh adapter (B = 0) changes nothing; the base weights keep their names (run checkpoints key on them).
    torch.testing.assert_close(logits(base, ids), before, rtol=0, atol=0)
    assert [name for name in base.state_dict() if ".lora_" not in name] == names
    trainable = sorted(name for name, p in base.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        f"transformer.h.{layer}.{target}.lora_{side}.weight" for layer in (0, 1) for target in TARGETS for side in "AB"
    )
    # A non-zero B moves the logits of every position: an adapter the forward bypassed would not.
    with torch.no_grad():
        for module in lora_modules(base).values():
            module.lora_B.weight.normal_(0.0, 0.1)
    assert (logits(base, ids) - before).abs().amax(dim=-1).min() > 1e-3
    # Merged into plain projections, the model computes the same.
    adapted = logits(base, ids)
    merge_lora(base)
    assert not lora_modules(base)
    assert type(base.transformer.h[0].attn.c_attn) is type(base.transformer.h[1].mlp.c_proj) is torch.nn.Linear
    torch.testing.assert_close(logits(base, ids), adapted, rtol=0, atol=1e-5)


def test_checkpointed_compiled_model_gives_the_eager_gradients_to_the_adapters_only() -> None:
    ids = random_ids(2, 17)
    model = lora_model(config=LoraConfig(r=RANK, alpha=ALPHA)).train()
    _, expected_loss = model(ids[:, :-1], ids[:, 1:])
    expected_loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert len(expected) == 2 * len(TARGETS) * 2
    model.zero_grad()
    apply_activation_checkpointing(model)
    # fullgraph: dynamo traces the adapters with no graph break (aot_eager: the same graphs inductor gets,
    # without its minutes of CPU code generation).
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _, loss = compiled(ids[:, :-1], ids[:, 1:])
    loss.backward()
    got = {name: p.grad for name, p in checkpoint.clean_state_dict(dict(model.named_parameters())).items()}
    assert sorted(name for name, grad in got.items() if grad is not None) == sorted(expected)
    torch.testing.assert_close(loss, expected_loss)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


def _train_steps(model: GPT2, wrapped: torch.nn.Module, ids: torch.Tensor) -> None:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        _, loss = wrapped(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _parallel_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: 2 SGD steps on its half of the batch under FSDP2 (checkpointed) and under DDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ids = random_ids(4, 17, seed=1)[2 * rank : 2 * rank + 2]
        for strategy in ("fsdp", "ddp"):
            model = lora_model().train()
            wrapped = parallelize(model, torch.device("cpu"), gradient_checkpointing=True, strategy=strategy)
            _train_steps(model, wrapped, ids)
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(state, f"{out}.{strategy}")
    finally:
        dist.destroy_process_group()


def test_two_fsdp2_or_ddp_workers_train_the_adapters_as_one_process_does(tmp_path: Path) -> None:
    """FSDP2 shards a block whose frozen base and trainable adapters share one parameter group."""
    out = str(tmp_path / "state")
    mp.spawn(_parallel_worker, args=(free_port(), out), nprocs=2)
    model = lora_model().train()
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    _train_steps(model, model, random_ids(4, 17, seed=1))
    for strategy in ("fsdp", "ddp"):
        state = torch.load(f"{out}.{strategy}", weights_only=True)
        assert sorted(state) == sorted(model.state_dict())
        for name, expected in model.state_dict().items():
            moved = (expected - initial[name]).abs().max().item()
            assert (moved > 0) == (".lora_" in name), f"{name} moved by {moved}: only adapters train"
            torch.testing.assert_close(state[name], expected, rtol=1e-4, atol=1e-6, msg=f"{strategy}: {name}")


def test_our_adapter_loads_in_peft_and_our_merged_export_in_transformers(tmp_path: Path) -> None:
    import peft
    import transformers

    model = lora_model()
    ids = random_ids(2, 24)
    ours = logits(model, ids)
    base_dir = save_base(model, tmp_path / "base")
    adapter_dir = write_adapter(model, tmp_path / "adapter", base_dir)

    # The key set and shapes peft itself saves for the same LoRA over transformers' GPT-2.
    config = peft.LoraConfig.from_pretrained(str(adapter_dir))
    assert (config.r, config.lora_alpha, config.fan_in_fan_out, config.task_type) == (RANK, ALPHA, True, "CAUSAL_LM")
    assert set(config.target_modules) == set(TARGETS) and config.base_model_name_or_path == str(base_dir.resolve())
    reference = peft.get_peft_model(
        hf_tiny_model(), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS))
    )
    reference.save_pretrained(tmp_path / "peft")
    expected = {k: tuple(v.shape) for k, v in load_file(str(tmp_path / "peft" / ADAPTER_WEIGHTS_NAME)).items()}
    written = {k: tuple(v.shape) for k, v in load_file(str(adapter_dir / ADAPTER_WEIGHTS_NAME)).items()}
    assert written == expected and "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" in written

    hf_base = transformers.GPT2LMHeadModel.from_pretrained(base_dir, attn_implementation="eager")
    with_adapter = peft.PeftModel.from_pretrained(hf_base, adapter_dir).eval()
    torch.testing.assert_close(logits(with_adapter, ids), ours, rtol=0, atol=1e-4)

    merged_dir = save_merged(model, tmp_path / "merged")
    assert lora_modules(model)  # the model itself keeps its adapters
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager").eval()
    torch.testing.assert_close(logits(merged, ids), ours, rtol=0, atol=1e-4)
    torch.testing.assert_close(
        logits(checkpoint.load_pretrained(str(base_dir), adapter=adapter_dir), ids), ours, rtol=0, atol=1e-4
    )


def test_an_adapter_peft_saved_over_transformers_gpt2_loads_into_ours(tmp_path: Path) -> None:
    import peft

    hf = nudge_weights(hf_tiny_model(3), 3)
    hf.save_pretrained(tmp_path / "base")
    # peft's own spelling (c_proj: both projections), rank-stabilised scaling, and dropout (off in eval).
    lora = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.1, target_modules=["c_attn", "c_proj"], use_rslora=True
    )
    with_adapter = peft.get_peft_model(hf, lora)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in with_adapter.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    with_adapter.save_pretrained(tmp_path / "adapter")
    ids = random_ids(2, 24, seed=5)
    theirs = logits(with_adapter.eval(), ids)
    ours = checkpoint.load_pretrained(str(tmp_path / "base"), adapter=tmp_path / "adapter").eval()
    assert (theirs - logits(checkpoint.load_pretrained(str(tmp_path / "base")), ids)).abs().max() > 1e-3
    torch.testing.assert_close(logits(ours, ids), theirs, rtol=0, atol=1e-4)
    assert not lora_modules(ours)  # merged: the engine runs a plain model


def test_a_lora_runs_checkpoint_resumes_and_exports_an_adapter_and_a_merged_model(tmp_path: Path) -> None:
    model = lora_model()
    ids = random_ids(2, 16)
    ours = logits(model, ids)
    base_dir = save_base(model, tmp_path / "base")
    # What a run's checkpoint holds (run_checkpoint.save_checkpoint): the base and the adapters, in HF layout.
    run_checkpoint = tmp_path / "checkpoint"
    run_checkpoint.mkdir()
    checkpoint.write_weights(model, run_checkpoint)
    resumed = apply_lora(GPT2(model.config), LoraConfig(r=RANK, alpha=ALPHA))
    resumed.load_state_dict(checkpoint.from_hf_state_dict(load_file(str(run_checkpoint / checkpoint.WEIGHTS_NAME))))
    torch.testing.assert_close(logits(resumed.eval(), ids), ours, rtol=0, atol=0)
    with pytest.raises(ValueError, match="hold LoRA adapters beside the base model"):
        checkpoint.load_pretrained(str(run_checkpoint))

    export_lora(run_checkpoint, LoraConfig(r=RANK, alpha=ALPHA), tmp_path / "adapter", base_dir, tmp_path / "merged")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME]
    for loaded in (
        checkpoint.load_pretrained(str(base_dir), adapter=tmp_path / "adapter"),
        checkpoint.load_pretrained(str(tmp_path / "merged")),
    ):
        torch.testing.assert_close(logits(loaded.eval(), ids), ours, rtol=0, atol=1e-5)


def test_bad_adapters_are_refused_in_one_line(tmp_path: Path) -> None:
    base_dir = save_base(lora_model(), tmp_path / "base")
    write_adapter(lora_model(n_embd=32), tmp_path / "narrow", base_name_or_path="tiny-32")
    write_adapter(lora_model(n_layer=3), tmp_path / "deep", base_name_or_path=None)
    good = write_adapter(lora_model(), tmp_path / "good", base_dir)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / ADAPTER_CONFIG_NAME).write_text((good / ADAPTER_CONFIG_NAME).read_text())
    (pickled / "adapter_model.bin").write_bytes(b"")
    for name, change in (("dora", {"use_dora": True}), ("no-rank", {"r": "four"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / ADAPTER_WEIGHTS_NAME).write_bytes((good / ADAPTER_WEIGHTS_NAME).read_bytes())
        fields = {**json.loads((good / ADAPTER_CONFIG_NAME).read_text()), **change}
        (tmp_path / name / ADAPTER_CONFIG_NAME).write_text(json.dumps(fields))
    cases = [
        (tmp_path / "missing", "is not a directory"),
        (base_dir, f"holds no {ADAPTER_CONFIG_NAME}"),
        (pickled, "adapter_model.bin (pickle) is not loaded"),
        (tmp_path / "dora", "use_dora=True is not supported"),
        (tmp_path / "no-rank", "r and lora_alpha must be numbers > 0, got r='four'"),
        (
            tmp_path / "narrow",
            "maps 32 to 96 features, the model's 64 to 192; it was trained on another base model (tiny-32)",
        ),
        (tmp_path / "deep", "it adapts layer 2, the model has 2 layers"),
    ]
    for adapter, message in cases:
        with pytest.raises((ValueError, FileNotFoundError)) as error:
            checkpoint.load_pretrained(str(base_dir), adapter=adapter)
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_batch_job_checks_its_adapter_before_ray_and_fingerprints_it(tmp_path: Path) -> None:
    from gpt2_platform.batch import config as batch_config
    from gpt2_platform.batch import fingerprint
    from gpt2_platform.batch.generate import resolve_adapter

    with pytest.raises(ConfigError, match="model.adapter is empty"):
        batch_config.load(None, ["model.path=m", "output.path=o", "model.adapter="])
    assert batch_config.load(None, ["model.path=m", "output.path=o", "model.adapter=a"]).model.adapter == "a"
    base_dir = save_base(lora_model(), tmp_path / "base")
    adapter_dir = write_adapter(lora_model(), tmp_path / "adapter", base_dir)
    write_adapter(lora_model(n_embd=32), tmp_path / "narrow", None)
    assert resolve_adapter(None, base_dir, "m") == (None, None)
    assert resolve_adapter(str(adapter_dir), base_dir, "m") == (str(adapter_dir.resolve()), adapter_dir.resolve())
    with pytest.raises(ValueError, match="does not fit the model m"):
        resolve_adapter(str(tmp_path / "narrow"), base_dir, "m")
    plain = fingerprint.identity_sha256(fingerprint.model_identity(base_dir, None))
    adapted = fingerprint.identity_sha256(fingerprint.model_identity(base_dir, None, adapter_dir))
    other = fingerprint.identity_sha256(fingerprint.model_identity(base_dir, None, tmp_path / "narrow"))
    assert len({plain, adapted, other}) == 3


def _evaluate_main():
    spec = importlib.util.spec_from_file_location("jobs_evaluate", REPO_ROOT / "jobs" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.slow
def test_evaluate_scores_the_base_with_its_adapter(
    ray_cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpt2_platform.train.data import TokenizeAndPack

    model = lora_model()
    base_dir = save_base(model, tmp_path / "base")
    adapter_dir = write_adapter(model, tmp_path / "adapter", base_dir)
    held_out = demo_data.write_jsonl(tmp_path / "held_out.jsonl", num_stories=20, seed=7)
    evaluate_main = _evaluate_main()
    out = tmp_path / "result.json"
    quick = ["--set", "engine.dtype=fp32", "progress_bars=false", "scaling.num_actors=1"]
    args = ["--model", str(base_dir), "--data", str(held_out), "--block-size", "64", *quick]
    assert evaluate_main([*args, "--adapter", str(adapter_dir), "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())

    # The blocks evaluate.py packs of the stories (tests/test_evaluate.py checks that packing), scored here.
    stories = [json.loads(line)["text"] for line in held_out.read_text().splitlines()]
    blocks = torch.as_tensor(TokenizeAndPack(str(base_dir), 64)({"text": np.array(stories, object)})["tokens"]).long()

    def loss_of(m: GPT2) -> float:
        with torch.no_grad():
            return m(blocks[:, :-1], blocks[:, 1:])[1].item()

    assert result["adapter"] == str(adapter_dir.resolve()) and result["blocks"] == len(blocks)
    assert result["perplexity"] == pytest.approx(math.exp(loss_of(model)), rel=1e-4)
    assert abs(result["perplexity"] - math.exp(loss_of(checkpoint.load_pretrained(str(base_dir))))) > 1e-2

    capsys.readouterr()
    assert evaluate_main([*args, "--adapter", str(tmp_path / "missing")]) == 2
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is not a directory" in errors[0]
