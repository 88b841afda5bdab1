"""Listeners bind loopback unless told otherwise: a laptop's `make run` (and the reconcile
sidecar's metrics) is not reachable from the network; the images choose 0.0.0.0 themselves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
BASE = {"INGEST_QUEUE_URL": "http://127.0.0.1:1/q", "INGEST_DATABASE_URL": "postgresql://u@h/d"}


def test_daemon_http_host_defaults_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INGEST_HTTP_HOST", raising=False)
    for k, v in BASE.items():
        monkeypatch.setenv(k, v)
    assert load_settings().http_host == "127.0.0.1"


def test_reconcile_sidecar_metrics_host_defaults_to_loopback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from service.reconcile.parser import build_parser

    monkeypatch.delenv("INGEST_RECONCILE_METRICS_HOST", raising=False)
    assert build_parser().parse_args([]).metrics_host == "127.0.0.1"
    monkeypatch.setenv("INGEST_RECONCILE_METRICS_HOST", "0.0.0.0")
    assert build_parser().parse_args([]).metrics_host == "0.0.0.0"
    assert build_parser().parse_args(["--metrics-host", "::1"]).metrics_host == "::1"


def _stage_env(text: str, stage: str) -> str:
    start = text.index(f" AS {stage}\n")
    end = text.find("\nFROM ", start)
    return text[start:] if end < 0 else text[start:end]


def test_images_bind_every_interface_in_their_own_environment() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^\s+INGEST_HTTP_HOST=0\.0\.0\.0\b", _stage_env(text, "runtime"), re.M)
    assert re.search(r"^\s+INGEST_RECONCILE_METRICS_HOST=0\.0\.0\.0\b",
                     _stage_env(text, "reconcile"), re.M)
