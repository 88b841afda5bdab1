"""The reference batch handler's rounds: each entity's k-th message of a batch in round k,
batch order kept within a round (service.handlers.entities._rounds)."""

from service.handlers.entities import _rounds


def test_distinct_entities_are_one_round() -> None:
    assert _rounds(["a", "b", "c"]) == [[0, 1, 2]]


def test_an_entity_written_again_waits_for_the_next_round() -> None:
    assert _rounds(["a", "b", "a", "c", "a", "b"]) == [[0, 1, 3], [2, 5], [4]]


def test_one_entity_only_is_one_by_one_in_order() -> None:
    assert _rounds(["x"] * 4) == [[0], [1], [2], [3]]


def test_no_items_no_rounds() -> None:
    assert _rounds([]) == []
