"""--opening: how the coordinator's loop runs a speculating request's first round (and the in-process loop's)."""

from __future__ import annotations

import pytest

from coordinator.engine import RoundEngine
from specd.core.errors import InvalidArgument
from specd.core.rounds.spec import opening_for
from specd.serving.config import CoordinatorConfig


@pytest.mark.parametrize(
    ("kinds", "opening"),
    [
        ({"model"}, "beside"),
        ({"hybrid"}, "beside"),
        ({"model", "hybrid"}, "beside"),
        ({"ngram"}, "draft-first"),
        ({"suffix"}, "draft-first"),
        ({"model", "suffix"}, "draft-first"),  # replicas of both kinds: the cheap ones lose nothing
        (set(), "draft-first"),  # no draft answered yet
    ],
)
def test_auto_opens_beside_only_for_model_drafts(kinds: set[str], opening: str) -> None:
    assert opening_for(kinds) == opening


def test_the_setting_reaches_the_loop() -> None:
    def loop_opening(opening: str) -> str:
        engine = RoundEngine(CoordinatorConfig(opening=opening), None, None, None)  # type: ignore[arg-type]
        engine.stop_prompt_pool()
        return engine.loop.settings.opening

    assert loop_opening("beside") == "beside"
    assert loop_opening("draft-first") == "draft-first"
    assert loop_opening("auto") == "draft-first"  # until start() has seen the drafts
    with pytest.raises(InvalidArgument, match="opening"):
        CoordinatorConfig(opening="later").validate()
