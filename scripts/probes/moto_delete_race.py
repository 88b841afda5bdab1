"""Probe: moto_server's DeleteMessage rebuilds the queue's message list from a snapshot
without the lock SendMessage appends under (moto/sqs/models.py Queue.delete_message), so
concurrent deletes can bring a deleted message back ("ghost": redelivered after its
visibility timeout) and a send during a delete can be lost.

One standard queue, VisibilityTimeout 2 s; a sender sends MESSAGES in batches of ten while
RECEIVERS threads receive and delete everything; then the queue is read until quiet.
Prints: messages sent, distinct messages ever received (sent - received = lost), and
deliveries of a message after its delete succeeded (ghosts).

    .venv/bin/python scripts/probes/moto_delete_race.py [receivers] [messages]
"""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3

receivers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
total = int(sys.argv[2]) if len(sys.argv) > 2 else 400
s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1",
                         "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
url = f"http://127.0.0.1:{port}"


def client():  # type: ignore[no-untyped-def]
    return boto3.client("sqs", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x")


c = client()
for _ in range(100):
    try:
        c.list_queues()
        break
    except Exception:
        time.sleep(0.2)
try:
    q = c.create_queue(QueueName="d", Attributes={"VisibilityTimeout": "2"})["QueueUrl"]
    lock = threading.Lock()
    received: set[str] = set()
    deleted: set[str] = set()
    ghosts: list[str] = []
    sending = threading.Event()
    sending.set()
    last_seen = [time.monotonic()]

    def send() -> None:
        cl = client()
        for i in range(0, total, 10):
            cl.send_message_batch(QueueUrl=q, Entries=[
                {"Id": str(j), "MessageBody": f"m{i + j}"} for j in range(min(10, total - i))])
        sending.clear()

    def rx() -> None:
        cl = client()
        while sending.is_set() or time.monotonic() - last_seen[0] < 8:
            got = cl.receive_message(QueueUrl=q, MaxNumberOfMessages=10,
                                     WaitTimeSeconds=1).get("Messages", [])
            if not got:
                continue
            with lock:
                last_seen[0] = time.monotonic()
                for m in got:
                    if m["Body"] in deleted:
                        ghosts.append(m["Body"])
                    received.add(m["Body"])
            r = cl.delete_message_batch(QueueUrl=q, Entries=[
                {"Id": str(k), "ReceiptHandle": m["ReceiptHandle"]} for k, m in enumerate(got)])
            ok = {int(x["Id"]) for x in r.get("Successful", [])}
            with lock:
                deleted.update(got[k]["Body"] for k in ok)

    ts = [threading.Thread(target=rx) for _ in range(receivers)] + [threading.Thread(target=send)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
finally:
    proc.terminate()
    proc.wait(10)
print(f"receivers={receivers}: sent {total}, received {len(received)} distinct "
      f"(lost {total - len(received)}), ghost deliveries after a successful delete "
      f"{len(ghosts)}")
