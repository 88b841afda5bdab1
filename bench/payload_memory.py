"""Raw bytes -> resident memory of one JSON payload on the daemon's path (issue 20): how many
bytes of RSS each raw byte of a message costs while it is in flight.

    .venv/bin/python bench/payload_memory.py            # 6 MiB payloads, every shape

For each shape (a base64 blob string, a list of small records, nested ``[]``) a fresh
process reads the raw bytes (as from S3), parses them as the daemon does
(``service.core.messages.parse``: orjson + the entity.upsert pydantic model + the canonical JSON
for the hash) and encodes the jsonb argument the handler sends (orjson), keeping every
intermediate alive, as a batch does until its commit. Reported: peak RSS growth (ru_maxrss)
over the raw size. The multiplier sizes INGEST_MAX_INFLIGHT_BYTES (README "Memory").
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = int(os.environ.get("PAYLOAD_BYTES", 6 * 2**20))


def build(shape: str, size: int) -> bytes:
    if shape == "blob":
        data: object = {"blob": "x" * size}
    elif shape == "records":
        rec = {"id": 123456, "name": "abcdefghij", "price": 12.5, "tags": ["a", "b"],
               "ok": True}
        one = len(json.dumps(rec)) + 2
        data = {"rows": [dict(rec, id=i) for i in range(size // one)]}
    elif shape == "nested":
        data = {"n": json.loads("[" + "[]," * (size // 3 - 1) + "[]]")}
    else:
        raise SystemExit(f"unknown shape {shape}")
    return json.dumps({"request_id": "r", "type": "entity.upsert", "payload": {
        "entity_id": "e", "version": 1, "data": data}}, separators=(",", ":")).encode()


def child(path: str) -> None:
    import orjson

    from service.core.messages import Message, Received, parse
    from service.core.pointers import Fetched, Pointer
    from service.handlers import default_registry, load_reference_handlers

    load_reference_handlers()
    parse(Received("m", "h", '{"request_id":"w","type":"entity.upsert","payload":{'
                   '"entity_id":"e","version":1,"data":{}}}'), default_registry)  # warm
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    data = bytearray(Path(path).read_bytes())  # what S3Payloads.fetch holds
    m = parse(Received("m", "h", "[]"), default_registry,
              Fetched(Pointer("b", "k"), data))
    assert isinstance(m, Message), m
    jsonb = orjson.dumps(m.payload_json["data"])  # the handler's argument
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"raw": len(data), "rss_growth": peak - before, "kept": len(jsonb) > 0}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    print(f"{'shape':<8} {'raw MiB':>8} {'RSS growth MiB':>15} {'multiplier':>10}")
    for shape in ("blob", "records", "nested"):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            f.write(build(shape, SIZE))
            f.flush()
            out = subprocess.run([sys.executable, __file__, "--child", f.name], check=True,
                                 capture_output=True, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{shape:<8} {r['raw'] / 2**20:>8.2f} {r['rss_growth'] / 2**20:>15.1f} "
              f"{r['rss_growth'] / r['raw']:>10.1f}")


if __name__ == "__main__":
    main()
