"""gpt2_platform.engine.sampling: greedy, per-row seeds independent of the batch, filters, distribution, compile."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpt2_platform.engine.sampling import SamplingParams, gumbel_noise, params_to_tensors, sample

NUCLEUS_PROBS = [0.4, 0.3, 0.2, 0.1]


def rows(batch_size: int, temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0) -> dict[str, torch.Tensor]:
    """The per-row parameter tensors for `sample`; each argument is a scalar for all rows or a sequence/tensor."""

    def column(value, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(value, (int, float)):
            return torch.full((batch_size,), value, dtype=dtype)
        return torch.as_tensor(value, dtype=dtype)

    return {
        "temperature": column(temperature, torch.float32),
        "top_k": column(top_k, torch.int64),
        "top_p": column(top_p, torch.float32),
        "seed": column(seed, torch.int64),
        "step": column(step, torch.int64),
    }


def random_logits(batch_size: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, vocab_size, generator=generator) * 3


def draws(logits_row: torch.Tensor, num_draws: int, **params) -> torch.Tensor:
    """`num_draws` tokens for one logits row, one per step (a fresh draw each), as a (num_draws,) tensor."""
    logits = logits_row.expand(num_draws, -1)
    return sample(logits, **rows(num_draws, step=torch.arange(num_draws), **params))


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).double() / len(tokens)


def mixed_params(batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Every kind of row: greedy, plain sampling, top-k, top-p, both, other temperatures."""
    generator = torch.Generator().manual_seed(seed)

    def pick(choices: list) -> list:
        return [choices[i] for i in torch.randint(len(choices), (batch_size,), generator=generator)]

    return rows(
        batch_size,
        temperature=pick([0.0, 0.5, 1.0, 1.0, 1.7]),
        top_k=pick([0, 0, 1, 3, 20]),
        top_p=pick([1.0, 1.0, 0.9, 0.5]),
        seed=torch.randint(0, 2**62, (batch_size,), generator=generator),
        step=torch.randint(0, 4096, (batch_size,), generator=generator),
    )


# --- greedy -----------------------------------------------------------------------------------------------


def test_greedy_rows_equal_argmax_with_ties_to_the_lowest_id() -> None:
    logits = random_logits(16, 100, seed=0)
    logits[3, [7, 42, 99]] = 50.0  # a three-way tie at the top
    tokens = sample(logits, **rows(16, temperature=0.0, top_k=5, top_p=0.3, seed=torch.arange(16)))
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    assert tokens[3] == 7


def test_greedy_rows_are_unaffected_by_sampled_rows_in_the_batch() -> None:
    logits = random_logits(32, 100, seed=1)
    params = mixed_params(32, seed=1)
    greedy = params["temperature"] == 0
    assert 0 < greedy.sum() < 32
    tokens = sample(logits, **params)
    assert torch.equal(tokens[greedy], torch.argmax(logits[greedy], dim=-1))


# --- independence of the batch and reproducibility -------------------------------------------------------


def test_a_row_draws_the_same_token_whatever_the_batch_around_it() -> None:
    num_rows, num_neighbours, vocab_size = 200, 100, 64
    logits = random_logits(num_rows, vocab_size, seed=2)
    params = mixed_params(num_rows, seed=2)
    params["temperature"] = params["temperature"].clamp(min=0.5)  # sampled rows only: greedy ones are trivial
    alone = torch.cat(
        [sample(logits[i : i + 1], **{k: v[i : i + 1] for k, v in params.items()}) for i in range(num_rows)]
    )
    assert torch.equal(sample(logits, **params), alone)

    generator = torch.Generator().manual_seed(3)
    for batch_size in (2, 7, 64, num_rows + num_neighbours):
        # The 200 rows shuffled among other rows, then cut into batches: new positions and neighbours each time.
        batch_logits = random_logits(num_rows + num_neighbours, vocab_size, seed=batch_size)
        batch_params = mixed_params(num_rows + num_neighbours, seed=batch_size)
        positions = torch.randperm(num_rows + num_neighbours, generator=generator)[:num_rows]
        batch_logits[positions] = logits
        for key, values in batch_params.items():
            values[positions] = params[key]
        tokens = torch.cat(
            [
                sample(batch_logits[i : i + batch_size], **{k: v[i : i + batch_size] for k, v in batch_params.items()})
                for i in range(0, num_rows + num_neighbours, batch_size)
            ]
        )
        assert torch.equal(tokens[positions], alone), f"batch size {batch_size}"


