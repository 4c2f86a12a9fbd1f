"""Moderation rules without Ray: blocklist matching, the config's errors, the user callable, streaming."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest

import helpers_moderation
from gpt2_platform.moderation import (
    MODERATION_ERROR,
    CompletionGuard,
    ModerationConfig,
    Moderator,
    Verdict,
    build_moderator,
)

POLICY = "helpers_moderation:policy"


def moderator(*terms: str, **config: object) -> Moderator:
    built = build_moderator(ModerationConfig(enabled=True, blocklist=list(terms), **config))
    assert built is not None
    return built


# ---- the blocklist ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "blocked"),
    [
        ("a zap here", True),
        ("ZAP!", True),
        ("zap", True),
        ("(zap)", True),
        ("zapping", False),  # a term matches whole words only
        ("unzap", False),
        ("zap_it", False),  # the underscore is a word character
        ("zap2", False),
        ("the class is full", False),  # the classic: 'ass' inside 'class'
        ("Forbidden Phrase", True),
        ("forbidden\n   phrase.", True),  # any whitespace between the words of a phrase
        ("forbidden phrases", False),
        ("forbiddenphrase", False),
        ("I write C++ daily", True),  # terms may hold punctuation
        ("", False),
    ],
)
def test_terms_match_whole_words_and_phrases_in_any_case(text: str, blocked: bool):
    check = moderator("zap", "ass", "forbidden phrase", "c++")
    assert (check.check_prompt(text) is not None) is blocked


def test_the_verdict_names_the_term_as_configured_and_the_kind():
    check = moderator("Forbidden Phrase", "forbidden")
    assert check.check_prompt("a FORBIDDEN phrase") == Verdict("prompt", "blocklist term 'Forbidden Phrase'")
    assert check.check_completion("just forbidden") == Verdict("completion", "blocklist term 'forbidden'")


def test_check_selects_prompts_completions_or_both():
    prompts_only, completions_only = moderator("zap", check="prompt"), moderator("zap", check="completion")
    assert prompts_only.check_prompt("zap") and prompts_only.check_completion("zap") is None
    assert completions_only.check_prompt("zap") is None and completions_only.check_completion("zap")


def test_a_blocklist_file_adds_terms_skipping_comments_and_blank_lines(tmp_path: Path):
    path = tmp_path / "terms.txt"
    path.write_text("# one term per line\n\n  zap  \nforbidden phrase\n", encoding="utf-8")
    check = build_moderator(ModerationConfig(enabled=True, blocklist=["boom"], blocklist_file=str(path)))
    assert len(check.blocklist) == 3
    assert check.check_prompt("a FORBIDDEN phrase") and check.check_prompt("boom") and check.check_prompt("zap")
    assert check.check_prompt("# one term per line") is None


def test_disabled_builds_nothing_and_the_identity_follows_the_terms():
    assert build_moderator(ModerationConfig(blocklist=["zap"])) is None
    assert moderator("zap").identity() == moderator("ZAP").identity()
    assert moderator("zap").identity() != moderator("zap", "boom").identity()
    assert moderator("zap").identity() != moderator("zap", check="prompt").identity()


# ---- configuration errors, each naming its field -------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"enabled": True}, "moderation.enabled is true but there is nothing"),
        ({"blocklist": ["ok", "  "]}, "moderation.blocklist holds an empty term"),
        ({"callable": "no_colon"}, "moderation.callable must look like 'package.module:function'"),
        ({"callable": ":policy"}, "moderation.callable must look like"),
    ],
)
def test_malformed_settings_are_refused_when_the_config_is_made(config: dict, message: str):
    with pytest.raises(ValueError, match=message):
        ModerationConfig(**config)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"blocklist_file": "/no/such/terms.txt"}, "moderation.blocklist_file '/no/such/terms.txt' does not exist"),
        ({"callable": "no_such_module_xyz:check"}, "moderation.callable .*cannot import 'no_such_module_xyz'"),
        ({"callable": "helpers_moderation:missing"}, "moderation.callable .*has no attribute 'missing'"),
        ({"callable": "helpers_moderation:NOT_A_FUNCTION"}, "moderation.callable .* is a int, not a function"),
    ],
)
def test_what_cannot_be_loaded_is_refused_at_start_up(config: dict, message: str):
    with pytest.raises(ValueError, match=message):
        build_moderator(ModerationConfig(enabled=True, **config))


def test_both_config_systems_take_the_same_section_and_refuse_the_same_mistakes():
    from pydantic import ValidationError

    from gpt2_platform.batch import load
    from gpt2_platform.serve.schemas import AppArgs

    required = ["output.path=out", "model.path=m"]
    batch = load(None, [*required, "moderation.enabled=true", "moderation.blocklist=[zap]", "moderation.check=prompt"])
    assert batch.moderation == ModerationConfig(enabled=True, check="prompt", blocklist=["zap"])
    serve = AppArgs.model_validate({"moderation": {"enabled": True, "blocklist": ["zap"], "check": "prompt"}})
    assert serve.moderation == batch.moderation
    with pytest.raises(ValueError, match="moderation.enabled is true"):
        load(None, [*required, "moderation.enabled=true"])
    with pytest.raises(ValidationError, match="moderation.enabled is true"):
        AppArgs.model_validate({"moderation": {"enabled": True}})
    with pytest.raises(ValueError, match="moderation.check must be one of"):
        load(None, [*required, "moderation.check=everything"])
    with pytest.raises(ValidationError, match="moderation.check"):
        AppArgs.model_validate({"moderation": {"check": "everything"}})
    with pytest.raises(ValueError, match="unknown config key moderation.blocklst"):
        load(None, [*required, "moderation.blocklst=[zap]"])


# ---- the user callable ----------------------------------------------------------------------------------
def test_the_callable_blocks_with_its_reason_after_the_blocklist():
    check = moderator("zap", callable=POLICY)
    assert check.calls_user_code
    assert check.check_completion("short") is None
    assert check.check_completion("a much longer text") == Verdict("completion", "completion over 8 characters")
    assert check.check_prompt("a much longer text") is None  # the policy only limits completions
    assert check.check_prompt("zap") == Verdict("prompt", "blocklist term 'zap'")


def test_a_callable_that_raises_or_answers_nonsense_blocks_and_is_logged(caplog: pytest.LogCaptureFixture):
    check = moderator(callable=POLICY)
    with caplog.at_level(logging.ERROR, logger="gpt2_platform.moderation"):
        assert check.check_prompt(f"please {helpers_moderation.EXPLODING_WORD}") == Verdict("prompt", MODERATION_ERROR)
    assert "helpers_moderation:policy raised on a prompt" in caplog.text and "the test policy failed" in caplog.text
    caplog.clear()
    nonsense = Moderator([], user_check=lambda text, kind: True, user_check_name="always_true")
    with caplog.at_level(logging.ERROR, logger="gpt2_platform.moderation"):
        assert nonsense.check_prompt("anything") == Verdict("prompt", MODERATION_ERROR)
    assert "always_true returned True" in caplog.text
    empty_reason = Moderator([], user_check=lambda text, kind: "", user_check_name="terse")
    assert empty_reason.check_prompt("anything") == Verdict("prompt", "blocked by terse")


def test_a_moderator_survives_pickling_as_it_is_shipped_to_replicas_and_actors():
    check = pickle.loads(pickle.dumps(moderator("zap", callable=POLICY)))
    assert check.check_prompt("ZAP") and check.check_completion("a much longer text") and not check.check_prompt("ok")


# ---- streaming -------------------------------------------------------------------------------------------
def feed_all(guard: CompletionGuard, pieces: list[str]) -> tuple[list[str], Verdict | None]:
    sent = []
    for i, piece in enumerate(pieces):
        text, verdict = guard.feed(piece, finished=i == len(pieces) - 1)
        if verdict is not None:
            return sent, verdict
        sent.append(text)
    return sent, None


def test_a_stream_holds_back_the_word_being_written_so_no_part_of_a_term_is_sent():
    sent, verdict = feed_all(CompletionGuard(moderator("zap")), ["one ", "z", "a", "p", " two", " three"])
    assert verdict == Verdict("completion", "blocklist term 'zap'")
    assert "".join(sent) == "one "  # 'z', 'a', 'p' were held back until the word ended, then blocked


def test_a_stream_releases_everything_at_the_end_and_a_longer_word_is_not_a_term():
    sent, verdict = feed_all(CompletionGuard(moderator("zap")), ["one ", "z", "a", "p", "ping", " t", "wo"])
    assert verdict is None
    assert sent == ["one ", "", "", "", "", "zapping ", "two"]
    sent, verdict = feed_all(CompletionGuard(moderator("zap")), ["one ", "zap"])  # a term at the very end
    assert verdict is not None and sent == ["one "]


def test_a_stream_sends_no_word_of_a_blocked_phrase_before_the_phrase_completes():
    pieces = ["we ", "saw ", "a ", "forbidden", " ", "phrase", " here"]
    sent, verdict = feed_all(CompletionGuard(moderator("forbidden phrase", "zap")), pieces)
    assert verdict == Verdict("completion", "blocklist term 'forbidden phrase'")
    assert "".join(sent) == "we saw a "  # "forbidden" waited for the word after it, which completed the phrase


def test_a_stream_releases_the_held_words_once_no_phrase_can_complete():
    pieces = ["a ", "forbidden", " ", "fruit", " is", " sweet"]
    sent, verdict = feed_all(CompletionGuard(moderator("forbidden phrase")), pieces)
    assert verdict is None
    assert "".join(sent) == "a forbidden fruit is sweet"
    assert sent[:3] == ["", "", "a "]  # "a " waits until "forbidden" is whole: one more word could follow
    assert sent[3:5] == ["", "forbidden "]  # "forbidden" waits until "fruit" is whole and not "phrase"
