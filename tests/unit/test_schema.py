"""`sqs-ingest schema` / `sqs-ingest handlers` (SPEC §6): a producer validates a body against
the printed schema before sending it; a body the schema accepts is one the daemon accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from service.core.messages import Message, Received, parse
from service.handlers import Registry, default_registry, load_reference_handlers
from service.ops.produce import sample_bodies
from service.ops.schema import document

ROOT = Path(__file__).resolve().parents[2]

HANDLERS_MODULE = """
from pydantic import BaseModel, Field
from service.handlers import handler

class Invoice(BaseModel):
    invoice_id: str
    amount_cents: int = Field(ge=0)
    lines: list[str] = []

@handler("invoice.created.schematest", Invoice)
async def invoice_created(payload, conn):
    return None
"""


def _cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "schematest_handlers.py").write_text(textwrap.dedent(HANDLERS_MODULE))
    env = {k: v for k, v in os.environ.items()
           if k not in ("INGEST_QUEUE_URL", "INGEST_DATABASE_URL")}
    env |= {"INGEST_HANDLERS": "schematest_handlers",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "service", *args], capture_output=True,
                          text=True, env=env, timeout=60, check=False)


def _validator(doc: dict[str, object]) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(doc)  # the document is itself valid
    return jsonschema.Draft202012Validator(
        doc, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_schema_command_validates_a_sample_and_rejects_wrong_bodies(tmp_path: Path) -> None:
    out = _cli("schema", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    v = _validator(json.loads(out.stdout))  # one JSON document on stdout, nothing else
    good = {"request_id": "r-1", "type": "invoice.created.schematest",
            "sent_at": "2026-01-02T03:04:05Z",
            "payload": {"invoice_id": "i-1", "amount_cents": 120, "lines": ["a"]}}
    assert list(v.iter_errors(good)) == []
    upsert = {"request_id": "r-2", "type": "entity.upsert",
              "payload": {"entity_id": "e1", "version": 3, "data": {}}}
    assert list(v.iter_errors(upsert)) == []
    wrong = [
        {**good, "payload": {"invoice_id": "i-1", "amount_cents": -1}},  # the model's ge=0
        {**good, "payload": {"invoice_id": "i-1"}},  # required field of the user model
        {**good, "payload": {"entity_id": "e1", "version": 3, "data": {}}},  # another model
        {**upsert, "payload": {"entity_id": "e1", "version": "three", "data": {}}},
        {**good, "type": "invoice.deleted"},  # not registered: unknown_type
        {k: v for k, v in good.items() if k != "request_id"},
        {**good, "request_id": ""},
        {**good, "payload": [1]},
        {**good, "sent_at": "yesterday"},
    ]
    for body in wrong:
        assert list(v.iter_errors(body)), body


def test_handlers_command_lists_the_registered_types(tmp_path: Path) -> None:
    out = _cli("handlers", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    types = [line.split()[0] for line in out.stdout.splitlines()]
    assert types == ["entity.delete", "entity.upsert", "invoice.created.schematest"]
    assert "model=schematest_handlers.Invoice" in out.stdout


def test_a_handlers_module_that_cannot_import_exits_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    out = subprocess.run([sys.executable, "-m", "service", "schema"], capture_output=True,
                         text=True, env={**env, "INGEST_HANDLERS": "no_such_module_xyz"},
                         cwd=ROOT, timeout=60, check=False)
    assert out.returncode == 2 and out.stdout == ""
    assert "INGEST_HANDLERS" in out.stderr and len(out.stderr.splitlines()) == 1


def _is_json(body: str) -> bool:
    try:
        json.loads(body)
    except json.JSONDecodeError:
        return False  # the samples' invalid_json body: a schema validates documents only
    return True


BODIES = [
    *filter(_is_json, sample_bodies(30, seed=3)),
    '{"request_id": "a", "type": "entity.upsert", "payload": {"entity_id": "x", "version": 1}}',
    '{"request_id": "a", "type": "entity.upsert", '
    '"payload": {"entity_id": "x", "version": 9223372036854775808, "data": {}}}',
    '{"request_id": "a", "type": "entity.delete", "payload": {"entity_id": "x", "version": 1.5}}',
    '{"request_id": "a", "type": "entity.delete", "payload": {"entity_id": 7, "version": 1}}',
    '{"request_id": "' + "r" * 513 + '", "type": "entity.delete", '
    '"payload": {"entity_id": "x", "version": 1}}',
    '{"request_id": "a\\u0000", "type": "entity.delete", '
    '"payload": {"entity_id": "x", "version": 1}}',
    '{"request_id": "a\\u0001", "type": "entity.delete", '
    '"payload": {"entity_id": "x", "version": 1}}',
    '{"request_id": "a\\uffff", "type": "entity.delete", '
    '"payload": {"entity_id": "x", "version": 1}}',
    '{"request_id": "a\\t\\ud83d\\ude00\\ufffd", "type": "entity.delete", '
    '"payload": {"entity_id": "x", "version": 1}}',
    '{"request_id": "a", "type": "entity.delete", "payload": {"entity_id": "x", "version": 1},'
    ' "sent_at": null}',
    '{"request_id": "a", "type": "", "payload": {}}',
    '[1, 2]',
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_schema_agrees_with_the_daemon_parser(body: str) -> None:
    """For every body a producer could send, the schema's verdict is parse()'s verdict."""
    load_reference_handlers()
    registry = Registry()
    for t in default_registry.types():
        spec = default_registry.get(t)
        assert spec is not None
        registry.register(t, spec.model, spec.fn)
    doc = json.loads(body)
    if isinstance(doc, dict) and doc.get("Type") == "Notification":
        doc = json.loads(doc["Message"])  # the schema covers the unwrapped message
        body = json.dumps(doc)
    accepted = isinstance(parse(Received("m", "h", body), registry), Message)
    v = _validator(json.loads(json.dumps(document(registry))))
    assert (not list(v.iter_errors(doc))) == accepted, body