def test_same_seed_and_step_give_the_same_token() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any token is as likely as any other
    first = [sample(logits, **rows(1, seed=seed, step=step)).item() for seed, step in [(5, 0), (5, 1), (6, 0)]]
    again = [sample(logits, **rows(1, seed=seed, step=step)).item() for seed, step in [(5, 0), (5, 1), (6, 0)]]
    assert first == again


def test_different_seeds_or_steps_give_different_draws() -> None:
    logits = torch.zeros(100, 1000)
    by_seed = sample(logits, **rows(100, seed=torch.arange(100), step=7))
    by_step = sample(logits, **rows(100, seed=7, step=torch.arange(100)))
    # 100 uniform draws over 1000 tokens: about 95 distinct values expected.
    assert len(by_seed.unique()) > 80
    assert len(by_step.unique()) > 80


def test_gumbel_noise_has_the_standard_gumbel_moments() -> None:
    noise = gumbel_noise(torch.arange(100), torch.zeros(100, dtype=torch.int64), 10_000)  # (100, 10_000)
    assert torch.isfinite(noise).all()
    assert noise.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni constant
    assert noise.std().item() == pytest.approx(torch.pi / 6**0.5, abs=0.01)


# --- the distribution ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_frequencies_match_the_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    observed = frequencies(draws(logits, 20_000, temperature=temperature, seed=11), 5)
    assert (observed - expected).abs().max() < 0.02, (observed, expected)


def test_frequencies_across_seeds_match_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(20_000, -1)
    observed = frequencies(sample(logits, **rows(20_000, seed=torch.arange(20_000), step=3)), 5)
    assert (observed - torch.softmax(logits[0].double(), dim=-1)).abs().max() < 0.02


def test_very_low_temperature_always_picks_the_argmax() -> None:
    logits = random_logits(1, 50, seed=4)[0]
    tokens = draws(logits, 2000, temperature=1e-3)
    assert (tokens == torch.argmax(logits)).all()


def test_high_temperature_is_close_to_uniform() -> None:
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0, -3.0])
    observed = frequencies(draws(logits, 20_000, temperature=100.0), 5)
    assert (observed - 0.2).abs().max() < 0.02, observed


# --- top-k and top-p ----------------------------------------------------------------------------------


def test_top_k_draws_only_the_top_ids_in_their_renormalised_proportions() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0])
    tokens = draws(logits, 20_000, top_k=2, seed=1)
    assert set(tokens.tolist()) == {1, 3}
    expected = torch.zeros(5, dtype=torch.float64)
    expected[[1, 3]] = torch.softmax(logits[[1, 3]].double(), dim=-1)
    assert (frequencies(tokens, 5) - expected).abs().max() < 0.02


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    tokens = draws(torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0]), 2000, top_k=2)
    assert set(tokens.tolist()) == {1, 2, 3}


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.5, {0, 1}), (0.4, {0}), (0.75, {0, 1, 2}), (0.05, {0})])
def test_top_p_draws_only_the_nucleus(top_p: float, nucleus: set[int]) -> None:
    logits = torch.log(torch.tensor(NUCLEUS_PROBS))
    assert set(draws(logits, 4000, top_p=top_p).tolist()) == nucleus


