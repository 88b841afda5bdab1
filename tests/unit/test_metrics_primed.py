"""Every labelled series exists at 0 from start-up (issue 24): ``increase()``/``rate()`` cannot
see the first increment of a series born inside the window, and a dashboard panel over a
series that does not exist yet is empty. The expected label values come from the code's one
source, ``service.core.labels``; the call sites that count are read from the source (AST)."""

from __future__ import annotations

import ast
from itertools import product
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from service.core import labels
from service.observe import metrics

SERVICE = Path(metrics.__file__).parents[1]  # service/, not service/observe/
TYPES = ["entity.upsert", "entity.delete", "x.custom"]

#: metric attribute in service.observe.metrics -> the label values it can take, per label, from
#: service.core.labels (messages_processed's type: the registered types + the invalid label).
EXPECTED: dict[str, list[tuple[str, ...]]] = {
    "messages_processed": [(*TYPES, labels.INVALID_TYPE_LABEL), labels.OUTCOMES],
    "dead_letters": [labels.DEAD_LETTER_REASONS],
    "sqs_errors": [labels.SQS_OPERATIONS],
    "aws_requests": [("sqs",), labels.SQS_LOOP_ACTIONS],
    "results_published": [labels.RESULT_STATUSES],
    "pruned_rows": [labels.PRUNED_TABLES],
    "s3_fetches": [labels.FETCH_OUTCOMES],
    "s3_errors": [labels.ERROR_KINDS],
    "s3_deletes": [labels.DELETE_OUTCOMES],
}


def labelled() -> dict[str, MetricWrapperBase]:
    return {name: obj for name, obj in vars(metrics).items()
            if isinstance(obj, MetricWrapperBase) and obj._labelnames}


def series(obj: MetricWrapperBase) -> set[tuple[str, ...]]:
    """Label-value tuples of the series the metric exposes now."""
    return {tuple(s.labels[n] for n in obj._labelnames)
            for fam in obj.collect() for s in fam.samples
            if not s.name.endswith("_created")}


def test_every_labelled_series_exists_at_start_with_every_value_the_code_emits() -> None:
    metrics.prime(TYPES)
    got = {name: series(obj) for name, obj in labelled().items()}
    assert set(got) == set(EXPECTED), "a labelled metric without its label set here"
    for name, values in EXPECTED.items():
        assert got[name] >= set(product(*values)), f"{name}: not primed: " \
            f"{sorted(set(product(*values)) - got[name])}"


def _label_calls() -> list[tuple[str, str, int, list[ast.expr]]]:
    """(metric, file, line, args) of every ``metrics.<name>.labels(...)`` in service/."""
    calls = []
    for path in SERVICE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "labels"
                    and isinstance(node.func.value, ast.Attribute)
                    and isinstance(node.func.value.value, ast.Name)
                    and node.func.value.value.id == "metrics"):
                calls.append((node.func.value.attr, path.name, node.lineno, node.args))
    return calls


def test_every_literal_label_value_in_the_code_is_in_the_primed_set() -> None:
    """A value written at a call site (``sqs_errors.labels("receive")``) must be one that
    start-up creates; values passed in variables are typed by service.core.labels' Literal
    aliases (mypy strict)."""
    calls = _label_calls()
    counted = {c[0] for c in calls}
    assert {"sqs_errors", "messages_processed", "dead_letters"} <= counted  # the scan works
    assert counted <= set(EXPECTED), f"counted but not checked: {counted - set(EXPECTED)}"
    stray = []
    for name, file, line, args in calls:
        for i, arg in enumerate(args):
            if isinstance(arg, ast.Constant) and arg.value not in EXPECTED[name][i]:
                stray.append(f"{file}:{line} {name}.labels(... {arg.value!r} ...)")
    assert not stray, "label values start-up does not create: " + "; ".join(stray)
