"""gpt2_platform.engine.config: one EngineConfig for Serve and the batch job, and one set of sampling bounds."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from pydantic import ValidationError

from gpt2_platform.batch import config as batch_config
from gpt2_platform.batch.rows import resolve_values
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.engine.config import (
    AUTO_CPU_BATCH_SIZE,
    AUTO_MAX_BATCH_SIZE,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    WORKSPACE_BYTES,
    EngineConfig,
    auto_batch_size,
)
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.serve import errors
from gpt2_platform.serve.schemas import AppArgs, CompletionRequest, GenerateRequest

# What a batch job needs besides the engine section.
BATCH_PATHS = ["input.paths=[p.parquet]", "output.path=out", "model.path=model"]
BAD_ENGINE_VALUES = [
    ("max_batch_size", 0),
    ("max_batch_size", "most"),
    ("gpu_memory_share", 0.0),
    ("gpu_memory_share", 1.5),
    ("max_seq_len", 1),
    ("dtype", "fp8"),
    ("decode_kernels", "cuda"),
    ("max_prefill_tokens", 0),
    ("compile_cache_dir", ""),
    ("gil_switch_interval_ms", 0),
    ("gil_switch_interval_ms", 500),
]


def load_batch(*overrides: str) -> batch_config.GenerateConfig:
    return batch_config.load(None, [*BATCH_PATHS, *overrides])


def test_serve_and_the_batch_job_take_the_same_engine_config_with_the_same_defaults():
    assert typing.get_type_hints(batch_config.GenerateConfig)["engine"] is EngineConfig
    assert AppArgs.model_fields["engine"].annotation is EngineConfig
    served, batched = AppArgs().engine, load_batch().engine
    assert type(served) is type(batched) is EngineConfig
    assert served == batched == EngineConfig()
    assert served.compile is None and served.max_prefill_tokens == 4096  # compile: engine.default_compile


def test_the_same_engine_values_give_the_same_config_in_both():
    values = {"max_batch_size": 8, "max_seq_len": 64, "dtype": "fp32", "compile": False, "max_prefill_tokens": 256}
    values |= {"compile_cache_dir": "/shared/gpt2-compile-cache", "packed_prefill": False}
    batched = load_batch(*(f"engine.{name}={str(value).lower()}" for name, value in values.items())).engine
    assert AppArgs.model_validate({"engine": values}).engine == batched == EngineConfig(**values)


@pytest.mark.parametrize(("field", "value"), BAD_ENGINE_VALUES)
def test_a_bad_engine_value_names_its_field_in_serve_and_in_the_batch_job(field: str, value: object):
    with pytest.raises(ValueError, match=rf"^engine\.{field} "):
        EngineConfig(**{field: value})
    with pytest.raises(ConfigError, match=rf"engine\.{field}\b"):
        load_batch(f"engine.{field}={value}")
    with pytest.raises(ValidationError, match=rf"args\.engine\.{field}\b"):
        AppArgs.model_validate({"engine": {field: value}})


def test_an_unknown_engine_key_is_named_in_both():
    with pytest.raises(ConfigError, match="unknown config key engine.max_batch_sise"):
        load_batch("engine.max_batch_sise=4")
    with pytest.raises(ValidationError, match=r"args\.engine\.max_batch_sise"):
        AppArgs.model_validate({"engine": {"max_batch_sise": 4}})


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(EngineConfig)])
def test_an_old_flat_engine_key_in_app_args_says_it_moved_under_engine(field: str):
    value = dataclasses.asdict(EngineConfig())[field]
    with pytest.raises(ValidationError, match=rf"args\.{field} moved under `engine:` \(e\.g\. args\.engine\.{field}\)"):
        AppArgs.model_validate({"model": "x", field: value})


def test_engine_process_is_refused_with_where_the_engine_runs_now():
    with pytest.raises(ValidationError, match="engine now always runs in its own deployment"):
        AppArgs.model_validate({"engine_process": False})


# ---- sampling bounds: every entry point refuses exactly what the engine does -----------------------------
def serve_accepts(**fields: object) -> bool:
    try:
        CompletionRequest.model_validate({"prompt": "x", **fields})
    except ValidationError:
        return False
    return True


def batch_config_accepts(field: str, value: object) -> bool:
    try:
        load_batch(f"generation.{field}={value}")
    except ConfigError:
        return False
    return True


def batch_row_accepts(temperature: object = None, seed: object = None) -> bool:
    _, error = resolve_values("row", None, temperature, seed, batch_config.GenerationConfig())
    return error is None


def engine_accepts(**fields: object) -> bool:
    try:
        SamplingParams(**fields)
    except ValueError:
        return False
    return True


def test_the_temperature_cap_is_the_same_everywhere():
    assert MAX_TEMPERATURE == 2.0  # OpenAI's
    above = math.nextafter(MAX_TEMPERATURE, math.inf)
    for value, accepted in ((0.0, True), (MAX_TEMPERATURE, True), (above, False), (-0.1, False)):
        assert engine_accepts(temperature=value) is accepted, value
        assert serve_accepts(temperature=value) is accepted, value
        try:
            GenerateRequest.model_validate({"prompt": "x", "temperature": value})
            assert accepted, value
        except ValidationError:
            assert not accepted, value
        assert batch_config_accepts("temperature", repr(value)) is accepted, value
        assert batch_row_accepts(temperature=value) is accepted, value


def test_the_top_k_and_seed_bounds_are_the_same_everywhere():
    for value, accepted in ((MAX_TOP_K, True), (MAX_TOP_K + 1, False), (-1, False)):
        assert engine_accepts(top_k=value) is accepted, value
        assert serve_accepts(top_k=value) is accepted, value
        assert batch_config_accepts("top_k", value) is accepted, value
    for value, accepted in ((MAX_SEED, True), (MAX_SEED + 1, False), (-1, False)):
        assert engine_accepts(seed=value) is accepted, value
        assert serve_accepts(seed=value) is accepted, value
        assert batch_config_accepts("seed", value) is accepted, value
        assert batch_row_accepts(seed=value) is accepted, value


def test_top_k_2_to_the_31_is_a_400_naming_top_k_and_a_batch_config_error():
    with pytest.raises(ValidationError) as refused:
        CompletionRequest.model_validate({"prompt": "x", "top_k": 2**31})
    error = errors.from_validation_error(refused.value)
    assert (error.status_code, error.param) == (400, "top_k")
    with pytest.raises(ConfigError, match="generation.top_k"):
        load_batch(f"generation.top_k={2**31}")


GIB = 2**30


def test_auto_batch_size_fills_the_share_after_weights_and_workspace():
    # 24 GiB card, 1 GiB held by another process, 3 GiB of weights to come, 300 MiB a sequence.
    per_slot = 300 * 2**20
    slots, why = auto_batch_size(True, 24 * GIB, 23 * GIB, 3 * GIB, per_slot, share=0.9)
    assert slots == int((0.9 * 24 * GIB - 1 * GIB - 3 * GIB - WORKSPACE_BYTES) // per_slot) == 56
    assert why.startswith("auto: 56 fit (0.9 of 24.0 GiB") and "300.0 MiB" in why
    # A smaller share leaves room for another replica on the card.
    assert auto_batch_size(True, 24 * GIB, 23 * GIB, 3 * GIB, per_slot, share=0.5)[0] < slots


def test_auto_batch_size_is_capped_on_a_large_card_and_small_on_a_cpu():
    slots, why = auto_batch_size(True, 140 * GIB, 139 * GIB, GIB // 4, 36 * 2**20, share=0.9)
    assert slots == AUTO_MAX_BATCH_SIZE and f"capped at {AUTO_MAX_BATCH_SIZE}" in why
    assert auto_batch_size(False, 0, 0, 0, 36 * 2**20, share=0.9)[0] == AUTO_CPU_BATCH_SIZE


def test_auto_batch_size_refuses_when_not_one_sequence_fits():
    with pytest.raises(ValueError, match="not one sequence fits .*lower engine.max_seq_len"):
        auto_batch_size(True, 8 * GIB, 2 * GIB, 3 * GIB, 300 * 2**20, share=0.9)


def test_auto_is_the_default_and_deployments_size_by_its_cap():
    assert EngineConfig().max_batch_size == "auto"
    assert EngineConfig().max_slots == AUTO_MAX_BATCH_SIZE
    assert EngineConfig(max_batch_size=8).max_slots == 8
    assert AppArgs.model_validate({"engine": {"max_batch_size": "auto"}}).engine.max_batch_size == "auto"
    assert load_batch("engine.max_batch_size=auto").engine.max_batch_size == "auto"


def test_an_engine_on_a_cpu_sizes_itself_and_says_so():
    import torch

    from gpt2_platform.engine.engine import Engine
    from gpt2_platform.model import GPT2, preset
    from gpt2_platform.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    engine = Engine(GPT2(preset("tiny")), byte_tokenizer(), EngineConfig(max_seq_len=32, dtype="fp32"))
    stats = engine.stats()
    assert (stats["max_batch_size"], stats["max_batch_size_reason"]) == (AUTO_CPU_BATCH_SIZE, "auto on a CPU: 16")
    assert len(engine.scheduler.slots) == AUTO_CPU_BATCH_SIZE
