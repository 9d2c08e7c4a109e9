# Idle subscription RSS: open N subscriptions, read their first update, then
# compare the proxy's VmRSS before and after.
import socket, sys, time, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
addr, pid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def rss():
    for line in open(f'/proc/{pid}/status'):
        if line.startswith('VmRSS'): return int(line.split()[1])
host, port = addr.split(':')
# warm up: a few subscriptions so the resource exists
warm = []
for i in range(10):
    s = socket.create_connection((host, int(port))); s.sendall(b'GET /notes.txt HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n'); s.recv(65536); warm.append(s)
time.sleep(1)
before = rss()
socks = []
for i in range(n):
    s = socket.create_connection((host, int(port)))
    s.sendall(b'GET /notes.txt HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n')
    socks.append(s)
for s in socks:
    s.settimeout(10); s.recv(65536)
time.sleep(2)
after = rss()
print(f"{n} idle subscriptions: RSS {before} KiB -> {after} KiB, {(after-before)/n:.1f} KiB each")
