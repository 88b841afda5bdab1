"""Probe: does moto_server keep a FIFO group locked while one of its messages is in flight
when several consumers receive at once? (SQS: "inflight messages block delivery of
available messages within the same message group".)

Each round: one FIFO queue, GROUPS groups of PER_GROUP messages sent in order; RECEIVERS
threads long-poll it (MaxNumberOfMessages=10, WaitTimeSeconds=1), hold what they got for
0-20 ms, then delete it. A *violation* is a message handed out while an earlier message of
its group (send order) was neither deleted nor in the same receive: SQS never does that.
Counted conservatively (a delete racing the check can hide one, never invent one).
A *double* is a message handed out while another consumer held it.

    .venv/bin/python scripts/probes/moto_fifo_group_order.py [plain|patched] [receivers]
        [rounds] [abandon: share of receives never deleted, e.g. 0.05]

plain = moto_server; patched = tests/moto_fifo.py (what the test suite starts).
"""
from __future__ import annotations

import collections
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3

GROUPS, PER_GROUP = 6, 40
mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
receivers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
# A receive abandoned (as by a consumer killed -9): its messages come back after the
# queue's visibility timeout, 2 s then instead of 60 s.
abandon = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
root = Path(__file__).resolve().parents[2]
cmd = ([sys.executable, str(root / "tests" / "moto_fifo.py")] if mode == "patched"
       else [str(Path(sys.executable).with_name("moto_server"))])
proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
url = f"http://127.0.0.1:{port}"


def client():  # type: ignore[no-untyped-def]
    return boto3.client("sqs", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x")


c = client()
for _ in range(100):
    try:
        c.list_queues()
        break
    except Exception:  # noqa: BLE001 - not up yet
        time.sleep(0.2)

total_v = total_d = total_n = 0
try:
    for rnd in range(rounds):
        q = c.create_queue(QueueName=f"g{rnd}.fifo", Attributes={
            "FifoQueue": "true", "VisibilityTimeout": "2" if abandon else "60"})["QueueUrl"]
        order = [(g, i) for i in range(PER_GROUP) for g in range(GROUPS)]  # interleaved
        for k in range(0, len(order), 10):
            c.send_message_batch(QueueUrl=q, Entries=[
                {"Id": str(j), "MessageBody": f"{g}:{i}", "MessageGroupId": f"g{g}",
                 "MessageDeduplicationId": f"{rnd}-{g}-{i}"}
                for j, (g, i) in enumerate(order[k:k + 10])])
        lock = threading.Lock()
        deleted: dict[int, set[int]] = collections.defaultdict(set)
        held: set[tuple[int, int]] = set()
        violations: list[tuple[int, int, int]] = []  # (group, index, earliest undeleted)
        doubles = 0
        done = threading.Event()

        def rx(seed: int) -> None:
            global doubles
            cl = client()
            r = random.Random(seed)
            while not done.is_set() and time.monotonic() < round_deadline:
                got = cl.receive_message(QueueUrl=q, MaxNumberOfMessages=10,
                                         WaitTimeSeconds=1).get("Messages", [])
                mine = [tuple(map(int, m["Body"].split(":"))) for m in got]
                with lock:
                    batch = set(mine)
                    for g, i in mine:
                        if (g, i) in held:
                            doubles += 1
                        undeleted = [j for j in range(i) if j not in deleted[g]
                                     and (g, j) not in batch]
                        if undeleted:
                            violations.append((g, i, undeleted[0]))
                        held.add((g, i))
                time.sleep(r.uniform(0, 0.02))
                if got and r.random() < abandon:
                    with lock:
                        held.difference_update(mine)
                    continue
                if got:
                    cl.delete_message_batch(QueueUrl=q, Entries=[
                        {"Id": str(k), "ReceiptHandle": m["ReceiptHandle"]}
                        for k, m in enumerate(got)])
                    with lock:
                        for g, i in mine:
                            deleted[g].add(i)
                            held.discard((g, i))
                        if sum(map(len, deleted.values())) == len(order):
                            done.set()

        round_deadline = time.monotonic() + 90
        ts = [threading.Thread(target=rx, args=(n,)) for n in range(receivers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        done.set()
        stuck = len(order) - sum(map(len, deleted.values()))
        if stuck:
            a = c.get_queue_attributes(QueueUrl=q, AttributeNames=["All"])["Attributes"]
            print(f"round {rnd}: {stuck} messages never deleted within 90 s (visible "
                  f"{a['ApproximateNumberOfMessages']}, in flight "
                  f"{a['ApproximateNumberOfMessagesNotVisible']}, held by a receiver {len(held)})")
        total_v += len(violations)
        total_d += doubles
        total_n += len(order)
        print(f"round {rnd}: {len(order)} messages, group-order violations {len(violations)}"
              f" {violations[:4]}, doubles {doubles}", flush=True)
finally:
    proc.terminate()
    proc.wait(10)
print(f"{mode} receivers={receivers} abandon={abandon}: {total_v} violations, {total_d} doubles"
      f" in {total_n} messages")
