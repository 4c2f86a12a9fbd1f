"""model.lora through the training job (issue 38): a LoRA run of the tiny preset on two DDP workers exports a
peft adapter that peft loads onto transformers' GPT-2 with our logits, its frozen base, and the merged model
transformers loads alone; a resume under other adapters is refused before Ray starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gpt2_platform import checkpoint
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.lora import is_lora_key
from helpers_unit import random_ids

pytestmark = pytest.mark.slow


def test_a_lora_run_on_two_workers_exports_what_peft_and_transformers_load(ray_cluster, corpus: Path, tmp_path: Path):
    import peft
    import transformers

    from gpt2_platform.train.trainer import fit

    lora = ["model.lora.r=4", "model.lora.export_merged=true"]
    steps = ["train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0", "scaling.num_workers=2"]
    result = fit(tiny_config(corpus, tmp_path, *lora, *steps, "run.name=lora"))

    adapter, base, merged = result.run_dir / "adapter", result.run_dir / "base", result.run_dir / "model"
    assert result.model_dir == merged
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not any(is_lora_key(name) for name in checkpoint.load_pretrained(str(base)).state_dict())

    ids = random_ids(2, 24)
    with torch.no_grad():
        ours = checkpoint.load_pretrained(str(base), adapter=adapter).eval()(ids)[0]
        plain = checkpoint.load_pretrained(str(base)).eval()(ids)[0]
        assert (ours - plain).abs().max() > 1e-3, "the adapters trained (lora_B starts at zero)"
        hf_base = transformers.GPT2LMHeadModel.from_pretrained(base, attn_implementation="eager")
        theirs = peft.PeftModel.from_pretrained(hf_base, adapter).eval()(ids).logits
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
        alone = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
        torch.testing.assert_close(alone, ours, rtol=0, atol=1e-4)

    # The checkpoint holds these adapters' weights and state: another rank, or none, cannot resume it.
    for other in (["model.lora.r=8"], []):
        with pytest.raises(ConfigError, match="cannot resume it"):
            fit(tiny_config(corpus, tmp_path, *other, *steps, "train.max_steps=6", "run.name=lora"))
