"""Content moderation of prompts and completions: a blocklist, and optionally a user-supplied callable.

One `ModerationConfig` serves both flows: the batch job's YAML (`moderation:`, a dataclass like the
rest of its config) and the Serve app's `args.moderation` (pydantic validates the same dataclass).
`build_moderator` turns it into a `Moderator` once, at start-up, where bad settings raise a ValueError
naming the field; the Moderator (compiled blocklist, imported callable) is then shipped to the replicas
or actors.

Blocklist rule: a term matches case-insensitively, as a whole word or phrase. Its ends must not touch
another letter, digit or underscore, so "ass" does not match "class" and "zap" does not match "zapping";
whitespace inside a term matches any run of whitespace. Terms are compared as given (no stemming, no
Unicode normalization): list every form to block.

The callable, "package.module:function", is called as `function(text, kind)` with kind "prompt" or
"completion" and returns None to allow the text or a reason (a string) to block it. It fails closed:
if it raises or returns anything else, the text is blocked with the reason "moderation error" and the
traceback is logged, so a broken classifier never lets text through nor takes a replica down. It may
run on several threads at once (Serve calls it off the event loop; a batch actor works on several batches),
so it must be thread-safe. On a stream it is called with the text so far at each step, then the whole text.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpt2_platform.config_loader import ConfigError

logger = logging.getLogger(__name__)

Kind = Literal["prompt", "completion"]
UserCheck = Callable[[str, Kind], "str | None"]
MODERATION_ERROR = "moderation error"
"""The reason given when the user callable failed (fail closed)."""
CONTENT_FILTER = "content_filter"
"""The finish_reason of a completion withheld by moderation (OpenAI's value)."""

_TRAILING_WORD = re.compile(r"\S*\Z")
_LAST_WORD = re.compile(r"\S*\s*\Z")  # searched up to an end position: the last whole word before it


@dataclass
class ModerationConfig:
    enabled: bool = False
    """Check prompts and/or completions; off by default (the other fields are then ignored)."""
    check: Literal["prompt", "completion", "both"] = "both"
    """What to check: prompts (refused before generation), completions (withheld), or both."""
    blocklist: list[str] = field(default_factory=list)
    """Words or phrases to block, matched case-insensitively on word boundaries."""
    blocklist_file: str | None = None
    """A UTF-8 file of more terms, one per line; blank lines and lines starting with '#' are skipped."""
    callable: str | None = None
    """'package.module:function' called as f(text, kind) -> reason or None; must import where the job runs."""

    def __post_init__(self) -> None:
        if any(not isinstance(term, str) or not term.strip() for term in self.blocklist):
            raise ConfigError("moderation.blocklist holds an empty term; remove it")
        if self.blocklist_file is not None and not self.blocklist_file.strip():
            raise ConfigError("moderation.blocklist_file is empty; set a path or null")
        if self.callable is not None:
            module, _, name = self.callable.partition(":")
            if not module or not name:
                raise ConfigError(
                    f"moderation.callable must look like 'package.module:function', got {self.callable!r}"
                )
        if self.enabled and not (self.blocklist or self.blocklist_file or self.callable):
            raise ConfigError(
                "moderation.enabled is true but there is nothing to check with; "
                "set moderation.blocklist, moderation.blocklist_file or moderation.callable"
            )


@dataclass(frozen=True)
class Verdict:
    """Why a text was blocked."""

    kind: Kind
    reason: str


class Blocklist:
    """Terms compiled into one case-insensitive regular expression with word-boundary guards."""

    def __init__(self, terms: list[str]) -> None:
        # Normalized (lower case, single spaces) -> the term as configured, for the reason.
        self.terms = {_normalize(term): term.strip() for term in terms}
        self.max_words = max((len(term.split()) for term in self.terms), default=0)
        # Longest first, so that of two terms starting at the same place the longer one is reported.
        alternatives = "|".join(
            r"\s+".join(re.escape(word) for word in term.split()) for term in sorted(self.terms, key=len, reverse=True)
        )
        # A term ends the text only where no letter follows: at the true end (final) or before a non-word
        # character. While a completion is still streaming, a term at the end may yet grow ("zap" -> "zapping").
        self._final = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE) if self.terms else None
        self._partial = re.compile(rf"(?<!\w)(?:{alternatives})(?=\W)", re.IGNORECASE) if self.terms else None

    def find(self, text: str, final: bool = True) -> str | None:
        """The configured term that `text` contains, or None; `final=False` skips a term the text ends with."""
        pattern = self._final if final else self._partial
        match = pattern.search(text) if pattern is not None else None
        return None if match is None else self.terms[_normalize(match.group())]

    def __len__(self) -> int:
        return len(self.terms)


def _normalize(term: str) -> str:
    return " ".join(term.casefold().split())


