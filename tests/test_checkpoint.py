"""gpt2_platform.checkpoint: Hugging Face format in and out, atomic saves, clear errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gpt2_platform import checkpoint
from gpt2_platform.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    clean_state_dict,
    load_pretrained,
    resolve,
    save_pretrained,
    staged_directory,
)
from gpt2_platform.train.parallelize import parallelize
from helpers_unit import assert_same_state, hf_tiny_model, nudge_weights, random_ids, tiny_model


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out[0]


def test_saved_model_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    model = nudge_weights(tiny_model(seed=0))
    directory = save_pretrained(model, tmp_path / "ckpt")
    assert sorted(p.name for p in directory.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert hf.config.eos_token_id == 256
    ids = random_ids(2, 40, seed=1)
    torch.testing.assert_close(_logits(hf, ids), _logits(model, ids), atol=1e-4, rtol=0)


def test_save_then_load_round_trips_exactly(tmp_path: Path) -> None:
    model = nudge_weights(tiny_model(seed=0))
    loaded = load_pretrained(str(save_pretrained(model, tmp_path / "ckpt")))
    assert loaded.config == model.config
    assert_same_state(loaded, model)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    # Built on the meta device and given the file's tensors: every parameter is real, contiguous,
    # and trains (a transposed view would slow DDP's gradient buckets, a meta one would not run).
    assert all(p.device.type == "cpu" and p.is_contiguous() and p.requires_grad for p in loaded.parameters())
    ids = random_ids(2, 20, seed=3)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=0, rtol=0)


def test_load_pretrained_casts_dtype(tmp_path: Path) -> None:
    save_pretrained(tiny_model(), tmp_path / "ckpt")
    loaded = load_pretrained(str(tmp_path / "ckpt"), dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_compiled_model_saves_with_clean_names(tmp_path: Path) -> None:
    model = tiny_model(seed=0)
    compiled = torch.compile(model)  # the wrapper only; nothing is compiled until it runs
    assert all(name.startswith("_orig_mod.") for name in compiled.state_dict())
    save_pretrained(compiled, tmp_path / "ckpt")
    assert all(not name.startswith("_orig_mod.") for name in load_file(str(tmp_path / "ckpt" / WEIGHTS_NAME)))
    assert_same_state(load_pretrained(str(tmp_path / "ckpt")), model)


def test_transformers_checkpoint_loads_and_matches(tmp_path: Path) -> None:
    hf = nudge_weights(hf_tiny_model(seed=3))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(str(tmp_path / "hf"))
    assert (ours.config.n_layer, ours.config.n_embd, ours.config.vocab_size) == (2, 64, 257)
    ids = random_ids(2, 32, seed=2)
    torch.testing.assert_close(_logits(ours, ids), _logits(hf, ids), atol=1e-4, rtol=0)


def test_hub_style_keys_without_transformer_prefix_load(tmp_path: Path) -> None:
    # The hub's openai-community/gpt2 stores `h.0.attn.c_attn.weight` etc. and old causal-mask buffers.
    hf = nudge_weights(hf_tiny_model(seed=4))
    hf.save_pretrained(tmp_path / "hub")
    weights = tmp_path / "hub" / WEIGHTS_NAME
    state = {name.removeprefix("transformer."): t for name, t in load_file(str(weights)).items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256))
    save_file(state, str(weights), metadata={"format": "pt"})
    assert not any(name.startswith("transformer.") for name in load_file(str(weights)))
    ours = load_pretrained(str(tmp_path / "hub"))
    ids = random_ids(1, 24, seed=5)
    torch.testing.assert_close(_logits(ours, ids), _logits(hf, ids), atol=1e-4, rtol=0)


def test_weights_of_another_shape_are_rejected(tmp_path: Path) -> None:
    save_pretrained(tiny_model(), tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / WEIGHTS_NAME
    state = load_file(str(weights))
    state["transformer.h.0.mlp.extra.weight"] = torch.zeros(2)
    del state["transformer.h.1.ln_2.bias"]
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="ln_2.bias"):
        load_pretrained(str(tmp_path / "ckpt"))


def test_clean_state_dict_strips_compile_and_ddp_prefixes() -> None:
    model = tiny_model()
    plain = model.state_dict()
    compiled = torch.compile(model).state_dict()
    assert list(compiled) != list(plain)
    ddp = {f"module.{name}": t for name, t in plain.items()}
    both = {f"module._orig_mod.{name}": t for name, t in plain.items()}
    for wrapped in (compiled, ddp, both):
        cleaned = clean_state_dict(wrapped)
        assert list(cleaned) == list(plain)
        assert all(cleaned[name] is wrapped_t for name, wrapped_t in zip(cleaned, wrapped.values(), strict=True))


def test_clean_state_dict_strips_the_activation_checkpoint_prefix() -> None:
    # `_checkpoint_wrapped_module.` is one of checkpoint.py's wrapper prefixes, and the parameter
    # names of a checkpointed model carry it. BUG (checkpoint.py, clean_state_dict): `module.` is
    # replaced first, inside `_checkpoint_wrapped_module.`, which leaves `_checkpoint_wrapped_ln_1.weight`.
    expected = [name for name, _ in tiny_model().named_parameters()]
    checkpointed = parallelize(tiny_model(), torch.device("cpu"), "off", gradient_checkpointing=True)
    wrapped = dict(checkpointed.named_parameters())
    assert "transformer.h.0._checkpoint_wrapped_module.ln_1.weight" in wrapped
    cleaned = list(clean_state_dict(wrapped))
    assert cleaned == expected, f"left unclean: {[n for n in cleaned if n not in expected][:3]}"


def test_from_hf_state_dict_transposes_conv1d_and_ties_the_head() -> None:
    hf = hf_tiny_model(seed=0)
    converted = checkpoint.from_hf_state_dict(hf.state_dict())
    name = "transformer.h.0.attn.c_attn.weight"
    assert hf.state_dict()[name].shape == (64, 192)
    assert converted[name].shape == (192, 64)
    without_head = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert checkpoint.from_hf_state_dict(without_head)["lm_head.weight"] is without_head["transformer.wte.weight"]


def test_save_refuses_an_existing_directory_unless_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    save_pretrained(tiny_model(seed=0), target)
    replacement = tiny_model(seed=1)
    with pytest.raises(FileExistsError, match="ckpt"):
        save_pretrained(replacement, target)
    assert_same_state(load_pretrained(str(target)), tiny_model(seed=0))

    save_pretrained(replacement, target, overwrite=True)
    assert_same_state(load_pretrained(str(target)), replacement)
    # No staging or backup folder is left beside it.
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_save_refuses_an_existing_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileExistsError):
        save_pretrained(tiny_model(), tmp_path / "ckpt")


def test_failure_inside_staged_directory_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "out" / "ckpt"
    with pytest.raises(RuntimeError, match="boom"):
        with staged_directory(target) as stage:
            (stage / "partial.bin").write_bytes(b"x")
            assert stage.parent == target.parent and stage.is_dir()
            raise RuntimeError("boom")
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_failure_while_overwriting_keeps_the_old_directory(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_directory(target, overwrite=True) as stage:
            (stage / "new.txt").write_text("new")
            raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert [p.name for p in target.iterdir()] == ["old.txt"]


def test_failing_extra_writer_leaves_no_checkpoint(tmp_path: Path) -> None:
    def extra(directory: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_pretrained(tiny_model(), tmp_path / "ckpt", extra=extra)
    assert list(tmp_path.iterdir()) == []


def test_extra_writer_adds_files(tmp_path: Path) -> None:
    save_pretrained(tiny_model(), tmp_path / "ckpt", extra=lambda d: (d / "note.txt").write_text("hi"))
    assert (tmp_path / "ckpt" / "note.txt").read_text() == "hi"
    assert json.loads((tmp_path / "ckpt" / CONFIG_NAME).read_text())["model_type"] == "gpt2"


def test_directory_without_weights_is_rejected(tmp_path: Path) -> None:
    directory = tmp_path / "config-only"
    checkpoint.hf_config(tiny_model().config).save_pretrained(directory)
    assert (directory / CONFIG_NAME).is_file()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        load_pretrained(str(directory))


def test_pickle_weights_are_not_loaded(tmp_path: Path) -> None:
    directory = tmp_path / "pickle"
    checkpoint.hf_config(tiny_model().config).save_pretrained(directory)
    torch.save(tiny_model().state_dict(), directory / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_pretrained(str(directory))


def test_weights_that_do_not_fit_the_config_are_refused_by_name(tmp_path: Path) -> None:
    directory = save_pretrained(tiny_model(), tmp_path / "ckpt")
    config = json.loads((directory / CONFIG_NAME).read_text())
    config["n_inner"] = 100  # the file's MLP is 256 wide
    (directory / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"wrong shape .*transformer\.h\.0\.mlp\.c_fc\.weight \(256, 64\) \(config\.json gives \(100, 64\)\)",
    ):
        load_pretrained(str(directory))


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record hub downloads instead of making them."""
    import huggingface_hub

    calls: list[str] = []

    def fake_download(repo_id: str, **kwargs: object) -> str:
        calls.append(repo_id)
        raise ConnectionError("no network in unit tests")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    return calls


@pytest.mark.parametrize("name", ["./does-not-exist", "/no/such/dir", "~/no-such-model-dir", "a/b/c"])
def test_missing_local_path_fails_fast_without_the_hub(name: str, no_hub: list[str]) -> None:
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve(name)
    assert time.perf_counter() - start < 1.0
    assert no_hub == []


def test_a_file_is_not_a_model_directory(tmp_path: Path, no_hub: list[str]) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError):
        resolve(str(tmp_path / "weights.bin"))
    assert no_hub == []


def test_hub_failure_becomes_file_not_found(no_hub: list[str]) -> None:
    with pytest.raises(FileNotFoundError, match="openai-community/gpt2.*ConnectionError"):
        resolve("openai-community/gpt2")
    assert no_hub == ["openai-community/gpt2"]


def test_existing_directory_resolves_to_itself(tmp_path: Path, no_hub: list[str]) -> None:
    assert resolve(str(tmp_path)) == tmp_path
    assert no_hub == []