def test_top_p_applies_to_what_top_k_kept() -> None:
    # top_p=0.75 needs three tokens of 0.4, 0.3, 0.2, 0.1 but only two of what top_k=3 leaves (4/9, 3/9, 2/9).
    logits = torch.log(torch.tensor(NUCLEUS_PROBS))
    assert set(draws(logits, 4000, top_k=0, top_p=0.75).tolist()) == {0, 1, 2}
    assert set(draws(logits, 4000, top_k=3, top_p=0.75).tolist()) == {0, 1}


def test_no_limit_rows_equal_sampling_without_filters() -> None:
    logits = random_logits(64, 300, seed=5)
    logits[:8, 100:] = -torch.inf  # masked tokens must stay impossible
    params = rows(
        64, temperature=0.8, top_k=torch.tensor([0, 300, 10_000, 0] * 16), top_p=1.0, seed=torch.arange(64), step=9
    )
    scaled = logits / torch.tensor(0.8)  # in float32, as `sample` does
    reference = torch.argmax(scaled.double() + gumbel_noise(params["seed"], params["step"], 300), dim=-1)
    assert torch.equal(sample(logits, **params), reference)


# --- dtypes and compile -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_logits_sample_as_their_float32_values(dtype: torch.dtype) -> None:
    logits = random_logits(32, 100, seed=6).to(dtype)
    params = mixed_params(32, seed=6)
    tokens = sample(logits, **params)
    assert tokens.dtype == torch.int64 and tokens.device == logits.device and tokens.shape == (32,)
    assert torch.equal(tokens, sample(logits.float(), **params))


def test_compiled_fullgraph_matches_eager() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(sample, fullgraph=True, dynamic=False)
    logits = random_logits(16, 257, seed=7)
    for seed in (7, 8):  # the second call reuses the graph with new parameter values
        params = mixed_params(16, seed=seed)
        assert torch.equal(compiled(logits, **params), sample(logits, **params))


# --- SamplingParams -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", 2**31),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("seed", -1),
        ("seed", 2**63),
    ],
)
def test_sampling_params_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_accept_their_edges() -> None:
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=2**31 - 1, top_p=1.0, seed=2**63 - 1),
    ):
        params.validate()


def test_resolved_fills_a_random_seed_and_keeps_a_given_one() -> None:
    fresh = SamplingParams(temperature=0.7, top_p=0.9)
    resolved = fresh.resolved()
    assert resolved.seed is not None and 0 <= resolved.seed < 2**63
    assert dataclasses.replace(resolved, seed=None) == fresh and fresh.seed is None
    assert resolved.resolved() == resolved
    assert SamplingParams(seed=123).resolved().seed == 123
    assert len({SamplingParams().resolved().seed for _ in range(20)}) == 20


def test_params_to_tensors_builds_the_rows_for_sample() -> None:
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=2**63 - 1)]
    tensors = params_to_tensors(params, steps=[0, 17], device="cpu")
    assert {name: tensor.dtype for name, tensor in tensors.items()} == {
        "temperature": torch.float32,
        "top_k": torch.int64,
        "top_p": torch.float32,
        "seed": torch.int64,
        "step": torch.int64,
    }
    assert tensors["seed"].tolist() == [1, 2**63 - 1] and tensors["step"].tolist() == [0, 17]
    assert sample(torch.randn(2, 10), **tensors).shape == (2,)


def test_params_to_tensors_rejects_unresolved_seeds_and_mismatched_steps() -> None:
    with pytest.raises(ValueError, match="seed"):
        params_to_tensors([SamplingParams(seed=1), SamplingParams()], steps=[0, 0], device="cpu")
    with pytest.raises(ValueError, match="steps"):
        params_to_tensors([SamplingParams(seed=1)], steps=[0, 1], device="cpu")


def test_unfiltered_sampling_equals_filtered_when_no_row_is_limited():
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    args = (
        torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 1.0]),
        torch.zeros(6, dtype=torch.long),
        torch.ones(6),
        torch.arange(6, dtype=torch.long) * 7,
        torch.arange(6, dtype=torch.long),
    )
    assert torch.equal(sample(logits, *args, filtered=False), sample(logits, *args))
