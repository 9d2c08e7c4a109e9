# The latency one Braid hop adds: one subscriber on the shield, one on an
# edge that follows the shield; N writes (PUT) to the shield; the arrival
# time of each version on both streams. Loopback only; bounded by N.
import socket, time, sys, threading, http.client

SHIELD, EDGE = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200

def subscribe(addr, arrivals):
    host, port = addr.split(':')
    s = socket.create_connection((host, int(port)))
    s.sendall(b'GET /notes.txt HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n')
    buf = b''
    while True:
        d = s.recv(65536)
        if not d: return
        t = time.perf_counter()
        buf += d
        # every Version line seen for the first time
        while True:
            i = buf.find(b'Version: "')
            if i < 0: buf = buf[-16:]; break
            j = buf.find(b'"', i + 10)
            if j < 0: buf = buf[i:]; break
            arrivals.setdefault(buf[i+10:j].decode(), t); buf = buf[j:]

a_shield, a_edge = {}, {}
for addr, arr in ((SHIELD, a_shield), (EDGE, a_edge)):
    threading.Thread(target=subscribe, args=(addr, arr), daemon=True).start()
time.sleep(1)
h, p = SHIELD.split(':')
sent = {}
for n in range(N):
    c = http.client.HTTPConnection(h, int(p))
    sent[n] = time.perf_counter()
    c.request('PUT', '/notes.txt', body=f'some text, edit-{n}.')
    c.getresponse().read(); c.close()
    time.sleep(0.02)
time.sleep(1)
common = [v for v in a_edge if v in a_shield]
hop = sorted((a_edge[v] - a_shield[v]) * 1000 for v in common)
q = lambda xs, f: xs[min(len(xs)-1, int(f * len(xs)))]
print(f"updates {N}: seen at shield {len(a_shield)}, at edge {len(a_edge)}, both {len(common)}")
print(f"shield subscriber -> edge subscriber (the added hop): p50 {q(hop,.5):.2f} ms p99 {q(hop,.99):.2f} ms max {hop[-1]:.2f} ms")
