"""The bench's Node peer (bench/peer/, `PEER=sqs-consumer make bench`) installs only what its
committed lock pins: exact versions, an integrity hash for every package, and no `resolved`
URL (npm then takes the configured registry, and no registry host is written in the repo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PEER = Path(__file__).parents[2] / "bench" / "peer"


def lock_problems(package: dict[str, Any], lock: dict[str, Any]) -> list[str]:
    problems = []
    root = lock["packages"][""]
    if root.get("dependencies") != package["dependencies"]:
        problems.append("package-lock.json is not the lock of package.json's dependencies")
    for name, version in package["dependencies"].items():
        if not version[:1].isdigit():
            problems.append(f"{name} {version!r} is a range, not a pinned version")
        if lock["packages"].get(f"node_modules/{name}", {}).get("version") != version:
            problems.append(f"{name}: the lock does not hold {version}")
    for path, entry in lock["packages"].items():
        if not path:
            continue
        if "resolved" in entry:
            problems.append(f"{path}: has a resolved URL")
        if not str(entry.get("integrity", "")).startswith("sha512-"):
            problems.append(f"{path}: no sha512 integrity hash")
    return problems


def test_the_peer_lock_pins_hashes_and_no_urls() -> None:
    package = json.loads((PEER / "package.json").read_text())
    lock = json.loads((PEER / "package-lock.json").read_text())
    assert package["dependencies"]["sqs-consumer"] == "14.2.8"  # what issue 26 measured
    assert lock_problems(package, lock) == []
    assert "omit-lockfile-registry-resolved=true" in (PEER / ".npmrc").read_text().split()


def test_lock_problems_sees_a_url_a_missing_hash_and_a_range() -> None:
    package = {"dependencies": {"a": "^1.0.0"}}
    lock = {"packages": {"": {"dependencies": {"a": "^1.0.0"}},
                         "node_modules/a": {"version": "1.2.0", "resolved": "x"}}}
    assert lock_problems(package, lock) == [
        "a '^1.0.0' is a range, not a pinned version",
        "a: the lock does not hold ^1.0.0",
        "node_modules/a: has a resolved URL",
        "node_modules/a: no sha512 integrity hash",
    ]
