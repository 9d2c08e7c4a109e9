#!/usr/bin/env bash
# Checks the deploy files the way a machine without images or a running
# systemd can: nginx.conf with `nginx -t` (Debian's nginx), the systemd
# unit with `systemd-analyze verify`, the sample TOML by starting the
# proxy with it. The Dockerfile's steps are checked by tests/operations.rs
# (no image can be pulled here). .ci/run runs this; so can you:
#   examples/deploy/check.sh target/debug/braid-proxy
set -euo pipefail
binary=$(realpath "${1:?usage: check.sh BINARY}")
here=$(cd "$(dirname "$0")" && pwd)
for tool in nginx systemd-analyze openssl; do
  command -v "$tool" >/dev/null || { echo "check: $tool is required but not installed" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'kill "${proxy:-}" 2>/dev/null || true; rm -rf "$work"' EXIT

# nginx.conf is a server block for the http context (conf.d/); it names
# its certificate under /etc/ssl/braid-proxy/, replaced here by a
# throwaway one.
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=docs.example.com \
  -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null
sed -e "s|/etc/ssl/braid-proxy/fullchain.pem|$work/cert.pem|" \
    -e "s|/etc/ssl/braid-proxy/privkey.pem|$work/key.pem|" \
    "$here/nginx.conf" >"$work/site.conf"
cat >"$work/nginx.conf" <<EOF
pid $work/nginx.pid;
error_log stderr;
events {}
http {
    access_log off;
    include $work/site.conf;
}
EOF
nginx -t -q -p "$work" -e stderr -c "$work/nginx.conf"
echo "check: nginx.conf passes nginx -t ($(nginx -v 2>&1))"

# The unit, with ExecStart pointing at the binary under test.
sed "s|/usr/local/bin/braid-proxy|$binary|" "$here/braid-proxy.service" >"$work/braid-proxy.service"
said=$(systemd-analyze verify "$work/braid-proxy.service" 2>&1) || { echo "$said" >&2; exit 1; }
# It exits 0 on directives it ignores; anything it says is a fault.
if [ -n "$said" ]; then
  echo "check: systemd-analyze verify: $said" >&2
  exit 1
fi
echo "check: braid-proxy.service passes systemd-analyze verify"

# The sample configuration starts the proxy (on free ports: flags override
# the file).
"$binary" --config "$here/braid-proxy.toml" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
  >"$work/banner" 2>"$work/log" &
proxy=$!
for _ in $(seq 100); do
  grep -q "listening on" "$work/banner" && break
  kill -0 "$proxy" 2>/dev/null || break
  sleep 0.1
done
if ! grep -q "listening on" "$work/banner"; then
  echo "check: the proxy did not start with the sample configuration:" >&2
  cat "$work/log" >&2
  exit 1
fi
kill "$proxy"
wait "$proxy" 2>/dev/null || true
echo "check: the sample braid-proxy.toml starts the proxy"