class Moderator:
    """Checks texts against a blocklist and an optional user callable; build it with `build_moderator`."""

    def __init__(
        self,
        terms: list[str],
        check: Literal["prompt", "completion", "both"] = "both",
        user_check: UserCheck | None = None,
        user_check_name: str | None = None,
    ) -> None:
        self.blocklist = Blocklist(terms)
        self.checks_prompts = check in ("prompt", "both")
        self.checks_completions = check in ("completion", "both")
        self.user_check = user_check
        self.user_check_name = user_check_name or getattr(user_check, "__qualname__", repr(user_check))

    @property
    def calls_user_code(self) -> bool:
        """Whether checks run the user callable (which may be slow: callers on an event loop use a thread)."""
        return self.user_check is not None

    def check_prompt(self, text: str) -> Verdict | None:
        """A Verdict if the prompt is blocked; None if it is allowed or prompts are not checked."""
        return self._check(text, "prompt", final=True) if self.checks_prompts else None

    def check_completion(self, text: str, final: bool = True) -> Verdict | None:
        """A Verdict if the completion is blocked; `final=False` for the text so far of a streaming one."""
        return self._check(text, "completion", final) if self.checks_completions else None

    def identity(self) -> dict[str, object]:
        """What decides the verdicts (a batch output's rows depend on it): the mode, the terms' hash, the callable."""
        terms = "\n".join(sorted(self.blocklist.terms)).encode()
        return {
            "prompts": self.checks_prompts,
            "completions": self.checks_completions,
            "blocklist_sha256": hashlib.sha256(terms).hexdigest(),
            "callable": self.user_check_name if self.user_check is not None else None,
        }

    def _check(self, text: str, kind: Kind, final: bool) -> Verdict | None:
        term = self.blocklist.find(text, final)
        if term is not None:
            return Verdict(kind, f"blocklist term {term!r}")
        if self.user_check is None:
            return None
        try:
            reason = self.user_check(text, kind)
        except Exception:  # fail closed: a broken classifier blocks, and must not take the replica down
            logger.exception("moderation callable %s raised on a %s; blocking it", self.user_check_name, kind)
            return Verdict(kind, MODERATION_ERROR)
        if reason is None:
            return None
        if not isinstance(reason, str):
            logger.error(
                "moderation callable %s returned %r for a %s, not a reason (str) or None; blocking it",
                self.user_check_name,
                reason,
                kind,
            )
            return Verdict(kind, MODERATION_ERROR)
        return Verdict(kind, reason or f"blocked by {self.user_check_name}")


class CompletionGuard:
    """Moderates one streamed completion: releases its text only as far as checks have passed on it.

    The word still being written (the text after the last whitespace) is held back until it ends, and
    so are as many whole words before it as the longest blocklist phrase has words after its first: a
    blocked term or phrase is never sent, not even in part. (A user callable's phrases are unknown to
    the guard; for those, only the word being written is held back.)
    """

    def __init__(self, moderator: Moderator) -> None:
        self.moderator = moderator
        self.hold_words = max(moderator.blocklist.max_words - 1, 0)
        self.text = ""
        self.num_released = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, Verdict | None]:
        """Add the next piece; return the text now safe to send ('' while held back), or '' and the Verdict."""
        self.text += delta
        verdict = self.moderator.check_completion(self.text, final=finished)
        if verdict is not None:
            return "", verdict
        end = len(self.text) if finished else self._safe_end()
        released, self.num_released = self.text[self.num_released : end], max(end, self.num_released)
        return released, None

    def _safe_end(self) -> int:
        """Where the text that no later word can still turn into a blocked phrase ends."""
        # Both patterns match (at worst the empty string) at the end of any text.
        trailing = _TRAILING_WORD.search(self.text)
        assert trailing is not None
        end = trailing.start()
        for _ in range(self.hold_words):
            last = _LAST_WORD.search(self.text, 0, end)
            assert last is not None
            end = last.start()
        return end


def read_blocklist_file(path: str) -> list[str]:
    """The terms of a blocklist file; ConfigError naming moderation.blocklist_file if it cannot be read."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(
            f"moderation.blocklist_file {path!r} does not exist; fix the path or set it to null"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"moderation.blocklist_file {path!r} cannot be read as UTF-8 text: {error}") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def import_callable(spec: str) -> UserCheck:
    """The function named by 'package.module:function'; ConfigError naming moderation.callable if it is not one."""
    module_name, _, attribute = spec.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"moderation.callable {spec!r}: cannot import {module_name!r} ({error}); it must be importable "
            "wherever the job runs (installed, or in the job's working_dir)"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"moderation.callable {spec!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"moderation.callable {spec!r} is a {type(target).__name__}, not a function")
    return target  # type: ignore[return-value]


def build_moderator(config: ModerationConfig) -> Moderator | None:
    """The Moderator the config describes (None when disabled): reads the file and imports the callable now."""
    if not config.enabled:
        return None
    terms = list(config.blocklist)
    if config.blocklist_file is not None:
        terms += read_blocklist_file(config.blocklist_file)
    user_check = import_callable(config.callable) if config.callable is not None else None
    moderator = Moderator(terms, config.check, user_check, config.callable)
    logger.info(
        "moderation on (%s): %d blocklist terms, callable %s", config.check, len(moderator.blocklist), config.callable
    )
    return moderator
