"""Probe: moto_server double-delivers under concurrent ReceiveMessage (no lock between its
visibility check and mark_received). 8 threads drain 5 queues of 200 messages; prints how
many messages were delivered twice. Measured 2026-11-26, moto 5.2.5: 4 of 1,000.
Why the dashboard test, which counts outcomes exactly, runs one poller."""
import boto3, subprocess, time, threading, collections, socket, sys
s=socket.socket(); s.bind(("127.0.0.1",0)); port=s.getsockname()[1]; s.close()
p=subprocess.Popen(["moto_server","-H","127.0.0.1","-p",str(port)],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
time.sleep(1.5)
c=boto3.client("sqs",endpoint_url=f"http://127.0.0.1:{port}",region_name="us-east-1",aws_access_key_id="x",aws_secret_access_key="x")
dups=0; total=0
for rnd in range(5):
    q=c.create_queue(QueueName=f"q{rnd}",Attributes={"VisibilityTimeout":"60"})["QueueUrl"]
    for i in range(0,200,10):
        c.send_message_batch(QueueUrl=q,Entries=[{"Id":str(j),"MessageBody":f"m{i+j}"} for j in range(10)])
    got=collections.Counter(); lock=threading.Lock()
    def rx():
        cl=boto3.client("sqs",endpoint_url=f"http://127.0.0.1:{port}",region_name="us-east-1",aws_access_key_id="x",aws_secret_access_key="x")
        while True:
            r=cl.receive_message(QueueUrl=q,MaxNumberOfMessages=10,WaitTimeSeconds=0).get("Messages",[])
            if not r: return
            with lock:
                for m in r: got[m["MessageId"]]+=1
    ts=[threading.Thread(target=rx) for _ in range(8)]
    [t.start() for t in ts]; [t.join() for t in ts]
    d=sum(1 for v in got.values() if v>1); dups+=d; total+=len(got)
    print(rnd, len(got), "delivered twice:", d)
p.terminate()
print("total", total, "dups", dups)
